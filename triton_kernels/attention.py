"""Fused softmax attention (flash style) with GQA head packing, block-id masks and an optional split over keys.

Softmax statistics are fp32; unnormalised probabilities are cast to the value dtype before P·V (as openpi does for
Gemma). Query i of batch b may attend key j iff `k_block[b, j] <= q_block[b, i]` — openpi's `make_attn_mask`
written as block ids: the prefix is block 0, the state token block 1, the action tokens block 2, padding keys get
a huge id. A query that sees no key returns zeros (never NaN).

A program owns `block_m` rows of (query position, head) pairs, `heads_per_program` query heads that share one KV
head, so each K/V tile is loaded once for all of them. With `num_splits > 1` the keys are split across programs
(flash-decoding) so the action expert's 64 queries fill the GPU. The splits are merged in split order
(deterministic) either by the last program of a row block to arrive, which then resets its counter, like split-K
GEMM (`config.combine = 0`), or by `attention_combine_kernel`, many small programs each merging a slice of rows and
columns (`combine = 1`: one more launch, but no single SM reads all of a row block's partials).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_configs import AttentionConfig, attention_config
from .attention_tma import attention_tma, tma_attention_applies
from .pdl import launch, pdl_enter
from .workspace import Workspace, default_workspace

__all__ = ["attention"]

LOG2E = 1.4426950408889634


@triton.jit
def _row_block(pid_bh, NUM_KV_HEADS, GROUP: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr):
    """(batch, KV head, first query head) of the row block on grid axis 1."""
    head_groups: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    b = pid_bh // (NUM_KV_HEADS * head_groups)
    kv_head = (pid_bh // head_groups) % NUM_KV_HEADS
    first_head = kv_head * GROUP + (pid_bh % head_groups) * HEADS_PER_PROGRAM
    return b, kv_head, first_head


@triton.jit
def merge_split_partials(partial_ptr, stats_ptr, first, rows, d, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):  # fmt: skip
    """The normalised output of rows `rows` x columns `d` from NUM_SPLITS split partials at slots first.. (acc
    (BLOCK_M, BLOCK_D) and (max, sum) (2, BLOCK_M) fp32 a slot), merged in split order, so the result does not
    depend on which split arrived last. Loads bypass L1: other programs of the launch wrote the partials."""
    m_all = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    for s_idx in range(0, NUM_SPLITS):
        m_s = tl.load(stats_ptr + (first + s_idx) * 2 * BLOCK_M + rows, cache_modifier=".cg")
        m_all = tl.maximum(m_all, m_s)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros(rows.shape, dtype=tl.float32)
    total = tl.zeros((rows.shape[0], d.shape[0]), dtype=tl.float32)
    for s_idx in range(0, NUM_SPLITS):
        slot = first + s_idx
        m_s = tl.load(stats_ptr + slot * 2 * BLOCK_M + rows, cache_modifier=".cg")
        l_s = tl.load(stats_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows, cache_modifier=".cg")
        weight = tl.math.exp2(m_s - m_ref)
        l_all += l_s * weight
        part = tl.load(partial_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :],
                       cache_modifier=".cg")  # fmt: skip
        total += part * weight[:, None]
    return total / tl.where(l_all > 0.0, l_all, 1.0)[:, None]


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_block_ptr, k_block_ptr, partial_ptr, stats_ptr, counter_ptr,
    Tq, Tk, NUM_KV_HEADS, logit_scale_log2,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h, sqb_b, sqb_t, skb_b, skb_t,
    D: tl.constexpr,  # head dim
    STRIDE_UNIT: tl.constexpr,  # q/k/v/out strides are passed divided by it (SigLIP's 72: 8), so loads stay 16-byte
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_COMBINE: tl.constexpr = False,  # split partials only; attention_combine_kernel merges
    USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_enter(USE_PDL)
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, kv_head, first_head = _row_block(pid_bh, NUM_KV_HEADS, GROUP, HEADS_PER_PROGRAM)
    sq_b, sq_t, sq_h = sq_b * STRIDE_UNIT, sq_t * STRIDE_UNIT, sq_h * STRIDE_UNIT
    sk_b, sk_t, sk_h = sk_b * STRIDE_UNIT, sk_t * STRIDE_UNIT, sk_h * STRIDE_UNIT
    sv_b, sv_t, sv_h = sv_b * STRIDE_UNIT, sv_t * STRIDE_UNIT, sv_h * STRIDE_UNIT
    so_b, so_t, so_h = so_b * STRIDE_UNIT, so_t * STRIDE_UNIT, so_h * STRIDE_UNIT

    rows = tl.arange(0, BLOCK_M)
    t = pid_q * (BLOCK_M // HEADS_PER_PROGRAM) + rows // HEADS_PER_PROGRAM
    h = first_head + rows % HEADS_PER_PROGRAM
    row_ok = t < Tq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if HAS_MASK:
        q_blk = tl.load(q_block_ptr + b * sqb_b + t * sqb_t, mask=row_ok, other=-1)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of log2-scaled logits
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    keys_per_split = tl.cdiv(tl.cdiv(Tk, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = pid_s * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, Tk)
    k_base = k_ptr + b * sk_b + kv_head * sk_h
    v_base = v_ptr + b * sv_b + kv_head * sv_h
    for start in range(k_lo, k_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < k_hi
        k_t = tl.load(k_base + j[None, :] * sk_t + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * logit_scale_log2
        visible = j_ok[None, :]
        if HAS_MASK:
            k_blk = tl.load(k_block_ptr + b * skb_b + j * skb_t, mask=j_ok, other=2**30)
            visible = visible & (k_blk[None, :] <= q_blk[:, None])
        # attention_tma.softmax_step's arithmetic, written out: as a call it changes this kernel's SASS for the tuned 3-view
        # chunk-50 expert configs (8 warps, 1 stage), whose committed timings come from this form
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: exp2(-inf) = 0
        p = tl.math.exp2(s - m_ref[:, None])
        rescale = tl.math.exp2(m_i - m_ref)
        l_i = l_i * rescale + tl.sum(p, axis=1)
        v = tl.load(v_base + j[:, None] * sv_t + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_ptrs = out_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials of tile `tile`, split s: acc (BLOCK_M, BLOCK_D) fp32 and (max, sum) (2, BLOCK_M) fp32.
        tile = pid_bh * tl.num_programs(0) + pid_q
        slot = tile * NUM_SPLITS + pid_s
        tl.store(partial_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(stats_ptr + slot * 2 * BLOCK_M + rows, m_i)
        tl.store(stats_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows, l_i)
        if not SPLIT_COMBINE:
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:  # the same arithmetic as attention_combine_kernel
                out = merge_split_partials(partial_ptr, stats_ptr, tile * NUM_SPLITS, rows, d, BLOCK_M, BLOCK_D,
                                           NUM_SPLITS)  # fmt: skip
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch / graph replay


@triton.jit
def attention_combine_kernel(
    partial_ptr, stats_ptr, out_ptr, Tq, NUM_KV_HEADS, so_b, so_t, so_h,
    D: tl.constexpr,
    STRIDE_UNIT: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK_M: tl.constexpr,
    CHUNK_D: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    """Merge the split partials of `attention_kernel` for a (CHUNK_M rows, CHUNK_D columns) slice of one row block.
    Grid: the partial kernel's (query tiles, row blocks) times the slices of a row block."""
    pdl_enter(USE_PDL)
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_c = tl.program_id(2)
    b, kv_head, first_head = _row_block(pid_bh, NUM_KV_HEADS, GROUP, HEADS_PER_PROGRAM)
    so_b, so_t, so_h = so_b * STRIDE_UNIT, so_t * STRIDE_UNIT, so_h * STRIDE_UNIT
    d_chunks: tl.constexpr = BLOCK_D // CHUNK_D
    rows = (pid_c // d_chunks) * CHUNK_M + tl.arange(0, CHUNK_M)
    d = (pid_c % d_chunks) * CHUNK_D + tl.arange(0, CHUNK_D)
    t = pid_q * (BLOCK_M // HEADS_PER_PROGRAM) + rows // HEADS_PER_PROGRAM
    h = first_head + rows % HEADS_PER_PROGRAM
    first = (pid_bh * tl.num_programs(0) + pid_q) * NUM_SPLITS
    m_all = tl.full((CHUNK_M,), float("-inf"), dtype=tl.float32)
    for s_idx in tl.static_range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(stats_ptr + (first + s_idx) * 2 * BLOCK_M + rows))
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros((CHUNK_M,), dtype=tl.float32)
    total = tl.zeros((CHUNK_M, CHUNK_D), dtype=tl.float32)
    for s_idx in tl.static_range(NUM_SPLITS):  # split order, unrolled so every split's loads are in flight at once
        slot = first + s_idx
        m_s = tl.load(stats_ptr + slot * 2 * BLOCK_M + rows)
        l_s = tl.load(stats_ptr + slot * 2 * BLOCK_M + BLOCK_M + rows)
        weight = tl.math.exp2(m_s - m_ref)
        l_all += l_s * weight
        part = tl.load(partial_ptr + slot * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :])
        total += part * weight[:, None]
    out = total / tl.where(l_all > 0.0, l_all, 1.0)[:, None]
    out_ptrs = out_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(t < Tq)[:, None] & (d < D)[None, :])


