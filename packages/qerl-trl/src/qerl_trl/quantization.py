"""The ``quantization`` setting of ``qerl train`` / ``qerl eval``: one registry of schemes, parsed once.

Values are ``<format>-<method>``:

=================  ============================================================================================
``nvfp4-rtn``      NVFP4 (E2M1 + FP8 scale per 16 + FP32 per tensor), round to nearest (llm-compressor bytes)
``nvfp4-mse``      NVFP4, per-block scale search
``nvfp4-awq``      NVFP4, activation-weighted scale search, calibrated on the task's prompts
``nvfp4-gptq``     NVFP4, error-compensating rounding, calibrated on the task's prompts
``mxfp4-rtn``      MXFP4 (OCP microscaling: E2M1 + E8M0 scale per 32), round to nearest (compressed-tensors bytes)
``nf4``            bitsandbytes NF4 (QLoRA: blockwise absmax per 64, double-quantized absmax); needs
                   ``pip install 'qerl-trl[nf4]'`` (bitsandbytes)
``none``           the dense model (bf16 LoRA baseline)
=================  ============================================================================================

The user's string (CLI, YAML recipe, Python) is turned into a :class:`QuantScheme` by :func:`get_scheme`, once, where
it enters (``QeRLConfig``, ``qerl eval``'s ``--quantization``, :func:`qerl_trl.policy.load_policy`); the object then
flows on. A scheme knows its transformers quantization config (:meth:`QuantScheme.hf_config`), how to load a dense
checkpoint into a policy in it (:meth:`~QuantScheme.load`, with calibration data where it needs some), how to convert
a model already held (:meth:`~QuantScheme.quantize_`, torchao's ``quantize_(model, config)``), which layers and
kernels compute it (:attr:`~QuantScheme.layer_type`, :attr:`~QuantScheme.kernels`), and whether the vLLM rollout
engine takes it. Formats are :class:`nvfp4.formats.Format` objects here, never names to compare; optional backends
(bitsandbytes) are imported by the scheme that needs them, when it needs them.

The bare NVFP4 method names of earlier versions (``rtn``, ``mse``, ``awq``, ``gptq``) stay accepted as aliases of
``nvfp4-<method>``, so recipes and saved configs written with them keep working.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from nvfp4.formats import FORMATS, NVFP4, Format
from nvfp4.methods import CALIBRATED_METHODS
from nvfp4.offline import publish_checkpoint
from torch import nn

__all__ = [
    "ALIASES",
    "SCHEMES",
    "QuantScheme",
    "calibrated_checkpoint_path",
    "get_scheme",
    "keep_nf4_exact",
]

logger = logging.getLogger(
    "qerl_trl.policy"
)  # what `qerl train` prints: whether a calibrated policy was made or loaded


@dataclass(frozen=True)
class QuantScheme:
    """One ``quantization`` value: what the policy's frozen base weights become.

    Attributes:
        name: the canonical value (a key of :data:`SCHEMES`).
        format: the :class:`nvfp4.formats.Format` of the 4-bit weights (``None``: not an ``nvfp4`` format).
        method: the weight-only method within the format (``None`` for ``nf4`` and ``none``).
        kernels: what computes a forward of its linears.
        vllm_engine: whether ``rollout_engine="vllm"`` / ``qerl eval --engine vllm`` load its checkpoints.
    """

    name: str
    format: Format | None = None
    method: str | None = None
    kernels: str = ""
    vllm_engine: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration data (the task's prompts): ``*-awq`` / ``*-gptq``."""
        return self.method in CALIBRATED_METHODS

    @property
    def is_dense(self) -> bool:
        """``quantization="none"``: the weights stay as the checkpoint has them."""
        return False

    @property
    def cache_tag(self) -> str:
        """The name in cache keys (calibrated policies, vLLM checkpoints): the bare method for NVFP4, as earlier
        versions keyed them (their caches stay valid), the canonical name otherwise."""
        return self.name

    @property
    def layer_type(self) -> type[nn.Module]:
        """The module class the quantized linears of a policy in this scheme are."""
        raise NotImplementedError

    def hf_config(self, dtype: torch.dtype, *, calibration_data: Sequence[Any] | None = None,
                  double_quant: bool = True) -> Any:  # fmt: skip
        """The transformers ``quantization_config`` that quantizes a dense checkpoint on load (``None``: dense)."""
        raise NotImplementedError

    def load(
        self,
        path: str,
        *,
        dtype: torch.dtype,
        device_map: str | dict | None = None,
        calibration_data: Sequence[torch.Tensor] | None = None,
        cache_dir: str | Path | None = None,
        double_quant: bool = True,
    ) -> nn.Module:
        """Load the dense checkpoint at ``path`` as a policy in this scheme (quantized while loading, or calibrated on
        ``calibration_data`` then quantized; a calibrated policy is cached under ``cache_dir`` when given)."""
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": dtype}
        if device_map is not None:
            kwargs["device_map"] = device_map
        cfg = self.hf_config(dtype, calibration_data=calibration_data, double_quant=double_quant)
        if cfg is not None:
            kwargs["quantization_config"] = cfg
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)

    def quantize_(
        self, model: nn.Module, *, calibration_data: Sequence[Any] | None = None, double_quant: bool = True
    ) -> nn.Module:
        """Convert the linears of a loaded dense ``model`` in place and return it (torchao's ``quantize_``); as
        loading does, ``lm_head`` stays dense. ``calibration_data``: model inputs for the calibrated schemes;
        ``double_quant``: NF4's double quantization."""
        raise NotImplementedError


