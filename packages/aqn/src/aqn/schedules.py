"""σ schedules for Adaptive Quantization Noise (AQN).

Training is cut into ``K = num_stages`` equal stages. Stage 0 adds no noise (the model explores with its quantization
noise only); stage ``k >= 1`` uses ``σ_k = shape(t_k)`` where the progress ``t_k`` runs from 0 (stage 1, ``σ_start``)
towards 1 (``σ_end``).

Progress, paper convention (default, ``reach_end=False``)::

    t_k = (k - 1) / (K - 1)        k = 1 .. K-1

so the exponential kind is exactly the paper's ``σ_k = σ_start · (σ_end/σ_start)^((k-1)/(K-1))``. Note what this
formula implies: the last stage (``k = K-1``) uses ``t = (K-2)/(K-1)``, i.e. σ never quite reaches ``σ_end`` (K=10,
1e-2 → 1e-4 ends at 1.67e-4). ``reach_end=True`` uses ``t_k = (k-1)/(K-2)`` instead, so stage ``K-1`` is exactly
``σ_end`` (with K=2 there is only one noisy stage and it uses ``σ_start``).

Shapes (``a = σ_start``, ``b = σ_end``, ``t`` in [0, 1]):

=============== ======================================================= ==================================
kind            σ(t)                                                    note
=============== ======================================================= ==================================
exponential     ``a · (b/a)^t``                                         paper default; needs a, b > 0
linear          ``a + (b - a) · t``
cosine          ``b + (a - b) · (1 + cos(π t)) / 2``
logarithmic     ``a - (a - b) · ln(1 + (e - 1) t)``                     drops fast early, flattens late
constant        ``a`` at every step, stage 0 included (``b`` ignored)    an ablation / measurement baseline
=============== ======================================================= ==================================

Stage boundaries: with ``T = total_steps`` and 0-based ``step``, ``stage(step) = min(K-1, ⌊step·K / T⌋)``, i.e. stage
``k`` covers steps ``[⌈k·T/K⌉, ⌈(k+1)·T/K⌉)``. Stage lengths differ by at most one step; when ``K`` divides ``T`` this
is exactly the paper's Algorithm 1 (``steps_per_stage = T/K``, ``k = ⌊(step_1based - 1)/steps_per_stage⌋``). Steps at or
past ``T`` stay in the last stage (the paper's ``⌊T/K⌋`` rounding would spill them into a stage ``K``). If ``T < K``
some stages are empty (skipped).

A schedule is a pure function of ``step``: its state (``state_dict()``) is its configuration, so a resumed run that
reloads it and resumes at the same step lands in the same stage with the same σ.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "SCHEDULE_KINDS",
    "ConstantSigmaSchedule",
    "CosineSigmaSchedule",
    "ExponentialSigmaSchedule",
    "LinearSigmaSchedule",
    "LogarithmicSigmaSchedule",
    "SigmaSchedule",
    "make_schedule",
    "schedule_from_state_dict",
]

_STATE_VERSION = 1


def _check_sigma(name: str, value: float) -> float:
    if isinstance(value, bool):  # float(True) is 1.0: σ = 1, a hundred times the paper's largest
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a number, got {value!r}") from e
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (it is a standard deviation), got {value}")
    return value


def _check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    if value is None:
        raise ValueError(f"{name} is unknown (None){hint}")
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)  # a numpy integer (a step count computed with numpy)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}{hint}")
    return value


def _lerp(a: float, b: float, s: float) -> float:
    """``a + (b - a) · s``, with ``s >= 1`` giving ``b`` exactly (the formula alone misses it by a rounding: 0.01 → 1e-4
    ended at 9.99999999999994e-05); ``s = 0`` gives ``a`` and ``a == b`` gives ``a`` at every ``s``."""
    return b if s >= 1.0 else a + (b - a) * s


class SigmaSchedule:
    """Base class: K equal stages over ``total_steps``, stage 0 noise-free, a decay shape over stages 1..K-1.

    Args:
        sigma_start: σ of stage 1 (float >= 0). Typical 1e-2.
        sigma_end: σ the decay heads to (float >= 0). Typical 1e-4 or 5e-4.
        num_stages: K, number of stages including the noise-free stage 0 (int >= 2). Typical 10.
        total_steps: number of training steps the stages are spread over (int >= 1). Required: pass e.g. the
            trainer's ``max_steps``.
        reach_end: False (paper): ``t_k = (k-1)/(K-1)``; True: ``t_k = (k-1)/(K-2)`` so stage K-1 is exactly
            ``sigma_end``.

    Raises:
        ValueError: σ < 0 or not finite, ``num_stages < 2``, ``total_steps`` None or <= 0.
    """

    kind: ClassVar[str] = ""
    noise_in_stage0: ClassVar[bool] = False

    def __init__(
        self,
        sigma_start: float = 1e-2,
        sigma_end: float = 1e-4,
        num_stages: int = 10,
        total_steps: int | None = None,
        *,
        reach_end: bool = False,
    ) -> None:
        self._configure(sigma_start, sigma_end, num_stages, total_steps, reach_end)

    # ------------------------------------------------------------------ configuration
    def _configure(
        self, sigma_start: float, sigma_end: float, num_stages: int, total_steps: int | None, reach_end: bool
    ) -> None:
        sigma_start = _check_sigma("sigma_start", sigma_start)
        sigma_end = _check_sigma("sigma_end", sigma_end)
        num_stages = _check_int(
            "num_stages", num_stages, 2, " (stage 0 is noise-free, so AQN needs at least one noisy stage: K >= 2)"
        )
        total_steps = _check_int(
            "total_steps",
            total_steps,
            1,
            ": the schedule needs the number of training steps to place its stages (pass e.g. the trainer's max_steps)",
        )
        self._validate_shape(sigma_start, sigma_end)
        self.sigma_start = sigma_start
        self.sigma_end = sigma_end
        self.num_stages = num_stages
        self.total_steps = total_steps
        self.reach_end = bool(reach_end)

    def _validate_shape(self, sigma_start: float, sigma_end: float) -> None:
        """Hook for shape-specific checks (exponential needs both ends > 0)."""

    # ------------------------------------------------------------------ stages
    def stage(self, step: int) -> int:
        """Stage index in ``[0, K-1]`` of the 0-based training ``step`` (steps >= total_steps stay in stage K-1)."""
        step = _check_int("step", step, 0)
        return min(self.num_stages - 1, step * self.num_stages // self.total_steps)

    def stage_start(self, stage: int) -> int:
        """First step of ``stage`` (``⌈stage·T/K⌉``); ``stage_start(K) == total_steps``."""
        stage = _check_int("stage", stage, 0)
        if stage > self.num_stages:
            raise ValueError(f"stage must be <= num_stages={self.num_stages}, got {stage}")
        return -(-stage * self.total_steps // self.num_stages)

    def stage_bounds(self) -> list[tuple[int, int]]:
        """``[(first_step, end_step_exclusive)]`` for each of the K stages (an empty range when T < K)."""
        return [(self.stage_start(k), self.stage_start(k + 1)) for k in range(self.num_stages)]

    def progress(self, stage: int) -> float:
        """Decay progress ``t`` in [0, 1] of a noisy stage ``stage >= 1`` (see module docstring)."""
        stage = _check_int("stage", stage, 0)
        if stage >= self.num_stages:
            raise ValueError(f"stage must be < num_stages={self.num_stages}, got {stage}")
        if stage == 0:
            return 0.0
        denom = self.num_stages - 2 if self.reach_end else self.num_stages - 1
        return 0.0 if denom <= 0 else (stage - 1) / denom

    # ------------------------------------------------------------------ σ
    def shape(self, t: float) -> float:
        """σ at decay progress ``t`` in [0, 1]; ``shape(0) == sigma_start``, ``shape(1) == sigma_end``."""
        raise NotImplementedError

    def sigma_for_stage(self, stage: int) -> float:
        """σ used throughout ``stage`` (0.0 for stage 0, except the constant kind)."""
        t = self.progress(stage)
        if stage == 0 and not self.noise_in_stage0:
            return 0.0
        return float(max(0.0, self.shape(t)))

    def sigma(self, step: int) -> float:
        """σ (float >= 0) of the noise added to the norm weights at 0-based training ``step``."""
        return self.sigma_for_stage(self.stage(step))

    def stage_sigmas(self) -> list[float]:
        """σ of each of the K stages."""
        return [self.sigma_for_stage(k) for k in range(self.num_stages)]

    def __call__(self, step: int) -> float:
        return self.sigma(step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON / ``torch.save`` friendly) from which the schedule is rebuilt exactly."""
        return {
            "version": _STATE_VERSION,
            "kind": self.kind,
            "sigma_start": self.sigma_start,
            "sigma_end": self.sigma_end,
            "num_stages": self.num_stages,
            "total_steps": self.total_steps,
            "reach_end": self.reach_end,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. The kind must match (use :func:`schedule_from_state_dict` otherwise)."""
        kind = state.get("kind")
        if kind != self.kind:
            raise ValueError(
                f"state_dict is for a {kind!r} schedule, this is {self.kind!r}; use aqn.schedule_from_state_dict"
            )
        version = state.get("version", _STATE_VERSION)
        if version > _STATE_VERSION:
            raise ValueError(f"state_dict version {version} is newer than this aqn ({_STATE_VERSION})")
        missing = [k for k in ("sigma_start", "sigma_end", "num_stages", "total_steps") if k not in state]
        if missing:  # a state edited by hand or cut down: say which key, not a bare KeyError
            raise ValueError(f"schedule state has no {missing[0]!r}")
        self._configure(
            state["sigma_start"],
            state["sigma_end"],
            state["num_stages"],
            state["total_steps"],
            state.get("reach_end", False),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SigmaSchedule) and self.state_dict() == other.state_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.state_dict().items())))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sigma_start={self.sigma_start:g}, sigma_end={self.sigma_end:g}, "
            f"num_stages={self.num_stages}, total_steps={self.total_steps}, reach_end={self.reach_end})"
        )


class ExponentialSigmaSchedule(SigmaSchedule):
    """``σ(t) = σ_start · (σ_end/σ_start)^t`` (the paper's default; both ends must be > 0)."""

    kind = "exponential"

    def _validate_shape(self, sigma_start: float, sigma_end: float) -> None:
        if sigma_start <= 0 or sigma_end <= 0:
            raise ValueError(
                f"the exponential schedule needs sigma_start > 0 and sigma_end > 0 (got {sigma_start:g}, "
                f"{sigma_end:g}); use kind='linear' to decay to 0"
            )

    def shape(self, t: float) -> float:
        if t >= 1.0:  # a · (b/a) is b only up to rounding
            return self.sigma_end
        return self.sigma_start * (self.sigma_end / self.sigma_start) ** t


class LinearSigmaSchedule(SigmaSchedule):
    """``σ(t) = σ_start + (σ_end - σ_start) · t``."""

    kind = "linear"

    def shape(self, t: float) -> float:
        return _lerp(self.sigma_start, self.sigma_end, t)


class CosineSigmaSchedule(SigmaSchedule):
    """``σ(t) = σ_end + (σ_start - σ_end) · (1 + cos(π t)) / 2`` (slow at both ends)."""

    kind = "cosine"

    def shape(self, t: float) -> float:
        return _lerp(self.sigma_start, self.sigma_end, 0.5 * (1.0 - math.cos(math.pi * t)))


class LogarithmicSigmaSchedule(SigmaSchedule):
    """``σ(t) = σ_start - (σ_start - σ_end) · ln(1 + (e - 1) t)``: sharp early drop, flat late (paper Fig. 15)."""

    kind = "logarithmic"

    def shape(self, t: float) -> float:
        return _lerp(self.sigma_start, self.sigma_end, math.log1p((math.e - 1.0) * t) / math.log1p(math.e - 1.0))


class ConstantSigmaSchedule(SigmaSchedule):
    """``σ = σ_start`` at every step, stage 0 included (``sigma_end`` is ignored but kept in the state).

    Stages are still computed (``stage(step)`` works) so logs line up with the decaying kinds.
    """

    kind = "constant"
    noise_in_stage0 = True

    def shape(self, t: float) -> float:
        return self.sigma_start


_KINDS: dict[str, type[SigmaSchedule]] = {
    cls.kind: cls
    for cls in (
        ExponentialSigmaSchedule,
        LinearSigmaSchedule,
        CosineSigmaSchedule,
        LogarithmicSigmaSchedule,
        ConstantSigmaSchedule,
    )
}
SCHEDULE_KINDS: tuple[str, ...] = tuple(_KINDS)
_ALIASES = {"exp": "exponential", "log": "logarithmic", "cos": "cosine", "const": "constant"}


def make_schedule(
    kind: str = "exponential",
    sigma_start: float = 1e-2,
    sigma_end: float = 1e-4,
    num_stages: int = 10,
    total_steps: int | None = None,
    *,
    reach_end: bool = False,
) -> SigmaSchedule:
    """Build a schedule by name: one of :data:`SCHEDULE_KINDS` (``exp``, ``log``, ``cos``, ``const`` also accepted)."""
    key = _ALIASES.get(str(kind).lower(), str(kind).lower())
    if key not in _KINDS:
        raise ValueError(f"unknown AQN schedule kind {kind!r}; expected one of {SCHEDULE_KINDS}")
    return _KINDS[key](sigma_start, sigma_end, num_stages, total_steps, reach_end=reach_end)


def schedule_from_state_dict(state: dict[str, Any]) -> SigmaSchedule:
    """Rebuild any schedule from its :meth:`SigmaSchedule.state_dict`."""
    if not isinstance(state, Mapping):
        raise ValueError(f"schedule state must be a mapping, got {type(state).__name__}")
    kind = state.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"state_dict has unknown schedule kind {kind!r}; expected one of {SCHEDULE_KINDS}")
    sched = _KINDS[kind].__new__(_KINDS[kind])
    sched.load_state_dict(state)
    return sched
