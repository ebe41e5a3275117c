"""Engines built one after another in one process (tests, ``qerl eval`` over several adapters): the last engine out
drops vLLM's process-wide CUDA-graph state, so that the next one captures into a fresh pool (vLLM issue 28426: the H100
at 6ee5805 stopped a second engine's capture on PyTorch's ``use_count > 0`` assert, and every later compile in the
process on "Offset increment outside graph capture": vllm_tests_h100_6ee5805_rerun.log).

In a file of its own: no module-scoped engine of another test may be alive while these run."""

from __future__ import annotations

import inspect

import pytest
import torch
from vllm_test_helpers import ENGINE_DTYPE, nvfp4_offline_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_the_vllm_names_the_last_engine_out_resets_are_where_it_looks():
    """``_release_engine_memory`` clears vLLM's graph wrappers through their public ``clear_all_graphs`` and resets
    the pool id that ``Platform.get_global_graph_pool`` makes once per process: both under the names it uses, in the
    installed vLLM (a vLLM that moves them fails here, not silently on a GPU)."""
    from qerl_vllm.engine import GRAPH_POOL_ATTRIBUTE
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.platforms.interface import Platform

    assert callable(CUDAGraphWrapper.clear_all_graphs) and callable(BreakableCUDAGraphWrapper.clear_all_graphs)
    assert hasattr(Platform, GRAPH_POOL_ATTRIBUTE)
    assert GRAPH_POOL_ATTRIBUTE in inspect.getsource(Platform.get_global_graph_pool)


def test_an_engine_is_live_from_its_start_to_its_close():
    from qerl_vllm.engine import _LIVE_ENGINES, VLLMEngine

    with VLLMEngine(nvfp4_offline_checkpoint(), max_lora_rank=0, seed=0, max_model_len=256,
                    kv_cache_memory_bytes=128 << 20, dtype=ENGINE_DTYPE, enforce_eager=True) as engine:  # fmt: skip
        assert engine in _LIVE_ENGINES
    assert engine not in _LIVE_ENGINES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: vLLM captures none on CPU")
def test_engines_one_after_another_capture_their_cuda_graphs_and_agree():
    """Two compiled engines (vLLM's default: torch.compile and CUDA graphs) on the same checkpoint, the second built
    after the first closed, in this process: both start, capture and give the same greedy tokens."""
    from qerl_vllm.engine import VLLMEngine

    sampling = {"temperature": 0.0, "max_tokens": 12, "min_tokens": 12}
    tokens = []
    for _ in range(2):
        with VLLMEngine(nvfp4_offline_checkpoint(), max_lora_rank=0, seed=0, max_model_len=256,
                        kv_cache_memory_bytes=128 << 20, dtype=ENGINE_DTYPE) as engine:  # fmt: skip
            tokens.append([g.token_ids for g in engine.generate(PROMPTS, sampling, lora=None)])
    assert tokens[0] == tokens[1]
