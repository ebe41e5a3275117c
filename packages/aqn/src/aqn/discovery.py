"""Structural discovery of RMSNorm → linear pairs.

AQN adds noise to the weight ``w`` (shape ``[d]``) of an RMSNorm-style module whose output ``y = w ⊙ n(x)`` is the
input of one or more linear layers. The reference implementation matched norms by their transformers class, which is
a silent no-op on a rollout engine's own model classes. Here pairs are found by *tracing*:

1. candidate norms: modules with a 1-D ``weight`` Parameter, no bias, and either a class name containing
   ``RMSNorm`` or an ``eps`` / ``variance_epsilon`` attribute (so HF ``*RMSNorm``, ``torch.nn.RMSNorm``, vLLM's
   ``RMSNorm`` all qualify; ``nn.LayerNorm`` with a bias does not — its bias breaks the multiplicative equivalence);
2. candidate linears: ``nn.Linear`` subclasses and any module whose class name contains ``Linear`` (vLLM's fused
   ``QKVParallelLinear`` / ``MergedColumnParallelLinear``, PEFT's LoRA ``Linear``, ``NVFP4Linear``), and any other
   module holding a weight matrix of its own (a floating Parameter of 2 or more dims) with no linear inside it: a
   mixture-of-experts router (``MixtralTopKRouter``, ``[E, d]``) and fused experts (``Qwen3MoeExperts``, ``[E, ., d]``),
   which call ``F.linear`` on their own parameters;
3. one tiny forward with hooks; a linear is fed by a norm when one of its tensor inputs shares storage with that
   norm's (first) output — the same tensor or a view of it (HF slices the final hidden state before ``lm_head``).
   All norm outputs are kept alive during the trace, so a storage address cannot be recycled by an unrelated tensor.
   When several norm outputs share the storage (in-place fused add-norm kernels), the latest norm call wins.

Wrappers are collapsed to the outermost matching linear (PEFT ``q_proj`` rather than ``q_proj.base_layer`` and
``q_proj.lora_A.default``).

What is found, per decoder layer of Llama / Qwen2 / Qwen3 / Mistral: ``input_layernorm → q_proj, k_proj, v_proj``
(one shared vector) and ``post_attention_layernorm → gate_proj, up_proj`` (in a mixture-of-experts layer, Mixtral /
Qwen3-MoE / gpt-oss: ``→ mlp.gate`` or ``mlp.router``, ``mlp.experts``). ``o_proj`` and ``down_proj`` are fed by no
norm. Qwen3's per-head ``q_norm`` / ``k_norm`` feed rotary embeddings, not a linear, so they are reported in
``skipped`` and never noised. The final norm feeds ``lm_head``; the paper only perturbs the per-layer norms, so it is
excluded unless ``include_final_norm=True``.

If the traced forward cannot run, ``method="auto"`` falls back (with a warning) to the HF decoder-layer naming
convention: ``input_layernorm`` → ``self_attn.{q,k,v,qkv}_proj``, ``post_attention_layernorm`` →
``mlp.{gate,up,gate_up}_proj`` (or a MoE layer's ``mlp.{gate,router,experts}``); in a layer that has a
``pre_feedforward_layernorm`` (Gemma 2 / 3), that norm feeds the MLP and ``post_attention_layernorm`` (on the attention
output) feeds nothing.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "NormLinearGroup",
    "find_norm_linear_pairs",
    "is_linear_like",
    "is_rmsnorm_like",
]

ExampleInputs = torch.Tensor | Mapping[str, Any] | Sequence[Any] | Callable[[nn.Module], Any] | None

_LM_HEAD_NAMES = ("lm_head", "embed_out", "output")


@dataclass(frozen=True)
class NormLinearGroup:
    """One norm and the linears that consume its output.

    Attributes:
        norm_name: qualified module name of the norm (``"model.layers.0.input_layernorm"``).
        weight_name: qualified name of its weight parameter (``norm_name + ".weight"``), the tensor AQN perturbs.
        linear_names: qualified names of the linears fed by the norm, in call order (``("...q_proj", ...)``).
        num_channels: d, the length of the norm weight (= ``in_features`` of each linear).
        feeds_output_embeddings: True for the final norm feeding ``lm_head`` (excluded by default).
        found_by: ``"trace"`` or ``"convention"``.
        norm: the norm module itself (not part of equality / repr).
    """

    norm_name: str
    weight_name: str
    linear_names: tuple[str, ...]
    num_channels: int
    feeds_output_embeddings: bool = False
    found_by: Literal["trace", "convention"] = "trace"
    norm: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def weight(self) -> nn.Parameter:
        """The norm's weight Parameter, ``[d]``."""
        if self.norm is None:
            raise AttributeError("this group carries no module reference")
        return self.norm.weight


