"""tests/qerl_trl fixtures: single-threaded torch, and a tiny random chat checkpoint with the offline model's tokenizer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core box are fastest single-threaded (see tests/aqn/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, offline_model_path):
    """A tiny random Llama (vocab of SmolLM2's tokenizer) saved with that tokenizer: a complete chat checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_model_path)
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=len(tok), max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_dir(tiny_dir, tmp_path_factory):
    """``tiny_dir`` whose tokenizer has no chat template, as a base (not instruct) model's."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(tiny_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
