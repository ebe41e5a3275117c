"""Training arguments: TRL's ``GRPOConfig`` plus the NVFP4 policy, LoRA, AQN and DAPO knobs.

Both configs are plain dataclasses, so ``trl.TrlParser`` reads them from YAML recipes and the command line like any
TRL config (``qerl train recipes/gsm8k_qwen2.5_7b_grpo.yaml --learning_rate 5e-6``).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import torch
from nvfp4.rollout_precision import PRECISIONS, RolloutPrecision, get_rollout_precision
from trl import GRPOConfig

from .quantization import ALIASES, SCHEMES, QuantScheme, get_scheme
from .rollout import RolloutEngine, engine_class
from .validation import check_config_values

__all__ = ["QeRLConfig", "QeRLDAPOConfig", "VLLMRolloutConfig"]


@dataclass
class VLLMRolloutConfig:
    """Settings of ``rollout_engine="vllm"`` (``QeRLConfig.vllm``).

    Attributes:
        server_url: ``http://host:port`` of a ``python -m vllm.entrypoints.openai.api_server`` (server mode); ``None``:
            an in-process engine (colocate).
        model_path: checkpoint the engine loads (default: the policy's NVFP4 checkpoint; a dense model quantized on
            load is saved once as NVFP4 under ``cache_dir``).
        cache_dir: where that checkpoint goes (default: the nvfp4 cache).
        adapter_dir: where the synced LoRA adapters go (server mode: a folder the server can read).
        gpu_memory_utilization, max_model_len, dtype, enforce_eager, kv_cache_memory_bytes: engine knobs (colocate;
            ``dtype="auto"``: bfloat16 on GPU, float32 on CPU).
        server_timeout: seconds per HTTP request (server mode).
        tensor_parallel_size: GPUs one colocated engine spans (vLLM tensor parallelism through its
            ``external_launcher`` backend: each trainer process hosts one TP worker, the ``T`` consecutive processes
            ``[kT, (k+1)T)`` share one engine and generate their prompts together). ``None``: the number of training
            processes under an FSDP2 launch (the policy is sharded because it does not fit one GPU, so is the
            engine's copy), 1 otherwise (one whole engine per process). It must divide the number of processes. A
            server's is its own ``--tensor-parallel-size``: not set here in server mode.
        share_weights: colocate, one process (no FSDP2, ``tensor_parallel_size`` 1): after the engine has loaded,
            the policy's frozen NVFP4 linears, embeddings and ``lm_head`` become views of the engine's bit-identical
            tensors, so the weights are held once (:mod:`qerl_trl.rollout.shared_weights`); ignored elsewhere.
        lora_tiles: the tiles of vLLM's LoRA kernels on CUDA (colocate; :mod:`qerl_vllm.lora_tiles`): ``"tuned"``
            (the files shipped for the GPU), ``"stock"`` (vLLM's defaults) or ``"reproducible"`` (one K split:
            bit-identical LoRA rollouts run to run). A server's are its own ``VLLM_TUNED_CONFIG_FOLDER``.
    """

    server_url: str | None = None
    model_path: str | None = None
    cache_dir: str | None = None
    adapter_dir: str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = None
    server_timeout: float = 600.0
    tensor_parallel_size: int | None = None
    share_weights: bool = True
    lora_tiles: str = "tuned"

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"vllm.tensor_parallel_size must be a whole number >= 1 (or None: automatic), got {tp!r}")
        # checked here, not by vLLM once the policy has loaded and the engine starts (30 meant for 0.3, ...)
        ranges = {"gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
                  "kv_cache_memory_bytes": (lambda v: v >= 1, ">= 1"), "max_model_len": (lambda v: v >= 1, ">= 1"),
                  "server_timeout": (lambda v: v > 0, "> 0")}  # fmt: skip
        for name, (ok, expected) in ranges.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not ok(value)):
                raise ValueError(f"vllm.{name} must be {expected}, got {value!r}")
        if tp is not None and self.server_url:
            raise ValueError(
                "vllm.tensor_parallel_size sets the colocated engine; a server's is its own --tensor-parallel-size "
                "(unset vllm.tensor_parallel_size or vllm.server_url)"
            )

    def tp_size(self, world_size: int, fsdp2: bool) -> int:
        """The colocated engine's tensor-parallel size for ``world_size`` training processes (``fsdp2``: the policy
        is sharded by FSDP2); ``ValueError`` (one line) when it does not divide ``world_size``."""
        tp = self.tensor_parallel_size if self.tensor_parallel_size is not None else world_size if fsdp2 else 1
        if world_size % tp:
            raise ValueError(
                f"vllm.tensor_parallel_size={tp} must divide the number of training processes ({world_size}): "
                f"each group of {tp} consecutive processes shares one engine"
            )
        return tp

    @classmethod
    def from_value(cls, value: VLLMRolloutConfig | dict | str | None) -> VLLMRolloutConfig:
        """From a mapping (YAML), a JSON object string (command line), an instance or ``None`` (the defaults)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"vllm must be a JSON object of {cls.__name__} settings, got {value!r}: {e}") from e
        if not isinstance(value, dict | type(None)):
            raise ValueError(f"vllm must be a mapping of {cls.__name__} settings, got {type(value).__name__}")
        unknown = sorted(set(value or {}) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"vllm: unknown setting(s) {unknown}; known: {[f.name for f in fields(cls)]}")
        return cls(**(value or {}))


