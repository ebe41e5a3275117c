"""Adaptive Quantization Noise (AQN): annealed channel-wise Gaussian noise on RMSNorm weights for RL exploration.

Adding ``Z ~ N(0, σ²)`` (``[d]``) to an RMSNorm weight ``w`` equals multiplying the input columns of the linears it
feeds (q/k/v; gate/up) by ``1 + Z/w`` at no kernel cost. σ follows a staged schedule (stage 0 noise-free).

Public API:

- schedules: :class:`SigmaSchedule` and its kinds, :func:`make_schedule`, :func:`schedule_from_state_dict`;
- discovery: :func:`find_norm_linear_pairs` → :class:`NormLinearGroup` (structural, by tracing a forward);
- noise: :class:`NormNoise` (``apply`` / ``apply_per_forward`` → :class:`NoiseHandle` with ``restore``),
  :func:`noisy_norm_weights` (copies for an external engine), :func:`measure_rounding_survival`;
- driver: :class:`AQNController` (``begin_rollout`` / ``end_rollout``, state for resume).

Imports torch only.
"""

from .controller import AQNController
from .discovery import NormLinearGroup, find_norm_linear_pairs, is_linear_like, is_rmsnorm_like
from .noise import (
    NoiseHandle,
    NormNoise,
    measure_rounding_survival,
    noise_seed,
    noisy_norm_weights,
    sample_noise,
)
from .schedules import (
    SCHEDULE_KINDS,
    ConstantSigmaSchedule,
    CosineSigmaSchedule,
    ExponentialSigmaSchedule,
    LinearSigmaSchedule,
    LogarithmicSigmaSchedule,
    SigmaSchedule,
    make_schedule,
    schedule_from_state_dict,
)

__version__ = "0.1.0"

__all__ = [
    "SCHEDULE_KINDS",
    "AQNController",
    "ConstantSigmaSchedule",
    "CosineSigmaSchedule",
    "ExponentialSigmaSchedule",
    "LinearSigmaSchedule",
    "LogarithmicSigmaSchedule",
    "NoiseHandle",
    "NormLinearGroup",
    "NormNoise",
    "SigmaSchedule",
    "find_norm_linear_pairs",
    "is_linear_like",
    "is_rmsnorm_like",
    "make_schedule",
    "measure_rounding_survival",
    "noise_seed",
    "noisy_norm_weights",
    "sample_noise",
    "schedule_from_state_dict",
]
