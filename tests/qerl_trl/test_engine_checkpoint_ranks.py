"""The colocated vLLM engine's checkpoint with several trainer processes: rank 0 saves it, every rank takes the one
barrier, whenever it gets there (2 CPU processes, gloo).

Rank 1 asks for the checkpoint only once rank 0 has written it, the order that made ``qerl train`` under FSDP2 with a
tensor-parallel engine hang now and then (``tests/vllm_integration/test_vllm_fsdp2_tp.py``): rank 1 found the folder,
skipped the barrier rank 0 was waiting in, and the next collectives paired up wrongly. Both ranks then meet in one
``all_gather_object``; with a rank short of a barrier, gloo's 30 s timeout fails the worker instead.

This file is also the worker: ``python tests/qerl_trl/test_engine_checkpoint_ranks.py RANK STORE CACHE_DIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(rank: int, store: str, cache_dir: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "tests"))
    from qerl_trl.quantization import get_scheme
    from qerl_trl.rollout.vllm import engine_checkpoint
    from tiny_models import tiny_config
    from transformers import LlamaForCausalLM

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config("llama"))
        if rank == 1:  # only after rank 0 has written the checkpoint
            while not any(Path(cache_dir).glob("*/config.json")):
                time.sleep(0.05)
        path = engine_checkpoint(None, model, get_scheme("none"), cache_dir=cache_dir)
        paths: list = [None, None]
        dist.all_gather_object(paths, path)  # the next collective: both ranks took the same ones before it
        print(json.dumps({"rank": rank, "paths": paths}))
    finally:
        from ports import end_process_group

        end_process_group()


def test_every_rank_takes_the_checkpoint_barrier_when_the_checkpoint_is_already_there(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "{rank}", str(tmp_path / "store"), str(tmp_path / "engine-ckpt")]
    procs = [subprocess.Popen([a.format(rank=r) for a in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0]["paths"] == results[1]["paths"] and len(set(results[0]["paths"])) == 1
    assert (Path(results[0]["paths"][0]) / "config.json").is_file()


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2], sys.argv[3])
