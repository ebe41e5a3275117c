"""Rollout throughput in vLLM (issue #39), beside ``benchmarks/rollout.py``'s graph-engine arms, same shapes and lengths.

Arms (:data:`ARMS`; each in a fresh subprocess, one in-process vLLM ``LLM``, LoRA r=32 as a vLLM adapter, never
merged): ``vllm-bf16``; ``vllm-nvfp4-marlin`` (compressed-tensors NVFP4A16 through stock vLLM, Marlin; CUDA only);
``vllm-nvfp4`` (our ``nvfp4::linear`` kernels); ``vllm-nvfp4-humming`` (vLLM's Humming W4A16; skipped without
``humming``); ``vllm-nvfp4-fp8`` / ``-auto`` (``rollout_precision``, issue #51). Each records ``linear_methods``,
``linear_kernels`` and ``kernel_ok``. Checkpoints (bf16, NVFP4 by RTN of the same random weights, a PEFT adapter)
are built once under ``--ckpt-root``. ``--eos-mean-tokens M``: ``fixed`` and ``eos`` rounds, each request
``max_tokens = min_tokens = L`` from :func:`common.models.spread_lengths`. ``tok/s`` = completion tokens / wall time
of one ``generate``; ``--profile`` as ``rollout.py``'s (``--enforce-eager`` for an eager arm).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import common  # noqa: F401  (the workspace packages on sys.path)
from common.env import RESULTS, ROOT, merge_results, versions
from common.models import build_model, materialize, spread_lengths
from common.profiler import profile_decode, with_profile
from common.rollouts import add_rollout_arguments, fixed_length_row, models_and_arms, prefill_row, spread_summary
from common.shapes import LINEARS, MODELS, meta_model, qwen2_config
from common.tables import fmt
from common.workers import add_run_arguments, run_arm_grid, run_meta, save_partial, worker_exit

if str(ROOT / "integrations" / "vllm" / "src") not in sys.path:  # qerl_vllm, where it is not installed
    sys.path.insert(0, str(ROOT / "integrations" / "vllm" / "src"))

# arm -> (checkpoint, QERL_VLLM_NVFP4_BACKEND or None, label); each + LoRA
ARMS: dict[str, tuple[str, str | None, str]] = {
    "vllm-bf16": ("bf16", None, "vLLM bf16 + LoRA"),
    "vllm-nvfp4-marlin": ("nvfp4", "native", "vLLM NVFP4 + LoRA (stock: Marlin)"),
    "vllm-nvfp4": ("nvfp4", "qerl", "vLLM NVFP4 + LoRA (ours)"),
    "vllm-nvfp4-humming": ("nvfp4", "native", "vLLM NVFP4 + LoRA (stock: Humming)"),
    # rollout_precision (issue #51): the plugin's method, E4M3 copy
    "vllm-nvfp4-fp8": ("nvfp4", "qerl", "vLLM NVFP4 + LoRA (ours, rollout_precision=fp8)"),
    "vllm-nvfp4-auto": ("nvfp4", "qerl", "vLLM NVFP4 + LoRA (ours, rollout_precision=auto)"),
}
ARM_LABEL = {a: label for a, (_, _, label) in ARMS.items()}
# arm -> extra LLM(...) arguments: linear_backend="humming" picks HummingNvFp4LinearKernel (with "auto": Marlin)
_ENGINE_KW: dict[str, dict] = {
    "vllm-nvfp4-humming": {"linear_backend": "humming"},
    **{f"vllm-nvfp4-{p}": {"additional_config": {"qerl_rollout_precision": p}} for p in ("fp8", "auto")},
}
# arm -> the NVFP4 kernel class that must show in linear_kernels for the arm to measure what its name says
_KERNEL = {"vllm-nvfp4-marlin": "MarlinNvFp4LinearKernel", "vllm-nvfp4-humming": "HummingNvFp4LinearKernel"}
CKPT_VERSION = 1  # bump when the checkpoints' recipe changes (a new folder is built)


# ------------------------------------------------------------------------------------------------------ checkpoints
def checkpoints(model_key: str, root: Path, lora_r: int, nvfp4_only: bool = False) -> dict[str, Path]:
    """The bf16 and NVFP4 checkpoints and the adapter of ``model_key`` under ``root`` (built on first use, on the GPU
    if there is one); returns ``{"bf16": dir, "nvfp4": dir, "adapter": dir}``. ``nvfp4_only``: no bf16 checkpoint
    (``{"nvfp4", "adapter"}``); the same NVFP4 tensors written layer by layer (``nvfp4.save_pretrained_by_blocks``)."""
    base = root / f"qwen2-{model_key}-random-v{CKPT_VERSION}"
    paths = {"bf16": base / "bf16", "nvfp4": base / "nvfp4", "adapter": base / f"lora-r{lora_r}"}
    if nvfp4_only:
        del paths["bf16"]
    if all((p / ".done").is_file() for p in paths.values()):
        return paths
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if nvfp4_only:  # the RNG draws of build_model, layer by layer: the 32B never exists in bf16 (disk or memory)
        from nvfp4 import save_pretrained_by_blocks

        model = meta_model(qwen2_config(model_key, architectures=["Qwen2ForCausalLM"]), torch.bfloat16)
        model.generation_config.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
        blocks = [f"model.layers.{i}" for i in range(len(model.model.layers))] + ["model.embed_tokens", "model.norm",
                                                                                "lm_head"]  # fmt: skip
        fill = lambda m: materialize(m, device, torch.bfloat16)  # noqa: E731
        _save(paths["nvfp4"], lambda d: save_pretrained_by_blocks(model, d, blocks, fill))
        _save(paths["adapter"], lambda d: _write_adapter(meta_model(model.config, torch.bfloat16), d, lora_r))
        return paths
    if not (paths["bf16"] / ".done").is_file() or not (paths["adapter"] / ".done").is_file():
        model, _ = build_model(model_key, "bf16-base", device, torch.bfloat16, lora_r=lora_r,
                               lora_dtype=torch.bfloat16, double_quant=False, nvfp4_method="rtn")  # fmt: skip
        model.config.architectures = ["Qwen2ForCausalLM"]
        if not (paths["bf16"] / ".done").is_file():
            _save(paths["bf16"], lambda d: model.save_pretrained(d))
        if not (paths["adapter"] / ".done").is_file():
            _save(paths["adapter"], lambda d: _write_adapter(model, d, lora_r))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not (paths["nvfp4"] / ".done").is_file():
        import nvfp4  # noqa: F401  (registers the transformers quantizer)
        from nvfp4 import NVFP4Config
        from transformers import AutoModelForCausalLM

        q = AutoModelForCausalLM.from_pretrained(paths["bf16"], dtype=torch.bfloat16, device_map=device.type,
                                                 quantization_config=NVFP4Config())  # fmt: skip
        _save(paths["nvfp4"], lambda d: q.save_pretrained(d))
        del q
    return paths


def _save(target: Path, write) -> None:
    """``write(folder)``, then its ``.done``, published as ``target`` by one rename (``nvfp4.offline``'s: a killed
    build leaves no half checkpoint)."""
    import shutil

    from nvfp4.offline import publish_checkpoint

    shutil.rmtree(target, ignore_errors=True)  # callers build what has no .done: a folder there is stale

    def save(folder: Path) -> None:
        write(folder)
        (folder / ".done").write_text("")

    publish_checkpoint(target, save)


def _write_adapter(model, folder: Path, r: int) -> None:
    """A PEFT LoRA adapter (r, alpha 2r, the 7 linears of every layer) with random A and non-zero random B, as a
    trained adapter is (PEFT starts B at zero, which vLLM would still compute)."""
    import torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(LINEARS),
                     bias="none", task_type="CAUSAL_LM")  # fmt: skip
    peft_model = get_peft_model(model, cfg, autocast_adapter_dtype=False)
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                std = 0.02 if "lora_B" in n else 1.0 / p.shape[1] ** 0.5
                w = (torch.randn(p.shape, generator=g) * std).to(p.dtype)
                if p.is_meta:  # a meta model (nvfp4_only): only the adapter's tensors exist, on the CPU
                    peft_model.get_submodule(n.rpartition(".")[0]).weight = torch.nn.Parameter(w, requires_grad=False)
                else:
                    p.copy_(w)
    peft_model.save_pretrained(folder)
    peft_model.unload()


# ---------------------------------------------------------------------------------------------------------- worker
def run_arm(args) -> dict:
    """One arm in this process: its ``LLM``, then per batch the warm-ups, the prefill and the timed rollouts."""
    ckpt_kind, backend, _ = ARMS[args.arm]
    engine_kw = _ENGINE_KW.get(args.arm, {})
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine, as the trainer runs it
    if backend:
        os.environ["QERL_VLLM_NVFP4_BACKEND"] = backend
    import torch

    res: dict = {"model": args.model, "arm": args.arm, "engine": "vllm", "backend": backend, "batches": [],
                 "label": ARM_LABEL[args.arm].replace("+ LoRA", "(no adapter)") if args.no_adapter else ARM_LABEL[args.arm]}
    if engine_kw:
        res["engine_kw"] = engine_kw
    cuda = torch.cuda.is_available()
    humming = engine_kw.get("linear_backend") == "humming"
    if humming:
        res["humming"] = _humming_version(load=cuda)
    if backend == "native" and not cuda:
        kernels = "Humming kernel (linear_backend=humming) needs" if humming else "kernels (Marlin) need"
        res["status"] = f"skipped: stock vLLM's NVFP4 {kernels} CUDA"
        return res
    if humming and not res["humming"].startswith("humming-kernels "):
        res["status"] = f"skipped: humming-kernels is not importable here ({res['humming']})"
        return res
    paths = checkpoints(args.model, Path(args.ckpt_root), args.lora_r)
    from qerl_vllm.lora_tiles import apply_lora_tiles
    from qerl_vllm.plugin import register

    if args.lora_tiles == "tuned" or (args.lora_tiles == "shipped" and backend == "qerl"):
        apply_lora_tiles("tuned")  # as VLLMEngine does (a folder already set wins)
    res["lora_tiles_folder"] = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    register()  # also the entry point's job; explicit where the plugin is on PYTHONPATH only
    kw: dict = dict(model=str(paths[ckpt_kind]), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                    max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=max(args.batch),
                    enable_prefix_caching=False, **engine_kw,
                    **({} if args.no_adapter else dict(enable_lora=True, max_lora_rank=args.lora_r, max_loras=1)))
    if cuda:
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    else:
        kw.update(kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res["init_s"] = round(time.perf_counter() - t0, 2)
    res.update(llm.apply_model(_linear_quant)[0])
    if kernel := _KERNEL.get(args.arm):  # e.g. Humming asked for but Marlin ran: Marlin's numbers
        res["kernel_ok"] = any(k.endswith(":" + kernel) for k in res["linear_kernels"])
    lora = None if args.no_adapter else LoRARequest("bench-adapter", 1, str(paths["adapter"]))
    vocab = MODELS[args.model]["vocab_size"]
    n, p = args.new_tokens, args.prompt_len

    def generate(prompts, params) -> tuple[float, list[list[int]]]:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    def fixed_params(tokens: int, **over):
        return SamplingParams(**{"temperature": 0.0, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                                 "detokenize": False, **over})  # fmt: skip

    for b in args.batch:
        row: dict = {"batch": b}
        res["batches"].append(row)
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, p), generator=g).tolist()
        prompts = [TokensPrompt(prompt_token_ids=x) for x in ids]
        try:
            row["warmup_s"] = [round(generate(prompts, fixed_params(args.warmup_tokens))[0], 3) for _ in range(2)]
            row.update(prefill_row(lambda ps=prompts: generate(ps, fixed_params(1))[0]))
            if args.eos_mean_tokens:
                row.update(_spread(args, generate, prompts, vocab, SamplingParams))
            else:
                times, lengths = [], []
                for _ in range(args.repeats):
                    dt, toks = generate(prompts, fixed_params(n))
                    times.append(dt)
                    lengths = [len(t) for t in toks]
                row.update(fixed_length_row(times, b, n, row["prefill_s"], toks), new_tokens_generated=max(lengths),
                           length_ok=all(x == n for x in lengths))  # fmt: skip
            if args.profile:
                row["profile"] = profile_decode(lambda k, ps=prompts: generate(ps, fixed_params(k))[0], cuda, min(16, n - 1))
        except torch.OutOfMemoryError as e:
            row["status"] = f"does not fit: OOM at batch {b} ({str(e).splitlines()[0][:200]})"
            break
        if cuda:
            row["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        save_partial(args, res)
    res["status"] = "ok" if all("status" not in r for r in res["batches"]) else "partial"
    if res.get("kernel_ok") is False:
        res["status"] += f" (but {kernel} did not run: {res['linear_kernels']})"
    return res


def _humming_version(load: bool) -> str:
    """``"humming-kernels X"`` where vLLM's Humming kernels can load, else why not. ``load``: import it (on CUDA;
    the import starts humming's background JIT builds of its launcher), else only look for the package."""
    import importlib.metadata as md
    import importlib.util

    try:
        version = md.version("humming-kernels")
    except md.PackageNotFoundError:
        return "not installed (package humming-kernels, module humming)"
    if importlib.util.find_spec("humming") is None:
        return f"humming-kernels {version} is installed without its module humming"
    if not load:
        return f"humming-kernels {version} (installed; not imported off CUDA)"
    try:
        import humming  # noqa: F401  (needs cuda-bindings, pyelftools, nvidia-ml-py, filelock, jinja2)
    except Exception as e:  # noqa: BLE001 (any import failure is the arm's reason to skip)
        return f"import humming failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return f"humming-kernels {version}"


