# THERE, in a call that carries .carry/kern (made HERE by `bash benchmarks/vllm_gpu/fetch.sh --kernels`), from the
# repository root:
#     source benchmarks/vllm_gpu/kernels_env.sh
# Kernel tests and gemm.py on the image's python without vLLM: installs Humming 0.1.19, pyelftools and pytest into
# /tmp/kern once per warm machine, puts them and this checkout's packages on PYTHONPATH. QERL_COMMIT: pass it in the
# command (the device's copy of the tree has no .git).
if [ ! -f /tmp/kern/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kern .carry/kern/*.whl && touch /tmp/kern/.ok \
    || { echo "kernels_env.sh: no .carry/kern in this call: carry it" >&2; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="/tmp/kern:$PWD/packages/nvfp4/src:$PWD/packages/aqn/src:$PWD/packages/qerl-trl/src:$PWD/integrations/vllm/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
