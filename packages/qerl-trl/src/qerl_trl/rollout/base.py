"""The interface every rollout engine of :class:`~qerl_trl.QeRLGRPOTrainer` implements.

The trainer holds one engine (``trainer.rollout``) and calls it at three points of a generation step, whatever the
engine: :meth:`RolloutEngine.set_noise` around the generation (AQN on the norm weights the engine generates from),
:meth:`RolloutEngine.generate` for each generation call, and :meth:`RolloutEngine.close` when done. Engines that
generate from a copy of the policy (vLLM) also take the LoRA adapter (:meth:`RolloutEngine.sync_lora`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

if TYPE_CHECKING:
    from aqn import AQNController
    from aqn.controller import NormWeightsEngine

    from ..quantization import QuantScheme

__all__ = ["RolloutEngine"]


class RolloutEngine:
    """One way of generating a GRPO step's completions from the trainer's policy.

    Args:
        trainer: the :class:`~qerl_trl.QeRLGRPOTrainer` the engine generates for (its settings, generation config,
            tokenizer, accelerator, model).
        prepared: what :meth:`prepare` returned for this run.

    Class attributes:
        name: the ``rollout_engine`` value that selects it.
        seeds_per_prompt: whether ``rollout_seed_per_prompt`` works with it (it samples with the torch RNG).
    """

    name: ClassVar[str]
    seeds_per_prompt: ClassVar[bool] = True

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        self.trainer = trainer

    @classmethod
    def prepare(cls, model_name: str | None, model: nn.Module, scheme: QuantScheme, args: Any) -> Any:
        """Work on the loaded policy before PEFT wraps it (vLLM: save the checkpoint its engine loads); default none."""
        return None

    def generate(
        self,
        prompt_ids: list[list[int]],
        images: list | None,
        multimodal_fields: dict | None,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One generation call (TRL's ``_generate_single_turn`` contract): ``(completion_ids, logprobs)``, the
        completions cut after their first EOS, logprobs of the sampled tokens or ``None``."""
        raise NotImplementedError

    def sync_lora(self) -> None:
        """Give the engine the policy's current LoRA adapter; nothing to do for an engine that generates with the
        policy itself."""

    @property
    def noise_target(self) -> NormWeightsEngine | None:
        """Where AQN's noisy norm weights go: ``None`` for the policy itself, else the engine holding its own copy."""
        return None

    def set_noise(self, controller: AQNController | None, model: nn.Module, step: int) -> contextlib.AbstractContextManager:
        """Context manager: the step's AQN noise on the norm weights this engine generates from (``model``'s, or the
        engine's copy of them), restored after; nothing without a controller (AQN off)."""
        if controller is None:
            return contextlib.nullcontext()
        return controller.rollout(model, step, engine=self.noise_target)

    def close(self) -> None:
        """Release what the engine holds (processes, GPU memory); nothing for the in-process engines."""
