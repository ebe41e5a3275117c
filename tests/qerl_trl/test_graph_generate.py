"""``qerl_trl.rollout.graph.generate``: the graph-replayed decode loop against transformers' ``generate`` on tiny random models.

Greedy tokens must equal ``generate``'s (static cache, left-padded batch: checks the mask and position handling, EOS
and pad semantics, early stop); sampling is reproducible from a seeded generator; EOS handling (pad after EOS,
``min_new_tokens``); the compiled step is one graph (dynamo + AOT autograd, no inductor: seconds on CPU) that later
calls with other prompt lengths, token counts and temperatures replay without recompiling; input validation.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings

import pytest
import torch
from qerl_trl.rollout.graph.generate import graph_generate, release_graph_state
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

PAD = 1
EOS = 5


_no_op = contextlib.nullcontext


def _model(arch: str = "llama"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def _prompts(batch: int = 3, length: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: row i has ``max(length - 2*i, 1)`` real tokens (ids >= 6, so never PAD or EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, : min(2 * i, length - 1)] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _hf_greedy(model, ids, mask, n: int, **kw) -> torch.Tensor:
    kw = {"min_new_tokens": n, "eos_token_id": None, **kw}
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=PAD,
                          cache_implementation="static", **kw)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_generate_left_padded(arch):
    model = _model(arch)
    ids, mask = _prompts()
    ref = _hf_greedy(model, ids, mask, 12)
    out = graph_generate(model, ids, mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.shape == (3, 7 + 12) and out.dtype == torch.long
    assert torch.equal(out, ref)
    # a longer cache (as a training run keeps it fixed) and a second call on the kept state: same tokens
    out2 = graph_generate(model, ids, mask, max_new_tokens=12, do_sample=False, max_cache_len=40)
    assert torch.equal(out2, ref)


@pytest.mark.parametrize("min_new", [0, 6])
def test_greedy_eos_pad_and_early_stop_match_generate(min_new):
    model = _model()
    ids, mask = _prompts()
    free = _hf_greedy(model, ids, mask, 16)
    eos = [int(free[0, 7 + 3]), int(free[1, 7 + 5]), int(free[2, 7 + 8])]  # each row emits one when nothing stops it
    ref = _hf_greedy(model, ids, mask, 16, eos_token_id=eos, min_new_tokens=min_new)
    out = graph_generate(model, ids, mask, max_new_tokens=16, min_new_tokens=min_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD, check_every=3)  # fmt: skip
    assert out.shape == ref.shape and torch.equal(out, ref)
    if min_new == 0:  # every row finished by its 9th token: generate stopped there, so did we
        assert out.shape[1] <= 7 + 9
        assert out[0, 7 + 3] == eos[0] and (out[0, 7 + 4 :] == PAD).all()


def _batch_sizes(model) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """Rows of every forward of ``model`` from now on (a pre-hook on its embedding: the public hook, nothing patched;
    eager only), and the hook's handle."""
    sizes: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda mod, args: sizes.append(args[0].shape[0]))
    return sizes, hook


def _staggered_eos(model, ids, mask, n: int) -> list[int]:
    """EOS ids taken from the free-running greedy tokens, so that rows finish one after another."""
    free = _hf_greedy(model, ids, mask, n)
    p = ids.shape[1]
    return sorted({int(free[i, p + 2 + 3 * i]) for i in range(0, ids.shape[0], 2)})


@pytest.mark.parametrize("min_batch", [1, 3])
def test_compaction_greedy_matches_generate(min_batch):
    """Finished rows compacted away (here at every 2nd step, down to ``min_batch`` rows): the same tokens as
    transformers' ``generate`` on a left-padded batch, EOS and pad included, and the decode batch shrinks."""
    model = _model("qwen2")
    ids, mask = _prompts(batch=8, length=18)
    eos = _staggered_eos(model, ids, mask, 24)
    ref = _hf_greedy(model, ids, mask, 24, eos_token_id=eos, min_new_tokens=0)
    sizes, _ = _batch_sizes(model)
    out = graph_generate(model, ids, mask, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                         check_every=2, compact_min_batch=min_batch)  # fmt: skip
    assert out.shape == ref.shape and torch.equal(out, ref)
    decode = sizes[1:]  # after the prefill
    assert decode[0] == 8 and decode == sorted(decode, reverse=True) and min(decode) < 8, decode
    assert min(decode) >= min_batch and set(decode) <= {8, 4, 2, 1}
    sizes.clear()
    plain = graph_generate(model, ids, mask, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                           check_every=2, compact=False)  # fmt: skip
    assert torch.equal(plain, ref) and set(sizes) == {8}


