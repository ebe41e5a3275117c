"""The frozen dispatch table and the tooling that writes it (``benchmarks/gemm.py --apply-table``), on CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gemm_module():
    spec = importlib.util.spec_from_file_location("gemm_bench", ROOT / "benchmarks" / "gemm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gemm_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_table_entry_is_a_valid_config():
    """Each entry of the committed table turns into a config the launcher accepts for its shape: the
    warp-specialised kernel only where its tiles divide N, K in whole 256-input tiles."""
    from nvfp4.kernels import dispatch_table, nvfp4_gemm

    for (n, k), row in dispatch_table.FORWARD.items():
        for m, entry in row.items():
            cfg = nvfp4_gemm.entry_config(entry, m, n, k)
            assert cfg.mma
            if cfg.ws:
                assert n % cfg.block_n == 0 and k % 256 == 0 and cfg.block_m in (64, 128, 256), (n, k, m, entry)
                assert cfg.sub in (1, 2) and 3 <= cfg.num_stages <= 12


def test_table_source_takes_the_fastest_form_per_shape_and_size():
    gemm = _gemm_module()
    ws = dict(block_m=128, block_n=128, num_stages=8, sub=2, ws=True, dequant=False, large_m=False)
    old = dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=1, ws=False, dequant=False,
               large_m=True)  # fmt: skip
    rows = [dict(N=256, K=512, M=128, ours_ms=1.0, config=old), dict(N=256, K=512, M=128, ours_ms=0.5, config=ws),
            dict(N=256, K=512, M=256, ours_ms=0.7, config=dict(ws, dequant=True)),
            dict(N=256, K=512, M=16, ours_ms=0.1, config=old)]  # fmt: skip
    src = gemm.dispatch_table_source({"forward": rows})
    table = eval("{" + src + "}")  # the printed body is a dict literal's items
    assert table == {(256, 512): {128: ("ws", 128, 2, 8, 2), 256: "dequant"}}  # M <= 16: the decode kernel's own


def test_ws_candidates_only_where_the_kernel_applies():
    gemm = _gemm_module()
    assert gemm.ws_candidate(32, 18944, 3584) is None  # the decode kernel's sizes
    assert gemm.ws_candidate(128, 18944 + 64, 3584) is None  # N not a multiple of 128
    cfg = gemm.ws_candidate(128, 18944, 3584)
    assert cfg.ws and cfg.block_m == 128 and cfg.block_n == 128


def test_out_folder_is_made_before_the_first_partial_json(tmp_path, monkeypatch):
    """``--out`` a folder nobody made (a bg.sh job's ``$JOB_OUT/h19``): the tables and the sweep write their partial
    JSON there after the first linear, so ``main`` makes it before timing anything (it ended the 4e1d05a run's
    ``--scale-pairs`` first try after minutes of measurements)."""
    gemm = _gemm_module()
    out = tmp_path / "job" / "h19"

    def tables(models, fwd_ms, bwd_ms, partial, *rest):
        partial.write_text("{}")  # as run_tables after its first linear
        return {"forward": [], "backward": []}

    def sweep(models, fwd_ms, bwd_ms, deadline, partial):
        partial.write_text("{}")
        return {"forward": [], "backward": []}

    monkeypatch.setattr(gemm, "run_tables", tables)
    monkeypatch.setattr(gemm, "run_sweep", sweep)
    monkeypatch.setattr(gemm, "env_info", dict)  # no GPU here
    monkeypatch.setattr(gemm, "print_tables", lambda res: None)
    monkeypatch.setattr(gemm, "__file__", str(tmp_path / "bench" / "gemm.py"))  # its results/ copy: not the repo's
    for argv, name in (([], "gemm.json"), (["--sweep"], "gemm_sweep.json")):
        monkeypatch.setattr(sys, "argv", ["gemm.py", "--models", "Qwen2.5-7B", "--out", str(out / name), *argv])
        gemm.main()
        assert (out / name / name).is_file()


def test_interleaved_balances_place_and_predecessor():
    """``common.timing.interleaved`` (gemm.py's arms): by default one Williams design, each arm in each place equally
    often and after each other arm equally often (3 arms: 6 rounds; 4 arms: 4), every figure kept in the arm's order
    of rounds; a fixed ``rounds`` runs that many."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common.timing import balanced_orders, interleaved

    order: list[str] = []
    arms = {name: (lambda name=name: order.append(name) or float(len(order))) for name in ("ours", "bf16", "peer")}
    runs = interleaved(arms)
    assert order[:6] == ["ours", "bf16", "peer", "bf16", "peer", "ours"] and len(order) == 18
    assert runs["ours"] == [1.0, 6.0, 8.0, 12.0, 13.0, 17.0]
    for n in range(1, 9):
        rows = balanced_orders(n)
        assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n)
        assert all(sorted(r) == list(range(n)) for r in rows)
        for place in range(n):  # each arm in each place equally often
            assert len({sum(r[place] == a for r in rows) for a in range(n)}) == 1
        pairs = [(r[i], r[i + 1]) for r in rows for i in range(n - 1)]  # each arm after each other equally often
        assert len({pairs.count((a, b)) for a in range(n) for b in range(n) if a != b} or {0}) == 1
    assert [len(v) for v in interleaved(arms, rounds=2).values()] == [2, 2, 2]
