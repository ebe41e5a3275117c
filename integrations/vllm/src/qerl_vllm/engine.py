"""``VLLMEngine``: the rollout engine adapter the QeRL trainer calls (colocate mode, one process).

Per training step the trainer does::

    engine.sync_lora(adapter_dir_or_state_dict, version=step, peft_config=...)   # a new LoRARequest, never merged
    engine.set_norm_weights(aqn.noisy_norm_weights(engine.norm_weights(), sigma, seed=s, step=step))
    outs = engine.generate(prompts, {"temperature": 1.0, "max_tokens": 256, "n": 8})
    engine.restore_norm_weights()                                                  # bit-identical originals back

* The NVFP4 base is loaded through the ``nvfp4_w4a16`` plugin (:mod:`qerl_vllm.quant`) and never touched again: the
  LoRA adapter reaches vLLM as an adapter (``LoRARequest`` with a fresh id and name per sync; the previous one is
  removed from the engine), exactly as ``vllm serve --enable-lora`` would apply it.
* AQN: noisy RMSNorm weights are written in place (``copy_``, same storage, cast to the engine's parameter dtype)
  into the engine model's norm parameters through ``LLM.collective_rpc`` on a worker extension
  (:class:`qerl_vllm.worker.QeRLWorkerExtension`, vLLM's ``worker_extension_cls`` hook), so it works in-process and
  multi-process / tensor-parallel; the originals are kept in the worker and copied back by
  :meth:`restore_norm_weights`.
  The prefix cache is reset after each change, so no KV computed under other norm weights is reused.
* vLLM names the norm parameters like HF does for Llama/Qwen/Mistral (``model.layers.{i}.input_layernorm.weight``,
  ``...post_attention_layernorm.weight``, ``model.norm.weight``); PEFT prefixes (``base_model.model.``) are stripped,
  and the model's own ``hf_to_vllm_mapper`` (if any) is applied to other names.

* Weight sharing (colocate, one in-process worker): :meth:`VLLMEngine.shareable_weights` returns views of the
  engine's frozen tensors (:mod:`qerl_vllm.shared_weights`) for the trainer to hold instead of its own copies.

Only public vLLM APIs are used: ``LLM``, ``SamplingParams``, ``LoRARequest``, ``worker_extension_cls`` +
``LLM.collective_rpc``, ``LLM.reset_prefix_cache``, ``LLMEngine.remove_lora``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from nvfp4.peft import write_adapter

from . import vllm_missing
from .shared_weights import EngineWeights

__all__ = [
    "Generation",
    "VLLMEngine",
    "WeightsNotShareable",
    "adapter_rank",
    "norm_param_names",
    "prompt_list",
    "to_vllm_name",
]

SYNCED = "synced"
WORKER_EXTENSION = "qerl_vllm.worker.QeRLWorkerExtension"
_PEFT_PREFIXES = ("base_model.model.",)


class WeightsNotShareable(RuntimeError):
    """The engine's tensors cannot be viewed by the caller (:meth:`VLLMEngine.shareable_weights`); the message says
    why."""


def prompt_list(prompts: Any) -> list:
    """``prompts`` as a list of prompts: one string or one token-id sequence (a list of ints, a 1-D tensor) becomes a
    list of one, a 2-D tensor its rows (as int lists), anything else a list of its items (iterating one string would
    make a prompt of each character)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2) or prompts.is_floating_point():
            raise ValueError(f"prompts as a tensor are token ids [T] or [B, T] (integer), got {prompts.dtype} "
                             f"{list(prompts.shape)}")  # fmt: skip
        return [prompts.tolist()] if prompts.dim() == 1 else prompts.tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]
    return prompts


class Generation(NamedTuple):
    """One completion: generated token ids and the engine's logprob of each sampled token (same length)."""

    token_ids: list[int]
    logprobs: list[float]