def _compiled_compaction_case():
    """A fresh dynamo (counters cleared), the tiny Llama, 8 left-padded rows whose greedy tokens hit EOS at staggered
    steps, and the ``graph_generate`` keywords that compact them every 2nd step down to 2 rows."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    ids, mask = _prompts(batch=8, length=18)
    eos = _staggered_eos(model, ids, mask, 24)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD, check_every=2,
              compact_min_batch=2, max_cache_len=48)  # fmt: skip
    return model, ids, mask, kw


def test_compaction_compiled_one_graph_per_batch():
    """Compiled (dynamo + AOT autograd): each batch size that compaction reaches compiles once; a second rollout
    replays them (no new graph) and returns the eager loop's tokens."""
    from torch._dynamo.utils import counters

    model, ids, mask, kw = _compiled_compaction_case()
    sizes, hook = _batch_sizes(model)
    ref = graph_generate(model, ids, mask, compile=False, **kw)
    hook.remove()
    reached = set(sizes[1:])
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    got = graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw)
    assert torch.equal(got, ref)
    assert len(reached) >= 2 and counters["stats"]["unique_graphs"] == len(reached), (reached, counters["stats"])
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw), ref)
    assert counters["stats"]["unique_graphs"] == len(reached) and not counters["graph_break"]
    release_graph_state(model)


@pytest.mark.parametrize("max_rows", [None, 3])
def test_compaction_sampling(max_rows):
    """Sampling with compaction, in one batch or in waves of at most 3 rows: a temperature near 0 gives the greedy
    one-batch tokens (1e-6: at 1e-4 a near-tie of this tiny model flips one token, with or without compaction); at
    T = 1 every row is a well-formed completion (pad after its EOS, the call as long as its longest row)."""
    model = _model()
    ids, mask = _prompts(batch=8, length=18)
    eos = _staggered_eos(model, ids, mask, 24)
    kw = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=PAD, check_every=2, compact_min_batch=1)
    greedy = graph_generate(model, ids, mask, do_sample=False, **kw)
    cold = graph_generate(model, ids, mask, temperature=1e-6, generator=torch.Generator().manual_seed(0),
                          max_rows=max_rows, **kw)  # fmt: skip
    assert torch.equal(cold, greedy)
    _eos_likely(model)
    sizes, _ = _batch_sizes(model)
    out = graph_generate(model, ids, mask, max_new_tokens=40, eos_token_id=[EOS, 3], pad_token_id=PAD,
                         generator=torch.Generator().manual_seed(0), check_every=2, compact_min_batch=1,
                         max_rows=max_rows)  # fmt: skip
    assert min(sizes[1:]) < 8 and max(sizes) == (max_rows or 8)
    gen = out[:, 18:]
    ends = []
    for row in gen:
        hit = ((row == EOS) | (row == 3)).nonzero()
        ends.append(int(hit[0]) + 1 if len(hit) else gen.shape[1])
        assert (row[ends[-1] :] == PAD).all(), row
    assert gen.shape[1] == max(ends) and torch.equal(out[:, :18], ids)


def test_compact_size():
    from qerl_trl.rollout.graph.generate import _compact_size

    assert _compact_size(40, 128, 32) == 64
    assert _compact_size(20, 128, 32) == 32
    assert _compact_size(64, 128, 32) == 64
    assert _compact_size(65, 128, 32) == 128
    assert _compact_size(1, 100, 1) == 1  # 100 -> 50 -> 25 -> 13 -> 7 -> 4 -> 2 -> 1
    assert _compact_size(5, 100, 1) == 7
    assert _compact_size(3, 24, 32) == 24


@pytest.mark.parametrize(("max_rows", "waves"), [(1, [1] * 8), (3, [3, 3, 2]), (5, [4, 4]), (8, [8]), (50, [8])])
@pytest.mark.parametrize("fixed", [False, True])
def test_waves_greedy_match_one_batch(max_rows, waves, fixed):
    """Must show (#40): a batch generated in waves of at most ``max_rows`` rows gives exactly the tokens of one batch
    (greedy; left-padded prompts; rows finishing at staggered steps, compacted within each wave; or fixed lengths),
    and no forward ever runs more rows than one wave. Waves split the batch evenly, the last one shorter."""
    model = _model("qwen2")
    ids, mask = _prompts(batch=8, length=18)
    eos = None if fixed else _staggered_eos(model, ids, mask, 24)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=PAD, check_every=2,
              compact_min_batch=1, max_cache_len=48)  # fmt: skip
    one = graph_generate(model, ids, mask, **kw)
    release_graph_state(model)
    ref = _hf_greedy(model, ids, mask, 24, eos_token_id=eos, min_new_tokens=24 if fixed else 0)
    assert torch.equal(one, ref)
    calls: list[tuple[int, int]] = []  # (rows, tokens) of every forward: the public pre-hook, eager only
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda mod, args: calls.append(tuple(args[0].shape)))
    got = graph_generate(model, ids, mask, max_rows=max_rows, **kw)
    hook.remove()
    assert got.shape == one.shape and torch.equal(got, one)
    assert [rows for rows, tokens in calls if tokens == 18] == waves  # one prefill per wave, of its rows
    assert max(rows for rows, _ in calls) == waves[0]
    release_graph_state(model)


