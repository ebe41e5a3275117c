"""``NVFP4KernelLinearMethod`` (``QERL_VLLM_NVFP4_BACKEND=qerl``, our kernels on CUDA) on real tensors, and how the
backend is chosen.

The method's weight handling is the same code on every device: the packed tensors a checkpoint loads, the kernels'
MMA layout (forced on here, where it would be used on CUDA), shared or per-member global scales. On CPU ``apply``
runs ``nvfp4::linear``'s reference (dequantize + matmul), so its output must equal the one-time dequantization
method's (:class:`NVFP4DequantLinearMethod`, what the CPU engine runs) bit for bit when the members share a scale.
The end-to-end engine runs of both backends are in ``test_vllm_engine.py``.
"""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch
import torch.nn.functional as F

K = 512  # in_features: two 256-wide MMA tiles


@pytest.fixture(scope="module")
def vllm_process_group():
    """vLLM's one-process tensor-parallel state (its parameter classes read their rank from it), as an engine sets it
    up; torn down after the module so that the next module's engine starts from nothing."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _quantized_member(out: int, seed: int, global_scale: torch.Tensor | None = None):
    from nvfp4.codec import quantize

    w = torch.randn(out, K, generator=torch.Generator().manual_seed(seed)) * (0.02 + 0.01 * seed)
    return quantize(w.to(torch.bfloat16), global_scale=global_scale)


def _layer(method, widths: list[int], members, bias: torch.Tensor | None = None) -> torch.nn.Module:
    """A linear layer as vLLM builds it: ``create_weights`` on an empty module, then the checkpoint's tensors
    copied into the parameters (what the weight loaders do, member by member), then ``process_weights_after_loading``."""
    layer = torch.nn.Module()
    method.create_weights(layer, K, widths, K, sum(widths), torch.bfloat16, weight_loader=lambda *a, **k: None)
    row = 0
    for i, (w, q) in enumerate(zip(widths, members)):
        layer.weight_packed.data[row : row + w].copy_(q.packed)
        layer.weight_scale.data[row : row + w].copy_(q.scale)
        layer.weight_global_scale.data[i : i + 1].copy_(q.global_scale)
        row += w
    # the bias as vLLM's linear layers hold it: processing may change it (vLLM's CPU GEMM for small layers keeps it in
    # float32, on hosts where that kernel runs)
    layer.bias = None if bias is None else torch.nn.Parameter(bias.clone(), requires_grad=False)
    method.process_weights_after_loading(layer)
    return layer


def _out(method, layer, x):
    return method.apply(layer, x, layer.bias)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_members_with_one_global_scale_take_the_mma_layout_and_match_dequant(bias, vllm_process_group):
    from nvfp4.codec import shared_global_scale
    from nvfp4.layout import (
        from_mma_layout,
        is_mma_layout,
        scale_in_ct_layout,
        scale_is_mma_layout,
    )
    from qerl_vllm.quant import NVFP4DequantLinearMethod, NVFP4KernelLinearMethod

    widths = [256, 64, 64]  # q/k/v-like: each a whole number of 64-row tiles
    dense = [torch.randn(w, K, generator=torch.Generator().manual_seed(i)) * 0.03 for i, w in enumerate(widths)]
    gs = shared_global_scale([d.to(torch.bfloat16) for d in dense])
    members = [_quantized_member(w, i, gs) for i, w in enumerate(widths)]
    b = torch.randn(sum(widths)).to(torch.bfloat16) if bias else None

    ours = NVFP4KernelLinearMethod(mma_layout=True)
    layer = _layer(ours, widths, members, b)
    packed_ct = torch.cat([q.packed for q in members])
    assert layer.nvfp4_mma_layout and layer.nvfp4_members is None
    assert is_mma_layout(layer.weight_packed, layer.weight_scale)
    assert tuple(layer.weight_packed.shape) == (sum(widths) // 4, 2 * K)
    assert torch.equal(from_mma_layout(layer.weight_packed), packed_ct)  # the layout round trip is exact
    assert scale_is_mma_layout(layer.weight_packed, layer.weight_scale)  # [N/64, 4K]: step A's order
    scale_ct = scale_in_ct_layout(layer.weight_packed, layer.weight_scale)
    assert torch.equal(scale_ct.view(torch.uint8), torch.cat([q.scale for q in members]).view(torch.uint8))
    assert layer.weight_global_scale.shape == (1,) and torch.equal(layer.weight_global_scale, gs.reshape(1))
    assert all(not p.requires_grad for p in layer.parameters())

    ref_method = NVFP4DequantLinearMethod()
    ref_layer = _layer(ref_method, widths, members, b)
    x = torch.randn(5, K).to(torch.bfloat16)
    y = _out(ours, layer, x)
    assert y.shape == (5, sum(widths)) and y.dtype == torch.bfloat16
    assert torch.equal(y, _out(ref_method, ref_layer, x))  # same dequantized weight, same product
    # and the plain reference: dequantize the checkpoint's tensors, F.linear
    from nvfp4.codec import dequantize

    w_ref = dequantize(packed_ct, torch.cat([q.scale for q in members]), gs, torch.bfloat16)
    assert torch.equal(y, F.linear(x, w_ref, b))


def test_members_with_their_own_global_scales_are_computed_one_by_one(vllm_process_group):
    from nvfp4.layout import scale_is_mma_layout
    from qerl_vllm.quant import NVFP4DequantLinearMethod, NVFP4KernelLinearMethod

    widths = [128, 64]  # gate/up-like, each quantized with its own global scale
    members = [_quantized_member(w, i) for i, w in enumerate(widths)]
    assert members[0].global_scale.item() != members[1].global_scale.item()
    for mma in (True, False):
        ours = NVFP4KernelLinearMethod(mma_layout=mma)
        layer = _layer(ours, widths, members)
        assert layer.nvfp4_mma_layout is mma
        assert layer.weight_global_scale.shape == (2,)
        rows = [(p1 - p0, s1 - s0) for (p0, p1), (s0, s1) in layer.nvfp4_members]
        assert scale_is_mma_layout(layer.weight_packed, layer.weight_scale) is mma  # step A's order: a row per 64
        assert rows == [(w // 4, w // 64) if mma else (w, w) for w in widths]
        ref_method = NVFP4DequantLinearMethod()
        ref_layer = _layer(ref_method, widths, members)
        x = torch.randn(3, K).to(torch.bfloat16)
        y = _out(ours, layer, x)
        # each member with its own scale: exactly the per-member reference, and the fused dense product up to the
        # order of the matmul's blocking
        per_member = torch.cat([F.linear(x, q.dequantize(torch.bfloat16)) for q in members], dim=-1)
        assert torch.equal(y, per_member)
        torch.testing.assert_close(y, _out(ref_method, ref_layer, x))


def test_mma_layout_only_where_it_applies(vllm_process_group):
    from qerl_vllm.quant import NVFP4KernelLinearMethod

    q = _quantized_member(64, 0)
    assert not _layer(NVFP4KernelLinearMethod(), [64], [q]).nvfp4_mma_layout  # default: CUDA only; this is CPU
    odd = [_quantized_member(96, 1)]  # 96 outputs: not whole 64-row tiles
    assert not _layer(NVFP4KernelLinearMethod(mma_layout=True), [96], odd).nvfp4_mma_layout
    # a zero block scale cannot be decoded by the MMA-layout kernels: the compressed-tensors layout is kept
    zero = _quantized_member(64, 2)
    zero.scale[0, 0] = 0.0
    layer = _layer(NVFP4KernelLinearMethod(mma_layout=True), [64], [zero])
    assert not layer.nvfp4_mma_layout and tuple(layer.weight_packed.shape) == (64, K // 2)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("one_global_scale", [True, False])
def test_trainer_linears_become_views_of_the_fused_layer(mma, one_global_scale, vllm_process_group):
    """Weight sharing (``qerl_vllm.shared_weights`` + ``qerl_trl.rollout.shared_weights``): each member's rows of a
    fused layer, in either layout, with one global scale for the group or one per member, are bit for bit the
    trainer's ``NVFP4Linear`` tensors; the trainer then views them (same storage), computes exactly as before, and a
    layer whose layout differs from the engine's keeps its own copy, with the reason."""
    from nvfp4 import NVFP4Linear
    from nvfp4.codec import shared_global_scale
    from nvfp4.layout import to_mma_layout, to_scale_mma_layout
    from qerl_trl.rollout.shared_weights import share_weights_with
    from qerl_vllm.quant import NVFP4KernelLinearMethod
    from qerl_vllm.shared_weights import EngineWeights, _packed_member_views

    widths = [128, 64]  # gate/up-like
    dense = [torch.randn(w, K, generator=torch.Generator().manual_seed(i)) * 0.03 for i, w in enumerate(widths)]
    gs = shared_global_scale([d.to(torch.bfloat16) for d in dense]) if one_global_scale else None
    members = [_quantized_member(w, i, gs) for i, w in enumerate(widths)]
    fused = _layer(NVFP4KernelLinearMethod(mma_layout=mma), widths, members)
    assert fused.nvfp4_mma_layout is mma and fused.weight_global_scale.numel() == (1 if one_global_scale else 2)
    names = ["mlp.gate_proj", "mlp.up_proj"]
    engine = EngineWeights(pid=os.getpid(), linears=dict(zip(names, _packed_member_views(fused))))

    trainer = torch.nn.Module()
    trainer.mlp = torch.nn.Module()
    for name, q in zip(names, members):
        lin = NVFP4Linear.from_weight(q, None, torch.bfloat16, name=name)
        if mma:  # the layout NVFP4Linear takes on CUDA (on this CPU it keeps the compressed-tensors one)
            lin.weight_packed = to_mma_layout(lin.weight_packed)
            lin.weight_scale = to_scale_mma_layout(lin.weight_scale)
        setattr(trainer.mlp, name.split(".")[1], lin)
    x = torch.randn(3, K).to(torch.bfloat16)
    before = [trainer.mlp.gate_proj(x), trainer.mlp.up_proj(x)]
    report = share_weights_with(trainer, engine)
    assert report.not_shared == {} and len(report.shared) == 6, report.summary()
    for lin in (trainer.mlp.gate_proj, trainer.mlp.up_proj):
        assert lin.mma_layout is mma
        for t, p in ((lin.weight_packed, fused.weight_packed), (lin.weight_scale, fused.weight_scale),
                     (lin.weight_global_scale, fused.weight_global_scale)):  # fmt: skip
            assert t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and t.is_contiguous()
    after = [trainer.mlp.gate_proj(x), trainer.mlp.up_proj(x)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))

    # the engine in the other layout: nothing of weight_packed is shared, the trainer keeps its copy and its results
    other = _layer(NVFP4KernelLinearMethod(mma_layout=not mma), widths, members)
    lone = NVFP4Linear.from_weight(members[0], None, torch.bfloat16, name=names[0])
    if mma:
        lone.weight_packed = to_mma_layout(lone.weight_packed)
        lone.weight_scale = to_scale_mma_layout(lone.weight_scale)
    holder = torch.nn.Module()
    holder.mlp = torch.nn.Module()
    holder.mlp.gate_proj = lone
    own = lone.weight_packed
    report = share_weights_with(holder, EngineWeights(os.getpid(), dict(zip(names, _packed_member_views(other)))))
    differ = {"mlp.gate_proj.weight_packed", "mlp.gate_proj.weight_scale"}
    assert lone.weight_packed is own and set(report.not_shared) == differ
    assert report.not_shared["mlp.gate_proj.weight_packed"].startswith("layout: ")
    assert torch.equal(lone(x), before[0])


