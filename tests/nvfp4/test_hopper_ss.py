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
    from nvfp4.kernels import hopper_ss

    return sorted(set(hopper_ss.SPIKE_CONFIGS.values()))


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
    assert hopper_ss.spike_config(256)["block_m"] == 128  # 256 runs as two 128-token blocks (see SPIKE_CONFIGS)
    assert hopper_ss.spike_config(4096) == hopper_ss.spike_config(256)