def test_waves_compiled_replay_one_graph_per_batch():
    """Compiled (dynamo + AOT autograd), 8 rows in waves of at most 3 (3, 3, 2): one graph for batch 3 and one for
    batch 2 (the last wave, and compaction's size), recorded once; the later waves and a second call replay them; the
    tokens are the eager one-batch tokens; the KV cache is the same object throughout (allocated once, for 3 rows)."""
    from torch._dynamo.utils import counters

    model, ids, mask, kw = _compiled_compaction_case()
    ref = graph_generate(model, ids, mask, compile=False, **kw)
    release_graph_state(model)
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    got = graph_generate(model, ids, mask, compile=True, compile_options=opts, max_rows=3, **kw)
    assert torch.equal(got, ref)
    from qerl_trl.rollout.graph.generate import _STATES

    cache, graphs = _STATES[model].cache, counters["stats"]["unique_graphs"]
    assert _STATES[model].key[0] == 3 and graphs == 2, counters["stats"]
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, max_rows=3, **kw), ref)
    assert _STATES[model].cache is cache and counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]
    release_graph_state(model)


def test_smaller_call_reuses_larger_state():
    """A call with fewer rows (a DAPO refill round) on the same cache length decodes in the first rows of the kept
    state instead of reallocating it, with the tokens of a fresh call."""
    from qerl_trl.rollout.graph.generate import _STATES

    model = _model()
    ids, mask = _prompts(batch=6, length=9)
    kw = dict(max_new_tokens=10, do_sample=False, max_cache_len=24)
    graph_generate(model, ids, mask, **kw)
    cache = _STATES[model].cache
    small = graph_generate(model, ids[3:], mask[3:], **kw)
    assert _STATES[model].cache is cache and _STATES[model].key[0] == 6
    release_graph_state(model)
    assert torch.equal(small, graph_generate(model, ids[3:], mask[3:], **kw))
    release_graph_state(model)


def _reference_logprobs(model, out: torch.Tensor, mask: torch.Tensor, temperature: float,
                        eos_blocked_until: int = 0) -> torch.Tensor:
    """Plain PyTorch: one full forward of ``model`` over prompt + completion (``out`` ``[B, P + T]``, prompts of
    ``mask``'s length ``P``, left-padded), the trainer's ``log_softmax(logits / temperature)`` in float32 gathered at
    the generated tokens, ``[B, T]``; with ``eos_blocked_until``, the EOS logit at -inf for the first that many
    tokens (what ``min_new_tokens`` samples from)."""
    gen, logits = _generated_logits(model, out, mask)
    logits[:, :eos_blocked_until, EOS] = float("-inf")
    return torch.log_softmax(logits / temperature, -1).gather(-1, gen[..., None]).squeeze(-1)


