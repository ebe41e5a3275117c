"""QeRL trainers: GRPO/DAPO over TRL with an NVFP4 policy, LoRA adapters and Adaptive Quantization Noise.

- :class:`QeRLGRPOTrainer` / :class:`QeRLConfig`: TRL's ``GRPOTrainer`` with an NVFP4 base, LoRA and AQN;
- :class:`QeRLDAPOTrainer` / :class:`QeRLDAPOConfig`: DAPO (clip-higher, token-level loss, dynamic sampling,
  overlong shaping, β = 0);
- :mod:`qerl_trl.tasks` (gsm8k, math, bigmath, arithmetic), :mod:`qerl_trl.rewards`, :mod:`qerl_trl.evaluation`;
- :func:`qerl_trl.rollout.graph.generate.graph_generate`: a decode loop replaying one CUDA graph per step (sampling included);
- ``qerl train`` / ``qerl eval`` (:mod:`qerl_trl.cli`).

The names below are imported on first use (PEP 562), so that importing a light submodule such as
:mod:`qerl_trl.rollout.graph.generate` does not import trl.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import QeRLConfig, QeRLDAPOConfig
    from .dapo import OverlongPenalty, QeRLDAPOTrainer
    from .policy import load_policy, load_tokenizer
    from .trainer import QeRLGRPOTrainer

_LAZY = {
    "OverlongPenalty": ".dapo",
    "QeRLConfig": ".config",
    "QeRLDAPOConfig": ".config",
    "QeRLDAPOTrainer": ".dapo",
    "QeRLGRPOTrainer": ".trainer",
    "load_policy": ".policy",
    "load_tokenizer": ".policy",
}
__all__ = [
    "OverlongPenalty",
    "QeRLConfig",
    "QeRLDAPOConfig",
    "QeRLDAPOTrainer",
    "QeRLGRPOTrainer",
    "load_policy",
    "load_tokenizer",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
