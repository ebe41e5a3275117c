"""What the public ops (:mod:`nvfp4.ops`) do with inputs a user or a framework hands them, on the CPU reference
path (the CUDA launchers are checked against the same expectations in ``test_kernels.py``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import nvfp4
import pytest
import torch
from nvfp4.codec import dequantize, quantize
from triton_interpreter import run_under_interpreter

SRC = Path(__file__).resolve().parents[2] / "packages" / "nvfp4" / "src"


def _weight(n: int = 32, k: int = 64):
    torch.manual_seed(0)
    return quantize(torch.randn(n, k))


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_of_another_dtype_is_cast_to_x_dtype_as_the_kernels_do(bias_dtype):
    """The CUDA launcher casts the bias to x's dtype; the reference (CPU, NVFP4_DISABLE_TRITON) failed with
    'self and mat2 must have the same dtype', so the same call worked on a GPU and failed elsewhere."""
    q = _weight()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    bias = torch.randn(32, dtype=bias_dtype)
    ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16).double().T
    ref += bias.to(torch.bfloat16).double()
    y = nvfp4.linear(x, q.packed, q.scale, q.global_scale, bias)
    assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2)
    bias.requires_grad_()
    nvfp4.linear(x, q.packed, q.scale, q.global_scale, bias).sum().backward()
    assert bias.grad.dtype == bias_dtype and torch.allclose(bias.grad, torch.full((32,), 3.0, dtype=bias_dtype))
    bias = bias.detach()
    a, b = torch.randn(4, 64), torch.randn(32, 4)
    y = nvfp4.ops.lora_linear(x, q.packed, q.scale, q.global_scale, bias, a, b, 0.5)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 32)


@pytest.mark.parametrize("shape", [(1,), (32, 1), (33,), (16,)])
def test_bias_not_of_out_features_is_refused(shape):
    """A bias of another shape than [out] broadcast in the reference ([1]) while the kernels read [out] elements
    from it (past its end on CUDA): the op now refuses it in one line."""
    q = _weight()
    x = torch.randn(3, 64)
    bias = torch.randn(shape)
    with pytest.raises(ValueError, match=r"bias .* \[32\]"):
        nvfp4.linear(x, q.packed, q.scale, q.global_scale, bias)
    with pytest.raises(ValueError, match=r"bias .* \[32\]"):
        nvfp4.ops.lora_linear(x, q.packed, q.scale, q.global_scale, bias, torch.randn(4, 64), torch.randn(32, 4), 1.0)


def test_zero_dim_input_is_refused_in_one_line():
    q = _weight()
    with pytest.raises(ValueError, match="at least one dimension"):
        nvfp4.linear(torch.tensor(1.0), q.packed, q.scale, q.global_scale)


def test_dgrad_refuses_integer_dy_instead_of_computing_in_integers():
    """linear_dgrad dequantized the weight to dy's dtype: an integer dy truncated every 4-bit value below 1 to 0 and
    returned an integer 'gradient'; linear refuses integer x, and now so does linear_dgrad."""
    q = _weight()
    with pytest.raises(ValueError, match="floating-point"):
        nvfp4.linear_dgrad(torch.ones(2, 32, dtype=torch.int32), q.packed, q.scale, q.global_scale)
    with pytest.raises(ValueError, match="at least one dimension"):
        nvfp4.linear_dgrad(torch.tensor(1.0), q.packed, q.scale, q.global_scale)


def test_lora_linear_refuses_a_bias_that_needs_a_gradient_up_front():
    """lora_linear has no backward and says so when x or the adapter needs a gradient; a trainable bias (PEFT's
    bias="all") passed, and the call failed only at backward, far from it ('no autograd formula was registered')."""
    q = _weight()
    bias = torch.randn(32, requires_grad=True)
    a, b = torch.randn(4, 64), torch.randn(32, 4)
    with pytest.raises(RuntimeError, match="no backward"):
        nvfp4.ops.lora_linear(torch.randn(3, 64), q.packed, q.scale, q.global_scale, bias, a, b, 0.5)
    with torch.no_grad():
        y = nvfp4.ops.lora_linear(torch.randn(3, 64), q.packed, q.scale, q.global_scale, bias, a, b, 0.5)
    assert y.shape == (3, 32) and not y.requires_grad


_FLOAT64_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from nvfp4.codec import dequantize, quantize
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout
    from nvfp4.kernels import nvfp4_gemm, nvfp4_linear, nvfp4_linear_dgrad, nvfp4_lora_linear

    nvfp4_gemm.POISON_OUTPUTS = True
    torch.manual_seed(0)
    n, k = 64, 256
    q = quantize(torch.randn(n, k))
    wd = dequantize(q.packed, q.scale, q.global_scale, torch.float64)
    x, dy = torch.randn(3, k, dtype=torch.float64), torch.randn(3, n, dtype=torch.float64)
    a, b = torch.randn(4, k, dtype=torch.float64), torch.randn(n, 4, dtype=torch.float64)

    def rel(y, ref):
        return [str(y.dtype), float("nan") if torch.isnan(y).any() else ((y - ref).norm() / ref.norm()).item()]

    out = {}
    for name, packed, scale in (("ct", q.packed, q.scale), ("mma", to_mma_layout(q.packed), to_scale_mma_layout(q.scale))):
        out["linear_" + name] = rel(nvfp4_linear(x, packed, scale, q.global_scale), x @ wd.T)
        out["dgrad_" + name] = rel(nvfp4_linear_dgrad(dy, packed, scale, q.global_scale), dy @ wd)
        y = nvfp4_lora_linear(x, packed, scale, q.global_scale, None, a, b, 0.5)
        out["lora_" + name] = rel(y, x @ wd.T + 0.5 * (x @ a.T) @ b.T)
    print("RESULT" + json.dumps(out))
    """
)


