"""Rollout engines of :class:`~qerl_trl.QeRLGRPOTrainer`: one :class:`RolloutEngine` per trainer (``trainer.rollout``).

==================  ====================================================================================
``transformers``    :class:`~qerl_trl.rollout.transformers.TransformersRollout`: the policy's ``generate``
``graph``           :class:`~qerl_trl.rollout.graph.engine.GraphRollout`: :func:`~qerl_trl.rollout.graph.generate.graph_generate`
``vllm``            :class:`~qerl_trl.rollout.vllm.VLLMRollout`: vLLM (colocate or server), ``qerl-trl[vllm]``
==================  ====================================================================================

Adding an engine is one module with a :class:`RolloutEngine` subclass (its rules included: ``check_config``,
``holds_generation_memory``, ``before_train``) plus one line in :data:`ENGINES`. :func:`engine_class` is the one place
a ``rollout_engine`` name becomes a class (``QeRLConfig`` calls it and keeps the class as ``rollout_engine_class``).
"""

from __future__ import annotations

import importlib

from .base import RolloutEngine

__all__ = ["ENGINES", "RolloutEngine", "engine_class", "evaluation_engines"]

#: ``rollout_engine`` value → ``module:class`` (imported when chosen: vLLM's module is only loaded for vLLM rollouts)
ENGINES: dict[str, str] = {
    "transformers": "qerl_trl.rollout.transformers:TransformersRollout",
    "graph": "qerl_trl.rollout.graph.engine:GraphRollout",
    "vllm": "qerl_trl.rollout.vllm:VLLMRollout",
}


def engine_class(name: str) -> type[RolloutEngine]:
    """The :class:`RolloutEngine` subclass ``rollout_engine=name`` selects."""
    if name not in ENGINES:
        raise ValueError(f"rollout_engine must be one of {', '.join(map(repr, ENGINES))}, got {name!r}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def evaluation_engines() -> list[str]:
    """The names of :data:`ENGINES` that ``qerl eval --engine`` can generate with: those whose class overrides
    :meth:`RolloutEngine.check_evaluation` (the base refuses every policy; ``graph`` generates for training only)."""
    refuses = RolloutEngine.check_evaluation.__func__
    return [name for name in ENGINES if getattr(engine_class(name).check_evaluation, "__func__", None) is not refuses]
