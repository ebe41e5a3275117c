"""Kernel v4 spike (:mod:`nvfp4.kernels.hopper_ss`): SS ``wgmma`` fed by transform warpgroups.

* CPU (CI): every spike config compiles for sm_90a without a GPU; the SASS has ``HGMMA`` with *both* operands from
  shared memory (``gdesc``, no register A), one ``wgmma`` group left in flight (``DEPBAR.LE gsb0, 0x1``), the decoded
  tile stored by ``STSM``, TMA loads and mbarriers, no local-memory spills; ptxas reports no C7515 serialisation.
* GPU (``-m gpu``, the H100): the spike configs against the float64 reference on fresh random inputs (odd M, bias,
  NaN-poisoned outputs), the 7B gate and down shapes included, and bit-equal repeated calls.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from nvfp4.codec import dequantize, quantize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _configs() -> list[tuple]:
    """The spike's configs (``SPIKE_CONFIGS`` and ``SPIKE_ALT_CONFIGS``: ``gemm.py --spike``'s two v4 arms)."""
    from nvfp4.kernels import hopper_ss

    return sorted(set(hopper_ss.SPIKE_CONFIGS.values()) | set(hopper_ss.SPIKE_ALT_CONFIGS.values()))


@pytest.mark.parametrize("config", _configs())
def test_spike_compiles_for_sm90a_with_shared_memory_operands(config):
    import triton
    from nvfp4.kernels import hopper_ss

    block_m, tiles, stages, astages, sub, xf, fixup = config
    compiled = hopper_ss.compile_sm90(block_m, tiles, stages, astages, sub, xf, fixup)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = Path(d) / "k.cubin", Path(d) / "k.ptx"
        cubin.write_bytes(compiled.asm["cubin"])
        ptx.write_text(compiled.asm["ptx"])
        sass = subprocess.run([bin_dir / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
        ptxas = subprocess.run([bin_dir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", Path(d) / "again.cubin"],
                               capture_output=True, text=True, check=True)  # fmt: skip
    log = ptxas.stdout + ptxas.stderr
    assert "C7515" not in log, log  # no wgmma serialisation
    assert "0 bytes spill stores" in log, log
    assert "LDL" not in sass and "STL" not in sass
    assert re.search(rf"HGMMA\.64x{block_m}x16\.F32\.BF16 R\d+, gdesc\[UR\d+\], R\d+", sass), "SS wgmma"
    assert not re.search(r"HGMMA\.\S+ R\d+, R\d+,", sass), "no wgmma takes A from registers"
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass  # one wgmma group stays in flight across stages
    assert "STSM" in sass and "FENCE.VIEW.ASYNC.S" in sass  # decoded tiles stored, then fenced for the async proxy
    assert "UTMALDG" in sass and "SYNCS" in sass


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output (an element never written)"
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", _configs())
def test_spike_random_shapes_against_the_reference_gpu(config):
    from nvfp4.kernels import hopper_ss
    from nvfp4.layout import to_mma_layout

    block_m, tiles, stages, astages, sub, xf, fixup = config
    kw = dict(block_m=block_m, tiles=tiles, stages=stages, astages=astages, sub=sub, xf=xf, fixup=fixup)
    gen = torch.Generator().manual_seed(block_m + stages)
    shapes = [(18944, 3584), (3584, 18944)]  # the 7B gate and down
    shapes += [(64 * tiles * int(torch.randint(1, 40, (1,), generator=gen)),
                256 * int(torch.randint(1, 30, (1,), generator=gen))) for _ in range(3)]  # fmt: skip
    hopper_ss.POISON = True
    try:
        for n, k in shapes:
            for m in (1, block_m - 1, block_m + 3, 2 * block_m + 1, 257):
                q = quantize(torch.randn(n, k, device="cuda"))
                packed = to_mma_layout(q.packed)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                ref = x.double() @ dequantize(q.packed, q.scale, q.global_scale, torch.float64).T + b.double()
                y = hopper_ss.ss_linear(x, packed, q.scale, q.global_scale, b, **kw)
                assert y.dtype == torch.bfloat16 and y.shape == (m, n)
                assert _rel(y, ref) < 1e-2, (m, n, k, config)
                again = hopper_ss.ss_linear(x, packed, q.scale, q.global_scale, b, **kw)
                assert torch.equal(y, again), "not deterministic"
        flags = hopper_ss._FLAGS[torch.device("cuda", torch.cuda.current_device())]
        assert int(flags.abs().sum()) == 0  # every launch leaves its flags at zero
    finally:
        hopper_ss.POISON = False


def test_spike_config_covers_the_spike_ms():
    from nvfp4.kernels import hopper_ss

    assert hopper_ss.spike_config(64)["block_m"] == 64
    assert hopper_ss.spike_config(100)["block_m"] == 128
    assert hopper_ss.spike_config(256)["block_m"] == 256 and hopper_ss.spike_config(256)["xf"] == 0
    assert hopper_ss.spike_config(256, alt=True)["block_m"] == 128  # two 128-token blocks
    assert hopper_ss.spike_config(4096) == hopper_ss.spike_config(256)


class _Barrier:
    """An mbarrier as the hardware sees it: ``count`` arrivals complete a phase; a wait names a phase parity only."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def passes(self, n: int) -> bool:
        """Whether a wait for phase ``n`` (parity ``n & 1``) returns now; a waiter two phases behind would hang on
        hardware (same parity), which the protocol must never allow."""
        assert self.phases <= n + 1, f"barrier ran {self.phases - n} phases past a waiter"
        return self.phases % 2 != n % 2


