"""The interface every rollout engine of :class:`~qerl_trl.QeRLGRPOTrainer` implements.

An engine owns its rules: :meth:`RolloutEngine.check_config` refuses the settings it cannot honour (called once by
``QeRLConfig``, which resolves ``rollout_engine`` to the class), :attr:`RolloutEngine.holds_generation_memory` and
:attr:`RolloutEngine.generates_in_waves` are what the memory plan reads, and :meth:`RolloutEngine.before_train` is what
it sets up when training starts. The trainer holds one engine (``trainer.rollout``) and calls the interface only:
:meth:`RolloutEngine.before_train`, :meth:`RolloutEngine.sync_lora` once per ``global_step`` (an engine that
generates from a copy of the policy, vLLM, takes the LoRA adapter there; the others do nothing),
:meth:`RolloutEngine.set_noise` around the generation (AQN on the norm weights the engine generates from),
:meth:`RolloutEngine.generate` for each generation call, and :meth:`RolloutEngine.close` when the trainer is closed.
No engine writes the trainer's (TRL's) state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from aqn import AQNController
    from aqn.controller import NormWeightsEngine

    from ..quantization import QuantScheme

__all__ = ["RolloutEngine", "generate_padded"]

logger = logging.getLogger(__name__)


class RolloutEngine:
    """One way of generating a GRPO step's completions from the trainer's policy.

    Args:
        trainer: the :class:`~qerl_trl.QeRLGRPOTrainer` the engine generates for (its settings, generation config,
            tokenizer, accelerator, model).
        prepared: what :meth:`prepare` returned for this run.

    Class attributes:
        name: the ``rollout_engine`` value that selects it.
        seeds_per_prompt: whether ``rollout_seed_per_prompt`` works with it (it samples with the torch RNG).
        holds_generation_memory: whether its KV cache lives in the trainer's GPU memory beside the policy (the memory
            plan then counts it); ``False``: the engine sizes its own memory (vLLM). Every engine must say.
        generates_in_waves: whether it generates a batch that does not fit in waves of the rows that do (the memory
            plan then sets ``generation_wave_rows`` instead of refusing the run).
        sampling_logprobs: whether :meth:`generate` returns the sampled tokens' logprobs under the distribution they
            were sampled from (vLLM's ``processed_logprobs``; the graph engine's own, from its FP8 or W4A16 rollout
            forward): TRL's importance-sampling correction (``vllm_importance_sampling_*``) then applies.
        rollout_precisions: the ``rollout_precision`` values it honours (:mod:`nvfp4.rollout_precision`); the base
            class refuses the others in :meth:`check_config`.
        generates_from_copy: whether it generates from a copy of the policy in an engine of its own, loaded from a
            saved checkpoint (vLLM): the LoRA adapter goes there every step and the sampling settings are that
            engine's; ``False``: the trainer's policy module generates itself.
        structured_outputs: whether it constrains sampling to TRL's ``vllm_structured_outputs_regex`` (vLLM's
            structured outputs); the base class refuses the setting for the others in :meth:`check_config`.
        fixed_cache: whether it decodes into a KV cache of one length for the whole run
            (:func:`~qerl_trl.rollout.transformers.generation_cache_len`): ``qerl train`` then refuses a training
            prompt longer than that cache holds beside the new tokens before the model loads
            (:func:`qerl_trl.cli.check_prompt_lengths`).
    """

    name: ClassVar[str]
    seeds_per_prompt: ClassVar[bool] = True
    holds_generation_memory: ClassVar[bool]
    generates_in_waves: ClassVar[bool] = False
    sampling_logprobs: ClassVar[bool] = False
    rollout_precisions: ClassVar[tuple[str, ...]] = ("w4a16",)
    generates_from_copy: ClassVar[bool] = False
    structured_outputs: ClassVar[bool] = False
    fixed_cache: ClassVar[bool] = False

    @classmethod
    def colocated_engine(cls, args: Any) -> bool:
        """Whether a config's rollouts run in an engine of their own on the training GPUs, beside the policy (the
        FSDP2 memory plan then adds that engine's weights and KV cache on every GPU). None here; vLLM without a
        ``server_url``: yes."""
        return False

    def __init__(self, trainer: Any, prepared: Any = None) -> None:
        self.trainer = trainer

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Raise ``ValueError`` (one sentence naming the setting) for settings of ``cfg`` (a ``QeRLConfig``) this
        engine cannot honour; ``QeRLConfig`` calls it once, after parsing. Subclasses call ``super().check_config``."""
        if not isinstance(getattr(cls, "holds_generation_memory", None), bool):
            raise TypeError(f"rollout engine {cls.__name__} must set holds_generation_memory (True or False)")
        # TRL's vLLM branch would generate instead of the engine, syncing by merging the adapter into the base
        if cfg.use_vllm:
            raise ValueError(f"rollout_engine={cls.name!r}: keep use_vllm=False (TRL's vLLM path merges the LoRA "
                             "adapter into the 4-bit base weights); for vLLM rollouts use rollout_engine='vllm'")  # fmt: skip
        if cfg.vllm_structured_outputs_regex is not None and not cls.structured_outputs:
            raise ValueError(f"rollout_engine={cls.name!r} cannot constrain sampling to vllm_structured_outputs_regex: "
                             "use rollout_engine='vllm' or unset it")  # fmt: skip
        if cfg.rollout_seed_per_prompt and (
            not cls.seeds_per_prompt or cfg.use_vllm or cfg.use_transformers_continuous_batching
        ):
            raise ValueError(
                "rollout_seed_per_prompt seeds the torch RNG of generate() / graph_generate(); vLLM (and "
                "continuous-batching) rollouts sample with the engine's own seed: use rollout_engine='transformers' "
                "or 'graph', or rollout_seed_per_prompt=False"
            )
        if cfg.generation_wave_rows is not None and not cls.generates_in_waves:
            # nothing else reads it (the memory plan ignores it here too): refused rather than silently unused
            raise ValueError(f"generation_wave_rows={cfg.generation_wave_rows} splits the generation into waves, "
                             f"which rollout_engine={cls.name!r} does not do: use rollout_engine='graph' or unset "
                             "generation_wave_rows")  # fmt: skip
        precision = cfg.rollout_precision_spec
        if precision.name not in cls.rollout_precisions:
            raise ValueError(f"rollout_engine={cls.name!r} generates in {' or '.join(cls.rollout_precisions)} only, "
                             f"not rollout_precision={precision.name!r}: use rollout_engine='graph' or 'vllm', or "
                             "rollout_precision='w4a16'")  # fmt: skip
        fmt = cfg.quant_scheme.format
        if precision.fp8_copy and (fmt is None or not fmt.has_global_scale):
            raise ValueError(f"rollout_precision={precision.name!r} makes its FP8 copy from NVFP4 weights; "
                             f"quantization={cfg.quantization!r} has none: use an nvfp4-* quantization or "
                             "rollout_precision='w4a16'")  # fmt: skip
        if (
            cls.sampling_logprobs
            and cfg.loss_type == "vespo"
            and cfg.vllm_importance_sampling_correction
            and cfg.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):
            # TRL's own check runs under its use_vllm flag, which the trainer sets for these engines after TRL's
            # __init__: without this, VESPO would take a per-sequence ratio TRL refuses
            raise ValueError(f"loss_type='vespo' needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask' "
                             f"with the importance-sampling correction of rollout_engine={cls.name!r}, got "
                             f"{cfg.vllm_importance_sampling_mode!r}")  # fmt: skip
        if precision.fp8_copy and cfg.vllm_importance_sampling_correction and not cls.sampling_logprobs:
            # TRL's correction reads the engine's sampling logprobs; without them the FP8-vs-trainer gap (a numeric one,
            # unlike AQN's noise) goes into the loss as it is: said once here instead of a True setting doing nothing
            logger.warning("rollout_precision=%r on rollout_engine=%r: the engine returns no sampling logprobs, so "
                           "TRL's importance-sampling correction does not run on the FP8 rollouts' gap to the "
                           "trainer (docs/fp8_rollouts.md); rollout_engine='graph' or 'vllm' apply it", precision.name,
                           cls.name)  # fmt: skip

    @classmethod
    def check_environment(cls, cfg: Any) -> None:
        """Raise :class:`nvfp4.extras.MissingExtraError` (one line: what to install) when this process lacks what the
        engine needs for ``cfg``; the trainer calls it before the policy loads, so a missing package costs no load.
        Apart from :meth:`check_config`: a config may be built where it will not run (``qerl plan``, tests)."""

    @classmethod
    def prepare(cls, model_name: str | None, model: nn.Module, scheme: QuantScheme, args: Any) -> Any:
        """Work on the loaded policy before PEFT wraps it (vLLM: save the checkpoint its engine loads); default none."""
        return None

    @classmethod
    def check_evaluation(cls, scheme: QuantScheme) -> None:
        """Raise ``ValueError`` (one sentence) when ``qerl eval --engine <name>`` cannot evaluate a ``scheme`` policy,
        before anything loads. The default refuses: the engine does not evaluate."""
        raise ValueError(f"qerl eval does not generate with --engine {cls.name}; use --engine transformers")

    @classmethod
    def evaluation_generator(
        cls, model_name: str, model: nn.Module, scheme: QuantScheme, *, seed: int, dtype: Any, adapter: str | None
    ) -> Any:
        """What ``qerl eval --engine <name>`` generates with: ``None`` for ``model`` itself (its ``generate``), or an
        object with ``generate(prompt_ids, sampling_params)``, ``model_path`` and ``close()`` (vLLM's engine), with
        ``adapter`` loaded; called after :meth:`check_evaluation` passed."""
        raise NotImplementedError

    @classmethod
    def compile_decode(cls, trainer: Any, options: dict[str, Any] | None) -> Any:
        """Compile ``trainer``'s decode with a caller's ``torch.compile`` keyword arguments (``options``; ``None``:
        eager), e.g. a benchmark's knobs; returns what the decode compiles with, ``None`` when it stays eager or the
        engine compiles its own way (vLLM: its engine's CUDA graphs). Default: nothing changes."""
        return None

    def before_train(self) -> None:
        """What the engine sets up when training starts, before the first step; default nothing."""

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
        """Give the engine the policy's current LoRA adapter (the trainer calls it on every process, once per
        ``global_step``, before that step's first generation); nothing to do for an engine that generates with the
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


def generate_padded(
    trainer: Any, prompt_ids: list[list[int]], profile_name: str, run: Callable, *, logprobs: bool = False
) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
    """TRL 1.16's regular generation path around ``run(model, input_ids, attention_mask)``, which returns the prompt +
    completion ids ``[B, T + new]``: the left padding (``pad``, ``pad_to_multiple_of``), the context managers
    (unwrapped model with gradient checkpointing off, no grad, FSDP full params), and the post-processing (the tokens
    after the padded prompt, cut after the first EOS). Returns the completions as lists of token ids.

    With ``logprobs``, ``run`` returns ``(ids, completion_logprobs)``, the latter ``[B, new]`` float32 aligned with the
    completion tokens, and the result is ``(completions, their logprobs)``, each list cut where its ids are."""
    from trl.extras.profiling import profiling_context
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import pad

    device = trainer.accelerator.device
    prompts = [torch.tensor(ids) for ids in prompt_ids]
    input_ids = pad(
        prompts,
        padding_value=trainer._tokenizer.pad_token_id,
        padding_side="left",
        pad_to_multiple_of=trainer.pad_to_multiple_of,
    ).to(device)
    attention_mask = pad(
        [torch.ones_like(t) for t in prompts],
        padding_value=0,
        padding_side="left",
        pad_to_multiple_of=trainer.pad_to_multiple_of,
    ).to(device)
    prompt_length = input_ids.size(1)
    with (
        profiling_context(trainer, profile_name),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        out = run(unwrapped_model, input_ids, attention_mask)
    prompt_completion_ids, completion_logprobs = out if logprobs else (out, None)
    completion_ids = prompt_completion_ids[:, prompt_length:]
    # Mask everything after the first EOS token (TRL 1.16's lines)
    is_eos = torch.isin(completion_ids, torch.tensor(trainer.eos_token_ids, device=device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
    completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
    keep = completion_mask.bool().cpu()
    ids = [c[m].tolist() for c, m in zip(completion_ids.cpu(), keep, strict=True)]
    if completion_logprobs is None:
        return ids
    return ids, [lp[m].tolist() for lp, m in zip(completion_logprobs.float().cpu(), keep, strict=True)]