def _generated_logits(model, out: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated tokens of ``out`` (``[B, P + T]``, left-padded prompts of ``mask``'s length ``P``), ``[B, T]``,
    and the float32 logits that predicted each, ``[B, T, V]``, from one uncompiled full-sequence forward."""
    p = mask.shape[1]
    gen = out[:, p:]
    full = torch.cat([mask, torch.ones_like(gen)], 1)
    pos = (full.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return gen, model(input_ids=out, attention_mask=full, position_ids=pos).logits[:, p - 1 : -1].float()


def _ends(gen: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """Each row's length up to and including its first EOS (the whole row without one), ``[B, 1]``."""
    is_eos = torch.isin(gen, torch.tensor(eos, device=gen.device))
    return torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, gen.shape[1])[:, None]


@pytest.mark.parametrize(("temperature", "max_rows"), [(0.7, None), (1.6, 3)])
def test_sampling_logprobs_match_a_full_forward_with_compaction(temperature, max_rows):
    """``return_logprobs``: each sampled token's logprob is the trainer's ``log_softmax(logits / T)`` of one full
    forward over prompt + completion, while rows finish at different steps and are compacted out of the batch (in
    one batch, and in waves of 3 rows): the per-row logprob buffer moves with its row. 0 after a row's EOS."""
    model = _model("qwen2")
    _eos_likely(model, boost=3.0)
    ids, mask = _prompts(batch=8, length=12, seed=int(temperature * 10))
    eos = [EOS, 3]
    sizes, _ = _batch_sizes(model)
    out, logp = graph_generate(model, ids, mask, max_new_tokens=40, temperature=temperature, eos_token_id=eos,
                               pad_token_id=PAD, generator=torch.Generator().manual_seed(7), check_every=2,
                               compact_min_batch=1, max_rows=max_rows, return_logprobs=True)  # fmt: skip
    gen = out[:, 12:]
    assert logp.shape == gen.shape and logp.dtype == torch.float32 and logp.device == out.device
    ends = _ends(gen, eos)
    assert len(set(ends[:, 0].tolist())) >= 3, ends  # rows finished at different steps
    assert min(sizes[1:]) < (max_rows or 8), sizes  # and compaction dropped some
    after = torch.arange(gen.shape[1])[None, :] >= ends
    ref = _reference_logprobs(model, out, mask, temperature)
    assert (logp[after] == 0).all()
    assert torch.allclose(logp[~after], ref[~after], atol=1e-4, rtol=1e-4), (logp - ref)[~after].abs().max()
    assert (logp[~after] < 0).all()
    # the sequences are what the call without return_logprobs returns (same generator seed)
    again = graph_generate(model, ids, mask, max_new_tokens=40, temperature=temperature, eos_token_id=eos,
                           pad_token_id=PAD, generator=torch.Generator().manual_seed(7), check_every=2,
                           compact_min_batch=1, max_rows=max_rows)  # fmt: skip
    assert torch.equal(again, out)


def test_sampling_logprobs_under_min_new_tokens_and_greedy():
    """While ``min_new_tokens`` blocks EOS the token is drawn from the distribution without it, and its logprob is
    taken there (vLLM's ``processed_logprobs`` for ``min_tokens``); afterwards it is the trainer's plain
    ``log_softmax(logits / T)``. Greedy decoding reports the logprobs at temperature 1."""
    model = _model()
    _eos_likely(model, boost=3.0)
    ids, mask = _prompts(batch=4, length=8)
    out, logp = graph_generate(model, ids, mask, max_new_tokens=16, min_new_tokens=5, temperature=0.8,
                               eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(3),
                               check_every=2, compact_min_batch=1, return_logprobs=True)  # fmt: skip
    after = torch.arange(out.shape[1] - 8)[None, :] >= _ends(out[:, 8:], [EOS])
    ref = _reference_logprobs(model, out, mask, 0.8, eos_blocked_until=5)
    assert torch.allclose(logp[~after], ref[~after], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref[:, :5], _reference_logprobs(model, out, mask, 0.8)[:, :5], atol=1e-3)
    greedy, glogp = graph_generate(model, ids, mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                   temperature=0.5, return_logprobs=True)  # fmt: skip
    assert torch.allclose(glogp, _reference_logprobs(model, greedy, mask, 1.0), atol=1e-4, rtol=1e-4)


def test_compiled_step_records_the_eager_logprobs():
    """The compiled step (dynamo + AOT autograd, compaction to 2 rows) writes the logprobs the eager loop does, with
    the same number of graphs: the logprob buffer is one more static input of the step."""
    from torch._dynamo.utils import counters

    model, ids, mask, kw = _compiled_compaction_case()
    ref, ref_logp = graph_generate(model, ids, mask, compile=False, return_logprobs=True, **kw)
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    got, logp = graph_generate(model, ids, mask, compile=True, compile_options=opts, return_logprobs=True, **kw)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(got, ref) and torch.allclose(logp, ref_logp, atol=1e-5)
    after = torch.arange(got.shape[1] - 18)[None, :] >= _ends(got[:, 18:], kw["eos_token_id"])
    assert len(set(after.sum(1).tolist())) >= 2 and (logp[after] == 0).all()
    assert torch.allclose(logp[~after], _reference_logprobs(model, got, mask, 1.0)[~after], atol=1e-4, rtol=1e-4)
    got2, logp2 = graph_generate(model, ids, mask, compile=True, compile_options=opts, return_logprobs=True, **kw)
    assert torch.equal(got2, ref) and torch.equal(logp2, logp) and counters["stats"]["unique_graphs"] == graphs
    release_graph_state(model)


def _eos_likely(model, boost: float = 4.0):
    """Add ``boost`` to the EOS logit (a hook on lm_head): most rows finish within a few dozen sampled tokens."""
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = boost
    return model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)


