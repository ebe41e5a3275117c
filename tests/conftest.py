"""Shared fixtures: the offline default model (converted once per machine) and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_config

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def offline_model_path() -> Path:
    from nvfp4.offline import offline_default_model_path

    return offline_default_model_path()


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.skip(f"GSM8K not found at {GSM8K_DIR}")
    return GSM8K_DIR


@pytest.fixture
def tiny_model_dir(tmp_path, request) -> Path:
    """A tiny random bf16 checkpoint folder (arch from the test's param, default llama)."""
    from transformers import AutoModelForCausalLM

    arch = getattr(request, "param", "llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / arch)
    return tmp_path / arch