def _check_heads(name: str, x: torch.Tensor, b: int, heads: int, d: int) -> None:
    if x.dim() != 4 or x.shape[0] != b or x.shape[2] != heads or x.shape[3] != d:
        raise ValueError(f"{name} must be ({b}, T, {heads}, {d}), got {tuple(x.shape)}")
    if x.stride(3) != 1:
        raise ValueError(f"{name} must have last stride 1, got strides {x.stride()}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    q_block: torch.Tensor | None = None,
    k_block: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """`out = softmax(scale * q @ k.T, masked) @ v` per head; GQA query head h reads KV head h // (Hq // Hkv).

    q: (B, Tq, Hq, D), k/v: (B, Tk, Hkv, D), out: (B, Tq, Hq, D); any strides with last stride 1 (q may be a view
    into a fused QKV buffer), one dtype for q/k/v, any float dtype for out. scale: multiplies the logits (1.0 when
    folded into q). q_block (B, Tq) / k_block (B, Tk) int32: query i sees key j iff k_block[j] <= q_block[i]; both
    None = full bidirectional attention. Rows that see no key are written as zeros. config: launch config (default:
    the GPU's table or the heuristic); workspace: split scratch (default: the device's shared one). Graph-capturable.
    """
    bsz, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    _check_heads("q", q, bsz, hq, d)
    _check_heads("k", k, bsz, hkv, d)
    _check_heads("v", v, bsz, hkv, d)
    _check_heads("out", out, bsz, hq, d)
    if v.shape[1] != tk:
        raise ValueError(f"k has {tk} keys but v has {v.shape[1]}")
    if out.shape[1] != tq:
        raise ValueError(f"out must have {tq} queries, got {out.shape[1]}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if (q_block is None) != (k_block is None):
        raise ValueError("give both q_block and k_block, or neither")
    if q_block is not None:
        for name, blk, n in (("q_block", q_block, tq), ("k_block", k_block, tk)):
            if blk.shape != (bsz, n) or blk.dtype != torch.int32:
                raise ValueError(f"{name} must be int32 ({bsz}, {n}), got {blk.dtype} {tuple(blk.shape)}")

    cfg = config or attention_config(bsz, tq, tk, hq, hkv, d, dtype=q.dtype, device=q.device)
    group = hq // hkv
    hpp = cfg.heads_per_program
    if group % hpp or cfg.block_m % hpp:
        raise ValueError(f"heads_per_program {hpp} must divide the GQA group {group} and block_m {cfg.block_m}")
    block_d = max(16, triton.next_power_of_2(d))
    q_tiles = triton.cdiv(tq, cfg.block_m // hpp)
    grid = (q_tiles, bsz * hkv * (group // hpp), cfg.num_splits)
    combine = cfg.num_splits > 1 and cfg.combine == 1
    if cfg.num_splits > 1:
        ws = workspace or default_workspace(q.device)
        tiles = grid[0] * grid[1]
        slots = tiles * cfg.num_splits * cfg.block_m
        scratch = ws.floats(slots * (block_d + 2))
        partials, stats = scratch[: slots * block_d], scratch[slots * block_d :]
        counters = out if combine else ws.counters(tiles)
    else:
        partials = stats = counters = out  # unused
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    unit = next(u for u in (16, 8, 4, 2, 1) if all(x % u == 0 for x in strides))
    masks = (q_block, k_block) if q_block is not None else (out, out)
    mask_strides = (*q_block.stride(), *k_block.stride()) if q_block is not None else (0, 0, 0, 0)
    if tma_attention_applies(q, k, v, cfg):  # else a `tma` config runs on the pointer kernel with the same tiles
        attention_tma(q, k, v, out, masks, mask_strides, q_block is not None, partials, stats,
                      float(scale) * LOG2E, cfg, grid)  # fmt: skip
    else:
        _launch_pointer(q, k, v, out, masks, mask_strides, q_block is not None, partials, stats, counters, scale,
                        unit, strides, cfg, grid, block_d, combine)  # fmt: skip
    if combine:
        chunk_m, chunk_d = min(16, cfg.block_m), min(64, block_d)
        chunks = (cfg.block_m // chunk_m) * (block_d // chunk_d)
        launch(attention_combine_kernel, (grid[0], grid[1], chunks), out)(
            partials, stats, out, tq, hkv, *(x // unit for x in strides[9:]),
            D=d, STRIDE_UNIT=unit, GROUP=group, HEADS_PER_PROGRAM=hpp, BLOCK_M=cfg.block_m, BLOCK_D=block_d, NUM_SPLITS=cfg.num_splits,
            CHUNK_M=chunk_m, CHUNK_D=chunk_d, num_warps=4 if chunk_m * chunk_d >= 1024 else 2, num_stages=1,
        )  # fmt: skip
    return out


def _launch_pointer(q, k, v, out, masks, mask_strides, has_mask, partials, stats, counters, scale, unit, strides,
                    cfg, grid, block_d, combine) -> None:  # fmt: skip
    """`attention_kernel` with `attention`'s checked arguments."""
    tq, tk, hq, hkv, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    launch(attention_kernel, grid, out)(
        q, k, v, out, *masks, partials, stats, counters,
        tq, tk, hkv, float(scale) * LOG2E,
        *(x // unit for x in strides), *mask_strides,
        D=d,
        STRIDE_UNIT=unit,
        GROUP=hq // hkv,
        HEADS_PER_PROGRAM=cfg.heads_per_program,
        HAS_MASK=has_mask,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=cfg.num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT_COMBINE=combine,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_block: torch.Tensor | None = None,
    k_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract in plain torch, fp32 math (for tests and benchmarks): (B, Tq, Hq, D) fp32."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    logits = scale * qf @ kf.transpose(-1, -2)
    if q_block is not None:
        visible = (k_block[:, None, :] <= q_block[:, :, None])[:, None]  # (B, 1, Tq, Tk)
        logits = logits.masked_fill(~visible, -math.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible key -> zeros
    return (probs @ vf).transpose(1, 2)
