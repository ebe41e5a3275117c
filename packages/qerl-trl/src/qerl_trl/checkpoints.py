"""Crash-safe checkpoint folders: written whole or not at all, checked before a resume, rotated without losing the
newest complete one.

A checkpoint is written into ``<output_dir>/.staging/checkpoint-N`` (same filesystem as its final name), every file
and folder in it is fsynced, a manifest of its files and sizes (:data:`MANIFEST_NAME`) is written last, and the folder
is renamed to ``<output_dir>/checkpoint-N`` in one ``rename``: a ``checkpoint-N`` folder that exists is complete, and a
kill during a save leaves only the staging folder, which the next save clears.

Damage after the fact (a disk error, a file cut short by hand, a checkpoint written by another tool) is caught by
:func:`check_checkpoint`: every file of the manifest present with its recorded size, every ``*.safetensors`` header
parsing and covering its file, ``trainer_state.json`` and ``aqn_state.json`` loading. :func:`find_resume_checkpoint`
picks the newest checkpoint that passes and says which newer ones it skipped and why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AQN_STATE_NAME",
    "MANIFEST_NAME",
    "STAGING_DIR",
    "WEIGHT_NAMES",
    "CheckpointError",
    "ResumePoint",
    "check_checkpoint",
    "check_safetensors",
    "checkpoint_folders",
    "find_resume_checkpoint",
    "publish_checkpoint",
    "required_checkpoint_files",
    "later_checkpoints",
    "rotate_checkpoints",
    "write_manifest",
]

#: Files of a checkpoint and their sizes in bytes, written last into the staging folder: ``{"step": N, "files": {...}}``.
MANIFEST_NAME = "checkpoint_files.json"
#: Folder of ``output_dir`` that checkpoints are written into before they are renamed into place.
STAGING_DIR = ".staging"
#: The AQN controller's state (schedule, stage, noise seed), written beside the optimizer's.
AQN_STATE_NAME = "aqn_state.json"
TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer's TRAINER_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
#: Model weights a checkpoint holds, one of these (PEFT adapter or full model, safetensors or pickle, one file or shards).
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")  # fmt: skip
#: Why a required file that a checkpoint's manifest does not list was never written.
_NOT_WRITTEN = {AQN_STATE_NAME: "the run that saved it had AQN off (aqn false)"}
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be resumed from: ``path`` (the file at fault, or the folder) and ``problem``;
    the message is ``"<path>: <problem>"``."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")

    def relative_to(self, folder: str | Path) -> str:
        """The message with ``path`` relative to ``folder`` (``"adapter_model.safetensors: ..."``)."""
        try:
            rel = self.path.relative_to(folder)
        except ValueError:
            return str(self)
        return self.problem if rel == Path(".") else f"{rel}: {self.problem}"


@dataclass
class ResumePoint:
    """What :func:`find_resume_checkpoint` found: the checkpoint to resume from and the newer ones it skipped."""

    path: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)

    def skipped_line(self) -> str:
        """``checkpoint-20 (adapter_model.safetensors: ...); checkpoint-15 (...)``, or ``""``."""
        return "; ".join(f"{os.path.basename(p)} ({why})" for p, why in self.skipped)


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, oldest (smallest N) first; none if it does not exist."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def check_safetensors(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a whole safetensors file (its header parses and its tensors
    cover the file exactly: what a write cut short breaks). Reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(path, f"not a complete safetensors file ({e})") from e


def _check_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(path, "not a JSON object")
    return data


def required_checkpoint_files(args: Any) -> list[str]:
    """Files a checkpoint of a run with trainer config ``args`` must hold, beyond its weights and
    ``trainer_state.json``, to be resumed from: the optimizer and scheduler (unless ``save_only_model``, or DeepSpeed /
    FSDP, which save them their own way) and ``aqn_state.json`` with AQN on."""
    files = []
    if not (args.save_only_model or args.deepspeed or args.fsdp or _fsdp_launch()):
        files += [OPTIMIZER_NAME, SCHEDULER_NAME]
    if getattr(args, "aqn", False):
        files.append(AQN_STATE_NAME)
    return files


def _fsdp_launch() -> bool:
    """Whether ``accelerate launch`` set FSDP up through the environment (``recipes/accelerate/fsdp2.yaml``): then
    ``args.fsdp`` stays unset, yet the trainer saves the optimizer through accelerate's FSDP helpers
    (``optimizer.bin`` or ``optimizer_0/``), never ``optimizer.pt``."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() == "true"


