"""Attention with Q, K and V tiles loaded by TMA (sm_90+), head dims up to 256 in 64-wide chunks.

Same contract and arithmetic as `attention.attention_kernel` (block-id masks, online softmax in the exp2 domain,
probabilities cast to the value dtype before P·V, split partials merged by `attention_combine_kernel`), with the
operands laid out for the tensor cores instead of loaded by address:

- Q, K and V arrive as 64-wide head-dim chunks by tensor descriptors over the (B, T, H, D) views, so each chunk
  lands in shared memory in the swizzled layout wgmma reads, with no address arithmetic a thread and no masks (a
  program's Q rows are `heads_per_program` heads of `block_m / heads_per_program` positions: one 4D box a chunk).
  At head dim 256 the O accumulator alone is 128 registers a thread for 64 rows a warpgroup; what else the
  registers hold (Q as wgmma's A operand from registers or shared memory) is Triton's choice, which
  `compile_check` reports (for 128 rows on 8 warps: 237-252 registers, no spill, with Triton 3.9).
- S = Q K^T is the sum of the chunks' products; O is kept as one accumulator a chunk.
- Keys past the cache's end and head-dim columns past D (SigLIP's 72 in two chunks) arrive as zeros (TMA bounds),
  so no key row of another batch element is ever read.

`attention.attention` runs it for a config with `tma = 1` where `tma_attention_applies` holds; the tuner times it
beside the pointer kernel, and the table keeps whichever measured faster (`attention_configs`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .attention_configs import AttentionConfig
from .pdl import launch, pdl_enter

__all__ = ["D_CHUNK", "attention_tma", "tma_attention_applies", "tma_attention_config_applies"]

D_CHUNK = 64  # head-dim chunk a descriptor load brings (128 bytes of bf16: one swizzle row)
MAX_HEAD_DIM = 256  # four chunks


def _chunked_width(d: int) -> int:
    return -(-d // D_CHUNK) * D_CHUNK


@triton.jit
def softmax_step(s, visible, m_i, l_i):
    """One key tile of the online softmax on log2-scaled logits `s`: (p, rescale of the old accumulator, new
    running max, new running sum). Hidden keys weigh 0; rows with nothing visible yet keep max -inf."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: exp2(-inf) = 0
    p = tl.math.exp2(s - m_ref[:, None])
    rescale = tl.math.exp2(m_i - m_ref)
    return p, rescale, m_new, l_i * rescale + tl.sum(p, axis=1)