@pytest.fixture
def backend_env():
    from qerl_vllm.quant import BACKEND_ENV

    before = os.environ.get(BACKEND_ENV)
    yield lambda v: os.environ.__setitem__(BACKEND_ENV, v)
    if before is None:
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = before


def test_backend_choice_and_checkpoint_claim_on_this_platform(backend_env):
    from nvfp4.formats import MXFP4, NVFP4
    from qerl_vllm.quant import QeRLNVFP4Config, resolve_backend
    from vllm.platforms import current_platform

    nvfp4a16 = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
    }
    cuda = current_platform.is_cuda()
    backend_env("auto")
    default = ("qerl" if current_platform.has_device_capability(90) else "native") if cuda else "dequant"
    assert resolve_backend(NVFP4) == default
    backend_env("qerl")
    assert resolve_backend(NVFP4) == "qerl"
    assert resolve_backend(MXFP4) == "dequant"  # our kernels take NVFP4 tensors only; stock MXFP4A16 fails on sm90
    assert QeRLNVFP4Config.override_quantization_method(nvfp4a16, None) == "nvfp4_w4a16"
    assert QeRLNVFP4Config.override_quantization_method(nvfp4a16, "fp8") is None  # the user's choice stands
    backend_env("dequant")
    assert QeRLNVFP4Config.override_quantization_method(nvfp4a16, None) == "nvfp4_w4a16"
    backend_env("native")
    if cuda:  # stock vLLM's compressed-tensors path loads the checkpoint untouched (Marlin on Hopper)
        assert QeRLNVFP4Config.override_quantization_method(nvfp4a16, None) is None
    else:
        with pytest.raises(ValueError, match="need CUDA"):
            resolve_backend(NVFP4)
    backend_env("marlin")
    with pytest.raises(ValueError, match="choose one of auto, qerl, native, dequant"):
        resolve_backend(NVFP4)