def default_sampling_correction(aqn: bool, precision: RolloutPrecision) -> bool:
    """QeRL's default for TRL's ``vllm_importance_sampling_correction`` (when the user leaves it unset).

    Off while AQN is on and rollouts run W4A16: the engine samples from the noisy policy on purpose (the noise lives in
    its norm weights only) and the trainer scores the clean one, so a ratio of the two re-weights AQN's exploration
    rather than a numerical error, which the graph and transformers engines never do. On the offline default (H200,
    20 steps, ``benchmarks/results/offline_default_h200_is_off_dce0c4f.json``) vLLM with ``token_truncate`` reached
    last-5 rewards 0.725 / 0.787 (seeds 0 / 1), without the correction 0.856 / 0.838, the graph engine 0.844 / 0.863.
    On with FP8 rollouts (their engine-vs-trainer gap is numeric: what the correction is for) and without AQN (TRL's
    default)."""
    return not aqn or precision.fp8_copy


@dataclass
class QeRLConfig(GRPOConfig):
    """``GRPOConfig`` with the QeRL parts. Defaults follow the QeRL paper where it states them.

    Policy:
        quantization: ``<format>-<method>``, how a dense checkpoint is turned into the 4-bit policy on load (see
            :mod:`qerl_trl.quantization`): ``"nvfp4-rtn"`` / ``"nvfp4-mse"`` (NVFP4 via :class:`nvfp4.NVFP4Config`,
            from the weights alone), ``"nvfp4-awq"`` / ``"nvfp4-gptq"`` (calibrated on the first
            ``calibration_samples`` prompts of the training set, :func:`nvfp4.calibration.calibrate_model`),
            ``"mxfp4-rtn"`` (MXFP4, ``NVFP4Config(format="mxfp4")``), ``"nf4"`` (bitsandbytes NF4, QLoRA;
            ``pip install 'qerl-trl[nf4]'``), or ``"none"`` for the bf16 LoRA baseline. The bare ``"rtn"`` /
            ``"mse"`` / ``"awq"`` / ``"gptq"`` of earlier versions are aliases of ``"nvfp4-*"`` and are stored in
            their canonical spelling. A checkpoint that is already NVFP4 loads as it is.
        nf4_double_quant: ``quantization="nf4"``: quantize the absmax scales again (QLoRA's double quantization).
        calibration_samples: prompts the ``awq`` / ``gptq`` calibration runs on.
        calibration_cache_dir: where a calibrated policy is saved (an NVFP4 checkpoint keyed by model, method and
            prompts; default ``<output_dir>/calibrated``), so a resumed or repeated run loads it instead of
            calibrating again.
        lora_r, lora_alpha, lora_dropout, lora_target_modules: the PEFT ``LoraConfig`` (paper: r=32, α=r, all linear
            projections of attention and MLP).
    AQN (noise on the RMSNorm weights of the model that generates, once per generation step):
        aqn: turn it on or off.
        aqn_schedule: ``exponential`` (paper) | ``linear`` | ``cosine`` | ``logarithmic`` | ``constant``.
        aqn_sigma_start, aqn_sigma_end, aqn_num_stages: σ goes from start to end over K stages; stage 0 is noise-free.
    Rollout engine (one :class:`qerl_trl.rollout.RolloutEngine` per trainer, :mod:`qerl_trl.rollout`; TRL's own
    ``use_vllm`` must stay False — it merges LoRA into the base weights, which a 4-bit base cannot take):
        rollout_engine: ``"transformers"`` (the policy's own ``generate``) or ``"vllm"``: an in-process vLLM engine
            (colocate), or the server at ``vllm.server_url``. The LoRA adapter is synced as an adapter once per
            step, AQN noise goes on the engine's norm weights, and TRL's importance-sampling correction
            (``vllm_importance_sampling_*``) can run on the engine-vs-trainer logprob gap, per token
            (``vllm_importance_sampling_mode="token_truncate"``, not TRL's ``sequence_mask``: a ratio taken over
            a whole completion under AQN's noise masks or shrinks most completions). Unset, the correction is off
            while AQN is on with W4A16 rollouts and on otherwise (:func:`default_sampling_correction`).
        vllm: the vLLM engine's settings, :class:`VLLMRolloutConfig` (``server_url``, ``model_path``, ``cache_dir``,
            ``adapter_dir``, ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ``enforce_eager``,
            ``kv_cache_memory_bytes``, ``server_timeout``, ``tensor_parallel_size``); the flat ``vllm_<setting>``
            keys of earlier versions (and TRL's ``vllm_tensor_parallel_size``) still set them, with a deprecation
            warning.
        rollout_engine="graph" (opt-in): the policy generates through :func:`qerl_trl.rollout.graph.generate.graph_generate`
            instead of its ``generate``: one compiled CUDA graph per decode step with the sampling inside, no host sync
            per step (on an H100 it doubled a 7B policy's rollout tokens/s outside the trainer). It samples from
            ``softmax(logits / temperature)`` only, so ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` must
            stay neutral and ``generation_kwargs`` may only hold what it honours (``max_new_tokens``,
            ``min_new_tokens``, ``temperature``, ``do_sample``, EOS/pad/BOS ids, ``max_cache_len``,
            ``cache_implementation``); AQN must be ``per_step`` (a replayed graph cannot redraw noise per forward).
            Text-only prompts. The KV cache has the fixed length of the compiled transformers path (below).
        rollout_precision: how the frozen NVFP4 base computes while rollouts are generated (issue #51,
            :mod:`nvfp4.rollout_precision`): ``"w4a16"`` (our W4A16 kernels, as training; the default), ``"fp8"`` (an
            E4M3 copy of the linears made once from the NVFP4 weights, activations quantised per token, FP8 tensor
            cores: Hopper) or ``"auto"`` (W4A16 below the crossover rows per linear call, FP8 from there: 128 on the
            7B layer, measured; 128 for unmeasured shapes). Engines ``"graph"`` (the copy beside the policy's NVFP4
            weights: +1 byte a weight, counted by the memory plan) and ``"vllm"`` (colocate: the engine's linear
            method, ``qerl_vllm.quant``); training's forward, backward and logprobs stay W4A16; LoRA stays bf16 on
            top, AQN unchanged (its noise is on the norms). TRL's importance-sampling correction needs the engine's
            sampling logprobs: both engines return them (an engine without them gets a warning when it is on).
        generation_wave_rows: ``"graph"``: the most rows decoded at once; a larger generation batch is generated in
            waves of at most that many rows through one KV cache of that many rows (``graph_generate(max_rows=)``).
            Default: on CUDA, as many as :mod:`qerl_trl.memory_plan` fits in the GPU's memory beside the weights, LoRA,
            optimizer state and training micro-batch (``qerl train`` says so in one line when it splits the batch, and
            stops before loading the model when not even one row fits); elsewhere, the whole batch.
    Transformers rollouts on a GPU:
        compile_generation: with ``cache_implementation="static"`` on CUDA, compile the decode step with CUDA graphs
            (transformers' compiled ``generate``; TRL 1.16 builds its generation config with ``disable_compile``,
            and eager decoding is launch-bound: ~10x slower at 7B). The static cache is sized
            ``generation_prompt_cache_len + max_completion_length`` (unless ``generation_kwargs`` sets
            ``max_cache_len``), so every step replays the same graphs whatever the prompt lengths.
        generation_prompt_cache_len: the longest prompt (tokens) that compiled cache holds (and ``"graph"``'s, whose
            cache is sized the same way; a longer prompt is an error there).
    Memory:
        logprob_batch_size: sequences per forward when the trainer scores completions (TRL's
            ``_get_per_token_logps_and_entropies`` ``batch_size``; default: the whole batch). Off Triton devices TRL's
            chunked LM head scores every position of every sequence in ``[tokens, 32768]`` fp32 vocabulary tiles
            whose backward takes ~8 tile-sized temporaries (2.6 GB for the offline default's 32 × 74 tokens), so
            the CPU recipe scores 4 sequences at a time. The same log-probabilities, gradients and batch.
    Several processes (``accelerate launch``, see ``recipes/accelerate/``):
        rollout_seed_per_prompt: sample each prompt's group of ``num_generations`` completions in its own
            ``generate`` call, from a seed that is a function of (``seed``, ``global_step``, the prompt's index in
            the global batch) only. The rollouts, hence the training run, are then the same on 1 or N processes for
            the same global batch (and ``gradient_accumulation_steps=1``); the price is one ``generate`` call per
            prompt instead of one per batch. ``"transformers"`` and ``"graph"`` rollouts only.
        ddp_broadcast_buffers (TrainingArguments'): default ``False`` here: every rank loads the same frozen
            NVFP4 base, so DDP has no reason to broadcast its 4-bit buffers before every forward.
        ddp_find_unused_parameters (TrainingArguments'): default ``False`` here: every LoRA adapter is used by every
            forward. Set it to ``True`` if you target modules a forward can skip.
    """

    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate (paper: 1e-5)."})
    quantization: str = field(
        default="nvfp4-rtn",
        metadata={
            "help": "4-bit format and method for a dense checkpoint: " + ", ".join(SCHEMES) + " ('*-awq' / "
            "'*-gptq' calibrated on the task's prompts; 'nf4' = bitsandbytes QLoRA; 'none' = bf16 LoRA baseline). "
            "Aliases: " + ", ".join(f"{a} = {c}" for a, c in ALIASES.items()) + "."
        },
    )
    nf4_double_quant: bool = field(
        default=True, metadata={"help": "quantization='nf4': double-quantize the absmax scales (QLoRA)."}
    )
    calibration_samples: int = field(
        default=32, metadata={"help": "Training prompts the 'awq' / 'gptq' calibration runs on."}
    )
    calibration_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where the calibrated NVFP4 policy is cached (default: <output_dir>/calibrated)."},
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default: = lora_r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Modules that get LoRA adapters (default: all attention and MLP projections; 'all-linear': "
                          "PEFT's every linear but the output layer)."},
    )
    aqn: bool = field(default=True, metadata={"help": "Adaptive Quantization Noise on the rollout model."})
    aqn_schedule: str = field(default="exponential", metadata={"help": "σ schedule kind."})
    aqn_sigma_start: float = field(default=1e-2, metadata={"help": "σ of stage 1."})
    aqn_sigma_end: float = field(
        default=5e-4,
        metadata={"help": "σ the schedule decays towards; the paper's stages stop short of it (10 stages, 1e-2 → "
                  "5e-4: the last at 7.0e-4)."},
    )  # fmt: skip
    aqn_num_stages: int = field(default=10, metadata={"help": "Number of schedule stages K (stage 0 is noise-free)."})
    aqn_mode: str = field(
        default="per_step", metadata={"help": "'per_step' (one draw per generation step) or 'per_forward'."}
    )

    rollout_engine: str = field(
        default="transformers",
        metadata={
            "help": "Rollout engine: 'transformers' (the policy's generate), 'vllm' (colocate, or server), or 'graph' "
            "(opt-in: qerl_trl.rollout.graph.generate, one compiled CUDA graph per decode step incl. sampling)."
        },
    )
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's engine-vs-trainer correction (engines that return sampling logprobs: graph, vLLM). Default (None): "
            "off while AQN is on with W4A16 rollouts, on otherwise. AQN's noise is in the engine's norms only, so the "
            "correction would re-weight the exploration it adds (the transformers engine never does): on "
            "the offline default (H200, 20 steps) vLLM with it reached last-5 rewards 0.725 / 0.787 (seeds 0 / 1), "
            "without it 0.856 / 0.838, the graph engine 0.844 / 0.863. FP8 rollouts keep it: their gap is numeric."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "TRL's correction of the engine-vs-trainer gap (engines that return sampling logprobs: vLLM). "
            "QeRL's default is token_truncate (per-token ratio clipped to [clip_min, clip_max]; every completion "
            "kept) instead of TRL's sequence_mask, whose ratio is the product over the whole completion: at "
            "AQN's sigma and at the recipes' lengths it zeroed or shrank most completions (BENCHMARKS.md). "
            "token_mask | sequence_truncate | sequence_mask as TRL."
        },
    )
    vllm: dict | str | None = field(
        default=None,
        metadata={
            "help": "rollout_engine='vllm' settings (VLLMRolloutConfig): a mapping in YAML, a JSON object on the command "
            "line, e.g. '{\"gpu_memory_utilization\": 0.3, \"max_model_len\": 5120}'. Keys: "
            + ", ".join(f.name for f in fields(VLLMRolloutConfig)) + "."
        },
    )
    # deprecated flat spellings of the `vllm` settings (kept for recipes and command lines written before it)
    vllm_server_url: str | None = field(default=None, metadata={"help": "Deprecated: vllm.server_url."})
    vllm_model_path: str | None = field(default=None, metadata={"help": "Deprecated: vllm.model_path."})
    vllm_cache_dir: str | None = field(default=None, metadata={"help": "Deprecated: vllm.cache_dir."})
    vllm_adapter_dir: str | None = field(default=None, metadata={"help": "Deprecated: vllm.adapter_dir."})
    vllm_gpu_memory_utilization: float | None = field(
        default=None, metadata={"help": "Deprecated: vllm.gpu_memory_utilization."}
    )
    vllm_max_model_len: int | None = field(default=None, metadata={"help": "Deprecated: vllm.max_model_len."})
    vllm_dtype: str | None = field(default=None, metadata={"help": "Deprecated: vllm.dtype."})
    vllm_enforce_eager: bool | None = field(default=None, metadata={"help": "Deprecated: vllm.enforce_eager."})
    vllm_kv_cache_memory_bytes: int | None = field(
        default=None, metadata={"help": "Deprecated: vllm.kv_cache_memory_bytes."}
    )
    vllm_server_timeout: float | None = field(default=None, metadata={"help": "Deprecated: vllm.server_timeout."})
    vllm_tensor_parallel_size: int | None = field(
        default=None, metadata={"help": "TRL's spelling of vllm.tensor_parallel_size (deprecated here)."}
    )
    compile_generation: bool = field(
        default=True,
        metadata={"help": "CUDA + cache_implementation='static': compiled decode with CUDA graphs (TRL disables it)."},
    )
    generation_prompt_cache_len: int = field(
        default=1024,
        metadata={"help": "Longest prompt (tokens) the compiled static cache holds (also rollout_engine='graph')."},
    )
    rollout_precision: Literal["w4a16", "fp8", "auto"] = field(
        default="w4a16",
        metadata={
            "help": "How the frozen NVFP4 base computes during generation: "
            + " | ".join(PRECISIONS)
            + " (fp8: an E4M3 copy of the linears, FP8 tensor cores; auto: W4A16 below the measured crossover rows, "
            "FP8 from there). rollout_engine 'graph' or 'vllm'; training stays W4A16."
        },
    )
    generation_wave_rows: int | None = field(
        default=None,
        metadata={
            "help": "rollout_engine='graph': most rows decoded at once, the rest in later waves (default: as many as "
            "the memory plan fits on the GPU; the whole batch elsewhere)."
        },
    )
    rollout_seed_per_prompt: bool = field(
        default=False,
        metadata={
            "help": "Seed each prompt group's sampling from (seed, step, global prompt index): the same rollouts "
            "on any number of processes (one generate call per prompt; transformers or graph rollouts only)."
        },
    )
    logprob_batch_size: int | None = field(
        default=None,
        metadata={"help": "Sequences per forward when scoring completions (lower peak memory; default: whole batch)."},
    )
    ddp_broadcast_buffers: bool | None = field(
        default=False,
        metadata={
            "help": "DDP broadcast_buffers (default False: the frozen 4-bit buffers are identical on all ranks)."
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "DDP find_unused_parameters (default False: every LoRA adapter takes part in every forward)."
        },
    )

    def __post_init__(self) -> None:
        if self.bf16 is None and not torch.cuda.is_available():
            self.bf16 = False  # CPU runs compute in fp32 (bf16 autocast on CPU is slower and lossier)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not self.use_cpu and not torch.accelerator.is_available():
            # launched as several processes (accelerate launch / torchrun) on a machine without an accelerator:
            # transformers only sets up the gloo process group with use_cpu, else each process would train alone
            self.use_cpu = True
        #: the parsed ``rollout_precision`` (ValueError naming the values); the engines and the memory plan use this
        self.rollout_precision_spec: RolloutPrecision = get_rollout_precision(self.rollout_precision)
        self.rollout_precision = self.rollout_precision_spec.name
        if self.vllm_importance_sampling_correction is None:  # before TRL's checks, which read it
            precision = self.rollout_precision_spec
            self.vllm_importance_sampling_correction = default_sampling_correction(self.aqn, precision)
        super().__post_init__()
        #: the parsed ``quantization`` (ValueError listing the valid values and aliases); the trainer uses this object
        self.quant_scheme: QuantScheme = get_scheme(self.quantization)
        self._fold_flat_vllm_settings()
        self.quantization = self.quant_scheme.name  # canonical: "rtn" → "nvfp4-rtn"
        #: the resolved ``rollout_engine`` (ValueError naming the engines); the trainer and the memory plan use this
        self.rollout_engine_class: type[RolloutEngine] = engine_class(self.rollout_engine)
        if self.calibration_samples < 1:
            raise ValueError(f"calibration_samples must be >= 1, got {self.calibration_samples}")
        if self.logprob_batch_size is not None and self.logprob_batch_size <= 0:
            raise ValueError(f"logprob_batch_size must be > 0 (or None for the whole batch), got {self.logprob_batch_size}")
        if self.generation_wave_rows is not None and self.generation_wave_rows < 1:
            raise ValueError(
                f"generation_wave_rows must be >= 1 (or None: from the memory plan), got {self.generation_wave_rows}"
            )
        if not isinstance(self.lora_r, int) or isinstance(self.lora_r, bool) or self.lora_r <= 0:
            raise ValueError(f"lora_r must be an integer > 0, got {self.lora_r!r}")
        if self.lora_alpha is None:
            self.lora_alpha = self.lora_r
        targets = self.lora_target_modules
        if isinstance(targets, list) and len(targets) == 1 and str(targets[0]).lower() == "all-linear":
            # PEFT's shorthand is the string only (a list holds module names), as TRL's ModelConfig passes it
            self.lora_target_modules = "all-linear"
        if self.aqn_mode not in ("per_step", "per_forward"):
            raise ValueError(f"aqn_mode must be 'per_step' or 'per_forward', got {self.aqn_mode!r}")
        self.rollout_engine_class.check_config(self)  # the engine's own rules (sampling, AQN mode, checkpoints)
        constant = str(self.aqn_schedule).lower() in ("constant", "const")  # σ_start throughout: σ_end is ignored
        if self.aqn and not constant and not 0 <= self.aqn_sigma_end <= self.aqn_sigma_start:
            raise ValueError(
                f"need 0 <= aqn_sigma_end <= aqn_sigma_start, got {self.aqn_sigma_end}, {self.aqn_sigma_start}"
            )
        check_config_values(self)  # max_steps, lengths, σ, schedule, ...: qerl_trl.validation.CONFIG_RULES

    def _fold_flat_vllm_settings(self) -> None:
        """``vllm`` becomes a :class:`VLLMRolloutConfig`; the deprecated flat ``vllm_<name>`` keys set its ``<name>``
        (with a warning that names the nested spelling) and are cleared, so ``vllm`` is the one place to read."""
        nested = VLLMRolloutConfig.from_value(self.vllm)
        # settings newer than the nested spelling have no flat one
        flat = {f.name: getattr(self, f"vllm_{f.name}", None) for f in fields(VLLMRolloutConfig)}
        for name, value in flat.items():
            if value is None:
                continue
            warnings.warn(f"vllm_{name} is deprecated: set vllm.{name} (YAML: `vllm: {{{name}: ...}}`)", FutureWarning,
                          stacklevel=4)  # fmt: skip
            setattr(nested, name, value)
            setattr(self, f"vllm_{name}", None)
        nested.__post_init__()  # the flat keys pass the same checks
        self.vllm = nested

    def to_dict(self) -> dict:
        """``TrainingArguments.to_dict`` with ``vllm`` as a plain mapping (JSON, loggers)."""
        d = super().to_dict()
        if isinstance(d.get("vllm"), VLLMRolloutConfig):
            d["vllm"] = asdict(d["vllm"])
        return d


