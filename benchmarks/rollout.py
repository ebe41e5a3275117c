"""Rollout throughput (issue #7): transformers ``generate`` with a static cache + compiled decode (CUDA graphs).

Every arm runs in the same engine: ``model.generate(..., cache_implementation="static")``. With a static cache on
CUDA, transformers 5.17 (``GenerationMixin._valid_auto_compile_criteria`` / ``PreTrainedModel.get_compiled_call``)
wraps the *decode* forward in ``torch.compile(model.__call__, **compile_config.to_dict())``; the default
``CompileConfig`` is inductor + ``mode="reduce-overhead"`` (CUDA graphs). The prefill runs eagerly. We pass an
explicit ``CompileConfig(dynamic=False)`` so batch 1 and batch 8 each get their own static graph (batch 1 is always
specialised by dynamo anyway), and ``max_cache_len`` so that a short warm-up ``generate`` compiles and records the
exact graphs (same cache shape) that the timed ``generate`` replays.

Models: random weights with the real Qwen2.5-7B / 14B / 32B shapes (speed does not depend on weight values), built
on the meta device and materialised decoder layer by decoder layer on the GPU, each layer converted to its arm's
format before the next one exists, so the 32B model never exists in bf16 in full (embeddings and ``lm_head`` stay
bf16 in every arm). Arms (LoRA r=32 on q/k/v/o/gate/up/down in every arm, adapters in ``--lora-dtype``):

* ``bf16``   bf16 base + PEFT LoRA
* ``qlora``  bitsandbytes NF4 (``bnb.nn.Linear4bit``, compute bf16, double quant as in QLoRA) + PEFT LoRA
* ``nvfp4``  ``NVFP4Linear`` (RTN via ``nvfp4.quantize_model``, Triton W4A16 kernels) + ``nvfp4.peft.get_peft_model``
* ``bf16-base`` / ``qlora-base`` / ``nvfp4-base``: the same without LoRA (diagnostics: LoRA's cost).

Fixed lengths: random prompt of ``--prompt-len`` tokens, exactly ``--new-tokens`` new tokens (greedy, EOS disabled,
``min_new_tokens = max_new_tokens``). Per (model, arm, batch):
warm-up ``generate`` of ``--warmup-tokens`` (compile + CUDA-graph recording; its time is reported as ``compile_s``),
a second warm-up (must not recompile), three 1-token ``generate`` calls (prefill time: the fastest), then the timed
``generate``.
``tok/s = batch * new_tokens / time(generate)`` (end to end, prefill included); ``decode tok/s`` excludes the
prefill. Dynamo counters (graph breaks, unique graphs, recompiles, skipped CUDA graphs) are recorded per batch, so a
LoRA that breaks the compiled path shows up in the table.

``--engine graph`` replaces ``model.generate`` by :func:`qerl_trl.graph_generate.graph_generate` (same static cache
length, lengths, greedy decoding, warm-ups and timings): the whole decode step, sampling included, is one
``torch.compile(mode="reduce-overhead")`` graph (``--compile-backend`` / ``--compile-mode`` / ``--fullgraph`` apply to
it) replayed by a Python loop that never syncs with the GPU, so the host work of ``generate`` between CUDA graphs
(logits processors, stopping criteria, a sync per step) goes away; on CUDA its attention is
``qerl_trl.decode_attention`` (graph_generate's default; every arm alike). Rows carry their ``engine``; ``--merge``
puts both engines in one table.

``--eos-mean-tokens M`` (graph engine) measures completions of varying length instead, as RL rollouts have them:
the arms sample at T = 1 with a set of ``round(V / M)`` EOS ids (drawn once, seeded); a random-weight model's
next-token distribution is close to uniform, so past ``--min-new-tokens`` a row ends at each step with probability
about 1/M (lengths about geometric, a long tail up to ``--new-tokens``). Per batch, after two warm-up rollouts, each
of ``--repeats`` rounds times three variants with the same seed: ``fixed`` (EOS suppressed: every row runs to the
cap), ``eos`` (rows stop at EOS, the batch decodes until the last row is done: ``compact=False``) and
``eos+compact`` (finished rows compacted away, ``graph_generate``'s default). ``tok/s`` there counts real tokens
(up to and including each row's EOS, no padding) over the wall time of the call (prefill included); the median over
rounds is reported, and every round is kept.

Each (model, arm) runs in a fresh subprocess (no compile-cache or allocator interference; OOM = "does not fit"),
results are appended to ``--out`` after every arm, so a run cut short keeps what it measured.

Usage::

    uv run python benchmarks/rollout.py --tiny --no-compile           # CPU smoke test (tiny config)
    uv run python benchmarks/rollout.py --tiny --no-compile --engine graph   # same, graph_generate engine
    python3 benchmarks/rollout.py --models 7b,14b,32b --arms bf16,qlora,nvfp4 --batch 1,8 \\
        --prompt-len 256 --new-tokens 1024 --out $OUT/rollout.json    # H100
    python3 benchmarks/rollout.py --models 7b --arms nvfp4,bf16 --batch 64,128 --engine graph --prompt-len 256 \
        --new-tokens 512 --min-new-tokens 64 --eos-mean-tokens 128 --repeats 2   # H100, lengths spread
    python3 benchmarks/rollout.py --merge a.json b.json --out rollout.json   # combine runs, print the table
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (
    ROOT / "packages" / "nvfp4" / "src",
    ROOT / "packages" / "aqn" / "src",
    ROOT / "packages" / "qerl-trl" / "src",
):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# Real Qwen2.5 shapes (config.json of Qwen/Qwen2.5-{7B,14B,32B}-Instruct). All three: q/k/v bias, untied lm_head,
# rope theta 1e6, rms eps 1e-6, no sliding window.
MODELS: dict[str, dict] = {
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
    "14b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
    "32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
    # CPU validation only
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
}
ARMS = ("bf16", "qlora", "nvfp4", "bf16-base", "qlora-base", "nvfp4-base")
ENGINES = ("generate", "graph")  # model.generate | qerl_trl.graph_generate.graph_generate
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFILL_SAMPLES = 3  # 1-token generates per batch; the fastest is prefill_s
SPREAD_VARIANTS = ("fixed", "eos", "eos+compact")  # --eos-mean-tokens: what each timed round runs
SPREAD_PAD = 0  # pad id of the spread runs (never an EOS id)
ARM_LABEL = {
    "bf16": "bf16 + LoRA",
    "qlora": "QLoRA (bnb NF4 + LoRA)",
    "nvfp4": "NVFP4 + LoRA (ours)",
    "bf16-base": "bf16 (no LoRA)",
    "qlora-base": "bnb NF4 (no LoRA)",
    "nvfp4-base": "NVFP4 (no LoRA)",
}


# ----------------------------------------------------------------------------------------------------------- utils
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def git_commit() -> str:
    """The repository's short HEAD, ``+dirty`` when tracked files differ from it; ``unknown`` outside a git checkout.
    Every JSON names the code it measured: a ratio is only stated with its commit."""
    here = Path(__file__).resolve().parent
    git = ["git", "-C", str(here)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions() -> dict:
    import torch

    out = {"commit": git_commit(), "python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "triton", "bitsandbytes", "accelerate"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[name] = f"not installed ({type(e).__name__})"
    return out


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gb(n: int | float) -> float:
    return round(n / 1e9, 3)


def _rss_peak_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)


class _LogCatcher(logging.Handler):
    """Collects torch's recompile / graph-break / perf-hint (cudagraph skip) log records.

    torch's artifact loggers are named ``<module>.__<artifact>`` (``torch._dynamo.guards.__recompiles``) and propagate
    up to ``torch._dynamo`` / ``torch._inductor`` (which do not propagate further), so the handler sits on those parents
    and keeps the records whose logger name matches."""

    NAMES = ("__recompiles", "__graph_breaks", "__perf_hints", "cudagraph_trees")
    PARENTS = ("torch._dynamo", "torch._inductor", "torch")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []
        self._last: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if not any(n in record.name for n in self.NAMES) or id(record) == self._last:
            return
        self._last = id(record)  # the same record reaching two parents
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.records.append(f"{record.name}: {msg[:600]}")

    def install(self) -> None:
        import torch

        with contextlib.suppress(Exception):
            torch._logging.set_logs(recompiles=True, graph_breaks=True, perf_hints=True)
        for n in self.PARENTS:
            logging.getLogger(n).addHandler(self)


def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    gb = dict(counters.get("graph_break", {}))
    return {
        "graph_breaks": int(sum(gb.values())),
        "graph_break_reasons": {k[:300]: int(v) for k, v in list(gb.items())[:10]},
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
    }


def _diff(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in ("graph_breaks", "unique_graphs", "frames_ok", "cudagraph_skips")}


# ---------------------------------------------------------------------------------------------------- model build
def _init_(module, std: float = 0.02) -> None:
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters(recurse=True):
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif "norm" in name or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def _materialize(module, device, dtype) -> None:
    module.to_empty(device=device)
    module.to(dtype)
    _init_(module)


def _to_bnb_nf4(layer, device, dtype, double_quant: bool) -> None:
    """Replace every nn.Linear of ``layer`` by ``bnb.nn.Linear4bit`` (NF4), as ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16, bnb_4bit_use_double_quant=double_quant)`` would."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    for name, lin in list(layer.named_modules()):
        if type(lin) is not nn.Linear:
            continue
        new = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=dtype,
            compress_statistics=double_quant,
            quant_type="nf4",
            quant_storage=torch.uint8,
            device="meta",
        )
        w = bnb.nn.Params4bit(
            lin.weight.data,
            requires_grad=False,
            compress_statistics=double_quant,
            quant_type="nf4",
            quant_storage=torch.uint8,
            module=new,
        )
        new.weight = w.to(device)  # quantizes on the move to CUDA
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.data.to(dtype), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, child, new)
        del lin, w


