"""``rollout_engine="graph"``: the policy generates through :func:`qerl_trl.rollout.graph.generate.graph_generate`.

Why not ``generate``: it graphs only the decode forward and syncs the GPU to the host every token, which left an H100
idle for longer than a 7B step's GEMMs (:mod:`qerl_trl.rollout.graph.generate`). One compiled CUDA graph per decode step with
the sampling inside, no host sync per step; plain temperature sampling only (``QeRLConfig`` refuses the settings it
cannot honour), text-only prompts.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from nvfp4.fp8_model import fp8_rollouts

from ..base import RolloutEngine, generate_padded
from ..transformers import generation_cache_len
from .generate import graph_generate

__all__ = ["GraphRollout"]

logger = logging.getLogger(__name__)

#: sampling settings (GRPOConfig fields or generation_kwargs keys) and the values at which they do nothing (TRL 1.16
#: defaults: top_p 1.0, top_k 0, min_p None, repetition_penalty 1.0; -1 is vLLM's "no top-k").
NEUTRAL_SAMPLING: dict[str, tuple] = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0),
}
#: generation_kwargs keys graph_generate honours (read back from TRL's generation config) or that do not change the
#: sampled distribution (its cache is always a static one).
HONOURED_KWARGS = frozenset(
    {"max_new_tokens", "min_new_tokens", "temperature", "do_sample", "eos_token_id", "pad_token_id", "bos_token_id",
     "max_cache_len", "cache_implementation"}
)  # fmt: skip


class GraphRollout(RolloutEngine):
    """TRL's regular path with :func:`~qerl_trl.rollout.graph.generate.graph_generate` in place of ``generate``; AQN on the
    policy itself (the noisy norms are what its compiled step reads). ``trainer.graph_generate_kwargs``, when a caller
    sets it (:meth:`compile_decode`), adds ``graph_generate`` keywords (``compile``, ``compile_options``,
    ``check_every``, ``compact``, ``compact_min_batch``); unset: its defaults (compiled with CUDA graphs on CUDA, eager
    elsewhere; finished rows compacted)."""

    name = "graph"
    holds_generation_memory = True  # the policy's own KV cache, on the training GPU
    generates_in_waves = True  # a batch that does not fit is decoded in waves of generation_wave_rows
    rollout_precisions = ("w4a16", "fp8", "auto")  # fp8 / auto: an E4M3 copy beside the policy (nvfp4.fp8_model)
    # graph_generate records each sampled token's logprob (float32 log_softmax(logits / temperature), as vLLM's
    # processed_logprobs): TRL's importance-sampling correction then covers the FP8 rollouts' gap to the trainer
    sampling_logprobs = True
    fixed_cache = True  # one KV-cache length for the run: CUDA graphs recorded once, replayed every step

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse, at config time, what ``graph_generate`` cannot do.

        It samples from ``softmax(logits / temperature)`` in one compiled graph per token, so any other logits
        processing TRL's ``generate`` would apply (nucleus/top-k/min-p filtering, repetition penalty, beams, ...)
        would be silently dropped: the rollouts would come from another distribution than the one configured. The
        graph is replayed per token, so AQN noise cannot be redrawn per forward.
        """
        super().check_config(cfg)
        if cfg.use_vllm or cfg.use_transformers_continuous_batching:
            raise ValueError(
                "rollout_engine='graph' generates with qerl_trl.graph_generate: keep use_vllm=False and "
                "use_transformers_continuous_batching=False"
            )
        kwargs = dict(cfg.generation_kwargs or {})
        settings = {k: kwargs.get(k, getattr(cfg, k)) for k in NEUTRAL_SAMPLING}
        bad = [f"{k}={v!r}" for k, v in settings.items() if v not in NEUTRAL_SAMPLING[k]]
        bad += [f"generation_kwargs[{k!r}]" for k in kwargs if k not in NEUTRAL_SAMPLING and k not in HONOURED_KWARGS]
        if bad:
            raise ValueError(
                f"rollout_engine='graph' samples from softmax(logits / temperature) only and cannot honour "
                f"{', '.join(bad)}; use top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0 and generation_kwargs "
                f"among {sorted(HONOURED_KWARGS)}, or rollout_engine='transformers'"
            )
        if cfg.aqn and cfg.aqn_mode != "per_step":
            raise ValueError(
                "rollout_engine='graph' replays one compiled graph per token, which cannot redraw AQN noise per "
                "forward: use aqn_mode='per_step'"
            )

    @classmethod
    def compile_decode(cls, trainer, options):
        """``graph_generate``'s decode step compiled with ``options`` (``None``: eager), on any device; its KV cache is
        always static."""
        compiled = {"compile": options is not None} | ({"compile_options": options} if options else {})
        trainer.graph_generate_kwargs = getattr(trainer, "graph_generate_kwargs", {}) | compiled
        return options

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        super().__init__(trainer)
        if trainer._is_vlm:
            raise NotImplementedError("rollout_engine='graph' supports text-only models; use 'transformers' or 'vllm'")
        self._fp8_attached = False

    def before_train(self) -> None:
        """On CUDA with ``generation_wave_rows`` unset, before the first step: the memory plan
        (:func:`qerl_trl.memory_plan.preflight`) against the GPU's memory; generate in waves of the rows that fit (or
        raise :class:`~qerl_trl.memory_plan.MemoryPlanError`, one line, when not even one fits). ``qerl train`` has
        made the check before loading the model (and set ``generation_wave_rows`` when waves are needed); this covers
        the Python API. Then, with ``rollout_precision`` fp8 / auto, the FP8 copies (:meth:`_attach_fp8_copies`)."""
        self._plan_memory()
        self._attach_fp8_copies()  # after the plan, which counts them (and refuses a run they do not fit)

    def _plan_memory(self) -> None:
        trainer = self.trainer
        if trainer.accelerator.device.type != "cuda" or trainer.args.generation_wave_rows is not None:
            return
        from ...memory_plan import cuda_budget_bytes, preflight

        config = trainer.accelerator.unwrap_model(trainer.model).config
        plan = preflight(trainer.args, config, cuda_budget_bytes(trainer.accelerator.device),
                         world_size=trainer.accelerator.num_processes)  # fmt: skip
        if plan is not None and trainer.args.generation_wave_rows is not None:
            logger.warning("memory plan: %s", plan.summary())

    def _attach_fp8_copies(self) -> None:
        """``rollout_precision`` fp8 / auto: the E4M3 copy of every NVFP4 linear, made once (the first time training
        starts), beside the NVFP4 weights training keeps using; ``auto``'s crossover is the model shape's
        (:func:`nvfp4.rollout_precision.fp8_crossover_rows`). Logged in one line with its bytes."""
        precision = self.trainer.args.rollout_precision_spec
        if not precision.fp8_copy or self._fp8_attached:
            return
        from nvfp4.fp8_model import attach_fp8_copies
        from nvfp4.rollout_precision import model_crossover_rows

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        rows, measured = model_crossover_rows(model.config)
        held = attach_fp8_copies(model, precision, rows)
        self._fp8_attached = True
        when = "every call" if precision.name == "fp8" else (
            f"calls of >= {rows} rows ({'measured' if measured else 'not measured for this shape: the 7B value'})")
        logger.warning("rollout_precision=%s: FP8 copies of the NVFP4 linears, %.2f GB, used for %s",
                       precision.name, held / 1e9, when)  # fmt: skip

    def generate(
        self,
        prompt_ids: list[list[int]],
        images: list | None,
        multimodal_fields: dict | None,
        num_generations: int = 1,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """TRL 1.16's regular generation path with ``graph_generate`` in place of ``unwrapped_model.generate``:
        ``(completion_ids, logprobs)``, ``logprobs[i]`` the float32 logprobs of ``completion_ids[i]``'s tokens under the
        distribution they were sampled from (``graph_generate(..., return_logprobs=True)``), cut where the ids are.

        Why not ``generate``: it graphs only the decode forward and syncs the GPU to the host every token, which left
        an H100 idle for longer than a 7B step's GEMMs (:mod:`qerl_trl.rollout.graph.generate`). What stays TRL's: the left
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
        self._attach_fp8_copies()  # made once (before_train's, or here when generating before training starts)
        gen = trainer.generation_config
        cache_len = generation_cache_len(gen, trainer.args)

        def run(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            prompt_length = input_ids.size(1)
            if prompt_length + gen.max_new_tokens > cache_len:
                raise ValueError(
                    f"rollout_engine='graph': a prompt of {prompt_length} tokens (padded) + {gen.max_new_tokens} new "
                    f"tokens does not fit the run's fixed KV cache of {cache_len} tokens (generation_prompt_cache_len "
                    f"{trainer.args.generation_prompt_cache_len} + max_completion_length "
                    f"{trainer.args.max_completion_length}, or generation_kwargs['max_cache_len']): raise "
                    "generation_prompt_cache_len or shorten the prompts"
                )
            with fp8_rollouts(model):  # rollout_precision fp8 / auto: the layers' E4M3 copies (none: no change)
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
                    return_logprobs=True,
                    **{"max_rows": trainer.args.generation_wave_rows, **getattr(trainer, "graph_generate_kwargs", {})},
                )

        return generate_padded(trainer, prompt_ids, "graph_generate", run, logprobs=True)
