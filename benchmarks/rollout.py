"""Rollout throughput (issue #7): ``qerl_trl.graph_generate``, a static cache and one compiled graph per decode step.

Every arm (:mod:`common.models`: random weights with the real Qwen2.5 shapes; ``bf16``, ``qlora``, ``nvfp4``, each
+ LoRA r=32) runs :func:`qerl_trl.graph_generate.graph_generate` (sampling in the compiled step; CUDA graphs on CUDA)
in a fresh subprocess (OOM = "does not fit"; results appended to ``--out`` after every arm). The transformers
``generate`` engine is at ``benchmarks/rollout.py@e48270c``; ``--engine graph`` stays so that recorded commands run.
Fixed lengths: ``--new-tokens`` greedy tokens after a ``--prompt-len`` prompt; per batch a warm-up (``compile_s``), a
second (must not recompile), three 1-token calls (prefill: the fastest), the timed rollout (``tok/s`` end to end,
``decode tok/s`` without the prefill). ``--eos-mean-tokens M``: T = 1 with ``round(V / M)`` EOS ids, variants
``fixed``, ``eos`` and ``eos+compact`` per round; ``tok/s`` of real tokens, median over ``--repeats``.
``--profile``: ms per decode step by kernel category (``common.profiler.profile_decode``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import RESULTS, gb, merge_results, rss_peak_gb, run_title, sync, versions, write_result
from common.models import ARM_LABEL, ARMS, OURS, build_arm, graph_compile_options, spread_eos_ids
from common.plots import plot_batches
from common.profiler import profile_decode, with_profile
from common.rollouts import add_rollout_arguments, fixed_length_row, models_and_arms, prefill_row, spread_summary
from common.shapes import MODELS
from common.tables import fmt
from common.workers import (
    LogCatcher,
    add_arm_arguments,
    counter_diff,
    dynamo_counters,
    run_arm_grid,
    run_meta,
    save_partial,
    worker_exit,
)

SPREAD_VARIANTS = ("fixed", "eos", "eos+compact")  # --eos-mean-tokens: what each timed round runs
SPREAD_PAD = 0  # pad id of the spread runs (never an EOS id)

# ---------------------------------------------------------------------------------------------------------- worker
def run_worker(args) -> dict:
    import torch
    from qerl_trl.graph_generate import graph_generate

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    catcher = LogCatcher().install()
    res: dict = {"model": args.model, "arm": args.arm, "label": ARM_LABEL[args.arm], "engine": args.engine,
                 "batches": []}  # fmt: skip
    model = build_arm(args, device, dtype, res)
    if model is None:
        return res
    vocab = MODELS[args.model]["vocab_size"]
    options = None if args.no_compile else graph_compile_options(args)  # made once: one compiled graph each

    def generate(ids, n_new: int):
        """Seconds and ids of exactly ``n_new`` greedy tokens (EOS disabled), the cache as long as the run's longest."""
        with torch.no_grad():
            sync()
            t = time.perf_counter()
            out = graph_generate(model, ids, torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 max_cache_len=args.prompt_len + args.new_tokens, compile=not args.no_compile,
                                 compile_options=options)  # fmt: skip
            sync()
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
        try:
            if args.eos_mean_tokens:
                c0 = dynamo_counters()
                row.update(prefill_row(lambda ids=ids: generate(ids, 1)[0]))
                row.update(measure_spread(args, model, ids, device, options))
                row["dynamo_timed"] = counter_diff(c0, dynamo_counters())  # compiles of the warm-ups included
            else:
                row.update(measure_fixed(args, lambda n, ids=ids: generate(ids, n), cuda))
        except torch.OutOfMemoryError as e:
            row["status"] = f"does not fit: OOM at batch {b} ({str(e).splitlines()[0][:200]})"
            status = "partial: OOM"
            if cuda:
                row["peak_gpu_gb"] = gb(torch.cuda.max_memory_allocated())
            break
        row["torch_log"] = catcher.records[n_logs:][:20]
        if cuda:
            row["peak_gpu_gb"] = gb(torch.cuda.max_memory_allocated())
            row["peak_gpu_reserved_gb"] = gb(torch.cuda.max_memory_reserved())
        del ids
        save_partial(args, res)
    res["status"] = status
    res["peak_rss_gb"] = rss_peak_gb()
    return res


