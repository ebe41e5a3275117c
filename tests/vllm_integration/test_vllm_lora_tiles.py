"""The tiles of vLLM's LoRA kernels (:mod:`qerl_vllm.lora_tiles`): the shipped tuned files, the reproducible folder,
where the engine points vLLM, and (on CUDA) vLLM's kernels with the session's folder against ``torch``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from qerl_vllm.lora_tiles import (
    LORA_TILES,
    SHIPPED_FOLDER,
    TUNED_CONFIG_FOLDER_ENV,
    apply_lora_tiles,
    lora_tiles_folder,
)

H100 = "NVIDIA H100 80GB HBM3"
# what vLLM 0.26's kernels read from a config (vllm/lora/ops/triton_ops/lora_{shrink,expand}_op.py)
_KEYS = {"block_m", "block_n", "block_k", "num_warps", "num_stages", "num_ctas", "max_nreg"}


@pytest.mark.parametrize("op", ["SHRINK", "EXPAND_TRUE"])
def test_shipped_files_cover_every_slice_count_vllm_looks_up_exactly(op):
    """vLLM matches each level of ``[max_loras][num_slices][rows][K][N]`` to the nearest key but the slice count, which
    it looks up exactly (a KeyError at the first decode step): q/k/v are 3 slices, gate/up 2, o and down 1."""
    table = json.loads((SHIPPED_FOLDER / f"{H100.replace(' ', '_')}_{op}.json").read_text())
    for slices in table.values():
        assert {"1", "2", "3"} <= slices.keys()
        for by_m in slices.values():
            for by_k in by_m.values():
                for by_n in by_k.values():
                    for cfg in by_n.values():
                        assert _KEYS <= cfg.keys() and (op != "SHRINK" or cfg["split_k"] >= 1), cfg


def test_folder_for_each_choice(tmp_path):
    names = ["NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json", "NVIDIA_H100_80GB_HBM3_SHRINK.json"]
    tuned = lora_tiles_folder("tuned", H100, folder=tmp_path / "tuned")
    assert sorted(p.name for p in tuned.iterdir()) == names
    for name in names:  # the tuner's entries as shipped; every slice count vLLM may look up (exactly) filled in
        written, shipped = (json.loads((d / name).read_text())["1"] for d in (tuned, SHIPPED_FOLDER))
        assert set(written) == {str(s) for s in range(1, 17)} and {k: written[k] for k in shipped} == shipped
        assert written["4"] == written["16"] == shipped["3"]  # the nearest tuned count's tiles
    assert lora_tiles_folder("tuned", "NVIDIA A10G") is None  # no file for it: vLLM's defaults
    assert lora_tiles_folder("stock", H100) is None
    out = lora_tiles_folder("reproducible", H100, folder=tmp_path / "repro")
    shrink = json.loads((out / "NVIDIA_H100_80GB_HBM3_SHRINK.json").read_text())
    assert {cfg["split_k"] for cfg in _leaves(shrink)} == {1}
    expand = json.loads((out / names[0]).read_text())["1"]  # the expand never splits K: its tuned tiles stay
    assert expand == json.loads((tuned / names[0]).read_text())["1"]
    other_gpu = lora_tiles_folder("reproducible", "NVIDIA A10G", folder=tmp_path / "a")
    assert sorted(p.name for p in other_gpu.iterdir()) == ["NVIDIA_A10G_SHRINK.json"]


def _leaves(table: dict):
    for v in table.values():
        if "block_m" in v:
            yield v
        else:
            yield from _leaves(v)


@pytest.mark.parametrize("call", [lambda: lora_tiles_folder("fast", H100), lambda: apply_lora_tiles("fast")])
def test_an_unknown_choice_is_refused_in_one_line(call):
    with pytest.raises(ValueError, match=r"^lora_tiles must be one of 'tuned', 'stock', 'reproducible', got 'fast'$"):
        call()
    from qerl_trl.rollout.vllm import LORA_TILES as CHECKED_BY_THE_CONFIG

    assert LORA_TILES == CHECKED_BY_THE_CONFIG == ("tuned", "stock", "reproducible")


def test_a_folder_already_set_wins(monkeypatch, tmp_path):
    monkeypatch.setenv(TUNED_CONFIG_FOLDER_ENV, str(tmp_path))
    assert apply_lora_tiles("reproducible") == str(tmp_path)
    assert os.environ[TUNED_CONFIG_FOLDER_ENV] == str(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: vLLM's LoRA there does not use these kernels")
def test_nothing_is_set_off_cuda(monkeypatch):
    monkeypatch.delenv(TUNED_CONFIG_FOLDER_ENV, raising=False)
    assert apply_lora_tiles("tuned") is None
    assert TUNED_CONFIG_FOLDER_ENV not in os.environ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's Triton LoRA kernels run on CUDA only")
@pytest.mark.parametrize("m", [1, 37, 128, 300])
def test_vllm_lora_kernels_with_the_sessions_tiles_match_torch_at_7b_sites(m):
    """The session's folder (conftest: the one-split shrink and, where shipped, the tuned expand) as vLLM reads it,
    vLLM's shrink and expand at the 7B's LoRA sites against ``x @ A.T * s`` and ``y + s @ B.T`` on fresh inputs.
    (Each tuned shrink tile was checked the same way by ``lora_tune.py`` before it was written: ``rel_err`` in
    ``benchmarks/results/lora_tune_7b_h100_6a06c59.json``.)"""
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    assert get_lora_op_configs("shrink", 1, m, 18944, 32, 1)["split_k"] == 1
    if lora_tiles_folder("tuned") is not None:  # this GPU's expand tiles are the shipped ones
        shipped = json.loads(next(SHIPPED_FOLDER.glob("*_EXPAND_TRUE.json")).read_text())
        tuned = shipped["1"]["1"]["128"]["32"]["3584"]
        assert get_lora_op_configs("expand", 1, 128, 3584, 32, 1, add_inputs=True) == tuned
    dev, bf, rank = "cuda", torch.bfloat16, 32
    meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=m, device=dev)
    meta.prepare_tensors(torch.zeros(m, dtype=torch.int32, device=dev))
    args = meta.meta_args(m, False)
    for k, ns in ((3584, [3584, 512, 512]), (3584, [3584]), (3584, [18944, 18944]), (18944, [3584])):
        x = torch.randn(m, k, dtype=bf, device=dev)
        a = [torch.randn(1, rank, k, dtype=bf, device=dev) / k**0.5 for _ in ns]
        s = torch.full((len(ns), m, rank), float("nan"), dtype=torch.float32, device=dev)  # vLLM zeroes it first
        lora_shrink(x, a, s, *args, 0.5)
        ref_s = torch.stack([(x.float() @ w[0].float().T) * 0.5 for w in a])
        torch.testing.assert_close(s, ref_s, rtol=2e-2, atol=2e-2 * ref_s.abs().max().item())
        b = [torch.randn(1, n, rank, dtype=bf, device=dev) / rank**0.5 for n in ns]
        y0 = torch.randn(m, sum(ns), dtype=bf, device=dev)
        y = y0.clone()
        lora_expand(s, b, y, *args, offset_start=0, add_inputs=True)
        ref_y = y0.float() + torch.cat([s[i] @ w[0].float().T for i, w in enumerate(b)], dim=1)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), ref_y, rtol=2e-2, atol=2e-2 * ref_y.abs().max().item())
