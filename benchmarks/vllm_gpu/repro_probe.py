"""Is our path inside vLLM bitwise reproducible run to run? (open failure: ``test_lora_sync_changes_outputs_like_hf[qerl]``,
the same adapter synced twice, logprobs 0.075-0.113 apart on the H100; ``[native]`` < 1e-5.)

THERE (the device machine, after ``source benchmarks/vllm_gpu/env.sh``), ~2-3 min on one H100:

    python3 benchmarks/vllm_gpu/repro_probe.py                  # every arm below, at once (one process each)
    python3 benchmarks/vllm_gpu/repro_probe.py --arms ops       # only some

Prints one ``CHECK`` line per check (``same=True``: bitwise equal) and ends with ``repro_probe: N checks, M differ``.
The arms, each in its own process (so that vLLM's per-process caches and environment do not leak between them):

* ``ops``: ``NVFP4KernelLinearMethod`` (what vLLM's layers call) on the offline model's linear shapes (hidden 576)
  and two 7B shapes (the warp-specialised kernel), at the row counts vLLM sends (1-8 decode, 42 the test's prefill,
  its CUDA-graph paddings, the large-M and dequantize sizes): the same input twice (eager), a CUDA-graph replay
  against eager, outputs poisoned with NaN against not (an element never written), and the real rows of a batch
  padded with garbage rows against the unpadded call (is a row independent of the rows beside it and of M?).
* ``qerl-eager``, ``native-eager``, ``qerl-graph``, ``native-graph``: a vLLM engine as the test builds it
  (``enforce_eager`` on, or torch.compile + CUDA graphs), greedy on the test's 4 prompts: base twice, an adapter
  synced from a folder and generated three times under the same id, the same tensors synced again under a new id
  (the test's step 2), the prefix cache left on once, base again. The prefix cache is reset before every other
  generate (a hit shortens the prefill, so the prefill's M differs: not like with like).
* ``qerl-eager-shrink1``, ``native-eager-shrink1``: as ``*-eager`` with vLLM's LoRA shrink kernel told to use one K
  split (``VLLM_TUNED_CONFIG_FOLDER``, vLLM's own config hook; the file from :mod:`qerl_vllm.lora_shrink`): its
  default at < 128 rows splits K 64 ways and sums the fp32 partials with ``tl.atomic_add``, in arrival order.

Reading it: ``ops`` all same and ``*-eager`` differing only with LoRA, with ``*-shrink1`` same: vLLM's LoRA shrink
atomics, not our kernels (the test then cannot ask for < 1e-5 without that config). ``ops`` differing: our kernel
(the line names the shape, M and family). ``*-graph`` differing where ``*-eager`` does not: capture vs replay.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("ops", "qerl-eager", "native-eager", "qerl-eager-shrink1", "native-eager-shrink1", "qerl-graph", "native-graph")
# the offline model's linears (SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, intermediate 1536) as vLLM fuses them,
# then two 7B shapes whose table entries are the warp-specialised kernel at M >= 64 (stream-K, and its fixup form)
SHAPES = {
    "qkv": ([576, 192, 192], 576),
    "o": ([576], 576),
    "gate_up": ([1536, 1536], 576),
    "down": ([576], 1536),
    "7b_gate_up": ([18944], 3584),
    "7b_down": ([3584], 18944),
}
ROWS = (1, 2, 3, 4, 5, 8, 16, 24, 32, 42, 48, 64, 96, 128, 200, 256, 512)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 48, 64]  # the graph arms' CUDA-graph sizes (fewer than vLLM's default: start-up)


def check(arm: str, what: str, a, b) -> bool:
    """Print one CHECK line comparing ``a`` with ``b`` (tensors, or lists of (token_ids, logprobs))."""
    import torch

    if isinstance(a, torch.Tensor):
        same = bool(torch.equal(a, b))
        gap = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item() if a.numel() else 0.0
        extra = f"nan={bool(a.isnan().any() or b.isnan().any())}"
    else:
        tokens = [x[0] for x in a] == [x[0] for x in b]
        gap = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x[1], y[1])), default=0.0)
        same = tokens and all(x[1] == y[1] for x, y in zip(a, b))
        extra = f"tokens_equal={tokens}"
    print(f"CHECK arm={arm} {what}: same={same} max_gap={gap:.3g} {extra}", flush=True)
    return same


# ------------------------------------------------------------------------------------------------ the ops arm
def _layer(widths: list[int], k: int, seed: int, device: str):
    """A linear as vLLM hands it to NVFP4KernelLinearMethod: compressed-tensors tensors, one global scale per member
    (all equal, as nvfp4 writes fused layers), then process_weights_after_loading (MMA layout where it applies)."""
    import torch
    from nvfp4.codec import quantize
    from qerl_vllm.quant import NVFP4KernelLinearMethod

    g = torch.Generator(device=device).manual_seed(seed)
    q = quantize(torch.randn(sum(widths), k, device=device, generator=g) * 0.05)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(q.packed, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(q.scale, requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(q.global_scale.reshape(1).repeat(len(widths)), requires_grad=False)
    layer.logical_widths = list(widths)
    layer.nvfp4_dtype = torch.bfloat16
    method = NVFP4KernelLinearMethod()
    method.process_weights_after_loading(layer)
    return method, layer


def _family(m: int, n: int, k: int, mma: bool) -> str:
    from nvfp4.kernels import linear_config

    c = linear_config(m, n, k, mma=mma)
    for name in ("dequant", "ws", "large_m", "gemv"):
        if getattr(c, name):
            return name
    tag = "mma" if c.mma else "tc"
    return f"{tag}_bm{c.block_m}_split{c.split_k}" + ("_fused" if c.mma and c.split_k > 1 and c.fused_reduce else "")


def arm_ops() -> int:
    import torch
    from nvfp4.kernels import nvfp4_gemm

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the reference op, a dry run of this harness
    differ = 0
    shapes = list(SHAPES.items()) if dev == "cuda" else list(SHAPES.items())[:2]
    for i, (name, (widths, k)) in enumerate(shapes):
        method, layer = _layer(widths, k, seed=i, device=dev)
        n = sum(widths)
        rows = ROWS if not name.startswith("7b") else (1, 4, 8, 32, 64, 128, 256, 512)
        rows = rows if dev == "cuda" else (1, 4, 42)
        for m in rows:
            fam = _family(m, n, k, bool(layer.nvfp4_mma_layout))
            tag = f"{name} N={n} K={k} M={m} {fam}"
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y1 = method.apply(layer, x)
            # the same input 20 times (the split-K tickets / stream-K flags under repetition)
            ys = [method.apply(layer, x) for _ in range(20)]
            differ += not check("ops", f"{tag} eager x20 vs first", torch.stack(ys), y1.expand(20, *y1.shape))
            nvfp4_gemm.POISON_OUTPUTS = True
            try:
                differ += not check("ops", f"{tag} NaN-poisoned outputs vs plain", method.apply(layer, x), y1)
            finally:
                nvfp4_gemm.POISON_OUTPUTS = False
            # a padded batch, as a CUDA-graph size pads the real rows (vLLM fills the rest with whatever was there)
            pad = next((s for s in (*CAPTURE_SIZES, 128, 256, 512, 1024) if s > m), 2 * m)
            xp = torch.cat([x, 100 * torch.randn(pad - m, k, device=dev, dtype=torch.bfloat16)])
            fam_pad = _family(pad, n, k, bool(layer.nvfp4_mma_layout))
            what = f"{tag} rows of M={pad} ({'same family' if fam_pad == fam else fam_pad}) padded with garbage vs unpadded"
            differ += not check("ops", what, method.apply(layer, xp)[:m], y1)
            # capture, then replay on the same input after other launches (the graph keeps its workspace addresses)
            if dev != "cuda":
                continue
            xs = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                method.apply(layer, xs)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                yg = method.apply(layer, xs)
            replays = []
            for _ in range(3):
                method.apply(layer, xp)  # something else in between
                graph.replay()
                replays.append(yg.clone())
            differ += not check(
                "ops", f"{tag} CUDA-graph replay x3 vs eager", torch.stack(replays), y1.expand(3, *y1.shape)
            )
            del graph
    left = nvfp4_gemm.splitk_counters_left()
    print(f"CHECK arm=ops split-K tickets / stream-K flags left non-zero: {left} (same={left == 0})", flush=True)
    return differ + (left != 0)


# ------------------------------------------------------------------------------------------------ the engine arms
def _adapter_state(ckpt: Path, rank: int):
    """A non-trivial all-linear adapter for the offline model (PEFT names), bf16-representable as the test's."""
    import torch

    cfg = json.loads((ckpt / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
            "mlp.down_proj": (inter, h)}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        for mod, (fan_in, fan_out) in dims.items():
            p = f"base_model.model.model.layers.{i}.{mod}"
            state[f"{p}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.05).bfloat16().float()
            state[f"{p}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.02).bfloat16().float()
    targets = sorted({m.split(".")[-1] for m in dims})
    return state, targets


def _print_engine_settings(arm: str, eng) -> None:
    """The vLLM settings the hypotheses hinge on (each read defensively: names move between vLLM versions)."""
    import vllm
    from vllm import envs

    def get(f):
        try:
            return f()
        except Exception as e:  # noqa: BLE001 - report whatever this vLLM version lacks
            return f"<{type(e).__name__}: {e}>"

    cfg = get(lambda: eng.llm.llm_engine.vllm_config)
    shrink = get(lambda: __import__("vllm.lora.ops.triton_ops.utils", fromlist=["x"]).get_lora_op_configs)
    settings = {
        "vllm": vllm.__version__,
        "cudagraph_mode": get(lambda: str(cfg.compilation_config.cudagraph_mode)),
        "async_scheduling": get(lambda: cfg.scheduler_config.async_scheduling),
        "prefix_caching": get(lambda: cfg.cache_config.enable_prefix_caching),
        "VLLM_LORA_ENABLE_DUAL_STREAM": get(lambda: envs.VLLM_LORA_ENABLE_DUAL_STREAM),
        "VLLM_BATCH_INVARIANT": get(lambda: envs.VLLM_BATCH_INVARIANT),
        "VLLM_TUNED_CONFIG_FOLDER": os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
        # max_loras + 1 slots, 4 rows (a decode step), K = 576, rank 8, one slice: the split_k used at decode
        "shrink_config_m4_k576": get(
            lambda: dict(shrink("shrink", max_loras=2, batch=4, hidden_size=576, rank=8, num_slices=1))
        ),  # fmt: skip
    }
    print(f"repro_probe: {arm}: {json.dumps(settings, default=str)}", flush=True)


def arm_engine(arm: str) -> int:
    from nvfp4.peft import write_adapter
    from peft import LoraConfig
    from qerl_vllm.engine import VLLMEngine
    from test_vllm_engine import LORA_RANK, N_TOKENS, PROMPTS
    from vllm_test_helpers import nvfp4_offline_checkpoint

    ckpt = nvfp4_offline_checkpoint()
    eager = "eager" in arm
    kw = {} if eager else {"compilation_config": {"cudagraph_capture_sizes": CAPTURE_SIZES}}
    t0 = time.perf_counter()
    eng = VLLMEngine(ckpt, max_lora_rank=LORA_RANK, seed=0, max_model_len=256, kv_cache_memory_bytes=128 << 20,
                     dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.12, **kw)  # fmt: skip
    print(f"repro_probe: {arm}: engine up in {time.perf_counter() - t0:.0f} s, "
          f"{os.environ.get('QERL_VLLM_NVFP4_BACKEND')}, enforce_eager={eager}", flush=True)  # fmt: skip
    _print_engine_settings(arm, eng)
    ids = [eng.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    print(f"repro_probe: {arm}: prompt tokens {[len(i) for i in ids]} (prefill M = {sum(len(i) for i in ids)})")

    def greedy(lora="synced", reset=True):
        if reset:
            eng.llm.reset_prefix_cache()
        outs = eng.generate(ids, {"temperature": 0.0, "max_tokens": N_TOKENS, "min_tokens": N_TOKENS}, lora=lora)
        return [(o.token_ids, o.logprobs) for o in outs]

    differ = 0
    base = greedy(lora=None)
    differ += not check(arm, "base run 2 vs run 1", greedy(lora=None), base)
    state, targets = _adapter_state(ckpt, LORA_RANK)
    config = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_adapter(Path(tmp) / "adapter", state, config)
        eng.sync_lora(folder, version=1)
        first = greedy()
        changed = sum(a[0] != b[0] for a, b in zip(first, base))
        print(f"repro_probe: {arm}: the adapter changed {changed} of {len(base)} completions")
        for r in (2, 3):
            differ += not check(arm, f"lora id 1, run {r} vs run 1 (no re-sync)", greedy(), first)
        eng.sync_lora(state, version=2, peft_config=config)  # the test's step 2: same tensors, a new id
        second = greedy()
        differ += not check(arm, "lora id 2 (same tensors re-synced) vs id 1 run 1 [the test's step 2]", second, first)
        differ += not check(arm, "lora id 2, prefix cache left on (a hit) vs reset", greedy(reset=False), second)
        differ += not check(arm, "base after the adapters vs base run 1", greedy(lora=None), base)
    eng.close()
    return differ


# ------------------------------------------------------------------------------------------------ driver
def _arm_env(arm: str, tmp: Path) -> dict[str, str]:
    env = {**os.environ, "QERL_VLLM_NVFP4_BACKEND": "native" if arm.startswith("native") else "qerl"}
    if arm.endswith("shrink1"):
        env["VLLM_TUNED_CONFIG_FOLDER"] = str(tmp)
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--arm-child", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=420, help="seconds for all arms")
    p.add_argument("--serial", action="store_true", help="one arm after another (default: all at once)")
    a = p.parse_args()
    if a.arm_child:
        return min(1, arm_ops() if a.arm_child == "ops" else arm_engine(a.arm_child))
    arms = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arms {unknown}")
    if any(x != "ops" for x in arms):  # built once here: the arms would race to build it
        sys.path.insert(0, str(ROOT / "tests" / "vllm_integration"))
        from vllm_test_helpers import nvfp4_offline_checkpoint

        print(f"repro_probe: checkpoint {nvfp4_offline_checkpoint()}", flush=True)
    path = os.pathsep.join([str(ROOT / "tests" / "vllm_integration"), os.environ.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if any(x.endswith("shrink1") for x in arms):
            from qerl_vllm.lora_shrink import write_one_split_shrink_config

            write_one_split_shrink_config(tmp)
        procs = {}

        def start(arm: str) -> subprocess.Popen:  # output to files: a full pipe would stall an arm not yet read
            env = {**_arm_env(arm, Path(tmp)), "PYTHONPATH": path}
            out, err = (open(Path(tmp) / f"{arm}.{s}", "w") for s in ("out", "err"))
            return subprocess.Popen([sys.executable, __file__, "--arm-child", arm], env=env, stdout=out, stderr=err)

        if not a.serial:  # all at once on the one GPU (135M model, 128 MiB of KV cache each)
            procs = {arm: start(arm) for arm in arms}
        checks = differ = 0
        for arm in arms:
            proc = procs[arm] if arm in procs else start(arm)
            try:
                proc.wait(timeout=max(1, a.timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                print(f"repro_probe: {arm}: timed out", flush=True)
            out, err = ((Path(tmp) / f"{arm}.{s}").read_text(errors="replace") for s in ("out", "err"))
            lines = [ln for ln in out.splitlines() if ln.startswith(("CHECK", "repro_probe"))]
            print("\n".join(lines), flush=True)
            checks += sum(ln.startswith("CHECK") for ln in lines)
            differ += sum(ln.startswith("CHECK") and "same=False" in ln for ln in lines)
            if proc.returncode not in (0, 1):
                print(f"repro_probe: {arm}: rc={proc.returncode}; stderr tail:\n{err[-3000:]}", flush=True)
    print(f"repro_probe: {checks} checks, {differ} differ ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
