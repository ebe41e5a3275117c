"""The tiles of vLLM's LoRA kernels on CUDA: tuned for the GPU, vLLM's defaults, or one K split (reproducible).

vLLM's Triton LoRA kernels (punica ``lora_shrink``: ``x @ lora_A`` for every token; ``lora_expand``: ``+ s @ lora_B``)
take their tiles from JSON files in the folder ``VLLM_TUNED_CONFIG_FOLDER`` names (its own tuning hook,
``vllm/lora/ops/triton_ops/utils.py``), else from defaults. Three choices (:data:`LORA_TILES`):

* ``"tuned"`` (the engine's default): the files shipped in ``tuned_lora_configs/`` for this GPU, written by
  ``benchmarks/vllm_gpu/lora_tune.py`` at the 7B's LoRA sites (rank 32; other shapes take vLLM's nearest entry). On
  the H100 at 6a06c59 vLLM 0.26's default shrink split K 8 ways in 32-deep tiles from 128 rows: 22.7 µs a call on the
  down projection against 6.6 tuned; 7B rollouts (prompt 256, 256 new tokens) rose 13.6 % at B = 128 and 6.8 % at 256
  with our kernel, 12.7 % / 6.2 % with bf16 (``benchmarks/results/rollout_vllm_lora_{stock,tuned}_h100_6a06c59.json``).
  A GPU with no shipped file keeps vLLM's defaults.
* ``"stock"``: vLLM's defaults.
* ``"reproducible"``: the shrink held to one K split. vLLM's shrink sums its float32 partial products with
  ``tl.atomic_add`` in the order the blocks finish, so the same adapter on the same prompts gives different logprobs
  run to run (0.066-0.086 apart, bf16, H200, vLLM 0.26: ``benchmarks/results/repro_probe_h200_b78624b.log``; the base
  model without LoRA, and our kernels, bit-identical); with one split the kernel stores its sums and every arm of
  that probe was bit-identical. The expand never splits K: its tuned tiles stay. What one split costs is not measured.

vLLM reads the variable through its environment, which an engine freezes as it starts (``vllm.envs``' cache), and
caches what it loaded per process: set it before the first engine or server of the process starts. The variable, when
already set, wins (:func:`apply_lora_tiles`). vLLM's CPU engine runs LoRA without these kernels and never reads it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = [
    "LORA_TILES",
    "SHIPPED_FOLDER",
    "TUNED_CONFIG_FOLDER_ENV",
    "apply_lora_tiles",
    "lora_tiles_folder",
    "write_one_split_shrink_config",
]

TUNED_CONFIG_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"
LORA_TILES = ("tuned", "stock", "reproducible")
#: the tuned files, one pair per GPU: ``{device name}_SHRINK.json`` and ``{device name}_EXPAND_TRUE.json``
SHIPPED_FOLDER = Path(__file__).resolve().parent / "tuned_lora_configs"
# vLLM's default shrink tile below 128 rows, with split_k 1 (no atomics)
_ONE_SPLIT = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_ctas": 1,
              "group_size_m": 8, "num_stages": 2, "max_nreg": None}  # fmt: skip
# vLLM looks the slice count up exactly (a KeyError for one not listed): 1 for a plain linear, one per member of a
# fused one (2 gate/up, 3 q/k/v); beyond that, room for other models' fusions
_SLICE_COUNTS = range(1, 17)


def _file_prefix(device_name: str | None) -> str:
    """vLLM's file-name prefix for a GPU: its device name, spaces and dashes as ``_`` (the current CUDA device's)."""
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name()
    return device_name.replace(" ", "_").replace("-", "_")


def _check_tiles(tiles: str) -> None:
    if tiles not in LORA_TILES:
        raise ValueError(f"lora_tiles must be one of {', '.join(map(repr, LORA_TILES))}, got {tiles!r}")


def write_one_split_shrink_config(folder: str | os.PathLike, device_name: str | None = None) -> Path:
    """Write vLLM's tuned config for its LoRA shrink kernel with one K split into ``folder``; returns the file.

    Point ``VLLM_TUNED_CONFIG_FOLDER`` at ``folder`` before vLLM starts (the engine's process, or the server's
    environment in server mode) to make LoRA rollouts bitwise reproducible run to run on CUDA (module docstring).
    vLLM names the file after the GPU (``{device name}_SHRINK.json``, spaces and dashes as ``_``; ``device_name``:
    default the current CUDA device's) and keys it ``[max_loras][num_slices][rows][K][rank]``, each level but the
    slice count matched to the nearest key: one entry per level covers every row count, hidden size and rank.
    """
    table = _with_every_slice_count({"1": {"1": {"1": {"1": {"1": _ONE_SPLIT}}}}})
    path = Path(folder) / f"{_file_prefix(device_name)}_SHRINK.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))
    return path


def _with_every_slice_count(table: dict) -> dict:
    """``table`` with every slice count of :data:`_SLICE_COUNTS`, a missing one taking the nearest tuned count's tiles:
    vLLM looks the count up exactly, and a model fusing more linears than the tuner's (3) would fail at its first
    decode step."""
    for by_slices in table.values():
        tuned = sorted(map(int, by_slices))
        for s in _SLICE_COUNTS:
            by_slices.setdefault(str(s), by_slices[str(min(tuned, key=lambda t: abs(t - s)))])
    return table


def lora_tiles_folder(
    tiles: str, device_name: str | None = None, folder: str | os.PathLike | None = None
) -> Path | None:
    """Write the folder for ``VLLM_TUNED_CONFIG_FOLDER`` that gives ``tiles`` on this GPU; ``None``: vLLM's defaults.

    ``"tuned"``: the GPU's files of :data:`SHIPPED_FOLDER`, every slice count filled in; ``None`` when none is shipped.
    ``"reproducible"``: the one-split shrink and the GPU's tuned expand, if shipped. ``folder``: where (default a fresh
    temporary one); ``device_name``: default the current CUDA device's. Raises ``ValueError`` for a name not in
    :data:`LORA_TILES`.
    """
    _check_tiles(tiles)
    prefix = _file_prefix(device_name)
    shipped = sorted(SHIPPED_FOLDER.glob(f"{prefix}_*.json"))
    if tiles == "stock" or (tiles == "tuned" and not shipped):
        return None
    out = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="qerl-lora-tiles-"))
    out.mkdir(parents=True, exist_ok=True)
    if tiles == "reproducible":
        write_one_split_shrink_config(out, prefix)
    for f in shipped:
        if tiles == "tuned" or not f.name.endswith("_SHRINK.json"):
            (out / f.name).write_text(json.dumps(_with_every_slice_count(json.loads(f.read_text()))))
    return out


def apply_lora_tiles(tiles: str = "tuned") -> str | None:
    """Point ``VLLM_TUNED_CONFIG_FOLDER`` at the folder for ``tiles`` before an engine starts in this process.

    Returns the folder set (``None``: vLLM's defaults). A variable already set wins (the user's own tuned files, or
    an earlier call's) and is returned as it is. vLLM reads it when the process's first engine starts and keeps what
    it read (its environment cache, ``vllm.envs``): set after that, it is not read. Nothing is set off CUDA, where
    vLLM's LoRA does not use these kernels. Raises ``ValueError`` for a name not in :data:`LORA_TILES`.
    """
    _check_tiles(tiles)
    if TUNED_CONFIG_FOLDER_ENV in os.environ:
        return os.environ[TUNED_CONFIG_FOLDER_ENV]
    import torch

    # no test of vLLM's cache here: it has no public one (0.26 names it _is_envs_cache_enabled, 0.32 without the _)
    if not torch.cuda.is_available():
        return None
    folder = lora_tiles_folder(tiles)
    if folder is not None:
        os.environ[TUNED_CONFIG_FOLDER_ENV] = str(folder)
    return None if folder is None else str(folder)
