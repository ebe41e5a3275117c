"""Channel-wise Gaussian noise on RMSNorm weights, applied in place and restored bit-identically.

Math. An RMSNorm computes ``y = w ⊙ x / rms(x)`` with a weight ``w`` of shape ``[d]``. Replacing ``w`` by ``w + Z``,
``Z ~ N(0, σ² I_d)``, gives ``y' = (1 + Z/w) ⊙ y``; for every linear ``W`` (``[out, d]``) fed by ``y``::

    W y' = (W · diag(1 + Z/w)) y

i.e. multiplicative noise on the *input columns* of q/k/v (one shared vector per layer) and gate/up (another), at no
extra kernel cost. ``o_proj`` / ``down_proj`` are fed by no norm and get no noise.

Noise is drawn in float32 (on the CPU by default, so the same seed gives the same noise on any device) and added to
the weight in float32 (or float64 for float64 weights) before being rounded to the weight's dtype. For bf16 weights
that rounding eats small σ entirely (bf16 has 8 significant bits: the spacing next to |w| ≈ 0.27, the median of
SmolLM2's norm weights, is 2⁻⁹ ≈ 2e-3) — see ``docs/aqn.md`` and :func:`measure_rounding_survival`. ``norm_dtype=
torch.float32`` leaves the weights alone and, while noise is on, swaps each norm for a wrapper that adds the noise
term ``Z ⊙ x/rms(x)`` (the exact effect of ``w + Z``) in float32 to the norm's output, so the perturbation reaches the
output, rounded once.

Seeding. With ``seed=s, step=k`` each parameter named ``n`` gets its own generator seeded from ``(s, k, n, draw)``
(blake2b), so the noise of a parameter does not depend on which other parameters are noised or in what order:
``NormNoise.apply(σ, seed=s, step=k)`` on an HF model and ``noisy_norm_weights(params, σ, seed=s, step=k)`` pushed to
an engine give the same noise for the same names. An explicit ``torch.Generator`` instead draws sequentially in name
order.
"""

from __future__ import annotations

import hashlib
import numbers
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .discovery import ExampleInputs, NormLinearGroup, find_norm_linear_pairs

__all__ = [
    "NoiseHandle",
    "NormNoise",
    "measure_rounding_survival",
    "noise_seed",
    "noisy_norm_weights",
    "sample_noise",
]

_MASK63 = (1 << 63) - 1

# id(norm weight) -> (the weight, the live handle noising it), across NormNoise objects: two over one model must not
# stack (the second would save the first's noisy weights as its originals). By id: tensors compare elementwise; weak
# references: the registry keeps neither a weight nor a handle (and its model) alive.
_LIVE: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[NoiseHandle]]] = {}


def _live_handle(t: torch.Tensor) -> NoiseHandle | None:
    """The live handle whose noise is on ``t``, if any."""
    entry = _LIVE.get(id(t))
    handle = entry[1]() if entry is not None and entry[0]() is t else None
    return handle if handle is not None and handle.active else None


def noise_seed(seed: int, step: int, name: str, draw: int = 0) -> int:
    """Deterministic 63-bit generator seed for parameter ``name`` at ``step`` (``draw`` > 0: per-forward resamples)."""
    msg = f"aqn:{int(seed)}:{int(step)}:{int(draw)}:{name}".encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") & _MASK63


def _check_sigma(sigma: float) -> float:
    """``sigma`` as a float; ``ValueError`` in one line for anything but a finite real number >= 0 (``None``, a string
    and a bool too: ``True`` would be σ = 1, a hundred times the paper's largest)."""
    value = sigma.item() if isinstance(sigma, torch.Tensor) and sigma.numel() == 1 else sigma
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    value = float(value)
    if not value >= 0 or value == float("inf"):  # also rejects NaN
        raise ValueError(f"sigma must be a finite number >= 0, got {value}")
    return value


