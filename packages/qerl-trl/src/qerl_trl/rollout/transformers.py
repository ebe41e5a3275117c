"""``rollout_engine="transformers"``: the policy's own ``generate``, through TRL's regular generation path.

Each GRPO group's prompt is prefilled once where the KV cache is dynamic (:func:`generate_from_shared_prefix`).
On CUDA with ``cache_implementation="static"``, transformers' compiled decode (CUDA graphs) is turned back on
(:func:`compiled_generation_config`): TRL 1.16 builds its generation config with ``disable_compile=True``, and an eager
static-cache ``generate`` is launch-bound.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig
from trl import GRPOTrainer

from .base import RolloutEngine, generate_padded

__all__ = ["TransformersRollout", "compiled_generation_config", "generate_from_shared_prefix", "generation_cache_len"]


class TransformersRollout(RolloutEngine):
    """TRL's own generation (``generate`` of the unwrapped policy, or continuous batching); AQN on the policy itself."""

    name = "transformers"
    holds_generation_memory = True  # the policy's own KV cache, on the training GPU: the whole batch must fit

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse ``generation_kwargs`` keys that are no ``GenerationConfig`` setting: TRL passes them to
        ``GenerationConfig(**...)``, which keeps any key as an attribute that ``generate`` never reads (vLLM's
        ``min_tokens``, ``stop``, ... would be dropped silently, while the vLLM engine applies them). And
        ``stop_strings``, which ``generate`` takes only with a tokenizer that TRL's call does not pass."""
        super().check_config(cfg)
        known = GenerationConfig().to_dict()
        unknown = sorted(k for k in (cfg.generation_kwargs or {}) if k not in known)
        if unknown:
            raise ValueError(f"rollout_engine='transformers' ignores generation_kwargs {unknown}: they are no "
                             "transformers GenerationConfig settings (vLLM SamplingParams names?); use GenerationConfig "
                             "names (e.g. min_new_tokens, eos_token_id) or rollout_engine='vllm'")  # fmt: skip
        top_k = (cfg.generation_kwargs or {}).get("top_k", cfg.top_k)
        if top_k is not None and top_k < 0:  # generate's top-k warper raises on it, at the first step
            raise ValueError(f"rollout_engine='transformers' takes top_k=0 (or None) for no top-k, not {top_k} "
                             "(vLLM's spelling)")  # fmt: skip
        if (cfg.generation_kwargs or {}).get("num_return_sequences", 1) != 1:  # k rows per prompt row
            raise ValueError("rollout_engine='transformers' generates one completion per prompt row (TRL repeats each "
                             "prompt num_generations times): set num_generations, not "
                             "generation_kwargs['num_return_sequences']")  # fmt: skip
        if (cfg.generation_kwargs or {}).get("stop_strings"):  # generate() raises without one, at the first step
            raise ValueError("rollout_engine='transformers' cannot stop on generation_kwargs['stop_strings']: TRL's "
                             "generate call passes no tokenizer; use eos_token_id, or rollout_engine='vllm' with "
                             "stop")  # fmt: skip

    @classmethod
    def check_evaluation(cls, scheme) -> None:
        """Every ``quantization`` evaluates through the model's own ``generate``."""

    @classmethod
    def evaluation_generator(cls, model_name, model, scheme, *, seed, dtype, adapter) -> None:
        """``qerl eval --engine transformers``: the evaluated model generates itself."""
        return None

    @classmethod
    def compile_decode(cls, trainer, options):
        """transformers' compiled decode with ``CompileConfig(**options)``, on any device (the trainer turns it on on
        CUDA only); a dynamic KV cache stays eager."""
        gen = trainer.generation_config
        if options is None or gen.cache_implementation != "static":
            return None
        _turn_on_compile(gen, trainer.args, options)
        if trainer.accelerator.device.type != "cuda":
            gen.compile_config._compile_all_devices = True  # generate compiles on CUDA only unless told
        return repr(gen.compile_config)

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        super().__init__(trainer)
        if trainer.accelerator.device.type == "cuda":
            compiled_generation_config(trainer.generation_config, trainer.args)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._shares_prompt_prefill(prompt_ids, images, multimodal_fields, has_tool_images):
            return self._generate_shared_prefill(prompt_ids)
        return GRPOTrainer._generate_single_turn(
            self.trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )

    def _shares_prompt_prefill(self, prompt_ids, images, multimodal_fields, has_tool_images) -> bool:
        """Whether :meth:`_generate_shared_prefill` applies: a dynamic KV cache (not the compiled static one, not
        continuous batching), text-only prompts, a prompt repeated in consecutive rows (GRPO's groups), and AQN drawn
        once per generation step (``per_forward`` would see one more forward)."""
        trainer = self.trainer
        gen = trainer.generation_config
        return (
            not trainer.use_transformers_continuous_batching
            and gen.cache_implementation in (None, "dynamic")
            and (gen.num_beams or 1) == 1
            and not has_tool_images
            and not multimodal_fields
            and (images is None or all(im is None for im in images))
            and not (trainer.args.aqn and trainer.args.aqn_mode != "per_step")
            and any(list(a) == list(b) for a, b in zip(prompt_ids, prompt_ids[1:]))
        )

    def _generate_shared_prefill(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], None]:
        """TRL 1.16's regular generation path (:func:`~qerl_trl.rollout.base.generate_padded`) with the KV cache of
        each run of identical prompts (a GRPO group: ``num_generations`` rows) computed for one row and copied to the
        others before ``generate`` (:func:`generate_from_shared_prefix`). The same sampling, one prefill per prompt
        instead of per completion: the offline default's 62-token prompts cost 8x its 12 new tokens."""
        gen = self.trainer.generation_config
        return generate_padded(
            self.trainer,
            prompt_ids,
            "transformers.generate",
            lambda model, input_ids, attention_mask: generate_from_shared_prefix(
                model, input_ids, attention_mask, generation_config=gen
            ),
        ), None


