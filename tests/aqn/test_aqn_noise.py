import copy
import warnings

import aqn
import pytest
import torch
from aqn import NormNoise, noisy_norm_weights
from aqn_test_helpers import (
    ARCHS,
    EngineModel,
    assert_bit_identical,
    logits,
    scale_input_columns,
    snapshot,
    tiny_model,
    tokens,
)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sigma", [1e-2, 1e-1])
def test_noisy_norm_equals_multiplicative_noise_on_the_following_linear_input_columns(arch, sigma):
    model = tiny_model(arch)
    ids = tokens()
    noise = NormNoise(model)
    with noise.apply(sigma, seed=3, step=5) as h:
        noisy = logits(model, ids)
        z = {k: v.clone() for k, v in h.noise.items()}
    reference = copy.deepcopy(model)  # clean norms, columns of q/k/v and gate/up scaled by 1 + Z/w
    scale_input_columns(reference, aqn.find_norm_linear_pairs(reference), z)
    ref = logits(reference, ids)
    clean = logits(model, ids)
    assert (noisy - clean).abs().max() > 1e-3  # the noise is not negligible here...
    torch.testing.assert_close(noisy, ref, rtol=1e-4, atol=2e-5)  # ...and it is exactly the column scaling


def test_equivalence_on_engine_style_fused_linears():
    model = EngineModel()
    args = (torch.arange(6) % 64, torch.arange(6))
    noise = NormNoise(model, example_inputs=args)
    with torch.no_grad(), noise.apply(5e-2, seed=1) as h:
        noisy = model(*args)
        z = {k: v.clone() for k, v in h.noise.items()}
    ref_model = copy.deepcopy(model)
    scale_input_columns(ref_model, noise.groups, z)
    with torch.no_grad():
        torch.testing.assert_close(noisy, ref_model(*args), rtol=1e-4, atol=1e-5)


