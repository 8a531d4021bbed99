"""Patchify NHWC images into GEMM rows, so SigLIP's stride-p patch-embedding conv becomes one GEMM.

Row `n * G*G + gy * G + gx` (G = S / p) holds patch (gy, gx) of image n; its columns are ordered (kh, kw, c):
column `(kh * p + kw) * C + c` = `images[n, gy*p + kh, gx*p + kw, c]`. That is the row-major flattening of a
flax/HWIO conv kernel (p, p, C, width), so the GEMM weight (Linear layout, (width, p*p*C)) is
`kernel.reshape(p*p*C, width).T` — for π0 (14, 14, 3, 1152) -> (1152, 588). A PyTorch OIHW conv weight
(width, C, p, p) maps to it by `weight.permute(0, 2, 3, 1).reshape(width, -1)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch, pdl_enter

__all__ = ["patchify"]


@triton.jit
def patchify_kernel(
    img_ptr, out_ptr, grid_size, patch, s_n, s_y, s_x, s_o,
    CHANNELS: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_COLS: tl.constexpr, USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    n = row // (grid_size * grid_size)
    gy = (row // grid_size) % grid_size
    gx = row % grid_size
    kh = tl.arange(0, BLOCK_KH)
    col = tl.arange(0, BLOCK_COLS)  # kw * CHANNELS + c within one image row of the patch
    kw = col // CHANNELS
    c = col % CHANNELS
    mask = (kh < patch)[:, None] & (col < patch * CHANNELS)[None, :]
    src = img_ptr + n * s_n + (gy * patch + kh)[:, None] * s_y + (gx * patch + kw)[None, :] * s_x + c[None, :]
    vals = tl.load(src, mask=mask, other=0.0)
    dst = out_ptr + row * s_o + kh[:, None] * (patch * CHANNELS) + col[None, :]
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=mask)


def patchify(images: torch.Tensor, out: torch.Tensor, patch: int) -> torch.Tensor:
    """images: (N, S, S, C) float, channel stride 1 (any other strides) -> out: (N*(S/p)**2, p*p*C), last stride 1.

    Columns in (kh, kw, c) order (module docstring: how the conv weight maps); `out` may have another float dtype.
    """
    if images.dim() != 4 or images.shape[1] != images.shape[2] or images.stride(3) != 1:
        raise ValueError(f"images must be (N, S, S, C) with channel stride 1, got {tuple(images.shape)}")
    n, s, _, c = images.shape
    if s % patch:
        raise ValueError(f"image size {s} not a multiple of patch {patch}")
    g = s // patch
    cols = patch * patch * c
    if out.shape != (n * g * g, cols) or out.stride(1) != 1:
        raise ValueError(f"out must be ({n * g * g}, {cols}) with last stride 1, got {tuple(out.shape)}")
    launch(patchify_kernel, (n * g * g,), out)(
        images, out, g, patch, images.stride(0), images.stride(1), images.stride(2), out.stride(0),
        CHANNELS=c, BLOCK_KH=triton.next_power_of_2(patch), BLOCK_COLS=triton.next_power_of_2(patch * c), num_warps=2,
    )  # fmt: skip
    return out