def is_rmsnorm_like(module: nn.Module) -> bool:
    """True for a scale-only norm: 1-D ``weight`` Parameter, no bias, RMSNorm-ish name or an ``eps`` attribute."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    if getattr(module, "bias", None) is not None:
        return False
    if "rmsnorm" in type(module).__name__.lower():
        return True
    return any(hasattr(module, a) for a in ("variance_epsilon", "eps", "epsilon"))


def is_linear_like(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and modules whose class name contains ``Linear`` (fused / quantized / LoRA linears)."""
    return isinstance(module, nn.Linear) or "linear" in type(module).__name__.lower()


def _is_consumer(module: nn.Module) -> bool:
    """A module that feeds its input to a matmul: linear-like (:func:`is_linear_like`), or holding a floating weight
    matrix of its own and no linear-like module inside (a MoE router or fused experts module)."""
    if is_linear_like(module):
        return True
    if not any(p.dim() >= 2 and p.is_floating_point() for p in module.parameters(recurse=False)):
        return False
    return not any(is_linear_like(m) for m in module.modules() if m is not module)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if ptr == 0:
        return None
    return (str(t.device), ptr)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _run_example(model: nn.Module, example_inputs: ExampleInputs) -> None:
    if callable(example_inputs) and not isinstance(example_inputs, (torch.Tensor, Mapping, Sequence)):
        example_inputs(model)
    elif isinstance(example_inputs, Mapping):
        model(**example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        model(example_inputs)
    elif isinstance(example_inputs, Sequence):
        model(*example_inputs)
    else:  # default: a few token ids, as any causal LM accepts
        ids = torch.zeros((1, 4), dtype=torch.long, device=_model_device(model))
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        if "input_ids" in params:
            kwargs: dict[str, Any] = {"input_ids": ids}
            if "use_cache" in params:
                kwargs["use_cache"] = False
            model(**kwargs)
        else:
            model(ids)


def _output_embedding_names(model: nn.Module, names: dict[nn.Module, str]) -> set[str]:
    out: set[str] = set()
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except Exception:  # noqa: BLE001 - best effort on arbitrary models
            head = None
        if isinstance(head, nn.Module) and head in names:
            out.add(names[head])
    for m, n in names.items():
        if n.rsplit(".", 1)[-1] in _LM_HEAD_NAMES or "lmhead" in type(m).__name__.lower():
            out.add(n)
    return out


def _collapse_to_outermost(linear_names: list[str]) -> list[str]:
    kept: list[str] = []
    for n in linear_names:
        if any(n.startswith(other + ".") for other in linear_names if other != n):
            continue
        if n not in kept:
            kept.append(n)
    return kept


def _trace(model: nn.Module, norms: dict[str, nn.Module], example_inputs: ExampleInputs) -> dict[str, list[str]]:
    """Run one forward and return ``{norm_name: [linear names fed by it, call order]}`` (all candidate norms)."""
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if n and _is_consumer(m)}
    clock = [0]
    norm_calls: list[tuple[int, str, torch.Tensor]] = []  # keeps outputs alive: no storage address reuse
    storage_to_calls: dict[tuple[str, int], list[int]] = {}
    feeds: dict[str, list[str]] = {n: [] for n in norms}
    handles = []

    def norm_hook(name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, out: Any) -> None:
            t = _first_tensor(out)
            clock[0] += 1
            if t is None:
                return
            key = _storage_key(t)
            if key is None:
                return
            norm_calls.append((clock[0], name, t))
            storage_to_calls.setdefault(key, []).append(len(norm_calls) - 1)

        return hook

    def linear_hook(name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            clock[0] += 1
            for x in list(args) + list(kwargs.values()):
                if not isinstance(x, torch.Tensor):
                    continue
                key = _storage_key(x)
                if key is None or key not in storage_to_calls:
                    continue
                _, norm_name, out = norm_calls[storage_to_calls[key][-1]]  # latest norm writing this storage
                d = norms[norm_name].weight.numel()
                if x.dim() >= 1 and x.shape[-1] == d and out.shape[-1] == d and name not in feeds[norm_name]:
                    feeds[norm_name].append(name)

        return hook

    was_training = {m: m.training for m in model.modules()}
    try:
        for n, m in norms.items():
            handles.append(m.register_forward_hook(norm_hook(n)))
        for n, m in linears.items():
            handles.append(m.register_forward_pre_hook(linear_hook(n), with_kwargs=True))
        model.eval()  # dropout off: a dropout between norm and linear would hide the pair
        with torch.no_grad():
            _run_example(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m, flag in was_training.items():
            m.training = flag
        norm_calls.clear()
    return {n: _collapse_to_outermost(v) for n, v in feeds.items()}


def _convention(model: nn.Module, norms: dict[str, nn.Module]) -> dict[str, list[str]]:
    modules = dict(model.named_modules())
    mlp = ("mlp", ("gate_proj", "up_proj", "gate_up_proj", "gate", "router", "experts"))
    targets = {
        "input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj", "qkv_proj", "W_pack")),
        "post_attention_layernorm": mlp,
        "pre_feedforward_layernorm": mlp,
    }
    feeds: dict[str, list[str]] = {n: [] for n in norms}
    for name in norms:
        parent, _, leaf = name.rpartition(".")
        if leaf not in targets:
            continue
        if leaf == "post_attention_layernorm" and f"{parent}.pre_feedforward_layernorm".lstrip(".") in norms:
            continue  # Gemma 2/3 sandwich norms: this one scales the attention output, the pre-feedforward one the MLP's input
        block, projs = targets[leaf]
        prefix = f"{parent}.{block}" if parent else block
        for p in projs:
            lin = f"{prefix}.{p}"
            if lin in modules and _is_consumer(modules[lin]):
                feeds[name].append(lin)
    return feeds


