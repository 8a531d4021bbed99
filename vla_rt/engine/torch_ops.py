"""PyTorch versions of the engine's kernels, with exactly the Triton kernels' contracts.

The `folded` backend runs on these (so graph passes can be tested on the CPU without any kernel), the CUDA Graph
baseline captures them, and kernel tests can compare against them. Every op accumulates in float32 and stores in
the output dtype, like the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Block id for a key nobody may see (padding, a missing camera view): larger than any query's block.
INVALID_BLOCK = 2**30


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    activation: str | None = None,
    gated: bool = False,
    alpha: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_period: int | None = None,
    out_dtype: torch.dtype | None = None,
    product: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = out_scale ⊙ alpha * act(row_scale ⊙ (a @ wᵀ) + bias) + residual, computed in float32.

    a: (M, K); w: (N, K), or (2N, K) = [gate; up] when `gated` (then act is gelu_tanh(gate) * up);
    row_scale: (M,) float32 (a fused RMSNorm factor); residual: (M, N), or (period, N) repeated every
    `residual_period` rows; out_scale (N,) float32 multiplies the result's columns before the residual (π0.5's
    gate: `x + y * gate`). bias and out_scale may hold G rows instead, (G, ·) with M = G * R: output row r takes
    row r // R (π0.5's batch elements, each at its own Euler step).
    """
    acc = a.float() @ w.float().T if product is None else product.float()  # `product`: a @ wᵀ computed elsewhere
    if row_scale is not None:
        acc = acc * row_scale.float()[:, None]
    if bias is not None:
        acc = acc + per_row(bias, acc.shape[0])
    if gated:
        gate, up = acc.chunk(2, dim=-1)
        acc = F.gelu(gate, approximate="tanh") * up
    elif activation == "gelu_tanh":
        acc = F.gelu(acc, approximate="tanh")
    elif activation == "silu":
        acc = F.silu(acc)
    elif activation is not None:
        raise ValueError(f"activation: expected None, 'gelu_tanh' or 'silu', found {activation!r}")
    if alpha != 1.0:
        acc = acc * alpha
    if out_scale is not None:
        acc = acc * per_row(out_scale, acc.shape[0])
    if residual is not None:
        r = residual.float()
        if residual_period is not None:
            r = r.repeat(acc.shape[0] // residual_period, 1)
        acc = acc + r
    return acc.to(out_dtype or a.dtype)


def per_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A float32 (N,) vector as is, or (G, N) rows repeated to `rows` rows (row r: t[r // (rows / G)])."""
    if t.dim() == 1:
        return t.float()
    if rows % t.shape[0]:
        raise ValueError(f"rows: expected a multiple of the {t.shape[0]} modulation rows, found {rows}")
    return t.float().repeat_interleave(rows // t.shape[0], dim=0)


def layernorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine (folded into the next GEMM), float32 statistics."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rmsnorm(x: torch.Tensor, eps: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """openpi's RMSNorm, `x * rsqrt(mean(x²) + eps) * (1 + scale)` in float32, cast to x's dtype (the Triton
    `rmsnorm` kernel's contract); scale (N,) is an offset from 1 (π0.5: a step's row of a scale table), or (G, N)
    rows for x (G * R, N): row r takes scale row r // R."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if scale is None else y * (1.0 + per_row(scale, x.shape[0]))).to(x.dtype)


def rms_factor(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x²) + eps) per row, float32 (M,)."""
    xf = x.float()
    return torch.rsqrt(xf.square().mean(-1) + eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Split-halves RoPE; x: (B, T, heads, D); cos/sin: (max_pos, D/2) tables; positions: (B, T) int."""
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_block: torch.Tensor | None = None,
    k_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with block masking: query i sees key j iff k_block[j] <= q_block[i].

    q: (B, T, Hq, D); k, v: (B, S, Hkv, D); blocks int (B, T) / (B, S). Probabilities are cast to v's dtype
    before P·V (openpi). A query that sees no key outputs zeros. Returns (B, T, Hq * D).
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, t, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # B K G T D
    kk = k.float().permute(0, 2, 1, 3)[:, :, None]  # B K 1 S D
    vv = v.permute(0, 2, 1, 3)[:, :, None]
    logits = (qg @ kk.transpose(-1, -2)) * scale
    if q_block is not None:
        mask = (k_block[:, None, :] <= q_block[:, :, None])[:, None, None]  # B 1 1 T S
        logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    else:
        probs = torch.softmax(logits, dim=-1)
    out = probs.to(v.dtype).float() @ vv.float()
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hq * d).to(v.dtype)


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, S, S, 3) NHWC -> (N * (S/p)², p*p*3) rows in (kh, kw, c) order, row-major over the patch grid."""
    n, s, _, c = images.shape
    g = s // patch
    x = images.reshape(n, g, patch, g, patch, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n * g * g, patch * patch * c)