def _linear_quant(model) -> dict[str, list[str]]:
    """``linear_methods``: the quantize-method classes of the engine model's linears (LoRA wrappers looked through);
    ``linear_kernels``: ``scheme:kernel`` class names where ``layer.scheme`` or the method holds a kernel object."""
    methods, kernels = set(), set()
    for m in model.modules():
        base = getattr(m, "base_layer", m)
        qm = getattr(base, "quant_method", None)
        if qm is None:
            continue
        methods.add(type(qm).__name__)
        for holder in (getattr(base, "scheme", None), qm):
            kernel = getattr(holder, "kernel", None) if holder is not None else None
            if kernel is not None and not isinstance(kernel, (str, int, float)):
                kernels.add(f"{type(holder).__name__}:{type(kernel).__name__}")
    return {"linear_methods": sorted(methods), "linear_kernels": sorted(kernels)}


def _spread(args, generate, prompts, vocab: int, SamplingParams) -> dict:  # noqa: N803 (vllm's class, passed in)
    """``--eos-mean-tokens``: per round ``fixed`` and ``eos`` (see the module doc), the same seeds for both."""
    n = args.new_tokens
    drawn = spread_lengths(len(prompts), args.eos_mean_tokens, args.min_new_tokens, n)

    def params(variant: str, seed: int):
        return [SamplingParams(temperature=1.0, max_tokens=length, min_tokens=length, ignore_eos=True,
                               detokenize=False, seed=seed * 100_003 + i)  # fmt: skip
                for i, length in enumerate([n] * len(prompts) if variant == "fixed" else drawn)]  # fmt: skip

    for w in range(args.spread_warmups):
        generate(prompts, params("eos", 1000 + w))
    rounds: dict[str, list[dict]] = {"fixed": [], "eos": []}
    for r in range(args.repeats):
        for v in rounds:
            dt, toks = generate(prompts, params(v, r))
            lengths = [len(t) for t in toks]
            rounds[v].append({"s": dt, "tokens": sum(lengths), "lengths": lengths})
    return {"lengths": "common.models.spread_lengths", "spread": spread_summary(rounds)}