def find_norm_linear_pairs(
    model: nn.Module,
    example_inputs: ExampleInputs = None,
    *,
    include_final_norm: bool = False,
    method: Literal["auto", "trace", "convention"] = "auto",
    return_skipped: bool = False,
) -> list[NormLinearGroup] | tuple[list[NormLinearGroup], list[str]]:
    """Find every RMSNorm-style module whose output feeds linear layers.

    Args:
        model: any ``nn.Module`` (HF model, PEFT-wrapped model, an engine's own model in eager mode).
        example_inputs: what to run the traced forward with: a tensor (``model(t)``), a mapping (``model(**m)``),
            a sequence (``model(*s)``) or a callable ``f(model)``. Default: ``input_ids`` zeros ``[1, 4]`` (int64)
            on the model's device, which any causal LM accepts.
        include_final_norm: also return the final norm feeding ``lm_head`` (the paper leaves it alone).
        method: ``"trace"`` (only tracing; errors propagate), ``"convention"`` (HF names only), ``"auto"`` (trace,
            fall back to the convention with a warning if the forward raises).
        return_skipped: also return names of candidate norms that feed no linear (Qwen3 ``q_norm``/``k_norm``,
            Gemma's post-norms) or only ``lm_head`` when excluded.

    Returns:
        groups in module order (and the skipped names if asked).

    Raises:
        ValueError: no RMSNorm-style module feeding a linear layer was found (AQN would be a silent no-op).
    """
    if method not in ("auto", "trace", "convention"):
        raise ValueError(f"method must be 'auto', 'trace' or 'convention', got {method!r}")
    names = {m: n for n, m in model.named_modules()}
    norms = {n: m for n, m in model.named_modules() if is_rmsnorm_like(m)}
    found_by: Literal["trace", "convention"] = "trace"
    if not norms:
        feeds: dict[str, list[str]] = {}
    elif method == "convention":
        feeds, found_by = _convention(model, norms), "convention"
    else:
        try:
            feeds = _trace(model, norms, example_inputs)
        except Exception as e:
            if method == "trace":
                raise
            warnings.warn(
                f"aqn: tracing {type(model).__name__} failed ({type(e).__name__}: {e}); falling back to the HF "
                "decoder-layer naming convention. Pass example_inputs= to trace the real graph.",
                stacklevel=2,
            )
            feeds, found_by = _convention(model, norms), "convention"
    heads = _output_embedding_names(model, names)
    groups: list[NormLinearGroup] = []
    skipped: list[str] = []
    for name, mod in norms.items():
        lins = tuple(feeds.get(name, ()))
        if not lins:
            skipped.append(name)
            continue
        is_final = any(lin in heads for lin in lins)
        if is_final and not include_final_norm:
            skipped.append(name)
            continue
        groups.append(
            NormLinearGroup(
                norm_name=name,
                weight_name=f"{name}.weight" if name else "weight",
                linear_names=lins,
                num_channels=mod.weight.numel(),
                feeds_output_embeddings=is_final,
                found_by=found_by,
                norm=mod,
            )
        )
    if not groups:
        detail = (
            f" (candidate norms that feed no linear: {skipped[:6]}{'...' if len(skipped) > 6 else ''})"
            if skipped
            else ""
        )
        raise ValueError(
            f"found no RMSNorm-style module feeding a linear layer in {type(model).__name__}; "
            f"AQN would be a no-op{detail}"
        )
    return (groups, skipped) if return_skipped else groups
