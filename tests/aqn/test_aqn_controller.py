import json

import aqn
import pytest
import torch
from aqn import AQNController, make_schedule
from aqn_test_helpers import (
    assert_bit_identical,
    logits,
    snapshot,
    tiny_model,
    tokens,
)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")


def controller(**kw) -> AQNController:
    return AQNController(make_schedule("exponential", 1e-2, 1e-4, 10, total_steps=100), seed=42, **kw)


def test_stage_zero_is_quantization_noise_only_but_discovery_still_runs():
    ctl = controller()
    model = tiny_model("llama")
    snap = snapshot(model)
    with ctl.rollout(model, step=5) as h:
        assert h is None
        assert_bit_identical(model, snap)
    assert ctl.step == 5
    with pytest.raises(ValueError, match="AQN would be a no-op"):  # even at σ = 0 a wrong model fails loudly
        ctl.begin_rollout(nn.Sequential(nn.Linear(2, 2)), step=0)


def test_a_norm_the_wide_noise_cannot_wrap_fails_in_stage_zero():
    """``norm_dtype`` (the trainer's on bf16 policies) with a norm that is no RMSNorm: refused at the first rollout,
    as discovery is, not at the first noisy stage (10% into a run with the default 10 stages)."""
    model = tiny_model("llama", dtype=torch.bfloat16, seed=int(torch.randint(0, 1000, ())))
    norm = model.model.layers[1].post_attention_layernorm
    norm.forward = lambda x: norm.weight * x  # not normalised: Z ⊙ n(x) would not be the noise of w + Z
    snap = snapshot(model)
    ctl = controller(norm_dtype=torch.float32)
    assert ctl.sigma(0) == 0
    with pytest.raises(ValueError, match="does not compute"):
        ctl.begin_rollout(model, step=0)
    assert model.model.layers[1].post_attention_layernorm is norm
    assert_bit_identical(model, snap)
    with controller(norm_dtype=torch.float32).rollout(tiny_model("llama", dtype=torch.bfloat16), step=0) as h:
        assert h is None  # an RMSNorm model passes the check in stage 0 and gets no noise there


def test_rollout_applies_the_scheduled_sigma_and_restores_exactly():
    ctl = controller()
    model = tiny_model("qwen2")
    ids = tokens()
    clean = logits(model, ids)
    snap = snapshot(model)
    for step in (10, 37, 99):
        h = ctl.begin_rollout(model, step)
        assert h is not None and h.sigma == ctl.sigma(step) == ctl.schedule.sigma(step)
        assert not torch.equal(logits(model, ids), clean)
        ctl.end_rollout()
        assert_bit_identical(model, snap)
    assert ctl.metrics(37) == {"aqn/sigma": pytest.approx(ctl.sigma(37)), "aqn/stage": 3.0}
    ctl.begin_rollout(model, 50)
    with pytest.raises(RuntimeError, match="without end_rollout"):
        ctl.begin_rollout(model, 51)
    ctl.end_rollout()


def test_train_forward_is_untouched_by_default_and_matches_the_rollout_draw_when_enabled():
    model = tiny_model("llama")
    snap = snapshot(model)
    ctl = controller()
    with ctl.train(model, 20) as h:
        assert h is None
        assert_bit_identical(model, snap)
    both = controller(apply_to="rollout_and_train")
    with both.rollout(model, 20) as h:
        rollout_noise = {k: v.clone() for k, v in h.noise.items()}
    with both.train(model, 20) as h:
        assert h is not None
        assert all(torch.equal(rollout_noise[k], h.noise[k]) for k in rollout_noise)
        loss = model(input_ids=tokens()).logits.float().square().mean()
        loss.backward()  # weights stay noisy until after backward
    assert_bit_identical(model, snap)


def test_engine_weights_match_the_rollout_noise():
    model = tiny_model("mistral")
    ctl = controller()
    params = ctl.norm_noise(model).named_parameters()
    pushed = dict(ctl.engine_weights(params, step=33))
    via_model = dict(ctl.engine_weights(model, step=33))
    with ctl.rollout(model, 33):
        for k, p in params.items():
            assert torch.equal(pushed[k], p) and torch.equal(via_model[k], p)
    clean = dict(ctl.engine_weights(params, step=0))  # stage 0: clean copies
    assert all(torch.equal(clean[k], params[k]) for k in params)


def test_state_dict_resume_gives_the_same_stage_sigma_and_noise():
    model = tiny_model("llama")
    ctl = AQNController(make_schedule("cosine", 2e-2, 5e-4, 8, total_steps=240), seed=9, mode="per_step")
    with ctl.rollout(model, 123) as h:
        before = {k: v.clone() for k, v in h.noise.items()}
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["step"] == 123
    resumed = AQNController(make_schedule("linear", total_steps=1), seed=0)
    resumed.load_state_dict(state)
    assert isinstance(resumed.schedule, aqn.CosineSigmaSchedule)
    assert resumed.state_dict() == ctl.state_dict()
    assert (resumed.stage(123), resumed.sigma(123)) == (ctl.stage(123), ctl.sigma(123))
    with resumed.rollout(model, 123) as h:
        assert all(torch.equal(before[k], h.noise[k]) for k in before)


