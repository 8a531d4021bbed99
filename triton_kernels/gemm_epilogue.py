"""The epilogue of the GEMM kernels (`gemm_pointer.py`'s pointer-load kernel and its split-K combine, `gemm_tma.py`'s
TMA kernel): row scale, bias, activation or GeGLU gate, alpha, output-column scale, residual, and the RoPE store
into the KV cache (bias before the rotation). One copy, so every kernel rounds exactly alike. The output-column
scale is π0.5's adaptive-norm gate (`x + y * gate`); its constexpr `HAS_OUT_SCALE` is off for π0, whose kernels
compile exactly as before."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["apply_activation", "epilogue_store", "gelu_tanh", "row_scales", "rope_tables"]


@triton.jit
def gelu_tanh(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the tanh-approximate GELU without a tanh intrinsic.
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:
        x = gelu_tanh(x)
    elif ACTIVATION == 2:
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def row_scales(row_scale_ptr, offs_m, M, HAS_ROW_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    """The fp32 per-row scale of the epilogue (the RMSNorm factor of the rows): loaded, or unused zeros."""
    if HAS_ROW_SCALE:
        return tl.load(row_scale_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)
    return tl.zeros((BLOCK_M,), dtype=tl.float32)


@triton.jit
def _pair_index(offs_n, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """(head, i) of pair columns offs_n (one tile's); when BLOCK_N divides HALF a tile lies in one head's half, so
    i is BLOCK_N contiguous values from a multiple of BLOCK_N (vector loads of the tables, vector stores)."""
    head = offs_n // HALF
    i = offs_n % HALF
    if HALF % BLOCK_N == 0:
        i = tl.max_contiguous(tl.multiple_of(i, BLOCK_N), BLOCK_N)
    return head, i


@triton.jit
def rope_tables(
    cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t, HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_M, BLOCK_N) fp32 cos and sin of a tile: token t = row % rope_t of batch b = row // rope_t, at
    frequency i of its pair column."""
    _, i = _pair_index(offs_n, HALF, BLOCK_N)
    b = offs_m // rope_t
    t = offs_m % rope_t
    tab = b[:, None] * stride_cos_b + t[:, None] * stride_cos_t + i[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    cos = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_store(
    x1,
    x2,
    cos,
    sin,
    offs_m,
    offs_n,
    mask,
    out_ptr,
    stride_om,
    k_cache_ptr,
    v_cache_ptr,
    rope_t,
    cache_offset,
    q_scale,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`rope_qk` on a tile of pair columns: x1 = columns h*D + i, x2 = columns h*D + D/2 + i (fp32). Q heads are
    rotated (times q_scale) into `out`, K heads rotated into the K cache, V heads copied into the V cache, at cache
    row cache_offset + t of batch b for output row b * rope_t + t. Same fp32 formulas and one cast as `rope_qk`."""
    head, i = _pair_index(offs_n, HALF, BLOCK_N)
    b = offs_m // rope_t
    t = offs_m % rope_t
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin

    is_q = head < Q_HEADS
    is_k = (head >= Q_HEADS) & (head < Q_HEADS + KV_HEADS)
    is_v = head >= Q_HEADS + KV_HEADS
    q_ptrs = out_ptr + offs_m[:, None] * stride_om + (head * (2 * HALF) + i)[None, :]
    q_mask = mask & is_q[None, :]
    tl.store(q_ptrs, (r1 * q_scale).to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptrs + HALF, (r2 * q_scale).to(out_ptr.dtype.element_ty), mask=q_mask)

    kv_head = tl.where(is_k, head - Q_HEADS, head - Q_HEADS - KV_HEADS)
    kv_head = tl.maximum(kv_head, 0)  # Q columns: a valid (never stored) address
    cache_row = b * stride_kv_b + (cache_offset + t) * stride_kv_t
    kv_offs = cache_row[:, None] + (kv_head * stride_kv_h + i)[None, :]
    k_mask = mask & is_k[None, :]
    tl.store(k_cache_ptr + kv_offs, r1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_cache_ptr + kv_offs + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    v_mask = mask & is_v[None, :]
    tl.store(v_cache_ptr + kv_offs, x1.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_cache_ptr + kv_offs + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def epilogue_store(
    acc,
    acc_up,
    rs,
    rope_cos,
    rope_sin,
    offs_m,
    offs_n,
    out_ptr,
    bias_ptr,
    res_ptr,
    M,
    N,
    alpha,
    res_period,
    stride_om,
    stride_rm,
    k_cache_ptr,
    v_cache_ptr,
    rope_t,
    cache_offset,
    q_scale,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    ROPE_Q_HEADS: tl.constexpr,
    ROPE_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    out_scale_ptr,
    HAS_OUT_SCALE: tl.constexpr,
    MOD_ROWS: tl.constexpr,
    MOD_STRIDE: tl.constexpr,
):
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_ROW_SCALE:
        acc = acc * rs[:, None]
        if GATED or ROPE_HALF > 0:
            acc_up = acc_up * rs[:, None]
    if ROPE_HALF > 0:
        if HAS_BIAS:  # pair column (head, i): bias of weight rows head*D + i and head*D + HALF + i
            head, i = _pair_index(offs_n, ROPE_HALF, BLOCK_N)
            col = head * (2 * ROPE_HALF) + i
            if MOD_ROWS > 0:  # a bias row per group of MOD_ROWS output rows (π0.5's rows at their own steps)
                group = ((offs_m // MOD_ROWS) * MOD_STRIDE)[:, None]
                acc = acc + tl.load(bias_ptr + group + col[None, :], mask=mask, other=0.0).to(tl.float32)
                acc_up = acc_up + tl.load(bias_ptr + group + (col + ROPE_HALF)[None, :], mask=mask,
                                          other=0.0).to(tl.float32)  # fmt: skip
            else:
                acc = acc + tl.load(bias_ptr + col, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                acc_up = acc_up + tl.load(bias_ptr + col + ROPE_HALF, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        _rope_store(
            acc, acc_up, rope_cos, rope_sin, offs_m, offs_n, mask, out_ptr, stride_om, k_cache_ptr, v_cache_ptr,
            rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t, stride_kv_h, ROPE_HALF, ROPE_Q_HEADS,
            ROPE_KV_HEADS, BLOCK_N,
        )  # fmt: skip
    else:
        if HAS_BIAS:
            if MOD_ROWS > 0:
                group = ((offs_m // MOD_ROWS) * MOD_STRIDE)[:, None]
                acc = acc + tl.load(bias_ptr + group + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
                if GATED:
                    acc_up = acc_up + tl.load(bias_ptr + group + (N + offs_n)[None, :], mask=mask,
                                              other=0.0).to(tl.float32)  # fmt: skip
            else:
                acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    acc_up = acc_up + tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = apply_activation(acc, ACTIVATION)
        if GATED:
            acc = acc * acc_up
        acc = acc * alpha
        if HAS_OUT_SCALE:
            if MOD_ROWS > 0:
                group = ((offs_m // MOD_ROWS) * MOD_STRIDE)[:, None]
                acc = acc * tl.load(out_scale_ptr + group + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                acc = acc * tl.load(out_scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            res_rows = offs_m
            if RESIDUAL_PERIODIC:
                res_rows = offs_m % res_period
            res = tl.load(res_ptr + res_rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
            acc = acc + res.to(tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
