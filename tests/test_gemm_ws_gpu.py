"""The warp-specialized GEMM on an sm_90 GPU (`pytest -m gpu tests/test_gemm_ws_gpu.py`): bf16 against a float32
torch reference on fresh random inputs, at the server's prefix shapes and at tails in M, N and K, for every epilogue
and both tile widths; outputs NaN-poisoned first so an unwritten element fails; a check that a wrong tile would be
caught; few CTAs (many tiles each, the ring's phases wrapping many times); bit-identical CUDA Graph replays.
Timing lives in tools/gemm_ws_probe.py, not here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vla_rt.cuda_kernels.gemm_ws import gemm_ws, why_not
from vla_rt.numerics import rel_err

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or why_not(torch.device("cuda")) is not None:
    pytest.skip("needs an sm_90 GPU and nvcc", allow_module_level=True)
DEV = torch.device("cuda")
TOL = 1e-2

SHAPES = [  # (M, N, K): the prefix's rows (8 x 532, one request's 532), a ragged M, Gemma / SigLIP widths
    (4256, 2560, 2048),  # q/k/v
    (4256, 2048, 16384),  # down
    (532, 2048, 2048),  # o_proj
    (77, 2048, 2048),
    (4096, 1152, 4304),  # SigLIP fc2: K not a multiple of 64
    (512, 4304, 1152),  # SigLIP fc1: N not a multiple of the tile
    (200, 264, 72),  # tails everywhere
]


def _inputs(m: int, n_w: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn(n_w, k, generator=g, device=DEV) * k**-0.5).to(torch.bfloat16)
    return a, w


def _mm32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ w.float().T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_plain_matches_fp32(m, n, k, block_n) -> None:
    a, w = _inputs(m, n, k, seed=m + n + k)
    out = gemm_ws(a, w, _poisoned(m, n), block_n=block_n)
    assert not out.isnan().any()
    assert rel_err(out, _mm32(a, w)) <= TOL


@pytest.mark.parametrize("block_n,stages", [(256, 3), (256, 4), (128, 5), (128, 6)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(4256, 2048, 2048), (532, 1152, 4304), (77, 2048, 16384)])
def test_residual_adds_into_out(m, n, k, bias, block_n, stages) -> None:
    a, w = _inputs(m, n, k, seed=k)
    b = torch.randn(n, device=DEV).to(torch.bfloat16) if bias else None
    out = torch.randn(m, n, device=DEV).to(torch.bfloat16)
    ref = out.float() + _mm32(a, w) + (b.float() if bias else 0)
    gemm_ws(a, w, out, bias=b, residual=True, block_n=block_n, stages=stages)
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("m,n,k", [(4256, 2048, 2048), (512, 4304, 1152), (77, 264, 72)])
def test_bias_matches_fp32(m, n, k) -> None:
    a, w = _inputs(m, n, k, seed=3)
    b = torch.randn(n, device=DEV).to(torch.bfloat16)
    out = gemm_ws(a, w, _poisoned(m, n), bias=b)
    assert rel_err(out, _mm32(a, w) + b.float()) <= TOL


@pytest.mark.parametrize("block_n", [256, 128])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(4256, 16384, 2048), (532, 16384, 2048), (77, 4304, 1152), (200, 264, 72)])
def test_gated_matches_fp32(m, n, k, bias, block_n) -> None:
    """w = [gate rows; up rows] (2N rows: 32768 for Gemma's MLP), out = gelu_tanh(gate + b_g) * (up + b_u)."""
    a, w = _inputs(m, 2 * n, k, seed=n)
    b = torch.randn(2 * n, device=DEV).to(torch.bfloat16) if bias else None
    y = _mm32(a, w) + (b.float() if bias else 0)
    ref = F.gelu(y[:, :n], approximate="tanh") * y[:, n:]
    out = gemm_ws(a, w, _poisoned(m, n), bias=b, gated=True, block_n=block_n)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOL


def test_the_check_catches_one_wrong_tile() -> None:
    a, w = _inputs(532, 2048, 2048, seed=5)
    out, ref = gemm_ws(a, w), _mm32(a, w)
    assert rel_err(out, ref) <= TOL
    out[128:256, 256:512] = 0  # one 128 x 256 tile of 33 lost
    assert rel_err(out, ref) > TOL
    bad = gemm_ws(a, w[torch.randperm(2048, device=DEV)])  # a wrong operand order
    assert rel_err(bad, ref) > TOL


@pytest.mark.parametrize("sm_count", [1, 3, 7])
def test_few_ctas_walk_many_tiles(sm_count) -> None:
    """Each CTA runs many tiles, so the ring's (stage, phase) wraps across tile boundaries many times."""
    a, w = _inputs(600, 1024, 576, seed=sm_count)
    for gated in (False, True):
        n = 512 if gated else 1024
        out = gemm_ws(a, w, _poisoned(600, n), gated=gated, sm_count=sm_count, stages=3, group_m=2)
        y = _mm32(a, w)
        ref = F.gelu(y[:, :n], approximate="tanh") * y[:, n:] if gated else y
        assert rel_err(out, ref) <= TOL


def test_graph_replays_are_bit_identical() -> None:
    a, w = _inputs(4256, 2 * 2048, 2048, seed=11)
    eager_plain, eager_gated = gemm_ws(a, w), gemm_ws(a, w, gated=True)
    plain, gated = torch.empty_like(eager_plain), torch.empty_like(eager_gated)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the graph: the variants load before capture
        gemm_ws(a, w, plain)
        gemm_ws(a, w, gated, gated=True)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        gemm_ws(a, w, plain)
        gemm_ws(a, w, gated, gated=True)
    for _ in range(3):
        plain.fill_(float("nan"))
        gated.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(plain, eager_plain) and torch.equal(gated, eager_gated)