def build_model(
    model_key: str, arm: str, device, dtype, *, lora_r: int, lora_dtype, double_quant: bool, nvfp4_method: str
):
    """Random-weight Qwen2 with the given shape, built layer by layer on ``device`` in the arm's format (+ LoRA)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    dims = dict(MODELS[model_key])
    theta = dims.pop("rope_theta")
    cfg = Qwen2Config(
        **dims,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)

    base = arm.removesuffix("-base")
    t_quant = 0.0
    if base == "nvfp4":
        from nvfp4 import quantize_model
    for layer in model.model.layers:
        _materialize(layer, device, dtype)
        _sync()
        t0 = time.perf_counter()
        if base == "nvfp4":
            quantize_model(layer, method=nvfp4_method, progress=False)
        elif base == "qlora":
            _to_bnb_nf4(layer, device, dtype, double_quant)
        _sync()
        t_quant += time.perf_counter() - t0
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        _materialize(mod, device, dtype)
    model.model.rotary_emb = Qwen2RotaryEmbedding(cfg).to(device)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on meta: {leftover[:5]}")
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    model.eval()
    model.requires_grad_(False)
    if base == "qlora":
        model.is_loaded_in_4bit = True  # PEFT dispatches bnb.nn.Linear4bit to its lora.bnb.Linear4bit

    info = {"quantize_s": round(t_quant, 2)}
    if not arm.endswith("-base"):
        from peft import LoraConfig

        lcfg = LoraConfig(
            r=lora_r,
            lora_alpha=2 * lora_r,
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            bias="none",
            task_type="CAUSAL_LM",
        )
        if base == "nvfp4":
            from nvfp4.peft import get_peft_model
        else:
            from peft import get_peft_model
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
        n_lora = 0
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(device=device, dtype=lora_dtype)
                n_lora += p.numel()
        model.eval()
        lora_types = sorted(
            {
                type(m).__module__ + "." + type(m).__name__
                for m in model.modules()
                if hasattr(m, "lora_A") and hasattr(m, "base_layer")
            }
        )
        info.update(lora_params=n_lora, lora_layer_types=lora_types)
    return model, info


def build_arm(args, device, dtype, res: dict):
    """:func:`build_model` for ``args.model`` / ``args.arm`` (and its LoRA / quantization options) on ``device``.

    Returns the model, with ``build_s``, the build info and ``weights_gpu_gb`` added to ``res``; or None, with
    ``res["status"]`` saying why not: a QLoRA arm without CUDA (unless ``ROLLOUT_BNB_CPU``) or without
    bitsandbytes, or an OOM while building ("does not fit").
    """
    import torch

    cuda = device.type == "cuda"
    if args.arm.removesuffix("-base") == "qlora":
        if not cuda and not os.environ.get("ROLLOUT_BNB_CPU"):
            res["status"] = "skipped: bitsandbytes NF4 arm needs CUDA (CPU validation run)"
            return None
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            res["status"] = f"skipped: bitsandbytes not importable ({e})"
            return None
    t0 = time.perf_counter()
    try:
        model, info = build_model(
            args.model,
            args.arm,
            device,
            dtype,
            lora_r=args.lora_r,
            lora_dtype=getattr(torch, args.lora_dtype),
            double_quant=not args.no_double_quant,
            nvfp4_method=args.nvfp4_method,
        )
    except torch.OutOfMemoryError as e:
        res["status"] = f"does not fit: OOM while building ({str(e).splitlines()[0][:200]})"
        return None
    _sync()
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res.update(info)
    if cuda:
        res["weights_gpu_gb"] = _gb(torch.cuda.memory_allocated(device))
    return model


def compile_config(args, cuda: bool):
    """transformers ``CompileConfig`` from the benchmark's knobs (``--compile-backend``, ``--compile-mode``,
    ``--fullgraph``); static shapes, so each batch size gets its own graph."""
    from transformers.generation.configuration_utils import CompileConfig

    cc = CompileConfig(
        fullgraph=args.fullgraph,
        dynamic=False,
        backend=args.compile_backend,
        mode=args.compile_mode if args.compile_backend == "inductor" else None,
    )
    if not cuda:
        cc._compile_all_devices = True  # CPU validation: let generate compile anyway
    return cc


def graph_compile_options(args) -> dict:
    """``torch.compile`` keyword arguments of ``graph_generate``'s decode step from the same knobs as
    :func:`compile_config` (static shapes: each batch size gets its own graph)."""
    return dict(
        fullgraph=args.fullgraph,
        dynamic=False,
        backend=args.compile_backend,
        mode=args.compile_mode if args.compile_backend == "inductor" else None,
    )


# ---------------------------------------------------------------------------------------------------------- worker
def _save_partial(args, res: dict) -> None:
    """Write the worker's results so far to its result file, so they survive a timeout kill of the worker."""
    if getattr(args, "_result", None):
        with open(args._result, "w") as f:
            json.dump({**res, "status": "partial: killed after this batch"}, f)


