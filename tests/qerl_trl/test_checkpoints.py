"""qerl_trl.checkpoints: what counts as a complete checkpoint, which one a resume picks, atomic publish, rotation.

Built from real files (safetensors, transformers' TrainerState, torch.save), no training: the trainer's own saves and
resumes are in test_trainer.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from aqn import AQNController, make_schedule
from qerl_trl.checkpoints import (
    MANIFEST_NAME,
    STAGING_DIR,
    CheckpointError,
    check_checkpoint,
    checkpoint_folders,
    find_resume_checkpoint,
    later_checkpoints,
    publish_checkpoint,
    required_checkpoint_files,
    rotate_checkpoints,
    write_manifest,
)
from safetensors.torch import save_file
from transformers import TrainerState

REQUIRED = ["optimizer.pt", "scheduler.pt", "aqn_state.json"]


def write_checkpoint(run: Path, step: int, manifest: bool = True) -> Path:
    """A checkpoint-<step> folder as the trainer writes it (adapter, optimizer, scheduler, RNG, states), published."""
    staged = run / STAGING_DIR / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    save_file({"lora_A": torch.randn(4, 8), "lora_B": torch.zeros(8, 4)}, staged / "adapter_model.safetensors")
    (staged / "adapter_config.json").write_text("{}")
    torch.save({"state": {0: torch.randn(64)}}, staged / "optimizer.pt")
    torch.save({"last_epoch": step}, staged / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, staged / "rng_state.pth")
    TrainerState(global_step=step).save_to_json(str(staged / "trainer_state.json"))
    aqn = AQNController(make_schedule("exponential", 1e-2, 5e-4, 4, total_steps=10), seed=0)
    (staged / "aqn_state.json").write_text(json.dumps(aqn.state_dict()))
    if manifest:
        write_manifest(staged, step)
    publish_checkpoint(staged, run / f"checkpoint-{step}")
    return run / f"checkpoint-{step}"


def truncate(path: Path, fraction: float = 0.5) -> None:
    """What a write cut short leaves: the first part of the file."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def test_complete_checkpoint_passes_and_each_kind_of_damage_names_its_file(tmp_path):
    ckpt = write_checkpoint(tmp_path, 2)
    check_checkpoint(ckpt, REQUIRED)
    assert not (tmp_path / STAGING_DIR / "checkpoint-2").exists()
    assert set(json.loads((ckpt / MANIFEST_NAME).read_text())["files"]) == {
        "adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
        "trainer_state.json", "aqn_state.json"}  # fmt: skip

    def damaged(tag: str, damage) -> str:
        broken = write_checkpoint(tmp_path / tag, 2)
        damage(broken)
        with pytest.raises(CheckpointError) as info:
            check_checkpoint(broken, REQUIRED)
        return info.value.relative_to(broken)

    assert damaged("cut-adapter", lambda c: truncate(c / "adapter_model.safetensors")) == (
        "adapter_model.safetensors: 196 bytes, written with 392 (cut short or changed)")
    assert damaged("cut-optimizer", lambda c: truncate(c / "optimizer.pt")).startswith("optimizer.pt: ")
    assert damaged("no-scheduler", lambda c: (c / "scheduler.pt").unlink()) == "scheduler.pt: missing"
    assert damaged("bad-state", lambda c: (c / "trainer_state.json").write_text("{")).startswith(
        "trainer_state.json: ")
    assert damaged("no-folder", lambda c: os.rename(c, c.with_name("elsewhere"))) == "no such checkpoint folder"


def test_an_incomplete_aqn_state_fails_the_check_naming_the_missing_key(tmp_path):
    """Valid JSON that is not a whole AQN state (edited by hand, written by another tool) is refused by the check,
    before a resume loads anything, naming the file and the key: not a KeyError from deep inside the resume."""
    ckpt = write_checkpoint(tmp_path, 2, manifest=False)
    state = json.loads((ckpt / "aqn_state.json").read_text())

    def check_with(aqn_state: dict) -> str:
        (ckpt / "aqn_state.json").write_text(json.dumps(aqn_state))
        with pytest.raises(CheckpointError) as info:
            check_checkpoint(ckpt, REQUIRED)
        return info.value.relative_to(ckpt)

    no_schedule = {k: v for k, v in state.items() if k != "schedule"}
    assert check_with(no_schedule) == "aqn_state.json: AQN controller state has no 'schedule'"
    no_seed = {k: v for k, v in state.items() if k != "seed"}
    assert check_with(no_seed) == "aqn_state.json: AQN controller state has no 'seed'"
    schedule = {k: v for k, v in state["schedule"].items() if k != "total_steps"}
    assert check_with({**state, "schedule": schedule}) == "aqn_state.json: schedule state has no 'total_steps'"
    assert check_with({**state, "schedule": 3}) == "aqn_state.json: schedule state must be a mapping, got int"
    (ckpt / "aqn_state.json").write_text(json.dumps(state))
    check_checkpoint(ckpt, REQUIRED)