def check_checkpoint(path: str | Path, required: Iterable[str] = ()) -> None:
    """Raise :class:`CheckpointError` (naming the file and the problem) unless ``path`` is a complete, readable
    checkpoint folder.

    Checks: the folder exists; every file of its manifest is there with the size it was written with (a checkpoint
    from before manifests, or from another tool, must hold ``trainer_state.json`` and model weights instead); every
    file of ``required`` is there (e.g. ``aqn_state.json`` when the run has AQN on); every ``*.safetensors`` header
    parses and covers its file; ``trainer_state.json`` loads as transformers' ``TrainerState``; ``aqn_state.json``,
    if present, loads as an AQN controller state. Reads headers and small JSON files only.
    """
    from transformers import TrainerState

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(
            folder, "a file, not a checkpoint folder" if folder.exists() else "no such checkpoint folder"
        )
    manifest = folder / MANIFEST_NAME
    files: dict = {}
    if manifest.exists():
        files = _check_json(manifest).get("files")
        if not isinstance(files, dict):
            raise CheckpointError(manifest, "no 'files' mapping")
        for name, size in files.items():
            file = folder / name
            if not file.is_file():
                raise CheckpointError(file, "missing")
            if file.stat().st_size != size:
                raise CheckpointError(file, f"{file.stat().st_size} bytes, written with {size} (cut short or changed)")
    elif not any((folder / name).is_file() for name in WEIGHT_NAMES):
        raise CheckpointError(folder, f"no model weights (none of {', '.join(WEIGHT_NAMES[:3])}, ...)")
    for name in (TRAINER_STATE_NAME, *required):
        if not (folder / name).is_file():
            # a manifest without it: never written, so the run that saved it was set up otherwise (not a lost file)
            why = _NOT_WRITTEN.get(name) if manifest.exists() and name not in files else None
            raise CheckpointError(folder / name, f"missing: {why}" if why else "missing")
    for file in sorted(folder.rglob("*.safetensors")):
        check_safetensors(file)
    _check_json(folder / TRAINER_STATE_NAME)  # a clear message for bad JSON; TrainerState's own errors below
    try:
        TrainerState.load_from_json(str(folder / TRAINER_STATE_NAME))
    except (TypeError, ValueError) as e:
        raise CheckpointError(folder / TRAINER_STATE_NAME, f"not a trainer state ({e})") from e
    if (folder / AQN_STATE_NAME).exists():
        _check_aqn_state(folder / AQN_STATE_NAME)


def _check_aqn_state(path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` holds a whole AQN controller state (what the resume loads)."""
    from aqn import AQNController

    try:
        AQNController.from_state_dict(_check_json(path))
    except (TypeError, ValueError) as e:  # CheckpointError is a ValueError: it passes through as it is
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(path, str(e)) from e


def find_resume_checkpoint(output_dir: str | Path, required: Iterable[str] = ()) -> ResumePoint:
    """The newest ``checkpoint-N`` of ``output_dir`` that passes :func:`check_checkpoint`, with the newer ones skipped
    and why (``path`` is ``None`` if none passes)."""
    required = tuple(required)
    skipped: list[tuple[str, str]] = []
    for folder in reversed(checkpoint_folders(output_dir)):
        try:
            check_checkpoint(folder, required)
        except CheckpointError as e:
            skipped.append((str(folder), e.relative_to(folder)))
            continue
        return ResumePoint(str(folder), skipped)
    return ResumePoint(None, skipped)


def later_checkpoints(resumed: str | Path, output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir`` with a larger N than ``resumed``'s (a run resumed from an earlier
    checkpoint than its last: the run it rolls back), oldest first; none if ``resumed`` is no ``checkpoint-N``."""
    m = _CHECKPOINT_RE.match(Path(resumed).name)
    if m is None:
        return []
    return [f for f in checkpoint_folders(output_dir) if int(_CHECKPOINT_RE.match(f.name).group(1)) > int(m.group(1))]


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str | Path, step: int) -> None:
    """Write :data:`MANIFEST_NAME` into ``folder``: every file below it (relative path → size in bytes)."""
    folder = Path(folder)
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    (folder / MANIFEST_NAME).write_text(json.dumps({"step": step, "files": files}, indent=1))


def publish_checkpoint(staged: str | Path, final: str | Path) -> None:
    """Make the finished checkpoint folder ``staged`` appear as ``final`` in one step.

    Every file and folder under ``staged`` is fsynced first (so a power cut after the rename cannot leave the new name
    pointing at empty files), then ``staged`` is renamed to ``final`` and the parent folder fsynced. Both must be on the
    same filesystem. A folder already at ``final`` (a step saved again after a resume) is moved aside into ``staged``'s
    parent first and deleted after the rename.
    """
    staged, final = os.fspath(staged), os.fspath(final)
    for root, _dirs, files in os.walk(staged, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root, directory=True)
    old = None
    if os.path.lexists(final):
        old = os.path.join(os.path.dirname(staged), os.path.basename(final) + ".replaced")
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staged, final)  # rename(2): the checkpoint appears whole or not at all
    _fsync(os.path.dirname(os.path.abspath(final)), directory=True)
    if old is not None:
        shutil.rmtree(old)


def rotate_checkpoints(
    output_dir: str | Path, save_total_limit: int | None, keep: Iterable[str | None], step: int | None = None
) -> list[Path]:
    """Delete the oldest ``checkpoint-N`` folders until ``save_total_limit`` remain, never one of ``keep`` (the
    checkpoint just written, the best one); returns the deleted folders. With ``step`` (the run's global step), the
    folders of N > ``step`` are the oldest: a run resumed from an earlier checkpoint (rolled back) left them, and
    ``resume_from_checkpoint=True`` would otherwise take the abandoned run back up after a crash.

    transformers' ``rotate_checkpoints`` keeps the folders with the largest N, which after a resume past damaged
    checkpoints can be those damaged ones and not the one just written; here the one just written always stays, so
    the newest complete checkpoint is never deleted, and only after the new one is in place.
    """
    if save_total_limit is None or save_total_limit <= 0:
        return []
    protected = {os.path.realpath(k) for k in keep if k}
    folders = checkpoint_folders(output_dir)
    if step is not None:  # stable sort: the abandoned run's folders first, each part oldest first
        folders.sort(key=lambda f: int(_CHECKPOINT_RE.match(f.name).group(1)) <= step)
    excess = len(folders) - save_total_limit
    deleted = []
    for folder in folders:
        if excess <= 0:
            break
        if os.path.realpath(folder) in protected:
            continue
        shutil.rmtree(folder)
        deleted.append(folder)
        excess -= 1
    return deleted
