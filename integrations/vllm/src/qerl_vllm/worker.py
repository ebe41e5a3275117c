"""vLLM worker extension (``LLM(..., worker_extension_cls="qerl_vllm.worker.QeRLWorkerExtension")``).

Its methods are mixed into every vLLM worker and called by name through ``LLM.collective_rpc`` (arguments go through
vLLM's own msgpack serialization, tensors included), so the AQN norm push works in-process and with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` / tensor parallelism alike, without pickled callables. A server started with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls qerl_vllm.worker.QeRLWorkerExtension`` exposes them through ``POST /collective_rpc``
(``{"method": "qerl_set_norms_file", "args": ["/shared/norms.safetensors"]}``, ``{"method": "qerl_restore_norms"}``).
"""

from __future__ import annotations

import torch

from .engine import _w_norm_names, _w_norm_weights, _w_restore_norms, _w_set_norms
from .shared_weights import EngineWeights, engine_weight_views

__all__ = ["QeRLWorkerExtension"]


class QeRLWorkerExtension:
    """Norm-weight access on the worker's model (``self.model_runner.model``), and (in-process engines only) views of
    its frozen weights for a colocated trainer."""

    def _qerl_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def qerl_norm_names(self) -> list[str]:
        return _w_norm_names(self._qerl_model())

    def qerl_norm_weights(self) -> dict[str, torch.Tensor]:
        return _w_norm_weights(self._qerl_model())

    def qerl_set_norms(self, named: dict[str, torch.Tensor]) -> int:
        return _w_set_norms(self._qerl_model(), named)

    def qerl_set_norms_file(self, path: str) -> int:
        """Norm weights from a safetensors file (the HTTP ``/collective_rpc`` route passes strings only)."""
        from safetensors.torch import load_file

        return _w_set_norms(self._qerl_model(), load_file(str(path)))

    def qerl_restore_norms(self) -> int:
        return _w_restore_norms(self._qerl_model())

    def qerl_worker_pid(self) -> int:
        """The worker's process id: the caller's own when the engine runs in its process (colocate mode)."""
        import os

        return os.getpid()

    def qerl_engine_weight_views(self) -> EngineWeights:
        """Views of the model's frozen tensors (:func:`qerl_vllm.shared_weights.engine_weight_views`). Only for an
        engine in the caller's process (``VLLMEngine.shareable_weights`` checks): across processes the RPC would
        serialize copies of every weight."""
        return engine_weight_views(self._qerl_model())
