"""GPTQ for NVFP4 (:func:`nvfp4.calibration.gptq_quantize`, :func:`nvfp4.calibration.calibrate_model`) against RTN and
the activation-weighted search on fresh random layers and a tiny model."""

from __future__ import annotations

import pytest
import torch
from nvfp4 import NVFP4Linear
from nvfp4.calibration import calibrate_model, gptq_quantize
from nvfp4.codec import dequantize, pack_e2m1, quantize_with_scales
from nvfp4.methods import quantize
from tiny_models import tiny_config


def _output_error(x: torch.Tensor, w: torch.Tensor, q) -> float:
    wq = dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    assert torch.isfinite(wq).all()
    return ((x @ (w - wq).T).square().sum() / (x @ w.T).square().sum()).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_lowers_output_error_below_rtn_and_awq(seed):
    gen = torch.Generator().manual_seed(seed)
    out, k = 96, 256
    # correlated inputs with uneven channel scales, as LLM activations
    x = (torch.randn(2048, k, generator=gen) @ (torch.randn(k, k, generator=gen) / k**0.5)) * (
        torch.rand(k, generator=gen) * 3 + 0.1
    )
    w = torch.randn(out, k, generator=gen) * 0.02
    h = x.T @ x / x.shape[0]
    rtn = _output_error(x, w, quantize(w))
    awq = _output_error(x, w, quantize(w, method="awq", act_sq=x.square().mean(0)))
    gptq = _output_error(x, w, gptq_quantize(w, h))
    assert gptq < 0.75 * rtn and gptq < awq, (rtn, awq, gptq)
    # the codes are the ones its scales give: re-rounding the dequantized weight changes nothing
    q = gptq_quantize(w, h)
    wq = dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    again = pack_e2m1(quantize_with_scales(wq, q.scale, q.global_scale))  # -0 may come back as +0: compare values
    assert torch.equal(dequantize(again, q.scale, q.global_scale, torch.float32), wq)


def test_gptq_input_checks_and_dead_inputs():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(32))
    with pytest.raises(ValueError, match="multiple of 16"):
        gptq_quantize(w, torch.eye(64), block_cols=24)
    h = torch.eye(64)
    h[5, 5] = 0.0  # an input that never fires: its weights are dropped, the rest still quantizes
    q = gptq_quantize(w, h)
    wq = dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    assert torch.isfinite(wq).all() and (wq[:, 5] == 0).all()


def test_calibrate_model_gptq_tiny_model_beats_rtn():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(tiny_config("qwen2", num_hidden_layers=3)).eval()
    calib = [torch.randint(0, 256, (1, 24)) for _ in range(8)]
    held_out = torch.randint(0, 256, (4, 24))
    with torch.no_grad():
        ref = dense(held_out).logits
    import copy

    from nvfp4 import quantize_model

    errs = {}
    for method in ("rtn", "gptq"):
        m = copy.deepcopy(dense)
        if method == "rtn":
            quantize_model(m, progress=False)
        else:
            calibrate_model(m, "gptq", calib, progress=False)
        assert sum(isinstance(x, NVFP4Linear) for x in m.modules()) == 3 * 7
        with torch.no_grad():
            errs[method] = ((m(held_out).logits - ref).norm() / ref.norm()).item()
    assert errs["gptq"] < errs["rtn"], errs
    with pytest.raises(ValueError, match="at least one"):
        calibrate_model(copy.deepcopy(dense), "gptq", [])
    with pytest.raises(ValueError, match="method"):
        calibrate_model(copy.deepcopy(dense), "rtn", calib)


