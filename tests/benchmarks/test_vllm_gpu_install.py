"""``benchmarks/vllm_gpu/install.sh``'s exit code, on CPU: 0 only once vLLM is installed, so that the last install
call's ``install.sh && ... bg.sh start ... && sleep 390`` stops where a part is missing (a machine that went back
between calls keeps none of the earlier calls' parts; a grown working tree makes ``fetch.sh`` pack one call more)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_call_that_leaves_parts_missing_stops_the_chain(tmp_path):
    root = tmp_path / "tree"  # no git here: install.sh works from its own ../.. (the device's copy has no .git)
    (root / "benchmarks" / "vllm_gpu").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "vllm_gpu" / "install.sh", root / "benchmarks" / "vllm_gpu" / "install.sh")
    whl, data = "a-1.0-py3-none-any.whl", b"0123456789"
    manifest = (f"# 2 calls; budget 5 bytes a call\n# file\tsha256\tbytes\tparts (in order)\tcalls\n{whl}\t"
                f"{hashlib.sha256(data).hexdigest()}\t{len(data)}\t{whl}.part-00,{whl}.part-01\t1,2\n")  # fmt: skip
    call1 = root / ".carry" / "vllm" / "call1"
    call1.mkdir(parents=True)
    (call1 / "manifest.tsv").write_text(manifest)
    (call1 / f"{whl}.part-00").write_bytes(data[:5])
    env = dict(os.environ, VLLM_PARTS=str(tmp_path / "parts"), VLLM_SITE=str(tmp_path / "site"), PYTHON=sys.executable)
    p = subprocess.run(["bash", "-c", "bash benchmarks/vllm_gpu/install.sh && echo CHAINED"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "still to carry: call2" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 3 and "CHAINED" not in p.stdout, (p.returncode, p.stdout)
    assert not (tmp_path / "site" / ".qerl-install-ok").exists()
