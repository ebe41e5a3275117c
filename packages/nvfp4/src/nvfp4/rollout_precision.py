"""``rollout_precision``: how the frozen NVFP4 base computes while rollouts are generated (issue #51), and ``auto``'s
crossover.

==========  ====================================================================================================
``w4a16``   our W4A16 kernels on the 4-bit weights (``nvfp4::linear``), as training runs them (the default)
``fp8``     an E4M3 copy of every linear made once from the NVFP4 weights (:func:`nvfp4.fp8.fp8_weight`), the
            activation quantised per token (:func:`nvfp4.fp8.act_quant`), the product on FP8 tensor cores
            (:func:`nvfp4.fp8.scaled_linear`; the float32 reference on CPU)
``auto``    W4A16 below :func:`fp8_crossover_rows` rows (tokens) per linear call, FP8 from there (both copies held)
==========  ====================================================================================================

Why a crossover: Hopper has no FP4 tensor cores; our W4A16 kernels win while the weight read dominates (decode of
few rows) and fall below bf16 from M ≈ 256, while the FP8 GEMM runs at twice the bf16 rate. The H100 spike
(``benchmarks/gemm.py --fp8``, ``benchmarks/results/gemm_fp8_spike.json`` at bdf44f8; the 7B layer = qkv + o +
gate_up + down as vLLM fuses them, ratio to bf16, M = 1 … 1024): W4A16 with its prologue 2.28 / 2.21 / 2.14 / 1.88 /
1.60 / 1.18 / 0.78 / 0.72 / 0.80, FP8 with the fused quantisation 1.17 / 1.19 / 1.19 / 1.19 / 1.27 / 1.35 / 1.32 /
1.40 / 1.45 at M = 1 / 8 / 16 / 32 / 64 / 128 / 256 / 512 / 1024: FP8 is faster from M = 128 on. The crossover is
held per model shape, like the frozen kernel dispatch table (:data:`FP8_CROSSOVER_ROWS`); an unmeasured shape takes
:data:`UNMEASURED_CROSSOVER_ROWS` (the 7B value; 128 is also one of vLLM's CUDA-graph batch sizes).

This module holds the setting and the table only (no torch): the ops are :mod:`nvfp4.fp8`, the model-level copies
:mod:`nvfp4.fp8_model` (the graph engine) and ``qerl_vllm.quant`` (vLLM's linear method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "FP8_CROSSOVER_ROWS",
    "PRECISIONS",
    "UNMEASURED_CROSSOVER_ROWS",
    "RolloutPrecision",
    "fp8_copy_bytes",
    "fp8_crossover_rows",
    "get_rollout_precision",
    "model_crossover_rows",
]

PRECISIONS: tuple[str, ...] = ("w4a16", "fp8", "auto")

#: ``(hidden_size, intermediate_size)`` → the smallest rows per linear call from which FP8 beat W4A16 on the whole
#: layer (both with their prologue) on an H100: Qwen2.5-7B, ``gemm_fp8_spike.json`` at bdf44f8.
FP8_CROSSOVER_ROWS: dict[tuple[int, int], int] = {(3584, 18944): 128}
#: ``auto``'s crossover for a model shape not in :data:`FP8_CROSSOVER_ROWS` (not measured: the 7B value).
UNMEASURED_CROSSOVER_ROWS = 128


@dataclass(frozen=True)
class RolloutPrecision:
    """A parsed ``rollout_precision`` (:func:`get_rollout_precision`).

    Attributes:
        name: ``"w4a16"``, ``"fp8"`` or ``"auto"``.
    """

    name: str

    @property
    def fp8_copy(self) -> bool:
        """Whether generation needs the E4M3 copy of the linears (``fp8`` and ``auto``)."""
        return self.name != "w4a16"

    @property
    def keeps_w4a16(self) -> bool:
        """Whether generation still runs the W4A16 path (``w4a16``, and ``auto`` below its crossover)."""
        return self.name != "fp8"

    def fp8_from_rows(self, crossover_rows: int) -> int | None:
        """The rows per linear call from which generation takes the FP8 path: 0 (always) for ``fp8``,
        ``crossover_rows`` for ``auto``, None (never) for ``w4a16``."""
        return {"w4a16": None, "fp8": 0, "auto": crossover_rows}[self.name]

    def __str__(self) -> str:
        return self.name


def get_rollout_precision(value: str | RolloutPrecision) -> RolloutPrecision:
    """Parse a ``rollout_precision`` value (case and surrounding spaces ignored); ``ValueError``, one line, for
    anything else. A :class:`RolloutPrecision` is taken as it is."""
    if isinstance(value, RolloutPrecision):
        return value
    key = str(value).strip().lower()
    if key not in PRECISIONS:
        raise ValueError(f"rollout_precision must be one of {', '.join(map(repr, PRECISIONS))}, got {value!r}")
    return RolloutPrecision(key)


def fp8_crossover_rows(hidden_size: int, intermediate_size: int) -> tuple[int, bool]:
    """``auto``'s crossover for a model of this shape: ``(rows, measured)``; ``measured`` False when the shape is not
    in :data:`FP8_CROSSOVER_ROWS` and :data:`UNMEASURED_CROSSOVER_ROWS` is used."""
    rows = FP8_CROSSOVER_ROWS.get((int(hidden_size), int(intermediate_size)))
    return (rows, True) if rows is not None else (UNMEASURED_CROSSOVER_ROWS, False)


def model_crossover_rows(config: Any) -> tuple[int, bool]:
    """:func:`fp8_crossover_rows` of a transformers model config (its text config where it has one: multimodal
    models); a config without ``hidden_size`` / ``intermediate_size`` (or None) takes the unmeasured value."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return fp8_crossover_rows(getattr(text, "hidden_size", 0), getattr(text, "intermediate_size", 0))


def fp8_copy_bytes(linears: list[tuple[int, int]]) -> int:
    """Bytes of the E4M3 copies of linears given as ``(in_features, out_features)``: 1 per weight + a float32 scale
    per output row (:func:`nvfp4.fp8.fp8_weight`)."""
    return sum(n_in * n_out + 4 * n_out for n_in, n_out in linears)