def test_sampling_eos_then_pad():
    model = _model()
    _eos_likely(model)
    ids, mask = _prompts(batch=6, length=8)
    out = graph_generate(model, ids, mask, max_new_tokens=40, eos_token_id=[EOS, 3], pad_token_id=PAD,
                         generator=torch.Generator().manual_seed(0), check_every=4)  # fmt: skip
    gen = out[:, 8:]
    finished = [(row == EOS) | (row == 3) for row in gen]
    ends = [int(f.nonzero()[0]) + 1 if f.any() else gen.shape[1] for f in finished]
    assert sum(f.any() for f in finished) >= 4, gen
    for row, end in zip(gen, ends):
        assert (row[end:] == PAD).all()
    assert gen.shape[1] == max(ends) <= 40  # stops once every row has finished, as generate does
    assert torch.equal(out[:, :8], ids)


def test_min_new_tokens_suppresses_eos():
    model = _model()
    _eos_likely(model)
    ids, mask = _prompts(batch=6, length=8)
    g = torch.Generator().manual_seed(0)
    fixed = graph_generate(model, ids, mask, max_new_tokens=20, min_new_tokens=20, eos_token_id=EOS, generator=g)
    assert fixed.shape == (6, 28) and not (fixed[:, 8:] == EOS).any()
    some = graph_generate(model, ids, mask, max_new_tokens=30, min_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD,
                          generator=g)  # fmt: skip
    assert not (some[:, 8:18] == EOS).any() and (some[:, 18:] == EOS).any()


def test_sampling_reproducible_with_generator():
    model = _model("qwen2")
    ids, mask = _prompts()

    def run(seed: int, temperature: float = 1.0) -> torch.Tensor:
        return graph_generate(model, ids, mask, max_new_tokens=10, min_new_tokens=10, temperature=temperature,
                              generator=torch.Generator().manual_seed(seed))  # fmt: skip

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    cold = run(0, temperature=1e-4)  # temperature -> 0: the greedy tokens
    assert torch.equal(cold, graph_generate(model, ids, mask, max_new_tokens=10, do_sample=False))