def run_worker(args) -> dict:
    import torch
    from transformers import GenerationConfig

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    catcher = _LogCatcher()
    catcher.install()
    engine = getattr(args, "engine", "generate")
    res: dict = {"model": args.model, "arm": args.arm, "label": ARM_LABEL[args.arm], "engine": engine, "batches": []}
    model = build_arm(args, device, dtype, res)
    if model is None:
        return res
    vocab = MODELS[args.model]["vocab_size"]

    cc = None if args.no_compile else compile_config(args, cuda)

    def gcfg(n_new: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            num_beams=1,
            cache_implementation="static",
            max_cache_len=args.prompt_len + args.new_tokens,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
            use_cache=True,
            compile_config=cc,
            disable_compile=args.no_compile,
        )

    if engine == "graph":
        from qerl_trl.graph_generate import graph_generate

        graph_opts = graph_compile_options(args)

    def run_engine(ids, n_new: int):
        if engine == "graph":  # same lengths, greedy, no EOS, same cache length as generate
            return graph_generate(
                model,
                ids,
                torch.ones_like(ids),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                max_cache_len=args.prompt_len + args.new_tokens,
                compile=not args.no_compile,
                compile_options=graph_opts,
            )
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gcfg(n_new))

    def generate(ids, n_new: int):
        with torch.no_grad():
            _sync()
            t = time.perf_counter()
            out = run_engine(ids, n_new)
            _sync()
            return time.perf_counter() - t, out

    status = "ok"
    for b in args.batch:
        row: dict = {"batch": b}
        res["batches"].append(row)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(1, vocab, (b, args.prompt_len), device=device, generator=None)
        n_logs = len(catcher.records)
        if args.eos_mean_tokens:
            try:
                c0 = _dynamo_counters()
                prefill_all = [generate(ids, 1)[0] for _ in range(PREFILL_SAMPLES)]
                row["prefill_s"], row["prefill_s_all"] = round(min(prefill_all), 4), [round(t, 4) for t in prefill_all]
                row.update(measure_spread(args, model, ids, device, graph_opts))
                row["dynamo_timed"] = _diff(c0, _dynamo_counters())  # compiles of the warm-ups included
            except torch.OutOfMemoryError as e:
                row["status"] = f"does not fit: OOM at batch {b} ({str(e).splitlines()[0][:200]})"
                status = "partial: OOM"
                del ids
                break
            row["torch_log"] = catcher.records[n_logs:][:20]
            if cuda:
                row["peak_gpu_gb"] = _gb(torch.cuda.max_memory_allocated())
            del ids
            _save_partial(args, res)
            continue
        try:
            c0 = _dynamo_counters()
            row["warmup1_s"], _ = generate(ids, args.warmup_tokens)  # compile + CUDA-graph recording
            c1 = _dynamo_counters()
            row["warmup2_s"], _ = generate(ids, args.warmup_tokens)  # must be a pure replay
            c2 = _dynamo_counters()
            # prefill (eager) + 1 token, the fastest of 3: one sample varied 2-3× between runs of the same engine
            prefill_all = [generate(ids, 1)[0] for _ in range(PREFILL_SAMPLES)]
            row["prefill_s"], row["prefill_s_all"] = min(prefill_all), [round(t, 4) for t in prefill_all]
            row["compile_s"] = round(row["warmup1_s"] - row["warmup2_s"], 2)
            times = []
            for _ in range(args.repeats):
                dt, out = generate(ids, args.new_tokens)
                times.append(dt)
            c3 = _dynamo_counters()
        except torch.OutOfMemoryError as e:
            row["status"] = f"does not fit: OOM at batch {b} ({str(e).splitlines()[0][:200]})"
            status = "partial: OOM"
            if cuda:
                row["peak_gpu_gb"] = _gb(torch.cuda.max_memory_allocated())
            del ids
            break
        new = out.shape[1] - args.prompt_len
        row["new_tokens_generated"] = int(new)
        row["length_ok"] = bool(new == args.new_tokens)
        gen_s = min(times)
        row["gen_s"] = round(gen_s, 4)
        row["gen_s_all"] = [round(t, 4) for t in times]
        row["tok_s"] = round(b * args.new_tokens / gen_s, 2)
        decode_s = gen_s - row["prefill_s"]
        row["decode_tok_s"] = round(b * (args.new_tokens - 1) / decode_s, 2) if decode_s > 0 else None
        row["ms_per_step"] = round(1000 * decode_s / max(args.new_tokens - 1, 1), 3)
        for k in ("warmup1_s", "warmup2_s", "prefill_s"):
            row[k] = round(row[k], 3)
        row["dynamo_compile"] = _diff(c0, c1)
        row["dynamo_warmup2"] = _diff(c1, c2)
        row["dynamo_timed"] = _diff(c2, c3)
        row["graph_break_reasons"] = c3["graph_break_reasons"]
        row["recompiled_after_warmup"] = bool(
            row["dynamo_warmup2"]["unique_graphs"] or row["dynamo_timed"]["unique_graphs"]
        )
        row["torch_log"] = catcher.records[n_logs:][:20]
        if cuda:
            row["peak_gpu_gb"] = _gb(torch.cuda.max_memory_allocated())
            row["peak_gpu_reserved_gb"] = _gb(torch.cuda.max_memory_reserved())
        compiled = not args.no_compile
        row["compiled_path_ok"] = (
            None
            if not compiled
            else bool(
                row["dynamo_compile"]["unique_graphs"] >= 1
                and c3["graph_breaks"] == 0
                and not row["recompiled_after_warmup"]
                and (not cuda or c3["cudagraph_skips"] == 0)
            )
        )
        del ids, out
        _save_partial(args, res)
    res["status"] = status
    res["peak_rss_gb"] = _rss_peak_gb()
    return res