@dataclass
class QeRLDAPOConfig(QeRLConfig):
    """DAPO preset: clip-higher (ε_low 0.2, ε_high 0.28), token-level loss, dynamic sampling, overlong shaping, β = 0.

    Extra fields:
        dynamic_sampling: drop groups whose rewards all agree (no learning signal) and refill the batch with groups
            generated from fresh prompts. Each process judges its own slice of the generation batch, so that slice
            (``per_device_train_batch_size x steps_per_generation`` rows) must hold whole groups.
        max_resample_rounds: how many extra generation rounds one step may spend refilling; if the batch is still
            short, the remaining slots keep uninformative groups (zero advantage) and ``dapo/unfilled_groups`` says so.
        overlong_buffer_length: soft punishment over the last L tokens before ``max_completion_length``
            (0: off; -1: a quarter of ``max_completion_length``); ``overlong_penalty_factor`` is the penalty at the limit.
        mask_truncated_completions (TRL's): leave truncated completions out of the loss.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clip ε."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip ε (clip-higher)."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level loss over the whole batch."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (DAPO: none, no reference model)."})
    dynamic_sampling: bool = field(default=True, metadata={"help": "DAPO dynamic sampling."})
    max_resample_rounds: int = field(default=4, metadata={"help": "Extra generation rounds per step for refills."})
    overlong_buffer_length: int = field(default=-1, metadata={"help": "Overlong buffer L (-1: max_completion/4)."})
    overlong_penalty_factor: float = field(default=1.0, metadata={"help": "Overlong penalty at the length limit."})

    def __post_init__(self) -> None:
        super().__post_init__()
        limit = self.max_completion_length
        if limit is None:  # TRL's "no limit": no end for a buffer to precede
            if self.overlong_buffer_length != 0:
                raise ValueError(
                    "overlong shaping needs a max_completion_length (got None, no limit): set one, or set "
                    "overlong_buffer_length 0 to turn overlong shaping off"
                )
        elif self.overlong_buffer_length == -1:
            if limit < 2:  # the default buffer (a quarter, at least 1 token) needs a token before it
                raise ValueError(
                    f"the default overlong_buffer_length (a quarter of max_completion_length, at least 1 token) needs "
                    f"max_completion_length >= 2, got {limit}; set overlong_buffer_length 0 to turn overlong shaping off"
                )
            self.overlong_buffer_length = max(1, limit // 4)
        if limit is not None and not 0 <= self.overlong_buffer_length < limit:
            raise ValueError(
                f"overlong_buffer_length must be in [0, max_completion_length={limit}), got {self.overlong_buffer_length}"
            )
        if self.max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        # TRL needs whole groups in the global generation batch only; dynamic sampling keeps or drops the groups of
        # each process's slice, so a group split between processes cannot be judged
        rows_per_process = self.generation_batch_size // self.world_size
        if self.dynamic_sampling and rows_per_process % self.num_generations:
            raise ValueError(
                f"dynamic_sampling needs whole prompt groups on each process: its {rows_per_process} rows per generation "
                f"batch (per_device_train_batch_size x steps_per_generation) must be a multiple of num_generations "
                f"({self.num_generations})"
            )
