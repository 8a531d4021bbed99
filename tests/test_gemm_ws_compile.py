"""Every variant of the warp-specialized GEMM (`cuda_kernels/gemm_ws.cu`) that the launcher accepts and the probe
times compiles for sm_90a on a CPU machine (nvcc from the toolkit or the `nvidia-cuda-nvcc` wheel) without spills or
wgmma serialisation: 384 threads a CTA, so ptxas reports 168 registers at entry; setmaxnreg then gives each
consumer thread 232 (128 or 64 fp32 accumulators plus the epilogue) and the producer 40."""

from __future__ import annotations

import sys

import pytest

from vla_rt.cuda_kernels import build
from vla_rt.cuda_kernels.gemm_ws import SOURCE, Variant

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the nvcc wheels are Linux-only")

EPILOGUES = {  # name: (bias, residual, gated)
    "plain": (False, False, False),
    "bias": (True, False, False),
    "residual": (False, True, False),
    "bias + residual": (True, True, False),
    "gated": (False, False, True),
    "gated + bias": (True, False, True),
}
TILINGS = [(bn, s) for bn in (128, 256) for s in (3, 4, 5, 6) if Variant(bn, s).why_unsupported() is None]
VARIANTS = [Variant(bn, s, *EPILOGUES[e]) for bn, s in TILINGS for e in EPILOGUES]


def test_the_tilings_are_the_ones_that_fit_shared_memory() -> None:
    assert TILINGS == [(128, 3), (128, 4), (128, 5), (128, 6), (256, 3), (256, 4)]


@pytest.mark.parametrize(
    "v", VARIANTS, ids=lambda v: f"n{v.block_n}-s{v.stages}-b{v.bias:d}r{v.residual:d}g{v.gated:d}"
)
def test_variant_compiles_without_spills(v: Variant) -> None:
    nvcc = build.find_nvcc()
    assert nvcc, "no nvcc: `pip install -e .[test]` installs the nvidia-cuda-nvcc wheel"
    _, log = build.compile_cubin(SOURCE, v.defines(), nvcc=nvcc, quiet=True, use_cache=False)
    r = build.Resources.parse(log)
    print(f"{v}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads} bytes, stack {r.stack_bytes}")
    assert r.registers == 168, log
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, log
    assert not r.wgmma_serialized, log


def test_a_ring_too_big_for_shared_memory_fails_to_compile() -> None:
    """The kernel's own static_assert agrees with Variant.why_unsupported."""
    nvcc = build.find_nvcc()
    assert nvcc
    with pytest.raises(build.BuildError, match="227 KB"):
        build.compile_cubin(SOURCE, Variant(256, 5).defines(), nvcc=nvcc, quiet=True, use_cache=False)
