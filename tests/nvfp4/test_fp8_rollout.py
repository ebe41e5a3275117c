"""``rollout_precision`` (issue #51): the setting, ``auto``'s crossover, the dispatching op and the FP8 copies of a
model's NVFP4 layers, on the CPU (the FP8 product is :func:`nvfp4.fp8.scaled_linear`'s float32 reference there).

Bound: the FP8 path against the NVFP4 policy's float64 output is E4M3 on both operands, ≈ 0.04 relative on Gaussian
data (the H100 spike measured 0.040 on every 7B linear); the tests hold it under 0.06, as tests/nvfp4/test_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4 import NVFP4Linear, fp8, ops
from nvfp4.codec import dequantize, quantize
from nvfp4.fp8_model import attach_fp8_copies, detach_fp8_copies, fp8_rollouts
from nvfp4.rollout_precision import (
    UNMEASURED_CROSSOVER_ROWS,
    fp8_copy_bytes,
    fp8_crossover_rows,
    get_rollout_precision,
    model_crossover_rows,
)
from torch import nn

FP8_BOUND = 0.06


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_setting_parses_once_and_says_what_it_needs():
    assert get_rollout_precision(" FP8 ").name == "fp8"
    auto = get_rollout_precision("auto")
    assert get_rollout_precision(auto) is auto
    assert auto.fp8_copy and auto.keeps_w4a16 and auto.fp8_from_rows(128) == 128
    fp8_only, w4 = get_rollout_precision("fp8"), get_rollout_precision("w4a16")
    assert fp8_only.fp8_copy and not fp8_only.keeps_w4a16 and fp8_only.fp8_from_rows(128) == 0
    assert not w4.fp8_copy and w4.fp8_from_rows(128) is None
    with pytest.raises(ValueError, match=r"^rollout_precision must be one of 'w4a16', 'fp8', 'auto', got 'fp16'$"):
        get_rollout_precision("fp16")
    assert fp8_crossover_rows(3584, 18944) == (128, True)  # Qwen2.5-7B, measured (gemm_fp8_spike.json @ bdf44f8)
    assert fp8_crossover_rows(576, 1536) == (UNMEASURED_CROSSOVER_ROWS, False)
    from transformers import Qwen2Config

    assert model_crossover_rows(Qwen2Config(hidden_size=3584, intermediate_size=18944)) == (128, True)
    assert model_crossover_rows(None) == (UNMEASURED_CROSSOVER_ROWS, False)  # vLLM without a model config
    assert fp8_copy_bytes([(3584, 4608), (18944, 3584)]) == 3584 * 4608 + 4 * 4608 + 18944 * 3584 + 4 * 3584


def _nvfp4_weight(n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k))


@pytest.mark.parametrize("bias", [False, True])
def test_auto_op_takes_w4a16_below_the_crossover_and_fp8_from_it(bias):
    q = _nvfp4_weight(64, 256)
    w8, ws = fp8.fp8_weight(q.packed, q.scale, q.global_scale)
    b = torch.randn(64) if bias else None
    wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
    for rows in (1, 7, 8, 9, 33):
        x = torch.randn(rows, 256)
        y = fp8.w4a16_or_fp8_linear(x, q.packed, q.scale, q.global_scale, w8, ws, b, fp8_from_rows=8)
        if rows < 8:
            assert torch.equal(y, ops.linear(x, q.packed, q.scale, q.global_scale, b))
        else:
            assert torch.equal(y, fp8.fp8_linear(x, w8, ws, b))
            ref = x.double() @ wd.T + (b.double() if bias else 0)
            assert rel_err(y, ref) < FP8_BOUND
    # leading dimensions count as rows; fakes and schema; a graph traced with a symbolic row count keeps the choice
    x3 = torch.randn(2, 4, 256)
    y3 = fp8.w4a16_or_fp8_linear(x3, q.packed, q.scale, q.global_scale, w8, ws, b, 8)
    assert y3.shape == (2, 4, 64) and torch.equal(y3.reshape(8, 64), fp8.fp8_linear(x3.reshape(8, 256), w8, ws, b))
    torch.library.opcheck(torch.ops.nvfp4.w4a16_or_fp8_linear.default,
                          (torch.randn(5, 256), q.packed, q.scale, q.global_scale, w8, ws, b, 8),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))  # fmt: skip
    fn = torch.compile(lambda t: fp8.w4a16_or_fp8_linear(t, q.packed, q.scale, q.global_scale, w8, ws, b, 8),
                       fullgraph=True, dynamic=True, backend="eager")  # fmt: skip
    for rows in (3, 20, 5):
        x = torch.randn(rows, 256)
        assert torch.equal(fn(x), fp8.w4a16_or_fp8_linear(x, q.packed, q.scale, q.global_scale, w8, ws, b, 8))


def test_fp8_weight_members_equals_each_member_with_its_own_global_scale():
    parts = [_nvfp4_weight(n, 256, seed=i) for i, n in enumerate((64, 32, 32))]
    packed = torch.cat([p.packed for p in parts])
    scale = torch.cat([p.scale for p in parts])
    gs = torch.cat([p.global_scale.reshape(1) for p in parts])
    w8, ws = fp8.fp8_weight_members(packed, scale, gs, [64, 32, 32])
    for p, rows in zip(parts, (slice(0, 64), slice(64, 96), slice(96, 128)), strict=True):
        e8, es = fp8.fp8_weight(p.packed, p.scale, p.global_scale)
        assert torch.equal(w8[rows].view(torch.uint8), e8.view(torch.uint8)) and torch.equal(ws[rows], es)
    with pytest.raises(ValueError, match="do not split"):
        fp8.fp8_weight_members(packed, scale, gs, [64, 32])


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.up = NVFP4Linear.from_linear(nn.Linear(256, 128, bias=True))
        self.down = NVFP4Linear.from_linear(nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_model_copies_are_used_only_inside_fp8_rollouts():
    model = _TwoLayers()
    x_small, x_large = torch.randn(1, 3, 256), torch.randn(2, 8, 256)
    w4_small, w4_large = model(x_small), model(x_large)
    held = attach_fp8_copies(model, "auto", crossover_rows=16)
    assert held == 256 * 128 + 4 * 128 + 128 * 64 + 4 * 64
    assert torch.equal(model(x_large), w4_large)  # outside the block: W4A16 (the trainer's forward and logprobs)
    with fp8_rollouts(model) as n:
        assert n == 2
        assert torch.equal(model(x_small), w4_small)  # 3 rows < 16: W4A16
        y = model(x_large)  # 16 rows: FP8
        assert not torch.equal(y, w4_large) and rel_err(model.up(x_large), model.up.dequantize(torch.float32)
                                                         .matmul(x_large.unsqueeze(-1)).squeeze(-1)
                                                         + model.up.bias) < FP8_BOUND  # fmt: skip
        up = model.up
        direct = fp8.fp8_linear(x_large, up.fp8_copy.weight, up.fp8_copy.scale, up.bias)
        assert torch.equal(up(x_large), direct)
    assert rel_err(y, w4_large) < 2 * FP8_BOUND
    assert not model.up.fp8_active and torch.equal(model(x_large), w4_large)
    # fp8: every row count; the copy is made once and kept
    w8 = model.up.fp8_copy.weight
    assert attach_fp8_copies(model, "fp8", crossover_rows=16) == held and model.up.fp8_copy.weight is w8
    with fp8_rollouts(model):
        assert not torch.equal(model(x_small), w4_small)
    # training's forward/backward stays W4A16 (gradients reach x) and the copies go away on request
    x = x_large.clone().requires_grad_()
    model(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert attach_fp8_copies(model, "w4a16", crossover_rows=16) == 0
    detach_fp8_copies(model)
    with fp8_rollouts(model) as n:
        assert n == 0 and torch.equal(model(x_small), w4_small)


def test_fp8_copies_move_with_the_model_and_keep_their_dtypes():
    """``model.to(device)`` / ``.half()`` after :func:`attach_fp8_copies`: the E4M3 copy (a plain attribute) stayed
    where it was made, so FP8 rollouts of a model moved to its GPU met a CPU weight. It now moves with the layer and
    is never cast (float8 weight, float32 scale)."""
    model = _TwoLayers()
    attach_fp8_copies(model, "fp8", crossover_rows=0)
    w8, scale = model.up.fp8_copy.weight.clone(), model.up.fp8_copy.scale.clone()
    model.half()
    assert model.up.fp8_copy.weight.dtype == torch.float8_e4m3fn and model.up.fp8_copy.scale.dtype == torch.float32
    assert torch.equal(model.up.fp8_copy.weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(model.up.fp8_copy.scale, scale)
    model.to("meta")
    copy = model.up.fp8_copy
    assert copy.weight.is_meta and copy.scale.is_meta and copy.from_rows == 0


def test_a_nested_fp8_block_leaves_the_outer_one_active():
    """``fp8_rollouts`` inside another switched every layer's FP8 copy off on leaving, so the rest of the outer block
    computed W4A16; each layer's flag as it was is now given back."""
    layer = NVFP4Linear.from_linear(nn.Linear(64, 32))
    attach_fp8_copies(layer, "fp8", 128)
    with fp8_rollouts(layer):
        with fp8_rollouts(layer):
            assert layer.fp8_active
        assert layer.fp8_active
    assert not layer.fp8_active
