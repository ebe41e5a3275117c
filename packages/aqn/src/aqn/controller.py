"""Trainer-agnostic driver: σ from the schedule, noise on the rollout model copy, restored afterwards.

Typical use in a GRPO step (the trainer owns ``step``, 0-based)::

    ctl = AQNController(make_schedule("exponential", 1e-2, 5e-4, 10, total_steps=max_steps), seed=args.seed)
    with ctl.rollout(policy_model, step):          # noise on, one draw for the whole generation (per_step)
        completions = policy_model.generate(...)
    # weights are bit-identical to before here
    with ctl.train(policy_model, step):            # no-op unless apply_to="rollout_and_train"
        loss = ...; loss.backward()                # restore only after backward (autograd saved the weights)

For an external engine (vLLM) that holds its own copy of the model, give it as ``engine``: the same draw goes to its
norm weights (``engine.set_norm_weights(named)``) for the rollout and ``engine.restore_norm_weights()`` puts the clean
ones back::

    with ctl.rollout(policy_model, step, engine=vllm_engine):   # policy_model's norms name the weights; it stays clean
        completions = vllm_engine.generate(...)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol

import torch
from torch import nn

from .discovery import ExampleInputs
from .noise import NoiseHandle, NormNoise, noisy_norm_weights
from .schedules import SigmaSchedule, schedule_from_state_dict

__all__ = ["AQNController", "NormWeightsEngine"]

Mode = Literal["per_step", "per_forward"]
ApplyTo = Literal["rollout", "rollout_and_train"]
_STATE_VERSION = 1


class NormWeightsEngine(Protocol):
    """An external engine with its own copy of the model's norm weights (e.g. ``qerl_vllm.engine.VLLMEngine``)."""

    def set_norm_weights(self, named: Mapping[str, torch.Tensor]) -> None: ...

    def restore_norm_weights(self) -> None: ...


class _EngineNoise:
    """Noisy norm weights loaded into an external engine; ``restore()`` has it put the clean ones back."""

    def __init__(self, engine: NormWeightsEngine) -> None:
        self.engine = engine
        self.active = True

    def restore(self) -> None:
        if self.active:
            self.active = False
            self.engine.restore_norm_weights()