# ---------------------------------------------------------------------------------------- rollout_precision (#51)
FP8_BOUND = 0.06  # E4M3 on both operands against the NVFP4 policy: ≈ 0.04 (the H100 spike: 0.040 on every 7B linear)


def _fused_qkv(bias: bool):
    from nvfp4.codec import shared_global_scale

    widths = [256, 64, 64]
    dense = [torch.randn(w, K, generator=torch.Generator().manual_seed(i)) * 0.03 for i, w in enumerate(widths)]
    gs = shared_global_scale([d.to(torch.bfloat16) for d in dense])
    members = [_quantized_member(w, i, gs) for i, w in enumerate(widths)]
    b = torch.randn(sum(widths)).to(torch.bfloat16) if bias else None
    return widths, members, b


def _policy_out(members, x, b) -> torch.Tensor:
    """The NVFP4 policy's output in float64 (what W4A16 computes, without its rounding)."""
    w = torch.cat([q.dequantize(torch.float64) for q in members])
    return x.double() @ w.T + (b.double() if b is not None else 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_precision_holds_only_the_e4m3_copy_and_meets_the_error_bound(bias, vllm_process_group):
    from nvfp4 import fp8
    from qerl_vllm.quant import NVFP4KernelLinearMethod

    widths, members, b = _fused_qkv(bias)
    method = NVFP4KernelLinearMethod(precision="fp8", crossover_rows=128)
    layer = _layer(method, widths, members, b)
    assert not hasattr(layer, "weight_packed") and not hasattr(layer, "weight_global_scale")
    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight.shape) == (sum(widths), K)
    assert layer.weight_scale.dtype == torch.float32 and tuple(layer.weight_scale.shape) == (sum(widths),)
    w8, ws = fp8.fp8_weight_members(torch.cat([q.packed for q in members]), torch.cat([q.scale for q in members]),
                                    members[0].global_scale.reshape(1), widths)  # fmt: skip
    assert torch.equal(layer.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(layer.weight_scale, ws)
    for rows in (1, 7, 130):  # every row count, decode or prefill
        x = torch.randn(rows, K).to(torch.bfloat16)
        y = _out(method, layer, x)
        assert y.shape == (rows, sum(widths)) and y.dtype == torch.bfloat16
        assert torch.equal(y, fp8.fp8_linear(x, w8, ws, b))
        assert _rel(y, _policy_out(members, x, b)) < FP8_BOUND


@pytest.mark.parametrize("bias", [False, True])
def test_auto_precision_is_w4a16_below_the_crossover_and_fp8_from_it(bias, vllm_process_group):
    from nvfp4 import fp8
    from qerl_vllm.quant import NVFP4KernelLinearMethod

    widths, members, b = _fused_qkv(bias)
    w4a16 = NVFP4KernelLinearMethod(mma_layout=True)
    w4_layer = _layer(w4a16, widths, members, b)
    auto = NVFP4KernelLinearMethod(mma_layout=True, precision="auto", crossover_rows=16)
    layer = _layer(auto, widths, members, b)
    assert layer.nvfp4_mma_layout and layer.weight_fp8.dtype == torch.float8_e4m3fn  # both copies held
    for rows in (1, 8, 15, 16, 17, 64):
        x = torch.randn(rows, K).to(torch.bfloat16)
        y = _out(auto, layer, x)
        if rows < 16:
            assert torch.equal(y, _out(w4a16, w4_layer, x)), rows
        else:
            assert torch.equal(y, fp8.fp8_linear(x, layer.weight_fp8, layer.weight_fp8_scale, b)), rows
            assert _rel(y, _policy_out(members, x, b)) < FP8_BOUND
    # members with their own global scales: fp8 is exact per member, auto refuses (one W4A16 product per layer)
    own = [_quantized_member(w, i) for i, w in enumerate([128, 64])]
    x = torch.randn(20, K).to(torch.bfloat16)
    fp8_method = NVFP4KernelLinearMethod(precision="fp8")
    assert _rel(_out(fp8_method, _layer(fp8_method, [128, 64], own), x), _policy_out(own, x, None)) < FP8_BOUND
    with pytest.raises(ValueError, match="needs one global scale per fused layer"):
        _layer(NVFP4KernelLinearMethod(precision="auto", crossover_rows=16), [128, 64], own)


def test_auto_precision_with_a_crossover_of_0_runs_fp8_on_its_own_copy(vllm_process_group):
    """``NVFP4KernelLinearMethod(precision="auto")`` (``crossover_rows`` default 0: FP8 from 0 rows, every call) holds
    the NVFP4 tensors and ``weight_fp8``, as auto does; ``apply`` took the ``fp8`` precision's branch, which reads
    ``layer.weight`` (fp8 only): an ``AttributeError`` on the first call."""
    from nvfp4 import fp8
    from qerl_vllm.quant import NVFP4KernelLinearMethod

    widths, members, b = _fused_qkv(bias=True)
    auto = NVFP4KernelLinearMethod(precision="auto")
    layer = _layer(auto, widths, members, b)
    for rows in (1, 17):
        x = torch.randn(rows, K).to(torch.bfloat16)
        assert torch.equal(_out(auto, layer, x), fp8.fp8_linear(x, layer.weight_fp8, layer.weight_fp8_scale, b)), rows


def test_rollout_precision_reaches_the_linear_method_through_additional_config(vllm_process_group, backend_env):
    from nvfp4.rollout_precision import UNMEASURED_CROSSOVER_ROWS
    from qerl_vllm.quant import ROLLOUT_PRECISION_KEY, NVFP4KernelLinearMethod, QeRLNVFP4Config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear

    backend_env("dequant")  # the CPU default: fp8 / auto take our method whatever the backend
    layer = ReplicatedLinear(K, 64, bias=False, params_dtype=torch.bfloat16)
    for value, kind, from_rows in (("fp8", NVFP4KernelLinearMethod, 0), ("auto", NVFP4KernelLinearMethod,
                                   UNMEASURED_CROSSOVER_ROWS), (None, None, None)):  # fmt: skip
        extra = {ROLLOUT_PRECISION_KEY: value} if value else {}
        with set_current_vllm_config(VllmConfig(additional_config=extra)):
            method = QeRLNVFP4Config().get_quant_method(layer, "model.layers.0.mlp.down_proj")
        if kind is None:
            assert type(method).__name__ == "NVFP4DequantLinearMethod"
        else:
            assert isinstance(method, kind) and method.fp8_from_rows == from_rows
    with set_current_vllm_config(VllmConfig(additional_config={ROLLOUT_PRECISION_KEY: "fp4"})):
        with pytest.raises(ValueError, match="rollout_precision must be one of 'w4a16', 'fp8', 'auto', got 'fp4'"):
            QeRLNVFP4Config().get_quant_method(layer, "model.layers.0.mlp.down_proj")


# ---------------------------------------------------------------------------------------- which layers are quantized
def _ct_config(ignore: list[str], targets: list[str] | None = None) -> dict:
    weights = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": targets or ["Linear"], "weights": weights}}}  # fmt: skip


def test_ignore_regexes_are_read_as_compressed_tensors_and_vllm_read_them(vllm_process_group):
    """A checkpoint's ``re:`` ignore entries are applied with ``re.match`` (a prefix) by compressed-tensors and stock
    vLLM; the plugin applied them with ``re.fullmatch``, so a prefix regex such as ``re:model\\.layers\\.1\\.`` kept
    nothing dense and vLLM quantized (or looked for the 4-bit tensors of) layers transformers keeps dense."""
    from compressed_tensors.utils.match import match_name
    from qerl_vllm.quant import QeRLNVFP4Config
    from vllm.model_executor.layers.linear import ReplicatedLinear

    ignore = ["lm_head", r"re:model\.layers\.1\.", r"re:.*self_attn\.o_proj$"]
    config = QeRLNVFP4Config.from_config(_ct_config(ignore))
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    layer = ReplicatedLinear(K, 64, bias=False, params_dtype=torch.bfloat16)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj",
                 "model.layers.10.mlp.down_proj", "model.layers.1.self_attn.q_proj"):  # fmt: skip
        dense = any(match_name(name, p) for p in ignore)
        assert config.is_quantized(layer, name) is not dense, name
    assert not config.is_quantized(layer, "model.layers.1.self_attn.qkv_proj")
    assert config.is_quantized(layer, "model.layers.0.self_attn.qkv_proj")


