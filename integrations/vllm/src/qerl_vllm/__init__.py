"""vLLM integration for QeRL (never imported by ``nvfp4``)."""
