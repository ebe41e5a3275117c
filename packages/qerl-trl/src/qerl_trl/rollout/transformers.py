"""``rollout_engine="transformers"``: the policy's own ``generate``, through TRL's regular generation path.

On CUDA with ``cache_implementation="static"``, transformers' compiled decode (CUDA graphs) is turned back on
(:func:`compiled_generation_config`): TRL 1.16 builds its generation config with ``disable_compile=True``, and an eager
static-cache ``generate`` is launch-bound.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig
from trl import GRPOTrainer

from .base import RolloutEngine

__all__ = ["TransformersRollout", "compiled_generation_config", "generation_cache_len"]


class TransformersRollout(RolloutEngine):
    """TRL's own generation (``generate`` of the unwrapped policy, or continuous batching); AQN on the policy itself."""

    name = "transformers"

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        super().__init__(trainer)
        if trainer.accelerator.device.type == "cuda":
            compiled_generation_config(trainer.generation_config, trainer.args)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return GRPOTrainer._generate_single_turn(
            self.trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )


def generation_cache_len(generation_config: GenerationConfig, args: Any) -> int:
    """The KV-cache length of the compiled rollouts, fixed for the run: ``generation_kwargs``' ``max_cache_len`` if set,
    else ``generation_prompt_cache_len + max_completion_length``. A fixed length lets every step replay the decode
    graphs recorded on the first one, whatever its prompt lengths (the graphs are specialised to the cache shape)."""
    fixed = getattr(generation_config, "max_cache_len", None)
    return fixed if fixed is not None else args.generation_prompt_cache_len + args.max_completion_length


def compiled_generation_config(generation_config: GenerationConfig, args: Any) -> GenerationConfig:
    """Turn on transformers' compiled decode (CUDA graphs) in TRL's generation config, in place.

    Applies when ``args.compile_generation`` and ``cache_implementation == "static"``: TRL 1.16 creates the config with
    ``disable_compile=True``, which leaves a static-cache ``generate`` eager and launch-bound. The cache gets a fixed
    length (``generation_prompt_cache_len + max_completion_length`` unless ``generation_kwargs`` set
    ``max_cache_len``), so prompts of any length up to that replay the same graphs instead of recompiling.
    The decode graph is specialised to the batch size (``dynamic=False``); the AQN noise changes norm weights in
    place, which the graphs read, so it needs no recompile (measured: ``benchmarks/grpo_step.py``).
    """
    if not args.compile_generation or generation_config.cache_implementation != "static":
        return generation_config
    from transformers.generation.configuration_utils import CompileConfig

    generation_config.disable_compile = False
    generation_config.compile_config = CompileConfig(dynamic=False)  # inductor, mode="reduce-overhead"
    generation_config.max_cache_len = generation_cache_len(generation_config, args)
    return generation_config