@triton.jit
def _dot_chunks(q0, q1, q2, q3, k_desc, b, start, kv_col, BLOCK_N: tl.constexpr, NUM_DC: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Q K^T for one key tile, summed over the head-dim chunks (fp32)."""
    k0 = k_desc.load([b, start, kv_col, 0]).reshape(BLOCK_N, 64)
    s = tl.dot(q0, k0.T, input_precision=DOT_PRECISION)
    if NUM_DC > 1:
        k1 = k_desc.load([b, start, kv_col, 64]).reshape(BLOCK_N, 64)
        s = tl.dot(q1, k1.T, s, input_precision=DOT_PRECISION)
    if NUM_DC > 2:
        k2 = k_desc.load([b, start, kv_col, 128]).reshape(BLOCK_N, 64)
        s = tl.dot(q2, k2.T, s, input_precision=DOT_PRECISION)
    if NUM_DC > 3:
        k3 = k_desc.load([b, start, kv_col, 192]).reshape(BLOCK_N, 64)
        s = tl.dot(q3, k3.T, s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _store_chunk(acc, c: tl.constexpr, scale_rows, out_ptr, b, t, h, row_ok, so_b, so_t, so_h, partial_ptr, slot,
                 rows, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):  # fmt: skip
    d = c * 64 + tl.arange(0, 64)
    if NUM_SPLITS == 1:
        ptrs = out_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :]
        mask = row_ok[:, None] & (d < D)[None, :]
        tl.store(ptrs, (acc * scale_rows[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:  # the pointer kernel's partial layout: (slot, BLOCK_M, BLOCK_D) fp32, unnormalised (columns >= D: zeros)
        tl.store(partial_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def attention_tma_kernel(
    q_desc, k_desc, v_desc, out_ptr, q_block_ptr, k_block_ptr, partial_ptr, stats_ptr,
    Tq, Tk, NUM_KV_HEADS, logit_scale_log2, so_b, so_t, so_h, sqb_b, sqb_t, skb_b, skb_t,
    D: tl.constexpr,
    NUM_DC: tl.constexpr,  # 64-wide head-dim chunks, cdiv(D, 64): the last one's columns past D arrive as zeros
    BLOCK_D: tl.constexpr,  # NUM_DC x 64: the split partials' row width (the combine kernel's BLOCK_D)
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    T_BLK: tl.constexpr = BLOCK_M // HEADS_PER_PROGRAM
    pdl_enter(USE_PDL)
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    head_groups: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    b = pid_bh // (NUM_KV_HEADS * head_groups)
    kv_head = (pid_bh // head_groups) % NUM_KV_HEADS
    first_head = kv_head * GROUP + (pid_bh % head_groups) * HEADS_PER_PROGRAM
    t0 = pid_q * T_BLK

    rows = tl.arange(0, BLOCK_M)
    t = t0 + rows // HEADS_PER_PROGRAM
    h = first_head + rows % HEADS_PER_PROGRAM
    row_ok = t < Tq
    # rows past Tq arrive as zeros (TMA bounds); the box's rows are (position, head) with the head fastest
    q0 = q_desc.load([b, t0, first_head, 0]).reshape(BLOCK_M, 64)
    q1 = q0
    q2 = q0
    q3 = q0
    if NUM_DC > 1:
        q1 = q_desc.load([b, t0, first_head, 64]).reshape(BLOCK_M, 64)
    if NUM_DC > 2:
        q2 = q_desc.load([b, t0, first_head, 128]).reshape(BLOCK_M, 64)
    if NUM_DC > 3:
        q3 = q_desc.load([b, t0, first_head, 192]).reshape(BLOCK_M, 64)
    if HAS_MASK:
        q_blk = tl.load(q_block_ptr + b * sqb_b + t * sqb_t, mask=row_ok, other=-1)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of log2-scaled logits
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    keys_per_split = tl.cdiv(tl.cdiv(Tk, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = pid_s * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, Tk)
    for start in range(k_lo, k_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        s = _dot_chunks(q0, q1, q2, q3, k_desc, b, start, kv_head, BLOCK_N, NUM_DC, DOT_PRECISION)
        s = s * logit_scale_log2
        visible = (j < k_hi)[None, :]
        if HAS_MASK:
            k_blk = tl.load(k_block_ptr + b * skb_b + j * skb_t, mask=j < k_hi, other=2**30)
            visible = visible & (k_blk[None, :] <= q_blk[:, None])
        p, rescale, m_new, l_i = softmax_step(s, visible, m_i, l_i)
        p = p.to(q0.dtype)
        v0 = v_desc.load([b, start, kv_head, 0]).reshape(BLOCK_N, 64)
        acc0 = tl.dot(p, v0, acc0 * rescale[:, None], input_precision=DOT_PRECISION)
        if NUM_DC > 1:
            v1 = v_desc.load([b, start, kv_head, 64]).reshape(BLOCK_N, 64)
            acc1 = tl.dot(p, v1, acc1 * rescale[:, None], input_precision=DOT_PRECISION)
        if NUM_DC > 2:
            v2 = v_desc.load([b, start, kv_head, 128]).reshape(BLOCK_N, 64)
            acc2 = tl.dot(p, v2, acc2 * rescale[:, None], input_precision=DOT_PRECISION)
        if NUM_DC > 3:
            v3 = v_desc.load([b, start, kv_head, 192]).reshape(BLOCK_N, 64)
            acc3 = tl.dot(p, v3, acc3 * rescale[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    slot = 0
    if NUM_SPLITS > 1:
        inv_l = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        slot = (pid_bh * tl.num_programs(0) + pid_q) * NUM_SPLITS + pid_s
        tl.store(stats_ptr + slot * 2 * BLOCK_M + rows, m_i)
        tl.store(stats_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows, l_i)
    args = (inv_l, out_ptr, b, t, h, row_ok, so_b, so_t, so_h, partial_ptr, slot, rows, BLOCK_M, D, BLOCK_D, NUM_SPLITS)
    _store_chunk(acc0, 0, *args)
    if NUM_DC > 1:
        _store_chunk(acc1, 1, *args)
    if NUM_DC > 2:
        _store_chunk(acc2, 2, *args)
    if NUM_DC > 3:
        _store_chunk(acc3, 3, *args)


def tma_attention_config_applies(cfg: AttentionConfig, d: int) -> bool:
    """The config side of `tma_attention_applies` (for the tuner's candidates): `cfg.tma` set, a head dim of at most
    256 whose 64-wide chunks span the pointer kernel's padded width (the split partials' layout the combine kernel
    reads: 72 -> 128 yes, 192 -> 256 no), and a split merge by the combine kernel (no in-kernel merge here)."""
    pow2 = max(16, 1 << (d - 1).bit_length())
    return (
        bool(cfg.tma) and d <= MAX_HEAD_DIM and _chunked_width(d) == pow2 and (cfg.num_splits == 1 or cfg.combine == 1)
    )


def _interpreting(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"


def tma_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig) -> bool:
    """Whether `attention` runs `cfg` on the TMA kernel: the config applies, 16-bit operands on sm_90+ CUDA (or the
    CPU interpreter, 2- or 4-byte, or meta tensors for a compile check), and views TMA can describe (16-byte aligned
    bases, strides in whole 16 bytes)."""
    d = q.shape[-1]
    if not tma_attention_config_applies(cfg, d):
        return False
    if q.device.type == "cuda":  # 16-bit on the GPU: a 64-wide float32 chunk is two swizzle rows (not built)
        if torch.cuda.get_device_capability(q.device)[0] < 9 or q.element_size() != 2:
            return False
    elif not (_interpreting(q) or q.device.type == "meta"):
        return False
    for x in (q, k, v):
        size = x.element_size()
        if size not in (2, 4) or x.stride(3) != 1 or any((s * size) % 16 for s in x.stride()[:3]):
            return False
        if x.device.type != "meta" and x.data_ptr() % 16:
            return False
    return True


def _descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block)


def attention_tma(q, k, v, out, masks, mask_strides, has_mask: bool, partials, stats, logit_scale_log2: float,
                  cfg: AttentionConfig, grid: tuple[int, int, int]) -> None:  # fmt: skip
    """Launch `attention_tma_kernel` with `attention`'s checked arguments (`masks`: (q_block, k_block) or stand-ins,
    `partials` / `stats`: the split scratch, merged afterwards by the caller's combine launch). Descriptors are built
    on the host per call; inside a CUDA Graph the launch keeps them by value."""
    bsz, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    hpp = cfg.heads_per_program
    q_desc = _descriptor(q, [1, cfg.block_m // hpp, hpp, D_CHUNK])
    k_desc = _descriptor(k, [1, cfg.block_n, 1, D_CHUNK])
    v_desc = _descriptor(v, [1, cfg.block_n, 1, D_CHUNK])
    launch(attention_tma_kernel, grid, out)(
        q_desc, k_desc, v_desc, out, *masks, partials, stats,
        tq, tk, hkv, logit_scale_log2, *out.stride()[:3], *mask_strides,
        D=d,
        NUM_DC=_chunked_width(d) // D_CHUNK,
        BLOCK_D=_chunked_width(d),
        GROUP=hq // hkv,
        HEADS_PER_PROGRAM=hpp,
        HAS_MASK=has_mask,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
