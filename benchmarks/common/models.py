"""Random-weight models of :mod:`common.shapes`, built layer by layer in an arm's format, with the paper's LoRA.

Arms (LoRA r=32 on q/k/v/o/gate/up/down in every arm, adapters in ``lora_dtype``), each a ``qerl_trl.quantization``
scheme that converts the layers (``QuantScheme.quantize_``): ``bf16`` (``none``) + PEFT LoRA; ``qlora``
(bitsandbytes NF4, compute bf16, double quant as in QLoRA) + PEFT LoRA; ``nvfp4`` (``NVFP4Linear``, Triton W4A16
kernels) + ``nvfp4.peft.get_peft_model``. ``<arm>-base``: the same without LoRA (``rollout_vllm.py``'s bf16
checkpoint). Built on the meta device and materialised decoder layer by decoder layer, each converted before the next
exists, so a 32B model never exists in bf16 in full (embeddings and ``lm_head`` stay bf16 in every arm).
"""

from __future__ import annotations

import time
from typing import Any

from .env import gb, sync
from .shapes import LINEARS, meta_model, qwen2_config

ARMS = ("bf16", "qlora", "nvfp4")
#: the arm the others are compared with (ratios: ours / other)
OURS = "nvfp4"
ARM_LABEL = {"bf16": "bf16 + LoRA", "qlora": "QLoRA (bnb NF4 + LoRA)", "nvfp4": "NVFP4 + LoRA (ours)"}
_ARM_SCHEME = {"bf16": "none", "qlora": "nf4", "nvfp4": "nvfp4-{method}"}


def arm_scheme(arm: str, nvfp4_method: str = "rtn"):
    """The ``qerl_trl.quantization.QuantScheme`` of ``arm``'s base layers (``nvfp4_method``: the NVFP4 arm's method)."""
    from qerl_trl.quantization import SCHEMES

    return SCHEMES[_ARM_SCHEME[arm.removesuffix("-base")].format(method=nvfp4_method)]


def init_(module, std: float = 0.02) -> None:
    """Random weights: matrices and biases ~ N(0, std²), norm weights 1."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters(recurse=True):
            if p.ndim < 2 and ("norm" in name or "layernorm" in name):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def materialize(module, device, dtype) -> None:
    """A meta-device ``module`` on ``device`` in ``dtype`` with :func:`init_` weights."""
    module.to_empty(device=device)
    module.to(dtype)
    init_(module)


def build_model(
    model_key: str, arm: str, device, dtype, *, lora_r: int, lora_dtype, double_quant: bool, nvfp4_method: str
) -> tuple[Any, dict]:
    """Random-weight Qwen2 of ``MODELS[model_key]``'s shape on ``device``, in ``arm``'s format (+ LoRA). Returns the
    model and ``{"quantize_s", "lora_params", "lora_layer_types"}``."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = qwen2_config(model_key, attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    model = meta_model(cfg, dtype)
    scheme = arm_scheme(arm, nvfp4_method)
    t_quant = 0.0
    for layer in model.model.layers:
        materialize(layer, device, dtype)
        sync()
        t0 = time.perf_counter()
        scheme.quantize_(layer, double_quant=double_quant)
        sync()
        t_quant += time.perf_counter() - t0
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        materialize(mod, device, dtype)
    model.model.rotary_emb = Qwen2RotaryEmbedding(cfg).to(device)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on meta: {leftover[:5]}")
    model.generation_config.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model.eval()
    model.requires_grad_(False)
    if arm.removesuffix("-base") == "qlora":
        model.is_loaded_in_4bit = True  # PEFT dispatches bnb.nn.Linear4bit to its lora.bnb.Linear4bit

    info: dict[str, Any] = {"quantize_s": round(t_quant, 2)}
    if not arm.endswith("-base"):
        model = add_lora(model, lora_r, lora_dtype, device, info)
    return model, info


def add_lora(model, lora_r: int, lora_dtype, device, info: dict):
    """The benchmarks' adapter: LoRA r = ``lora_r``, alpha 2r, on the seven linears of every layer (NVFP4 layers get
    ``LoraNVFP4Linear``), adapters in ``lora_dtype`` on ``device``; adds ``lora_params`` / ``lora_layer_types`` to
    ``info``."""
    from nvfp4.peft import get_peft_model  # peft's, with NVFP4Linear mapped to LoraNVFP4Linear
    from peft import LoraConfig

    lcfg = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=list(LINEARS), bias="none",
                      task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
    n_lora = 0
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(device=device, dtype=lora_dtype)
            n_lora += p.numel()
    model.eval()
    types = {type(m).__module__ + "." + type(m).__name__ for m in model.modules()
             if hasattr(m, "lora_A") and hasattr(m, "base_layer")}  # fmt: skip
    info.update(lora_params=n_lora, lora_layer_types=sorted(types))
    return model


def build_arm(args, device, dtype, res: dict):
    """:func:`build_model` for ``args.model`` / ``args.arm`` on ``device``, with ``build_s``, the build info and
    ``weights_gpu_gb`` added to ``res``; or None with ``res["status"]`` saying why not (QLoRA, OOM)."""
    import torch

    cuda = device.type == "cuda"
    if args.arm == "qlora":
        if not cuda:
            res["status"] = "skipped: bitsandbytes NF4 arm needs CUDA (CPU validation run)"
            return None
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            res["status"] = f"skipped: bitsandbytes not importable ({e})"
            return None
    t0 = time.perf_counter()
    try:
        model, info = build_model(args.model, args.arm, device, dtype, lora_r=args.lora_r,
                                  lora_dtype=getattr(torch, args.lora_dtype), double_quant=not args.no_double_quant,
                                  nvfp4_method=args.nvfp4_method)  # fmt: skip
    except torch.OutOfMemoryError as e:
        res["status"] = f"does not fit: OOM while building ({str(e).splitlines()[0][:200]})"
        return None
    sync()
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res.update(info)
    if cuda:
        res["weights_gpu_gb"] = gb(torch.cuda.memory_allocated(device))
    return model


def graph_compile_options(args) -> dict:
    """``torch.compile`` keyword arguments of ``graph_generate``'s decode step from the benchmark's knobs; static
    shapes, so each batch size gets its own graph."""
    return dict(fullgraph=args.fullgraph, dynamic=False, backend=args.compile_backend,
                mode=args.compile_mode if args.compile_backend == "inductor" else None)  # fmt: skip


def spread_lengths(n: int, mean_tokens: float, min_tokens: int, cap: int, seed: int = 0) -> list[int]:
    """``n`` completion lengths from the distribution :func:`spread_eos_ids` gives a near-uniform model (past
    ``min_tokens`` a row stops with probability ``1 / mean_tokens`` a step, capped at ``cap``), drawn from ``seed``:
    for engines that take fewer stop ids (vLLM: 128 a request)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_min(1e-12)
    p = 1.0 / mean_tokens
    steps = torch.ceil(torch.log(u) / torch.log1p(torch.tensor(-p, dtype=torch.float64)))  # Geometric(p) on 1, 2, ...
    return [int(min(cap, min_tokens + k)) for k in steps.clamp_min(1).tolist()]


def spread_eos_ids(vocab: int, mean_tokens: float, seed: int = 0) -> list[int]:
    """``round(vocab / mean_tokens)`` distinct token ids (never 0, the pad id of the spread-length runs), drawn once from ``seed``."""
    import torch

    k = max(1, round(vocab / mean_tokens))
    perm = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(seed))[:k] + 1
    return sorted(perm.tolist())
