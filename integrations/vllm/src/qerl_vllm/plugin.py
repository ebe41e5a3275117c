"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts."""


def register() -> None:
    """Register the ``nvfp4_w4a16`` quantization config with vLLM (idempotent)."""
    from . import quant  # noqa: F401  (the decorator registers on import)
