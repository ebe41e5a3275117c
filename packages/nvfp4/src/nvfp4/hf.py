"""transformers integration: ``NVFP4Config`` and its ``HfQuantizer``, registered as ``quant_method="nvfp4_w4a16"``.

transformers ≥5.2x already owns ``"nvfp4"`` (a Blackwell-only W4A4 path), hence our own name.

* ``from_pretrained(bf16_path, quantization_config=NVFP4Config())`` quantizes on load: each linear weight is
  quantized as soon as it (and the other members of its fused q/k/v or gate/up group, which share one global scale)
  has been read, so the target device never holds more than one group in full precision. The arithmetic runs in the
  dtype the weight has *in the checkpoint* (a bf16 checkpoint loaded with ``dtype=torch.float32`` is quantized in
  bf16), so RTN gives the bytes llm-compressor's ``NVFP4A16`` gives for that checkpoint whatever the load dtype.
* ``save_pretrained`` / ``push_to_hub`` write the compressed-tensors tensors (``weight_packed``, ``weight_scale``,
  ``weight_global_scale``) under the compressed-tensors ``quantization_config`` that llm-compressor writes for
  ``NVFP4A16`` (``quant_method="compressed-tensors"``, one fp4 group-16 ``tensor_group`` config group), so stock
  transformers (with ``compressed-tensors`` installed) and stock vLLM load the checkpoint, and anything that does not
  know the format fails loudly instead of initialising the linears at random. What only our loader uses (the
  calibration method, the fused groups) sits under the key ``"qerl"``, which compressed-tensors ignores.
  ``NVFP4Config(serialization="nvfp4_w4a16")`` writes the previous, QeRL-only config instead.
* :func:`from_compressed_tensors` (or :func:`load_nvfp4_checkpoint`, which takes either config) loads such a checkpoint
  into ``NVFP4Linear`` on our kernels; transformers picks its quantizer from ``quant_method`` alone, so a plain
  ``from_pretrained`` of a compressed-tensors checkpoint goes through compressed-tensors, not through us.
* ``from_pretrained(path)`` still loads checkpoints written with the old ``nvfp4_w4a16`` config after ``import nvfp4``.
* MXFP4 (issue #22): ``NVFP4Config(format="mxfp4")`` (or :func:`MXFP4Config`) does all of the above for
  compressed-tensors ``mxfp4-pack-quantized`` (llm-compressor ``MXFP4A16``: uint8 E8M0 ``weight_scale`` per 32
  inputs, no global scale), round to nearest only; the layers are ``NVFP4Linear(format="mxfp4")``, which compute
  through the NVFP4 kernels after an exact scale transcode (:func:`nvfp4.mxfp4.to_nvfp4`).
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .calibration import calibrate_model
from .formats import (
    CT_METHOD,
    FORMATS,
    MXFP4,
    NVFP4,
    UNTARGETED_PREFIX,
    Format,
    compressed_tensors_format,
    compressed_tensors_untargeted,
    get_format,
)
from .linear import (
    CONVERTED_MODEL_HOOKS,
    DEFAULT_FUSED_GROUPS,
    DEFAULT_MODULES_TO_NOT_CONVERT,
    NVFP4Linear,
    _fused_group_names,
    _module_names,
    _quantizable,
    _tied_linears,
    _warn_unmatched,
    fused_group_of,
    nothing_to_quantize,
)
from .methods import CALIBRATED_METHODS, METHODS

__all__ = [
    "QUANT_METHOD",
    "STOCK_LOAD_DTYPE",
    "MXFP4Config",
    "NVFP4CheckpointError",
    "NVFP4Config",
    "NVFP4HfQuantizer",
    "compressed_tensors_config",
    "from_compressed_tensors",
    "load_nvfp4_checkpoint",
    "nvfp4_checkpoint_kind",
    "save_pretrained_by_blocks",
]

QUANT_METHOD = "nvfp4_w4a16"
FORMAT = "nvfp4-pack-quantized"
SERIALIZATIONS = (CT_METHOD, QUANT_METHOD)


def compressed_tensors_config(
    ignore: list[str], qerl: dict[str, Any] | None = None, format: Format = NVFP4
) -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor writes for ``NVFP4A16`` (weight-only NVFP4, round to nearest) or,
    with ``format="mxfp4"``, ``MXFP4A16`` (group 32, ``strategy: group``, uint8 E8M0 scales), with ``ignore`` the
    modules kept dense and our own fields under ``"qerl"`` (ignored by compressed-tensors)."""
    fmt = format
    cfg: dict[str, Any] = {
        "quant_method": CT_METHOD,
        "format": fmt.ct_format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": fmt.group_size,
                            "strategy": fmt.ct_strategy, "dynamic": False, "actorder": None, "block_structure": None,
                            "observer": "memoryless_minmax", "observer_kwargs": {},
                            "scale_dtype": fmt.ct_scale_dtype, "zp_dtype": None},  # fmt: skip
                "input_activations": None,
                "output_activations": None,
                "format": fmt.ct_format,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
    if qerl:
        cfg["qerl"] = dict(qerl)
    return cfg


