# THERE, in each call after install.sh finished on this warm machine, from the repository root:
#     source benchmarks/vllm_gpu/env.sh
# Puts the carried wheels (/tmp/vllm_site) and this checkout's packages on PYTHONPATH; keeps NVLink multicast off
# (KINDS.md) and everything offline.
if [ ! -f "${VLLM_SITE:-/tmp/vllm_site}/.qerl-install-ok" ]; then
  echo "env.sh: no finished install in ${VLLM_SITE:-/tmp/vllm_site} (a fresh machine?): run the install calls first" >&2
  return 1 2>/dev/null || exit 1
fi
export PYTHONPATH="${VLLM_SITE:-/tmp/vllm_site}:$PWD/packages/nvfp4/src:$PWD/packages/aqn/src:$PWD/packages/qerl-trl/src:$PWD/integrations/vllm/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 QERL_CACHE="${QERL_CACHE:-/tmp/qerl-cache}"
# vLLM 0.26's GPU sampler imports flashinfer unless told not to (ModuleNotFoundError: we carry no flashinfer)
export VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
