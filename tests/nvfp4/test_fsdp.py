"""FSDP2 (``fully_shard``) of NVFP4 / MXFP4 + LoRA models: 2 CPU processes over gloo against the unsharded model.

Each rank builds the same random tiny Llama, quantizes it, adds LoRA (random ``B`` so that every adapter gets a
gradient) and keeps an unsharded copy. The copy runs forward + backward on the whole batch (with AQN noise on the
norms); the other is sharded by :func:`nvfp4.fsdp.fully_shard_quantized` (4-bit weights, one group per decoder
layer), then ``fully_shard`` per decoder layer and at the root (what accelerate's FSDP2 does), and runs the same
step on half the batch per rank. Checked: every quantized weight gathered from the shards is bit-identical to the
unsharded one (on random codes and scales), each rank holds half the rows, the loss (averaged over ranks) and every
LoRA gradient (FSDP2's reduce-scatter averages them) equal the unsharded ones to float tolerance.

This file is also the worker: ``python tests/nvfp4/test_fsdp.py FORMAT OUT_JSON``.
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

WORLD = 2
BATCH, SEQ = 4, 12


def _tiny_model(fmt: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import nvfp4
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig
    from tiny_models import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", num_hidden_layers=2)).float()
    with torch.no_grad():  # norms away from 1 so that AQN's noise is not the only thing they hold
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    nvfp4.quantize_model(model, progress=False, format=fmt)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _worker(rank: int, port: int, fmt: str, out: str) -> None:
    import copy

    import torch.distributed as dist
    from aqn import NormNoise
    from nvfp4 import NVFP4Linear
    from nvfp4.fsdp import fully_shard_quantized, gathered_quantized_weight
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _tiny_model(fmt)
        ref = copy.deepcopy(model)
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        sigma, seed, step = 0.05, 7, 3

        # the unsharded reference: whole batch, AQN on
        with NormNoise(ref.base_model.model).apply(sigma, seed=seed, step=step):
            ref_loss = _loss(ref, ids)
            ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
        ref_layers = {n: m for n, m in ref.named_modules() if isinstance(m, NVFP4Linear)}

        mesh = init_device_mesh("cpu", (WORLD,))
        noise = NormNoise(model.base_model.model)  # built before sharding, as the trainer does
        groups = fully_shard_quantized(model, mesh=mesh)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        # gathered weights are bit-identical; each rank holds its rows
        layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
        assert layers.keys() == ref_layers.keys() and len(layers) == 14
        identical, local_rows = 0, set()
        for name, layer in layers.items():
            got, want = gathered_quantized_weight(layer), ref_layers[name].quantized_weight
            for a, b in ((got.packed, want.packed), (got.scale, want.scale)):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
            if fmt == "nvfp4":
                assert torch.equal(got.global_scale, want.global_scale)
            stored = layer.stored("weight_packed")
            local_rows.add(stored.to_local().shape[0] / layer.out_features)
            identical += 1

        with noise.apply(sigma, seed=seed, step=step):
            loss = _loss(model, ids[rank * BATCH // WORLD : (rank + 1) * BATCH // WORLD])
            loss.backward()
        restored = all(torch.equal(noise.params[n].full_tensor(), p.detach()) for n, p in
                       NormNoise(ref.base_model.model).params.items())  # fmt: skip
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= WORLD

        diffs = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                diffs[name] = (p.grad.full_tensor() - ref_grads[name]).abs().max().item()
                torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mean_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        assert restored, "AQN did not restore the sharded norms exactly"
        if rank == 0:
            Path(out).write_text(json.dumps({
                "groups": groups, "layers": identical, "local_row_fractions": sorted(local_rows),
                "loss": mean_loss.item(), "ref_loss": ref_loss.item(), "lora_grads": len(diffs),
                "max_grad_diff": max(diffs.values()), "max_ref_grad": max(g.abs().max().item() for g in ref_grads.values()),
            }))  # fmt: skip
    finally:
        from ports import end_process_group

        end_process_group()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fsdp2_sharded_step_equals_unsharded(fmt, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, fmt, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(fmt, result)
    assert result["groups"] == 2  # one FSDP group per decoder layer for its 7 quantized projections
    assert result["layers"] == 14 and result["lora_grads"] == 28
    assert result["local_row_fractions"] == [0.5]
    assert result["max_grad_diff"] <= 1e-4 * result["max_ref_grad"]


def test_shardable_layer_matches_buffers_and_keeps_dtypes():
    """One process, no sharding: the converted layer computes the same outputs and input gradients as the buffer one,
    keeps its state dict (names, dtypes, bytes), and ``.to(dtype)`` casts neither the codes nor the scales."""
    import copy

    import nvfp4
    from nvfp4.fsdp import ShardableNVFP4Linear, make_shardable

    for fmt in ("nvfp4", "mxfp4"):
        torch.manual_seed(2)
        layer = nvfp4.NVFP4Linear.from_linear(nn.Linear(64, 48, bias=True), format=fmt)
        conv = make_shardable(copy.deepcopy(layer))
        assert isinstance(conv, ShardableNVFP4Linear) and conv.weight_packed.dtype == torch.uint8
        assert not any(p.requires_grad for p in conv.parameters())
        assert "weight_global_scale" in dict(conv.named_buffers())
        x = torch.randn(5, 64, requires_grad=True)
        y_ref = layer(x)
        (g_ref,) = torch.autograd.grad(y_ref.sum(), x)
        y = conv(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
        sd_ref, sd = layer.state_dict(), conv.state_dict()
        assert sd.keys() == sd_ref.keys()
        for k in sd:
            assert sd[k].dtype == sd_ref[k].dtype and torch.equal(sd[k].view(torch.uint8), sd_ref[k].view(torch.uint8))
        fresh = make_shardable(nvfp4.NVFP4Linear.from_linear(nn.Linear(64, 48, bias=True), format=fmt))
        if fmt == "nvfp4":
            fresh.load_state_dict(sd_ref)  # byte for byte into the stored views
            assert torch.equal(fresh(x.detach()), y_ref.detach())
        else:
            with pytest.raises(ValueError, match="before nvfp4.fsdp.make_shardable"):
                fresh.load_state_dict(sd_ref)
        scale_dtype = layer.weight_scale.dtype
        conv.to(torch.bfloat16)
        assert conv.weight_scale.dtype == scale_dtype
        assert conv.weight_packed.dtype == torch.uint8
        assert torch.equal(conv(x.detach().bfloat16()), layer.to(torch.bfloat16)(x.detach().bfloat16()))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ports import free_port

    mp.spawn(_worker, args=(free_port(), sys.argv[1], sys.argv[2]), nprocs=WORLD)


def test_the_public_functions_have_type_hints():
    """``fully_shard_quantized(model, *, mesh=None, ..., offload_policy=None)`` left ``mesh`` and ``offload_policy``
    unannotated: what a DeviceMesh / OffloadPolicy argument takes was in the docstring only."""
    import inspect

    import nvfp4.fsdp

    sig = inspect.signature(nvfp4.fsdp.fully_shard_quantized)
    assert [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty] == []