def spread_eos_ids(vocab: int, mean_tokens: float, seed: int = 0) -> list[int]:
    """``round(vocab / mean_tokens)`` distinct token ids (never :data:`SPREAD_PAD`), drawn once from ``seed``."""
    import torch

    k = max(1, round(vocab / mean_tokens))
    perm = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(seed))[:k] + 1
    return sorted(perm.tolist())


def completion_lengths(gen, eos: list[int]) -> tuple[list[int], bool]:
    """Per row of ``gen`` ``[B, T]``: tokens up to and including the first EOS (``T`` without one); and whether every
    row holds only :data:`SPREAD_PAD` after its EOS."""
    import torch

    is_eos = torch.isin(gen, torch.tensor(eos, device=gen.device))
    has = is_eos.any(1)
    ends = torch.where(has, is_eos.int().argmax(1) + 1, torch.full_like(has, gen.shape[1], dtype=torch.long))
    after = torch.arange(gen.shape[1], device=gen.device)[None, :] >= ends[:, None]
    return ends.tolist(), bool((gen[after] == SPREAD_PAD).all())


def measure_spread(args, model, ids, device, graph_opts: dict) -> dict:
    """``--eos-mean-tokens``: ``args.spread_warmups`` warm-up rollouts (the first compiles and records every batch size
    compaction reaches; the timed rounds' dynamo counters show any compile they still did), then
    ``args.repeats`` rounds of the :data:`SPREAD_VARIANTS`, each round one seed for all three. Returns the row's
    ``spread`` results (per variant: median ``tok_s`` of real tokens, every round's time, tokens, steps, mean and
    max completion length, well-formedness) and the warm-ups' times."""
    import statistics

    import torch
    from qerl_trl.graph_generate import graph_generate

    vocab = MODELS[args.model]["vocab_size"]
    eos = spread_eos_ids(vocab, args.eos_mean_tokens)
    compact_kw = {} if args.compact_min_batch is None else {"compact_min_batch": args.compact_min_batch}
    n, p = args.new_tokens, args.prompt_len

    def run(variant: str, seed: int) -> dict:
        g = torch.Generator(device=device).manual_seed(seed)
        _sync()
        t0 = time.perf_counter()
        out = graph_generate(
            model,
            ids,
            torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n if variant == "fixed" else args.min_new_tokens,
            do_sample=True,
            temperature=1.0,
            eos_token_id=eos,
            pad_token_id=SPREAD_PAD,
            max_cache_len=p + n,
            compile=not args.no_compile,
            compile_options=graph_opts,
            compact=variant == "eos+compact",
            generator=g,
            **compact_kw,
        )
        _sync()
        dt = time.perf_counter() - t0
        lengths, ok = completion_lengths(out[:, p:], eos)
        return {"s": dt, "tokens": sum(lengths), "steps": out.shape[1] - p, "lengths": lengths, "ok": ok}

    warm = [round(run("eos+compact", 1000 + i)["s"], 3) for i in range(args.spread_warmups)]
    rounds = {v: [] for v in SPREAD_VARIANTS}
    for r in range(args.repeats):
        for v in SPREAD_VARIANTS:
            rounds[v].append(run(v, r))
    spread = {}
    for v, rs in rounds.items():
        tok_s = [x["tokens"] / x["s"] for x in rs]
        lengths = [n_ for x in rs for n_ in x["lengths"]]
        spread[v] = {
            "tok_s": round(statistics.median(tok_s), 2),
            "tok_s_all": [round(t, 2) for t in tok_s],
            "gen_s_all": [round(x["s"], 4) for x in rs],
            "tokens_all": [x["tokens"] for x in rs],
            "steps_all": [x["steps"] for x in rs],
            "mean_len": round(sum(lengths) / len(lengths), 1),
            "max_len": max(lengths),
            "well_formed": all(x["ok"] for x in rs),
        }
    return {"warmup_s": warm, "n_eos_ids": len(eos), "spread": spread}