def test_compiled_step_is_one_graph_replayed():
    """dynamo + AOT autograd (functionalized in-place updates, as inductor sees them): same tokens as eager, one
    graph, no graph break, no recompile for other prompt lengths / token counts / temperatures / EOS ids."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    ids, mask = _prompts(batch=2, length=7)
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    calls = [  # (prompt length, max_new, min_new, temperature, eos)
        (7, 9, 9, 1.0, None),
        (5, 12, 0, 0.7, EOS),
        (7, 4, 2, 1.3, [EOS, 3]),
    ]
    for plen, n, mn, temp, eos in calls:
        kw = dict(max_new_tokens=n, min_new_tokens=mn, temperature=temp, eos_token_id=eos, pad_token_id=PAD,
                  max_cache_len=24)  # fmt: skip
        p_ids, p_mask = ids[:, -plen:], mask[:, -plen:]
        got = graph_generate(model, p_ids, p_mask, compile=True, compile_options=opts,
                             generator=torch.Generator().manual_seed(2), **kw)  # fmt: skip
        ref = graph_generate(model, p_ids, p_mask, compile=False, generator=torch.Generator().manual_seed(2), **kw)
        assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    release_graph_state(model)


def test_peft_model():
    from peft import LoraConfig, get_peft_model

    torch._dynamo.reset()
    peft_model = get_peft_model(_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                            init_lora_weights=False)).eval()  # fmt: skip
    ids, mask = _prompts(batch=2)
    ref = _hf_greedy(peft_model, ids, mask, 6)
    opts = {"backend": "eager", "fullgraph": True, "dynamic": False}
    out = graph_generate(peft_model, ids, mask, max_new_tokens=6, do_sample=False, compile=True, compile_options=opts)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, ValueError, "min_new_tokens"),
        ({"max_new_tokens": 4, "min_new_tokens": -1}, ValueError, "min_new_tokens"),
        ({"max_new_tokens": 4, "attention_mask": torch.ones(2, 6, dtype=torch.long)}, ValueError, "attention_mask"),
        ({"max_new_tokens": 4, "attention_mask": torch.tensor([[1] * 5, [0] * 5])}, ValueError, r"rows \[1\] have no token"),
        ({"max_new_tokens": 4, "input_ids": torch.ones(5, dtype=torch.long)}, ValueError, "input_ids"),
        ({"max_new_tokens": 4, "input_ids": torch.ones(2, 5)}, TypeError, "integer"),
        ({"max_new_tokens": 4, "temperature": 0.0}, ValueError, "temperature"),
        # an infinite temperature samples uniformly at random (QeRLConfig refuses it too); a string failed in a comparison
        ({"max_new_tokens": 4, "temperature": float("inf")}, ValueError, "temperature must be a finite number > 0"),
        ({"max_new_tokens": 4, "temperature": "0.7"}, ValueError, "temperature must be a finite number > 0"),
        # right padding: the first token was drawn from the logits of a pad position, silently other tokens
        ({"max_new_tokens": 4, "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])}, ValueError,
         r"rows \[1\] end in padding .*left"),
        ({"max_new_tokens": 4, "attention_mask": torch.tensor([[1] * 5, [0, 2, 2, 2, 2]])}, ValueError, "0/1"),
        ({"max_new_tokens": 4, "check_every": 0}, ValueError, "check_every"),
        ({"max_new_tokens": 4, "compact_min_batch": 0}, ValueError, "compact_min_batch"),
        ({"max_new_tokens": 4, "max_rows": 0}, ValueError, "max_rows"),
        ({"max_new_tokens": 4, "max_rows": 2.0}, ValueError, "max_rows"),
        ({"max_new_tokens": 4, "max_cache_len": 8}, ValueError, "max_cache_len"),
        # a float length failed deep in torch.zeros ("type must be tuple of ints, but got float")
        ({"max_new_tokens": 4, "max_cache_len": 20.0}, ValueError, "max_cache_len must be an int"),
        ({"max_new_tokens": 4, "max_cache_len": True}, ValueError, "max_cache_len must be an int"),
        ({"max_new_tokens": 4, "eos_token_id": -2}, ValueError, "eos_token_id"),
        ({"max_new_tokens": 4, "eos_token_id": 10_000}, ValueError, "vocabulary"),
        ({"max_new_tokens": 4, "pad_token_id": -1}, ValueError, "pad_token_id"),
    ],
)
def test_validation(kwargs, error, match):
    model = _model()
    kwargs = {"input_ids": torch.full((2, 5), 7), **kwargs}
    with pytest.raises(error, match=match):
        graph_generate(model, **kwargs)


def test_import_is_light(monkeypatch):
    """The benchmarks import this module alone: no trl (qerl_trl's package imports are lazy). In-process: qerl_trl and
    trl are taken out of ``sys.modules`` (put back afterwards) and any import of trl raises."""

    class BlockTrl:
        def find_spec(self, name, path=None, target=None):
            if name == "trl" or name.startswith("trl."):
                raise ImportError(f"{name} imported")
            return None

    for name in [n for n in sys.modules if n.split(".")[0] in ("qerl_trl", "trl")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BlockTrl(), *sys.meta_path])
    mod = importlib.import_module("qerl_trl.rollout.graph.generate")
    assert callable(mod.graph_generate) and "trl" not in sys.modules


def _lora_arms_gpu() -> dict:
    """A tiny Qwen2 on CUDA in bf16 with PEFT LoRA on every projection, and the same shapes quantized to NVFP4 with
    our LoRA layer (every linear a whole number of kernel tiles)."""
    from nvfp4 import quantize_model
    from nvfp4.peft import get_peft_model as nvfp4_peft
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=16, target_modules=targets, init_lora_weights=False)
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)).to("cuda", torch.bfloat16).eval()
    quantized = quantize_model(AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)), progress=False)
    return {"bf16": get_peft_model(base, lora), "nvfp4": nvfp4_peft(quantized.to("cuda", torch.bfloat16), lora)}


def _argmax_gap(model, out: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per generated token of ``out`` (``[B, P + T]``, prompts of ``mask``'s length ``P``): how far its logit is below
    the best one in an uncompiled full-sequence forward, and the tolerance for bf16 noise (0.05 of the logits' std:
    inductor and eager round differently, so a near-tie may go either way). Both ``[B, T]``; the logits must be
    finite."""
    gen, logits = _generated_logits(model, out, mask)
    assert torch.isfinite(logits).all()
    return logits.amax(-1) - logits.gather(-1, gen[..., None]).squeeze(-1), 0.05 * logits.std(-1)


@pytest.mark.gpu
def test_cuda_graphs_default_compile_is_greedy_gpu():
    """The default on CUDA (inductor, ``mode="reduce-overhead"``: CUDA graphs), for a bf16 model with PEFT LoRA and an
    NVFP4 model (MMA-layout Triton kernels with the fused LoRA; every linear a whole number of kernel tiles): each
    generated token is the argmax of an uncompiled full-sequence forward (within bf16 noise: inductor and eager round
    differently, so exact token equality with the eager loop would fail on near-ties), and a second call, replaying
    the recorded graphs, returns the same tokens."""
    arms = _lora_arms_gpu()
    ids, mask = _prompts(batch=3, length=9)
    ids, mask = ids.cuda(), mask.cuda()
    n = 16
    for name, model in arms.items():
        model.eval()
        torch._dynamo.reset()
        out = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
        assert torch.equal(graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True), out)
        gap, tol = _argmax_gap(model, out, mask)
        assert (gap <= tol).all(), (name, gap.max().item())
        release_graph_state(model)