@dataclass(frozen=True)
class _FP4Scheme(QuantScheme):
    """NVFP4 or MXFP4 through :mod:`nvfp4` (``NVFP4Linear``, the ``nvfp4::`` ops)."""

    @property
    def cache_tag(self) -> str:
        # "rtn" for nvfp4-rtn, as before formats existed: calibrated policies and saved engine checkpoints stay valid
        return self.method if self.format is NVFP4 else self.name

    @property
    def layer_type(self) -> type[nn.Module]:
        from nvfp4 import NVFP4Linear

        return NVFP4Linear

    def hf_config(self, dtype, *, calibration_data=None, double_quant=True):
        from nvfp4 import NVFP4Config

        if self.calibrated and not calibration_data:
            raise ValueError(f"quantization={self.name!r} needs calibration_data (token ids of task prompts)")
        data = list(calibration_data) if self.calibrated else None
        return NVFP4Config(method=self.method, format=self.format, calibration_data=data)

    def load(self, path, *, dtype, device_map=None, calibration_data=None, cache_dir=None, double_quant=True):
        if not self.calibrated:
            return super().load(path, dtype=dtype, device_map=device_map, calibration_data=calibration_data)
        model = self._load_calibrated(path, dtype, device_map, calibration_data, cache_dir)
        # which calibration made these weights (model, method, prompts): the vLLM engine checkpoint saved from this
        # policy is keyed by it (qerl_trl.rollout.vllm.engine_checkpoint), not by the model and method alone
        model.qerl_calibration_id = calibrated_checkpoint_path(path, self.cache_tag, calibration_data or [], "").name
        return model

    def _load_calibrated(self, path, dtype, device_map, calibration_data, cache_dir) -> nn.Module:
        if cache_dir is None:
            return super().load(path, dtype=dtype, device_map=device_map, calibration_data=calibration_data)
        if not calibration_data:
            raise ValueError(f"quantization={self.name!r} needs calibration_data (token ids of task prompts)")
        from nvfp4.hf import load_nvfp4_checkpoint

        cached = calibrated_checkpoint_path(path, self.cache_tag, calibration_data, cache_dir)
        kwargs: dict[str, Any] = {"dtype": dtype} | ({"device_map": device_map} if device_map is not None else {})
        if (cached / "config.json").is_file():
            logger.info("loading the %s-calibrated policy from %s (no new calibration)", self.name, cached)
            return load_nvfp4_checkpoint(cached, **kwargs)
        model = super().load(path, dtype=dtype, device_map=device_map, calibration_data=calibration_data)
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return model  # every rank calibrated the same policy: one copy per machine is written, by local rank 0
        if publish_checkpoint(cached, model.save_pretrained):
            logger.info("saved the %s-calibrated policy to %s", self.name, cached)
        return model

    def quantize_(self, model, *, calibration_data=None, double_quant=True):
        if self.calibrated:
            from nvfp4.calibration import calibrate_model

            if not calibration_data:
                raise ValueError(f"quantization={self.name!r} needs calibration_data (model inputs of task prompts)")
            return calibrate_model(model, self.method, calibration_data, progress=False)
        from nvfp4 import quantize_model

        return quantize_model(model, method=self.method, format=self.format, progress=False)


