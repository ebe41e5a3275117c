"""QeRL trainers: GRPO/DAPO over TRL with an NVFP4 policy, LoRA adapters and Adaptive Quantization Noise.

- :class:`QeRLGRPOTrainer` / :class:`QeRLConfig`: TRL's ``GRPOTrainer`` with an NVFP4 base, LoRA and AQN;
- :class:`QeRLDAPOTrainer` / :class:`QeRLDAPOConfig`: DAPO (clip-higher, token-level loss, dynamic sampling,
  overlong shaping, β = 0);
- :mod:`qerl_trl.tasks` (gsm8k, math, bigmath, arithmetic), :mod:`qerl_trl.rewards`, :mod:`qerl_trl.evaluation`;
- ``qerl train`` / ``qerl eval`` (:mod:`qerl_trl.cli`).
"""

from .config import QeRLConfig, QeRLDAPOConfig
from .dapo import OverlongPenalty, QeRLDAPOTrainer
from .policy import load_policy, load_tokenizer
from .trainer import QeRLGRPOTrainer

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
