"""tests/aqn fixtures. Puts this folder on ``sys.path`` so test files can ``import aqn_test_helpers`` under any
pytest import mode (the workspace uses ``--import-mode=importlib``, which does not add test folders itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def one_thread():
    """Tiny matmuls are dominated by thread-pool wake-ups (25 ms per 64x128 linear with 2 threads on a busy 2-core
    box, 10 us with one): run these tests single-threaded, and put the setting back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