def test_calibrate_model_gptq_feeds_each_layer_the_model_s_own_inputs_whatever_its_kv_cache():
    """GPTQ catches the first decoder layer's call and runs each layer again on it, twice (statistics, then its
    outputs for the next layer). The caught call held the model's KV cache (transformers passes a DynamicCache with
    the default use_cache=True), so each run added its keys and the next attended over them too: from layer 1 on the
    Hessians came from inputs the model never computes, and the bytes differed from the same calibration with
    use_cache=False. The cache is no part of calibration: the same bytes either way."""
    import copy

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    ids = [torch.randint(0, 256, (2, 12)) for _ in range(3)]
    default = calibrate_model(copy.deepcopy(base), "gptq", ids, progress=False).state_dict()
    no_cache = calibrate_model(copy.deepcopy(base), "gptq", [{"input_ids": i, "use_cache": False} for i in ids],
                               progress=False).state_dict()  # fmt: skip
    as_bytes = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    assert [k for k in default if not torch.equal(as_bytes(default[k]), as_bytes(no_cache[k]))] == []


def test_layers_calibrated_with_gptq_are_named_in_messages_as_the_other_methods_name_them():
    """``calibrate_model(method='gptq')`` built its layers without their names, so every message about one (a PEFT
    refusal, a layout warning) said 'NVFP4Linear (nvfp4, 64x64)' where RTN / AWQ layers name themselves
    ('model.layers.0.self_attn.q_proj (nvfp4, 64x64)')."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = calibrate_model(AutoModelForCausalLM.from_config(tiny_config("llama")).eval(), "gptq",
                            [torch.randint(0, 256, (1, 8))], progress=False)  # fmt: skip
    named = {n: m.layer_name for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert named and all(n == layer for n, layer in named.items())


def _padded_and_unpadded(lengths=(9, 5, 3), pad_id=7):
    """One right-padded batch ``{input_ids [3, 9], attention_mask}`` and the same real tokens as one ``[1, T]``
    batch per sequence."""
    seqs = [torch.randint(0, 256, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return [{"input_ids": ids, "attention_mask": mask}], [{"input_ids": s[None]} for s in seqs]


def _tiny_float64_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager").double().eval()


@pytest.mark.parametrize("stats_class", ["ActivationStats", "HessianStats"])
def test_calibration_statistics_count_real_tokens_only(stats_class):
    """A batch of right-padded prompts with its attention mask counted the padding positions as tokens: the
    statistics (``E[x²]`` for AWQ, ``E[xᵀx]`` for GPTQ) mixed in activations of pad tokens and divided by the padded
    count. Told the mask (:meth:`real_tokens`), they are those of the real tokens alone: the same as the unpadded
    sequences give."""
    import nvfp4.calibration as calibration

    torch.manual_seed(0)
    model = _tiny_float64_model()
    padded, unpadded = _padded_and_unpadded()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]

    def collect(batches):
        stats = getattr(calibration, stats_class)(model, names)
        with torch.no_grad():
            for batch in batches:
                stats.real_tokens(batch.get("attention_mask"))
                model(**batch)
        stats.remove()
        return {n: stats.mean_sq()[n] if stats_class == "ActivationStats" else stats.hessian(n) for n in names}

    want, got = collect(unpadded), collect(padded)
    for n in names:
        torch.testing.assert_close(got[n], want[n])  # float32 sums in another order


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrate_model_quantizes_a_padded_batch_as_its_real_tokens(method):
    """``calibrate_model`` on a right-padded batch with its attention mask gives the bytes the unpadded prompts give
    (the padding positions no longer enter the statistics)."""
    import copy

    torch.manual_seed(1)
    model = _tiny_float64_model()
    padded, unpadded = _padded_and_unpadded()
    want = calibrate_model(copy.deepcopy(model), method, unpadded, progress=False).state_dict()
    got = calibrate_model(copy.deepcopy(model), method, padded, progress=False).state_dict()
    assert list(got) == list(want)
    changed = [k for k in want if not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))]
    assert not changed, changed


def test_the_awq_forward_over_the_batches_shows_progress(capsys):
    """AWQ's full-model forward over the calibration batches showed nothing: a 32B model over a few dozen prompts sat
    silent until the quantization bar appeared (GPTQ's bar covers its layer-by-layer passes; its first pass stops at
    layer 0). A bar over the batches now (``progress=False`` turns it off)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    batches = [torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for progress in (True, False):
        import copy

        calibrate_model(copy.deepcopy(model), "awq", batches, progress=progress)
        err = capsys.readouterr().err
        assert ("3/3" in err and "batch" in err) == progress, err
