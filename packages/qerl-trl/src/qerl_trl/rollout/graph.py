"""``rollout_engine="graph"``: the policy generates through :func:`qerl_trl.graph_generate.graph_generate`.

Why not ``generate``: it graphs only the decode forward and syncs the GPU to the host every token, which left an H100
idle for longer than a 7B step's GEMMs (:mod:`qerl_trl.graph_generate`). One compiled CUDA graph per decode step with
the sampling inside, no host sync per step; plain temperature sampling only (``QeRLConfig`` refuses the settings it
cannot honour), text-only prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..graph_generate import graph_generate
from .base import RolloutEngine, generate_padded
from .transformers import generation_cache_len

__all__ = ["GraphRollout"]


class GraphRollout(RolloutEngine):
    """TRL's regular path with :func:`~qerl_trl.graph_generate.graph_generate` in place of ``generate``; AQN on the
    policy itself (the noisy norms are what its compiled step reads). ``trainer.graph_generate_kwargs`` adds
    ``graph_generate`` keywords (``compile``, ``compile_options``, ``check_every``, ``compact``, ...)."""

    name = "graph"

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        super().__init__(trainer)
        if trainer._is_vlm:
            raise NotImplementedError("rollout_engine='graph' supports text-only models; use 'transformers' or 'vllm'")

    def generate(
        self,
        prompt_ids: list[list[int]],
        images: list | None,
        multimodal_fields: dict | None,
        num_generations: int = 1,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], None]:
        """TRL 1.16's regular generation path with ``graph_generate`` in place of ``unwrapped_model.generate``.

        Why not ``generate``: it graphs only the decode forward and syncs the GPU to the host every token, which left
        an H100 idle for longer than a 7B step's GEMMs (:mod:`qerl_trl.graph_generate`). What stays TRL's: the left
        padding (``pad``, ``pad_to_multiple_of``), the context managers (unwrapped model with gradient checkpointing
        off, no grad, FSDP full params), and the post-processing (the tokens after the padded prompt, cut after the
        first EOS). The sampling settings are read from TRL's generation config (``QeRLConfig`` refused those
        ``graph_generate`` cannot honour), and the KV cache has the run's fixed length
        (:func:`generation_cache_len`), so the graph recorded on the first step is replayed on later ones.
        """
        if has_tool_images or (images is not None and any(im is not None for im in images)) or multimodal_fields:
            raise NotImplementedError(
                "rollout_engine='graph' generates from text-only prompts; use rollout_engine='transformers' for "
                "prompts with images or other multimodal inputs"
            )
        trainer = self.trainer
        gen = trainer.generation_config
        cache_len = generation_cache_len(gen, trainer.args)

        def run(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            prompt_length = input_ids.size(1)
            if prompt_length + gen.max_new_tokens > cache_len:
                raise ValueError(
                    f"rollout_engine='graph': a prompt of {prompt_length} tokens (padded) + {gen.max_new_tokens} new "
                    f"tokens does not fit the run's fixed KV cache of {cache_len} tokens (generation_prompt_cache_len "
                    f"{trainer.args.generation_prompt_cache_len} + max_completion_length "
                    f"{trainer.args.max_completion_length}, or generation_kwargs['max_cache_len']): raise "
                    "generation_prompt_cache_len or shorten the prompts"
                )
            return graph_generate(
                model,
                input_ids,
                attention_mask,
                max_new_tokens=gen.max_new_tokens,
                min_new_tokens=gen.min_new_tokens or 0,
                temperature=gen.temperature,
                do_sample=gen.do_sample,
                eos_token_id=gen.eos_token_id,
                pad_token_id=gen.pad_token_id,
                max_cache_len=cache_len,
                **{"max_rows": trainer.args.generation_wave_rows, **trainer.graph_generate_kwargs},
            )

        return generate_padded(trainer, prompt_ids, "graph_generate", run), None