# ---------------------------------------------------------------------------------------------- worker-side helpers
# Module-level functions so that a multi-process engine pickles them by reference (qerl_vllm is importable there).


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def norm_param_names(model: torch.nn.Module) -> list[str]:
    """Names of the RMSNorm weights of an (engine) model, in module order."""
    model = _unwrap(model)
    return [f"{n}.weight" if n else "weight" for n, m in model.named_modules() if _is_norm(m) and m.weight.dim() == 1]


def to_vllm_name(name: str, model: torch.nn.Module | None = None) -> str:
    """Map an HF / PEFT parameter name to the engine model's name (Llama-family names are identical)."""
    for p in _PEFT_PREFIXES:
        if name.startswith(p):
            name = name[len(p) :]
    mapper = getattr(_unwrap(model), "hf_to_vllm_mapper", None) if model is not None else None
    if mapper is not None:
        try:
            mapped = mapper._map_name(name)  # WeightsMapper; returns None for dropped names
        except Exception:  # noqa: BLE001 - mapper internals differ across versions; fall back to the plain name
            mapped = name
        if mapped:
            name = mapped
    return name


def _w_norm_names(model: torch.nn.Module) -> list[str]:
    return norm_param_names(model)


def _w_norm_weights(model: torch.nn.Module) -> dict[str, tuple[str, list[float]]]:
    """Clean (noise-free, even while noise is on) norm weights as ``{name: (dtype, values)}`` — plain Python data,
    which crosses any RPC transport exactly (bf16/fp16/fp32 values are exact as Python floats)."""
    model = _unwrap(model)
    params = dict(model.named_parameters())
    saved = getattr(model, "_qerl_norm_originals", {})
    out = {}
    for n in norm_param_names(model):
        t = (saved[n] if n in saved else params[n].detach()).to("cpu")
        out[n] = (str(t.dtype).removeprefix("torch."), t.double().tolist())
    return out


def _to_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[0], str):
        return torch.tensor(v[1], dtype=torch.float64).to(getattr(torch, v[0]))
    return torch.tensor(v, dtype=torch.float64)


def _w_set_norms(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> int:
    model = _unwrap(model)
    params = dict(model.named_parameters())
    allowed = set(norm_param_names(model))
    resolved = {}
    for name, t in named.items():
        t = _to_tensor(t)
        vname = name if name in params else to_vllm_name(name, model)
        if vname not in allowed:
            raise KeyError(
                f"{name!r} (engine name {vname!r}) is not an RMSNorm weight of the engine model; "
                f"e.g. {sorted(allowed)[:3]}"
            )
        p = params[vname]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != engine parameter {tuple(p.shape)}")
        resolved[vname] = t
    saved: dict[str, torch.Tensor] = model.__dict__.setdefault("_qerl_norm_originals", {})
    with torch.no_grad():
        for vname, t in resolved.items():
            p = params[vname]
            if vname not in saved:
                saved[vname] = p.detach().clone()
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))
    return len(resolved)


def _w_restore_norms(model: torch.nn.Module) -> int:
    model = _unwrap(model)
    saved: dict[str, torch.Tensor] = model.__dict__.pop("_qerl_norm_originals", {})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for vname, orig in saved.items():
            params[vname].data.copy_(orig)
    return len(saved)


# ---------------------------------------------------------------------------------------------- the engine


def _default_lora_root() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="qerl-vllm-lora-", dir=base)


#: memory left out of :func:`utilization_for_fixed_kv_cache`'s fraction for what this process (vLLM's own start) and
#: others allocate between reading the free memory and vLLM's check of it (> 90 MiB seen on the H100 at 6ee5805)
START_CHECK_HEADROOM_BYTES = 1 << 30