# ---------------------------------------------------------------------------------------------------------- tables
def table(results: list[dict]) -> str:
    """Fixed-length rows of vLLM and graph-engine results (``rollout.py`` JSON rows too) and the goals' ratios
    (vLLM + our kernel over vLLM bf16 + LoRA, vLLM + Marlin and vLLM + Humming, within one run only)."""
    lines = ["| model | engine | arm | B | tok/s | decode tok/s | ms/step | prefill s | status |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    by: dict[tuple, tuple[float, int]] = {}
    for r in results:
        for row in r.get("batches", []):
            if (v := row.get("tok_s")) is not None:
                by[(r["model"], r.get("engine", "generate"), r["arm"], row["batch"])] = (v, r.get("run", 0))
                lines.append(f"| {r['model']} | {r.get('engine', 'generate')} | {r.get('label', r['arm'])} | "
                             f"{row['batch']} | {fmt(v)} | {fmt(row.get('decode_tok_s'))} | "
                             f"{fmt(row.get('ms_per_step'), 2)} | {fmt(row.get('prefill_s'), 3)} | "
                             f"{row.get('status', r.get('status'))} |")  # fmt: skip
    rat = [f"| {m} | {b} | " + " | ".join(f"{v / o[0]:.2f}×" if (o := by.get((m, e, other, b))) and o[1] == run else "—"
                                           for other in ("vllm-bf16", "vllm-nvfp4-marlin", "vllm-nvfp4-humming")) + " |"
           for (m, e, a, b), (v, run) in sorted(by.items()) if a == "vllm-nvfp4"]  # fmt: skip
    if rat:
        lines += ["", "| model | B | vLLM ours / vLLM bf16 + LoRA | vLLM ours / vLLM Marlin | vLLM ours / vLLM Humming |",
                  "|---|---:|---:|---:|---:|", *rat]  # fmt: skip
    spread = [(r, row) for r in results for row in r.get("batches", []) if "spread" in row]
    if spread:
        lines += ["", "| model | engine | arm | B | fixed tok/s | EOS tok/s | mean / max len |",
                  "|---|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r, row in spread:
        sp = row["spread"]
        eos = sp.get("eos+compact", sp.get("eos"))  # the graph engine's compaction = vLLM's continuous batching
        lines.append(f"| {r['model']} | {r.get('engine', 'generate')} | {r.get('label', r['arm'])} | {row['batch']} "
                     f"| {fmt(sp['fixed']['tok_s'])} | {fmt(eos['tok_s'])} | {eos['mean_len']} / {eos['max_len']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- driver
_PASS = ("batch", "prompt_len", "new_tokens", "warmup_tokens", "repeats", "eos_mean_tokens", "min_new_tokens",
         "spread_warmups", "ckpt_root", "lora_tiles")  # fmt: skip
_FLAGS = ("enforce_eager", "profile", "no_adapter")


#: settings read from the environment that change what a run measures (the JSON's ``env``): vLLM's LoRA tiles, the
#: NVFP4 backend
_RECORDED_ENV = ("VLLM_TUNED_CONFIG_FOLDER", "QERL_VLLM_NVFP4_BACKEND")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_rollout_arguments(ap, models="7b", batch="8,32,64,128", new_tokens=256, repeats=2, spread_warmups=1)
    ap.add_argument("--arms", default="vllm-bf16,vllm-nvfp4-marlin,vllm-nvfp4,vllm-nvfp4-humming",
                    help="comma list of " + ",".join(ARMS))  # fmt: skip
    ap.set_defaults(lora_r=32, gpu_memory_utilization=0.85)  # every committed run's (options no run set left, #48)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (diagnostics)")
    ap.add_argument("--no-adapter", action="store_true", help="no LoRA at all: the arm's ceiling (#51 item 3)")
    ap.add_argument("--lora-tiles", choices=("shipped", "stock", "tuned"), default="shipped",
                    help="vLLM's LoRA kernel tiles: each arm as it ships (ours tuned, stock vLLM's own), all vLLM's, "
                         "all tuned (qerl_vllm.lora_tiles)")  # fmt: skip
    ap.add_argument("--ckpt-root", default=os.environ.get("QERL_CACHE", "/tmp/qerl-cache") + "/rollout_vllm")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print one table of these result files, run nothing")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoints of --models and stop")
    ap.add_argument("--nvfp4-only", action="store_true", help="with --build-only: NVFP4 + adapter only, layer by layer")
    add_run_arguments(ap, out=str(RESULTS / "rollout_vllm.json"), arm_timeout=900.0)
    ap.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._build:
        for kind, path in checkpoints(args.model, Path(args.ckpt_root), args.lora_r, args.nvfp4_only).items():
            print(f"[{args.model}] {kind}: {path}", flush=True)  # machine_e.sh reads the nvfp4 line
        return
    if args._worker:
        worker_exit(args, run_arm, ARM_LABEL.get(args.arm), engine="vllm", batches=[])  # exits (skips vLLM's teardown)

    if args.table:  # rows of different files are different runs (tagged with their file): no ratio across them
        rows = merge_results(args.table)[1]
        print(with_profile(table(rows), rows))
        return

    models, arms = models_and_arms(ap, args, ARMS)
    t_start, checkpoint_s = time.perf_counter(), {}
    for m in models:  # the checkpoints first, in a process of their own (the arms' GPU memory stays vLLM's)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_build", "--model", m, "--ckpt-root",
                            args.ckpt_root, *["--nvfp4-only"] * args.nvfp4_only])  # fmt: skip
        if p.returncode:
            sys.exit(f"building the {m} checkpoints failed (rc={p.returncode})")
        checkpoint_s[m] = round(time.perf_counter() - t0, 1)
        print(f"[{m}] checkpoints ready in {checkpoint_s[m]} s", flush=True)
    if args.build_only:
        return
    import vllm

    meta = run_meta("rollout tokens/s, vLLM (LLM.generate, colocated engine), LoRA as a vLLM adapter", args, models,
                    {**versions(), "vllm": vllm.__version__}, skip=("table",), checkpoint_s=checkpoint_s,
                    env={k: os.environ[k] for k in _RECORDED_ENV if k in os.environ})  # fmt: skip

    def brief(res: dict) -> str:
        tok_s = ", ".join(f"B={r['batch']}: {r.get('tok_s', r.get('spread', {}).get('eos', {}).get('tok_s'))} tok/s"
                          for r in res.get("batches", []))  # fmt: skip
        return f"init {res.get('init_s')} s, {res.get('linear_methods')}, {res.get('linear_kernels')}; {tok_s}"

    run_arm_grid("rollout_vllm", args, models, arms, meta, ARM_LABEL, brief, lambda rs: with_profile(table(rs), rs),
                 __file__, run_arm, _PASS, _FLAGS, defaults=lambda a: dict(engine="vllm", batches=[]),
                 t_start=t_start)  # fmt: skip


if __name__ == "__main__":
    main()
