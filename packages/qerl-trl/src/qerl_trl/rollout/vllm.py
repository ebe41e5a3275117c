"""``rollout_engine="vllm"``: vLLM rollouts for :class:`~qerl_trl.QeRLGRPOTrainer`, colocate and server mode.

TRL's own ``use_vllm=True`` path is not used: it syncs a PEFT policy by *merging* the adapters into the base weights
(impossible for a 4-bit NVFP4 base), so ``args.use_vllm`` stays False (TRL builds no engine). :class:`VLLMRollout` is a
:class:`~qerl_trl.rollout.RolloutEngine` like the others: the trainer calls its ``sync_lora``, ``set_noise``,
``generate`` and ``close``, and it writes nothing into the trainer. Its ``generate`` returns the sampled tokens'
logprobs (``sampling_logprobs``), so the trainer runs TRL's importance-sampling correction
(``vllm_importance_sampling_*``, ``sampling/*`` metrics) on the engine-vs-trainer gap.

Per generation step:

1. ``sync_lora`` (the trainer calls it when ``global_step`` changed): the LoRA state of the unwrapped ``PeftModel``
   (``get_peft_model_state_dict``) becomes a NEW adapter of the engine — colocate: ``VLLMEngine.sync_lora``; server:
   the adapter folder is written under ``vllm.adapter_dir`` (a filesystem the server reads) and loaded through
   ``POST /v1/load_lora_adapter`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), the previous one unloaded. Never merged.
2. AQN (around generation, :meth:`VLLMRollout.set_noise`): the controller's noisy norm weights of this step
   (``AQNController.rollout(policy, step, engine=...)`` — the same σ, seed and per-(seed, step, name) draw as the
   transformers path) are written into the engine's RMSNorm weights and restored bit-identically afterwards.
   Colocate: ``VLLMEngine.set_norm_weights`` / ``restore_norm_weights``; server: a safetensors file + the dev-mode
   ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``, server started with
   ``--worker-extension-cls qerl_vllm.worker.QeRLWorkerExtension``) and ``POST /reset_prefix_cache``.
3. ``generate``: prompt token ids (TRL repeats each prompt ``num_generations`` times; whole groups are sent once with
   ``n=num_generations``), the trainer's temperature / top_p / top_k / min_p / repetition_penalty /
   ``max_completion_length`` / ``generation_kwargs``; logprobs are vLLM's ``processed_logprobs`` (after temperature),
   as the trainer's logprobs are.

A sharded policy (FSDP2, ``accelerate launch --config_file recipes/accelerate/fsdp2.yaml``): the LoRA parameters and
the RMSNorm weights are ``DTensor`` shards. Every process gathers each one whole (``DTensor.full_tensor()``, a
collective: all processes, same order, one tensor at a time, straight to the CPU) before anything is pushed; then who
pushes what depends on who owns the engine:

* colocate, ``vllm.tensor_parallel_size`` = 1: each process owns a whole engine and pushes the full adapter and the
  full noisy norms into it (as without FSDP2);
* colocate, ``tensor_parallel_size`` = T > 1 (vLLM's ``external_launcher`` backend, as TRL's colocate mode): the T
  consecutive processes of a group each host one TP worker of the same engine, and each pushes the *full* tensors into
  its own worker: vLLM's LoRA layers keep their TP slice of the whole adapter, and the RMSNorm weights are replicated
  across TP ranks, so each worker takes the whole vector. Nothing crosses processes but the gathers. The group
  generates together: its processes' prompts are gathered (``all_gather_object`` on the TP group), every worker runs
  the same requests with the same seed, and each process keeps its own rows;
* server (``vllm.server_url``, e.g. ``vllm serve --tensor-parallel-size N --host 127.0.0.1``): the main process
  pushes (adapter files + HTTP; the server fans the norm RPC out to all its TP workers), the others only gather.

``qerl_vllm`` / ``vllm`` are imported only by the colocate engine; server mode needs neither (stdlib HTTP).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from nvfp4.extras import missing_extra
from nvfp4.offline import publish_checkpoint
from nvfp4.peft import write_adapter
from trl.extras.profiling import profiling_context

from ..quantization import QuantScheme
from .base import RolloutEngine
from .shared_weights import share_engine_weights

__all__ = [
    "ColocateVLLMGeneration",
    "ServerVLLMGeneration",
    "VLLMRollout",
    "adapter_state",
    "engine_checkpoint",
    "full_tensors",
    "sampling_kwargs",
    "write_adapter",
]

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the settings vLLM's SamplingParams and transformers' GenerationConfig both name (the same way)
#: the colocated engine's ``lora_tiles`` (``qerl_vllm.lora_tiles.LORA_TILES``, which qerl-trl does not need installed to
#: check a config; tests/vllm_integration/test_vllm_lora_tiles.py holds the two equal)
LORA_TILES = ("tuned", "stock", "reproducible")
_SHARED_SAMPLING_NAMES = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty"})
#: what needs vLLM in a missing-package error (with the other way: a server, which brings its own)
_COLOCATE_NEEDS = "rollout_engine='vllm' colocated (or set vllm.server_url for a server)"


def _require_vllm_here(what: str) -> None:
    """:class:`nvfp4.extras.MissingExtraError` (one line: what to install) unless vLLM and qerl-vllm are importable.
    The extra qerl-trl[vllm] brings the plugin only; qerl-vllm[vllm] brings vLLM too (GPU: the CUDA wheel)."""
    for module, install in (("vllm", "qerl-vllm[vllm]"), ("qerl_vllm", "qerl-trl[vllm]")):
        if importlib.util.find_spec(module) is None:
            raise missing_extra(None, module, what, "vLLM and qerl-vllm", install)


# ---------------------------------------------------------------------------------------------- checkpoint
def engine_checkpoint(
    name_or_path: str | None,
    model: Any,
    scheme: QuantScheme,
    *,
    override: str | None = None,
    cache_dir: str | None = None,
) -> str:
    """The checkpoint folder the engine loads: ``override`` if given; an NVFP4 (or, with the dense ``scheme``,
    dense) checkpoint on disk as it is; otherwise the loaded NVFP4 ``model`` (quantized on load, before PEFT wraps it)
    saved once with its tokenizer under ``cache_dir`` (default: the nvfp4 cache), keyed by source path + method."""
    if override:
        return str(override)
    from ..policy import _is_nvfp4_checkpoint, resolve_model_path

    src = resolve_model_path(name_or_path) if name_or_path is not None else None
    if not scheme.vllm_engine:
        raise ValueError(f"the vLLM engine loads NVFP4 or dense checkpoints; quantization={scheme.name!r} is not supported")
    if src is not None and os.path.isdir(src) and (scheme.is_dense or _is_nvfp4_checkpoint(src)):
        return src
    from peft import PeftModel

    if model is None or isinstance(model, PeftModel):
        raise ValueError(
            "rollout_engine='vllm' needs the policy's checkpoint on disk: pass a model id/path, a base "
            "PreTrainedModel, or set vllm.model_path to its NVFP4 checkpoint"
        )
    if cache_dir is None:
        from nvfp4.offline import cache_dir as nvfp4_cache_dir

        cache_dir = str(nvfp4_cache_dir() / "vllm-rollout")
    ident = src or getattr(model.config, "_name_or_path", "") or "model"
    tag = scheme.cache_tag  # "rtn" for nvfp4-rtn, as before formats existed: saved engine checkpoints stay valid
    key_text = f"{os.path.abspath(ident) if os.path.exists(ident) else ident}|{tag}"
    calibration = getattr(model, "qerl_calibration_id", None)  # awq / gptq: the weights depend on the prompts too
    if calibration:
        key_text += f"|{calibration}"
    key = hashlib.sha1(key_text.encode()).hexdigest()[:10]
    target = Path(cache_dir) / f"{Path(ident).name or 'model'}-{tag}-{key}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # several trainer processes (one machine): transformers' save_pretrained writes on global rank 0 only, so
        # that one saves and the others wait for it. Every rank takes the barrier, cached or not: a rank that looked
        # for the checkpoint only after rank 0 had written it would skip the barrier rank 0 waits in, and the next
        # collectives would pair up wrongly (the FSDP2 + TP test's hang)
        if dist.get_rank() == 0 and not (target / "config.json").is_file():
            _save_engine_checkpoint(target, model, src)
        dist.barrier()
        if not (target / "config.json").is_file():
            raise FileNotFoundError(f"{target}: rank 0 wrote no engine checkpoint here (vllm.cache_dir must be shared)")
        return str(target)
    if not (target / "config.json").is_file():
        _save_engine_checkpoint(target, model, src)
    return str(target)


def _save_engine_checkpoint(target: Path, model: Any, src: str | None) -> None:
    """``model`` (with ``src``'s tokenizer and generation config) saved as ``target``, atomically (a rename); its
    base only, where PEFT injected layers into it (:func:`_without_peft_layers`)."""

    def save(staged: Path) -> None:
        with _without_peft_layers(model):
            model.save_pretrained(staged)
        if src is not None:
            with contextlib.suppress(Exception):
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(src).save_pretrained(staged)
            if os.path.isdir(src):
                for f in ("generation_config.json",):
                    if (Path(src) / f).is_file() and not (staged / f).is_file():
                        shutil.copy(Path(src) / f, staged / f)

    publish_checkpoint(target, save)


@contextlib.contextmanager
def _without_peft_layers(model: Any):
    """``model`` with each layer PEFT injected into it (a LoRA layer around a linear: ``qerl eval``'s model carrying
    its adapter, ``get_base_model()``) swapped for the layer it wraps, put back afterwards, also on failure: the engine
    loads the base (the adapter reaches it as a LoRA adapter), not PEFT's ``base_layer`` names and ``lora_*`` tensors,
    which vLLM cannot load and which would stay in the cached checkpoint."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    injected = [(name, m) for name, m in model.named_modules() if name and isinstance(m, BaseTunerLayer)]
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for name, layer in injected:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            if getattr(owner, child, None) is layer:  # not inside a layer swapped already
                setattr(owner, child, layer.get_base_layer())
                swapped.append((owner, child, layer))
        yield model
    finally:
        for owner, child, layer in reversed(swapped):
            setattr(owner, child, layer)


# ---------------------------------------------------------------------------------------------- adapters
def full_tensors(named: Mapping[str, torch.Tensor], *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Whole CPU copies of ``named``'s tensors, in its order. A ``DTensor`` (an FSDP2 shard) is gathered with
    ``full_tensor()``, a collective: every process of its mesh must call this with the same names in the same order.
    One tensor is gathered at a time and moved to the CPU at once, so the GPU holds one whole tensor at most.
    ``keep=False`` (a process that takes part in the gathers but pushes nothing): the copies are dropped, ``{}``."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        t = t.detach()
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = whole.to("cpu", copy=True)
        del whole
    return out


def adapter_state(model: Any, *, keep: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
    """The active LoRA adapter of ``model`` (a ``PeftModel``, sharded by FSDP2 or not) as the engine takes it: PEFT's
    adapter state dict (``get_peft_model_state_dict``), every tensor whole on the CPU (:func:`full_tensors`: a
    collective under FSDP2), and its ``LoraConfig``."""
    from peft import PeftModel, get_peft_model_state_dict

    if not isinstance(model, PeftModel):
        raise TypeError("rollout_engine='vllm' syncs LoRA adapters: the policy must be a PeftModel")
    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    return full_tensors(get_peft_model_state_dict(model, adapter_name=name), keep=keep), model.peft_config[name]


def lora_rank_bucket(r: int) -> int:
    """Smallest rank vLLM accepts as ``max_lora_rank`` that holds ``r``."""
    for b in _VLLM_LORA_RANKS:
        if r <= b:
            return b
    return int(r)


def sampling_kwargs(trainer: Any, n: int) -> dict[str, Any]:
    """The trainer's sampling settings as vLLM ``SamplingParams`` keywords (as TRL's vLLM branch builds them)."""
    sp: dict[str, Any] = {
        "n": n,
        "temperature": trainer.temperature,
        "top_p": trainer.top_p,
        "top_k": 0 if trainer.top_k is None else int(trainer.top_k),
        "min_p": 0.0 if trainer.min_p is None else float(trainer.min_p),
        "repetition_penalty": trainer.repetition_penalty,
        "max_tokens": trainer.max_completion_length,
    }
    sp.update(trainer.args.generation_kwargs or {})
    regex = getattr(trainer.args, "vllm_structured_outputs_regex", None)
    if regex is not None:  # TRL's setting; it takes precedence over generation_kwargs' structured_outputs, as in TRL
        sp["structured_outputs"] = {"regex": regex}
    if sp.get("logit_bias"):  # from YAML / a JSON command line its token ids are strings; vLLM compares them as ints
        sp["logit_bias"] = {int(t): float(b) for t, b in sp["logit_bias"].items()}
    return sp


def _groups(prompts: Sequence[Sequence[int]], n: int) -> tuple[list[list[int]], int]:
    """TRL repeats each prompt ``n`` times in a row; send each group once with ``n`` samples when that holds."""
    prompts = [list(map(int, p)) for p in prompts]
    if n > 1 and len(prompts) % n == 0:
        heads = prompts[::n]
        if all(prompts[i] == heads[i // n] for i in range(len(prompts))):
            return heads, n
    return prompts, 1


class _VLLMGeneration:
    """What both modes share: adapter sync, generation and the norm-weight calls of
    :class:`aqn.controller.NormWeightsEngine` (the AQN controller's target) on top of the mode's raw engine calls.

    Every trainer process calls :meth:`sync_weights`, :meth:`set_norm_weights`, :meth:`restore_norm_weights` and
    :meth:`generate` (the trainer and the AQN controller run on all of them), so the gathers of a sharded policy are
    collective; :attr:`pushes` says whether this process then hands the tensors to the engine."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.last_synced_step: int | None = None
        #: the process group of the processes that share one engine (colocate with tensor_parallel_size > 1)
        self.tp_group: Any = None

    @property
    def pushes(self) -> bool:
        """Whether this process pushes the adapter and the norm weights into the engine (after every process has
        gathered them): colocate, every process (its own engine, or its own TP worker of the group's engine)."""
        return True

    # sync and generation --------------------------------------------------------------
    def sync_weights(self) -> None:
        """Push the current LoRA adapter as a new adapter (:meth:`VLLMRollout.sync_lora`: once per ``global_step``)."""
        step = int(self.trainer.state.global_step)
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        state, cfg = adapter_state(model, keep=self.pushes)
        self._sync_lora(state, cfg, step)
        self.last_synced_step = step

    def generate(self, prompts, num_generations: int = 1) -> tuple[list[list[int]], list[list[float]]]:
        """``(completion_ids, logprobs)`` of ``prompts`` (token ids, each prompt ``num_generations`` times in a row):
        ``logprobs[i][t]`` the logprob of the sampled token. The processes of a TP group generate their prompts
        together (each keeps its own rows)."""
        local = [list(map(int, p)) for p in prompts]
        everyone, start = self._group_prompts(local)
        unique, n = _groups(everyone, num_generations)
        completion_ids, logprobs = self._generate(unique, sampling_kwargs(self.trainer, n))
        mine = slice(start, start + len(local))
        return completion_ids[mine], logprobs[mine]

    def _group_prompts(self, local: list[list[int]]) -> tuple[list[list[int]], int]:
        """The prompts of every process of this one's TP group, in rank order, and where this process's start."""
        if self.tp_group is None:
            return local, 0
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(parts, local, group=self.tp_group)
        me = dist.get_rank(self.tp_group)
        return [p for part in parts for p in part], sum(len(part) for part in parts[:me])

    # AQN's NormWeightsEngine -----------------------------------------------------------
    def set_norm_weights(self, named: Mapping[str, torch.Tensor]) -> None:
        """Load AQN's noisy norm weights (``{name: float32 tensor}``, ``DTensor`` shards under FSDP2: gathered whole
        on every process) into the engine for the next generation."""
        self._push_norms(full_tensors(named, keep=self.pushes))

    def restore_norm_weights(self) -> None:
        """Put the engine's clean norm weights back, bit-identically."""
        raise NotImplementedError

    # mode-specific ---------------------------------------------------------------------
    def _sync_lora(self, state: dict[str, torch.Tensor], peft_config: Any, step: int) -> None:
        raise NotImplementedError

    def _push_norms(self, named: dict[str, torch.Tensor]) -> None:
        """Write the whole noisy norm weights into the engine (``named`` is empty where :attr:`pushes` is False)."""
        raise NotImplementedError

    def _generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _tp_groups(world: int, tp: int) -> Any:
    """This process's group among the ``world // tp`` groups of ``tp`` consecutive ranks (every process creates all)."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration([list(range(k * tp, (k + 1) * tp)) for k in range(world // tp)])
    return group


class ColocateVLLMGeneration(_VLLMGeneration):
    """An in-process :class:`qerl_vllm.engine.VLLMEngine`: a whole engine per trainer process, or, with
    ``vllm.tensor_parallel_size`` = T > 1, one TP worker per process of an engine shared by T consecutive processes
    (vLLM's ``external_launcher`` backend on the trainer's own process group, as TRL's colocate mode)."""

    def __init__(self, trainer: Any, model_path: str) -> None:
        super().__init__(trainer)
        try:
            from qerl_vllm.engine import VLLMEngine
        except ImportError as e:
            raise missing_extra(e, "qerl_vllm", _COLOCATE_NEEDS, "vLLM and qerl-vllm", "qerl-trl[vllm]") from e

        args, settings, acc = trainer.args, trainer.args.vllm, trainer.accelerator
        world = int(acc.num_processes)
        self.tp_size = settings.tp_size(world, fsdp2=bool(getattr(acc, "is_fsdp2", False)))
        dtype = settings.dtype
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        extra: dict[str, Any] = {}
        lora_dir = settings.adapter_dir
        if lora_dir is not None and world > 1:  # the processes of one machine write their adapters apart
            lora_dir = os.path.join(lora_dir, f"rank{acc.process_index}")
        if self.tp_size > 1:
            self.tp_group = _tp_groups(world, self.tp_size)
            # vLLM's external launcher reads the launch from the environment (torchrun / accelerate set most of it)
            os.environ.update(RANK=str(acc.process_index), LOCAL_RANK=str(acc.local_process_index),
                              WORLD_SIZE=str(world))  # fmt: skip
            extra.update(tensor_parallel_size=self.tp_size, distributed_executor_backend="external_launcher")
        self.engine = VLLMEngine(
            model_path,
            max_lora_rank=lora_rank_bucket(args.lora_r),
            # one seed per engine: the TP workers of a group must sample the same tokens
            seed=args.seed + acc.process_index // self.tp_size,
            dtype=dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            lora_dir=lora_dir,
            rollout_precision=args.rollout_precision_spec.name,  # fp8 / auto: the plugin's linear method (issue #51)
            lora_tiles=settings.lora_tiles,
            logprobs_mode="processed_logprobs",  # after temperature, like the trainer's logprobs
            **extra,
        )
        try:
            if self.tp_size > 1:
                acc.wait_for_everyone()  # every worker of every group is up before the first collective
            self.shared_weights = share_engine_weights(trainer, self.engine, settings.share_weights)  # one copy
        except BaseException:  # a refused weight share: the engine (its KV cache, its weights) goes, not leaks
            self.engine.close()
            raise

    def _sync_lora(self, state, peft_config, step):
        self.engine.sync_lora(state, version=step, peft_config=peft_config)

    def _push_norms(self, named):
        self.engine.set_norm_weights(named)

    def restore_norm_weights(self):
        self.engine.restore_norm_weights()

    def _generate(self, prompts, sampling):
        if self.tp_group is not None:
            self.trainer.accelerator.wait_for_everyone()  # TRL's drain of the training collectives before vLLM's TP ones
        if isinstance(sampling.get("structured_outputs"), Mapping):  # SamplingParams takes the object, not a dict
            from vllm.sampling_params import StructuredOutputsParams

            sampling = {**sampling, "structured_outputs": StructuredOutputsParams(**sampling["structured_outputs"])}
        gens = self.engine.generate(prompts, sampling)
        return [g.token_ids for g in gens], [g.logprobs for g in gens]

    def close(self) -> None:
        self.engine.close()


NORMS_FILE = "aqn-norms.safetensors"  # server mode: the noisy norms, passed to the server as a file


class ServerVLLMGeneration(_VLLMGeneration):
    """A vLLM OpenAI-compatible server started separately (see the README, "Rollouts with vLLM").

    Needs on the server: ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (adapter
    sync), ``--logprobs-mode processed_logprobs`` (logprobs after temperature), and for AQN (σ > 0)
    ``VLLM_SERVER_DEV_MODE=1`` + ``--worker-extension-cls qerl_vllm.worker.QeRLWorkerExtension``. Adapters and
    noisy norms are passed as files under ``vllm.adapter_dir``, which the server must be able to read.
    With several trainer processes the main one syncs and pushes norms; every process sends its own prompts.
    Dev mode's ``/collective_rpc`` runs worker methods: start the server with ``--host 127.0.0.1`` and never make its
    port reachable by others.
    """

    def __init__(self, trainer: Any, url: str, adapter_dir: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(trainer)
        self.url = url.rstrip("/")
        self.timeout = timeout
        root = adapter_dir or os.path.join(trainer.args.output_dir, "vllm-adapters")
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        models = self._request("GET", "/v1/models")
        if not (isinstance(models, dict) and models.get("data") and isinstance(models["data"][0], dict)):
            raise RuntimeError(f"vLLM server GET {self.url}/v1/models: no model list in the answer "
                               f"{' '.join(str(models).split())[:200]!r} (is vllm.server_url {self.url} a vLLM "
                               "OpenAI-compatible server?)")  # fmt: skip
        self.base_model = models["data"][0]["id"]
        self.lora_name: str | None = None
        self._lora_folder: Path | None = None

    # HTTP ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            detail = " ".join(e.read().decode(errors="replace").split())[:2000]  # one line (an HTML page has many)
            raise RuntimeError(f"vLLM server {method} {self.url}{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:  # refused, unresolvable, timed out: urllib names no URL
            why = e.reason if isinstance(e, urllib.error.URLError) else e
            raise RuntimeError(f"vLLM server {method} {self.url}{path}: {why} (is the server at vllm.server_url "
                               f"{self.url} running and reachable?)") from e  # fmt: skip
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body.decode(errors="replace")

    def _is_main(self) -> bool:
        return bool(self.trainer.accelerator.is_main_process)

    def _barrier(self) -> None:
        self.trainer.accelerator.wait_for_everyone()

    # sync --------------------------------------------------------------------------------
    def _sync_lora(self, state, peft_config, step):
        name = f"qerl-step{step}"
        if self._is_main():
            folder = write_adapter(self.root / name, state, peft_config)
            with contextlib.suppress(RuntimeError):  # a server reused across runs may still hold this name
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            old, old_folder = self.lora_name, self._lora_folder
            if old is not None and old != name:
                with contextlib.suppress(RuntimeError):
                    self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old})
                if old_folder is not None:
                    shutil.rmtree(old_folder, ignore_errors=True)
            self._lora_folder = folder
        self.lora_name = name
        self._barrier()

    def close(self) -> None:
        """Unload this run's adapter from the server and delete the files passed to it (the server stays up)."""
        if self._is_main():
            if self.lora_name is not None:
                with contextlib.suppress(RuntimeError):  # a server already gone holds nothing any more
                    self._request("POST", "/v1/unload_lora_adapter", {"lora_name": self.lora_name})
            if self._lora_folder is not None:
                shutil.rmtree(self._lora_folder, ignore_errors=True)
            (self.root / NORMS_FILE).unlink(missing_ok=True)
        self.lora_name, self._lora_folder = None, None

    def _rpc(self, method: str, *args: str) -> Any:
        try:
            return self._request("POST", "/collective_rpc", {"method": method, "args": list(args)})
        except RuntimeError as e:
            if "HTTP 404" in str(e):
                raise RuntimeError(
                    "AQN needs the vLLM server's dev-mode /collective_rpc route: start it with VLLM_SERVER_DEV_MODE=1 "
                    "and --worker-extension-cls qerl_vllm.worker.QeRLWorkerExtension (or train with aqn=False)"
                ) from e
            raise

    @property
    def pushes(self) -> bool:
        """Server mode: the main process pushes; the others take part in the gathers only."""
        return self._is_main()

    def _push_norms(self, named):
        self._barrier()
        if self._is_main():
            from safetensors.torch import save_file

            path = self.root / NORMS_FILE
            save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in named.items()}, str(path))
            self._rpc("qerl_set_norms_file", str(path))
            self._request("POST", "/reset_prefix_cache")
        self._barrier()

    def restore_norm_weights(self):
        self._barrier()
        if self._is_main():
            self._rpc("qerl_restore_norms")
            self._request("POST", "/reset_prefix_cache")
        self._barrier()

    # generation ------------------------------------------------------------------------
    def _generate(self, prompts, sampling):
        payload = {k: v for k, v in sampling.items() if v is not None}
        payload.update(
            model=self.lora_name or self.base_model,
            prompt=prompts,
            logprobs=0,
            return_token_ids=True,
        )
        out = self._request("POST", "/v1/completions", payload)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        ids = [list(c["token_ids"]) for c in choices]
        lps = [[float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []] for c in choices]
        return ids, lps


class VLLMRollout(RolloutEngine):
    """The :class:`~qerl_trl.rollout.RolloutEngine` on vLLM: a :class:`ColocateVLLMGeneration` (in-process engine) or
    :class:`ServerVLLMGeneration` (``vllm.server_url``) generates, and takes the LoRA adapter and AQN's noisy norm
    weights."""

    name = "vllm"
    seeds_per_prompt = False  # the engine samples with its own seed
    holds_generation_memory = False  # the engine sizes its own KV cache (vllm.gpu_memory_utilization)
    sampling_logprobs = True  # vLLM's processed logprobs: TRL's importance-sampling correction applies
    generates_from_copy = True  # its engine loads the policy's checkpoint; the adapter is synced to it every step
    structured_outputs = True  # vllm_structured_outputs_regex goes into the sampling settings (sampling_kwargs)
    rollout_precisions = ("w4a16", "fp8", "auto")  # colocate; a server's is its own --additional-config

    @classmethod
    def colocated_engine(cls, args: Any) -> bool:
        return not args.vllm.server_url  # colocate mode: the engine shares the trainer's GPUs

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """A checkpoint vLLM loads (NVFP4 or dense), AQN once per generation step, TRL's own ``use_vllm`` off."""
        super().check_config(cfg)
        if not cfg.quant_scheme.vllm_engine:
            raise ValueError(
                f"rollout_engine='vllm' loads an NVFP4 (or dense) checkpoint; quantization={cfg.quantization!r} is "
                "not supported there yet: use rollout_engine='transformers'"
            )
        if cfg.aqn and cfg.aqn_mode != "per_step":
            raise ValueError("rollout_engine='vllm' applies AQN once per generation step: use aqn_mode='per_step'")
        from transformers import GenerationConfig

        hf_names = GenerationConfig().to_dict().keys() - _SHARED_SAMPLING_NAMES
        hf_only = sorted(k for k in (cfg.generation_kwargs or {}) if k in hf_names)
        if hf_only:  # colocated: SamplingParams raises at the first generation; a server drops unknown fields silently
            raise ValueError(f"rollout_engine='vllm' takes vLLM SamplingParams names in generation_kwargs, not "
                             f"transformers' {hf_only} (max_completion_length sets max_tokens; e.g. min_tokens, "
                             "stop_token_ids, stop)")  # fmt: skip
        if cfg.rollout_precision_spec.fp8_copy and cfg.vllm.server_url:
            raise ValueError("rollout_precision is a vLLM server's own setting: start it with --additional-config "
                             "'{\"qerl_rollout_precision\": \"fp8\"}' and keep rollout_precision='w4a16' here")
        if cfg.vllm.lora_tiles not in LORA_TILES:
            raise ValueError(f"vllm.lora_tiles must be one of {', '.join(map(repr, LORA_TILES))}, got "
                             f"{cfg.vllm.lora_tiles!r}")  # fmt: skip
        if cfg.vllm.server_url and cfg.vllm.lora_tiles != "tuned":
            raise ValueError("vllm.lora_tiles sets the colocated engine; a server's LoRA tiles are its own "
                             "VLLM_TUNED_CONFIG_FOLDER (qerl_vllm.lora_tiles.lora_tiles_folder writes one)")  # fmt: skip
        if cfg.use_vllm:
            raise ValueError(
                "rollout_engine='vllm' replaces TRL's use_vllm (which merges LoRA into the 4-bit base); keep use_vllm=False"
            )
        if "n" in (cfg.generation_kwargs or {}):  # sampling_kwargs sets n per call: one group of rows, once
            raise ValueError("rollout_engine='vllm' samples num_generations completions per prompt: set "
                             "num_generations, not generation_kwargs['n']")  # fmt: skip
        if cfg.use_transformers_continuous_batching:  # the transformers engine's generation; nothing here reads it
            raise ValueError("rollout_engine='vllm' generates with vLLM: keep use_transformers_continuous_batching=False "
                             "(or use rollout_engine='transformers')")  # fmt: skip

    @classmethod
    def check_environment(cls, cfg: Any) -> None:
        """Colocate: vLLM and qerl-vllm importable here (a server brings its own)."""
        if not cfg.vllm.server_url:
            _require_vllm_here(_COLOCATE_NEEDS)

    def __init__(self, trainer: Any, prepared: str | None = None) -> None:
        super().__init__(trainer)
        settings = trainer.args.vllm
        if settings.server_url:
            self.generation: _VLLMGeneration = ServerVLLMGeneration(
                trainer, settings.server_url, settings.adapter_dir, settings.server_timeout
            )
        elif prepared is None:
            raise ValueError("colocate vLLM rollouts need the engine checkpoint (vllm.model_path)")
        else:
            self.generation = ColocateVLLMGeneration(trainer, prepared)

    @classmethod
    def check_evaluation(cls, scheme: QuantScheme) -> None:
        if not scheme.vllm_engine:
            raise ValueError(f"--engine vllm loads NVFP4 or dense checkpoints, not --quantization {scheme}; "
                             "use --engine transformers")  # fmt: skip
        _require_vllm_here("qerl eval --engine vllm")  # before the model loads

    @classmethod
    def evaluation_generator(cls, model_name, model, scheme, *, seed, dtype, adapter) -> Any:
        """``qerl eval --engine vllm``: a vLLM engine on the evaluated checkpoint (NVFP4 saved once if quantized on
        load), with ``adapter`` synced as a LoRA adapter (the engine's ``max_lora_rank`` holds its rank)."""
        from peft import PeftModel
        from qerl_vllm.engine import VLLMEngine, adapter_rank  # there: check_evaluation ran first

        base = model.get_base_model() if isinstance(model, PeftModel) else model
        path = engine_checkpoint(model_name, base, scheme)
        rank = adapter_rank(Path(adapter)) if adapter else None
        # vLLM preallocates its LoRA buffers for max_lora_rank and refuses a larger adapter
        max_rank = max(64, lora_rank_bucket(rank or 0))
        engine = VLLMEngine(path, seed=seed, max_lora_rank=max_rank, dtype=dtype)  # same compute dtype as HF
        if adapter:
            engine.sync_lora(adapter, version=1)
        return engine

    @classmethod
    def prepare(cls, model_name, model, scheme, args):
        """The checkpoint the colocated engine loads (the NVFP4 base, saved once before PEFT wraps the model)."""
        if args.vllm.server_url:
            return None
        return engine_checkpoint(model_name, model, scheme, override=args.vllm.model_path, cache_dir=args.vllm.cache_dir)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None and any(im is not None for im in images):
            raise NotImplementedError("rollout_engine='vllm' does not support images yet")
        with profiling_context(self.trainer, "vLLM.generate"):
            return self.generation.generate(prompt_ids, num_generations)

    def sync_lora(self) -> None:
        with profiling_context(self.trainer, "sync_weights"):
            self.generation.sync_weights()

    @property
    def noise_target(self) -> _VLLMGeneration:
        return self.generation

    def close(self) -> None:
        self.generation.close()
