"""Row normalisations: LayerNorm (SigLIP), the RMS factor that fuses RMSNorm into the next GEMM, and RMSNorm.

All statistics are fp32; one program normalises one row of up to a few thousand elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch, pdl_enter

__all__ = ["layernorm", "rms_factor", "rmsnorm"]


@triton.jit
def layernorm_kernel(
    x_ptr, out_ptr, weight_ptr, bias_ptr, N, eps, stride_x, stride_o,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    centred = tl.where(ok, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / N
    y = centred * tl.math.rsqrt(var + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rms_kernel(
    x_ptr, out_ptr, factor_ptr, scale_ptr, N, eps, stride_x, stride_o,
    WRITE_NORMED: tl.constexpr, WRITE_FACTOR: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = 0, SCALE_ROWS: tl.constexpr = 0, SCALE_STRIDE: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    factor = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if WRITE_FACTOR:
        tl.store(factor_ptr + row, factor)
    if WRITE_NORMED:
        y = x * factor
        if HAS_SCALE:
            scale_row = scale_ptr
            if SCALE_ROWS > 0:  # a scale row per SCALE_ROWS rows (π0.5's batch elements at their own steps)
                scale_row = scale_ptr + (row // SCALE_ROWS) * SCALE_STRIDE
            y = y * (1.0 + tl.load(scale_row + cols, mask=ok, other=0.0).to(tl.float32))
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(name: str, t: torch.Tensor) -> tuple[int, int]:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D (M, N) with last stride 1, got {tuple(t.shape)} strides {t.stride()}")
    return t.shape


def row_launch_params(n: int) -> dict:
    """BLOCK_N and num_warps of a kernel whose program holds one whole row of `n` values."""
    block_n = triton.next_power_of_2(n)
    return {"BLOCK_N": block_n, "num_warps": max(1, min(8, block_n // 256))}


def _check_vector(name: str, t: torch.Tensor | None, n: int) -> None:
    if t is not None and (t.shape != (n,) or t.stride(0) != 1):
        raise ValueError(f"{name} must be contiguous ({n},), got {tuple(t.shape)}")


def layernorm(
    x: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out = (x - mean) * rsqrt(var + eps) * weight + bias` per row, fp32 statistics.

    x, out: (M, N), last stride 1 (out may alias x); weight, bias: (N,) or None (affine folded into the next GEMM).
    """
    m, n = _rows("x", x)
    if _rows("out", out) != (m, n):
        raise ValueError(f"out must be ({m}, {n}), got {tuple(out.shape)}")
    _check_vector("weight", weight, n)
    _check_vector("bias", bias, n)
    launch(layernorm_kernel, (m,), out)(
        x, out, weight if weight is not None else x, bias if bias is not None else x, n, float(eps),
        x.stride(0), out.stride(0), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **row_launch_params(n),
    )  # fmt: skip
    return out


def rms_factor(x: torch.Tensor, out_factor: torch.Tensor, eps: float) -> torch.Tensor:
    """`out_factor[m] = rsqrt(mean(x[m]**2) + eps)`: fp32 (M,) — the `row_scale` of a GEMM with the norm folded in.

    x: (M, N), last stride 1, any float dtype; out_factor: contiguous float32 (M,).
    """
    m, n = _rows("x", x)
    if out_factor.shape != (m,) or out_factor.dtype != torch.float32 or out_factor.stride(0) != 1:
        raise ValueError(
            f"out_factor must be contiguous float32 ({m},), got {out_factor.dtype} {tuple(out_factor.shape)}"
        )
    launch(rms_kernel, (m,), out_factor)(
        x, x, out_factor, x, n, float(eps), x.stride(0), 0,
        WRITE_NORMED=False, WRITE_FACTOR=True, HAS_SCALE=False, SCALE_ROWS=0, SCALE_STRIDE=0, **row_launch_params(n),
    )  # fmt: skip
    return out_factor


def rmsnorm(x: torch.Tensor, out: torch.Tensor, eps: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """openpi's RMSNorm: `out = x * rsqrt(mean(x**2) + eps) * (1 + scale)` in fp32, cast to `out.dtype`.

    x, out: (M, N), last stride 1 (out may alias x); scale: (N,) stored as an offset from 1, or None (factor 1), or
    (G, N) rows with unit column stride, M = G * R: row r takes scale row r // R (π0.5's batch elements, each at its
    own Euler step).
    """
    m, n = _rows("x", x)
    if _rows("out", out) != (m, n):
        raise ValueError(f"out must be ({m}, {n}), got {tuple(out.shape)}")
    rows = stride = 0
    if scale is not None and scale.dim() == 2:
        if scale.shape[1] != n or scale.stride(1) != 1 or scale.shape[0] < 1 or m % scale.shape[0]:
            raise ValueError(f"scale rows: expected (G, {n}) with unit column stride and G dividing the {m} rows, "
                             f"got {tuple(scale.shape)} strides {scale.stride()}")  # fmt: skip
        rows, stride = m // scale.shape[0], scale.stride(0)
    else:
        _check_vector("scale", scale, n)
    launch(rms_kernel, (m,), out)(
        x, out, x, scale if scale is not None else x, n, float(eps), x.stride(0), out.stride(0),
        WRITE_NORMED=True, WRITE_FACTOR=False, HAS_SCALE=scale is not None, SCALE_ROWS=rows, SCALE_STRIDE=stride,
        **row_launch_params(n),
    )  # fmt: skip
    return out