def test_wide_norm_noise_on_engine_style_fused_add_norms():
    """``norm_dtype`` on an engine's model whose norms fuse the residual add (``norm(x, residual)`` returns
    ``(out, residual)``, vLLM's): the noise term is taken on the summed input, as ``w + Z`` would be (the wrapper
    failed on the tuple)."""
    seed = int(torch.randint(0, 1000, ()))
    model = EngineModel()
    args = (torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)), torch.arange(6))
    snap = snapshot(model)
    with torch.no_grad():
        with NormNoise(model, example_inputs=args).apply(5e-2, seed=seed):  # in place: the weights are w + Z
            want = model(*args)
        with NormNoise(model, example_inputs=args, norm_dtype=torch.float64).apply(5e-2, seed=seed):
            got = model(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert_bit_identical(model, snap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_is_bit_identical_after_thousands_of_steps(dtype):
    model = tiny_model("qwen2", dtype=dtype)
    snap = snapshot(model)
    noise = NormNoise(model, warn_lossy=False)
    storages = {n: p.data_ptr() for n, p in noise.params.items()}
    for step in range(2000):
        h = noise.apply(1e-2, seed=0, step=step)
        h.restore()
        h.restore()  # idempotent
    assert_bit_identical(model, snap)
    assert {n: p.data_ptr() for n, p in noise.params.items()} == storages  # same storage: engines' views stay valid


def test_noise_changes_logits_and_restore_brings_them_back_exactly():
    model = tiny_model("llama")
    ids = tokens()
    clean = logits(model, ids)
    noise = NormNoise(model)
    with noise.apply(0.0, seed=0):
        assert torch.equal(logits(model, ids), clean)  # σ = 0: bit-identical
    with noise.apply(1e-2, seed=0):
        noisy = logits(model, ids)
    assert not torch.equal(noisy, clean)
    assert torch.equal(logits(model, ids), clean)


def test_noise_statistics_and_only_norm_weights_move():
    model = tiny_model("llama")
    snap = snapshot(model)
    noise = NormNoise(model)
    with noise.apply(1e-2, seed=0) as h:
        z = torch.cat([v for v in h.noise.values()])
        assert z.numel() == 4 * 64
        assert z.std().item() == pytest.approx(1e-2, rel=0.15)
        assert abs(z.mean().item()) < 3e-3
        for k, v in model.state_dict().items():
            moved = not torch.equal(v, snap[k])
            assert moved == (k in noise.params), k
            if moved:
                torch.testing.assert_close(v, snap[k] + h.noise[k], rtol=0, atol=1e-7)


def test_seeded_noise_is_reproducible_and_independent_of_order():
    model = tiny_model("llama")
    noise = NormNoise(model)
    with noise.apply(1e-2, seed=7, step=3) as h:
        a = {k: v.clone() for k, v in h.noise.items()}
    with noise.apply(1e-2, seed=7, step=3) as h:
        assert all(torch.equal(a[k], h.noise[k]) for k in a)
    with noise.apply(1e-2, seed=7, step=4) as h:
        assert not any(torch.equal(a[k], h.noise[k]) for k in a)
    with noise.apply(1e-2, seed=8, step=3) as h:
        assert not any(torch.equal(a[k], h.noise[k]) for k in a)
    # explicit generator: reproducible too
    draws = []
    for _ in range(2):
        with noise.apply(1e-2, torch.Generator().manual_seed(123)) as h:
            draws.append(torch.cat(list(h.noise.values())))
    assert torch.equal(*draws)
    # no seed: follows torch's global RNG
    torch.manual_seed(5)
    with noise.apply(1e-2) as h:
        g1 = torch.cat(list(h.noise.values()))
    torch.manual_seed(5)
    with noise.apply(1e-2) as h:
        assert torch.equal(g1, torch.cat(list(h.noise.values())))


def test_noisy_norm_weights_yields_copies_with_the_same_noise_as_apply():
    model = tiny_model("mistral")
    noise = NormNoise(model)
    params = noise.named_parameters()
    before = {k: v.detach().clone() for k, v in params.items()}
    pushed = dict(noisy_norm_weights(params, 1e-2, seed=11, step=2))
    assert all(torch.equal(params[k], before[k]) for k in params)  # sources untouched
    with noise.apply(1e-2, seed=11, step=2):
        for k, p in params.items():
            assert torch.equal(pushed[k], p.detach())
    # a subset, in another order, gets the same per-name noise
    names = list(params)[::-1][:2]
    subset = dict(noisy_norm_weights([(n, params[n]) for n in names], 1e-2, seed=11, step=2))
    assert all(torch.equal(subset[n], pushed[n]) for n in names)
    # dtype conversion for an engine, and σ = 0 → exact copies
    half = dict(noisy_norm_weights(params, 1e-2, seed=11, step=2, dtype=torch.bfloat16))
    assert all(v.dtype == torch.bfloat16 for v in half.values())
    zero = dict(noisy_norm_weights(params, 0.0))
    assert all(torch.equal(zero[k], params[k]) and zero[k].data_ptr() != params[k].data_ptr() for k in params)


def test_named_parameter_map_target():
    model = tiny_model("llama")
    snap = snapshot(model)
    params = {n: p for n, p in model.named_parameters() if n.endswith("input_layernorm.weight")}
    noise = NormNoise(params)
    with noise.apply(1e-2, seed=0):
        assert not torch.equal(
            params["model.layers.0.input_layernorm.weight"], snap["model.layers.0.input_layernorm.weight"]
        )
    assert_bit_identical(model, snap)
    with pytest.raises(ValueError, match="per-forward"):
        noise.apply_per_forward(1e-2)
    with pytest.raises(ValueError, match="1-D"):
        NormNoise({"w": torch.ones(3, 3)})


def test_per_forward_resamples_every_forward_and_restores():
    model = tiny_model("qwen3")
    snap = snapshot(model)
    noise = NormNoise(model)
    ids = tokens(1, 4)
    seen = []
    with noise.apply_per_forward(1e-2, seed=2, step=1) as h:
        for _ in range(3):
            logits(model, ids)
            seen.append(torch.cat(list(h.noise.values())).clone())
        assert h.draws == 3
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape[1] == 8
        assert h.draws == 3 + 4  # one fresh draw per generated token (one forward each)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    assert_bit_identical(model, snap)
    assert not model.model.layers[0].input_layernorm._forward_pre_hooks  # hook removed
    # reproducible: same seed / step → same sequence of draws
    with noise.apply_per_forward(1e-2, seed=2, step=1) as h:
        logits(model, ids)
        assert torch.equal(torch.cat(list(h.noise.values())), seen[0])


def test_per_forward_fires_through_a_peft_wrapper_generate():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    noise = NormNoise(model)
    with noise.apply_per_forward(1e-2, seed=0) as h, torch.no_grad():
        model.generate(input_ids=tokens(1, 3), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert h.draws == 3


def test_misuse_errors():
    model = tiny_model("llama")
    noise = NormNoise(model)
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sigma"):
            noise.apply(bad)
    h = noise.apply(1e-2, seed=0)
    with pytest.raises(RuntimeError, match="already applied"):
        noise.apply(1e-2, seed=0)
    h.restore()
    with pytest.raises(RuntimeError):
        h.resample()
    with pytest.raises(TypeError):
        NormNoise([1, 2, 3])  # type: ignore[arg-type]


@pytest.mark.parametrize("norm_dtype", [None, torch.float32])
def test_a_second_noise_on_the_same_norms_is_refused(norm_dtype):
    """Two NormNoise objects over one model (two controllers, or one per wrapper): the second apply while the first
    is live would save the first's noisy weights as its originals, and restoring out of order left them noisy."""
    model = tiny_model("llama", torch.bfloat16, seed=int(torch.randint(0, 1000, ())))
    snap = snapshot(model)
    first, second = NormNoise(model, norm_dtype=norm_dtype), NormNoise(model, norm_dtype=norm_dtype)
    live = first.apply(1e-2, seed=0)
    with pytest.raises(RuntimeError, match="already applied"):
        second.apply(1e-2, seed=1)
    with pytest.raises(RuntimeError, match="already applied"):
        second.apply_per_forward(1e-2, seed=1)
    live.restore()
    assert_bit_identical(model, snap)
    with second.apply(1e-2, seed=1):  # free again once the first is restored
        pass
    assert_bit_identical(model, snap)


def test_inplace_noise_is_visible_to_autograd():
    """Noise is written with an autograd-tracked copy_: changing it between forward and backward fails loudly."""
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].input_layernorm.weight.requires_grad_(True)
    noise = NormNoise(model)
    loss = model(input_ids=tokens()).logits.square().mean()
    with noise.apply(1e-2, seed=0):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_bf16_small_sigma_is_lost_and_the_fp32_norm_option_keeps_it():
    model = tiny_model("llama", dtype=torch.bfloat16)
    snap = snapshot(model)
    ids = tokens()
    clean = logits(model, ids)
    lossy = NormNoise(model)
    with pytest.warns(UserWarning, match="survives rounding"):
        h = lossy.apply(1e-4, seed=0)
    stats = h.survival()
    assert stats["fraction_changed"] < 0.05 and stats["retained"] < 0.1
    assert torch.equal(logits(model, ids), clean)  # σ = 1e-4 on bf16 norms ≈ 1: a no-op
    h.restore()

    precise = NormNoise(model, norm_dtype=torch.float32)
    with precise.apply(0.0):
        clean32 = logits(model, ids)  # norms in float32 (one rounding) differ slightly from pure bf16
        assert clean32.dtype == torch.bfloat16
        torch.testing.assert_close(clean32, clean, rtol=0.05, atol=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with precise.apply(1e-4, seed=0) as h:
            assert all(p.dtype == torch.bfloat16 for p in precise.params.values())  # weights never written
            assert h.survival()["retained"] == pytest.approx(1.0, abs=1e-3)
            noisy = logits(model, ids)
    assert not torch.equal(noisy, clean32)
    assert_bit_identical(model, snap)
    assert torch.equal(logits(model, ids), clean)


def test_measure_rounding_survival():
    w = torch.ones(20000)
    lost = aqn.measure_rounding_survival(w, 1e-4, torch.bfloat16)
    kept = aqn.measure_rounding_survival(w, 1e-4, torch.float32)
    assert lost["fraction_changed"] == 0.0 and lost["retained"] == 0.0
    assert kept["retained"] == pytest.approx(1.0, abs=1e-3)
    coarse = aqn.measure_rounding_survival(w, 1e-2, torch.bfloat16)
    assert 0.5 < coarse["retained"] < 1.5 and coarse["fraction_changed"] > 0.3


def test_noise_seed_is_stable():
    # fixed values: changing the derivation would silently change every resumed run's noise
    assert aqn.noise_seed(0, 0, "a") == aqn.noise_seed(0, 0, "a")
    assert aqn.noise_seed(0, 0, "a") != aqn.noise_seed(0, 1, "a") != aqn.noise_seed(1, 0, "a")
    assert 0 <= aqn.noise_seed(2**70, -3, "x", 9) < 2**63


def test_per_forward_with_fp32_norms_on_a_bf16_model():
    model = tiny_model("llama", dtype=torch.bfloat16)
    snap = snapshot(model)
    noise = NormNoise(model, norm_dtype=torch.float32)
    ids = tokens(1, 3)
    with noise.apply_per_forward(1e-3, seed=0) as h, torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert h.draws == 3 and out.dtype == torch.long
        first = model.model.layers[0].input_layernorm
        assert torch.equal(first.noise, h.noise["model.layers.0.input_layernorm.weight"])  # the latest draw
    assert_bit_identical(model, snap)
    layer0 = model.model.layers[0].input_layernorm
    assert type(layer0).__name__ == "LlamaRMSNorm" and not layer0._forward_pre_hooks and not layer0._forward_hooks


def test_fp32_noise_buffers_are_reused_across_noises():
    """Every noise swaps in the same wrappers, whose float32 noise buffers stay at one address (a CUDA graph captured
    during one rollout reads them by address in the next) and hold each draw exactly; the norms and their bf16
    weights come back untouched."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    snap = snapshot(model)
    noise = NormNoise(model, norm_dtype=torch.float32)
    norms = {n: model.get_submodule(n.removesuffix(".weight")) for n in noise.params}
    seen = []
    for step in range(3):
        with noise.apply(1e-3, seed=0, step=step) as h:
            wrappers = {n: model.get_submodule(n.removesuffix(".weight")) for n in noise.params}
            assert all(w.norm is norms[n] and w.noise.dtype == torch.float32 for n, w in wrappers.items())
            for n, w in wrappers.items():
                assert torch.equal(w.noise, h.noise[n])
            seen.append({n: w.noise.data_ptr() for n, w in wrappers.items()})
        assert all(model.get_submodule(n.removesuffix(".weight")) is m for n, m in norms.items())
        assert_bit_identical(model, snap)
    assert seen[0] == seen[1] == seen[2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3_text", "cohere"])
def test_fp32_noise_term_is_the_noisy_weight(arch):
    """The wrapper's ``norm(x) + Z ⊙ n(x)`` equals the norm run in float32 with ``w + Z`` as its weight, for the
    ``w ⊙ n(x)`` norms, Gemma's ``(1 + w) ⊙ n(x)`` and Cohere's bias-free LayerNorm (``n(x)`` mean-centred)."""
    from aqn.noise import _NoisyNorm

    model = tiny_model(arch, dtype=torch.float32)
    noise = NormNoise(model, norm_dtype=torch.float64)  # float32 weights are narrower: wrapped, noise in float64
    x = torch.randn(3, 5, model.config.hidden_size)
    with noise.apply(0.05, seed=1) as h:
        for n in noise.params:
            wrapper = model.get_submodule(n.removesuffix(".weight"))
            assert isinstance(wrapper, _NoisyNorm)
            want_norm = copy.deepcopy(wrapper.norm).double()
            with torch.no_grad():
                want_norm.weight += h.noise[n].double()
                torch.testing.assert_close(wrapper(x).double(), want_norm(x.double()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharing", ["module", "weight"])
def test_wide_norm_noise_reaches_every_place_a_shared_norm_sits(sharing):
    """A norm module placed twice, or two norms tied to one weight: ``w + Z`` is read at both places, so the wrapped
    (``norm_dtype``) noise must be there too, not only at the first place (which left layer 1 noise-free)."""
    seed = int(torch.randint(0, 1000, ()))
    model = tiny_model("llama", dtype=torch.float32, seed=seed)
    first, second = model.model.layers
    if sharing == "module":
        second.input_layernorm = first.input_layernorm
    else:
        second.input_layernorm.weight = first.input_layernorm.weight
    snap, norms = snapshot(model), [first.input_layernorm, second.input_layernorm]
    ids = tokens(2, 6, seed=seed)
    with NormNoise(model).apply(0.05, seed=seed):  # in place: the weight itself is w + Z everywhere
        want = logits(model, ids)
    assert_bit_identical(model, snap)
    with NormNoise(model, norm_dtype=torch.float64).apply(0.05, seed=seed):  # float32 weights: wrapped
        assert type(second.input_layernorm).__name__ == "_NoisyNorm"
        got = logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [first.input_layernorm, second.input_layernorm] == norms
    assert_bit_identical(model, snap)


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_fp32_noise_on_torch_rmsnorm(eps):
    """``torch.nn.RMSNorm`` (eps None: finfo of the input dtype, float32 inside the wrapper) on a bf16 weight."""
    from aqn.noise import _NoisyNorm

    norm = nn.RMSNorm(32, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    wrapper = _NoisyNorm(norm, torch.float32)
    aqn.noise._check_rmsnorm("norm", wrapper)
    z = aqn.sample_noise((32,), 1e-3, seed=0)
    wrapper.noise.copy_(z)
    x = torch.randn(4, 32).to(torch.bfloat16)
    want = nn.functional.rms_norm(x.float(), (32,), norm.weight.float() + z, eps).to(torch.bfloat16)
    torch.testing.assert_close(wrapper(x), want, rtol=0, atol=1e-2)
    assert wrapper(x).dtype == torch.bfloat16


def test_fp32_noise_on_the_bias_free_layernorms_of_a_bf16_cohere_model():
    """Cohere's bias-free LayerNorm is noised as ``w + Z`` too (``n(x)`` mean-centred): the trainer keeps a bf16
    policy's noise in float32, and such a norm stopped the run at the first noisy stage ("does not compute")."""
    seed = int(torch.randint(0, 1000, ()))
    model = tiny_model("cohere", dtype=torch.bfloat16, seed=seed)
    snap = snapshot(model)
    ids = tokens(2, 6, seed=seed)
    clean = logits(model, ids)
    with NormNoise(model, norm_dtype=torch.float32).apply(1e-3, seed=seed):
        assert type(model.model.layers[0].input_layernorm).__name__ == "_NoisyNorm"
        noisy = logits(model, ids)
    assert not torch.equal(noisy, clean)
    assert_bit_identical(model, snap)


def test_fp32_norms_refuse_a_norm_that_is_not_rmsnorm():
    model = tiny_model("llama", dtype=torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    norm.forward = lambda x: norm.weight * x  # not normalised: the noise term Z ⊙ x/rms(x) would be wrong
    snap = snapshot(model)
    noise = NormNoise(model, norm_dtype=torch.float32, method="convention")
    with pytest.raises(ValueError, match="does not compute"):
        noise.apply(1e-3, seed=0)
    assert model.model.layers[0].input_layernorm is norm  # nothing swapped
    assert_bit_identical(model, snap)


def test_noisy_norm_weights_checks_its_arguments_at_the_call():
    # a generator function: a bad σ or a 2-D weight raised only when the copies were first taken (inside whatever
    # engine weight loader consumed them), far from the call that passed it
    d = int(torch.randint(8, 32, ()))
    params = {"a.weight": torch.rand(d) + 0.5, "b.weight": torch.rand(d) + 0.5}
    for sigma in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sigma must be a finite number >= 0"):
            aqn.noisy_norm_weights(params, sigma, seed=0)
    with pytest.raises(ValueError, match=r"^c\.weight: expected a 1-D norm weight, got shape \(4, 4\)$"):
        aqn.noisy_norm_weights({**params, "c.weight": torch.ones(4, 4)}, 1e-2, seed=0)
    with pytest.raises(ValueError, match=r"^c\.weight: expected a 1-D norm weight, got a list$"):
        aqn.noisy_norm_weights({**params, "c.weight": [1.0, 2.0]}, 1e-2, seed=0)
    # good arguments still yield the noise NormNoise.apply adds
    copies = dict(aqn.noisy_norm_weights(params, 1e-2, seed=3, step=2))
    live = {k: v.clone() for k, v in params.items()}
    with aqn.NormNoise(live).apply(1e-2, seed=3, step=2):
        assert all(torch.equal(copies[k], live[k]) for k in params)


def test_a_sigma_that_is_not_a_number_is_refused_in_one_line_naming_sigma():
    # None raised "float() argument must be a string or a real number, not 'NoneType'" (a TypeError naming nothing);
    # True was taken as σ = 1.0, a hundred times the paper's largest
    model = tiny_model("llama")
    snap = snapshot(model)
    noise = NormNoise(model)
    weights = noise.named_parameters()
    for bad in (None, "0.01", True, [0.01]):
        for call in (
            lambda s: noise.apply(s, seed=0),
            lambda s: noise.apply_per_forward(s, seed=0),
            lambda s: aqn.sample_noise((4,), s, seed=0),
            lambda s: aqn.noisy_norm_weights(weights, s, seed=0),
            lambda s: aqn.measure_rounding_survival(torch.rand(8), s),
        ):
            with pytest.raises(ValueError, match=r"^sigma must be a finite number >= 0, got .+$"):
                call(bad)
    assert_bit_identical(model, snap)
    with pytest.raises(ValueError, match="^sigma_start must be a number, got True$"):
        aqn.make_schedule("linear", True, 0.0, 4, total_steps=8)
    # numbers of other real types are still σ
    sigma = float(torch.rand(()) * 1e-2 + 1e-3)
    with noise.apply(torch.tensor(sigma), seed=1) as handle:
        assert handle.sigma == float(torch.tensor(sigma))