def test_linears_no_config_group_targets_stay_dense(vllm_process_group):
    """llm-compressor quantizes only the linears its config groups target (``re:`` with ``re.match``, or exact
    names) and saves the others dense; where the checkpoint's tensors are not read (a Hub id), the plugin took every
    linear as NVFP4 and looked for the 4-bit tensors of the dense ones."""
    from qerl_vllm.quant import QeRLNVFP4Config
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(K, 64, bias=False, params_dtype=torch.bfloat16)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    for targets in ([r"re:.*mlp.*"], names):
        config = QeRLNVFP4Config.from_config(_ct_config(["lm_head"], targets))
        config.packed_modules_mapping = fused
        assert config.is_quantized(layer, "model.layers.0.mlp.down_proj"), targets
        assert config.is_quantized(layer, "model.layers.0.mlp.gate_up_proj"), targets
        assert not config.is_quantized(layer, "model.layers.0.self_attn.o_proj"), targets
        assert not config.is_quantized(layer, "model.layers.0.self_attn.qkv_proj"), targets
    assert not QeRLNVFP4Config.from_config(_ct_config(["lm_head"], names)).is_quantized(
        layer, "model.layers.1.mlp.down_proj"
    )
    assert QeRLNVFP4Config.from_config(_ct_config(["lm_head"])).is_quantized(layer, "model.layers.0.self_attn.o_proj")


