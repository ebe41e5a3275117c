"""``qerl_trl.rollout.graph.attention``: the split-KV decode kernels against the plain PyTorch reference (Triton interpreter
on CPU, fp16/fp32; bf16 at a 7B shape on the GPU), inside ``graph_generate`` against SDPA, and input validation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from qerl_trl.rollout.graph.attention import decode_attention, decode_attention_reference
from triton_interpreter import run_under_interpreter

TESTS = Path(__file__).resolve().parents[1]

_INTERP = textwrap.dedent(
    """
    import json
    import torch
    import qerl_trl.rollout.graph.attention as da
    from test_graph_generate import _model, _prompts
    from qerl_trl.rollout.graph.generate import graph_generate

    da.POISON_OUTPUTS = True
    out = []
    torch.manual_seed(0)
    # (B, H, Hkv, L, D, dtype): GQA groups 1/4/7, L not a multiple of the 64-slot block, several splits
    for b, h, hkv, length, d, dt in [(2, 7, 1, 200, 64, torch.float16), (3, 8, 2, 130, 32, torch.float32),
                                     (1, 4, 4, 64, 16, torch.float32), (2, 28, 4, 1280, 128, torch.float16),
                                     (1, 4, 1, 2600, 16, torch.float32)]:  # 41 splits
        q = torch.randn(b, h, 1, d, dtype=dt)
        k, v = torch.randn(b, hkv, length, d, dtype=dt), torch.randn(b, hkv, length, d, dtype=dt)
        keep = torch.zeros(b, length, dtype=torch.bool)
        for i in range(b):  # left padding, then the slots written so far; the rest of the cache unattended
            keep[i, 5 * i : length // 2 + 11 * i] = True
        if b == 3:
            keep[2] = False  # a row with nothing to attend to: zeros
        got = da.decode_attention(q, k, v, keep, d**-0.5)
        ref = da.decode_attention_reference(q, k, v, keep, d**-0.5)
        err = float("nan") if torch.isnan(got).any() else ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        out.append(dict(kind="kernel", shape=list(got.shape), ref_shape=list(ref.shape), rel=err,
                        zero_row=bool(b != 3 or got[2].abs().max() == 0)))
    # inside graph_generate (eager steps): the same greedy tokens as SDPA, attention implementation restored
    model = _model("qwen2")
    ids, mask = _prompts(batch=3, length=9)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, compile=False, max_cache_len=150)
    sdpa = graph_generate(model, ids, mask, decode_attention=False, **kw)
    ours = graph_generate(model, ids, mask, decode_attention=True, **kw)
    out.append(dict(kind="generate", equal=bool(torch.equal(sdpa, ours)), impl=model.config._attn_implementation))
    print("RESULT" + json.dumps(out))
    """
)


def test_decode_attention_under_triton_interpreter():
    results = run_under_interpreter(_INTERP, timeout=600, extra_path=[TESTS, TESTS / "qerl_trl"])
    kernels = [r for r in results if r["kind"] == "kernel"]
    assert len(kernels) == 5
    for r in kernels:
        assert r["shape"] == r["ref_shape"], r
        assert r["rel"] < 2e-3, r  # NaN (an unwritten element of the poisoned output) fails here too
        assert r["zero_row"], r
    gen = next(r for r in results if r["kind"] == "generate")
    assert gen["equal"] and gen["impl"] == "sdpa", gen


@pytest.mark.parametrize(
    ("q", "k", "keep", "match"),
    [
        ((1, 4, 2, 16), (1, 2, 64, 16), (1, 64), "one query token"),
        ((1, 4, 1, 16), (1, 3, 64, 16), (1, 64), "do not fit"),
        ((1, 4, 1, 24), (1, 2, 64, 24), (1, 64), "power of two"),
        ((1, 4, 1, 16), (1, 2, 64, 16), (1, 63), "keep"),
    ],
)
def test_validation(q, k, keep, match):
    with pytest.raises(ValueError, match=match):
        decode_attention(torch.randn(q), torch.randn(k), torch.randn(k), torch.ones(keep, dtype=torch.bool), 0.25)


@pytest.mark.gpu
def test_decode_attention_7b_shape_gpu():
    """bf16, Qwen2.5-7B heads (28 query / 4 KV, D = 128), batch 8, a 1280-slot cache partly written, left padding."""
    import qerl_trl.rollout.graph.attention as da

    torch.manual_seed(1)
    b, h, hkv, length, d = 8, 28, 4, 1280, 128
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    keep = torch.zeros(b, length, dtype=torch.bool, device="cuda")
    for i in range(b):
        keep[i, 7 * i : 300 + 97 * i] = True
    da.POISON_OUTPUTS = True
    try:
        got = decode_attention(q, k, v, keep, d**-0.5)
    finally:
        da.POISON_OUTPUTS = False
    ref = decode_attention_reference(q, k, v, keep, d**-0.5)
    assert not torch.isnan(got).any()
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2