def test_an_incomplete_state_is_refused_naming_the_key_and_changes_nothing():
    ctl = AQNController(make_schedule("cosine", 2e-2, 5e-4, 8, total_steps=240), seed=9)
    state = json.loads(json.dumps(ctl.state_dict()))
    other = AQNController(make_schedule("linear", total_steps=1), seed=0)
    before = other.state_dict()
    for cut, said in [({k: v for k, v in state.items() if k != "schedule"}, "AQN controller state has no 'schedule'"),
                      ({k: v for k, v in state.items() if k != "seed"}, "AQN controller state has no 'seed'"),
                      ({**state, "schedule": {k: v for k, v in state["schedule"].items() if k != "num_stages"}},
                       "schedule state has no 'num_stages'")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{said}$"):
            other.load_state_dict(cut)
        with pytest.raises(ValueError, match=f"^{said}$"):
            AQNController.from_state_dict(cut)
    assert other.state_dict() == before
    assert AQNController.from_state_dict(state).state_dict() == ctl.state_dict()


def test_per_forward_mode_through_the_controller():
    model = tiny_model("qwen3")
    snap = snapshot(model)
    ctl = controller(mode="per_forward")
    with ctl.rollout(model, 60) as h, torch.no_grad():
        model.generate(tokens(1, 3), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert h.draws == 3
    assert_bit_identical(model, snap)


def test_bad_arguments():
    sched = make_schedule(total_steps=10)
    with pytest.raises(ValueError, match="mode"):
        AQNController(sched, mode="per_token")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply_to"):
        AQNController(sched, apply_to="train")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AQNController(lambda step: 0.1)  # type: ignore[arg-type]


class _ModelCopyEngine:
    """An engine generating from its own copy of the model, as vLLM does: norm weights set by name, restored after."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy

        self.model = copy.deepcopy(model)
        self.params = dict(self.model.named_parameters())
        self.clean: dict[str, torch.Tensor] = {}
        self.restores = 0

    @torch.no_grad()
    def set_norm_weights(self, named) -> None:
        for name, w in named.items():
            self.clean[name] = self.params[name].detach().clone()
            self.params[name].copy_(w)

    @torch.no_grad()
    def restore_norm_weights(self) -> None:
        for name, w in self.clean.items():
            self.params[name].copy_(w)
        self.restores += 1


def test_rollout_on_an_external_engine_gives_it_the_models_noise():
    """``rollout(model, step, engine=...)``: the engine's norms carry the very draw ``rollout(model, step)`` puts on the
    model, the model stays clean, and the engine is restored after; stage 0 touches nothing."""
    model = tiny_model("llama")
    snap = snapshot(model)
    engine = _ModelCopyEngine(model)
    ctl = controller()
    with ctl.rollout(model, 33, engine=engine) as handle:
        assert handle is not None and ctl.step == 33
        assert_bit_identical(model, snap)
        on_engine = {k: engine.params[k].detach().clone() for k in ctl.norm_noise(model).params}
    assert engine.restores == 1 and all(torch.equal(engine.params[k], snap[k]) for k in on_engine)
    with ctl.rollout(model, 33):
        live = dict(model.named_parameters())
        assert all(torch.equal(on_engine[k], live[k]) for k in on_engine)
    with ctl.rollout(model, 0, engine=engine) as handle:  # σ = 0: nothing loaded, nothing to restore
        assert handle is None
    assert engine.restores == 1


def test_per_forward_mode_with_an_external_engine_fails_in_stage_zero():
    """An engine takes one draw per rollout: per_forward is refused at the first rollout, stage 0 included, not at the
    first noisy stage (10% into a run with the default 10 stages)."""
    model = tiny_model("llama")
    engine = _ModelCopyEngine(model)
    ctl = controller(mode="per_forward")
    assert ctl.sigma(0) == 0
    with pytest.raises(ValueError, match="per_step"):
        ctl.begin_rollout(model, 0, engine=engine)
    with pytest.raises(ValueError, match="per_step"):
        ctl.begin_rollout(model, 33, engine=engine)
    assert engine.restores == 0


def test_an_engine_that_fails_while_taking_the_noise_is_restored():
    """An engine that raises part-way through ``set_norm_weights`` (vLLM server mode: norms set, then its prefix-cache
    reset refused) gets its clean norms back before the error propagates: no noisy engine is left behind."""

    class _FailingEngine(_ModelCopyEngine):
        def set_norm_weights(self, named) -> None:
            super().set_norm_weights(named)
            raise ConnectionError("POST /reset_prefix_cache: refused")

    model = tiny_model("llama")
    snap = snapshot(model)
    engine = _FailingEngine(model)
    ctl = controller()
    with pytest.raises(ConnectionError, match="refused"):
        ctl.begin_rollout(model, 33, engine=engine)
    assert engine.restores == 1 and all(torch.equal(engine.params[k], snap[k]) for k in engine.clean)
    assert ctl.begin_rollout(model, 33, engine=_ModelCopyEngine(model)) is not None  # not left "active"
    ctl.end_rollout()


def test_controller_does_not_keep_the_models_it_noised_alive():
    # the per-model NormNoise cache has weak keys, but each NormNoise held its model strongly: every model copy given
    # to rollout() stayed in memory for the controller's life
    import gc
    import weakref

    ctl = AQNController(make_schedule("exponential", 1e-2, 1e-4, 4, total_steps=8), seed=int(torch.randint(0, 99, ())))
    refs = []
    for step in (0, 5):
        model = tiny_model("llama")
        snap = snapshot(model)
        with ctl.rollout(model, step):
            pass
        assert_bit_identical(model, snap)
        assert ctl.norm_noise(model).model is model
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert len(ctl._noises) == 0
