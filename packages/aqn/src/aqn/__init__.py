"""Adaptive Quantization Noise."""