def sample_noise(
    shape: torch.Size | tuple[int, ...],
    sigma: float,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``N(0, σ²)`` noise of ``shape`` in float32, drawn from ``generator`` (or a fresh CPU generator seeded ``seed``),
    then moved to ``device``."""
    sigma = _check_sigma(sigma)
    if generator is None:
        generator = torch.Generator(device="cpu")
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed) & _MASK63)
    z = torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device=generator.device)
    z.mul_(sigma)
    return z if device is None else z.to(device)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _shard_like(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``z`` (a whole ``[d]`` noise vector) laid out as ``t``: unchanged for a plain tensor; for a ``DTensor`` (a norm
    weight sharded by FSDP2) the DTensor whose local part is this rank's slice of ``z``, cut locally
    (``src_data_rank=None``: every rank drew the same ``z`` from the same seed, so no communication)."""
    if not _is_dtensor(t):
        return z
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(z.to(t.device), t.device_mesh, t.placements, src_data_rank=None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _add_noise(t: torch.Tensor, z: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t + z`` computed in float32 (float64 if ``t`` is float64), returned in ``dtype`` (default ``t.dtype``).
    ``t`` may be a sharded ``DTensor`` (FSDP2): each rank adds its slice of the whole ``z``."""
    acc = torch.promote_types(t.dtype, torch.float32)
    return (t.detach().to(acc) + _shard_like(z.to(device=t.device, dtype=acc), t)).to(dtype or t.dtype)


def _global_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def _draw(
    named: list[tuple[str, torch.Tensor]],
    sigma: float,
    *,
    seed: int | None,
    step: int,
    draw: int,
    generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """float32 noise per name (on each tensor's device)."""
    out: dict[str, torch.Tensor] = {}
    if generator is not None:
        for name, t in sorted(named, key=lambda kv: kv[0]):
            out[name] = sample_noise(t.shape, sigma, generator=generator, device=t.device)
        return out
    if seed is None:
        seed = _global_seed()
    for name, t in named:
        out[name] = sample_noise(t.shape, sigma, seed=noise_seed(seed, step, name, draw), device=t.device)
    return out


def noisy_norm_weights(
    named_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    sigma: float,
    generator: torch.Generator | None = None,
    *,
    seed: int | None = None,
    step: int = 0,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, w + Z)`` copies of norm weights for an external engine (e.g. a vLLM weight update).

    The sources are never modified. Each yielded tensor has the source's shape ``[d]`` and device, and ``dtype``
    (default: the source's dtype; pass ``torch.float32`` if the engine keeps fp32 norms). With the same ``seed`` /
    ``step`` and names, the noise equals what :meth:`NormNoise.apply` adds. ``sigma == 0`` yields exact copies.

    The arguments are checked here, at the call (``ValueError`` for a bad σ or a weight that is not 1-D), not when the
    copies are first taken (the noise is drawn then).
    """
    sigma = _check_sigma(sigma)
    items = list(named_params.items()) if isinstance(named_params, Mapping) else list(named_params)
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D norm weight, got {_describe(t)}")
    if generator is None and seed is None and sigma != 0:
        seed = _global_seed()  # drawn now: reproducible under the torch.manual_seed in force at the call
    return _noisy_copies(items, sigma, generator, seed=seed, step=step, dtype=dtype)


def _describe(t: Any) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def _noisy_copies(
    items: list[tuple[str, torch.Tensor]],
    sigma: float,
    generator: torch.Generator | None,
    *,
    seed: int | None,
    step: int,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    if sigma == 0:
        for name, t in items:
            yield name, t.detach().to(dtype or t.dtype, copy=True)
        return
    noise = _draw(items, sigma, seed=seed, step=step, draw=0, generator=generator)
    for name, t in items:
        yield name, _add_noise(t, noise[name], dtype)


def _survival(orig: torch.Tensor, new: torch.Tensor, z: torch.Tensor) -> dict[str, float]:
    """How much of the intended noise ``z`` survived in ``new - orig`` (all float64 sums)."""
    r = new.detach().double() - orig.detach().double()
    z = z.detach().double().to(r.device)
    zz = float((z * z).sum())
    return {
        "fraction_changed": float((r != 0).double().mean()),
        # projection of the realised perturbation on the intended one: 1 = all there, 0 = lost
        "retained": float((r * z).sum()) / zz if zz > 0 else float("nan"),
        "relative_error": float(((r - z) ** 2).sum() ** 0.5) / zz**0.5 if zz > 0 else float("nan"),
        "energy_ratio": float((r * r).sum()) / zz if zz > 0 else float("nan"),
    }


def _merge_survival(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    # sharded (FSDP2) weights: this rank's slices
    parts = [(_local(o), _local(n), _local(_shard_like(z, o))) for o, n, z in parts]
    if not parts:
        return {"fraction_changed": 0.0, "retained": float("nan"), "relative_error": float("nan")}
    orig = torch.cat([o.detach().double().flatten().cpu() for o, _, _ in parts])
    new = torch.cat([n.detach().double().flatten().cpu() for _, n, _ in parts])
    z = torch.cat([z.detach().double().flatten().cpu() for _, _, z in parts])
    return _survival(orig, new, z)


def measure_rounding_survival(
    weights: torch.Tensor | Iterable[torch.Tensor],
    sigma: float,
    dtype: torch.dtype = torch.bfloat16,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """What fraction of ``N(0, σ²)`` noise survives when ``w + Z`` is stored in ``dtype``.

    ``weights`` are the norm weights (any dtype; they are first rounded to ``dtype``, as a checkpoint in that dtype
    would be). Returns ``fraction_changed`` (channels whose stored value moved), ``retained`` (projection
    ``<r, Z>/<Z, Z>`` of the realised perturbation ``r`` on the intended ``Z``: 1 = intact, 0 = lost),
    ``relative_error`` (``‖r − Z‖/‖Z‖``) and ``energy_ratio`` (``‖r‖²/‖Z‖²``).
    """
    sigma = _check_sigma(sigma)
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    w = torch.cat([t.detach().flatten().to(dtype).cpu() for t in ws])
    z = sample_noise(w.shape, sigma, seed=seed)
    new = _add_noise(w, z)
    return _survival(w, new, z)


class _NoisyNorm(nn.Module):
    """An RMSNorm whose weight reads as ``w + Z`` without being touched: ``norm(x) + Z ⊙ n(x)``, ``n(x) = x/rms(x)``.

    The norm runs on the input cast to ``noise.dtype`` (float32), the noise term is added in it and the sum is rounded
    once to the input dtype, so σ below the resolution of bf16 weights reaches the output (with ``Z = 0`` this is the
    norm computed in float32, within one rounding of the bf16 model's own output). AQN swaps these in for the norms
    while noise is on (``NormNoise(..., norm_dtype=...)``). The model then has no hooks and no parameter of a changed
    dtype, so a compiled decode step traces it like any module (the hooks and fp32 weight storage this replaces gave
    garbage tokens under ``torch.compile`` on the H100; docs/aqn.md).
    ``noise`` (``[d]``) is one buffer for the wrapper's life: a CUDA graph captured on it reads each draw in place.

    ``n(x)`` is the RMSNorm normalisation, ``x · rsqrt(mean(x²) + eps)`` in float32, which gives the exact noise term
    for both weight forms in use: ``w ⊙ n(x)`` (Llama, Qwen, Mistral) and ``(1 + w) ⊙ n(x)`` (Gemma); with
    ``centered`` it is a bias-free LayerNorm's, ``x`` less its mean first (Cohere). :func:`_check_rmsnorm` finds which
    one the norm computes on a probe before it is wrapped.
    """

    def __init__(self, norm: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = norm
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        # None: torch.nn.RMSNorm's default, finfo of its input's dtype, which is noise.dtype here
        self.eps = None if eps is None else float(eps)
        self.centered = False  # a bias-free LayerNorm: n(x) of x less its mean (set by _check_rmsnorm)
        w = norm.weight
        self.register_buffer("noise", torch.zeros(w.shape, dtype=dtype, device=w.device), persistent=False)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x)`` over the last dim (``x`` less its mean first if ``centered``), in ``noise.dtype``."""
        xf = x.to(self.noise.dtype)
        if self.centered:
            xf = xf - xf.mean(-1, keepdim=True)
        eps = torch.finfo(xf.dtype).eps if self.eps is None else self.eps
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the norm on a float32 input computes w ⊙ n(x) in float32 (HF norms promote), unrounded: the noise term
        # then moves the value before its one rounding (added to an already rounded output, small σ would vanish)
        out = self.norm(x.to(self.noise.dtype), *args, **kwargs)
        if isinstance(out, tuple):  # a fused add-norm (vLLM's): (norm(x + residual), x + residual), noised on the sum
            y, normed_input = out[0], out[1]
            return ((y.to(self.noise.dtype) + self.noise * self.normalized(normed_input)).to(x.dtype), *out[1:])
        return (out.to(self.noise.dtype) + self.noise * self.normalized(x)).to(x.dtype)


def _check_rmsnorm(name: str, wrapper: _NoisyNorm) -> None:
    """Raise ``ValueError`` unless the wrapped norm, run as the wrapper runs it (float32 input, ``Z = 0``), computes
    ``w ⊙ n(x)`` or ``(1 + w) ⊙ n(x)`` on a random probe, ``n(x)`` an RMSNorm's or else a bias-free LayerNorm's (then
    ``wrapper.centered`` is set)."""
    norm, w = wrapper.norm, wrapper.norm.weight
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)) + 1.0  # off-centre: the forms differ
    x = x.to(device=w.device, dtype=w.dtype)
    why = "does not compute w * x/rms(x) nor (1 + w) * x/rms(x) (nor with x less its mean)"
    try:
        with torch.no_grad():
            y = norm(x.to(wrapper.noise.dtype)).double()
        wd = w.detach().double()
        ok = False
        for centered in (False, True):
            wrapper.centered = centered
            n = wrapper.normalized(x).double()
            err = min(float((y - wd * n).abs().max()), float((y - (1 + wd) * n).abs().max()))
            if err <= 1e-4 * (float(y.abs().max()) + 1e-12):
                ok = True
                break
    except (RuntimeError, TypeError) as e:  # e.g. a fused norm that wants input and weight of one dtype
        ok, why = False, f"cannot run on a {wrapper.noise.dtype} input ({e})"
    if not ok:
        raise ValueError(
            f"aqn: {name} ({type(norm).__name__}) {why}, so its noise cannot be added as Z * x/rms(x) in "
            f"{wrapper.noise.dtype}; use norm_dtype=None (the noise is then rounded into the weight itself)"
        )


class NoiseHandle:
    """Live noise on a :class:`NormNoise`'s weights. ``restore()`` copies the saved originals back (bit-identical).

    Usable as a context manager (``with noise.apply(σ, seed=s, step=k): model.generate(...)``). ``noise`` holds the
    intended float32 noise of the latest draw, ``{weight_name: Tensor[d]}``; ``draws`` counts draws (per-forward mode
    resamples before every forward).
    """

    def __init__(
        self,
        owner: NormNoise,
        sigma: float,
        *,
        seed: int | None,
        step: int,
        generator: torch.Generator | None,
        per_forward: bool,
    ) -> None:
        self.owner = owner
        self.sigma = sigma
        self.seed = seed if (seed is not None or generator is not None) else _global_seed()
        self.step = step
        self.generator = generator
        self.per_forward = per_forward
        self.draws = 0
        self.noise: dict[str, torch.Tensor] = {}
        self._originals: dict[str, torch.Tensor] = {}
        self._wrapped = False  # the norms are swapped for their _NoisyNorm wrappers (norm_dtype)
        self._hook: Any = None
        self._active = False
        #: read by ``qerl_trl.rollout.graph.generate``, which decodes eagerly while a hook so marked is on: per-forward noise
        #: resamples in a Python hook before every forward, which a compiled step cannot replay
        self.compiled_decode_unsafe = per_forward

    # -------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        o = self.owner
        self._originals = {n: p.detach().clone() for n, p in o.params.items()}
        self._active = True
        for p in o.params.values():
            _LIVE[id(p)] = (weakref.ref(p), weakref.ref(self))
        try:
            if o.norm_dtype is not None:
                if o.norm_modules is None:
                    raise ValueError("norm_dtype needs a model (norm modules to wrap), not a parameter map")
                if any(p.dtype != o.norm_dtype for p in o.params.values()):
                    o._swap_wrappers(True)
                    self._wrapped = True
            if self.per_forward:
                target = o.hook_module
                if target is None:
                    raise ValueError("per-forward resampling needs a model, not a parameter map")
                self._hook = target.register_forward_pre_hook(self._forward_pre_hook)
            else:
                self.resample()
        except BaseException:
            self.restore()
            raise

    def _forward_pre_hook(self, _m: nn.Module, _args: Any) -> None:
        # activation-checkpoint recomputation runs inside backward: keep the noise of the original forward
        if torch._C._current_graph_task_id() != -1:
            return
        self.resample()

    def resample(self) -> None:
        """Draw fresh noise and write ``original + Z`` into the weights (per-forward mode calls this every forward)."""
        if not self._active:
            raise RuntimeError("this noise handle was restored; call NormNoise.apply again")
        o = self.owner
        draw = self.draws + (1 if self.per_forward else 0)  # draw 0 = the per-step noise (= noisy_norm_weights)
        named = [(n, self._originals[n]) for n in o.params]
        self.noise = _draw(named, self.sigma, seed=self.seed, step=self.step, draw=draw, generator=self.generator)
        with torch.no_grad():
            for n, p in o.params.items():
                if self._wrapped:
                    o._noise_buffer(n).copy_(self.noise[n])
                else:
                    p.copy_(_add_noise(self._originals[n], self.noise[n], p.dtype))
        self.draws += 1
        if o.warn_lossy and not self.per_forward and self.draws == 1:
            o._maybe_warn_lossy(self)

    def restore(self) -> None:
        """Put the exact original weights (or norms) back (idempotent); removes the per-forward hook."""
        if not self._active:
            return
        o = self.owner
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._wrapped:
            o._swap_wrappers(False)  # the weights themselves were never touched
            self._wrapped = False
        else:
            with torch.no_grad():
                for n, p in o.params.items():
                    p.copy_(self._originals[n])
        self._originals = {}
        self._active = False
        for p in o.params.values():
            entry = _LIVE.get(id(p))
            if entry is not None and entry[1]() is self:
                del _LIVE[id(p)]
        if o._active is self:
            o._active = None

    @property
    def active(self) -> bool:
        """True until :meth:`restore`."""
        return self._active

    def survival(self) -> dict[str, float]:
        """How much of the latest draw survived in the stored weights (see :func:`measure_rounding_survival`)."""
        if not self._active or not self.noise:
            raise RuntimeError("no live noise to measure")
        o = self.owner
        if self._wrapped:  # the noise term is added in norm_dtype: what survives is the draw rounded to it
            return _merge_survival([(self._originals[n], self._originals[n].to(o.norm_dtype) + o._noise_buffer(n),
                                     self.noise[n]) for n in o.params])  # fmt: skip
        return _merge_survival([(self._originals[n], p, self.noise[n]) for n, p in o.params.items()])

    def __enter__(self) -> NoiseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        mode = "per_forward" if self.per_forward else "per_step"
        return f"NoiseHandle(sigma={self.sigma:g}, step={self.step}, mode={mode}, draws={self.draws}, active={self._active})"


class NormNoise:
    """Adds channel-wise Gaussian noise to the norm weights of one model copy, and takes it away again.

    Args:
        target: an ``nn.Module`` (norm → linear groups are discovered with :func:`find_norm_linear_pairs`) or a map
            ``{name: 1-D Parameter/Tensor}`` of norm weights to perturb in place (no discovery, no hooks).
        groups: precomputed groups for ``target`` (skips discovery).
        example_inputs, include_final_norm, method: forwarded to :func:`find_norm_linear_pairs`.
        norm_dtype: e.g. ``torch.float32``: while noise is on, each norm with a narrower weight is swapped for a
            wrapper that adds the noise term ``Z ⊙ x/rms(x)`` in this dtype to the norm's own output and rounds the
            sum once (the weight itself is never written). Needed for σ below the resolution of bf16 weights; see
            the module docstring. Raises ``ValueError`` at the first noise if a norm is not an RMSNorm.
        warn_lossy: warn (once per σ) when less than half of the noise survives rounding to the weight dtype.

    The model is held weakly (:attr:`model`): this object keeps its norms and their weights, not the whole model.
    Only one noise can be live at a time: ``apply`` while a handle is active raises ``RuntimeError``.
    """

    def __init__(
        self,
        target: nn.Module | Mapping[str, torch.Tensor],
        *,
        groups: list[NormLinearGroup] | None = None,
        example_inputs: ExampleInputs = None,
        include_final_norm: bool = False,
        method: str = "auto",
        norm_dtype: torch.dtype | None = None,
        warn_lossy: bool = True,
    ) -> None:
        # weakly held: a cache keyed by the model (AQNController's WeakKeyDictionary) must not keep it alive through
        # its NormNoise; the norms, their weights and their parents are held, the root module is not
        self._model_ref: weakref.ref[nn.Module] | None = None
        self._model_type = "param map"
        self.groups: list[NormLinearGroup] = []
        self.norm_modules: list[nn.Module] | None = None
        self.hook_module: nn.Module | None = None
        if isinstance(target, nn.Module):
            self._model_ref, self._model_type = weakref.ref(target), type(target).__name__
            self.groups = (
                list(groups)
                if groups is not None
                else find_norm_linear_pairs(
                    target,
                    example_inputs,
                    include_final_norm=include_final_norm,
                    method=method,  # type: ignore[arg-type]
                )
            )
            params: dict[str, torch.Tensor] = {}
            seen: set[int] = set()
            for g in self.groups:
                p = g.weight
                if id(p) not in seen:
                    seen.add(id(p))
                    params[g.weight_name] = p
            self.norm_modules = [g.norm for g in self.groups if g.norm is not None]
            # the first norm a forward runs: hooking it (not the root) still fires when a wrapper's generate()
            # bypasses the wrapper's own forward (PEFT)
            self.hook_module = self.norm_modules[0] if self.norm_modules else target
        elif isinstance(target, Mapping):
            params = dict(target)
            if not params:
                raise ValueError("empty parameter map: AQN would be a no-op")
        else:
            raise TypeError(f"NormNoise expects an nn.Module or a name → tensor mapping, got {type(target).__name__}")
        for n, p in params.items():
            if not isinstance(p, torch.Tensor) or p.dim() != 1 or not p.is_floating_point():
                raise ValueError(f"{n}: norm weights must be 1-D floating tensors, got {getattr(p, 'shape', p)}")
        self.params = params
        self.norm_dtype = norm_dtype
        self.warn_lossy = warn_lossy
        self._active: NoiseHandle | None = None
        self._warned: set[float] = set()
        # weight name -> every (parent, attribute, norm) place of a norm reading that weight: a norm module placed
        # twice, or two norms tied to one weight, read w + Z at each place, so each gets a wrapper (norm_dtype)
        self._norm_slots: dict[str, list[tuple[nn.Module, str, nn.Module]]] = {}
        if isinstance(target, nn.Module):
            name_of = {id(p): n for n, p in params.items()}
            norm_weight = {id(g.norm): name_of[id(g.weight)] for g in self.groups
                           if g.norm is not None and id(g.weight) in name_of}  # fmt: skip
            seen_slots: set[tuple[int, str]] = set()
            for _, parent in target.named_modules(remove_duplicate=False):
                for attr, child in parent._modules.items():
                    if child is not None and id(child) in norm_weight and (id(parent), attr) not in seen_slots:
                        seen_slots.add((id(parent), attr))
                        self._norm_slots.setdefault(norm_weight[id(child)], []).append((parent, attr, child))
        # one wrapper per norm for this object's life, and one noise buffer per weight shared by its norms' wrappers:
        # it stays at one address (CUDA graphs)
        self._wrappers: dict[str, dict[int, _NoisyNorm]] = {}  # weight name -> {id(norm): wrapper}

    def _noise_buffer(self, name: str) -> torch.Tensor:
        """The noise buffer the wrappers of weight ``name`` read."""
        return next(iter(self._wrappers[name].values())).noise

    def check_wrappers(self) -> None:
        """Build and check the ``norm_dtype`` wrappers now, without swapping them in: ``ValueError`` for a norm they
        cannot take (see :func:`_check_rmsnorm`), so a caller whose first noise comes later learns of it at once."""
        if self.norm_dtype is not None and any(p.dtype != self.norm_dtype for p in self.params.values()):
            self._build_wrappers()

    def _build_wrappers(self) -> None:
        """Every norm's :class:`_NoisyNorm`, built and checked (kept for this object's life; rebuilt on a new device)."""
        for n, slots in self._norm_slots.items():
            wrappers = self._wrappers.get(n)
            if wrappers is None or self._noise_buffer(n).device != slots[0][2].weight.device:
                wrappers = {}
                for _, _, norm in slots:
                    if id(norm) not in wrappers:
                        wrapper = _NoisyNorm(norm, self.norm_dtype)  # type: ignore[arg-type]
                        _check_rmsnorm(n.removesuffix(".weight"), wrapper)
                        if wrappers:  # a norm tied to the same weight: the same noise, the same buffer
                            wrapper.noise = next(iter(wrappers.values())).noise
                        wrappers[id(norm)] = wrapper
                self._wrappers[n] = wrappers

    def _swap_wrappers(self, on: bool) -> None:
        """Put each norm's :class:`_NoisyNorm` in its places in the model (``on``), or the norm back."""
        if on:  # every wrapper built and checked before the model changes
            self._build_wrappers()
        for n, slots in self._norm_slots.items():
            for parent, attr, norm in slots:
                setattr(parent, attr, self._wrappers[n][id(norm)] if on else norm)

    @property
    def weight_names(self) -> list[str]:
        """Names of the perturbed weights, ``[..."model.layers.0.input_layernorm.weight", ...]``."""
        return list(self.params)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """``{weight_name: Parameter[d]}`` of the perturbed norm weights (live tensors)."""
        return dict(self.params)

    @property
    def model(self) -> nn.Module | None:
        """The model the norms were found in (``None`` for a parameter map, or once the model was freed: it is held
        weakly)."""
        return None if self._model_ref is None else self._model_ref()

    def _refresh_params(self) -> None:
        """Re-read each norm weight from the model: a wrapper that replaces parameters after this object was built
        (FSDP2's ``fully_shard`` swaps each for a sharded ``DTensor`` of the same name) is then noised where it
        lives. Weights not reachable by name (a parameter map, a renamed module) keep the tensor given."""
        model = self.model
        if model is None:
            return
        for name in self.params:
            try:
                self.params[name] = model.get_parameter(name)
            except AttributeError:
                pass

    def _begin(
        self, sigma: float, *, seed: int | None, step: int, generator: torch.Generator | None, per_forward: bool
    ) -> NoiseHandle:
        sigma = _check_sigma(sigma)
        if self._active is not None and self._active.active:
            raise RuntimeError("noise is already applied to these norms; restore() the live handle first")
        self._refresh_params()
        for name, p in self.params.items():
            if _live_handle(p) is not None:
                raise RuntimeError(
                    f"noise is already applied to {name} by another NormNoise; restore() its handle first"
                )
        handle = NoiseHandle(self, sigma, seed=seed, step=step, generator=generator, per_forward=per_forward)
        self._active = handle
        handle._start()
        return handle

    def apply(
        self,
        sigma: float,
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
        step: int = 0,
    ) -> NoiseHandle:
        """Add ``Z ~ N(0, σ²)`` (one fresh ``[d]`` vector per norm) in place; returns the handle that restores.

        Reproducible with ``seed`` (and ``step``), or with an explicit ``generator``; with neither, the seed comes
        from torch's global RNG (reproducible under ``torch.manual_seed``). ``sigma == 0`` is allowed (no change).
        """
        return self._begin(sigma, seed=seed, step=step, generator=generator, per_forward=False)

    def apply_per_forward(
        self,
        sigma: float,
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
        step: int = 0,
    ) -> NoiseHandle:
        """Resample the noise before every forward of the model (each generated token) until ``restore()``.

        The resampling hook sits on the first norm a forward runs. Draw ``i`` of step ``k`` is reproducible from
        ``(seed, k, i)``. Inside activation-checkpoint recomputation the hook does not resample.
        """
        return self._begin(sigma, seed=seed, step=step, generator=generator, per_forward=True)

    def noisy_weights(
        self, sigma: float, generator: torch.Generator | None = None, *, seed: int | None = None, step: int = 0
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:func:`noisy_norm_weights` over this model's norm weights (the model is not modified)."""
        return noisy_norm_weights(self.params, sigma, generator, seed=seed, step=step)

    def _maybe_warn_lossy(self, handle: NoiseHandle) -> None:
        if handle.sigma == 0 or handle.sigma in self._warned:
            return
        if all(p.dtype in (torch.float32, torch.float64) for p in self.params.values()):
            return
        stats = handle.survival()
        if stats["retained"] < 0.5:
            self._warned.add(handle.sigma)
            dtypes = sorted({str(p.dtype) for p in self.params.values()})
            warnings.warn(
                f"aqn: only {stats['retained']:.0%} of the σ={handle.sigma:g} noise survives rounding to "
                f"{'/'.join(dtypes)} norm weights ({stats['fraction_changed']:.1%} of channels changed); "
                "use NormNoise(..., norm_dtype=torch.float32) to keep it",
                stacklevel=4,
            )

    def __repr__(self) -> str:
        return f"NormNoise({self._model_type}, {len(self.params)} norm weights, norm_dtype={self.norm_dtype})"