def measure_fixed(args, generate: Callable, cuda: bool) -> dict:
    """Fixed lengths, one batch (``generate(n)``: seconds and ids of ``n`` new tokens): the row's timings, lengths,
    dynamo counters and whether the compiled path held."""
    row: dict = {}
    c0 = dynamo_counters()
    warmup1_s, _ = generate(args.warmup_tokens)  # compile + CUDA-graph recording
    c1 = dynamo_counters()
    warmup2_s, _ = generate(args.warmup_tokens)  # must be a pure replay
    c2 = dynamo_counters()
    row.update(prefill_row(lambda: generate(1)[0]))  # prefill (eager) + 1 token
    row["compile_s"] = round(warmup1_s - warmup2_s, 2)
    times = []
    for _ in range(args.repeats):
        dt, out = generate(args.new_tokens)
        times.append(dt)
    c3 = dynamo_counters()
    if args.profile:  # after the counters: the profiled runs replay the same graphs
        row["profile"] = profile_decode(lambda n: generate(n)[0], cuda, min(16, args.new_tokens - 1))
    new = out.shape[1] - args.prompt_len
    row["new_tokens_generated"] = int(new)
    row["length_ok"] = bool(new == args.new_tokens)
    row.update(fixed_length_row(times, len(out), args.new_tokens, row["prefill_s"], out[:, args.prompt_len :].tolist()))
    row["warmup1_s"], row["warmup2_s"] = round(warmup1_s, 3), round(warmup2_s, 3)
    row["dynamo_compile"] = counter_diff(c0, c1)
    row["dynamo_warmup2"] = counter_diff(c1, c2)
    row["dynamo_timed"] = counter_diff(c2, c3)
    row["graph_break_reasons"] = c3["graph_break_reasons"]
    row["recompiled_after_warmup"] = bool(row["dynamo_warmup2"]["unique_graphs"] or row["dynamo_timed"]["unique_graphs"])
    row["compiled_path_ok"] = None if args.no_compile else bool(
        row["dynamo_compile"]["unique_graphs"] >= 1
        and c3["graph_breaks"] == 0
        and not row["recompiled_after_warmup"]
        and (not cuda or c3["cudagraph_skips"] == 0)
    )  # fmt: skip
    return row


def completion_lengths(gen, eos: list[int]) -> tuple[list[int], bool]:
    """Per row of ``gen`` ``[B, T]``: tokens up to and including the first EOS (``T`` without one); and whether every
    row holds only :data:`SPREAD_PAD` after its EOS."""
    import torch

    is_eos = torch.isin(gen, torch.tensor(eos, device=gen.device))
    has = is_eos.any(1)
    ends = torch.where(has, is_eos.int().argmax(1) + 1, torch.full_like(has, gen.shape[1], dtype=torch.long))
    after = torch.arange(gen.shape[1], device=gen.device)[None, :] >= ends[:, None]
    return ends.tolist(), bool((gen[after] == SPREAD_PAD).all())


def measure_spread(args, model, ids, device, graph_opts: dict | None) -> dict:
    """``--eos-mean-tokens``: ``args.spread_warmups`` warm-up rollouts (the first compiles every batch size compaction
    reaches), then ``args.repeats`` rounds of the :data:`SPREAD_VARIANTS`, one seed a round; the row's ``spread``
    (:func:`common.rollouts.spread_summary`) and the warm-ups' times."""
    import torch
    from qerl_trl.graph_generate import graph_generate

    vocab = MODELS[args.model]["vocab_size"]
    eos = spread_eos_ids(vocab, args.eos_mean_tokens)
    compact_kw = {} if args.compact_min_batch is None else {"compact_min_batch": args.compact_min_batch}
    n, p = args.new_tokens, args.prompt_len

    def run(variant: str, seed: int) -> dict:
        g = torch.Generator(device=device).manual_seed(seed)
        sync()
        t0 = time.perf_counter()
        out = graph_generate(model, ids, torch.ones_like(ids), max_new_tokens=n, do_sample=True, temperature=1.0,
                             min_new_tokens=n if variant == "fixed" else args.min_new_tokens, eos_token_id=eos,
                             pad_token_id=SPREAD_PAD, max_cache_len=p + n, compile=not args.no_compile,
                             compile_options=graph_opts, compact=variant == "eos+compact", generator=g,
                             **compact_kw)  # fmt: skip
        sync()
        dt = time.perf_counter() - t0
        lengths, ok = completion_lengths(out[:, p:], eos)
        return {"s": dt, "tokens": sum(lengths), "steps": out.shape[1] - p, "lengths": lengths, "ok": ok}

    warm = [round(run("eos+compact", 1000 + i)["s"], 3) for i in range(args.spread_warmups)]
    rounds = {v: [] for v in SPREAD_VARIANTS}
    for r in range(args.repeats):
        for v in SPREAD_VARIANTS:
            rounds[v].append(run(v, r))
    return {"warmup_s": warm, "n_eos_ids": len(eos), "spread": spread_summary(rounds)}


