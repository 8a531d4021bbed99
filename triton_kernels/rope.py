"""RoPE on a fused QKV buffer: rotate Q in place (optionally scaled), write rotated K and V into the KV cache.

openpi's "split halves" RoPE: with x1, x2 the first and second half of a head's D,
`rope(x) = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]`, in fp32, cast to the buffer dtype once at the end.

Optionally the row `r` read is first `row_scale[r] * qkv[r] + bias` (fp32): the epilogue of the QKV GEMM before
it, so that GEMM can be a plain one (cuBLAS, where the table measured it faster than our GEMM with the RoPE
epilogue: the server's 408-row expert step, `cublas_choice`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch, pdl_enter

__all__ = ["rope_qk"]


@triton.jit
def rope_qkv_to_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, row_scale_ptr, bias_ptr,
    T, cache_offset, q_scale, bias_group_rows, stride_bias,
    stride_row, stride_cos_b, stride_cos_t, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)  # token row b * T + t of the QKV buffer
    b = row // T
    t = row % T
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    head_dim: tl.constexpr = 2 * HALF
    cos = tl.load(cos_ptr + b * stride_cos_b + t * stride_cos_t + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + b * stride_cos_b + t * stride_cos_t + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    src = qkv_ptr + row * stride_row
    scale = 1.0
    if HAS_ROW_SCALE:
        scale = tl.load(row_scale_ptr + row)
    bias_row = bias_ptr + (row // bias_group_rows) * stride_bias  # the row's bias (one row, or its group's)

    hq = tl.arange(0, BLOCK_Q_HEADS)
    q_mask = (hq < NUM_Q_HEADS)[:, None] & i_ok[None, :]
    q_cols = hq[:, None] * head_dim + i[None, :]
    q1_ptrs = src + q_cols
    q1 = _epilogue(tl.load(q1_ptrs, mask=q_mask, other=0.0), scale, bias_row, q_cols, q_mask, HAS_BIAS)
    q2 = _epilogue(tl.load(q1_ptrs + HALF, mask=q_mask, other=0.0), scale, bias_row, q_cols + HALF, q_mask, HAS_BIAS)
    tl.store(q1_ptrs, ((q1 * cos - q2 * sin) * q_scale).to(qkv_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF, ((q2 * cos + q1 * sin) * q_scale).to(qkv_ptr.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_KV_HEADS)
    kv_mask = (hk < NUM_KV_HEADS)[:, None] & i_ok[None, :]
    k_cols = (NUM_Q_HEADS + hk[:, None]) * head_dim + i[None, :]
    k1_ptrs = src + k_cols
    k1 = _epilogue(tl.load(k1_ptrs, mask=kv_mask, other=0.0), scale, bias_row, k_cols, kv_mask, HAS_BIAS)
    k2 = _epilogue(tl.load(k1_ptrs + HALF, mask=kv_mask, other=0.0), scale, bias_row, k_cols + HALF, kv_mask, HAS_BIAS)
    kc_ptrs = k_cache_ptr + b * skc_b + (cache_offset + t) * skc_t + hk[:, None] * skc_h + i[None, :]
    tl.store(kc_ptrs, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_ptrs + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)

    v_cols = (NUM_Q_HEADS + NUM_KV_HEADS + hk[:, None]) * head_dim + i[None, :]
    vc_ptrs = v_cache_ptr + b * svc_b + (cache_offset + t) * svc_t + hk[:, None] * svc_h + i[None, :]
    for half in tl.static_range(2):
        v = tl.load(src + v_cols + half * HALF, mask=kv_mask, other=0.0)
        if HAS_ROW_SCALE or HAS_BIAS:  # else V is copied as it is, bit for bit
            v = _epilogue(v, scale, bias_row, v_cols + half * HALF, kv_mask, HAS_BIAS)
        tl.store(vc_ptrs + half * HALF, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _epilogue(x, scale, bias_row, cols, mask, HAS_BIAS: tl.constexpr):
    """The QKV GEMM's epilogue on loaded values, in fp32: `scale * x (+ bias)` (scale 1.0 without a row scale)."""
    y = x.to(tl.float32) * scale
    if HAS_BIAS:
        y += tl.load(bias_row + cols, mask=mask, other=0.0).to(tl.float32)
    return y