@pytest.mark.gpu
def test_cuda_graphs_compaction_gpu():
    """Compaction under the default CUDA compile (inductor, CUDA graphs; one graph per batch size over views of the
    same buffers), bf16 + LoRA and NVFP4 + LoRA: rows finish one after another (EOS ids from the free-running tokens)
    and are compacted at every 2nd step, down to 1 row. Each row's tokens up to its EOS are the argmax of an
    uncompiled forward (within bf16 noise), pad follows, and a second call (replaying the recorded graphs) agrees."""
    arms = _lora_arms_gpu()
    ids, mask = _prompts(batch=8, length=18)
    ids, mask = ids.cuda(), mask.cuda()
    n = 24
    for name, model in arms.items():
        model.eval()
        torch._dynamo.reset()
        free = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
        eos = sorted({int(free[i, 18 + 2 + 2 * i]) for i in range(8)})  # row i ends by its token 3 + 2i
        kw = dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=PAD, check_every=2,
                  compact_min_batch=1, compile=True)  # fmt: skip
        out = graph_generate(model, ids, mask, **kw)
        assert torch.equal(graph_generate(model, ids, mask, **kw), out), name
        gen = out[:, 18:]
        is_eos = torch.isin(gen, torch.tensor(eos, device="cuda"))
        ends = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, gen.shape[1])
        assert len(set(ends.tolist())) >= 3, (name, ends)  # staggered: compaction had rows to drop
        after = torch.arange(gen.shape[1], device="cuda")[None, :] >= ends[:, None]
        assert (gen[after] == PAD).all(), name
        gap, tol = _argmax_gap(model, out, mask)
        assert ((gap <= tol) | after).all(), (name, gap[~after].max().item())
        release_graph_state(model)


