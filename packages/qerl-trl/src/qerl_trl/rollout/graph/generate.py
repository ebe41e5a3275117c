"""A decode loop that replays one compiled graph per step, sampling included (gpt-fast style).

Why: transformers' ``generate(..., cache_implementation="static")`` compiles only the decode *forward* into a CUDA
graph. Around it, every step runs the logits processors and stopping criteria in Python and syncs the GPU to the host
(``unfinished_sequences.max()``); on an H100 with a 7B model that host work leaves the GPU idle 3.6-9.7 ms per step,
more than the step's GEMMs take (4.4 ms). :func:`graph_generate` puts the whole step (forward, EOS suppression,
sampling, the finished-row bookkeeping and the next step's inputs) into one ``torch.compile(mode="reduce-overhead")``
function whose inputs and state are all static-address tensors updated in place. The Python loop only replays it and
never waits for the GPU, except for an "all rows finished?" check every ``check_every`` steps (none at all with
``min_new_tokens == max_new_tokens``), so the CPU runs ahead and the GPU sees back-to-back graph launches.

Finished rows are compacted away: RL completions vary in length, and without it every row keeps decoding (pad tokens)
until the longest one stops, so the tail of a rollout runs at the full batch. At a check where at most half the rows
are unfinished, the unfinished rows (their KV cache, tokens and bookkeeping) move to the front and decoding goes on at
half the batch (or a quarter, ...), each size with its own compiled graph over views of the same buffers. For the
NVFP4 kernels this matters more than for bf16: a 7B decode step at batch 32 takes about half the time of one at
batch 128 (bf16: about 85 %; BENCHMARKS.md).

A batch whose KV cache does not fit is generated in waves (``max_rows``): the cache holds one wave's rows at full
length (prompt + every new token: 2.4 GB per row for Qwen2.5-32B at 9,216 positions), and the waves go through it one
after the other; :mod:`qerl_trl.memory_plan` says how many rows fit.

Only torch and transformers are imported here (no trl), so the benchmarks can import this module on its own.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import StaticCache, StaticLayer

__all__ = ["COMPACT_MIN_BATCH", "DEFAULT_COMPILE_OPTIONS", "graph_generate", "release_graph_state"]

#: ``torch.compile`` keyword arguments of the decode step when ``compile_options`` is not given: inductor with CUDA
#: graphs (cudagraph trees), graph breaks allowed, shapes static (one graph per batch size and cache length).
DEFAULT_COMPILE_OPTIONS: dict[str, Any] = {"mode": "reduce-overhead", "fullgraph": False, "dynamic": False}

#: Smallest batch that finished-row compaction halves down to (``compact_min_batch``'s default). Below about 32 rows a
#: 7B decode step is bound by reading the weights in either format (H100: NVFP4 + LoRA 4.9 ms at B = 8 against 5.6 ms
#: at B = 32; bf16 + LoRA 9.0 against 9.4 ms), so a smaller batch saves little, while each size is one more compile.
COMPACT_MIN_BATCH = 32


@dataclass
class _Rows:
    """The first ``b`` rows of a :class:`_State`'s per-row buffers and KV cache: views of the same storage, kept so that
    the step compiled for batch ``b`` sees the same tensors (addresses) in every rollout. Shapes as in :class:`_State`
    with ``B`` replaced by ``b``."""

    cache: StaticCache
    tok: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    seq: torch.Tensor
    logp: torch.Tensor
    finished: torch.Tensor
    gen_len: torch.Tensor
    noise: torch.Tensor | None


@dataclass
class _State:
    """Everything the decode step reads or writes, kept per model between calls.

    Reusing the same tensors (same addresses) across calls is what lets a second call replay the CUDA graphs recorded
    by the first: cudagraph trees read static inputs in place and re-record when such an address changes.
    Shapes: ``B`` batch, ``L`` cache length, ``V`` vocabulary (logits width).
    """

    key: tuple
    cache: StaticCache
    tok: torch.Tensor  # [B, 1] int64: the token the next step feeds
    pos: torch.Tensor  # [B, 1] int64: its position id
    mask: torch.Tensor  # [B, L] int64: prompt mask, then 1 for every generated position
    seq: torch.Tensor  # [B, L] int64: prompt + generated tokens
    #: [B, L] float32, aligned with ``seq``: at each generated position the log-probability of the token there under
    #: the distribution it was drawn from, ``log_softmax(logits / temperature)`` (EOS at -inf while ``eos_block``),
    #: vLLM's ``processed_logprobs``; 0 after the row's EOS, the prompt's positions unwritten. Moves with the row when
    #: finished rows are compacted, as ``seq`` does.
    logp: torch.Tensor
    cur: torch.Tensor  # [1] int64: index in ``seq`` of the next generated token
    finished: torch.Tensor  # [B, 1] bool: row emitted an EOS
    gen_len: torch.Tensor  # [B, 1] int64: tokens generated before finishing (the EOS included)
    eos_block: torch.Tensor  # [] bool: EOS logits are set to -inf (fewer than min_new_tokens generated)
    pad: torch.Tensor  # [] int64: token emitted by finished rows
    temperature: torch.Tensor  # [] float32
    eos_mask: torch.Tensor | None = None  # [V] bool: True at the EOS ids (allocated at the first prefill)
    noise: torch.Tensor | None = None  # [B, V] float32: Exp(1) draws for sampling (allocated when sampling)
    views: dict[int, _Rows] = field(default_factory=dict)  # batch -> its rows (emptied when ``noise`` is reallocated)

    def rows(self, b: int, config: Any) -> _Rows:
        """The first ``b`` rows (all of them for ``b == B``); the KV-cache view is made after the prefill has
        allocated the cache, with ``config`` (the model's) for its layer types."""
        if b not in self.views:
            full = b == self.tok.shape[0]
            self.views[b] = _Rows(
                cache=self.cache if full else _row_view_cache(self.cache, config, b),
                **{n: getattr(self, n) if full else _static(getattr(self, n)[:b])
                   for n in ("tok", "pos", "mask", "seq", "logp", "finished", "gen_len")},
                noise=None if self.noise is None else self.noise if full else _static(self.noise[:b]),
            )  # fmt: skip
        return self.views[b]


_STATES: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()
_COMPILED: dict[tuple, Callable[..., None]] = {}


def release_graph_state(model: nn.Module) -> None:
    """Drop the static KV cache and buffers :func:`graph_generate` keeps for ``model`` (the next call allocates new
    ones, so its graphs are re-recorded)."""
    _STATES.pop(model, None)


def _static(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(t)
    return t


def _row_view_cache(cache: StaticCache, config: Any, rows: int) -> StaticCache:
    """A ``StaticCache`` over the first ``rows`` rows of ``cache`` (every layer's keys and values are views; the
    position counters are the same tensors), so a step over it writes into ``cache``."""
    view = StaticCache(config=config, max_cache_len=cache.layers[0].max_cache_len)
    for src, dst in zip(cache.layers, view.layers, strict=True):
        dst.dtype, dst.device, dst.batch_size, dst.num_heads = src.dtype, src.device, rows, src.num_heads
        dst.k_head_dim, dst.v_head_dim = src.k_head_dim, src.v_head_dim
        dst.keys, dst.values = _static(src.keys[:rows]), _static(src.values[:rows])
        dst.cumulative_length = src.cumulative_length
        dst.is_initialized = True
    return view


def _compact_size(unfinished: int, batch: int, min_batch: int) -> int:
    """The batch to go on decoding at: ``batch`` halved (rounding up) as long as the half still holds the
    ``unfinished`` rows and is at least ``min_batch``. Only the sizes ``batch``, ``ceil(batch/2)``, ... ever occur, so
    a rollout compiles at most ``log2(batch / min_batch)`` extra graphs."""
    size = batch
    while (size + 1) // 2 >= max(unfinished, min_batch) and size > 1:
        size = (size + 1) // 2
    return size


def _get_state(model: nn.Module, batch: int, cache_len: int, device: torch.device) -> _State:
    """The model's kept state if it fits (same cache length and device; ``batch`` rows, or more rows whose cache was
    allocated by an earlier prefill, of which the call uses the first ``batch`` through views), reset; else a new one
    of ``batch`` rows. Reusing a larger state keeps its graphs: a DAPO refill round or the last, smaller wave of a
    call then replays graphs recorded over the same buffers instead of reallocating the cache."""
    key = (batch, cache_len, str(device))
    st = _STATES.get(model)
    if st is not None and st.key[1:] == key[1:] and (st.key[0] == batch or (st.key[0] > batch and _allocated(st))):
        st.cache.reset()
        return st
    _STATES.pop(model, None)  # one state per model (like transformers' ``model._cache``): free the old cache first

    def buf(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return _static(torch.zeros(shape, dtype=dtype, device=device))

    st = _State(
        key=key,
        cache=StaticCache(config=model.config, max_cache_len=cache_len),
        tok=buf(batch, 1),
        pos=buf(batch, 1),
        mask=buf(batch, cache_len),
        seq=buf(batch, cache_len),
        logp=buf(batch, cache_len, dtype=torch.float32),
        cur=buf(1),
        finished=buf(batch, 1, dtype=torch.bool),
        gen_len=buf(batch, 1),
        eos_block=buf(dtype=torch.bool),
        pad=buf(),
        temperature=buf(dtype=torch.float32),
    )
    _STATES[model] = st
    return st


def _allocated(st: _State) -> bool:
    """Whether the state's KV cache exists (StaticCache allocates it at the first prefill), so row views can be made."""
    return all(getattr(layer, "is_initialized", False) for layer in st.cache.layers)


def _choose(
    logits: torch.Tensor,
    tok: torch.Tensor,
    seq: torch.Tensor,
    logp: torch.Tensor,
    cur: torch.Tensor,
    finished: torch.Tensor,
    gen_len: torch.Tensor,
    eos_mask: torch.Tensor,
    eos_block: torch.Tensor,
    pad: torch.Tensor,
    temperature: torch.Tensor,
    noise: torch.Tensor | None,
    do_sample: bool,
) -> None:
    """Pick the next token from ``logits`` ([B, V], last position) and advance the state in place; no host sync.

    Sampling is gpt-fast's ``argmax(probs / q)`` with ``q ~ Exp(1)`` (``noise``, drawn by the caller): the same
    distribution as ``torch.multinomial(probs, 1)`` without its device-to-host synchronisation.

    The chosen token's log-probability goes to ``logp`` [B, L] float32 at column ``cur`` (0 for finished rows): the
    float32 ``log_softmax(logits / temperature)`` of the trainer (TRL divides its logits by the same temperature), with
    the EOS logits at -inf while ``eos_block`` is set (``min_new_tokens``), the distribution the token was actually
    drawn from, as vLLM's ``processed_logprobs`` (which also masks EOS for ``min_tokens``). Greedy decoding divides by
    1 (``temperature`` holds 1.0). It costs one gather and one ``logsumexp`` over the vocabulary per step, no [B, V]
    log-softmax written: eagerly one more read of the [B, V] float32 ``scaled`` logits (the softmax reads them too);
    compiled, inductor may fuse its max and sum with the softmax's over the same row (not measured).
    """
    logits = logits.float().masked_fill(eos_mask & eos_block, float("-inf"))
    scaled = logits / temperature
    if do_sample:
        probs = torch.softmax(scaled, dim=-1)
        nxt = torch.argmax(probs / noise.clamp_min(1e-30), dim=-1, keepdim=True)  # a 0 draw (CPU) must not give NaN
    else:
        nxt = torch.argmax(logits, dim=-1, keepdim=True)
    # not log(probs[nxt]): that underflows to -inf for a token below e^-103 (float32), which a draw can still pick
    lp = scaled.gather(1, nxt) - torch.logsumexp(scaled, dim=-1, keepdim=True)
    nxt = torch.where(finished, pad, nxt)  # finished rows keep emitting pad
    lp = lp.masked_fill(finished, 0.0)
    gen_len.add_((~finished).long())
    finished.logical_or_(eos_mask[nxt])
    seq.index_copy_(1, cur, nxt)
    logp.index_copy_(1, cur, lp)
    cur.add_(1)
    tok.copy_(nxt)


def _decode_step(
    model: nn.Module,
    cache: StaticCache,
    pos: torch.Tensor,
    mask: torch.Tensor,
    keep_last: bool,
    tok: torch.Tensor,
    *choose_args: Any,
) -> None:
    """One decode step: forward of ``tok`` at ``pos`` (the cache's own counter is the cache position), then
    ``_choose(logits, tok, *choose_args)``. Every tensor argument is a static-address buffer; the outputs are in-place
    updates only."""
    extra = {"logits_to_keep": 1} if keep_last else {}
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, **extra)
    pos.add_(1)
    _choose(out.logits[:, -1, :], tok, *choose_args)


def _model_config(model: nn.Module) -> tuple:
    """What a compiled step depends on beyond what dynamo guards: the class of every module, the dtype of every
    parameter and which modules carry forward hooks. AQN with ``norm_dtype`` swaps the norms for noisy wrappers for a
    rollout; each configuration gets its own compiled step (and CUDA graphs), replayed whenever it comes back."""
    modules = list(model.modules())
    types = tuple(type(m) for m in modules)
    dtypes = tuple(p.dtype for p in model.parameters())
    hooked = tuple(i for i, m in enumerate(modules) if m._forward_pre_hooks or m._forward_hooks)
    return types, dtypes, hooked


def _compiled_decode_unsafe(model: nn.Module) -> bool:
    """Whether some module carries a forward hook marked ``compiled_decode_unsafe`` (AQN's per-forward noise, which
    resamples in a Python hook before every forward: a replayed step would keep one draw)."""
    for m in model.modules():
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            if getattr(getattr(hook, "__self__", None), "compiled_decode_unsafe", False):
                return True
    return False


_WARNED_EAGER = False


def _warn_eager_once() -> None:
    global _WARNED_EAGER
    if not _WARNED_EAGER:
        _WARNED_EAGER = True
        warnings.warn(
            "graph_generate: AQN's per-forward noise hook is on (it resamples before every forward, which a compiled "
            "step cannot replay); decoding these rollouts eagerly",
            stacklevel=3,
        )


def _compiled_step(options: Mapping[str, Any], config: tuple = ()) -> Callable[..., None]:
    """One ``torch.compile`` wrapper per set of options and ``config`` (the model configuration of
    :func:`_model_config` and the batch size), kept for the process. Dynamo caches graphs per code object, so each
    configuration compiles a copy of :func:`_decode_step` with its own code object: its graphs are never reused for
    another configuration, switching back replays the graphs already compiled, and the batch sizes of compaction do
    not count towards dynamo's recompile limit of one code object."""
    key = (repr(sorted(options.items())), config)
    if key not in _COMPILED:
        n = len(_COMPILED)
        code = _decode_step.__code__.replace(co_name=f"_decode_step_{n}", co_qualname=f"_decode_step_{n}")
        fn = types.FunctionType(code, _decode_step.__globals__, code.co_name, _decode_step.__defaults__)
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PeftModel forwards its kwargs
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def _eos_list(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"eos_token_id must be non-negative ints, got {eos_token_id!r}")
    return list(dict.fromkeys(ids))


@torch.no_grad()
def graph_generate(
    model: nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    temperature: float = 1.0,
    do_sample: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    max_cache_len: int | None = None,
    compile: bool | None = None,
    compile_options: Mapping[str, Any] | None = None,
    check_every: int = 32,
    generator: torch.Generator | None = None,
    decode_attention: bool | None = None,
    compact: bool = True,
    compact_min_batch: int = COMPACT_MIN_BATCH,
    max_rows: int | None = None,
    return_logprobs: bool = False,
) -> torch.LongTensor | tuple[torch.LongTensor, torch.Tensor]:
    """Generate ``max_new_tokens`` tokens per row with a static KV cache and one compiled graph per decode step.

    The prompt is prefilled eagerly (one forward); each decode step (forward, EOS suppression, sampling, bookkeeping)
    is :func:`_decode_step`, wrapped in ``torch.compile(**compile_options)`` when ``compile``. The loop does not wait
    for the GPU between steps: whether every row has finished is read only every ``check_every`` steps.

    Args:
        model: a causal LM taking ``input_ids``, ``attention_mask`` (2D), ``position_ids`` and ``past_key_values``
            (a transformers ``PreTrainedModel`` or a ``PeftModel`` around one), on the device of ``input_ids``.
        input_ids: ``[B, P]`` integer prompt tokens, left-padded when the prompts differ in length.
        attention_mask: ``[B, P]`` 0/1 (or bool) mask of the real prompt tokens (zeros on the left); default all ones.
        max_new_tokens: tokens to generate per row (>= 1).
        min_new_tokens: EOS is suppressed (its logits set to -inf) for the first ``min_new_tokens`` tokens of each row;
            ``min_new_tokens == max_new_tokens`` means fixed-length generation without any host sync.
        temperature: softmax temperature for sampling (> 0); ignored when greedy.
        do_sample: sample (``argmax(probs / q)``, ``q ~ Exp(1)``, i.e. multinomial sampling) or take the argmax.
        eos_token_id: token id(s) that finish a row; None: rows never finish (the model's generation config is not
            consulted).
        pad_token_id: token emitted by a row after its EOS; default the first EOS id.
        max_cache_len: KV-cache length ``L`` (>= ``P + max_new_tokens``); default ``P + max_new_tokens``. Keep it fixed
            across calls with different prompt lengths to replay the same graph.
        compile: compile the decode step; default True on CUDA, False elsewhere.
        compile_options: ``torch.compile`` keyword arguments; default :data:`DEFAULT_COMPILE_OPTIONS`.
        check_every: decode steps between two "all rows finished?" checks (one device-to-host sync each); only
            when there is an EOS id and ``min_new_tokens < max_new_tokens``.
        generator: RNG for sampling, on the device of ``input_ids``; default the global RNG.
        decode_attention: run attention through :mod:`qerl_trl.rollout.graph.attention` (split-KV, skips the cache blocks
            no row attends to yet) while this call runs, for models on SDPA or eager attention; default on CUDA.
            The model's attention implementation is restored on return.
        compact: at each "all rows finished?" check, when at most half the rows are unfinished, move them to the
            front (KV cache included) and decode on at half the batch (halving again while that still holds them),
            each batch size with its own compiled graph. The returned tokens are the same (greedy tokens exactly;
            sampling draws from the same distribution, not the same random numbers).
        compact_min_batch: never compact below this many rows (>= 1).
        max_rows: decode at most this many rows at once (>= 1; default all): a larger batch is generated in waves,
            the rows split evenly (``ceil(B / ceil(B / max_rows))`` per wave, in order), one after the other through
            the same KV cache of that many rows, each wave compacted as it finishes. The memory plan
            (:mod:`qerl_trl.memory_plan`) gives the rows that fit. The returned tokens are those of one batch (greedy
            tokens exactly; sampling draws from the same distribution, not the same random numbers). Finished rows are
            not refilled from the queue as continuous batching does: all rows of the cache share one write position
            (``StaticCache``'s counter, one graph per step), so a row started later would need positions the cache
            does not have; a wave's tail runs at the compacted batch instead.
        return_logprobs: also return the generated tokens' logprobs (always recorded; this only returns them).

    Returns:
        ``[B, P + T]`` int64 on the device of ``input_ids``: the prompt followed by the generated tokens, rows that
        finished early padded with ``pad_token_id`` after their EOS, as ``model.generate`` returns it. ``T`` is
        ``max_new_tokens``, or (with an EOS id and ``min_new_tokens < max_new_tokens``) the number of steps after
        which every row had finished, as ``generate`` stops. With ``return_logprobs``: ``(that, logprobs)``,
        ``logprobs`` ``[B, T]`` float32 on the same device, aligned with the generated tokens: each token's
        log-probability under the distribution it was sampled from, ``log_softmax(logits / temperature)`` in float32
        (greedy: temperature 1; EOS excluded while fewer than ``min_new_tokens`` were generated), what vLLM returns as
        ``processed_logprobs`` and what the trainer's logprobs are compared with; 0 after a row's EOS.

    Graph reuse: the KV cache (``transformers.StaticCache``) and the step's buffers are kept per model for the next
    call with the same ``(B, L, device)`` (``B``: the rows of one wave), which then replays the same graph; a call with
    fewer rows on the same ``L`` decodes in the first rows of the kept ones (views: the graphs of its batch sizes are
    kept too); a call with more rows or another ``L`` replaces them (:func:`release_graph_state` frees them). The
    graph is specialised to ``(B, L)`` (and each compacted batch size), ``do_sample`` and whether the model takes
    ``logits_to_keep``; prompt length, ``max_new_tokens``, ``min_new_tokens``, EOS/pad ids and ``temperature`` are
    tensor inputs and never cause a recompile.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.numel() == 0:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, prompt_len] tensor, got {got}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
    elif attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, input_ids on {device}")
    if ((attention_mask != 0) & (attention_mask != 1)).any():  # positions are the mask's cumulative sum
        raise ValueError("attention_mask must hold 0/1 (or bool) values, got "
                         f"{sorted(set(attention_mask.unique().tolist()))[:8]}")  # fmt: skip
    empty = (attention_mask == 0).all(1).nonzero().flatten().tolist()
    if empty:  # attention over no key: the first token's logits depend on how each kernel fills a masked-out row
        raise ValueError(f"prompt rows {empty} have no token (attention_mask all 0): every prompt needs at least one")
    right = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
    if right:  # the first new token would be drawn from the logits of a pad position, and follow the padding
        raise ValueError(f"prompt rows {right[:8]} end in padding (attention_mask 0 in the last column): pad the "
                         "prompts on the left (tokenizer.padding_side = 'left'), as generate expects")  # fmt: skip
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
    if min_new_tokens > max_new_tokens:
        raise ValueError(f"min_new_tokens ({min_new_tokens}) > max_new_tokens ({max_new_tokens})")
    try:  # a number (a 0-d tensor too); inf would sample uniformly at random
        temp = math.nan if isinstance(temperature, str | bytes | bool) else float(temperature)
    except (TypeError, ValueError):
        temp = math.nan
    if do_sample and not 0 < temp < math.inf:
        raise ValueError(f"temperature must be a finite number > 0 when sampling, got {temperature!r}")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
    if isinstance(compact_min_batch, bool) or not isinstance(compact_min_batch, int) or compact_min_batch < 1:
        raise ValueError(f"compact_min_batch must be an int >= 1, got {compact_min_batch!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows must be an int >= 1 or None, got {max_rows!r}")
    if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)):
        raise ValueError(f"max_cache_len must be an int or None, got {max_cache_len!r}")
    cache_len = prompt_len + max_new_tokens if max_cache_len is None else max_cache_len
    if cache_len < prompt_len + max_new_tokens:
        raise ValueError(f"max_cache_len ({cache_len}) < prompt_len + max_new_tokens ({prompt_len} + {max_new_tokens})")
    if generator is not None and do_sample and generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device}, input_ids on {device}")
    eos = _eos_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    elif isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
    if compile is None:
        compile = device.type == "cuda"

    if decode_attention is None:
        decode_attention = device.type == "cuda"
    waves = 1 if max_rows is None or max_rows >= batch else math.ceil(batch / max_rows)
    wave = math.ceil(batch / waves)  # the batch split evenly: the last wave is at most waves - 1 rows shorter
    with _decode_attention(model, decode_attention):
        st = _get_state(model, wave, cache_len, device)
        if compile:
            odd = sorted({type(layer).__name__ for layer in st.cache.layers if type(layer) is not StaticLayer})
            if odd:  # e.g. sliding-window layers keep a Python int counter, which a replayed graph would not advance
                raise NotImplementedError(
                    f"compiled graph_generate supports full-attention cache layers only, got {odd}"
                )
        run = _Wave(
            model=model, st=st, prompt_len=prompt_len, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            temperature=temp, do_sample=do_sample, eos=eos, pad_token_id=pad_token_id,
            compile=compile, options=DEFAULT_COMPILE_OPTIONS if compile_options is None else compile_options,
            check_every=check_every, generator=generator, compact=compact, compact_min_batch=compact_min_batch,
            keep_last=_accepts_logits_to_keep(model),
        )  # fmt: skip
        outs = []
        for start in range(0, batch, wave):
            if start:
                st.cache.reset()  # the next wave's rows start from position 0 of the same cache
            outs.append(run(input_ids[start : start + wave], attention_mask[start : start + wave]))
    if len(outs) == 1:
        out, logp = outs[0]
    else:
        # as one batch would return them: up to the longest row's last token, pad (logprob 0) after each row's end
        out = torch.full((batch, max(o.shape[1] for o, _ in outs)), pad_token_id, dtype=torch.long, device=device)
        logp = torch.zeros(batch, out.shape[1] - prompt_len, dtype=torch.float32, device=device)
        for start, (o, lp) in zip(range(0, batch, wave), outs, strict=True):
            out[start : start + o.shape[0], : o.shape[1]] = o
            logp[start : start + lp.shape[0], : lp.shape[1]] = lp
    return (out, logp) if return_logprobs else out


@dataclass
class _Wave:
    """One :func:`graph_generate` call's settings; calling it generates one wave of rows (the first ``b`` rows of the
    state ``st``) and returns ``[b, P + T]`` as ``graph_generate`` does for a batch of ``b``, with the generated tokens'
    logprobs ``[b, T]`` float32 (0 after a row's EOS)."""

    model: nn.Module
    st: _State
    prompt_len: int
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    do_sample: bool
    eos: list[int]
    pad_token_id: int
    compile: bool
    options: Mapping[str, Any]
    check_every: int
    generator: torch.Generator | None
    compact: bool
    compact_min_batch: int
    keep_last: bool

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        model, st, prompt_len = self.model, self.st, self.prompt_len
        max_new_tokens, min_new_tokens, do_sample = self.max_new_tokens, self.min_new_tokens, self.do_sample
        eos, pad_token_id, generator = self.eos, self.pad_token_id, self.generator
        batch, device = input_ids.shape[0], input_ids.device
        full = st.tok.shape[0]
        extra = {"logits_to_keep": 1} if self.keep_last else {}

        # ---- prefill (eager), into the first ``batch`` rows of the state (views when the state has more)
        mask = attention_mask.to(torch.long)
        st.mask[:batch, :prompt_len].copy_(mask)
        # generated positions are 1 from the start: the causal mask (query offset = the cache's length) hides the future
        st.mask[:batch, prompt_len:].fill_(1)
        st.seq[:batch, :prompt_len].copy_(input_ids)
        st.cur.fill_(prompt_len)
        st.finished.zero_()
        st.gen_len.zero_()
        st.eos_block.fill_(min_new_tokens > 0)
        st.pad.fill_(pad_token_id)
        st.temperature.fill_(self.temperature if do_sample else 1.0)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate: left padding gets position 0
        out = model(
            input_ids=input_ids.to(torch.long),
            attention_mask=st.mask[:batch, :prompt_len],  # padded with zeros up to L by transformers' mask code
            position_ids=position_ids,
            past_key_values=st.cache if batch == full else st.rows(batch, model.config).cache,
            use_cache=True,
            **extra,
        )
        logits = out.logits[:, -1, :]
        del out
        vocab = logits.shape[-1]
        if max(eos + [pad_token_id]) >= vocab:
            raise ValueError(f"eos_token_id {eos} / pad_token_id {pad_token_id} outside the vocabulary ({vocab})")
        if st.eos_mask is None or st.eos_mask.shape[0] != vocab:
            st.eos_mask = _static(torch.zeros(vocab, dtype=torch.bool, device=device))
        st.eos_mask.zero_()
        if eos:
            st.eos_mask[torch.tensor(eos, device=device)] = True
        if do_sample and (st.noise is None or st.noise.shape[1] != vocab):
            st.noise = _static(torch.empty(full, vocab, dtype=torch.float32, device=device))
            st.views.clear()  # their noise views belong to the old buffer
        st.pos[:batch].copy_(mask.sum(-1, keepdim=True))
        first = rows = st.rows(batch, model.config)

        def choose_args(r: _Rows) -> tuple:  # the state _choose advances, in its argument order
            return (r.tok, r.seq, r.logp, st.cur, r.finished, r.gen_len, st.eos_mask, st.eos_block, st.pad,
                    st.temperature, r.noise if do_sample else None, do_sample)  # fmt: skip

        if do_sample:
            rows.noise.exponential_(generator=generator)
        state = choose_args(rows)  # what the prefill and every decode step pass (rebuilt only when rows change)
        _choose(logits, *state)
        del logits

        # ---- decode: replay the step, no host sync except the periodic "all finished?" check
        eager = not self.compile or _compiled_decode_unsafe(model)
        if self.compile and eager:
            _warn_eager_once()
        config = None if eager else _model_config(model)

        def step_for(b: int) -> Callable[..., None]:  # one compiled step per batch size (a graph each)
            return _decode_step if eager else _compiled_step(self.options, (config, b))

        check = bool(eos) and min_new_tokens < max_new_tokens
        b, step = batch, step_for(batch)
        # after a compaction: original row of each row, and the rows put aside
        row_of = out_seq = out_logp = out_len = None
        for t in range(1, max_new_tokens):  # token t of each row (token 0 came from the prefill)
            if t == min_new_tokens:
                st.eos_block.fill_(False)
            if do_sample:
                rows.noise.exponential_(generator=generator)
            step(model, rows.cache, rows.pos, rows.mask, self.keep_last, *state)
            if not (check and t % self.check_every == 0 and t >= min_new_tokens):
                continue
            alive = ~rows.finished[:, 0]
            unfinished = int(alive.sum())  # the check's one host sync
            if unfinished == 0:
                break
            size = _compact_size(unfinished, b, self.compact_min_batch) if self.compact else b
            if size == b:
                continue
            if row_of is None:
                row_of = torch.arange(batch, device=device)
                out_seq, out_logp, out_len = first.seq.clone(), first.logp.clone(), first.gen_len.clone()
            # every row as it is now; the kept ones go on
            out_seq[row_of], out_logp[row_of], out_len[row_of] = rows.seq, rows.logp, rows.gen_len
            keep = torch.cat([alive.nonzero()[:, 0], (~alive).nonzero()[:, 0]])[:size]  # unfinished first
            _move_rows_to_front(st, keep, prompt_len + t)
            row_of = row_of[keep]
            b, rows, step = size, st.rows(size, model.config), step_for(size)
            state = choose_args(rows)
        if row_of is None:
            new = int(first.gen_len.max()) if check else max_new_tokens  # as generate: stop when the last row finished
            return first.seq[:, : prompt_len + new].clone(), first.logp[:, prompt_len : prompt_len + new].clone()
        out_seq[row_of], out_logp[row_of], out_len[row_of] = rows.seq, rows.logp, rows.gen_len
        new = int(out_len.max())
        out = out_seq[:, : prompt_len + new].clone()
        logp = out_logp[:, prompt_len : prompt_len + new].clone()
        # positions after a row's EOS hold pad (logprob 0), as without compaction (a row put aside stopped writing them)
        after = torch.arange(new, device=device)[None, :] >= out_len
        out[:, prompt_len:].masked_fill_(after, pad_token_id)
        logp.masked_fill_(after, 0.0)
        return out, logp


def _move_rows_to_front(st: _State, keep: torch.Tensor, filled: int) -> None:
    """Rows ``keep`` (indices among the current rows) become rows ``0 .. len(keep) - 1`` of every per-row buffer and
    of the KV cache (its first ``filled`` positions, the ones written so far). The right side is gathered into a new
    tensor before the copy, so overlapping source and destination rows are safe."""
    n = keep.numel()
    for layer in st.cache.layers:
        layer.keys[:n, :, :filled] = layer.keys[keep, :, :filled]
        layer.values[:n, :, :filled] = layer.values[keep, :, :filled]
    for buf in (st.tok, st.pos, st.mask, st.seq, st.logp, st.finished, st.gen_len):
        buf[:n] = buf[keep]


@contextlib.contextmanager
def _decode_attention(model: nn.Module, enable: bool):
    """Switch a model on SDPA/eager attention to :data:`~qerl_trl.rollout.graph.attention.DECODE_ATTENTION` for the block."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prev = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if not enable or prev not in ("sdpa", "eager") or not hasattr(base, "set_attn_implementation"):
        yield
        return
    from .attention import register_decode_attention

    base.set_attn_implementation(register_decode_attention())
    try:
        yield
    finally:
        base.set_attn_implementation(prev)
