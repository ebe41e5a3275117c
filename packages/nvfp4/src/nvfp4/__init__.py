"""NVFP4 weight-only quantization."""