def spread_table(results: list[dict]) -> str:
    """The ``--eos-mean-tokens`` rows: tok/s per variant, completion lengths, and NVFP4 / other-arm ratios."""
    rows = [(r, row) for r in results for row in r.get("batches", []) if "spread" in row]
    if not rows:
        return ""
    lines = ["| model | arm | B | fixed tok/s | EOS tok/s | EOS + compaction tok/s | compaction gain | mean / max len "
             "| steps (EOS) |", "|---|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for r, row in rows:
        fixed, eos, compact = (row["spread"][v] for v in SPREAD_VARIANTS)
        gain = compact["tok_s"] / eos["tok_s"] if eos["tok_s"] else None
        lines.append(f"| {r['model']} | {r['label']} | {row['batch']} | {fmt(fixed['tok_s'])} | {fmt(eos['tok_s'])} "
                     f"| {fmt(compact['tok_s'])} | {fmt(gain, 2)}× | {eos['mean_len']} / {eos['max_len']} "
                     f"| {eos['steps_all']} |")  # fmt: skip
    by = {(r["model"], r["arm"], row["batch"]): row["spread"] for r, row in rows}
    rat = [f"| {m} | {b} | NVFP4+LoRA / {ARM_LABEL[other]} | "
           + " | ".join(f"{sp[v]['tok_s'] / o[v]['tok_s']:.2f}×" for v in SPREAD_VARIANTS) + " |"
           for (m, a, b), sp in sorted(by.items()) if a == OURS
           for other in ("bf16", "qlora") if (o := by.get((m, other, b)))]  # fmt: skip
    if rat:
        lines += ["", "| model | B | ratio | fixed | EOS | EOS + compaction |", "|---|---:|---|---:|---:|---:|", *rat]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- driver
_PASS = ("batch", "prompt_len", "new_tokens", "warmup_tokens", "repeats", "compile_backend", "engine", "eos_mean_tokens",
         "min_new_tokens", "spread_warmups", "compact_min_batch")  # fmt: skip
_FLAGS = ("no_compile", "profile")


def table(results: list[dict]) -> str:
    lines = ["| model | arm | engine | B | tok/s | decode tok/s | ms/step | prefill s | compile s | peak GPU GB "
             "| compiled path | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for r in results:
        eng = r.get("engine", "generate")  # results written before --engine existed
        if not r.get("batches"):
            lines.append(f"| {r['model']} | {r['label']} | {eng} |{' — |' * 8} {r.get('status')} |")
        for row in r.get("batches") or []:
            cp, d = row.get("compiled_path_ok"), row.get("dynamo_compile", {})
            cps = ("eager" if "tok_s" in row else "—") if cp is None else "ok" if cp else (
                f"BROKEN (breaks {row.get('graph_break_reasons') and sum(row['graph_break_reasons'].values())},"
                f" graphs {d.get('unique_graphs')}, recompiled {row.get('recompiled_after_warmup')},"
                f" cg-skips {d.get('cudagraph_skips')})")  # fmt: skip
            lines.append(f"| {r['model']} | {r['label']} | {eng} | {row['batch']} | {fmt(row.get('tok_s'))} | "
                         f"{fmt(row.get('decode_tok_s'))} | {fmt(row.get('ms_per_step'), 2)} | "
                         f"{fmt(row.get('prefill_s'), 3)} | {fmt(row.get('compile_s'))} | "
                         f"{fmt(row.get('peak_gpu_gb'), 2)} | {cps} | "
                         f"{row.get('status', r.get('status'))} |")  # fmt: skip
    # ratios (--merge tags each result with its run; a ratio across two runs is marked as such)
    by = {(r["model"], r["arm"], row["batch"], r.get("engine", "generate")): (row.get("tok_s"), r.get("run"))
          for r in results for row in r.get("batches", [])}  # fmt: skip

    def ratio(v, key, run) -> str:
        o, orun = by.get(key, (None, None))
        return (f"{v / o:.2f}×" + (" (across runs)" if orun != run else "")) if o and v else "—"

    rat = [f"| {m} | {e} | {b} | {ratio(v, (m, 'bf16', b, e), run)} | {ratio(v, (m, 'qlora', b, e), run)} |"
           for (m, a, b, e), (v, run) in sorted(by.items()) if a == OURS and v]  # fmt: skip
    if rat:
        head = "| model | engine | B | NVFP4+LoRA / bf16+LoRA | NVFP4+LoRA / QLoRA |"
        lines += ["", head, "|---|---|---:|---:|---:|", *rat]
    if spread := spread_table(results):
        lines += ["", spread]
    return "\n".join(lines)


def plot(results: list[dict], path: str | Path, title: str | None) -> Path:
    """Tokens/s against batch size per (model, arm), and NVFP4 + LoRA's ratio to each other arm (:mod:`common.plots`)."""
    return plot_batches(results, path, ARM_LABEL, OURS, "NVFP4 + LoRA", title)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_rollout_arguments(ap, models="7b,14b,32b", batch="1,8", new_tokens=1024, repeats=1, spread_warmups=2)
    ap.add_argument("--arms", default="bf16,qlora,nvfp4", help="comma list of " + ",".join(ARMS))
    ap.add_argument("--compact-min-batch", type=int, default=None,
                    help="graph_generate's compact_min_batch (default: its own, COMPACT_MIN_BATCH)")  # fmt: skip
    ap.add_argument("--engine", default="graph", choices=["graph"], help="graph_generate (generate: rollout.py@e48270c)")
    ap.add_argument("--no-compile", action="store_true", help="eager generate (CPU validation)")
    ap.add_argument("--in-process", action="store_true", help="run arms in this process (debugging)")
    ap.add_argument("--plot", help="also write a PNG of tok/s and NVFP4's ratios against batch size (matplotlib)")
    ap.add_argument("--plot-only", metavar="JSON", help="with --plot: plot this result JSON, run nothing")
    add_arm_arguments(ap, out=str(RESULTS / "rollout.json"), arm_timeout=900.0)
    args = ap.parse_args(argv)

    if args._worker:
        worker_exit(args, run_worker, ARM_LABEL.get(args.arm), batches=[], engine=args.engine)

    if args.plot_only:
        if not args.plot:
            ap.error("--plot-only needs --plot PNG")
        d = json.loads(Path(args.plot_only).read_text())
        print(f"wrote {plot(d['results'], args.plot, run_title(d))}")
        return

    if args.merge:
        meta, results = merge_results(args.merge)
        write_result(args.out, meta, results)
        print(table(results))
        if args.plot:
            print(f"wrote {plot(results, args.plot, 'merged runs')}")
        return

    models, arms = models_and_arms(ap, args, ARMS)
    meta = run_meta("rollout tokens/s, qerl_trl graph_generate, static cache"
                    + ("" if args.no_compile else " + one compiled graph per decode step incl. sampling"),
                    args, models, versions(), skip=("merge", "plot_only"),
                    tok_s_definition="batch * new_tokens / wall time of one generate (prefill included), after "
                    "warm-up; decode_tok_s = batch * (new_tokens-1) / (generate time - prefill+1-token generate time, "
                    "fastest of 3)")  # fmt: skip

    def brief(res: dict) -> str:
        return ", ".join(f"B={r['batch']}: {r.get('tok_s')} tok/s (compile {r.get('compile_s')} s, "
                         f"compiled ok={r.get('compiled_path_ok')})" for r in res.get("batches", []))  # fmt: skip

    results = run_arm_grid("rollout", args, models, arms, meta, ARM_LABEL, brief, lambda rs: with_profile(table(rs), rs),
                           __file__, run_worker, _PASS, _FLAGS, args.in_process,
                           lambda a: dict(batches=[], engine=args.engine))  # fmt: skip
    if args.plot:
        print(f"wrote {plot(results, args.plot, run_title(meta))}")


if __name__ == "__main__":
    main()