def generate_from_shared_prefix(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generate_kwargs: Any
) -> torch.Tensor:
    """``model.generate(input_ids, attention_mask, **generate_kwargs)`` with each run of identical consecutive rows
    (the same prompt, e.g. a GRPO group) prefilled once.

    ``input_ids`` / ``attention_mask``: ``[B, T]``, left-padded. All but the last prompt token of one row per run go
    through the model (positions as ``generate`` numbers them: ``cumsum(mask) - 1``, 0 on padding), the dynamic KV
    cache is copied to every row of its run, and ``generate`` continues from it (transformers' prefix caching: it
    feeds only the tokens the cache lacks). The same distribution as plain ``generate``; not the same bits, since
    the prompt's GEMMs have other shapes. Returns ``[B, T + new]`` as ``generate`` does.
    """
    from transformers import DynamicCache

    b, t = input_ids.shape
    new_run = torch.ones(b, dtype=torch.bool, device=input_ids.device)
    if b > 1:
        new_run[1:] = (input_ids[1:] != input_ids[:-1]).any(-1) | (attention_mask[1:] != attention_mask[:-1]).any(-1)
    firsts = new_run.nonzero().squeeze(-1)
    if t < 2 or len(firsts) == b:  # nothing to share
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    run_of_row = new_run.long().cumsum(0) - 1  # which run (prefilled row) each row copies
    prefix_mask = attention_mask[firsts, :-1]
    position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
    out = model(input_ids=input_ids[firsts, :-1], attention_mask=prefix_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1)  # fmt: skip
    cache = out.past_key_values
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"generate_from_shared_prefix needs a DynamicCache, the model returned {type(cache).__name__}")
    del out
    cache.batch_select_indices(run_of_row)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **generate_kwargs)


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
    _turn_on_compile(generation_config, args, {"dynamic": False})  # inductor, mode="reduce-overhead"
    return generation_config


def _turn_on_compile(generation_config: GenerationConfig, args: Any, options: dict[str, Any]) -> None:
    """``generate``'s compiled decode with ``CompileConfig(**options)`` over a static cache of the fixed length
    :func:`generation_cache_len` gives (what TRL's ``disable_compile=True`` leaves off)."""
    from transformers.generation.configuration_utils import CompileConfig

    generation_config.disable_compile = False
    generation_config.compile_config = CompileConfig(**options)
    generation_config.max_cache_len = generation_cache_len(generation_config, args)
