"""Where :mod:`qerl_trl.rollout.graph.generate` lived before issue #48; this name is the same module (not a copy), for
``benchmarks/rollout.py`` and callers of the old path."""

import sys

from .rollout.graph import generate

sys.modules[__name__] = generate