def _check_compressed_tensors_nvfp4(qc: dict[str, Any], where: str) -> Format:
    """The :class:`Format` of ``qc`` if it is a weight-only NVFP4 or MXFP4 compressed-tensors config
    (:func:`nvfp4.formats.compressed_tensors_format`); raise :class:`NVFP4CheckpointError` naming ``where``
    otherwise."""
    try:
        return compressed_tensors_format(qc)
    except ValueError as e:
        raise NVFP4CheckpointError(f"{where}: {e}") from None


def MXFP4Config(**kwargs: Any) -> NVFP4Config:  # noqa: N802 (a config "class" for discoverability)
    """``NVFP4Config(format="mxfp4", **kwargs)``: weight-only MXFP4 (compressed-tensors ``MXFP4A16``, round to nearest)
    for ``from_pretrained(..., quantization_config=MXFP4Config())``; one config class serves both formats."""
    if "format" in kwargs:  # the format is what this name says
        raise ValueError(f"MXFP4Config(format={kwargs['format']!r}): use NVFP4Config(format=...) to choose a format")
    return NVFP4Config(**{**kwargs, "format": MXFP4.name})


class NVFP4CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unreadable/truncated safetensors, or tensors that disagree with the config."""


@register_quantization_config(QUANT_METHOD)
class NVFP4Config(QuantizationConfigMixin):
    """Weight-only NVFP4 (E2M1 values, FP8-E4M3 scale per 16 inputs, FP32 scale per tensor) for ``from_pretrained``.

    Args:
        method: calibration at load time: ``"rtn"`` (round to nearest, llm-compressor ``NVFP4A16`` byte-identical),
            ``"mse"`` (per-block scale search), or, with ``calibration_data``, ``"awq"`` (activation-weighted scale
            search) or ``"gptq"`` (error-compensating rounding, :func:`nvfp4.calibration.gptq_quantize`). The
            calibrated methods load the model dense first, run it on the data, then quantize
            (:func:`nvfp4.calibration.calibrate_model`), so they need the dense model's memory once.
        calibration_data: for ``"awq"`` / ``"gptq"``: token ids, each an int64 tensor ``[T]`` or ``[B, T]`` (or a list
            of ints), or a dict of model keyword arguments (``input_ids``, ``attention_mask``); one tensor or dict
            (a tokenizer's batch) is one batch. Not saved with the
            checkpoint; its count is (``"calibration_samples"`` under ``"qerl"``).
        modules_to_not_convert: names / suffixes / regexes (or compressed-tensors ``re:`` entries) kept in full
            precision, a module's name keeping every linear under it (``"model.layers.0"``) (default ``["lm_head"]``;
            embeddings are never converted).
        fused_groups: sibling linears that share one global scale (engines fuse them).
        format: the 4-bit format: ``"nvfp4"`` (default; compressed-tensors ``"nvfp4-pack-quantized"``) or
            ``"mxfp4"`` (``"mxfp4-pack-quantized"``: E8M0 scale per 32 inputs, no global scale, llm-compressor
            ``MXFP4A16``; ``method="rtn"`` only, fused groups share nothing). Stored as the compressed-tensors string.
        serialization: the ``quantization_config`` that ``save_pretrained`` writes: ``"compressed-tensors"``
            (default; what llm-compressor writes for ``NVFP4A16``: stock transformers and vLLM load it, our fields
            under ``"qerl"``) or ``"nvfp4_w4a16"`` (the previous config, read only with ``import nvfp4``).
    """

    def __init__(
        self,
        method: str = "rtn",
        modules_to_not_convert: list[str] | None = None,
        fused_groups: list[list[str]] | None = None,
        format: str = FORMAT,
        serialization: str = CT_METHOD,
        calibration_data: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        if serialization not in SERIALIZATIONS:
            raise ValueError(f"NVFP4Config(serialization={serialization!r}): choose one of {SERIALIZATIONS}")
        self.serialization = serialization
        if method not in METHODS:
            raise ValueError(f"NVFP4Config(method={method!r}): choose one of {METHODS}")
        # one tokenizer batch (an int tensor [B, T], or a BatchEncoding / dict of model inputs) is one batch: iterated,
        # a dict gave its keys (read as texts) and a tensor its rows, after `bool(tensor)` had failed
        if isinstance(calibration_data, (torch.Tensor, Mapping)):
            calibration_data = [calibration_data]
        if calibration_data is not None and method not in CALIBRATED_METHODS:
            raise ValueError(f"NVFP4Config(method={method!r}) takes no calibration_data (only {CALIBRATED_METHODS} do)")
        if calibration_data is not None and len(calibration_data) == 0:
            raise ValueError("NVFP4Config(calibration_data=[]): give at least one calibration sample")
        # texts are the likely mistake: torch's own error ("new(): invalid data type 'str'") came after the dense load
        text = next((i for i, item in enumerate(calibration_data or []) if isinstance(item, str)), None)
        if text is not None:
            raise ValueError(f"NVFP4Config: calibration_data[{text}]: a string; expected token ids (int tensors [T] or "
                             "[B, T], or lists of ints): tokenize the texts first, e.g. tokenizer(text, "
                             "return_tensors='pt')['input_ids']")  # fmt: skip
        self.calibration_data = calibration_data
        try:
            fmt = get_format(format)
        except ValueError:
            choices = sorted({*FORMATS, *(f.ct_format for f in FORMATS.values())})
            raise ValueError(f"NVFP4Config(format={format!r}): choose one of {choices}") from None
        try:
            fmt.check_options(f"NVFP4Config(format={fmt.name!r}, method={method!r})", method)
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
        self.method = method
        self.modules_to_not_convert = list(
            _module_names(modules_to_not_convert, "NVFP4Config: modules_to_not_convert")
            if modules_to_not_convert is not None
            else DEFAULT_MODULES_TO_NOT_CONVERT
        )
        # [] means no fused groups (as in quantize_model), so only None takes the default
        groups = DEFAULT_FUSED_GROUPS if fused_groups is None else fused_groups
        self.fused_groups = [list(g) for g in _fused_group_names(groups, "NVFP4Config: fused_groups")]
        self.format = fmt.ct_format  # what saved configs have always carried for NVFP4 (the serialized name)
        #: the :class:`nvfp4.formats.Format` this config quantizes to (NVFP4 or MXFP4), looked up once, here
        self.weight_format: Format = fmt
        self.weight_block_size = fmt.group_size
        # a typo (modules_to_not_covert=...) was kept as an unknown option and silently did nothing; fields a saved
        # config has that this version does not know come through from_dict / from_compressed_tensors_dict instead
        unknown = [k for k in kwargs if k not in _SAVED_FIELDS]
        if unknown:
            raise TypeError(f"NVFP4Config: unknown option {unknown[0]!r}; the options are {', '.join(_OPTIONS)}")
        self.extra = {k: v for k, v in kwargs.items() if k not in ("quant_method", "weight_block_size")}
        if calibration_data is not None:
            self.extra["calibration_samples"] = len(calibration_data)

    def _dense_names(self) -> list[str]:
        """``modules_to_not_convert`` as a written config gives it (:meth:`to_dict`, pickling). For a config bound to
        its model (:func:`_bound_to`: by a load, a conversion in memory, :func:`save_pretrained_by_blocks`) it also
        names every linear of the model left dense that compressed-tensors would otherwise take as quantized, as the
        model holds them now: a tied lm_head, whose weight never reached the quantizer; a suffix or regex of ours,
        which compressed-tensors reads as an exact name; linears PEFT's ``merge_and_unload`` made dense after the
        conversion. A saved config must name them, or every reader (ours, compressed-tensors, vLLM) looks for their
        4-bit tensors. The entry naming the linears a loaded checkpoint's config groups did not target
        (:func:`nvfp4.formats.compressed_tensors_untargeted`) is replaced by their names: stock vLLM matches
        ``ignore`` against a fused layer's own name first (``gate_up_proj``, no target), so the lookahead kept fused
        quantized layers dense there."""
        ref = getattr(self, "_model_ref", None)
        model = ref() if ref is not None else None
        if model is None:
            return self.modules_to_not_convert
        return _naming_dense_linears(self.modules_to_not_convert, model)

    def __getstate__(self) -> dict[str, Any]:
        # pickle / deepcopy / copy.copy: no weakref to the model, the dense linears as it holds them now (_bound_to
        # copies without coming through here)
        state = dict(self.__dict__)
        state.pop("_model_ref", None)
        state["modules_to_not_convert"] = self._dense_names()
        return state

    def to_dict(self) -> dict[str, Any]:
        """What ``save_pretrained`` writes as ``quantization_config`` (see ``serialization``)."""
        ours = {
            "quant_method": QUANT_METHOD,
            "format": self.format,
            "method": self.method,
            "weight_block_size": self.weight_block_size,
            "modules_to_not_convert": self._dense_names(),
            "fused_groups": self.fused_groups,
            **self.extra,
        }
        if self.serialization == QUANT_METHOD:
            return ours
        ignore = [m for m in ours["modules_to_not_convert"] if m]  # names, suffixes and regexes, as compressed-tensors
        return compressed_tensors_config(
            ignore, qerl={k: v for k, v in ours.items() if k != "format"}, format=self.weight_format
        )

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """transformers' reader of :meth:`to_dict`'s output; the compressed-tensors dict it writes by default is read
        as :meth:`from_compressed_tensors_dict` reads it (as keyword arguments its method, format and ignore list
        were lost and its fields taken as unknown options)."""
        if config_dict.get("quant_method") == CT_METHOD:
            ours = cls.from_compressed_tensors_dict(config_dict)
            ours.serialization = QUANT_METHOD
            config_dict = {**ours.to_dict(), "serialization": CT_METHOD}
        config_dict, later = _known_fields(config_dict)
        got = super().from_dict(config_dict, return_unused_kwargs, **kwargs)
        (got[0] if return_unused_kwargs else got).extra.update(later)
        return got

    @classmethod
    def from_compressed_tensors_dict(cls, qc: dict[str, Any], where: str = "quantization_config") -> NVFP4Config:
        """The config of a compressed-tensors NVFP4A16 / MXFP4A16 checkpoint (ours: from its ``"qerl"`` fields;
        llm-compressor's: ``ignore`` as ``modules_to_not_convert``). Raises :class:`NVFP4CheckpointError` for any
        other config."""
        fmt = _check_compressed_tensors_nvfp4(qc, where)
        ours = dict(qc.get("qerl") or {})
        ours["format"] = fmt.ct_format
        method = ours.pop("method", "rtn")
        ours.pop("quant_method", None)
        ours.pop("weight_block_size", None)
        if "modules_to_not_convert" not in ours:
            # an empty ``ignore`` means every Linear is quantized (lm_head too); only a config without one keeps lm_head.
            # compressed-tensors applies "re:" entries with re.match (a prefix), ours with re.fullmatch: add ".*"
            ignore = qc.get("ignore")
            ours["modules_to_not_convert"] = (
                ["lm_head"] if ignore is None else [f"(?:{p[3:]}).*" if p.startswith("re:") else p for p in ignore]
            )
        untargeted = compressed_tensors_untargeted(qc)  # linears no config group targets were saved dense
        if untargeted is not None and untargeted not in ours["modules_to_not_convert"]:
            ours["modules_to_not_convert"] = [*ours["modules_to_not_convert"], untargeted]
        ours, later = _known_fields(ours)
        cfg = cls(method=method, **ours)
        cfg.extra.update(later)  # a later version's fields, written back as they came
        return cfg


#: NVFP4Config's keyword arguments, then the fields a saved config adds (read back by from_dict)
_OPTIONS = ("method", "modules_to_not_convert", "fused_groups", "format", "serialization", "calibration_data")
_SAVED_FIELDS = ("quant_method", "weight_block_size", "calibration_samples")


def _known_fields(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A saved config's ``fields`` split into those :class:`NVFP4Config` takes and those it does not know (written by
    another version), which the read config keeps in ``extra`` as they came."""
    known = {k: v for k, v in fields.items() if k in _OPTIONS or k in _SAVED_FIELDS}
    return known, {k: v for k, v in fields.items() if k not in known}


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _mark_initialized(module: nn.Module) -> None:
    # transformers re-initialises tensors without this flag after loading (and nn.Linear gets normal_ init).
    module._is_hf_initialized = True
    for t in list(module.buffers()) + list(module.parameters()):
        t._is_hf_initialized = True


def check_safetensors_files(files: list[str] | None) -> None:
    """Raise :class:`NVFP4CheckpointError` if a safetensors file is unreadable or shorter than its header says."""
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            continue
        size = os.path.getsize(f)
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit in a {size}-byte file")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise NVFP4CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        if 8 + n + end > size:
            raise NVFP4CheckpointError(
                f"{f}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}"
            )


_SAFETENSORS_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _safetensors_float_dtypes(files: list[str] | None) -> dict[str, torch.dtype]:
    """Floating dtype of every tensor in the safetensors ``files``, read from their headers (no tensor is loaded)."""
    dtypes: dict[str, torch.dtype] = {}
    for f in files or []:
        if not str(f).endswith(".safetensors"):
            continue
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for key, info in header.items():
            if key != "__metadata__" and info.get("dtype") in _SAFETENSORS_FLOAT_DTYPES:
                dtypes[key] = _SAFETENSORS_FLOAT_DTYPES[info["dtype"]]
    return dtypes


@register_quantizer(QUANT_METHOD)
class NVFP4HfQuantizer(HfQuantizer):
    """Quantize on load (bf16 checkpoint + :class:`NVFP4Config`) or load our NVFP4 checkpoints."""

    requires_calibration = False

    def __init__(self, quantization_config: NVFP4Config, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self._targets: set[str] = set()
        self._stored_dtypes: dict[str, torch.dtype] = {}  # checkpoint key -> dtype of that tensor in the file

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return torch.bfloat16 if dtype is None else dtype

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            return 0.5 + 1 / self.quantization_config.weight_format.group_size  # nibbles + one 1-byte scale per group
        return super().param_element_size(model, param_name, param)

    def param_needs_quantization(self, model, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False
        module_name, _, tensor = param_name.rpartition(".")
        return tensor == "weight" and module_name in self._targets

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs: Any):
        check_safetensors_files(checkpoint_files)
        cfg = self.quantization_config
        calibrated = not self.pre_quantized and cfg.method in CALIBRATED_METHODS
        if calibrated and not getattr(cfg, "calibration_data", None):
            raise ValueError(
                f"NVFP4Config(method={cfg.method!r}) needs calibration_data (token ids of a few dozen task prompts) "
                "to quantize a dense checkpoint; 'rtn' and 'mse' need none"
            )
        fmt = cfg.weight_format
        eligible = [
            n for n, m in model.named_modules() if _quantizable(n, m, cfg.modules_to_not_convert, fmt.group_size)
        ]
        if not self.pre_quantized and not calibrated:  # calibrate_model warns for the calibrated methods
            _warn_unmatched(model, cfg.modules_to_not_convert, "NVFP4Config: modules_to_not_convert")
        if not eligible and not self.pre_quantized:  # nothing would be quantized: a dense model under a 4-bit config
            raise ValueError(f"NVFP4Config: {nothing_to_quantize(model, fmt)}")
        if self.pre_quantized:
            for name in eligible:
                lin = model.get_submodule(name)
                new = NVFP4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype,
                                  device="meta", format=fmt, name=name)  # fmt: skip
                _replace(model, name, new)
            if checkpoint_files:
                self._check_prequantized_tensors(model, checkpoint_files)
        elif calibrated:  # the model loads dense; _process_model_after_weight_loading calibrates and quantizes
            self._targets = set()
        else:
            self._targets = set(eligible)
            self._stored_dtypes = _safetensors_float_dtypes(checkpoint_files)
            self._prefix = getattr(model, "base_model_prefix", "")
        return model

    def _quantization_input(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` back in its checkpoint dtype when the loader widened it (exact), so RTN sees the stored values in the
        dtype llm-compressor would quantize them in; otherwise ``w`` itself."""
        key = f"{name}.weight"
        prefix = getattr(self, "_prefix", "")
        stored = self._stored_dtypes.get(key)
        if stored is None and prefix:
            alt = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else f"{prefix}.{key}"
            stored = self._stored_dtypes.get(alt)
        if stored is not None and stored.itemsize < w.dtype.itemsize:
            return w.to(stored)
        return w

    def _check_prequantized_tensors(self, model, files: list[str]) -> None:
        from safetensors import safe_open

        names = set()
        for f in files:
            if str(f).endswith(".safetensors"):
                with safe_open(f, "pt") as fh:
                    names |= set(fh.keys())
        prefix = getattr(model, "base_model_prefix", "")
        missing = []
        for name, mod in model.named_modules():
            if isinstance(mod, NVFP4Linear):
                key = f"{name}.weight_packed"
                alt = key[len(prefix) + 1 :] if prefix and key.startswith(prefix + ".") else f"{prefix}.{key}"
                if key not in names and alt not in names:
                    missing.append(key)
        if missing:
            raise NVFP4CheckpointError(
                f"the checkpoint's quantization_config ({QUANT_METHOD}) says {len(missing)} linear layer(s) are "
                f"{self.quantization_config.weight_format.name.upper()}, "
                f"but their tensors are absent, e.g. {missing[:3]}; the config disagrees with the tensors"
            )

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs: Any):
        cfg = self.quantization_config
        if not self.pre_quantized and cfg.method in CALIBRATED_METHODS:
            was_training = model.training
            model.eval()
            # tied linears (lm_head sharing the embedding) stay dense, as quantize on load leaves them: an NVFP4
            # lm_head has no weight parameter for transformers to tie, and the load failed after calibrating
            skip = [*cfg.modules_to_not_convert, *_tied_linears(model)]
            calibrate_model(model, cfg.method, _calibration_batches(cfg.calibration_data, model),
                            modules_to_not_convert=skip, fused_groups=cfg.fused_groups)  # fmt: skip
            model.train(was_training)
            for m in model.modules():
                if isinstance(m, NVFP4Linear):
                    _mark_initialized(m)
        for _group, got in list(self._pending.items()):  # a group whose other members were never loaded
            self._flush(model, tuple(got), got, None)
        self._pending.clear()
        # the saved config names the linears this model holds dense when it is written (NVFP4Config._dense_names)
        self.quantization_config = model.config.quantization_config = _bound_to(cfg, model)
        bad = [
            n
            for n, m in model.named_modules()
            if isinstance(m, NVFP4Linear) and any(t.is_meta for t in m.buffers())
        ]
        if bad:
            raise NVFP4CheckpointError(f"NVFP4 tensors were not loaded for {len(bad)} layer(s), e.g. {bad[:3]}")
        for m in model.modules():
            if isinstance(m, NVFP4Linear):
                # pre-quantized tensors arrive in the checkpoint layout (MXFP4: E8M0 scales, transcoded here)
                m.use_kernel_layout()
        return model

    def _flush(self, model, group: tuple[str, ...], weights: dict[str, torch.Tensor], missing_keys) -> None:
        """Quantize a complete fused group (with one shared global scale where the format has one) and swap its
        ``nn.Linear``s for ours."""
        cfg = self.quantization_config
        for name, q in cfg.weight_format.quantize_group(weights, method=cfg.method).items():
            old = model.get_submodule(name)
            dtype = old.weight.dtype  # the load dtype; the weights may be in the narrower checkpoint dtype
            w = weights[name]
            bias = old.bias.detach().to(w.device) if old.bias is not None and not old.bias.is_meta else None
            new = NVFP4Linear.from_weight(q, bias, dtype, name=name)
            if old.bias is not None and bias is None:  # bias not read yet: keep a slot for the loader
                new.bias = nn.Parameter(torch.empty(old.out_features, dtype=dtype, device="meta"), False)
            _mark_initialized(new)
            _replace(model, name, new)
            if missing_keys is not None:
                missing_keys.discard(f"{name}.weight")
            self._targets.discard(name)

    def is_serializable(self, **kwargs: Any) -> bool:
        return True

    def _dequantize(self, model, dtype: torch.dtype | None = None):
        """``model.dequantize()``: every :class:`NVFP4Linear` becomes a plain ``nn.Linear`` holding ``dequant(W)`` in
        ``dtype`` (transformers passes the model's), trainable as a loaded dense linear is; transformers then removes
        the quantization config."""
        if isinstance(dtype, str):  # a config's dtype may be its name
            dtype = getattr(torch, dtype.removeprefix("torch."))
        for name, m in list(model.named_modules()):
            if isinstance(m, NVFP4Linear):
                dense = m.to_dense().to(dtype) if dtype is not None else m.to_dense()
                _replace(model, name, dense.requires_grad_(True))
        return model

    def get_state_dict_and_metadata(self, model):
        """``save_pretrained``'s hook (the state dict is the model's own); warns when the checkpoint will not run in
        stock transformers with its own dtype (see :data:`STOCK_LOAD_DTYPE`). Runs before transformers writes the
        config, which must name the linears the model holds dense now (PEFT's own ``merge_and_unload`` swaps an
        adapted 4-bit layer for ``nn.Linear(dequant(W) + ΔW)``), or every reader looks for their 4-bit tensors: the
        config is bound to the model again (:func:`_bound_to`)."""
        warn_if_not_stock_loadable(model.dtype)
        self.quantization_config = model.config.quantization_config = _bound_to(self.quantization_config, model)
        return super().get_state_dict_and_metadata(model)

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters train through NVFP4Linear

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return False


def _naming_dense_linears(names: list[str], model: nn.Module) -> list[str]:
    """``names`` (a ``modules_to_not_convert``) without the untargeted entry, then the linears ``model`` holds dense
    that they leave to compressed-tensors as quantized (sorted); see :meth:`NVFP4Config._dense_names`."""
    kept = [p for p in names if not p.startswith(UNTARGETED_PREFIX)]
    return [*kept, *_linears_ct_would_quantize(model, kept)]


def _bound_to(cfg: NVFP4Config, model: nn.Module) -> NVFP4Config:
    """A copy of ``cfg`` bound to ``model``, the one way a config names its model's dense linears
    (:meth:`NVFP4Config._dense_names`): ``modules_to_not_convert`` names those dense now, and the copy keeps a weakref
    to ``model`` so that, written later, it names those made dense since (after the earlier ones, as saved configs
    have always listed them). A copy: the caller's config may serve another model next. Made from the attributes as
    they are, not through ``copy.copy`` (whose ``__getstate__`` freezes the names of a model ``cfg`` is bound to)."""
    bound = object.__new__(type(cfg))
    bound.__dict__.update(cfg.__dict__)
    bound.modules_to_not_convert = _naming_dense_linears(cfg.modules_to_not_convert, model)
    bound._model_ref = weakref.ref(model)
    return bound


def _linears_ct_would_quantize(model: nn.Module, ignore: list[str]) -> list[str]:
    """Names of the dense linears of ``model`` that compressed-tensors would take as quantized under ``ignore``: its
    ``match_name`` skips a module only for an exact name or a ``re:`` regex, while ours also match suffixes and bare
    regexes (:func:`nvfp4.linear._matches`)."""
    exact = set(ignore)
    regexes = [re.compile(p[3:]) for p in ignore if p.startswith("re:")]
    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, NVFP4Linear)
        and n not in exact and not any(r.match(n) for r in regexes)
    )  # fmt: skip


def _record_quantization_config(
    model: nn.Module, method: str, fused_groups: list[tuple[str, ...]], fmt: Format
) -> None:
    """Give a transformers model converted in memory (:func:`nvfp4.quantize_model`,
    :func:`nvfp4.calibration.calibrate_model`) the :class:`NVFP4Config` its ``save_pretrained`` writes and our loaders
    read (:data:`nvfp4.linear.CONVERTED_MODEL_HOOKS`); a config it had before (quantized on load) is kept."""
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        return
    earlier = getattr(config, "quantization_config", None)
    if earlier is not None and not getattr(earlier, "_converted_in_memory", False):
        return
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not any(isinstance(m, NVFP4Linear) for _, m in linears):
        return
    # the dense linears by exact name: true to the model whatever each call skipped (a model converted in parts)
    dense = [n for n, m in linears if not isinstance(m, NVFP4Linear)]
    cfg = NVFP4Config(method=method, modules_to_not_convert=dense, fused_groups=[list(g) for g in fused_groups],
                      format=fmt.name)  # fmt: skip
    cfg._converted_in_memory = True  # a later conversion of this model records the config again
    config.quantization_config = _bound_to(cfg, model)  # linears made dense later (a PEFT merge) are named when written


CONVERTED_MODEL_HOOKS.append(_record_quantization_config)


#: The dtype compressed-tensors (0.20) decompresses FP4 weights to: a stock ``from_pretrained`` of one of our checkpoints
#: runs only when the checkpoint's dense tensors have this dtype (or the load passes ``dtype=torch.bfloat16``); an
#: fp16/fp32 checkpoint otherwise fails at the first forward (a bf16 linear meets fp16/fp32 activations).
STOCK_LOAD_DTYPE = torch.bfloat16


def warn_if_not_stock_loadable(dtype: torch.dtype) -> None:
    """Warn that a checkpoint saved in ``dtype`` loads in stock transformers only with ``dtype=torch.bfloat16``."""
    if dtype != STOCK_LOAD_DTYPE:
        warnings.warn(
            f"saving a 4-bit checkpoint whose dense tensors are {str(dtype).removeprefix('torch.')}: compressed-tensors "
            "decompresses FP4 weights to bfloat16, so a stock transformers from_pretrained of it fails at the first "
            "forward unless it passes dtype=torch.bfloat16 (nvfp4.from_compressed_tensors and vLLM load it as it "
            "is); load the model in bfloat16 before saving for a checkpoint that loads anywhere as it is",
            stacklevel=4,
        )


def _calibration_batches(data: list[Any], model: nn.Module) -> list[Any]:
    """``NVFP4Config.calibration_data`` as model inputs on the model's device: ``[1, T]`` / ``[B, T]`` int64 tensors or
    keyword dicts."""
    device = next(p.device for p in model.parameters() if not p.is_meta)
    batches = []
    for i, item in enumerate(data):
        if isinstance(item, Mapping):  # a BatchEncoding is a Mapping, not a dict
            batches.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in item.items()})
            continue
        ids = item if isinstance(item, torch.Tensor) else torch.tensor(item)
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2) or ids.numel() == 0:
            raise ValueError(
                f"calibration_data[{i}]: expected token ids (a non-empty int tensor [T] or [B, T], or a list of ints), "
                f"got {type(item).__name__} {tuple(ids.shape)} {ids.dtype}"
            )
        batches.append(ids.reshape(1, -1).to(device, torch.int64) if ids.dim() == 1 else ids.to(device, torch.int64))
    return batches


class _QuantizeOnLoad(ConversionOps):
    """transformers ``ConversionOps``: collects a fused group's bf16 weights, then quantizes them together."""

    def __init__(self, quantizer: NVFP4HfQuantizer) -> None:
        self.q = quantizer

    def convert(self, input_dict: dict[str, Any], model=None, full_layer_name: str | None = None, missing_keys=None, **_):
        for key, value in input_dict.items():
            w = value[0] if isinstance(value, list) else value
            name = key.rpartition(".")[0]
            # members stay in `_targets` until their group is flushed, so this is the group still to be collected
            cfg = self.q.quantization_config
            # members of a fused group share a global scale where the format has one, so they are quantized together
            shared = cfg.weight_format.has_global_scale
            full = (fused_group_of(name, cfg.fused_groups) if shared else None) or (name,)
            group = tuple(n for n in full if n in self.q._targets)
            got = self.q._pending.setdefault(group, {})
            got[name] = self.q._quantization_input(name, w)
            if all(n in got for n in group):
                del self.q._pending[group]
                self.q._flush(model, group, got, missing_keys)
        return {}


def _checkpoint_quantization_config(path: str | Path) -> dict[str, Any] | None:
    text = os.path.expanduser(str(path))
    # a local path that is not there: transformers took it for a Hub id ("Repo id must be in the form ...")
    if not os.path.exists(text) and (text.startswith((".", "/")) or text.count("/") > 1):
        raise FileNotFoundError(f"{path}: no such checkpoint folder (give a local folder or a Hub id)")
    qc = getattr(AutoConfig.from_pretrained(text), "quantization_config", None)
    return qc if isinstance(qc, dict) or qc is None else qc.to_dict()


def nvfp4_checkpoint_kind(path: str | Path) -> str | None:
    """``"compressed-tensors"`` (a weight-only NVFP4 or MXFP4 compressed-tensors checkpoint: ours, or
    llm-compressor's ``NVFP4A16`` / ``MXFP4A16``), ``"nvfp4_w4a16"`` (ours with the previous config) or None
    (anything else) for a local folder or Hub id."""
    qc = _checkpoint_quantization_config(path)
    if not qc:
        return None
    if qc.get("quant_method") == QUANT_METHOD:
        return QUANT_METHOD
    try:
        _check_compressed_tensors_nvfp4(qc, str(path))
    except NVFP4CheckpointError:
        return None
    return CT_METHOD


def from_compressed_tensors(path: str | Path, config: PretrainedConfig | None = None, **kwargs: Any) -> nn.Module:
    """Load a compressed-tensors ``NVFP4A16`` or ``MXFP4A16`` checkpoint (``nvfp4-pack-quantized`` /
    ``mxfp4-pack-quantized``: ours, or llm-compressor's) into ``NVFP4Linear`` layers on our kernels.

    The tensors are ours; only the config names compressed-tensors (``quant_method="compressed-tensors"`` with
    ``config_groups``), so transformers would route a plain ``from_pretrained`` to compressed-tensors. Modules in
    the checkpoint's ``ignore`` stay dense. Other ``kwargs`` go to ``AutoModelForCausalLM.from_pretrained``; the
    model's ``config.quantization_config`` is then ours, and ``save_pretrained`` writes the compressed-tensors config
    again. ``config``: the model config to load with (a copy of it: another attention implementation, fewer layers),
    by default the checkpoint's; the quantization is always the checkpoint's.
    """
    qc = _checkpoint_quantization_config(path)
    if not qc or qc.get("quant_method") == QUANT_METHOD:
        raise NVFP4CheckpointError(f"{path}: {_not_compressed_tensors(qc)}")
    config = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(path)
    ours = NVFP4Config.from_compressed_tensors_dict(qc, str(path))
    ours.serialization = QUANT_METHOD  # this load goes to our quantizer; the model's config saves compressed-tensors
    config.quantization_config = ours.to_dict()
    return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)


@torch.no_grad()
def save_pretrained_by_blocks(
    model: nn.Module,
    folder: str | Path,
    blocks: list[str],
    fill: Any,
    config: NVFP4Config | None = None,
    progress: bool = True,
) -> Path:
    """``save_pretrained`` of ``model`` quantized as ``from_pretrained(..., quantization_config=config)`` would, for a
    model too large to exist dense: block by block, each dense only while it is quantized and written.

    Args:
        model: a transformers model on the meta device (its ``config`` and ``generation_config`` are saved).
        folder: created; receives one ``model-XXXXX-of-YYYYY.safetensors`` shard per block, the index, ``config.json``
            (the compressed-tensors ``quantization_config`` of ``config``) and ``generation_config.json``.
        blocks: module names, in the order ``fill`` is called, that together hold every parameter and buffer
            (e.g. ``model.layers.0`` … ``model.layers.N-1``, ``model.embed_tokens``, ``model.norm``, ``lm_head``).
        fill: ``fill(module)`` materialises one block in place (dense, on the device the quantization runs on); the
            dense dtype it leaves is the one RTN runs in, as on load.
        config: :class:`NVFP4Config` (default: NVFP4 RTN); calibrated methods are refused (they need the dense model).
        progress: a progress bar over the blocks (each filled, quantized and written: minutes for a large model).

    Returns ``folder``. Raises ``ValueError`` when a tensor is in no block (or for a calibrated method).
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from .linear import quantize_model

    cfg = config or NVFP4Config()
    if cfg.method in CALIBRATED_METHODS:
        raise ValueError(f"save_pretrained_by_blocks: method {cfg.method!r} calibrates the dense model; use rtn or mse")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, dtype = 0, None
    bar = tqdm(blocks, desc=f"Saving {cfg.weight_format.name.upper()} by blocks", unit="block", disable=not progress)
    for i, name in enumerate(bar):
        block = model.get_submodule(name)
        fill(block)
        dtype = dtype or next((p.dtype for p in block.parameters() if p.is_floating_point()), None)
        quantize_model(model, method=cfg.method, modules_to_not_convert=cfg.modules_to_not_convert,
                       fused_groups=cfg.fused_groups, format=cfg.weight_format.name, progress=False)  # fmt: skip
        shard = f"model-{i + 1:05d}-of-{len(blocks):05d}.safetensors"
        tensors = {f"{name}.{k}": v.detach().to("cpu").contiguous() for k, v in block.state_dict().items()}
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        block.to("meta")
    missing = [k for k in model.state_dict() if k not in weight_map]
    if missing:
        raise ValueError(f"save_pretrained_by_blocks: {len(missing)} tensors in no block, e.g. {missing[:3]}")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf_config = model.config.__class__.from_dict(model.config.to_dict())
    hf_config.dtype = dtype
    hf_config.quantization_config = _bound_to(cfg, model)
    hf_config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return folder


def load_nvfp4_checkpoint(path: str | Path, **kwargs: Any) -> nn.Module:
    """Load an NVFP4 checkpoint of either config (compressed-tensors, or the previous ``nvfp4_w4a16``) into
    ``NVFP4Linear``; ``kwargs`` go to ``AutoModelForCausalLM.from_pretrained``."""
    kind = nvfp4_checkpoint_kind(path)
    if kind == QUANT_METHOD:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    qc = _checkpoint_quantization_config(path)
    # every compressed-tensors config goes there: one that is not weight-only NVFP4/MXFP4 (llm-compressor's W4A4
    # NVFP4, another format) is refused saying what disagrees, not as "not an NVFP4 checkpoint"
    if kind == CT_METHOD or (qc or {}).get("quant_method") == CT_METHOD:
        return from_compressed_tensors(path, **kwargs)
    if not qc:
        raise NVFP4CheckpointError(f"{path}: {_not_compressed_tensors(qc)}")
    raise NVFP4CheckpointError(f"{path}: not an NVFP4 checkpoint (quantization_config={qc!r})")


def _not_compressed_tensors(qc: dict[str, Any] | None) -> str:
    """Why :func:`from_compressed_tensors` does not load a checkpoint whose ``quantization_config`` is ``qc`` (None or
    ours with the previous config), and what does."""
    if not qc:
        return ("not an NVFP4 checkpoint but a dense one (no quantization_config): quantize it on load with "
                "AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config())")  # fmt: skip
    return (f"a checkpoint with the previous {QUANT_METHOD} config, not compressed-tensors: load it with "
            "nvfp4.load_nvfp4_checkpoint(path)")  # fmt: skip
