"""LayerNorm, RMS factor and RMSNorm kernels vs torch, in Triton's interpreter (fp32 and fp16) on the CPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import gemm, layernorm, rms_factor, rmsnorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def rows(m, n, dtype, seed=0, row_stride=None):
    """Rows with a large offset (catches one-pass variance) as a view with row stride >= n."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(m, row_stride or n, generator=g) * 2 + 3
    return base.to(dtype).to(DEVICE)[:, :n]


@DTYPES
@pytest.mark.parametrize("affine", ["none", "weight", "weight_bias"])
def test_layernorm(dtype, affine):
    x = rows(7, 72, dtype, row_stride=80)
    w = torch.randn(72, device=DEVICE) if affine != "none" else None
    b = torch.randn(72, device=DEVICE) if affine == "weight_bias" else None
    out = torch.full((7, 72), float("nan"), dtype=dtype, device=DEVICE)
    layernorm(x, out, 1e-6, w, b)
    ref = F.layer_norm(
        x.double(), (72,), w.double() if w is not None else None, b.double() if b is not None else None, 1e-6
    )
    assert rel_err(out, ref) < TOL[dtype]


def test_layernorm_in_place():
    x = rows(5, 100, torch.float32)
    ref = F.layer_norm(x.double(), (100,), eps=1e-6)
    layernorm(x, x, 1e-6)
    assert rel_err(x, ref) < 1e-6


@DTYPES
def test_rms_factor(dtype):
    x = rows(9, 100, dtype, row_stride=128)
    f = torch.full((9,), float("nan"), device=DEVICE)
    rms_factor(x, f, 1e-6)
    ref = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
    assert rel_err(f, ref) < 1e-6


@DTYPES
@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no_scale"])
def test_rmsnorm_one_plus_scale(dtype, with_scale):
    x = rows(6, 48, dtype)
    scale = torch.randn(48, device=DEVICE) * 0.1 if with_scale else None
    out = torch.full((6, 48), float("nan"), dtype=dtype, device=DEVICE)
    rmsnorm(x, out, 1e-6, scale)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = ref * (1 + scale.double()) if with_scale else ref
    assert rel_err(out, ref) < TOL[dtype]


def test_rms_factor_fused_into_gemm_equals_rmsnorm_then_gemm():
    """How the engine uses it: scale folded into w, rms_factor as the GEMM's row_scale."""
    x, scale = rows(10, 32, torch.float32), torch.randn(32, device=DEVICE) * 0.1
    w = torch.randn(24, 32, device=DEVICE) * 0.2
    normed = torch.empty_like(x)
    rmsnorm(x, normed, 1e-6, scale)
    f = torch.empty(10, device=DEVICE)
    rms_factor(x, f, 1e-6)
    fused = torch.empty(10, 24, device=DEVICE)
    gemm(x, (w * (1 + scale)).contiguous(), fused, row_scale=f)
    assert rel_err(fused, normed.double() @ w.double().T) < 1e-5


def test_norms_reject_bad_inputs():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError):
        rms_factor(x, torch.empty(4, dtype=torch.float16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError):
        layernorm(x, torch.empty(4, 9, device=DEVICE), 1e-6)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.empty_like(x), 1e-6, scale=torch.zeros(7, device=DEVICE))