class AQNController:
    """Drives AQN from a trainer: one call per generation step, on any model copy the caller owns.

    Args:
        schedule: the σ schedule (``aqn.make_schedule(...)``).
        seed: base seed; the noise of step ``k`` is a pure function of ``(seed, k, weight name)``.
        mode: ``"per_step"`` (default): one draw per rollout step, shared by all tokens and completions of the step;
            ``"per_forward"``: a fresh draw before every forward (every generated token with ``generate``).
        apply_to: ``"rollout"`` (default, as the paper): only the generation sees noise; ``"rollout_and_train"``:
            :meth:`begin_train` applies the *same* step-``k`` draw to the training forward (per_step mode).
        norm_dtype, include_final_norm, example_inputs: forwarded to :class:`~aqn.NormNoise`.

    Raises:
        ValueError: unknown ``mode`` / ``apply_to``.
    """

    def __init__(
        self,
        schedule: SigmaSchedule,
        seed: int = 0,
        mode: Mode = "per_step",
        apply_to: ApplyTo = "rollout",
        *,
        norm_dtype: torch.dtype | None = None,
        include_final_norm: bool = False,
        example_inputs: ExampleInputs = None,
    ) -> None:
        if not isinstance(schedule, SigmaSchedule):
            raise TypeError(f"schedule must be an aqn.SigmaSchedule, got {type(schedule).__name__}")
        if mode not in ("per_step", "per_forward"):
            raise ValueError(f"mode must be 'per_step' or 'per_forward', got {mode!r}")
        if apply_to not in ("rollout", "rollout_and_train"):
            raise ValueError(f"apply_to must be 'rollout' or 'rollout_and_train', got {apply_to!r}")
        self.schedule = schedule
        self.seed = int(seed)
        self.mode: Mode = mode
        self.apply_to: ApplyTo = apply_to
        self.norm_dtype = norm_dtype
        self.include_final_norm = include_final_norm
        self.example_inputs = example_inputs
        self.step: int | None = None  # last step a rollout began at
        self._noises: weakref.WeakKeyDictionary[nn.Module, NormNoise] = weakref.WeakKeyDictionary()
        self._rollout: NoiseHandle | None = None
        self._train: NoiseHandle | None = None

    # ------------------------------------------------------------------ schedule
    def sigma(self, step: int) -> float:
        """σ at ``step``."""
        return self.schedule.sigma(step)

    def stage(self, step: int) -> int:
        """Schedule stage of ``step``."""
        return self.schedule.stage(step)

    def metrics(self, step: int) -> dict[str, float]:
        """``{"aqn/sigma": σ, "aqn/stage": k}`` for logging."""
        return {"aqn/sigma": self.sigma(step), "aqn/stage": float(self.stage(step))}

    # ------------------------------------------------------------------ model copies
    def norm_noise(self, model: nn.Module | NormNoise) -> NormNoise:
        """The (cached) :class:`~aqn.NormNoise` of ``model``; discovery runs once per model object."""
        if isinstance(model, NormNoise):
            return model
        noise = self._noises.get(model)
        if noise is None:
            noise = NormNoise(
                model,
                example_inputs=self.example_inputs,
                include_final_norm=self.include_final_norm,
                norm_dtype=self.norm_dtype,
            )
            self._noises[model] = noise
        return noise

    def _start(
        self, model: nn.Module | NormNoise, step: int, draw_mode: Mode, engine: NormWeightsEngine | None = None
    ) -> NoiseHandle | _EngineNoise | None:
        sigma = self.sigma(step)
        noise = self.norm_noise(model)  # discover (and fail loudly) even in the noise-free stage 0
        if engine is None:
            noise.check_wrappers()  # likewise a norm the norm_dtype wrapper cannot take
        elif draw_mode == "per_forward":  # likewise a mode the engine cannot take
            raise ValueError("an external engine takes one draw per rollout: use mode='per_step'")
        if sigma == 0.0:
            return None
        if engine is not None:
            try:
                engine.set_norm_weights(dict(self.engine_weights(noise, step, dtype=torch.float32)))
            except BaseException:
                # it may have taken some noisy norms before failing (a server: the norms set, its cache reset
                # refused): put the clean ones back, best effort, and raise the first error
                with contextlib.suppress(Exception):
                    engine.restore_norm_weights()
                raise
            return _EngineNoise(engine)
        if draw_mode == "per_forward":
            return noise.apply_per_forward(sigma, seed=self.seed, step=step)
        return noise.apply(sigma, seed=self.seed, step=step)

    def begin_rollout(
        self, model: nn.Module | NormNoise, step: int, engine: NormWeightsEngine | None = None
    ) -> NoiseHandle | _EngineNoise | None:
        """Put step-``step`` noise on ``model``'s norms for generation; ``None`` when σ = 0 (nothing to do).

        ``engine``: an external engine generating from its own copy of ``model`` (vLLM): the same draw, in float32,
        goes to its norm weights instead, and ``model`` stays clean (its norms name and size the weights).

        Raises ``RuntimeError`` if the previous rollout was not ended.
        """
        if self._rollout is not None and self._rollout.active:
            raise RuntimeError("begin_rollout called twice without end_rollout")
        self.step = int(step)
        self._rollout = self._start(model, step, self.mode, engine)
        return self._rollout

    def end_rollout(self) -> None:
        """Restore the exact original norm weights of the rollout model (no-op if nothing was applied)."""
        if self._rollout is not None:
            self._rollout.restore()
            self._rollout = None

    @contextlib.contextmanager
    def rollout(
        self, model: nn.Module | NormNoise, step: int, engine: NormWeightsEngine | None = None
    ) -> Iterator[NoiseHandle | _EngineNoise | None]:
        """Context-manager form of :meth:`begin_rollout` / :meth:`end_rollout`."""
        handle = self.begin_rollout(model, step, engine)
        try:
            yield handle
        finally:
            self.end_rollout()

    def begin_train(self, model: nn.Module | NormNoise, step: int) -> NoiseHandle | None:
        """Noise for the training forward (only with ``apply_to="rollout_and_train"``; else ``None``).

        In per_step mode the draw equals the rollout's draw at the same step, so the policy that generated the
        samples is the one being scored. Call :meth:`end_train` only after ``backward()``.
        """
        if self.apply_to != "rollout_and_train":
            return None
        if self._train is not None and self._train.active:
            raise RuntimeError("begin_train called twice without end_train")
        self._train = self._start(model, step, self.mode)
        return self._train

    def end_train(self) -> None:
        """Restore the norm weights after the training step (no-op if nothing was applied)."""
        if self._train is not None:
            self._train.restore()
            self._train = None

    @contextlib.contextmanager
    def train(self, model: nn.Module | NormNoise, step: int) -> Iterator[NoiseHandle | None]:
        """Context-manager form of :meth:`begin_train` / :meth:`end_train`."""
        handle = self.begin_train(model, step)
        try:
            yield handle
        finally:
            self.end_train()

    def engine_weights(
        self,
        named_params: Mapping[str, torch.Tensor] | Any,
        step: int,
        *,
        dtype: torch.dtype | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Noisy copies ``(name, w + Z)`` of the given norm weights for an external engine's weight update.

        Same noise as :meth:`begin_rollout` gives the same names at ``step`` (per_step mode). ``named_params`` may
        also be a model or :class:`~aqn.NormNoise`, whose discovered norm weights are used (read from the model again:
        sharded by FSDP2, they are ``DTensor`` s and so are the noisy copies, each rank adding its slice of the whole
        draw; ``DTensor.full_tensor()`` gathers them). σ = 0 yields clean copies.
        """
        if isinstance(named_params, (nn.Module, NormNoise)):
            noise = self.norm_noise(named_params)
            noise._refresh_params()  # the model's live weights (FSDP2 swaps them for DTensor shards after discovery)
            named_params = noise.params
        return noisy_norm_weights(named_params, self.sigma(step), seed=self.seed, step=step, dtype=dtype)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Schedule, seed, last step, mode: everything to resume with the same σ and the same noise."""
        return {
            "version": _STATE_VERSION,
            "schedule": self.schedule.state_dict(),
            "seed": self.seed,
            "step": self.step,
            "mode": self.mode,
            "apply_to": self.apply_to,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (the schedule object is replaced by the saved one).

        Raises ``ValueError`` naming what is wrong (a missing key, a bad mode) and leaves the controller unchanged.
        """
        schedule, seed, step, mode, apply_to = _parse_state(state, self.mode, self.apply_to)
        self.schedule, self.seed, self.step, self.mode, self.apply_to = schedule, seed, step, mode, apply_to

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], **kwargs: Any) -> AQNController:
        """A controller restored from :meth:`state_dict`; ``kwargs``: the constructor's keyword-only options, which
        the state does not hold. Raises ``ValueError`` as :meth:`load_state_dict` does."""
        schedule, seed, step, mode, apply_to = _parse_state(state, "per_step", "rollout")
        controller = cls(schedule, seed, mode, apply_to, **kwargs)
        controller.step = step
        return controller

    def __repr__(self) -> str:
        return f"AQNController({self.schedule!r}, seed={self.seed}, mode={self.mode!r}, apply_to={self.apply_to!r})"


def _parse_state(
    state: Mapping[str, Any], mode: Mode, apply_to: ApplyTo
) -> tuple[SigmaSchedule, int, int | None, Mode, ApplyTo]:
    """(schedule, seed, step, mode, apply_to) of a :meth:`AQNController.state_dict`; ``mode`` / ``apply_to`` where it
    has none. A state edited by hand or cut short raises ``ValueError`` naming the key, not a bare ``KeyError``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"AQN controller state must be a mapping, got {type(state).__name__}")
    if state.get("version", _STATE_VERSION) > _STATE_VERSION:
        raise ValueError(f"controller state version {state['version']} is newer than this aqn")
    for key in ("schedule", "seed"):
        if key not in state:
            raise ValueError(f"AQN controller state has no {key!r}")
    mode, apply_to = state.get("mode", mode), state.get("apply_to", apply_to)
    if mode not in ("per_step", "per_forward") or apply_to not in ("rollout", "rollout_and_train"):
        raise ValueError(f"bad controller state: mode={mode!r}, apply_to={apply_to!r}")
    schedule = schedule_from_state_dict(state["schedule"])
    step = None if state.get("step") is None else int(state["step"])
    return schedule, int(state["seed"]), step, mode, apply_to