def _eos_boost(model, ids: torch.Tensor, mask: torch.Tensor, temperature: float, p_eos: float) -> float:
    """The EOS logit boost under which the first sampled token is EOS with probability ``p_eos`` (mean over the
    prompts): found by bisection on one forward's last-position logits, so that rows end at staggered steps whatever
    the tiny model's logit scale (a fixed boost of 6 ended every row at its first token on the H200)."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
    lo, hi = -30.0, 30.0
    for _ in range(40):
        b = (lo + hi) / 2
        boosted = logits.clone()
        boosted[:, EOS] += b
        lo, hi = (b, hi) if torch.softmax(boosted / temperature, -1)[:, EOS].mean() < p_eos else (lo, b)
    return (lo + hi) / 2


@pytest.mark.gpu
def test_cuda_graphs_sampling_logprobs_gpu():
    """The CUDA-graph form of the CPU logprob tests (inductor, ``mode="reduce-overhead"``), bf16 + LoRA and NVFP4 +
    LoRA: 16 rows sampled at T = 0.7, finishing at different steps (EOS boosted to ~8 % a step) and compacted every 2nd step
    down to 1 row. Each returned logprob is the trainer's float32 ``log_softmax(logits / T)`` of an uncompiled
    full-sequence forward at the sampled token (within bf16 noise: inductor and eager round the logits differently,
    and cached decoding differs from one full forward; the H200 at dc2eaa4, bf16 arm: 0.234 at most, 0.0056 on
    average, over ~5.5 nats), 0 after the row's EOS, and a second call from the same seed (replaying the recorded
    graphs) returns the same."""
    arms = _lora_arms_gpu()
    ids, mask = _prompts(batch=16, length=18)
    ids, mask = ids.cuda(), mask.cuda()
    t, eos = 0.7, [EOS, 3]
    for name, model in arms.items():
        model.eval()
        bias = torch.zeros(model.config.vocab_size, device="cuda", dtype=torch.bfloat16)
        bias[EOS] = _eos_boost(model, ids, mask, t, 0.08)
        hook = model.get_output_embeddings().register_forward_hook(lambda mod, inp, out, b=bias: out + b)
        torch._dynamo.reset()
        kw = dict(max_new_tokens=48, temperature=t, eos_token_id=eos, pad_token_id=PAD, check_every=2,
                  compact_min_batch=1, compile=True, return_logprobs=True)  # fmt: skip
        out, logp = graph_generate(model, ids, mask, generator=torch.Generator("cuda").manual_seed(0), **kw)
        out2, logp2 = graph_generate(model, ids, mask, generator=torch.Generator("cuda").manual_seed(0), **kw)
        assert torch.equal(out2, out) and torch.equal(logp2, logp), name
        gen = out[:, 18:]
        assert logp.shape == gen.shape and logp.dtype == torch.float32 and logp.is_cuda
        ends = _ends(gen, eos)
        assert len(set(ends[:, 0].tolist())) >= 3, (name, ends)  # staggered: compaction had rows to drop
        after = torch.arange(gen.shape[1], device="cuda")[None, :] >= ends
        assert (logp[after] == 0).all(), name
        ref = _reference_logprobs(model, out, mask, t)
        err = (logp - ref)[~after].abs()
        # where the largest errors sit (row, step; compaction every 2nd step), for a failure to be read without a rerun.
        # The NVFP4 arm's 0.796 at f6961bd (H200) and 4e1d05a (H100) sat at step 0 of rows 9-15 alone: prompts with no
        # token (18 - 2i < 1), whose first logits each kernel fills its own way; every row has a token since
        full = (logp - ref).abs().masked_fill(after, 0)
        top = [(divmod(i, full.shape[1]), round(v, 3)) for v, i in zip(*(t.tolist() for t in full.flatten().topk(8)))]
        assert torch.isfinite(logp).all() and err.max() < 0.3 and err.mean() < 0.02, (
            name, err.max().item(), err.mean().item(), top, ends[:, 0].tolist())
        hook.remove()
        release_graph_state(model)


@pytest.mark.gpu
def test_cuda_graphs_follow_aqn_fp32_norms_gpu():
    """The H100 form of the test below, with the default CUDA compile (inductor, CUDA graphs): a bf16 NVFP4 + LoRA
    model, AQN's fp32 norm storage switched on and off between rollouts. Every generated token of every rollout is
    the argmax of an uncompiled forward of the model as it is at that moment (noise on or off; within bf16 noise), so
    no rollout replays a step recorded for the other configuration (before the fix the noisy rollouts replayed the
    bf16-norm graph: garbage tokens from AQN's first noisy stage)."""
    from aqn import NormNoise
    from nvfp4 import quantize_model
    from nvfp4.peft import get_peft_model as nvfp4_peft
    from peft import LoraConfig

    lora = LoraConfig(r=16, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    quantized = quantize_model(AutoModelForCausalLM.from_config(tiny_config("qwen2", **cfg)), progress=False)
    model = nvfp4_peft(quantized.to("cuda", torch.bfloat16), lora).eval()
    ids, mask = _prompts(batch=3, length=9)
    ids, mask = ids.cuda(), mask.cuda()
    n = 12

    def check(out: torch.Tensor) -> None:
        gap, tol = _argmax_gap(model, out, mask)
        assert (gap <= tol).all(), gap.max().item()

    torch._dynamo.reset()
    clean = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
    check(clean)
    noise = NormNoise(model, norm_dtype=torch.float32)
    for step in (1, 2, 3):
        with noise.apply(0.3, seed=0, step=step):
            noisy = graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True)
            check(noisy)
            assert not torch.equal(noisy, clean)
        assert torch.equal(graph_generate(model, ids, mask, max_new_tokens=n, do_sample=False, compile=True), clean)
    release_graph_state(model)


def test_compiled_step_follows_aqn_fp32_norms():
    """AQN on a bf16 model swaps the norms for float32-noise wrappers for a rollout. The step compiled before the
    noise must not be replayed on the noisy model (its earlier form, fp32 weight storage + hooks, was: garbage
    rollouts on the H100 from AQN's first noisy stage on). The noisy configuration compiles once, replays for every
    later draw (new noise values in the same buffers), gives the tokens of an eager decode, and the clean step is
    replayed after it."""
    from aqn import NormNoise
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model().to(torch.bfloat16)
    ids, mask = _prompts(batch=2, length=7)
    opts = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, max_cache_len=24)
    clean = graph_generate(model, ids, mask, compile=False, **kw)
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw), clean)
    noise = NormNoise(model, norm_dtype=torch.float32)
    noisy = []
    for step in (1, 2):
        with noise.apply(0.3, seed=0, step=step), warnings.catch_warnings():
            warnings.simplefilter("error")  # compiled, no eager fallback
            got = graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw)
            assert torch.equal(got, graph_generate(model, ids, mask, compile=False, **kw))
            assert not torch.equal(got, clean)  # σ = 0.3 changes the greedy tokens of this tiny model
            noisy.append(got)
    assert not torch.equal(noisy[0], noisy[1])  # each draw's values reach the replayed step
    assert torch.equal(graph_generate(model, ids, mask, compile=True, compile_options=opts, **kw), clean)
    assert counters["stats"]["unique_graphs"] == 2  # clean + noisy, each replayed
    release_graph_state(model)


def test_old_import_path_is_the_same_module():
    """``qerl_trl.graph_generate`` (its path before issue #48, used by ``benchmarks/rollout.py``) is the module itself."""
    import qerl_trl.graph_generate as old
    import qerl_trl.rollout.graph.generate as new

    assert old is new
