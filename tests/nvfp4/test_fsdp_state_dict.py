"""FSDP2 state dicts of sharded NVFP4 / MXFP4 layers: 3 gloo CPU processes, rows not divisible by the world size
(one layer with fewer rows than ranks). The sharded state dict (what DCP saves, and what a full state dict gathers) must hold the
unsharded layer's bytes in its dtypes and shapes (the FP8 scales as FP8: gloo cannot all-gather FP8, so the test
gathers the sharded one as bytes), and loading it into another sharded model must give them back exactly.

This file is also the worker: ``python tests/nvfp4/test_fsdp_state_dict.py FORMAT OUT_JSON``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

WORLD = 3
OUT_FEATURES = (40, 2)  # 40 rows over 3 ranks is uneven; 2 rows leave a rank empty


def _model(fmt: str, seed: int) -> nn.Module:
    import nvfp4

    torch.manual_seed(seed)
    layers = [nvfp4.NVFP4Linear.from_linear(nn.Linear(64, out, bias=False), format=fmt) for out in OUT_FEATURES]
    return nn.ModuleDict({"layers": nn.ModuleList(layers)})


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _worker(rank: int, port: int, fmt: str, out: str) -> None:
    import torch.distributed as dist
    from nvfp4.fsdp import fully_shard_quantized, gathered_quantized_weight
    from nvfp4.sharded import gather_bytes
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        ref = _model(fmt, seed=0)
        want = ref.state_dict()
        model = _model(fmt, seed=0)
        fully_shard_quantized(model, mesh=mesh)
        checked = []

        for i, layer in enumerate(model["layers"]):  # gathered weights: bit-identical, uneven or empty shards
            got, exp = gathered_quantized_weight(layer), ref["layers"][i].quantized_weight
            assert torch.equal(_bytes(got.packed), _bytes(exp.packed)) and got.scale.dtype == exp.scale.dtype, i
            assert torch.equal(_bytes(got.scale), _bytes(exp.scale)), i
        checked.append("gathered")

        sharded = get_model_state_dict(model)  # what DCP saves: each rank's rows, the whole tensor's dtype and shape
        assert sharded.keys() == want.keys(), (sorted(sharded), sorted(want))
        for k, v in want.items():
            t = sharded[k]
            assert t.dtype == v.dtype and t.shape == v.shape, (k, t.dtype, v.dtype, t.shape, v.shape)
            whole = gather_bytes(t).view(v.dtype) if hasattr(t, "full_tensor") else t  # gloo: no FP8 all-gather
            assert torch.equal(_bytes(whole), _bytes(v)), k
        checked.append("sharded_state_dict")

        if fmt == "mxfp4":  # MXFP4 tensors load before make_shardable (transcoded on load; test_fsdp.py checks it)
            if rank == 0:
                Path(out).write_text(json.dumps(checked))
            return
        fresh = _model(fmt, seed=1)  # other weights, then the reference's loaded into its shards
        fully_shard_quantized(fresh, mesh=mesh)
        set_model_state_dict(fresh, sharded)  # DCP's load: each rank's rows (gloo cannot scatter a full FP8 tensor)
        for i, layer in enumerate(fresh["layers"]):
            got, exp = gathered_quantized_weight(layer), ref["layers"][i].quantized_weight
            assert torch.equal(_bytes(got.packed), _bytes(exp.packed)), i
            assert torch.equal(_bytes(got.scale), _bytes(exp.scale)), i
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
        for i, layer in enumerate(fresh["layers"]):
            torch.testing.assert_close(layer(x), ref["layers"][i](x), rtol=0, atol=0)
        checked.append("load_sharded_state_dict")
        if rank == 0:
            Path(out).write_text(json.dumps(checked))
    finally:
        from ports import end_process_group

        end_process_group()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sharded_state_dicts_round_trip_exactly(fmt, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, fmt, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = ["load_sharded_state_dict"] if fmt == "nvfp4" else []
    assert json.loads(out.read_text()) == ["gathered", "sharded_state_dict", *loaded]


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ports import free_port

    mp.spawn(_worker, args=(free_port(), sys.argv[1], sys.argv[2]), nprocs=WORLD)