@dataclass(frozen=True)
class _NF4Scheme(QuantScheme):
    """bitsandbytes NF4 as QLoRA: quantized by bitsandbytes while loading (``Linear4bit``)."""

    @property
    def layer_type(self) -> type[nn.Module]:
        return _bitsandbytes().nn.Linear4bit

    def hf_config(self, dtype, *, calibration_data=None, double_quant=True):
        """The QLoRA ``BitsAndBytesConfig``: NF4 weights, compute in ``dtype``, absmax double-quantized (QLoRA's
        default), uint8 storage.

        Raises:
            nvfp4.MissingExtraError: bitsandbytes is not installed (names ``pip install 'qerl-trl[nf4]'``).
        """
        _bitsandbytes()
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_quant_storage=torch.uint8,
        )

    def load(self, path, *, dtype, device_map=None, calibration_data=None, cache_dir=None, double_quant=True):
        # bitsandbytes quantizes while loading, on the device it computes on: this process's GPU when there is one
        if device_map is None and torch.cuda.is_available():
            device_map = {"": int(os.environ.get("LOCAL_RANK", "0"))}
        model = super().load(path, dtype=dtype, device_map=device_map, double_quant=double_quant)
        keep_nf4_exact(model)  # no bf16 repack of the NF4 scales on AVX512-BF16 CPUs
        return model

    def quantize_(self, model, *, calibration_data=None, double_quant=True):
        """Each ``nn.Linear`` (not ``lm_head``) → ``bnb.nn.Linear4bit`` (NF4) computing in its weight's dtype, as
        :meth:`hf_config` does while loading; bitsandbytes quantizes the weight when it is moved to its (CUDA) device."""
        bnb = _bitsandbytes()
        for name, lin in list(model.named_modules()):
            if type(lin) is not nn.Linear or name.rpartition(".")[2] == "lm_head":
                continue
            dtype, device = lin.weight.dtype, lin.weight.device
            new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=dtype,
                                    compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.uint8,
                                    device="meta")  # fmt: skip
            weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=double_quant,
                                       quant_type="nf4", quant_storage=torch.uint8, module=new)  # fmt: skip
            new.weight = weight.to(device)
            if lin.bias is not None:
                new.bias = nn.Parameter(lin.bias.data.to(dtype), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        keep_nf4_exact(model)  # no bf16 repack of the NF4 scales on AVX512-BF16 CPUs
        return model


@dataclass(frozen=True)
class _DenseScheme(QuantScheme):
    """``none``: the checkpoint's own dtype (the bf16 LoRA baseline)."""

    @property
    def is_dense(self) -> bool:
        return True

    @property
    def layer_type(self) -> type[nn.Module]:
        return nn.Linear

    def hf_config(self, dtype, *, calibration_data=None, double_quant=True):
        return None

    def quantize_(self, model, *, calibration_data=None, double_quant=True):
        return model


def _bitsandbytes() -> Any:
    """``bitsandbytes``, imported only by the scheme that needs it (its import logs a warning on some CPUs)."""
    from nvfp4.extras import missing_extra

    try:
        import bitsandbytes
    except ImportError as e:
        raise missing_extra(e, "bitsandbytes", "quantization='nf4'", "bitsandbytes", "qerl-trl[nf4]") from e
    return bitsandbytes


_NVFP4_KERNELS = "NVFP4Linear → nvfp4::linear (Triton kernels on CUDA, nvfp4.kernels; dequantize + F.linear elsewhere)"


def _fp4_kernels(fmt: Format) -> str:
    transcode = fmt.to_nvfp4_scales
    if transcode is None:
        return _NVFP4_KERNELS
    where = f"{transcode.__module__.rpartition('.')[2]}.{transcode.__name__}"
    return f"{_NVFP4_KERNELS}, after an exact scale transcode ({where})"


def _schemes() -> dict[str, QuantScheme]:
    """``<format>-<method>`` for every format of :data:`nvfp4.formats.FORMATS` and method it implements (NVFP4 first,
    calibrated methods last), then NF4 and the dense baseline."""
    fp4 = (_FP4Scheme(f"{f.name}-{m}", f, m, _fp4_kernels(f), vllm_engine=f.vllm_rollouts)
           for f in FORMATS.values() for m in f.methods)  # fmt: skip
    return {
        s.name: s
        for s in (
            *fp4,
            _NF4Scheme("nf4", kernels="bitsandbytes Linear4bit (its own CUDA / CPU kernels)"),
            _DenseScheme("none", kernels="nn.Linear (torch)", vllm_engine=True),
        )
    }


#: Every scheme by canonical name: NVFP4 first (calibrated methods last), then the other formats and the dense baseline.
SCHEMES: Mapping[str, QuantScheme] = MappingProxyType(_schemes())
#: Earlier bare NVFP4 method names → canonical value.
ALIASES: Mapping[str, str] = MappingProxyType({m: f"nvfp4-{m}" for m in NVFP4.methods})


def get_scheme(value: str | QuantScheme, what: str = "quantization") -> QuantScheme:
    """The :class:`QuantScheme` a ``quantization`` value names (canonical or alias, any case); a scheme is returned as
    it is. This is the one place a ``quantization`` string is parsed.

    Raises:
        ValueError: naming ``what``, the value and every valid value, for anything else.
    """
    if isinstance(value, QuantScheme):
        return value
    key = str(value).strip().lower()
    scheme = SCHEMES.get(ALIASES.get(key, key))
    if scheme is None:  # a format registered after this module was imported (nvfp4.formats.register_format)
        scheme = _schemes().get(key)
    if scheme is None:
        aliases = ", ".join(f"{a!r} (= {c!r})" for a, c in ALIASES.items())
        raise ValueError(f"{what} must be one of {', '.join(map(repr, SCHEMES))}; aliases: {aliases}, got {value!r}")
    return scheme


def calibrated_checkpoint_path(
    model_path: str, method: str, calibration_data: Sequence[torch.Tensor], cache_dir: str | Path
) -> Path:
    """``cache_dir/<model>-<method>-<key>``: the key hashes the model path, the method and every calibration id, so a
    different model, method or prompt set never reuses a calibration."""
    digest = hashlib.sha1(
        f"{os.path.abspath(model_path) if os.path.exists(model_path) else model_path}|{method}".encode()
    )
    for ids in calibration_data:
        digest.update(torch.as_tensor(ids).to(torch.int64).reshape(-1).numpy().tobytes())
        digest.update(b"|")
    return Path(cache_dir) / f"{Path(model_path.rstrip('/')).name or 'model'}-{method}-{digest.hexdigest()[:12]}"


def keep_nf4_exact(model: nn.Module) -> int:
    """Keep bitsandbytes NF4 layers on their exact NF4 path on CPU; returns how many ``Linear4bit`` were set.

    On CPUs with AVX512-BF16, bitsandbytes (0.48 and later) repacks a ``Linear4bit`` the first time it runs in eval
    mode without gradients (generation, evaluation, AQN's norm discovery): the absmax scales are rounded to bf16 and the
    layer then computes in bf16 (``_convert_weight_packed_for_cpu``), so the model's weights silently change mid-run and
    differ from the GPU's NF4. We turn that repack off (``support_avx512bf16_for_cpu = False``): the same NF4 numbers
    in every mode, on every device.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n