def utilization_for_fixed_kv_cache(free_bytes: int, total_bytes: int) -> float:
    """``gpu_memory_utilization`` for an engine whose KV cache ``kv_cache_memory_bytes`` fixes: the fraction of the
    GPU free now less :data:`START_CHECK_HEADROOM_BYTES`, rounded down (at least 0.01). vLLM (0.26) still refuses to
    start when free memory < total x utilization (0.9 by default) although the KV size no longer depends on it, so
    beside a colocated trainer that already holds its policy the default fails; with a fixed KV cache the fraction is
    read only by that check, so the headroom costs nothing. A process that allocates more than the headroom meanwhile
    still trips it (vLLM's own error then names both figures)."""
    usable = max(0, free_bytes - START_CHECK_HEADROOM_BYTES)
    return max(0.01, math.floor(1000 * usable / total_bytes) / 1000 - 0.001)


class VLLMEngine:
    """A vLLM ``LLM`` over an NVFP4 checkpoint, with LoRA-adapter sync and AQN norm-weight push/restore.

    Args:
        model_path: our NVFP4 checkpoint folder (``quant_method="nvfp4_w4a16"``), or any checkpoint vLLM loads.
        max_lora_rank: largest LoRA rank to be synced (vLLM preallocates LoRA buffers; 0 disables LoRA).
        seed: engine seed (sampling with ``temperature > 0`` is reproducible per seed / per-request ``seed``).
        dtype: activation / dense-weight dtype (``"bfloat16"``).
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (on CPU: fraction of host memory;
            prefer ``kv_cache_memory_bytes`` there). With ``kv_cache_memory_bytes`` given and this not, on a GPU: the
            fraction free at start (:func:`utilization_for_fixed_kv_cache`).
        max_model_len: longest prompt + completion.
        max_loras: adapters resident at once (1 is enough for on-policy RL).
        enforce_eager: no CUDA graphs / torch.compile (default True on CPU, where start-up time dominates).
        kv_cache_memory_bytes: explicit KV-cache size (default 512 MiB on CPU).
        lora_dir: where adapters given as tensors are written (default: a fresh folder under /dev/shm).
        rollout_precision: ``"w4a16"`` (default), ``"fp8"`` or ``"auto"`` (:mod:`nvfp4.rollout_precision`): how the
            NVFP4 linears compute, passed to the plugin as vLLM's ``additional_config`` (:mod:`qerl_vllm.quant`).
        lora_tiles: the tiles of vLLM's LoRA kernels on CUDA (:mod:`qerl_vllm.lora_tiles`): ``"tuned"`` (default: the
            files shipped for this GPU, +13.6 % rollout tokens/s at B = 128 on the H100), ``"stock"`` (vLLM's defaults) or
            ``"reproducible"`` (one K split: bit-identical LoRA rollouts run to run). Set through
            ``VLLM_TUNED_CONFIG_FOLDER`` before the engine starts; a variable already set wins, and an engine that is
            not the process's first keeps what the first one read.
        **llm_kwargs: passed on to ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``enable_prefix_caching``,
            ``logprobs_mode``, ``enable_sleep_mode``). With ``distributed_executor_backend="external_launcher"`` and
            ``tensor_parallel_size=T`` inside a torchrun / accelerate launch, this process hosts one TP worker of an
            engine shared by T processes (the trainer's colocate mode): every method then acts on this worker only
            and every process of the group must make the same calls (same prompts, same seed, same adapter and norm
            weights: vLLM's LoRA layers keep their TP slice of the whole adapter, its RMSNorm weights are replicated).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_lora_rank: int = 64,
        seed: int = 0,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        max_loras: int = 1,
        enforce_eager: bool | None = None,
        kv_cache_memory_bytes: int | None = None,
        lora_dir: str | os.PathLike | None = None,
        rollout_precision: str = "w4a16",
        lora_tiles: str = "tuned",
        **llm_kwargs: Any,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocate: the engine lives in this process
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as err:  # the extra is not installed
            raise vllm_missing(err, "qerl_vllm.engine.VLLMEngine") from err

        from nvfp4.rollout_precision import get_rollout_precision

        from .lora_tiles import apply_lora_tiles
        from .plugin import register
        from .quant import ROLLOUT_PRECISION_KEY

        register()  # also done by the vllm.general_plugins entry point; harmless twice
        #: the folder vLLM takes its LoRA kernels' tiles from (None: its defaults)
        self.lora_tiles_folder = apply_lora_tiles(lora_tiles)
        on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = dict(model=str(model_path), dtype=dtype, seed=seed)
        if max_lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enforce_eager is None:
            enforce_eager = on_cpu
        kwargs["enforce_eager"] = enforce_eager
        if kv_cache_memory_bytes is None and on_cpu and gpu_memory_utilization is None:
            kv_cache_memory_bytes = 512 << 20
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
            if gpu_memory_utilization is None and not on_cpu and torch.cuda.is_available():
                kwargs["gpu_memory_utilization"] = utilization_for_fixed_kv_cache(*torch.cuda.mem_get_info())
        kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        kwargs.update(llm_kwargs)
        precision = get_rollout_precision(rollout_precision)
        if precision.fp8_copy:  # the default leaves additional_config (part of vLLM's compile-cache hash) alone
            kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), ROLLOUT_PRECISION_KEY: precision.name}
        self.model_path = str(model_path)
        self.max_lora_rank = max_lora_rank
        #: one TP worker of an engine spread over the processes of a torchrun / accelerate launch: the torch process
        #: group is the launcher's, so :meth:`close` leaves it alone
        self.external_launcher = kwargs.get("distributed_executor_backend") == "external_launcher"
        self._llm_kwargs = dict(kwargs)
        # the adapter folder first: a bad lora_dir is refused before an engine (its memory, its KV cache) exists
        self._lora_root = Path(lora_dir) if lora_dir is not None else Path(_default_lora_root())
        self._own_lora_root = lora_dir is None
        try:
            self._lora_root.mkdir(parents=True, exist_ok=True)
        except OSError:
            if self._own_lora_root:
                shutil.rmtree(self._lora_root, ignore_errors=True)
            raise
        try:
            self.llm = LLM(**kwargs)
            _LIVE_ENGINES.add(self)
            self.tokenizer = self.llm.get_tokenizer()  # ValueError with skip_tokenizer_init=True
        except BaseException:
            self.close()  # no caller can: the engine (if it started) is shut down and the adapter folder removed
            raise
        self._next_lora_id = 1
        self._lora_request = None  # the adapter of the last sync_lora
        self._lora_version: int | None = None
        self._norms_dirty = False

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: Mapping[str, Any] | Any | None = None,
        lora: Any = SYNCED,
        *,
        use_tqdm: bool = False,
    ) -> list[Generation]:
        """Generate completions.

        Args:
            prompts: strings, or token-id lists (sent as they are, no special tokens added).
            sampling: ``vllm.SamplingParams`` keyword arguments (``temperature``, ``top_p``, ``max_tokens``, ``n``,
                ``seed``, ``stop_token_ids``, ...) or a ``SamplingParams``. ``logprobs`` defaults to 0 (the sampled
                token's logprob is always returned).
            lora: ``"synced"`` (default: the adapter of the last :meth:`sync_lora`, none before), ``None`` (base
                model), a ``LoRARequest``, an adapter folder, or ``(name, folder)``.

        Returns:
            ``len(prompts) * n`` :class:`Generation` s, prompt-major (all samples of prompt 0 first). One string or
            one token-id list is one prompt.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = prompt_list(prompts)

        if isinstance(sampling, SamplingParams):
            params = sampling.clone()
            if params.logprobs is None:
                params.logprobs = 0
        else:
            sp = dict(sampling or {})
            sp.setdefault("logprobs", 0)
            params = SamplingParams(**sp)
        inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        request = self._resolve_lora(lora)
        outs = self.llm.generate(inputs, params, lora_request=request, use_tqdm=use_tqdm)
        result = []
        for out in outs:
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [])] if c.logprobs else []
                result.append(Generation(ids, lps))
        return result

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]], lora: Any = SYNCED) -> list[list[float]]:
        """Teacher-forced logprob of every token after the first, for each sequence (one prefill, no sampling)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in token_ids],
            params,
            lora_request=self._resolve_lora(lora),
            use_tqdm=False,
        )
        res = []
        for seq, out in zip(token_ids, outs):
            pl = out.prompt_logprobs or []
            res.append([float(pl[i][int(seq[i])].logprob) for i in range(1, len(seq))])
        return res

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ LoRA
    def _resolve_lora(self, lora: Any):
        from vllm.lora.request import LoRARequest

        if lora is None:
            return None
        if isinstance(lora, str) and lora == SYNCED:
            return self._lora_request
        if isinstance(lora, LoRARequest):
            return lora
        if isinstance(lora, (str, os.PathLike)):
            name, path = f"adapter-{Path(lora).name}", str(lora)
        elif isinstance(lora, tuple) and len(lora) == 2:
            name, path = str(lora[0]), lora[1]
            if isinstance(path, Mapping):
                raise TypeError("pass adapter tensors through sync_lora(state_dict, version, peft_config=...)")
            path = str(path)
        else:
            raise TypeError(f"lora: expected None, 'synced', a LoRARequest, a folder or (name, folder); got {lora!r}")
        req = LoRARequest(name, self._new_lora_id(), path)
        return req

    def _new_lora_id(self) -> int:
        i = self._next_lora_id
        self._next_lora_id += 1
        return i

    def sync_lora(
        self,
        adapter: str | os.PathLike | Mapping[str, torch.Tensor],
        version: int,
        *,
        peft_config: Any = None,
    ):
        """Make ``adapter`` the engine's current LoRA (used by :meth:`generate` with ``lora="synced"``).

        Args:
            adapter: a PEFT adapter folder (``save_pretrained`` output), or its state dict (PEFT key names, e.g.
                ``get_peft_model_state_dict(model)``: ``base_model.model.<module>.lora_A.weight``), written to
                ``lora_dir/v{version}`` as ``adapter_model.safetensors`` + ``adapter_config.json``.
            version: the training step (names the adapter; each sync gets a fresh LoRARequest id, so vLLM never
                serves a stale cached adapter).
            peft_config: ``peft.LoraConfig`` or its dict, required when ``adapter`` is a state dict.

        Returns:
            The new ``LoRARequest``. The previous synced adapter is removed from the engine (and its temp folder).
        """
        from vllm.lora.request import LoRARequest

        if not self.max_lora_rank:
            raise RuntimeError("this engine was built with max_lora_rank=0 (LoRA disabled)")
        written = None
        if isinstance(adapter, Mapping):
            if peft_config is None:
                raise ValueError("sync_lora(state_dict, ...) needs peft_config (a LoraConfig or its dict)")
            written = self._lora_root / f"v{int(version)}-{self._next_lora_id}"
            write_adapter(written, adapter, peft_config)
            path = str(written)
        else:
            path = str(adapter)
            if not (Path(path) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"{path}: no adapter_config.json (not a PEFT adapter folder)")
        rank = adapter_rank(Path(path))
        if rank is not None and rank > self.max_lora_rank:
            if written is not None:  # refused: the folder written for it goes too
                shutil.rmtree(written, ignore_errors=True)
            raise ValueError(f"adapter rank {rank} exceeds the engine's max_lora_rank={self.max_lora_rank}")
        old, old_dir = self._lora_request, getattr(self, "_lora_written", None)
        req = LoRARequest(f"qerl-lora-v{int(version)}", self._new_lora_id(), path)
        self._lora_request, self._lora_version, self._lora_written = req, int(version), written
        if old is not None:
            try:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            except Exception:  # noqa: BLE001 - never loaded (no generate since the last sync): nothing to remove
                pass
            if old_dir is not None:
                shutil.rmtree(old_dir, ignore_errors=True)
        return req

    @property
    def lora_request(self):
        """The ``LoRARequest`` of the last :meth:`sync_lora` (None before)."""
        return self._lora_request

    @property
    def lora_version(self) -> int | None:
        return self._lora_version

    def clear_lora(self) -> None:
        """Forget the synced adapter (``generate`` then uses the base model by default) and delete the folder
        :meth:`sync_lora` wrote for it, if any."""
        if self._lora_request is not None:
            try:
                self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            except Exception:  # noqa: BLE001
                pass
        self._remove_written_adapter()
        self._lora_request, self._lora_version = None, None

    def _remove_written_adapter(self) -> None:
        """Delete the adapter folder the last :meth:`sync_lora` wrote from tensors (in ``lora_dir``), if any."""
        written = self.__dict__.pop("_lora_written", None)
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)

    # ------------------------------------------------------------------ AQN norm weights
    def norm_param_names(self) -> list[str]:
        """The engine model's RMSNorm weight names (e.g. ``model.layers.0.input_layernorm.weight``)."""
        return self.llm.collective_rpc("qerl_norm_names")[0]

    def norm_weights(self) -> dict[str, torch.Tensor]:
        """Clean (noise-free) copies of the engine's RMSNorm weights on the CPU: the input for
        ``aqn.noisy_norm_weights`` / ``AQNController.engine_weights``."""
        return {n: _to_tensor(v) for n, v in self.llm.collective_rpc("qerl_norm_weights")[0].items()}

    def set_norm_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write ``(name, tensor)`` pairs into the engine's norm parameters, in place; returns how many.

        Names may be HF/PEFT names (mapped with :func:`to_vllm_name`). Values are cast to the parameter dtype
        (bf16 in a bf16 engine). The first write of each parameter since the last restore saves its original.
        """
        named = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        # plain (dtype, values) pairs: exact for bf16/fp16/fp32 and safe through any RPC transport (multi-process)
        named = {
            k: (str(v.dtype).removeprefix("torch."), v.detach().to("cpu").double().tolist()) for k, v in named.items()
        }
        counts = self.llm.collective_rpc("qerl_set_norms", args=(named,))
        self._norms_dirty = True
        self.llm.reset_prefix_cache()
        return counts[0]

    def restore_norm_weights(self) -> int:
        """Copy the saved original norm weights back (bit-identical); returns how many were restored."""
        counts = self.llm.collective_rpc("qerl_restore_norms")
        self._norms_dirty = False
        self.llm.reset_prefix_cache()
        return counts[0]

    # ------------------------------------------------------------------ weight sharing (colocate)
    def shareable_weights(self) -> EngineWeights:
        """Views of the engine model's frozen weights (:class:`qerl_vllm.shared_weights.EngineWeights`: packed NVFP4
        linears per HF member, embeddings, ``lm_head``) that a trainer in this process may hold instead of its own
        copies. No tensor is copied.

        Raises :class:`WeightsNotShareable` (its message says why) where the engine's tensors are not this process's
        whole tensors: tensor or pipeline parallelism (a worker holds a shard), sleep mode (vLLM frees and re-creates
        the weights' memory), a worker in another process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), or a worker
        extension other than :class:`qerl_vllm.worker.QeRLWorkerExtension`.
        """
        kw = self._llm_kwargs
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if int(kw.get(key) or 1) > 1:
                raise WeightsNotShareable(f"{key}={kw[key]}: each worker holds a shard of the weights")
        if kw.get("enable_sleep_mode"):
            raise WeightsNotShareable("enable_sleep_mode: vLLM frees the weights' memory while it sleeps")
        if kw.get("worker_extension_cls") != WORKER_EXTENSION:
            raise WeightsNotShareable(
                f"worker_extension_cls={kw.get('worker_extension_cls')!r}, not {WORKER_EXTENSION}"
            )
        pids = self.llm.collective_rpc("qerl_worker_pid")
        if pids != [os.getpid()]:  # asked first: across processes the views would come back as serialized copies
            raise WeightsNotShareable(f"the engine's worker runs in process(es) {pids}, not this one ({os.getpid()})")
        return self.llm.collective_rpc("qerl_engine_weight_views")[0]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the engine and the adapter temp folder (with a caller's ``lora_dir``: the adapter folder written
        there, the folder itself stays)."""
        if self._own_lora_root:
            shutil.rmtree(self._lora_root, ignore_errors=True)
        else:
            self._remove_written_adapter()
        llm = self.__dict__.pop("llm", None)
        _LIVE_ENGINES.discard(self)
        if llm is not None and self.external_launcher:
            # vLLM's shutdown ends by destroying the default process group, which belongs to the launch (the
            # trainer still uses it, and destroys it itself): the engine is dropped instead, its shutdown-on-collect
            # finalizer detached (at exit it would destroy groups the launch already took down); its memory goes with
            # the process
            finalizer = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            del llm
        elif llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001
                pass
            del llm
            _release_engine_memory(last_engine=not _LIVE_ENGINES)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: the engines of this process that hold a vLLM ``LLM`` (a closed one leaves): the last one out may drop what vLLM
#: keeps process-wide for CUDA graphs without breaking another engine's
_LIVE_ENGINES: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()


def _release_engine_memory(*, last_engine: bool) -> None:
    """Collect the closed engine and hand its cached CUDA memory back, so that a later engine in this process starts
    clean. vLLM's own shutdown (``EngineCore.shutdown``: ``gc.unfreeze``, ``gc.collect``, ``empty_cache``) runs while
    the ``LLM`` is still referenced; what is freed only afterwards stays cached.

    ``last_engine`` (no other engine of this process holds an ``LLM``): also vLLM's process-wide CUDA-graph state.
    vLLM (0.26 and 0.32) captures every engine's graphs into one pool id made once per process
    (``Platform.get_global_graph_pool``, never reset) and keeps every graph wrapper in a process-wide set; a second
    engine's start clears the first engine's surviving graphs (its CUDA-graph memory profile), which drops the old
    pool's use count to 0 while tensors still hold its blocks, and its own capture into the same id then stops on
    PyTorch's ``use_count > 0 INTERNAL ASSERT FAILED`` (vLLM issue 28426; H200 0c004f2 and H100 6ee5805:
    vllm_tests_h100_6ee5805_rerun.log), which also leaves the CUDA generator in capture mode ("Offset increment
    outside graph capture" in every later test). So the last engine out clears the graphs (vLLM's public
    ``clear_all_graphs``, which its own shutdown runs on ROCm only) and forgets the pool id, so that the next engine
    makes a fresh pool. The pool id is a vLLM class attribute with no public setter: it is reset only where it exists
    under that name (vLLM 0.26 and 0.32, pinned by test_vllm_engine_lifecycle.py)."""
    import gc

    gc.collect()  # runs the closed LLMEngine's finalizer, which unpins its compiled model
    if not torch.cuda.is_available():
        return
    if last_engine:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.platforms import current_platform

        CUDAGraphWrapper.clear_all_graphs()
        BreakableCUDAGraphWrapper.clear_all_graphs()
        torch.cuda.synchronize()
        gc.collect()
        if hasattr(type(current_platform), GRAPH_POOL_ATTRIBUTE):
            setattr(type(current_platform), GRAPH_POOL_ATTRIBUTE, None)
    torch.cuda.empty_cache()


#: where vLLM keeps its process-wide CUDA-graph pool id (``Platform.get_global_graph_pool`` makes it once)
GRAPH_POOL_ATTRIBUTE = "_global_graph_pool"


def adapter_rank(folder: Path) -> int | None:
    """The largest LoRA rank of the PEFT adapter in ``folder`` (``r`` and its ``rank_pattern``); None without a
    readable ``adapter_config.json``."""
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    ranks = [cfg.get("r")] + list((cfg.get("rank_pattern") or {}).values())
    ranks = [int(r) for r in ranks if r is not None]
    return max(ranks) if ranks else None