def test_float64_activations_take_the_full_precision_path_under_triton_interpreter():
    """The ops accept any floating x (the reference computes float64 exactly), but the CUDA launchers sent only
    float32 to dequantize + matmul: float64 went into the fp16/bf16 kernels and came back NaN (outputs never written
    under the interpreter). float64 now takes the dequantize path as float32 does."""
    results = run_under_interpreter(_FLOAT64_SCRIPT, timeout=600, extra_path=[SRC])
    for name, (dtype, err) in results.items():
        assert dtype == "torch.float64" and err < 1e-12, (name, dtype, err)


@pytest.mark.parametrize("op", ["linear", "linear_dgrad", "lora_linear"])
@pytest.mark.parametrize("case", ["scale of another weight", "scale and global scale swapped", "two global scales"])
def test_weight_tensors_that_disagree_are_named_not_blamed_on_x(op, case):
    """The ops read the weight's shape from ``scale`` alone: a scale of another weight made a right ``x`` wrong
    ('x has 64 input features, the weight expects 32'), the scale and global scale swapped ended in an IndexError
    ('tuple index out of range'), two global scales in "shape '[1, 1]' is invalid for input of size 2". Each is now
    one ValueError naming the tensors."""
    q = _weight()
    packed, scale, gs = q.packed, q.scale, q.global_scale
    if case == "scale of another weight":
        scale = scale[:, :2]
    elif case == "scale and global scale swapped":
        scale, gs = gs, scale
    else:
        gs = torch.ones(2)
    call = {
        "linear": lambda: nvfp4.linear(torch.randn(3, 64), packed, scale, gs),
        "linear_dgrad": lambda: nvfp4.linear_dgrad(torch.randn(3, 32), packed, scale, gs),
        "lora_linear": lambda: nvfp4.ops.lora_linear(torch.randn(3, 64), packed, scale, gs, None, torch.randn(4, 64),
                                                     torch.randn(32, 4), 1.0),  # fmt: skip
    }[op]
    with pytest.raises(ValueError, match="NVFP4 tensors disagree|global_scale") as info:
        call()
    assert "input features" not in str(info.value) and len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("tensor", ["packed", "scale", "global_scale"])
def test_weight_tensors_of_another_dtype_are_refused_here_as_on_cuda(tensor):
    """The CUDA launchers refuse weight tensors that are not uint8 / float8_e4m3fn / float32 (TypeError), while the
    reference computed with any (float32 block scales, an int8 view of the codes, a bfloat16 global scale), so a call
    that ran on the CPU failed on a GPU. Both refuse them now, here in one line naming the dtypes."""
    q = _weight()
    given = {"packed": q.packed, "scale": q.scale, "global_scale": q.global_scale}
    given[tensor] = {"packed": q.packed.view(torch.int8), "scale": q.scale.float(),
                     "global_scale": q.global_scale.bfloat16()}[tensor]  # fmt: skip
    with pytest.raises(ValueError, match="uint8/float8_e4m3fn/float32") as info:
        nvfp4.linear(torch.randn(3, 64), given["packed"], given["scale"], given["global_scale"])
    assert len(str(info.value).splitlines()) == 1