def test_checkpoint_names_follow_the_models_hf_to_vllm_mapper(vllm_process_group, tmp_path):
    """Where vLLM names a model's modules otherwise than its checkpoint (a multimodal model's language model:
    ``model.language_model.layers.0`` in the checkpoint, ``language_model.model.layers.0`` in vLLM), vLLM hands the
    model's mapper to the quantization config (``apply_vllm_mapper``); the plugin ignored it, so no layer was found
    NVFP4 in the checkpoint and every linear was built dense beside its 4-bit tensors."""
    from qerl_vllm.quant import QeRLNVFP4Config
    from safetensors.torch import save_file
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models.utils import WeightsMapper

    # Gemma3ForConditionalGeneration's (its module imports torchvision)
    mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model.",
                                               "lm_head.": "language_model.lm_head."})  # fmt: skip
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layer = ReplicatedLinear(K, 64, bias=False, params_dtype=torch.bfloat16)
    hf = [f"model.language_model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "mlp.down_proj")]  # fmt: skip
    save_file({f"{n}.weight_packed": torch.zeros(1, 1, dtype=torch.uint8) for n in hf}, tmp_path / "model.safetensors")
    read = QeRLNVFP4Config.from_config(_ct_config(["lm_head"]))
    read.maybe_update_config(str(tmp_path))  # the checkpoint's tensors decide
    dense = "model.language_model.layers.0.mlp.down_proj"
    patterns = QeRLNVFP4Config.from_config(_ct_config(["lm_head", dense]))  # the config's names decide
    for config in (read, patterns):
        config.packed_modules_mapping = fused
        config.apply_vllm_mapper(mapper)
        assert config.is_quantized(layer, "language_model.model.layers.0.self_attn.qkv_proj")
    assert read.is_quantized(layer, "language_model.model.layers.0.mlp.down_proj")
    assert not read.is_quantized(layer, "language_model.model.layers.0.mlp.gate_up_proj")  # dense in the checkpoint
    assert not patterns.is_quantized(layer, "language_model.model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("backend", ["dequant", "qerl"])
def test_an_lm_head_quantized_in_the_checkpoint_loads_and_computes_its_logits(vllm_process_group, backend_env,
                                                                               tmp_path, backend):  # fmt: skip
    """An untied lm_head quantized in the checkpoint (``NVFP4Config(modules_to_not_convert=[])``, or an llm-compressor
    ``ignore`` without it) is NVFP4 there; vLLM builds it as a ``ParallelLMHead`` (not a ``LinearBase``), to which the
    plugin gave no method: a dense weight was created and the checkpoint's 4-bit tensors had nowhere to go."""
    from qerl_vllm.quant import QeRLNVFP4Config
    from qerl_vllm.shared_weights import engine_weight_views
    from safetensors.torch import save_file
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    backend_env(backend)
    vocab = 250  # vLLM pads the rows to 256
    q = _quantized_member(vocab, 3)
    tensors = {"lm_head.weight_packed": q.packed, "lm_head.weight_scale": q.scale,
               "lm_head.weight_global_scale": q.global_scale}  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    config = QeRLNVFP4Config.from_config(_ct_config([]))
    config.maybe_update_config(str(tmp_path))
    head = ParallelLMHead(vocab, K, params_dtype=torch.bfloat16, quant_config=config, prefix="lm_head")
    for name, t in tensors.items():
        param = getattr(head, name.removeprefix("lm_head."))
        param.weight_loader(param, t)
    head.quant_method.process_weights_after_loading(head)
    x = torch.randn(3, K).to(torch.bfloat16)
    logits = head.quant_method.apply(head, x, None)
    want = (x.double() @ q.dequantize(torch.float64).T).float()
    assert logits.shape == (3, 256) and not logits[:, vocab:].any()
    assert torch.allclose(logits[:, :vocab].float(), want, rtol=2e-2, atol=2e-2)
    model = torch.nn.Module()
    model.lm_head = head
    views = engine_weight_views(model)  # not a dense lm_head (the dequantized or FP8 copy): the trainer's is NVFP4
    assert "lm_head.weight" not in views.dense and "lm_head" in views.not_offered
    dense = QeRLNVFP4Config.from_config(_ct_config(["lm_head"]))  # kept dense: vLLM's own embedding method
    assert dense.get_quant_method(ParallelLMHead(vocab, K, params_dtype=torch.bfloat16), "lm_head") is None


def test_a_config_keeping_only_some_members_of_a_fused_layer_dense_is_refused(vllm_process_group):
    """Where the checkpoint's tensors are not read, a config that keeps some members of a layer vLLM fuses dense and
    quantizes the others (``ignore: [...q_proj]``, or targets naming gate_proj but not up_proj) made the whole fused
    layer dense, and the load failed later on the members' 4-bit tensors ("no module or parameter named
    ...weight_packed"); it is refused in one line, as the tensors' check and stock vLLM's compressed-tensors refuse
    it."""
    from qerl_vllm.quant import QeRLNVFP4Config
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(K, 64, bias=False, params_dtype=torch.bfloat16)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    some = QeRLNVFP4Config.from_config(_ct_config(["lm_head", "model.layers.0.self_attn.q_proj"]))
    some.packed_modules_mapping = fused
    with pytest.raises(ValueError, match=r"fuses .* into model.layers.0.self_attn.qkv_proj, but the config keeps"):
        some.is_quantized(layer, "model.layers.0.self_attn.qkv_proj")
    assert some.is_quantized(layer, "model.layers.1.self_attn.qkv_proj")
    all_dense = QeRLNVFP4Config.from_config(_ct_config([r"re:model\.layers\.0\.self_attn\.[qkv]_proj"]))
    all_dense.packed_modules_mapping = fused
    assert not all_dense.is_quantized(layer, "model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize(
    "config, key",
    [
        ({"quant_method": "nvfp4_w4a16", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
        ({**_ct_config([]), "ignore": "lm_head"}, "ignore"),
        ({**_ct_config([]), "qerl": {"modules_to_not_convert": "lm_head"}}, "qerl.modules_to_not_convert"),
        ({"quant_method": "nvfp4_w4a16", "modules_to_not_convert": ["lm_head", 3]}, "modules_to_not_convert"),
    ],
)
def test_a_dense_module_list_that_is_not_a_list_of_names_is_refused(config, key):
    """A hand-edited config with ``"ignore": "lm_head"`` (or ``modules_to_not_convert``) as a bare string was taken
    as ``list("lm_head")``: seven one-letter patterns matching no module, so where the checkpoint's tensors are not
    read every linear and the lm_head were taken as NVFP4, silently; it is refused in one line naming the value."""
    from qerl_vllm.quant import QeRLNVFP4Config

    with pytest.raises(ValueError, match=rf"^nvfp4_w4a16: {re.escape(key)} must be a list of module names"):
        QeRLNVFP4Config.from_config(config)
    assert QeRLNVFP4Config.from_config({**_ct_config([]), "ignore": None}).modules_to_not_convert == ["lm_head"]


def test_asking_for_nvfp4_w4a16_on_a_checkpoint_it_cannot_load_says_why(tmp_path):
    """``quantization="nvfp4_w4a16"`` on a compressed-tensors checkpoint that is not weight-only NVFP4/MXFP4 (here
    ``nvfp4-pack-quantized`` with groups of 32) was declined silently, and vLLM refused it only with "compressed-tensors
    does not match nvfp4_w4a16"; ``from_config`` printed the whole config. Both now name what disagrees."""
    import json
    import shutil

    from qerl_vllm.quant import QeRLNVFP4Config
    from vllm.engine.arg_utils import EngineArgs
    from vllm_test_helpers import nvfp4_offline_checkpoint

    bad = _ct_config(["lm_head"])
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 32
    reason = r"^nvfp4_w4a16: cannot load this compressed-tensors checkpoint: config group .*'group_size': 32.* group 16"
    with pytest.raises(ValueError, match=reason):
        QeRLNVFP4Config.override_quantization_method(bad, "nvfp4_w4a16")
    with pytest.raises(ValueError, match=reason):
        QeRLNVFP4Config.from_config(bad)
    assert QeRLNVFP4Config.override_quantization_method(bad, None) is None  # not asked for: left to stock vLLM
    assert QeRLNVFP4Config.override_quantization_method(_ct_config(["lm_head"]), "nvfp4_w4a16") == "nvfp4_w4a16"

    # through vLLM's own config check (no engine starts): the checkpoint's config with groups of 32
    src = nvfp4_offline_checkpoint()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["group_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"nvfp4_w4a16: cannot load this compressed-tensors checkpoint: .*group 16"):
        EngineArgs(model=str(tmp_path), quantization="nvfp4_w4a16").create_model_config()