def spread_table(results: list[dict]) -> str:
    """The ``--eos-mean-tokens`` rows: tok/s per variant, completion lengths, and NVFP4 / other-arm ratios."""
    rows = [(r, row) for r in results for row in r.get("batches", []) if "spread" in row]
    if not rows:
        return ""
    lines = [
        "| model | arm | B | fixed tok/s | EOS tok/s | EOS + compaction tok/s | compaction gain | mean / max len "
        "| steps (EOS) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r, row in rows:
        sp = row["spread"]
        gain = sp["eos+compact"]["tok_s"] / sp["eos"]["tok_s"] if sp["eos"]["tok_s"] else None
        lines.append(
            f"| {r['model']} | {r['label']} | {row['batch']} | {_fmt(sp['fixed']['tok_s'])} | {_fmt(sp['eos']['tok_s'])} "
            f"| {_fmt(sp['eos+compact']['tok_s'])} | {_fmt(gain, 2)}× | {sp['eos']['mean_len']} / {sp['eos']['max_len']} "
            f"| {sp['eos']['steps_all']} |"
        )
    by = {(r["model"], r["arm"], row["batch"]): row["spread"] for r, row in rows}
    rat = []
    for (m, a, b), sp in sorted(by.items()):
        if a != "nvfp4":
            continue
        for other in ("bf16", "qlora"):
            o = by.get((m, other, b))
            if o:
                cells = " | ".join(f"{sp[v]['tok_s'] / o[v]['tok_s']:.2f}×" for v in SPREAD_VARIANTS)
                rat.append(f"| {m} | {b} | NVFP4+LoRA / {ARM_LABEL[other]} | {cells} |")
    if rat:
        lines += ["", "| model | B | ratio | fixed | EOS | EOS + compaction |", "|---|---:|---|---:|---:|---:|", *rat]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- driver
def _worker_cmd(args, model: str, arm: str, result_path: str) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_worker",
        "--model",
        model,
        "--arm",
        arm,
        "--_result",
        result_path,
        "--batch",
        ",".join(map(str, args.batch)),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--warmup-tokens",
        str(args.warmup_tokens),
        "--repeats",
        str(args.repeats),
        "--lora-r",
        str(args.lora_r),
        "--lora-dtype",
        args.lora_dtype,
        "--nvfp4-method",
        args.nvfp4_method,
        "--compile-backend",
        args.compile_backend,
        "--compile-mode",
        args.compile_mode,
        "--engine",
        args.engine,
        "--eos-mean-tokens",
        str(args.eos_mean_tokens),
        "--min-new-tokens",
        str(args.min_new_tokens),
        "--spread-warmups",
        str(args.spread_warmups),
    ]
    if args.compact_min_batch is not None:
        cmd += ["--compact-min-batch", str(args.compact_min_batch)]
    for flag in ("no_compile", "cpu", "fullgraph", "no_double_quant"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def _failed(model: str, arm: str, status: str, **kw) -> dict:
    """A result row for an arm that produced no measurement."""
    return {"model": model, "arm": arm, "label": ARM_LABEL[arm], "status": status, **kw}


def _exception_result(model: str, arm: str, exc: BaseException, **kw) -> dict:
    """A worker's exception as a result row (an OOM means "does not fit"); the traceback is printed and kept."""
    import torch

    oom = isinstance(exc, torch.OutOfMemoryError)
    res = _failed(model, arm, "does not fit: OOM" if oom else f"failed: {type(exc).__name__}: {str(exc)[:300]}", **kw)
    res["traceback"] = traceback.format_exc()[-3000:]
    print(res["traceback"], file=sys.stderr)
    return res


def _worker_exit(args, run_worker, **kw) -> None:
    """Body of a ``--_worker`` subprocess: run one (model, arm), write the result (or the failure) to
    ``args._result`` and exit at once (skips the slow teardown of compiled graphs and the CUDA context)."""
    try:
        res = run_worker(args)
    except Exception as e:  # noqa: BLE001
        res = _exception_result(args.model, args.arm, e, **kw)
    with open(args._result, "w") as f:
        json.dump(res, f, default=str)
    sys.stdout.flush()
    os._exit(0)


def _run_worker_subprocess(cmd: list[str], result_path: str, model: str, arm: str, args, **kw) -> dict:
    """Run a worker command (``args.arm_timeout``); its result file, or a failure row with the log's tail."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, timeout=args.arm_timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    wall = round(time.perf_counter() - t0, 1)
    if args.verbose:
        print(out)
    if os.path.exists(result_path):
        with open(result_path) as f:
            res = json.load(f)
    else:
        tail = "\n".join(out.strip().splitlines()[-15:])
        oom = "OutOfMemoryError" in out or "CUDA out of memory" in out
        res = _failed(
            model, arm, "does not fit: OOM (worker died)" if oom else f"failed (rc={rc})", log_tail=tail, **kw
        )
        print(f"[{model}/{arm}] worker rc={rc}\n{tail}", file=sys.stderr)
    res["wall_s"] = wall
    return res


def _run_subprocess(args, model: str, arm: str) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        rp = os.path.join(td, "r.json")
        return _run_worker_subprocess(
            _worker_cmd(args, model, arm, rp), rp, model, arm, args, batches=[], engine=args.engine
        )


def _merge(paths: list[str]) -> tuple[dict, list[dict]]:
    """Result files of several runs → (meta with every run's metadata under ``runs``, rows tagged with their run)."""
    results, meta = [], {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        for r in d.pop("results"):
            r.setdefault("run", len(meta.get("runs", [])))
            r.setdefault("run_date", d.get("date"))
            results.append(r)
        meta.setdefault("runs", []).append(d)
    return meta, results


def _check_names(ap: argparse.ArgumentParser, models: list[str], arms: list[str], known_arms) -> None:
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m}")
    for a in arms:
        if a not in known_arms:
            ap.error(f"unknown arm {a}")


def _fmt(x, nd=1):
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def table(results: list[dict]) -> str:
    lines = [
        "| model | arm | engine | B | tok/s | decode tok/s | ms/step | prefill s | compile s | peak GPU GB | compiled path"
        " | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        eng = r.get("engine", "generate")  # results written before --engine existed
        if not r.get("batches"):
            lines.append(f"| {r['model']} | {r['label']} | {eng} | — | — | — | — | — | — | — | — | {r.get('status')} |")
            continue
        for row in r["batches"]:
            cp = row.get("compiled_path_ok")
            if cp is None:
                cps = "eager" if "tok_s" in row else "—"
            elif cp:
                cps = "ok"
            else:
                d = row.get("dynamo_compile", {})
                cps = (
                    f"BROKEN (breaks {row.get('graph_break_reasons') and sum(row['graph_break_reasons'].values())},"
                    f" graphs {d.get('unique_graphs')}, recompiled {row.get('recompiled_after_warmup')},"
                    f" cg-skips {d.get('cudagraph_skips')})"
                )
            lines.append(
                f"| {r['model']} | {r['label']} | {eng} | {row['batch']} | {_fmt(row.get('tok_s'))} | "
                f"{_fmt(row.get('decode_tok_s'))} | {_fmt(row.get('ms_per_step'), 2)} | {_fmt(row.get('prefill_s'), 3)} | "
                f"{_fmt(row.get('compile_s'))} | {_fmt(row.get('peak_gpu_gb'), 2)} | {cps} | "
                f"{row.get('status', r.get('status'))} |"
            )
    # ratios, side by side
    # (--merge tags each result with the run it came from; a ratio across two runs is marked as such)
    by = {
        (r["model"], r["arm"], row["batch"], r.get("engine", "generate")): (row.get("tok_s"), r.get("run"))
        for r in results
        for row in r.get("batches", [])
    }

    def ratio(v, key, run) -> str:
        o, orun = by.get(key, (None, None))
        return (f"{v / o:.2f}×" + (" (across runs)" if orun != run else "")) if o and v else "—"

    rat = []
    for (m, a, b, e), (v, run) in sorted(by.items()):
        if a != "nvfp4" or not v:
            continue
        parts = [ratio(v, (m, other, b, e), run) for other in ("bf16", "qlora")]
        rat.append(f"| {m} | {e} | {b} | {parts[0]} | {parts[1]} |")
    if rat:
        lines += [
            "",
            "| model | engine | B | NVFP4+LoRA / bf16+LoRA | NVFP4+LoRA / QLoRA |",
            "|---|---|---:|---:|---:|",
            *rat,
        ]
    eng_rat = [
        f"| {m} | {ARM_LABEL.get(a, a)} | {b} | {ratio(v, (m, a, b, 'generate'), run)} |"
        for (m, a, b, e), (v, run) in sorted(by.items())
        if e == "graph" and (m, a, b, "generate") in by
    ]
    if eng_rat:
        lines += ["", "| model | arm | B | graph / generate tok/s |", "|---|---|---:|---:|", *eng_rat]
    return "\n".join(lines)


def plot_batches(results: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Tokens/s against batch size per (model, arm), and NVFP4 + LoRA's ratio to each other arm, into a PNG.

    ``results`` are a rollout JSON's ``results``; rows merged from several runs (``--merge`` tags them) stay separate
    curves, and a ratio is only drawn within one run and engine. Both axes of the throughput panel are logarithmic;
    the ratio panel marks 1× (parity).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one curve per (model, engine, run, arm); ratios only within one (model, engine, run)
    curves: dict[tuple[str, str, int, str], dict[int, float]] = {}
    for r in results:
        pts = {row["batch"]: row["tok_s"] for row in r.get("batches", []) if row.get("tok_s")}
        if pts:
            curves[(r["model"], r.get("engine", "generate"), r.get("run", 0), r["arm"])] = pts
    if not curves:
        raise ValueError("no (model, arm) in these results has a tok/s figure to plot")
    several_engines = len({k[1] for k in curves}) > 1
    several_runs = len({k[2] for k in curves}) > 1

    def name(m: str, e: str, run: int) -> str:
        return m + (f" {e}" if several_engines else "") + (f" run {run}" if several_runs else "")

    fig, (tx, rx) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batches = sorted({b for pts in curves.values() for b in pts})
    for i, ((m, e, run, a), pts) in enumerate(sorted(curves.items())):
        bs, colour = sorted(pts), colours[i % len(colours)]  # one colour per curve, kept in the ratio panel
        tx.plot(bs, [pts[b] for b in bs], marker="o", color=colour, label=f"{name(m, e, run)} {ARM_LABEL.get(a, a)}")
        ours = curves.get((m, e, run, "nvfp4"))
        if a != "nvfp4" and ours:
            common = [b for b in bs if b in ours]
            rx.plot(common, [ours[b] / pts[b] for b in common], marker="o", color=colour,
                    label=f"{name(m, e, run)}: ÷ {ARM_LABEL.get(a, a)}")  # fmt: skip
    for ax in (tx, rx):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (completions generated at once)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tx.set_yscale("log")
    tx.set_ylabel("tokens / s (prefill included)")
    rx.axhline(1.0, color="grey", lw=1, ls="--")
    rx.set_ylabel("NVFP4 + LoRA tok/s ÷ other arm")
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp" + out.suffix)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _run_title(meta: dict) -> str:
    """A plot title naming the run: device, commit, date (``?`` where a result file predates the field)."""
    return f"{meta.get('device', '?')}, {meta.get('versions', {}).get('commit', '?')}, {meta.get('date', '?')[:10]}"


def _write(path: str, meta: dict, results: list[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    os.replace(tmp, p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="7b,14b,32b", help="comma list of " + ",".join(MODELS))
    ap.add_argument("--arms", default="bf16,qlora,nvfp4", help="comma list of " + ",".join(ARMS))
    ap.add_argument("--batch", default="1,8", type=lambda s: [int(x) for x in _csv(s)])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each warm-up generate (compile)")
    ap.add_argument(
        "--eos-mean-tokens",
        type=float,
        default=0.0,
        help="graph engine: completions of varying length (EOS ids for a mean of this many tokens past "
        "--min-new-tokens; sampled); 0: fixed lengths, greedy",
    )
    ap.add_argument("--min-new-tokens", type=int, default=0, help="with --eos-mean-tokens: EOS suppressed before this")
    ap.add_argument("--spread-warmups", type=int, default=2,
                    help="with --eos-mean-tokens: warm-up rollouts per batch (the first compiles and records)")  # fmt: skip
    ap.add_argument("--compact-min-batch", type=int, default=None,
                    help="graph_generate's compact_min_batch (default: its own, COMPACT_MIN_BATCH)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="timed generates per batch (min is reported)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--lora-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--nvfp4-method", default="rtn", choices=["rtn", "mse"])
    ap.add_argument("--no-double-quant", action="store_true", help="bnb NF4 without double quantization")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "cudagraphs"],
        help="cudagraphs = dynamo + CUDA graphs without inductor (much faster to compile)",
    )
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument(
        "--engine",
        default="generate",
        choices=ENGINES,
        help="generate: model.generate (static cache, compiled decode forward); graph: qerl_trl graph_generate "
        "(one compiled graph per decode step, sampling included, no host sync per step)",
    )
    ap.add_argument("--fullgraph", action="store_true", help="CompileConfig(fullgraph=True): a graph break errors")
    ap.add_argument("--no-compile", action="store_true", help="eager generate (CPU validation)")
    ap.add_argument("--tiny", action="store_true", help="tiny config only (CPU validation)")
    ap.add_argument("--cpu", action="store_true", help="force CPU")
    ap.add_argument("--in-process", action="store_true", help="run arms in this process (debugging)")
    ap.add_argument("--arm-timeout", type=float, default=900.0, help="seconds per (model, arm) subprocess")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="start no new (model, arm) after this many seconds (keeps a device call inside its limit)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollout.json"))
    ap.add_argument("--merge", nargs="+", help="merge these result JSONs into --out and print the table")
    ap.add_argument("--plot", help="also write a PNG of tok/s and NVFP4's ratios against batch size (matplotlib)")
    ap.add_argument("--plot-only", metavar="JSON", help="with --plot: plot this result JSON, run nothing")
    ap.add_argument("--verbose", action="store_true", help="print worker output")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:
        _worker_exit(args, run_worker, batches=[], engine=args.engine)

    if args.plot_only:
        if not args.plot:
            ap.error("--plot-only needs --plot PNG")
        with open(args.plot_only) as f:
            d = json.load(f)
        print(f"wrote {plot_batches(d['results'], args.plot, _run_title(d))}")
        return

    if args.merge:
        meta, results = _merge(args.merge)
        _write(args.out, meta, results)
        print(table(results))
        print(spread_table(results))
        if args.plot:
            print(f"wrote {plot_batches(results, args.plot, 'merged runs')}")
        return

    import torch

    models = ["tiny"] if args.tiny else _csv(args.models)
    arms = _csv(args.arms)
    _check_names(ap, models, arms, ARMS)
    if args.eos_mean_tokens and args.engine != "graph":
        ap.error("--eos-mean-tokens needs --engine graph (compaction is graph_generate's)")
    if args.eos_mean_tokens < 0 or not 0 <= args.min_new_tokens < args.new_tokens:
        ap.error("--eos-mean-tokens must be >= 0 and --min-new-tokens in [0, --new-tokens)")
    meta = {
        "benchmark": (
            "rollout tokens/s, transformers generate, static cache" + ("" if args.no_compile else " + compiled decode")
            if args.engine == "generate"
            else "rollout tokens/s, qerl_trl graph_generate (static cache"
            + ("" if args.no_compile else ", one compiled graph per decode step incl. sampling")
            + ")"
        ),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device_name() if not args.cpu else "cpu (forced)",
        "versions": versions(),
        "settings": {
            k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("merge", "verbose", "plot_only")
        },
        "configs": {m: MODELS[m] for m in models},
        "tok_s_definition": "batch * new_tokens / wall time of one generate (prefill included), after warm-up; "
        "decode_tok_s = batch * (new_tokens-1) / (generate time - prefill+1-token generate time, fastest of 3)",
    }
    print(f"# rollout: {meta['device']} | {meta['versions']}", flush=True)
    results: list[dict] = []
    t_start = time.perf_counter()
    for m in models:
        for a in arms:
            t0 = time.perf_counter()
            if args.deadline_s and t0 - t_start > args.deadline_s:
                res = _failed(
                    m,
                    a,
                    f"not run: --deadline-s {args.deadline_s:g} passed",
                    batches=[],
                    wall_s=0.0,
                    engine=args.engine,
                )
                results.append(res)
                print(f"[{m}/{a}] {res['status']}", flush=True)
                _write(args.out, meta, results)
                continue
            print(f"[{m}/{a}/{args.engine}] running ...", flush=True)
            if args.in_process:
                wargs = argparse.Namespace(**{**vars(args), "model": m, "arm": a})
                try:
                    res = run_worker(wargs)
                except Exception as e:  # noqa: BLE001
                    res = _exception_result(m, a, e, batches=[], engine=args.engine)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
            else:
                res = _run_subprocess(args, m, a)
            res.setdefault("wall_s", round(time.perf_counter() - t0, 1))
            results.append(res)
            brief = ", ".join(
                f"B={r['batch']}: {r.get('tok_s')} tok/s (compile {r.get('compile_s')} s, "
                f"compiled ok={r.get('compiled_path_ok')})"
                for r in res.get("batches", [])
            )
            print(f"[{m}/{a}] {res.get('status')} in {res['wall_s']} s; {brief}", flush=True)
            _write(args.out, meta, results)
    print()
    print(table(results))
    if args.eos_mean_tokens:
        print()
        print(spread_table(results))
    print(f"\nwrote {args.out}")
    if args.plot:
        print(f"wrote {plot_batches(results, args.plot, _run_title(meta))}")


if __name__ == "__main__":
    main()
