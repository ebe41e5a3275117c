"""What a vLLM engine is handed for a policy sharded by FSDP2: 2 CPU processes (gloo) against the unsharded policy.

Each rank builds the same tiny NVFP4 + LoRA Llama (random ``B``, norms away from 1) and keeps an unsharded copy, then
shards the other as accelerate's FSDP2 does (:func:`nvfp4.fsdp.fully_shard_quantized`, ``fully_shard`` per decoder
layer and at the root), so its LoRA parameters and RMSNorm weights are ``DTensor`` shards. Checked, on both ranks:

* the adapter :meth:`~qerl_trl.rollout.vllm._VLLMGeneration.sync_weights` pushes
  (:func:`~qerl_trl.rollout.vllm.adapter_state`: gathered whole) is bit-identical to the unsharded policy's, key for key;
* the AQN-noised norm weights the engine is handed (``AQNController.rollout(policy, step, engine=...)`` through
  :meth:`~qerl_trl.rollout.vllm._VLLMGeneration.set_norm_weights`: the controller's draw on the shards, gathered
  whole) are bit-identical to the ones the same controller hands over for the unsharded policy, and differ from the
  clean weights; the policy's own norms are untouched;
* a process that pushes nothing (server mode's non-main ranks) still takes part in the gathers and keeps nothing.

The engine itself is the one part not run here (no vLLM in this environment): :class:`_Recording` keeps what
``_push_norms`` / ``_sync_lora`` would write into it. ``tests/vllm_integration/test_vllm_fsdp2_tp.py`` runs the real
tensor-parallel engine under ``qerl train``.

This file is also the worker: ``python tests/qerl_trl/test_vllm_fsdp2_push.py OUT_JSON``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD = 2
REPO = Path(__file__).resolve().parents[2]


def _tiny_policy():
    sys.path.insert(0, str(REPO / "tests"))
    import nvfp4
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig
    from tiny_models import tiny_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", num_hidden_layers=2)).float()
    with torch.no_grad():  # norms away from 1, adapters away from their initialisation
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    nvfp4.quantize_model(model, progress=False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _sha(named: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(named):
        h.update(k.encode())
        h.update(named[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from aqn import AQNController, make_schedule
    from nvfp4.fsdp import fully_shard_quantized
    from qerl_trl.rollout.vllm import _VLLMGeneration, adapter_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    class _Recording(_VLLMGeneration):
        """The generation side of the colocate / server modes up to the engine write, which it keeps instead."""

        def __init__(self, pushes: bool) -> None:
            super().__init__(trainer=None)
            self._pushes, self.norms, self.restored = pushes, None, 0

        @property
        def pushes(self) -> bool:
            return self._pushes

        def _push_norms(self, named: dict[str, torch.Tensor]) -> None:
            self.norms = named

        def restore_norm_weights(self) -> None:
            self.restored += 1

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _tiny_policy()
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (WORLD,))
        fully_shard_quantized(model, mesh=mesh)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
        norms = {n: p for n, p in model.named_parameters() if "norm" in n}
        sharded = all(isinstance(p, DTensor) and p.to_local().shape[0] < p.shape[0] for p in lora.values())
        sharded_norms = all(isinstance(p, DTensor) for p in norms.values())

        # the adapter: gathered whole, equal to the unsharded policy's
        state, cfg = adapter_state(model)
        want, _ = adapter_state(ref)
        adapter_equal = state.keys() == want.keys() and all(
            state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]) for k in want
        )
        # a process that pushes nothing takes part in the gathers, keeps nothing
        kept, _ = adapter_state(model, keep=rank == 0)

        # AQN: the same controller's draw at step 3 (σ > 0), on the shards and on the whole weights
        def controller() -> AQNController:
            return AQNController(make_schedule("exponential", 0.05, 0.01, 4, total_steps=8), seed=7)

        step = 6
        sharded_gen, ref_gen = _Recording(pushes=True), _Recording(pushes=True)
        ctl, ref_ctl = controller(), controller()
        with ctl.rollout(model.base_model.model, step, engine=sharded_gen):
            pass
        with ref_ctl.rollout(ref.base_model.model, step, engine=ref_gen):
            pass
        clean = {n: p.detach() for n, p in ref.base_model.model.named_parameters() if "norm" in n}
        got, want_norms = sharded_gen.norms, ref_gen.norms
        norms_equal = got.keys() == want_norms.keys() and all(
            got[k].dtype == torch.float32 and torch.equal(got[k], want_norms[k]) for k in want_norms
        )
        noised = all(not torch.equal(got[k], clean[k].float()) for k in got)
        untouched = all(torch.equal(norms[n].full_tensor(), clean[n.removeprefix("base_model.model.")]) for n in norms)
        quiet = _Recording(pushes=rank == 0)
        with controller().rollout(model.base_model.model, step, engine=quiet):
            pass
        record: dict[str, Any] = {
            "rank": rank,
            "lora_sharded": sharded,
            "norms_sharded": sharded_norms,
            "adapter_tensors": len(state),
            "adapter_equal": adapter_equal,
            "adapter_sha": _sha(state),
            "adapter_r": cfg.r,
            "kept_when_not_pushing": len(kept),
            "norms": len(got),
            "norms_equal": norms_equal,
            "norms_sha": _sha(got),
            "noised": noised,
            "sigma": ctl.sigma(step),
            "policy_norms_untouched": untouched,
            "restored": sharded_gen.restored,
            "quiet_kept": len(quiet.norms),
        }
        Path(out).with_name(f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        from ports import end_process_group

        end_process_group()


def test_fsdp2_sharded_policy_pushes_the_unsharded_adapter_and_noisy_norms(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(ranks[0])
    for r in ranks:
        assert r["lora_sharded"] and r["norms_sharded"]  # the policy really was sharded
        assert r["adapter_equal"] and r["adapter_tensors"] == 28 and r["adapter_r"] == 4
        # the 4 decoder-layer norms (AQN leaves the final norm alone by default)
        assert r["norms_equal"] and r["norms"] == 4 and r["noised"] and r["sigma"] > 0
        assert r["policy_norms_untouched"] and r["restored"] == 1
    # both ranks hand over the same bytes; the non-pushing rank kept nothing
    assert len({r["adapter_sha"] for r in ranks}) == 1 and len({r["norms_sha"] for r in ranks}) == 1
    assert [r["kept_when_not_pushing"] for r in ranks] == [28, 0]
    assert [r["quiet_kept"] for r in ranks] == [4, 0]


def test_tensor_parallel_size_is_validated_in_one_line():
    from qerl_trl.config import QeRLConfig, VLLMRolloutConfig

    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"^vllm.tensor_parallel_size must be a whole number >= 1") as e:
            VLLMRolloutConfig(tensor_parallel_size=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="a server's is its own --tensor-parallel-size"):
        VLLMRolloutConfig(server_url="http://127.0.0.1:8000", tensor_parallel_size=2)
    cfg = VLLMRolloutConfig(tensor_parallel_size=2)
    assert cfg.tp_size(4, fsdp2=True) == 2 and cfg.tp_size(2, fsdp2=False) == 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the number of training processes \(3\)"):
        cfg.tp_size(3, fsdp2=True)
    auto = VLLMRolloutConfig()  # unset: all the processes under FSDP2, one engine per process otherwise
    assert (auto.tp_size(4, fsdp2=True), auto.tp_size(4, fsdp2=False), auto.tp_size(1, fsdp2=True)) == (4, 1, 1)
    args = QeRLConfig(output_dir="x", rollout_engine="vllm", vllm='{"tensor_parallel_size": 2}')
    assert args.vllm.tensor_parallel_size == 2
    with pytest.warns(FutureWarning, match="vllm.tensor_parallel_size"):  # TRL's spelling
        args = QeRLConfig(output_dir="x", rollout_engine="vllm", vllm_tensor_parallel_size=2)
    assert args.vllm.tensor_parallel_size == 2 and args.vllm_tensor_parallel_size is None
    with pytest.raises(ValueError, match="must be a whole number"), pytest.warns(FutureWarning):
        QeRLConfig(output_dir="x", rollout_engine="vllm", vllm_tensor_parallel_size=0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO / "tests"))
    from ports import free_port

    mp.spawn(_worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
