"""RoPE on a fused QKV buffer: rotate Q in place (optionally scaled), write rotated K and V into the KV cache.

openpi's "split halves" RoPE: with x1, x2 the first and second half of a head's D,
`rope(x) = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]`, in fp32, cast to the buffer dtype once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch, pdl_enter

__all__ = ["rope_qk"]


@triton.jit
def rope_qkv_to_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    T, cache_offset, q_scale,
    stride_row, stride_cos_b, stride_cos_t, skc_b, skc_t, skc_h, svc_b, svc_t, svc_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = 0,
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

    hq = tl.arange(0, BLOCK_Q_HEADS)
    q_mask = (hq < NUM_Q_HEADS)[:, None] & i_ok[None, :]
    q1_ptrs = src + hq[:, None] * head_dim + i[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, ((q1 * cos - q2 * sin) * q_scale).to(qkv_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF, ((q2 * cos + q1 * sin) * q_scale).to(qkv_ptr.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_KV_HEADS)
    kv_mask = (hk < NUM_KV_HEADS)[:, None] & i_ok[None, :]
    k1_ptrs = src + (NUM_Q_HEADS + hk[:, None]) * head_dim + i[None, :]
    k1 = tl.load(k1_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    kc_ptrs = k_cache_ptr + b * skc_b + (cache_offset + t) * skc_t + hk[:, None] * skc_h + i[None, :]
    tl.store(kc_ptrs, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_ptrs + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)

    v_ptrs = src + (NUM_Q_HEADS + NUM_KV_HEADS + hk[:, None]) * head_dim + i[None, :]
    vc_ptrs = v_cache_ptr + b * svc_b + (cache_offset + t) * svc_t + hk[:, None] * svc_h + i[None, :]
    tl.store(vc_ptrs, tl.load(v_ptrs, mask=kv_mask, other=0.0).to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(
        vc_ptrs + HALF,
        tl.load(v_ptrs + HALF, mask=kv_mask, other=0.0).to(v_cache_ptr.dtype.element_ty),
        mask=kv_mask,
    )


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
) -> None:
    """Rotate the Q heads of `qkv` in place (times `q_scale`) and write rotated K and plain V to the cache.

    qkv: (B*T, (Hq + 2*Hkv) * D), last stride 1, row b*T + t = token t of batch b, heads laid out [Q..., K..., V...].
    cos, sin: fp32 (T, D/2) shared by the batch, or (B, T, D/2) per batch row; last stride 1.
    k_cache, v_cache: (B, T_cache, Hkv, D), last stride 1; rows cache_offset .. cache_offset+T-1 are written.
    The K and V columns of `qkv` are left as they were. num_q_heads may be 0 (a K/V-only buffer).
    """
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be (B*T, {width}) with last stride 1, got {tuple(qkv.shape)} {qkv.stride()}")
    t, cos_b, cos_t = check_rope_inputs(qkv.shape[0], cos, sin, k_cache, v_cache, num_kv_heads, head_dim, cache_offset)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    launch(rope_qkv_to_cache_kernel, (qkv.shape[0],), qkv)(
        qkv, cos, sin, k_cache, v_cache, t, cache_offset, float(q_scale),
        qkv.stride(0), cos_b, cos_t, *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_Q_HEADS=triton.next_power_of_2(max(1, num_q_heads)), BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, num_warps=4 if num_q_heads * block_half >= 512 else 1,
    )  # fmt: skip
