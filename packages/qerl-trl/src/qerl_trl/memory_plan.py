"""Memory plan of a GRPO/DAPO run on one GPU: the bytes each part of a step needs, and how many rollout rows fit.

Why: the shipped 32B DAPO recipe generates 128 completions of up to 8,192 tokens through the graph engine, whose static
KV cache holds every row at its full length: 64 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 256 KiB per token,
~2.4 GB per row of 9,216 positions, ~309 GB for 128 rows, on an 80 GB GPU. :func:`plan_memory` adds up what a step
holds and gives the largest number of rows the engine can decode at once (a *wave*); the engine then generates the
batch in waves of that many rows (``graph_generate(..., max_rows=)``), and ``qerl train`` refuses a run that does not
fit even one row, before the model loads (:func:`check_plan`).

Model shapes (a Llama / Qwen2-style decoder, :class:`ModelShape`): hidden ``H``, MLP ``I``, ``n_L`` layers, ``n_q`` query
and ``n_kv`` KV heads of ``d`` = head_dim, vocabulary ``V``. Per layer the 7 projections are q ``[H → n_q·d]``,
k and v ``[H → n_kv·d]``, o ``[n_q·d → H]``, gate and up ``[H → I]``, down ``[I → H]``. Bytes, ``a`` = activation
dtype bytes (2: bf16), run shapes in :class:`RunShape`:

Held for the whole run
  * weights: the projections' ``in·out`` weights at :data:`WEIGHT_BYTES` per weight (NVFP4: 4-bit code + one FP8 scale
    per 16 = 0.5625 B; bf16: 2 B; NF4 as QLoRA: 4-bit code + absmax per 64, double-quantized), plus embeddings and
    ``lm_head`` (``V·H`` each, one matrix when tied), norms and q/k/v biases, in bf16.
  * FP8 copy (``rollout_precision`` fp8 / auto with the graph engine, which generates with the policy itself): an
    E4M3 copy of every projection beside its NVFP4 weights, 1 byte per weight + a float32 scale per output row
    (:func:`nvfp4.rollout_precision.fp8_copy_bytes`); training keeps the NVFP4 weights. A colocated vLLM engine
    holds its own copy of the weights instead (FSDP2 plan): ``fp8`` the E4M3 copy only, ``auto`` both.
  * LoRA: ``r·(in + out)`` parameters per adapted projection, in ``lora_param_bytes`` (4: the trainer keeps the adapters
    in fp32), and as many gradient values during the backward.
  * optimizer: AdamW's ``exp_avg`` and ``exp_avg_sq``, 2 values per LoRA parameter in the parameters' dtype (8-bit
    optimizers: 2 bytes; SGD: none). Only the adapters train, so nothing for the frozen base.
  * generation rows (the graph engine keeps its static cache and buffers between steps, so that every step replays the
    graphs recorded on the first: they are held during training too). Per row:
    KV cache ``2·n_L·n_kv·d·cache_len·a``; the engine's ``seq`` and ``mask`` ``[cache_len]`` int64, its sampled
    tokens' logprobs ``[cache_len]`` fp32 and its sampling noise ``[V]`` fp32; the decode step's logits temporaries in
    its CUDA-graph pool (``[V]`` bf16 + 4 × ``[V]`` fp32).

Transient, one phase at a time (the plan takes the larger)
  * prefill of a wave of ``R`` rows × ``P`` prompt tokens (no grad): per token ``(4·H + 4·I)·a`` (the layer's MLP
    intermediates and hidden states); SDPA with a padding mask takes transformers' ``repeat_kv`` path, which expands
    the whole cache's K and V to the query heads, ``2·n_q·d·cache_len·a`` per row; the boolean mask ``P·cache_len``
    bytes per row; the last position's logits ``[V]`` bf16 + fp32.
  * training micro-batch, ``S`` rows × ``T = P + C`` tokens (TRL pads a micro-batch to its longest prompt and
    completion; the plan takes the caps). With gradient checkpointing each layer's input is kept, ``n_L·H·a`` per token,
    and one layer at a time is recomputed and back-propagated, ``(5·H + 6.5·I)·a`` per token; without it every layer's
    activations are kept, ``n_L·(5·H + 6.5·I)·a`` per token. The padding mask ``S·T²`` bool and its additive bf16 copy;
    TRL's fused LM head: its ``[min(N, 4096), 32768]`` logits tile in ``a`` and the fp32 gradient of the hidden states
    ``N·H·4`` (``N = S·T``).

The activation coefficients (4 and 4 for the prefill, 5 and 6.5 for training) are fitted to the peaks of the committed
H100 runs of ``benchmarks/grpo_step.py`` (7B, 14B and 32B, graph engine; 7B at 128 completions) and rounded up:
``tests/qerl_trl/test_memory_plan.py`` checks that the plan is at least each measured peak and at most 25 % above it.
They are an estimate, not a model of the allocator: :data:`DEFAULT_MARGIN` of the budget is kept free for its caching
and fragmentation (the runs' reserved memory was 8-17 % above their allocated peaks), CUDA graphs' private pools and
workspaces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nvfp4.formats import FORMATS
from nvfp4.rollout_precision import PRECISIONS, fp8_copy_bytes

if TYPE_CHECKING:
    from .quantization import QuantScheme

__all__ = [
    "DEFAULT_MARGIN",
    "GB",
    "H100_80GB_BYTES",
    "LORA_TARGETS",
    "WEIGHT_BYTES",
    "MemoryPlan",
    "MemoryPlanError",
    "ModelShape",
    "RunShape",
    "QWEN25_SHAPES",
    "check_fp8_copy",
    "check_plan",
    "cuda_budget_bytes",
    "fsdp2_answer",
    "fsdp2_preflight",
    "fsdp2_requested",
    "model_shape_for",
    "plan_fsdp2",
    "plan_memory",
    "preflight",
    "run_shape_from_config",
    "smallest_fsdp2_gpus",
    "weight_bytes_per_param",
]

#: Every figure the plan prints is in GB of 10**9 bytes (``--memory-budget-gb`` too): an H100 80GB is 85.5 GB.
GB = 1e9
#: Memory of an H100 80GB (SXM5 / PCIe) as the driver reports it (``nvidia-smi``: 81,559 MiB = 85.5 GB).
H100_80GB_BYTES = 81_559 * 2**20
#: Fraction of the budget the plan leaves free (allocator caching and fragmentation, CUDA-graph pools, workspaces).
DEFAULT_MARGIN = 0.10

#: Bytes per weight of a projection in each policy format (scales included). The 4-bit formats of the registry say
#: theirs (:attr:`nvfp4.formats.Format.bytes_per_weight`: NVFP4 a 4-bit E2M1 code + an FP8 E4M3 scale per 16 weights,
#: MXFP4 code + an E8M0 scale per 32); NF4 (bitsandbytes, QLoRA): code + an absmax per 64 weights, fp32, or with
#: double quantization 8-bit with an fp32 scale per 256 absmax; dense (``none``): bf16.
#: The keys are the format's name (:class:`nvfp4.formats.Format`), ``"nf4"`` and ``"none"`` (:data:`DENSE`);
#: :func:`weight_bytes_per_param` maps a :class:`~qerl_trl.quantization.QuantScheme` to its key.
DENSE = "none"
WEIGHT_BYTES: dict[str, float] = {
    **{name: fmt.bytes_per_weight for name, fmt in FORMATS.items()},
    "nf4": 0.5 + 1 / 64 + 4 / (64 * 256),
    "nf4-no-double-quant": 0.5 + 4 / 64,
    DENSE: 2.0,
}
#: Bytes per tensor besides the per-weight ones: the fp32 global scale of the formats that have one (NVFP4), as the
#: format registry says (:attr:`nvfp4.formats.Format.bytes_per_tensor`).
TENSOR_BYTES: dict[str, int] = {name: fmt.bytes_per_tensor for name, fmt in FORMATS.items() if fmt.bytes_per_tensor}
#: The projections of a decoder layer LoRA can target here (PEFT's module names; ``"all-linear"`` means all of them).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Activation coefficients (elements per token, see the module docstring); fitted to the committed H100 runs.
_PREFILL_H, _PREFILL_I = 4.0, 4.0
_TRAIN_H, _TRAIN_I = 5.0, 6.5
_LM_HEAD_TILE = (4096, 32768)  # TRL's ChunkedLogProbFunction: TOKEN_CHUNK_SIZE x its vocabulary chunk
_DECODE_LOGITS_BYTES = 2 + 4 * 4  # per vocabulary entry and row: bf16 logits, fp32 copy, masked, softmax, probs / q


class MemoryPlanError(ValueError):
    """A run that does not fit the memory it is given; the message is one line: what, by how much, what to change."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama / Qwen2-style decoder that the plan needs.

    Attributes: ``hidden_size`` H, ``intermediate_size`` I, ``num_layers`` n_L, ``num_attention_heads`` n_q,
    ``num_kv_heads`` n_kv, ``head_dim`` d, ``vocab_size`` V, ``tie_word_embeddings`` (one matrix for embeddings and
    ``lm_head``), ``attention_bias`` (q/k/v biases, Qwen2), ``max_positions`` (the context length in tokens, config
    ``max_position_embeddings``: a vLLM engine's ``max_model_len`` when it is not set; None: not known).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_positions: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (its text config for a multimodal one). Raises
        :class:`MemoryPlanError` for a model without the fields of a dense decoder (mixture-of-experts, ...)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
            raise MemoryPlanError(f"no memory plan for mixture-of-experts models ({type(config).__name__})")
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [n for n in names if not isinstance(getattr(config, n, None), int)]
        if missing:
            raise MemoryPlanError(f"no memory plan for {type(config).__name__}: its config has no {', '.join(missing)}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
            max_positions=getattr(config, "max_position_embeddings", None),
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one layer, by PEFT module name."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads, self.num_kv_heads
        d = self.head_dim
        return {
            "q_proj": (h, q * d),
            "k_proj": (h, kv * d),
            "v_proj": (h, kv * d),
            "o_proj": (q * d, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why vLLM cannot split this model over ``tp`` tensor-parallel workers (it refuses at start), or ``None``: the
        attention heads must divide evenly, and the KV heads too, or be replicated whole (``tp`` a multiple of them)."""
        heads, kv = self.num_attention_heads, self.num_kv_heads
        if heads % tp:
            return f"does not divide the model's {heads} attention heads"
        if kv % tp and tp % kv:
            return f"neither divides nor is a multiple of the model's {kv} KV heads"
        return None

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per cached position of one row: ``2 (K, V) · n_L · n_kv · d · dtype_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that decide its memory (what :func:`run_shape_from_config` reads from a ``QeRLConfig``).

    Attributes:
        quantization: policy format, a key of :data:`WEIGHT_BYTES` (``"nvfp4"``, ``"mxfp4"``, ``"nf4"``, ``"none"``).
        lora_r, lora_targets: LoRA rank and the adapted projections (names of :data:`LORA_TARGETS`).
        lora_param_bytes: bytes per adapter value (4: fp32, the trainer's; 2: bf16).
        optimizer_states: optimizer values per LoRA parameter (AdamW: 2), each ``optimizer_state_bytes``.
        generation_rows: completions one generation call makes on this process (TRL's ``per_device_train_batch_size
            × steps_per_generation``).
        micro_batch_rows: sequences per training forward/backward (``per_device_train_batch_size``).
        prompt_len: longest prompt (tokens) after padding; the graph engine's cap, ``generation_prompt_cache_len``.
        completion_len: ``max_completion_length``.
        cache_len: KV positions per generation row (graph engine: ``generation_prompt_cache_len +
            max_completion_length`` unless ``generation_kwargs["max_cache_len"]``).
        gradient_checkpointing: whether the training forward keeps only each layer's input.
        activation_bytes: bytes of an activation / KV value (2: bf16).
        held_generation: whether the generation rows stay allocated during training (the graph engine's static cache).
        train_prompt_len: longest prompt of the training set in tokens, when known (the training micro-batch is padded
            to it, not to the engine's cap); None: ``prompt_len``.
        rollout_precision: ``"w4a16"``, ``"fp8"`` or ``"auto"``: with fp8 / auto the model that generates holds an FP8
            copy of the projections (the policy itself with the graph engine: added to ``weights``).
    """

    quantization: str
    lora_r: int
    lora_targets: tuple[str, ...]
    generation_rows: int
    micro_batch_rows: int
    prompt_len: int
    completion_len: int
    cache_len: int
    gradient_checkpointing: bool = True
    lora_param_bytes: int = 4
    optimizer_states: int = 2
    optimizer_state_bytes: int | None = None  # default: lora_param_bytes
    activation_bytes: int = 2
    held_generation: bool = True
    train_prompt_len: int | None = None
    rollout_precision: str = "w4a16"

    def __post_init__(self) -> None:
        if self.rollout_precision not in PRECISIONS:
            raise MemoryPlanError(f"rollout_precision {self.rollout_precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.quantization not in WEIGHT_BYTES:
            raise MemoryPlanError(f"quantization {self.quantization!r}: expected one of {', '.join(WEIGHT_BYTES)}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            raise MemoryPlanError(f"no memory plan for LoRA targets {unknown}: it knows {', '.join(LORA_TARGETS)}")
        for name in ("lora_r", "generation_rows", "micro_batch_rows", "prompt_len", "completion_len", "cache_len"):
            if getattr(self, name) < 1:
                raise MemoryPlanError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_len < self.prompt_len + self.completion_len:
            raise MemoryPlanError(
                f"cache_len ({self.cache_len}) < prompt_len + completion_len ({self.prompt_len} + {self.completion_len})"
            )


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part of a step (see the module docstring) and the rows that fit ``budget_bytes``.

    ``wave_rows``: the most generation rows held at once so that the peak stays within ``budget_bytes × (1 −
    margin)`` (``generation_rows`` when all fit; 0 when not even one does); ``waves``: generation calls of at most
    that many rows that one step's generation batch takes.
    """

    model: ModelShape
    run: RunShape
    budget_bytes: int
    margin: float
    weights: int
    lora: int  # adapter parameters + their gradients
    optimizer: int
    training: int  # the training micro-batch's activations (transient)
    kv_per_row: int
    buffers_per_row: int  # engine buffers + decode-step temporaries, held with the row
    prefill_per_row: int  # transient, during a wave's prefill
    wave_rows: int
    details: dict[str, int] = field(default_factory=dict)
    #: bytes held twice only while a colocated vLLM engine starts: the weights the policy then shares with it (both
    #: copies exist until the engine has loaded and the policy's are freed, with the KV cache already allocated)
    startup_extra: int = 0
    #: bytes per GPU of a KV cache whose size is fixed (a colocated vLLM engine's ``kv_cache_memory_bytes``), held
    #: whatever the rows: part of :attr:`fixed`, the rows then hold nothing of their own and ``kv_per_row`` is what one
    #: sequence takes of it; 0: the KV cache grows with the rows
    kv_cache_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """The budget less the margin: what the planned peak must stay under."""
        return int(self.budget_bytes * (1 - self.margin))

    @property
    def fixed(self) -> int:
        """Held whatever the number of rows: weights, LoRA (+ gradients), optimizer state, a fixed KV cache."""
        return self.weights + self.lora + self.optimizer + self.kv_cache_bytes

    @property
    def per_row(self) -> int:
        """Held per generation row: its KV cache and engine buffers (nothing with a fixed :attr:`kv_cache_bytes`)."""
        return 0 if self.kv_cache_bytes else self.kv_per_row + self.buffers_per_row

    @property
    def kv_cache_rows(self) -> int:
        """With a fixed :attr:`kv_cache_bytes`: the generation rows (sequences of ``kv_per_row`` bytes) it holds at
        once, at most the run's; 0 without one."""
        return min(self.run.generation_rows, self.kv_cache_bytes // self.kv_per_row) if self.kv_cache_bytes else 0

    def peak(self, rows: int) -> int:
        """Planned peak with ``rows`` generation rows held: the fixed part, the rows, and the larger of the prefill
        (a wave of ``rows``), the training micro-batch (with the rows still held when ``held_generation``) and a
        colocated engine's start (:attr:`startup_extra`)."""
        held = self.fixed + rows * self.per_row
        prefill = held + rows * self.prefill_per_row
        train = (held if self.run.held_generation else self.fixed) + self.training
        return max(prefill, train, held + self.startup_extra)

    @property
    def fits(self) -> bool:
        return self.wave_rows >= 1

    @property
    def waves(self) -> int:
        return math.ceil(self.run.generation_rows / self.wave_rows) if self.wave_rows else 0

    @property
    def rows_per_wave(self) -> int:
        """The rows each wave decodes (the generation batch split evenly, as ``graph_generate(max_rows=)`` does)."""
        return math.ceil(self.run.generation_rows / self.waves) if self.wave_rows else 0

    def summary(self) -> str:
        """The parts in GB, one line (for logs)."""
        rows = self.rows_per_wave
        parts = (
            f"weights {self.weights / GB:.1f} GB, LoRA + grads {self.lora / GB:.2f} GB, optimizer "
            f"{self.optimizer / GB:.2f} GB, training micro-batch ({self.run.micro_batch_rows} x "
            f"{self.run.prompt_len + self.run.completion_len} tokens) {self.training / GB:.1f} GB, KV cache "
            f"{self.kv_per_row / GB:.3f} GB per row of {self.run.cache_len} positions"
        )
        if not rows:
            return parts
        return (
            f"{parts}; {self.run.generation_rows} rows in {self.waves} wave(s) of <= {rows}: planned peak "
            f"{self.peak(rows) / GB:.1f} of {self.usable_bytes / GB:.1f} GB usable ({self.budget_bytes / GB:.1f} GB "
            f"budget, {self.margin:.0%} kept free)"
        )


def weight_bytes_per_param(quantization: QuantScheme | str, nf4_double_quant: bool = True) -> float:
    """Bytes per projection weight of a ``quantization`` value (``"nvfp4-rtn"``, ``"mxfp4-rtn"``, ``"nf4"``,
    ``"none"``, a bare format name, or an NVFP4 method alias such as ``"rtn"``)."""
    return WEIGHT_BYTES[_format_key(quantization, nf4_double_quant)]


def _format_key(quantization: Any, nf4_double_quant: bool = True) -> str:
    """The :data:`WEIGHT_BYTES` key of a :class:`~qerl_trl.quantization.QuantScheme` (``QeRLConfig.quant_scheme``,
    the config's parsed ``quantization``) or of a key itself."""
    if isinstance(quantization, str):
        if quantization in WEIGHT_BYTES:
            return quantization
        raise MemoryPlanError(
            f"no memory plan for quantization {quantization!r}: pass a QuantScheme (qerl_trl.quantization.get_scheme) "
            f"or one of {', '.join(map(repr, WEIGHT_BYTES))}"
        )
    if quantization.is_dense:
        return DENSE
    if quantization.format is not None:
        return quantization.format.name
    return quantization.name if nf4_double_quant else f"{quantization.name}-no-double-quant"  # bitsandbytes NF4


def _lora_targets(targets: str | Iterable[str] | None) -> tuple[str, ...]:
    if targets is None or targets == "all-linear":
        return LORA_TARGETS
    if isinstance(targets, str):  # PEFT takes a regex string too: the plan cannot size that
        raise MemoryPlanError(f"no memory plan for the LoRA target pattern {targets!r}: list the module names")
    return tuple(dict.fromkeys(targets))


def plan_memory(model: ModelShape, run: RunShape, budget_bytes: int, margin: float = DEFAULT_MARGIN) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``run`` on ``model`` within ``budget_bytes`` (the GPU memory the run may use).

    ``wave_rows`` is the largest ``R <= run.generation_rows`` with ``peak(R) <= budget_bytes · (1 − margin)``; every
    part is linear in ``R``, so it is solved for directly. See the module docstring for each part's formula.
    """
    if budget_bytes <= 0:
        raise MemoryPlanError(f"budget_bytes must be > 0, got {budget_bytes}")
    if not 0 <= margin < 1:
        raise MemoryPlanError(f"margin must be in [0, 1), got {margin}")
    m, a = model, run.activation_bytes
    h, i, v, n_layers = m.hidden_size, m.intermediate_size, m.vocab_size, m.num_layers
    proj = m.projections()
    parts = _weight_parts(m, run)
    fp8_copy = n_layers * parts["fp8_layer"] if run.rollout_precision != "w4a16" else 0
    weights = int(n_layers * parts["layer"] + parts["embeddings"] + parts["final_norm"] + fp8_copy)

    lora_params = n_layers * sum(run.lora_r * sum(proj[t]) for t in run.lora_targets)
    lora = 2 * lora_params * run.lora_param_bytes  # parameters + gradients
    state_bytes = run.lora_param_bytes if run.optimizer_state_bytes is None else run.optimizer_state_bytes
    optimizer = lora_params * run.optimizer_states * state_bytes

    train_prompt = min(run.prompt_len, run.train_prompt_len or run.prompt_len)
    tokens = run.micro_batch_rows * (train_prompt + run.completion_len)
    layer_act = (_TRAIN_H * h + _TRAIN_I * i) * a  # one layer's activations + gradients, per token
    kept = n_layers * h * a if run.gradient_checkpointing else n_layers * layer_act
    recompute = layer_act if run.gradient_checkpointing else 0
    mask = run.micro_batch_rows * (train_prompt + run.completion_len) ** 2 * (1 + a)
    lm_head = min(tokens, _LM_HEAD_TILE[0]) * _LM_HEAD_TILE[1] * a + tokens * h * 4
    training = int(tokens * (kept + recompute) + mask + lm_head)

    kv_per_row = m.kv_bytes_per_token(a) * run.cache_len
    buffers_per_row = (2 * 8 + 4) * run.cache_len + 4 * v + _DECODE_LOGITS_BYTES * v  # seq, mask int64; logp fp32
    prefill_per_row = int(
        run.prompt_len * (_PREFILL_H * h + _PREFILL_I * i) * a  # the layer's intermediates
        + 2 * m.num_attention_heads * m.head_dim * run.cache_len * a  # repeat_kv of the whole cache (SDPA, masked)
        + run.prompt_len * run.cache_len  # the boolean SDPA mask
        + v * (a + 4)  # the last position's logits, and their fp32 copy
    )
    plan = MemoryPlan(
        model=m, run=run, budget_bytes=int(budget_bytes), margin=margin, weights=weights, lora=lora,
        optimizer=optimizer, training=training, kv_per_row=kv_per_row, buffers_per_row=buffers_per_row,
        prefill_per_row=prefill_per_row, wave_rows=0,
        details={"lora_params": lora_params, "training_tokens": tokens, "training_kept": int(tokens * kept),
                 "training_mask": int(mask), "training_lm_head": int(lm_head), "fp8_copy": int(fp8_copy)},
    )  # fmt: skip
    object.__setattr__(plan, "wave_rows", _fit_rows(plan))
    return plan


def _weight_parts(m: ModelShape, run: RunShape) -> dict[str, float]:
    """Bytes of one decoder layer's weights (projections in the run's format, its two RMSNorms and q/k/v biases in
    bf16) and of its projections alone, of the embeddings + ``lm_head`` (bf16, one matrix when tied) and of the final
    norm."""
    proj = m.projections()
    projections = sum(n_in * n_out for n_in, n_out in proj.values()) * WEIGHT_BYTES[run.quantization]
    projections += len(proj) * TENSOR_BYTES.get(run.quantization, 0)
    layer = projections + 2 * 2 * m.hidden_size  # RMSNorm weights
    if m.attention_bias:
        layer += 2 * (proj["q_proj"][1] + 2 * proj["k_proj"][1])
    return {
        "layer": layer,
        "layer_projections": projections,
        "fp8_layer": fp8_copy_bytes(list(proj.values())),
        "embeddings": 2 * m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2),
        "final_norm": 2 * m.hidden_size,
    }


def _fit_rows(plan: MemoryPlan) -> int:
    """The most generation rows whose peak stays within the usable budget (0 when not one fits)."""
    run = plan.run
    if plan.kv_cache_bytes:  # a fixed KV cache: the sequences it holds at once, when it fits beside the rest
        return plan.kv_cache_rows if plan.peak(0) <= plan.usable_bytes else 0
    if plan.per_row + plan.prefill_per_row == 0:  # rows that hold nothing here (a vLLM server's): all, or none
        return run.generation_rows if plan.peak(0) <= plan.usable_bytes else 0
    room = plan.usable_bytes - plan.fixed
    by_prefill = room // (plan.per_row + plan.prefill_per_row)
    by_train = (room - plan.training) // plan.per_row if run.held_generation else (room if room >= plan.training else -1)
    by_startup = (room - plan.startup_extra) // plan.per_row
    return int(max(0, min(run.generation_rows, by_prefill, by_train, by_startup)))


def run_shape_from_config(
    args: Any, *, world_size: int = 1, activation_bytes: int | None = None, train_prompt_len: int | None = None
) -> RunShape:
    """The :class:`RunShape` of a ``QeRLConfig`` (read by attribute, so the module does not import trl).

    Generation rows per process: ``per_device_train_batch_size × steps_per_generation`` (TRL's generation batch is
    ``per_device_train_batch_size × num_processes × steps_per_generation``, sharded over the processes;
    ``steps_per_generation`` defaults to ``gradient_accumulation_steps``), whatever ``world_size`` (the processes
    planned: ``args.world_size``, the ones the config was parsed in, divides TRL's batch; ``world_size`` only when
    ``args`` has none). The prompt cap and the cache length are the
    graph engine's (:func:`qerl_trl.trainer.generation_cache_len`). LoRA adapters in fp32 (the trainer's), AdamW-style
    optimizers with 2 states (``*8bit*``: 1-byte states; ``sgd``: none); activations in bf16 when ``bf16`` or
    ``fp16`` is on, else fp32 (a CPU run's; ``activation_bytes`` overrides, e.g. 2 to plan a CPU-parsed config for a
    GPU).
    """
    steps = getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps
    gen_batch = getattr(args, "generation_batch_size", None)
    # TRL sized its generation batch for the processes the config was parsed in (``args.world_size``): one for
    # ``qerl plan --gpus N``, which plans N; each process's share is the same whatever N (TRL's batch grows with it)
    parsed_world = int(getattr(args, "world_size", None) or world_size)
    rows = gen_batch // parsed_world if gen_batch else args.per_device_train_batch_size * steps
    kwargs: Mapping[str, Any] = getattr(args, "generation_kwargs", None) or {}
    prompt = int(args.generation_prompt_cache_len)
    completion = int(args.max_completion_length)
    cache = int(kwargs.get("max_cache_len") or prompt + completion)
    optim = str(getattr(args, "optim", "adamw_torch")).lower()
    states, state_bytes = (0, None) if optim.startswith("sgd") else (2, 1 if "8bit" in optim else None)
    bf16 = bool(getattr(args, "bf16", False)) or bool(getattr(args, "fp16", False))
    return RunShape(
        quantization=_format_key(getattr(args, "quant_scheme", None) or args.quantization,
                                 getattr(args, "nf4_double_quant", True)),  # fmt: skip
        lora_r=int(args.lora_r),
        lora_targets=_lora_targets(getattr(args, "lora_target_modules", None)),
        generation_rows=int(rows),
        micro_batch_rows=int(args.per_device_train_batch_size),
        prompt_len=prompt,
        completion_len=completion,
        cache_len=cache,
        gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
        optimizer_states=states,
        optimizer_state_bytes=state_bytes,
        activation_bytes=activation_bytes or (2 if bf16 else 4),
        held_generation=args.rollout_engine_class.holds_generation_memory,
        train_prompt_len=train_prompt_len,
        rollout_precision=_precision(args),
    )


def _precision(args: Any) -> str:
    """The config's parsed ``rollout_precision`` (``QeRLConfig.rollout_precision_spec``), ``"w4a16"`` if it has none."""
    spec = getattr(args, "rollout_precision_spec", None)
    return spec.name if spec is not None else "w4a16"


def check_plan(plan: MemoryPlan, *, waves_allowed: bool = True) -> None:
    """Raise :class:`MemoryPlanError` with one line when ``plan`` does not fit: not even one generation row, or (with
    ``waves_allowed=False``: an engine that cannot generate in waves) not the whole generation batch. The line says
    what does not fit, by how much, and which setting to change."""
    run = plan.run
    need_rows = 1 if waves_allowed else run.generation_rows
    if plan.wave_rows >= need_rows:
        return
    over = plan.peak(need_rows) - plan.usable_bytes
    what = "one generation row" if waves_allowed else f"the {run.generation_rows} generation rows"
    train_alone = plan.fixed + plan.training
    if plan.fixed > plan.usable_bytes:  # nothing a setting of this run can fix
        fix = "the policy's weights alone do not fit: use a smaller model, or a GPU with more memory"
        if run.quantization == DENSE:
            fix = "quantize the policy (quantization nvfp4-rtn), use a smaller model, or a GPU with more memory"
    elif train_alone > plan.usable_bytes:  # the training micro-batch alone is too large
        fix = (
            f"lower per_device_train_batch_size ({run.micro_batch_rows}; raise gradient_accumulation_steps to keep "
            f"{run.generation_rows} completions per step), or max_completion_length ({run.completion_len})"
        )
        if not run.gradient_checkpointing:
            fix = "turn gradient_checkpointing on, or " + fix
    elif waves_allowed:
        fix = (
            f"lower max_completion_length ({run.completion_len}) or generation_prompt_cache_len ({run.prompt_len}), or "
            f"per_device_train_batch_size ({run.micro_batch_rows})"
        )
    else:
        fix = (
            f"use rollout_engine='graph' (generates in waves of the rows that fit: {plan.wave_rows}), or lower "
            "per_device_train_batch_size x gradient_accumulation_steps or num_generations"
        )
    raise MemoryPlanError(
        f"the run does not fit in {plan.budget_bytes / GB:.1f} GB of GPU memory: weights {plan.weights / GB:.1f} GB + "
        f"LoRA and optimizer {(plan.lora + plan.optimizer) / GB:.1f} GB + training micro-batch "
        f"{plan.training / GB:.1f} GB + {what} ({plan.per_row / GB:.2f} GB each) is {over / GB:.1f} GB over the "
        f"{plan.usable_bytes / GB:.1f} GB usable ({plan.margin:.0%} kept free); {fix}"
    )


def check_fp8_copy(plan: MemoryPlan) -> None:
    """Raise :class:`MemoryPlanError` (one line, naming the numbers) when the FP8 copy of ``rollout_precision`` fp8 /
    auto does not fit beside the run, or costs it generation waves: an extra wave decodes the whole batch once more,
    far more time than FP8's 1.2-1.45x on the linears saves (the H100 spike, ``gemm_fp8_spike.json``). The plan
    without the copy is what ``w4a16`` would do; when that does not fit either, nothing is raised here
    (:func:`check_plan` says what does not fit and what to change: ``w4a16`` would not do)."""
    run = plan.run
    w4a16 = plan_memory(plan.model, replace(run, rollout_precision="w4a16"), plan.budget_bytes, plan.margin)
    if not w4a16.fits or (plan.fits and plan.waves <= w4a16.waves):
        return
    copy = plan.details["fp8_copy"]
    then = (f"then take {plan.waves} wave(s) of <= {plan.rows_per_wave} instead of {w4a16.waves} of <= "
            f"{w4a16.rows_per_wave}" if plan.fits else "then do not fit at all")  # fmt: skip
    raise MemoryPlanError(
        f"rollout_precision={run.rollout_precision!r} adds a {copy / GB:.1f} GB FP8 copy of the linears (1 byte a "
        f"weight + 4 per output row) to {w4a16.weights / GB:.1f} GB of weights: the {run.generation_rows} generation "
        f"rows {then} in {plan.usable_bytes / GB:.1f} GB usable; use rollout_precision='w4a16' here"
    )


def cuda_budget_bytes(device: Any = None) -> int:
    """GPU memory a run on ``device`` may use: what the driver reports free plus what this process's caching
    allocator already holds (so a plan made after the model loaded counts the model in both)."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def preflight(
    args: Any,
    model_config: Any,
    budget_bytes: int,
    *,
    world_size: int = 1,
    margin: float = DEFAULT_MARGIN,
    train_prompt_len: int | None = None,
) -> MemoryPlan | None:
    """``qerl train``'s memory check before the model loads (and the trainer's before its first step).

    Plans ``args`` (a ``QeRLConfig``) for ``model_config`` (a transformers config) within ``budget_bytes`` and raises
    :class:`MemoryPlanError` (one line) when the run does not fit. With ``rollout_engine="graph"`` a generation batch
    whose KV cache does not fit is generated in waves: ``args.generation_wave_rows`` is set to the rows that fit when
    it was None (a value the user set is checked instead). Returns the plan, or None when there is nothing to plan:
    ``rollout_engine="vllm"`` (the engine sizes its own KV cache to ``vllm_gpu_memory_utilization``) or a model or
    LoRA target the plan does not know (a mixture of experts, a target pattern): those runs are not checked.
    """
    engine = args.rollout_engine_class  # the engine says how it holds its generation memory
    if not engine.holds_generation_memory:
        return None
    try:
        plan = plan_memory(
            ModelShape.from_config(model_config),
            run_shape_from_config(args, world_size=world_size, train_prompt_len=train_prompt_len),
            budget_bytes,
            margin,
        )  # fmt: skip
    except MemoryPlanError:
        return None
    waves = engine.generates_in_waves
    wanted = getattr(args, "generation_wave_rows", None) if waves else None
    if plan.run.rollout_precision != "w4a16" and wanted is None:
        check_fp8_copy(plan)
    if wanted is not None and plan.peak(min(wanted, plan.run.generation_rows)) > plan.usable_bytes:
        rows = min(wanted, plan.run.generation_rows)
        over = plan.peak(rows) - plan.usable_bytes
        raise MemoryPlanError(
            f"generation_wave_rows={wanted} does not fit in {plan.budget_bytes / GB:.1f} GB of GPU memory: "
            f"{rows} rows of {plan.per_row / GB:.2f} GB (KV cache of {plan.run.cache_len} positions) are "
            f"{over / GB:.1f} GB over the {plan.usable_bytes / GB:.1f} GB usable; set it to {plan.wave_rows} or less "
            "(or leave it unset: the memory plan picks it)"
        )
    check_plan(plan, waves_allowed=waves)
    if waves and wanted is None and plan.waves > 1:
        args.generation_wave_rows = plan.wave_rows
    return plan


# ----------------------------------------------------------------------------------------------------------- FSDP2
#: config.json sizes of Qwen2.5-{7B,14B,32B,72B}-Instruct, for plans of models whose config is not at hand (no Hub)
QWEN25_SHAPES: dict[str, ModelShape] = {
    f"Qwen/Qwen2.5-{size}-Instruct": ModelShape(h, i, n, q, kv, 128, 152064, attention_bias=True, max_positions=32768)
    for size, (h, i, n, q, kv) in {
        "7B": (3584, 18944, 28, 28, 4),
        "14B": (5120, 13824, 48, 40, 8),
        "32B": (5120, 27648, 64, 40, 8),
        "72B": (8192, 29568, 80, 64, 8),
    }.items()
}
#: Decoder layers whose gathered (unsharded) weights FSDP2 holds at once: the one computing and the one prefetched.
FSDP_GATHERED_LAYERS = 2


def plan_fsdp2(
    model: ModelShape, run: RunShape, budget_bytes: int, num_gpus: int, margin: float = DEFAULT_MARGIN, *,
    vllm_colocate: bool = False, vllm_tp: int | None = None, vllm_shares_weights: bool = False,
    vllm_kv_cache_bytes: int | None = None, vllm_max_model_len: int | None = None, vllm_server: bool = False,
) -> MemoryPlan:  # fmt: skip
    """The :class:`MemoryPlan` of one GPU when ``num_gpus`` processes train ``run`` under FSDP2 (``fully_shard``:
    :mod:`nvfp4.fsdp` for the 4-bit weights, accelerate's per-decoder-layer groups for the rest), within
    ``budget_bytes`` per GPU. ``num_gpus == 1`` is :func:`plan_memory` (nothing to shard).

    ``vllm_server``: rollouts by a vLLM server on GPUs of its own (``vllm.server_url``): the generation rows hold
    nothing on these GPUs (their KV cache, buffers and prefill are the server's).

    ``vllm_colocate``: rollouts by colocated vLLM engines of ``tensor_parallel_size = vllm_tp`` (default
    ``num_gpus``: one engine over all the GPUs) on the same GPUs, ``num_gpus / vllm_tp`` of them. Each holds its own
    copy of the weights, split over its ``vllm_tp`` GPUs (``weights / vllm_tp`` per GPU), and a KV cache whose heads
    are split too: the plan's generation rows are then an engine's (the rows of its ``vllm_tp`` processes,
    ``kv_per_row / vllm_tp`` per GPU and row, the engine's activations left to the margin), and ``wave_rows`` is how
    many sequences of ``cache_len`` positions its KV cache holds at once (the engine schedules the rest).

    ``vllm_kv_cache_bytes`` (``vllm.kv_cache_memory_bytes``; None or 0: unset, as vLLM reads it): the engine's KV
    cache is that many bytes on each of its GPUs (vLLM's ``CacheConfig.kv_cache_memory_bytes`` is per GPU, each TP
    worker allocates it), held whatever the rows (:attr:`MemoryPlan.kv_cache_bytes`); ``wave_rows`` is then the
    sequences it holds at once, each of ``min(cache_len, vllm_max_model_len)`` positions, and 0 when the rest does
    not fit beside it or when it cannot hold one sequence of ``vllm_max_model_len`` positions (unset: the model's
    :attr:`~ModelShape.max_positions`), which vLLM refuses at start (``details["vllm_kv_start"]``: those bytes).

    ``vllm_shares_weights`` (``vllm.share_weights``): with one process and ``vllm_tp`` = 1 the policy's frozen
    weights are views of the engine's (:mod:`qerl_trl.rollout.shared_weights`), so the embeddings and ``lm_head``
    and, for NVFP4 (the engine's ``qerl`` backend keeps them packed, the default from Hopper on), the projections are
    counted once (``details["vllm_shared_weights"]``); the engine adds only its norms and biases. They are held twice
    while the engine starts (it loads its copy, then the policy's is freed): :attr:`MemoryPlan.startup_extra`.

    Per GPU: every weight, LoRA parameter, LoRA gradient and optimizer state divided by ``num_gpus`` (FSDP2 splits
    each tensor by rows), plus what FSDP2 holds whole while a step runs: the all-gathered weights and adapters (and
    their gradients before the reduce-scatter) of :data:`FSDP_GATHERED_LAYERS` decoder layers, and the embeddings and
    ``lm_head`` (the root and the tail groups keep theirs gathered through forward and backward). The training
    micro-batch and the generation rows are per process, as without FSDP. An estimate, like :func:`plan_memory`: it
    has not been checked against a measured FSDP2 step yet (``details["fsdp_gathered"]`` is the whole-tensor part).
    """
    if num_gpus < 1:
        raise MemoryPlanError(f"num_gpus must be >= 1, got {num_gpus}")
    tp = num_gpus if vllm_tp is None else vllm_tp
    if vllm_colocate and (tp < 1 or num_gpus % tp):
        raise MemoryPlanError(f"vllm.tensor_parallel_size={tp} must divide the GPU count ({num_gpus})")
    if vllm_colocate and (why := model.tensor_parallel_problem(tp)):  # vLLM's own start check, before any load
        ok = [t for t in range(1, num_gpus + 1) if num_gpus % t == 0 and model.tensor_parallel_problem(t) is None]
        use = ", ".join(map(str, ok[:-1])) + f" or {ok[-1]}" if len(ok) > 1 else str(ok[0])
        raise MemoryPlanError(f"vllm.tensor_parallel_size={tp} {why}, so vLLM would refuse to start: use {use} "
                              f"(vllm.tensor_parallel_size, dividing the {num_gpus} GPUs)")  # fmt: skip
    if vllm_colocate:  # an engine generates its tp processes' rows; its KV cache stays allocated while they train
        run = replace(run, held_generation=True, generation_rows=run.generation_rows * tp)
    precision = run.rollout_precision
    if vllm_colocate:  # the engine's weights carry the FP8 copy, not the policy's
        run = replace(run, rollout_precision="w4a16")
    base = plan_memory(model, run, budget_bytes, margin)
    parts = _weight_parts(model, run)
    n = num_gpus
    weights, lora, optimizer, details = base.weights, base.lora, base.optimizer, dict(base.details)
    if n > 1:
        lora_layer = base.lora / model.num_layers  # one layer's adapters + gradients
        whole = parts["embeddings"] + parts["final_norm"]
        gathered = FSDP_GATHERED_LAYERS * (parts["layer"] + lora_layer) + whole
        weights = int(base.weights / n + FSDP_GATHERED_LAYERS * parts["layer"] + whole)
        lora = int(base.lora / n + FSDP_GATHERED_LAYERS * lora_layer)
        optimizer = math.ceil(base.optimizer / n)
        details.update(num_gpus=n, fsdp_sharded=int((base.weights + base.lora + base.optimizer) / n),
                       fsdp_gathered=int(gathered))  # fmt: skip
    kv_per_row, buffers_per_row, prefill_per_row = base.kv_per_row, base.buffers_per_row, base.prefill_per_row
    if vllm_colocate:  # fp8: the E4M3 copy replaces the NVFP4 projections; auto: both
        fp8_copy = model.num_layers * parts["fp8_layer"] if precision != "w4a16" else 0
        dropped = model.num_layers * parts["layer_projections"] if precision == "fp8" else 0
        engine_weights = int((base.weights - dropped + fp8_copy) / tp)
        if vllm_shares_weights and n == 1 and tp == 1:
            # the engine keeps packed (its qerl backend) the formats with a global scale, as qerl_vllm.quant decides;
            # with fp8 it keeps no NVFP4 projections to share, only the embeddings
            fmt = FORMATS.get(run.quantization)
            keeps_packed = fmt is not None and fmt.has_global_scale and precision != "fp8"
            packed = model.num_layers * parts["layer_projections"] if keeps_packed else 0
            shared = parts["embeddings"] + packed
            engine_weights -= int(shared)
            details.update(vllm_shared_weights=int(shared))
        details.update(vllm_weights=engine_weights, vllm_tp=tp, vllm_fp8_copy=int(fp8_copy / tp))
        weights += engine_weights
        kv_per_row, buffers_per_row, prefill_per_row = math.ceil(base.kv_per_row / tp), 0, 0
    elif vllm_server:  # the server's GPUs hold the rows
        kv_per_row, buffers_per_row, prefill_per_row = 0, 0, 0
    kv_cache = int(vllm_kv_cache_bytes or 0) if vllm_colocate else 0
    if kv_cache:
        # vLLM pages its cache: a sequence holds the positions it has reached, at most the run's cache_len (prompt
        # cap + max_completion_length) and at most max_model_len (vLLM ends it there), so the sequences at once are
        # counted at the shorter of the two, full length (the worst case). vLLM's start check is one sequence of its
        # max_model_len (unset: the model's context length), which may be longer than any sequence of the run.
        max_len = vllm_max_model_len or model.max_positions or run.cache_len
        per_token = model.kv_bytes_per_token(run.activation_bytes)
        seq_len = min(run.cache_len, max_len)
        kv_per_row = math.ceil(per_token * seq_len / tp)
        details.update(vllm_kv_start=math.ceil(per_token * max_len / tp), vllm_max_model_len=max_len,
                       vllm_seq_len=seq_len)  # fmt: skip
    plan = replace(base, weights=weights, lora=lora, optimizer=optimizer, kv_per_row=kv_per_row,
                   buffers_per_row=buffers_per_row, prefill_per_row=prefill_per_row, wave_rows=0,
                   details=details, startup_extra=details.get("vllm_shared_weights", 0),
                   kv_cache_bytes=kv_cache)  # fmt: skip
    starts = kv_cache >= details.get("vllm_kv_start", 0)  # vLLM refuses a cache without one max_model_len sequence
    object.__setattr__(plan, "wave_rows", _fit_rows(plan) if starts else 0)
    return plan


def smallest_fsdp2_gpus(
    model: ModelShape, run: RunShape, budget_bytes: int, *, max_gpus: int = 8, margin: float = DEFAULT_MARGIN,
    waves_allowed: bool = True, vllm_colocate: bool = False, vllm_tp: int | None = None,
    vllm_shares_weights: bool = False, vllm_kv_cache_bytes: int | None = None, vllm_max_model_len: int | None = None,
    vllm_server: bool = False,
) -> int | None:  # fmt: skip
    """The fewest GPUs (1 .. ``max_gpus``; multiples of ``vllm_tp`` when it is set) of ``budget_bytes`` each on which
    :func:`plan_fsdp2` fits ``run`` (at least one generation row per wave, or the whole batch without
    ``waves_allowed``); None when none does."""
    for n in range(vllm_tp or 1, max_gpus + 1, vllm_tp or 1):
        if vllm_colocate and model.tensor_parallel_problem(vllm_tp or n):
            continue  # vLLM would refuse this count's engines
        plan = plan_fsdp2(model, run, budget_bytes, n, margin, vllm_colocate=vllm_colocate, vllm_tp=vllm_tp,
                          vllm_shares_weights=vllm_shares_weights, vllm_kv_cache_bytes=vllm_kv_cache_bytes,
                          vllm_max_model_len=vllm_max_model_len, vllm_server=vllm_server)  # fmt: skip
        if plan.wave_rows >= (1 if waves_allowed else run.generation_rows):
            return n
    return None


def fsdp2_answer(
    model: ModelShape, run: RunShape, budget_bytes: int, num_gpus: int, *, name: str = "the model",
    max_gpus: int = 8, margin: float = DEFAULT_MARGIN, waves_allowed: bool = True, vllm_colocate: bool = False,
    vllm_tp: int | None = None, vllm_shares_weights: bool = False, vllm_kv_cache_bytes: int | None = None,
    vllm_max_model_len: int | None = None, vllm_server: bool = False,
) -> tuple[bool, str]:  # fmt: skip
    """Whether ``run`` on ``model`` fits ``num_gpus`` GPUs of ``budget_bytes`` under FSDP2, and one line saying so:
    the planned peak per GPU against what is usable, and the smallest GPU count that would fit (``qerl plan``; an
    estimate, see :func:`plan_fsdp2`). With a fixed vLLM KV cache (``vllm_kv_cache_bytes``, bytes per GPU) the line
    says how many sequences it holds at once, and which value of ``vllm.kv_cache_memory_bytes`` would do when it
    cannot hold one sequence or does not fit beside the rest."""
    vllm = dict(vllm_colocate=vllm_colocate, vllm_tp=vllm_tp, vllm_shares_weights=vllm_shares_weights,
                vllm_kv_cache_bytes=vllm_kv_cache_bytes, vllm_max_model_len=vllm_max_model_len,
                vllm_server=vllm_server)  # fmt: skip
    plan = plan_fsdp2(model, run, budget_bytes, num_gpus, margin, **vllm)
    need = 1 if waves_allowed else run.generation_rows
    fits = plan.wave_rows >= need
    rows = plan.rows_per_wave if fits else need
    smallest = smallest_fsdp2_gpus(model, run, budget_bytes, max_gpus=max_gpus, margin=margin,
                                   waves_allowed=waves_allowed, **vllm)  # fmt: skip
    where = f"{num_gpus} GPU{'s' if num_gpus > 1 else ''} of {budget_bytes / GB:.1f} GB"
    mode = "FSDP2" if num_gpus > 1 else "one process"
    head = (
        f"{name} ({run.quantization}, LoRA r={run.lora_r}, micro-batch {run.micro_batch_rows} x "
        f"{run.prompt_len + run.completion_len} tokens) under {mode} on {where}: "
    )
    engine, shared = plan.details.get("vllm_weights", 0), plan.details.get("vllm_shared_weights", 0)
    engine_weights = f"{engine / GB:.1f} GB" + (f" (+ {shared / GB:.1f} GB shared with the policy)" if shared else "")
    kv, start = plan.kv_cache_bytes, plan.details.get("vllm_kv_start", 0)
    engine_kv = f"vLLM TP={plan.details.get('vllm_tp')} weights {engine_weights} + KV cache"
    if kv:  # held whatever the rows; vLLM schedules the sequences it cannot hold at once
        gen = (f"{engine_kv} {kv / GB:.1f} GB fixed by vllm.kv_cache_memory_bytes, holding {plan.kv_cache_rows} of the "
               f"{run.generation_rows} sequences of {plan.details['vllm_seq_len']} positions at once")  # fmt: skip
    elif vllm_server:
        gen = f"generation on the vLLM server ({rows} completions, no KV cache here)"
    elif vllm_colocate:
        gen = (f"{engine_kv} for {rows} concurrent sequence(s) of {run.cache_len} positions "
               f"{rows * plan.per_row / GB:.1f} GB")  # fmt: skip
    else:
        gen = f"{rows} generation row(s) per wave {rows * plan.per_row / GB:.1f} GB"
    body = (
        f"planned peak {plan.peak(rows) / GB:.1f} of {plan.usable_bytes / GB:.1f} GB usable per GPU (policy weights "
        f"{(plan.weights - engine) / GB:.1f} GB, LoRA + optimizer {(plan.lora + plan.optimizer) / GB:.2f} GB, "
        f"training {plan.training / GB:.1f} GB, {gen})"
    )
    if smallest is None:
        least = f"no count up to {max_gpus} GPUs fits"
    else:
        least = f"smallest GPU count that fits: {smallest}"
    over = plan.peak(rows) - plan.usable_bytes
    verdict = "fits" if fits else f"does not fit, {over / GB:.1f} GB over"
    mib = 2**20  # the values suggested for vllm.kv_cache_memory_bytes: whole MiB
    if kv and kv < start:  # vLLM itself stops at start: "max_model_len ... larger than ... stored in KV cache"
        verdict = (
            f"does not fit: vllm.kv_cache_memory_bytes={kv} cannot hold one sequence of "
            f"{plan.details['vllm_max_model_len']} positions (vLLM's max_model_len, {start / GB:.2f} GB per GPU) "
            f"and vLLM would refuse to start; raise it to {-(-start // mib) * mib} or more, or lower vllm.max_model_len"
        )
    elif kv and not fits:  # the fixed cache is held in full: a smaller one may fit
        room = (kv - over) // mib * mib  # the largest cache that fits beside the rest
        fix = (f"set vllm.kv_cache_memory_bytes to {room} or less" if room >= start else
               f"lowering vllm.kv_cache_memory_bytes cannot: one sequence needs {start / GB:.2f} GB")  # fmt: skip
        verdict = f"does not fit, {over / GB:.1f} GB over with its fixed KV cache ({fix})"
    return fits, f"{head}{verdict}: {body}; {least} (estimate)"


def fsdp2_requested() -> bool:
    """Whether ``accelerate launch`` was given an FSDP2 config (``distributed_type: FSDP``, ``fsdp_version: 2``, as
    ``recipes/accelerate/fsdp2.yaml``): it exports ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION=2``."""
    import os

    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("FSDP_VERSION") == "2"


def model_shape_for(name: str, config: Any = None) -> ModelShape:
    """The :class:`ModelShape` of a transformers ``config`` when there is one, else of a Qwen2.5 Instruct model named
    ``name`` (:data:`QWEN25_SHAPES`: its published sizes, for plans made where the config cannot be read)."""
    if config is not None:
        return ModelShape.from_config(config)
    key = name if name in QWEN25_SHAPES else f"Qwen/{name}" if f"Qwen/{name}" in QWEN25_SHAPES else None
    if key is None:
        raise MemoryPlanError(
            f"no config for {name!r} here and no known shape: pass a local model folder, or one of "
            f"{', '.join(QWEN25_SHAPES)}"
        )
    return QWEN25_SHAPES[key]


def fsdp2_preflight(
    args: Any, model: ModelShape, budget_bytes: int, num_gpus: int, *, name: str = "the model",
    margin: float = DEFAULT_MARGIN,
) -> tuple[bool, str]:  # fmt: skip
    """:func:`fsdp2_answer` for a ``QeRLConfig`` (``qerl plan``, and ``qerl train`` under an FSDP2 launch): the run's
    shape as :func:`run_shape_from_config` reads it with bf16 activations (the GPU run's, whatever machine plans it);
    ``rollout_engine="vllm"`` without a ``server_url`` plans colocated engines of ``vllm.tensor_parallel_size``
    (unset: ``num_gpus`` when several GPUs shard the policy, as the trainer resolves it; a ``ValueError`` when it does
    not divide ``num_gpus``; with ``vllm.share_weights`` on one GPU the weights are counted once; with
    ``vllm.kv_cache_memory_bytes`` its KV cache is that many bytes per GPU, sequences of at most ``vllm.max_model_len``
    positions), a vLLM server on other GPUs nothing (``vllm_server``: the rows hold nothing here); the graph engine
    may generate in waves."""
    run = run_shape_from_config(args, world_size=num_gpus, activation_bytes=2)
    engine = args.rollout_engine_class  # what it holds and how it generates are its own rules
    colocate = engine.colocated_engine(args)
    waves = engine.generates_in_waves or colocate  # a colocated vLLM schedules what its KV cache cannot hold at once
    server = not colocate and not engine.holds_generation_memory  # a vLLM server: its own GPUs hold the rows
    if colocate:
        args.vllm.tp_size(num_gpus, fsdp2=num_gpus > 1)  # ValueError when it does not divide the GPU count
    tp = args.vllm.tensor_parallel_size if colocate else None  # unset: each count's own (num_gpus)
    return fsdp2_answer(model, run, budget_bytes, num_gpus, name=name, margin=margin, waves_allowed=waves,
                        vllm_colocate=colocate, vllm_tp=tp,
                        vllm_shares_weights=colocate and args.vllm.share_weights,
                        vllm_kv_cache_bytes=args.vllm.kv_cache_memory_bytes if colocate else None,
                        vllm_max_model_len=args.vllm.max_model_len if colocate else None,
                        vllm_server=server)  # fmt: skip