def _segments(u0: int, u1: int, ku: int):
    u = u0
    while u < u1:
        kb = u % ku
        ke = min(ku, kb + (u1 - u))
        yield kb, ke
        u += ke - kb


def _simulate(stages: int, astages: int, xf: int, sub: int, u0: int, u1: int, ku: int, seed: int) -> int:
    """One program of :func:`nvfp4.kernels.hopper_ss._ss_linear_kernel`'s mainloop, its index and barrier arithmetic
    replayed in Python under a random interleaving of the partitions and of the TMA completions: every wgmma sees
    the x and A tiles of its own stage from issue to retirement, no barrier runs a phase past a waiter, and the run
    ends (no deadlock). Returns the number of wgmma groups issued."""
    import random

    rng = random.Random(seed)
    empty = [_Barrier(4 if xf == 2 else 3) for _ in range(stages)]
    ready = [_Barrier(1) for _ in range(stages)]
    a_empty = [_Barrier(1) for _ in range(2 * astages)]
    a_ready = [_Barrier(1) for _ in range(2 * astages)]
    x, w, a = [None] * stages, [None] * stages, [None] * (2 * astages)
    tma: list = []  # copies in flight: (stage, i)
    issued = [0]

    def wait(bar, n):
        while not bar.passes(n):
            yield

    def producer():
        i = 0
        for kb, ke in _segments(u0, u1, ku):
            for _ in range(kb * sub, ke * sub):
                st = i % stages
                yield from wait(empty[st], i // stages - 1)  # parity ((i // S) & 1) ^ 1
                tma.append((st, i))
                i += 1

    def transform(h0, nh):
        i = 0
        for kb, ke in _segments(u0, u1, ku):
            for _ in range(kb * sub, ke * sub):
                st, sa = i % stages, i % astages
                for h in range(h0, h0 + nh):
                    yield from wait(a_empty[h * astages + sa], i // astages - 1)
                    yield from wait(ready[st], i // stages)
                    assert w[st] == i, ("transform read a weight tile of another stage", w[st], i)
                    yield
                    a[h * astages + sa] = (i, h)
                for h in range(h0, h0 + nh):
                    a_ready[h * astages + sa].arrive()
                empty[st].arrive()
                i += 1

    def transform_producer():  # xf = 0: loads run stages - 2 ahead of the decode, from the stage index alone
        lead, n_st = stages - 2, (u1 - u0) * sub

        def load(j):
            yield from wait(empty[j % stages], j // stages - 1)
            tma.append((j % stages, j))

        for j in range(min(lead, n_st)):
            yield from load(j)
        for i in range(n_st):
            if i + lead < n_st:
                yield from load(i + lead)
            st, sa = i % stages, i % astages
            for h in range(2):
                yield from wait(a_empty[h * astages + sa], i // astages - 1)
                yield from wait(ready[st], i // stages)
                assert w[st] == i, ("transform read a weight tile of another stage", w[st], i)
                yield
                a[h * astages + sa] = (i, h)
            for h in range(2):
                a_ready[h * astages + sa].arrive()
            empty[st].arrive()

    def mma(wg):
        i = 0
        inflight: list = []

        def retire(keep):
            while len(inflight) > keep:
                j, st, sa = inflight.pop(0)
                assert x[st] == j and a[wg * astages + sa] == (j, wg), "a tile was overwritten under a wgmma"

        for kb, ke in _segments(u0, u1, ku):
            i_first = i
            for _ in range(kb * sub, ke * sub):
                st, sa = i % stages, i % astages
                yield from wait(a_ready[wg * astages + sa], i // astages)
                yield from wait(ready[st], i // stages)
                assert x[st] == i and a[wg * astages + sa] == (i, wg), "wgmma issued on tiles of another stage"
                inflight.append((i, st, sa))
                issued[0] += 1
                yield
                retire(1)
                if i > i_first:
                    a_empty[wg * astages + (i - 1) % astages].arrive()
                    empty[(i - 1) % stages].arrive()
                i += 1
            yield
            retire(0)
            a_empty[wg * astages + (i - 1) % astages].arrive()
            empty[(i - 1) % stages].arrive()

    if xf == 0:
        roles = [mma(0), mma(1), transform_producer()]
    else:
        roles = [producer(), mma(0), mma(1)] + ([transform(0, 1), transform(1, 1)] if xf == 2 else [transform(0, 2)])
    live = list(roles)
    steps = 0
    while live or tma:
        steps += 1
        assert steps < 10**6, "no progress: deadlock"
        if tma and (not live or rng.random() < 0.3):
            st, i = tma.pop(rng.randrange(len(tma)) if rng.random() < 0.1 else 0)
            x[st] = w[st] = i  # the copy lands, then completes the stage's barrier
            ready[st].arrive()
            continue
        role = rng.choice(live)
        try:
            next(role)
        except StopIteration:
            live.remove(role)
    return issued[0]


@pytest.mark.parametrize("stages,astages,xf,sub", [(6, 3, 2, 1), (8, 3, 2, 1), (3, 2, 1, 1), (2, 2, 2, 2), (4, 4, 1, 1), (4, 2, 0, 1), (3, 2, 0, 2)])
@pytest.mark.parametrize("u0,u1,ku", [(0, 56, 56), (13, 130, 56), (5, 7, 296), (290, 600, 296)])
def test_spike_pipeline_protocol_replayed_on_the_cpu(stages, astages, xf, sub, u0, u1, ku):
    """The barrier protocol of the spike (load ring released by 2 + xf arrivals, A ring per half), replayed under
    random interleavings: what the GPU test would show as a hang or a wrong tile, caught without a GPU."""
    for seed in range(3):
        assert _simulate(stages, astages, xf, sub, u0, u1, ku, seed) == 2 * (u1 - u0) * sub


def test_spike_pipeline_needs_two_a_tiles_per_half():
    """With one A tile per half the protocol deadlocks: an MMA warpgroup releases stage i's tile only after issuing
    stage i + 1 (one group stays in flight), whose tile the transform cannot write before that release. The launcher
    refuses ``astages < 2``."""
    from nvfp4.kernels import hopper_ss

    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(4, 1, 2, 1, 0, 20, 56, 0)
    with pytest.raises(ValueError, match="astages"):
        hopper_ss.launch(torch.zeros(1, 256, dtype=torch.bfloat16), None, torch.zeros(128, 16), None, None, None,
                         None, astages=1)  # fmt: skip