def check_rope_inputs(
    rows: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    cache_offset: int,
) -> tuple[int, int, int]:
    """Checks what a RoPE call over `rows` (Q, K, V) rows reads and writes besides them (`rope_qk`, or a GEMM's RoPE
    epilogue): an even head_dim, the caches, the cache rows, the tables. Returns (tokens a batch row, the tables'
    batch and token strides)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    bsz, t_cache = k_cache.shape[0], k_cache.shape[1]
    if rows % bsz:
        raise ValueError(f"qkv rows {rows} not a multiple of the cache batch {bsz}")
    t = rows // bsz
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.shape != (bsz, t_cache, num_kv_heads, head_dim) or c.stride(3) != 1:
            raise ValueError(f"{name} must be ({bsz}, {t_cache}, {num_kv_heads}, {head_dim}), got {tuple(c.shape)}")
    if not 0 <= cache_offset <= t_cache - t:
        raise ValueError(f"cache rows {cache_offset}..{cache_offset + t - 1} outside a cache of {t_cache}")
    half = head_dim // 2
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.shape not in ((t, half), (bsz, t, half)) or tab.stride(-1) != 1 or tab.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 ({t}, {half}) or ({bsz}, {t}, {half}), got {tuple(tab.shape)}")
    if cos.stride() != sin.stride() or cos.shape != sin.shape:
        raise ValueError("cos and sin must share shape and strides")
    cos_b, cos_t = (0, cos.stride(0)) if cos.dim() == 2 else (cos.stride(0), cos.stride(1))
    return t, cos_b, cos_t


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_offset: int = 0,
    q_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Rotate the Q heads of `qkv` in place (times `q_scale`) and write rotated K and plain V to the cache.

    qkv: (B*T, (Hq + 2*Hkv) * D), last stride 1, row b*T + t = token t of batch b, heads laid out [Q..., K..., V...].
    cos, sin: fp32 (T, D/2) shared by the batch, or (B, T, D/2) per batch row; last stride 1.
    k_cache, v_cache: (B, T_cache, Hkv, D), last stride 1; rows cache_offset .. cache_offset+T-1 are written.
    row_scale (contiguous fp32 (B*T,)) and bias ((width,), or (G, width) with one row a group of B*T / G rows, unit
    column stride): each row is first `row_scale * row + bias`, in fp32 (a QKV GEMM's epilogue, applied here).
    The K and V columns of `qkv` are left as they were. num_q_heads may be 0 (a K/V-only buffer).
    """
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be (B*T, {width}) with last stride 1, got {tuple(qkv.shape)} {qkv.stride()}")
    rows = qkv.shape[0]
    t, cos_b, cos_t = check_rope_inputs(rows, cos, sin, k_cache, v_cache, num_kv_heads, head_dim, cache_offset)
    if row_scale is not None and (
        row_scale.shape != (rows,) or row_scale.dtype != torch.float32 or row_scale.stride(0) != 1
    ):
        raise ValueError(
            f"row_scale must be contiguous float32 ({rows},), got {row_scale.dtype} {tuple(row_scale.shape)}"
        )
    group_rows, bias_stride = _bias_layout(bias, rows, width)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    launch(rope_qkv_to_cache_kernel, (rows,), qkv)(
        qkv, cos, sin, k_cache, v_cache, qkv if row_scale is None else row_scale, qkv if bias is None else bias,
        t, cache_offset, float(q_scale), group_rows, bias_stride,
        qkv.stride(0), cos_b, cos_t, *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_Q_HEADS=triton.next_power_of_2(max(1, num_q_heads)), BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, HAS_ROW_SCALE=row_scale is not None, HAS_BIAS=bias is not None,
        num_warps=4 if num_q_heads * block_half >= 512 else 1,
    )  # fmt: skip


def _bias_layout(bias: torch.Tensor | None, rows: int, width: int) -> tuple[int, int]:
    """(rows that share a bias row, the bias's row stride) for `rope_qk`'s bias, checked against `rows` x `width`."""
    if bias is None:
        return rows, 0
    if bias.dim() == 1 and bias.shape == (width,) and bias.stride(0) == 1:
        return rows, 0
    if bias.dim() == 2 and bias.shape[1] == width and bias.stride(1) == 1 and rows % bias.shape[0] == 0:
        return rows // bias.shape[0], bias.stride(0)
    raise ValueError(
        f"bias must be ({width},) or (G, {width}) with {rows} rows a multiple of G and unit column stride, "
        f"got {tuple(bias.shape)} with strides {bias.stride()}"
    )
