"""``qerl eval --engine vllm`` on the real CPU engine: same scores as the transformers path, and the adapter counts."""

from __future__ import annotations

import json

import pytest
import torch
from vllm_test_helpers import ENGINE_DTYPE, nvfp4_offline_checkpoint

ARGS = ["--task", "arithmetic", "--split", "test", "--limit", "8", "--greedy", "--max-new-tokens", "8",
        "--no-progress", "--dtype", ENGINE_DTYPE]  # fmt: skip
# greedy completions equal between the engines, of 8: float32 (CPU) all but a near-tie; bf16 (CUDA) parts at more
# near-ties (6 of 8 on the H100, 2026-11-27)
MIN_SAME, MAX_PASS_GAP = (7, 1 / 8) if ENGINE_DTYPE == "float32" else (5, 2 / 8)


@pytest.fixture(scope="module")
def ckpt():
    return nvfp4_offline_checkpoint()


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory):
    """A LoRA adapter with large random B (PEFT's default B = 0 would change nothing), saved like a trained one."""
    import nvfp4  # noqa: F401
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig

    model = nvfp4.load_nvfp4_checkpoint(ckpt, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    # A and B both from a seeded generator (PEFT draws A from the global RNG: the adapter's effect changed from run to
    # run, and B at 0.05 changed 3 of the 8 greedy completions on the H200, 2026-12-01); B at 0.2 moves most of them
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    path = tmp_path_factory.mktemp("adapter") / "random-lora"
    peft.save_pretrained(path)
    return path


def _eval(ckpt, out, *extra):
    from qerl_trl.evaluation import main

    main(["--model", str(ckpt), *ARGS, "--output", str(out), *extra])
    return json.loads((out / "eval.json").read_text())


def test_vllm_eval_matches_transformers_and_the_adapter_changes_it(ckpt, adapter, tmp_path):
    hf = _eval(ckpt, tmp_path / "hf")
    ours = _eval(ckpt, tmp_path / "vllm", "--engine", "vllm")
    assert ours["settings"]["engine"] == "vllm" and hf["settings"]["engine"] == "transformers"
    same = sum(a["completions"] == b["completions"] for a, b in zip(hf["records"], ours["records"]))
    assert same >= MIN_SAME, (same, [r["completions"] for r in hf["records"]], [r["completions"] for r in ours["records"]])
    assert abs(hf["metrics"]["pass@1"] - ours["metrics"]["pass@1"]) <= MAX_PASS_GAP

    tuned = _eval(ckpt, tmp_path / "vllm-adapter", "--engine", "vllm", "--adapter", str(adapter))
    changed = sum(a["completions"] != b["completions"] for a, b in zip(ours["records"], tuned["records"]))
    assert changed >= 4, "the adapter did not reach the vLLM engine's generations"
    assert tuned["settings"]["adapter"]  # verified loaded into the HF copy as well


def test_vllm_eval_engine_takes_an_adapter_of_rank_above_64(ckpt, tmp_path):
    """``qerl eval --engine vllm --adapter A`` with A of rank 128 (``qerl train --lora_r 128`` syncs such adapters):
    the engine is built for the adapter's rank (vLLM's bucket), not a fixed 64 that refused it after the engine had
    started (and left that engine open)."""
    import nvfp4
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig
    from qerl_trl.quantization import get_scheme
    from qerl_trl.rollout.vllm import VLLMRollout

    model = nvfp4.load_nvfp4_checkpoint(ckpt, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=128, lora_alpha=16, target_modules=["q_proj"]))
    adapter = tmp_path / "rank-128"
    peft.save_pretrained(adapter)
    engine = VLLMRollout.evaluation_generator(str(ckpt), peft, get_scheme("none"), seed=0, dtype=ENGINE_DTYPE,
                                              adapter=str(adapter))  # fmt: skip
    try:
        assert engine.max_lora_rank == 128 and engine.lora_request is not None
    finally:
        engine.close()