def test_a_checkpoint_of_a_run_without_aqn_says_so_when_aqn_is_on(tmp_path):
    """A run trained with AQN off never writes aqn_state.json (its manifest lists none); resumed with AQN on (the
    default, the flag forgotten), the error says that run had AQN off, not just "missing" as if a file were lost."""
    ckpt = write_checkpoint(tmp_path, 2, manifest=False)
    (ckpt / "aqn_state.json").unlink()
    write_manifest(ckpt, 2)
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(ckpt, REQUIRED)
    assert info.value.relative_to(ckpt) == "aqn_state.json: missing: the run that saved it had AQN off (aqn false)"
    check_checkpoint(ckpt, REQUIRED[:2])


def test_checkpoint_without_manifest_needs_state_weights_and_required_files(tmp_path):
    """Checkpoints from before the manifest (or from plain transformers) are checked by their expected files."""
    ckpt = write_checkpoint(tmp_path, 3, manifest=False)
    check_checkpoint(ckpt, REQUIRED)
    (ckpt / "aqn_state.json").unlink()
    check_checkpoint(ckpt)  # a run without AQN does not need it
    with pytest.raises(CheckpointError, match=r"checkpoint-3/aqn_state.json: missing"):
        check_checkpoint(ckpt, REQUIRED)
    truncate(ckpt / "adapter_model.safetensors")  # no manifest: the safetensors header says it
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: not a complete safetensors file \(.*"
                       "incomplete metadata, file not fully covered"):  # fmt: skip
        check_checkpoint(ckpt)
    (ckpt / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model weights"):
        check_checkpoint(ckpt)


def test_resume_picks_the_newest_complete_checkpoint_and_says_what_it_skipped(tmp_path):
    for step in (2, 4, 6, 10):
        write_checkpoint(tmp_path, step)
    truncate(tmp_path / "checkpoint-10" / "adapter_model.safetensors")
    (tmp_path / "checkpoint-6" / "optimizer.pt").unlink()
    (tmp_path / "checkpoint-8").mkdir()  # an empty folder (e.g. an old, non-atomic save)
    found = find_resume_checkpoint(tmp_path, REQUIRED)
    assert found.path == str(tmp_path / "checkpoint-4")
    line = found.skipped_line()
    assert line.startswith("checkpoint-10 (adapter_model.safetensors: 196 bytes, written with 392 (cut short")
    assert "; checkpoint-8 (no model weights" in line and line.endswith("; checkpoint-6 (optimizer.pt: missing)")
    none = find_resume_checkpoint(tmp_path / "nothing-here")
    assert none.path is None and none.skipped == []


def test_fsdp_launch_checkpoints_resume_without_optimizer_pt(tmp_path, monkeypatch):
    """`accelerate launch --config_file recipes/accelerate/fsdp2.yaml` sets FSDP through the environment (args.fsdp stays
    unset); the trainer then saves the optimizer with accelerate's FSDP helpers (optimizer.bin), never optimizer.pt."""
    from types import SimpleNamespace

    args = SimpleNamespace(save_only_model=False, deepspeed=None, fsdp=None, aqn=True)
    assert required_checkpoint_files(args) == REQUIRED
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    ckpt = write_checkpoint(tmp_path, 2)
    os.rename(ckpt / "optimizer.pt", ckpt / "optimizer.bin")  # what save_fsdp_optimizer writes (FULL_STATE_DICT)
    write_manifest(ckpt, 2)
    assert find_resume_checkpoint(tmp_path, required_checkpoint_files(args)).path == str(ckpt)


def test_publish_replaces_an_existing_folder_and_rotation_keeps_the_new_one(tmp_path):
    """A step saved again after a resume replaces the damaged folder of that name; ``save_total_limit`` deletes the
    oldest folders, never the one just written, even when damaged folders with larger N are left from before."""
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    truncate(tmp_path / "checkpoint-6" / "adapter_model.safetensors")
    truncate(tmp_path / "checkpoint-4" / "adapter_model.safetensors")
    again = write_checkpoint(tmp_path, 4)  # resumed from 2, saved step 4 again
    check_checkpoint(again, REQUIRED)
    assert not any((tmp_path / STAGING_DIR).iterdir())
    new = write_checkpoint(tmp_path, 3)
    deleted = rotate_checkpoints(tmp_path, 1, keep=[str(new)])
    assert [p.name for p in checkpoint_folders(tmp_path)] == ["checkpoint-3"]
    assert [p.name for p in deleted] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert rotate_checkpoints(tmp_path, None, keep=[]) == [] and rotate_checkpoints(tmp_path, 0, keep=[]) == []


def test_rotation_after_a_rollback_deletes_the_abandoned_runs_checkpoints_first(tmp_path):
    """Resumed from checkpoint-2 with 4 and 6 left from the run after it (a rollback), the run saves step 3: with a
    limit of 2, the abandoned run's 4 and 6 go first (left, ``resume_from_checkpoint=True`` would take that run
    back up after a crash before step 6), and 2, the run's own previous checkpoint, stays."""
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    new = write_checkpoint(tmp_path, 3)
    deleted = rotate_checkpoints(tmp_path, 2, keep=[str(new)], step=3)
    assert [p.name for p in deleted] == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in checkpoint_folders(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_checkpoints_after_the_one_resumed_from_are_named(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    assert [p.name for p in later_checkpoints(tmp_path / "checkpoint-2", tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    assert later_checkpoints(tmp_path / "checkpoint-6", tmp_path) == []
    assert later_checkpoints(tmp_path / "elsewhere", tmp_path) == []  # not a checkpoint-N folder
