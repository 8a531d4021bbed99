"""One persistent kernel for a whole action-expert layer: RMS → QKV + RoPE → attention → O + residual → RMS →
gate/up GeGLU → down + residual, with grid-wide barriers between the phases.

Why: an action-expert layer works on 64 rows, so each of its ~10 separate kernels (2–13 µs) is bound by ramp-up,
tail and launch, not by the 35 MB of weights it streams (8.5 µs at the H200's bandwidth; docs/kernels.md "Known
limits"). Here one program per SM walks the layer: the two RMS factors are summed while the GEMMs load their A
tiles (no `rms_factor` launches), split-K and split-KV partials are merged by the last program to arrive at a tile
(no combine launches), and (`prefetch=1`) a phase's programs can ask L2 for their slice of the next phase's weights
before they wait at the barrier. 18 launches a denoising step instead of ~185. Measured on the H200 it is slower
than the separate kernels (0.79 vs 0.64 ms a step; the L2 prefetch slower still), so the engine runs it only when
asked (`expert_layer=True`); docs/kernels.md "One persistent kernel a layer" has the per-phase profile and why.

Semantics: exactly the separate path's (`plan._gemma_layer` for the expert with the RoPE epilogue): the same
fp32 formulas and one rounding per stored tensor, up to fp32 summation order. Limits (checked; the engine falls
back to the separate kernels otherwise): one KV head, at most BLOCK_M rows, widths divisible by the tiles.

Barriers: every program arrives (release) and spins (acquire) on a counter in the workspace; the last program to
leave the kernel resets the counters, so the next launch or CUDA Graph replay starts at zero. They need every
program resident at once: the launch uses at most one program per SM (the interpreter runs programs one after
another, so there the grid is one program that walks every unit). Loads of what another program of this launch
wrote bypass L1 (`.cg`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .attention import LOG2E, merge_split_partials, softmax_step
from .gemm_epilogue import _rope_store, gelu_tanh, rope_tables
from .launch_configs import _num_sms
from .pdl import launch, pdl_enter, prefetch_rows_l2
from .rope import check_rope_inputs
from .workspace import Workspace, default_workspace

__all__ = ["ExpertLayerConfig", "expert_layer", "expert_layer_applies", "expert_layer_config"]

BARRIERS = 4  # after QKV, attention, O, gate/up; counter BARRIERS is the exit count
_BARRIERS = tl.constexpr(BARRIERS)


@dataclasses.dataclass(frozen=True)
class ExpertLayerConfig:
    """Tiles of each phase (columns a unit owns, K step, splits) and the launch shape.

    qkv_half: pair columns of a QKV unit (a unit owns qkv_half columns of both halves of one head, for RoPE);
    att_rows: query vectors (row × head) of an attention unit; att_keys: keys per inner step; att_splits: key
    splits merged by the last arriving split; o_cols/down_cols and o_split/down_split: output columns and K splits
    of the residual GEMMs; gate_cols: GeGLU output columns of a gate/up unit. prefetch: 1 = before each barrier,
    bulk-prefetch the program's slice of the next phase's weights into L2 (and the QKV slice before the PDL wait).
    programs: grid size (0 = one per SM)."""

    block_m: int = 64
    block_k: int = 128
    qkv_half: int = 16
    att_rows: int = 16
    att_keys: int = 32
    att_splits: int = 4
    o_cols: int = 32
    o_split: int = 4
    gate_cols: int = 32
    down_cols: int = 64
    down_split: int = 8
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0
    programs: int = 0
    poll_load: int = 1  # barrier polls with ld.acquire (1) or an atomic add of 0 (0)
    phases: int = 31  # profiling only: bit i runs phase i (QKV, attention, O, gate/up, down); barriers always run


@triton.jit
def _load_acquire(ptr):
    """One `ld.acquire.gpu` of an int32: a poll that reads L2 without an atomic read-modify-write."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _grid_sync(sync_ptr, index, nprog, POLL_LOAD: tl.constexpr):
    """Barrier `index`: every program's stores before it are visible to every program after it. The last program
    to arrive does not poll (so a one-program grid, the interpreter's, never does)."""
    tl.debug_barrier()  # all threads' stores issued before the (single-thread) release
    seen = tl.atomic_add(sync_ptr + index, 1, sem="acq_rel") + 1
    while seen < nprog:
        if POLL_LOAD:
            seen = _load_acquire(sync_ptr + index)
        else:
            seen = tl.atomic_add(sync_ptr + index, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _grid_exit(sync_ptr, nprog, NUM_BARRIERS: tl.constexpr):
    """The last program out resets the barrier counters (every program has passed every barrier by then)."""
    tl.debug_barrier()
    done = tl.atomic_add(sync_ptr + NUM_BARRIERS, 1, sem="acq_rel")
    if done == nprog - 1:
        for i in tl.static_range(NUM_BARRIERS + 1):
            tl.atomic_xchg(sync_ptr + i, 0)


@triton.jit
def _prefetch_cols(w_ptr, stride_w, cols, k_lo, nbytes, PREFETCH: tl.constexpr):
    if PREFETCH:
        prefetch_rows_l2(w_ptr + cols.to(tl.int64) * stride_w + k_lo, nbytes)


@triton.jit
def _qkv_units(Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_HALF: tl.constexpr):
    return (Q_HEADS + 2 * KV_HEADS) * ((HEAD_DIM // 2) // QKV_HALF)


@triton.jit
def _qkv_cols(u, HEAD_DIM: tl.constexpr, QKV_HALF: tl.constexpr):
    """(first-half columns, pair columns) of QKV unit u: QKV_HALF columns of one head's first half."""
    groups: tl.constexpr = (HEAD_DIM // 2) // QKV_HALF
    head = u // groups
    i0 = (u % groups) * QKV_HALF
    r = tl.arange(0, QKV_HALF)
    return head * HEAD_DIM + i0 + r, head * (HEAD_DIM // 2) + i0 + r


@triton.jit
def _prefetch_qkv(pid, nprog, w_ptr, stride_w, elem_bytes, WIDTH: tl.constexpr, Q_HEADS: tl.constexpr,
                  KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_HALF: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    if PREFETCH:
        for u in range(pid, _qkv_units(Q_HEADS, KV_HEADS, HEAD_DIM, QKV_HALF), nprog):
            cols, _ = _qkv_cols(u, HEAD_DIM, QKV_HALF)
            _prefetch_cols(w_ptr, stride_w, cols, 0, WIDTH * elem_bytes, PREFETCH)
            _prefetch_cols(w_ptr, stride_w, cols + HEAD_DIM // 2, 0, WIDTH * elem_bytes, PREFETCH)


@triton.jit
def _prefetch_split(pid, nprog, w_ptr, stride_w, elem_bytes, N: tl.constexpr, K: tl.constexpr,
                    COLS: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """L2 prefetch of this program's slices of a residual GEMM's weight (units as `_residual_gemm`)."""
    if PREFETCH:
        tiles: tl.constexpr = N // COLS
        for u in range(pid, tiles * SPLIT, nprog):
            cols = (u % tiles) * COLS + tl.arange(0, COLS)
            k_lo = (u // tiles) * (K // SPLIT)
            _prefetch_cols(w_ptr, stride_w, cols, k_lo, (K // SPLIT) * elem_bytes, PREFETCH)


@triton.jit
def _prefetch_gate_up(pid, nprog, w_ptr, stride_w, elem_bytes, WIDTH: tl.constexpr, MLP: tl.constexpr,
                      GATE_COLS: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    if PREFETCH:
        for u in range(pid, MLP // GATE_COLS, nprog):
            cols = u * GATE_COLS + tl.arange(0, GATE_COLS)
            _prefetch_cols(w_ptr, stride_w, cols, 0, WIDTH * elem_bytes, PREFETCH)
            _prefetch_cols(w_ptr, stride_w, cols + MLP, 0, WIDTH * elem_bytes, PREFETCH)


@triton.jit
def _paired_rms_dot(x_ptr, stride_x, w_ptr, stride_w, cols, second, offs_m, m_ok, WIDTH: tl.constexpr,
                    COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """x @ w[cols].T and x @ w[cols + second].T in fp32, and the sum of squares of x's rows (for the RMS
    factor) summed from the A tiles the K loop loads anyway."""
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, WIDTH, BLOCK_K):
        a = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        af = a.to(tl.float32)
        ssq += tl.sum(af * af, axis=1)
        w1 = tl.load(w_ptr + cols[:, None] * stride_w + (k0 + offs_k)[None, :])
        w2 = tl.load(w_ptr + (cols + second)[:, None] * stride_w + (k0 + offs_k)[None, :])
        acc1 = tl.dot(a, tl.trans(w1), acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(a, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
    return acc1, acc2, ssq


@triton.jit
def _qkv_phase(
    pid, nprog, x_ptr, stride_x, w_ptr, stride_w, qkv_ptr, stride_qkv, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    M, rope_t, cache_offset, q_scale, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, eps,
    WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, QKV_HALF: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """q (rotated, × q_scale) into `qkv`, rotated K and plain V into the cache rows; the RMS factor of x's rows is
    summed from the A tiles the K loop loads anyway."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    for u in range(pid, _qkv_units(Q_HEADS, KV_HEADS, HEAD_DIM, QKV_HALF), nprog):
        cols, pairs = _qkv_cols(u, HEAD_DIM, QKV_HALF)
        acc1, acc2, ssq = _paired_rms_dot(x_ptr, stride_x, w_ptr, stride_w, cols, HALF, offs_m, m_ok, WIDTH,
                                          QKV_HALF, BLOCK_M, BLOCK_K, DOT_PRECISION)  # fmt: skip
        rs = tl.math.rsqrt(ssq / WIDTH + eps)
        acc1 = acc1 * rs[:, None]
        acc2 = acc2 * rs[:, None]
        n_pairs: tl.constexpr = (Q_HEADS + 2 * KV_HEADS) * HALF
        cos, sin = rope_tables(cos_ptr, sin_ptr, offs_m, pairs, M, n_pairs, rope_t, stride_cos_b, stride_cos_t,
                               HALF, QKV_HALF)  # fmt: skip
        mask = m_ok[:, None] & (pairs < n_pairs)[None, :]
        _rope_store(
            acc1, acc2, cos, sin, offs_m, pairs, mask, qkv_ptr, stride_qkv, k_cache_ptr, v_cache_ptr, rope_t,
            cache_offset, q_scale, stride_kv_b, stride_kv_t, stride_kv_h, HALF, Q_HEADS, KV_HEADS, QKV_HALF,
        )  # fmt: skip


@triton.jit
def _attention_phase(
    pid, nprog, qkv_ptr, stride_qkv, k_cache_ptr, v_cache_ptr, stride_kv_b, stride_kv_t, attn_ptr, stride_attn,
    q_block_ptr, k_block_ptr, sqb_b, sqb_t, skb_b, skb_t, part_ptr, stats_ptr, count_ptr, B, S, Tk,
    logit_scale_log2,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ATT_ROWS: tl.constexpr, ATT_KEYS: tl.constexpr,
    SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Masked attention of the rows' 8 query heads over the one KV head (prefix + suffix keys): units are (tile of
    ATT_ROWS query vectors, key split); the last split to finish a tile merges the partials in split order."""
    T_ROWS: tl.constexpr = ATT_ROWS // HEADS  # query rows of a tile (all HEADS heads each)
    r = tl.arange(0, ATT_ROWS)
    d = tl.arange(0, HEAD_DIM)
    tiles_per_b = tl.cdiv(S, T_ROWS)
    keys_per_split = tl.cdiv(tl.cdiv(Tk, SPLITS), ATT_KEYS) * ATT_KEYS
    for u in range(pid, B * tiles_per_b * SPLITS, nprog):
        tile = u // SPLITS
        split = u % SPLITS
        b = tile // tiles_per_b
        t = (tile % tiles_per_b) * T_ROWS + r // HEADS
        h = r % HEADS
        row_ok = t < S
        rows = b * S + t
        q = tl.load(qkv_ptr + rows[:, None] * stride_qkv + (h * HEAD_DIM)[:, None] + d[None, :],
                    mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        q_blk = tl.load(q_block_ptr + b * sqb_b + t * sqb_t, mask=row_ok, other=-1)
        m_i = tl.full((ATT_ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ATT_ROWS,), dtype=tl.float32)
        acc = tl.zeros((ATT_ROWS, HEAD_DIM), dtype=tl.float32)
        k_lo = split * keys_per_split
        k_hi = tl.minimum(k_lo + keys_per_split, Tk)
        k_base = k_cache_ptr + b * stride_kv_b
        v_base = v_cache_ptr + b * stride_kv_b
        for start in range(k_lo, k_hi, ATT_KEYS):
            j = start + tl.arange(0, ATT_KEYS)
            j_ok = j < k_hi
            k_t = tl.load(k_base + j[None, :] * stride_kv_t + d[:, None], mask=j_ok[None, :], other=0.0,
                          cache_modifier=".cg")  # fmt: skip
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * logit_scale_log2
            k_blk = tl.load(k_block_ptr + b * skb_b + j * skb_t, mask=j_ok, other=2**30)
            visible = j_ok[None, :] & (k_blk[None, :] <= q_blk[:, None])
            p, rescale, m_new, l_i = softmax_step(s, visible, m_i, l_i)
            v = tl.load(v_base + j[:, None] * stride_kv_t + d[None, :], mask=j_ok[:, None], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out_ptrs = attn_ptr + rows[:, None] * stride_attn + (h * HEAD_DIM)[:, None] + d[None, :]
        if SPLITS == 1:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(out_ptrs, out.to(attn_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(part_ptr + u * ATT_ROWS * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :], acc)
            tl.store(stats_ptr + u * 2 * ATT_ROWS + r, m_i)
            tl.store(stats_ptr + u * 2 * ATT_ROWS + ATT_ROWS + r, l_i)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # attention_kernel's merge, in split order
                out = merge_split_partials(part_ptr, stats_ptr, tile * SPLITS, r, d, ATT_ROWS, HEAD_DIM, SPLITS)
                tl.store(out_ptrs, out.to(attn_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _residual_gemm(
    pid, nprog, a_ptr, stride_a, w_ptr, stride_w, x_ptr, stride_x, part_ptr, count_ptr, M,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """x += a @ w.T in place (fp32 sum, one rounding); units (column tile, K split), split-major so a tile's splits
    run on different programs; the last split of a tile adds the partials in split order and the residual."""
    tiles: tl.constexpr = N // COLS
    K_PER: tl.constexpr = K // SPLIT
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    for u in range(pid, tiles * SPLIT, nprog):
        tile = u % tiles
        split = u // tiles
        cols = tile * COLS + tl.arange(0, COLS)
        acc = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
        for k0 in range(split * K_PER, (split + 1) * K_PER, BLOCK_K):
            a = tl.load(a_ptr + offs_m[:, None] * stride_a + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            w = tl.load(w_ptr + cols[:, None] * stride_w + (k0 + offs_k)[None, :])
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + cols[None, :]
        if SPLIT == 1:
            res = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(x_ptrs, (acc + res).to(x_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            part = part_ptr + offs_m[:, None] * N + cols[None, :]
            tl.store(part + split * BLOCK_M * N, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                total = tl.zeros((BLOCK_M, COLS), dtype=tl.float32)
                for s_idx in tl.static_range(SPLIT):
                    total += tl.load(part + s_idx * BLOCK_M * N, cache_modifier=".cg")
                res = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(x_ptrs, (total + res).to(x_ptr.dtype.element_ty), mask=m_ok[:, None])
                tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _gate_up_phase(
    pid, nprog, x_ptr, stride_x, w_ptr, stride_w, h_ptr, stride_h, M, eps,
    WIDTH: tl.constexpr, MLP: tl.constexpr, BLOCK_M: tl.constexpr, GATE_COLS: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """h = gelu_tanh(rms·(x @ gate.T)) · rms·(x @ up.T) for w = [gate rows; up rows]; rms summed in the K loop."""
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    for u in range(pid, MLP // GATE_COLS, nprog):
        cols = u * GATE_COLS + tl.arange(0, GATE_COLS)
        acc_g, acc_u, ssq = _paired_rms_dot(x_ptr, stride_x, w_ptr, stride_w, cols, MLP, offs_m, m_ok, WIDTH,
                                            GATE_COLS, BLOCK_M, BLOCK_K, DOT_PRECISION)  # fmt: skip
        rs = tl.math.rsqrt(ssq / WIDTH + eps)
        out = gelu_tanh(acc_g * rs[:, None]) * (acc_u * rs[:, None])
        tl.store(h_ptr + offs_m[:, None] * stride_h + cols[None, :], out.to(h_ptr.dtype.element_ty),
                 mask=m_ok[:, None])  # fmt: skip


@triton.jit
def expert_layer_kernel(
    x_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, qkv_ptr, attn_ptr, h_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr,
    q_block_ptr, k_block_ptr, floats_ptr, sync_ptr,
    M, B, S, Tk, cache_offset, eps, q_scale, logit_scale_log2, elem_bytes,
    stride_x, stride_wqkv, stride_wo, stride_wgu, stride_wd, stride_qkv, stride_attn, stride_h,
    stride_kv_b, stride_kv_t, stride_kv_h, stride_cos_b, stride_cos_t, sqb_b, sqb_t, skb_b, skb_t,
    att_part_off, att_stats_off, o_part_off, d_part_off, att_count_off, o_count_off, d_count_off,
    WIDTH: tl.constexpr, MLP: tl.constexpr, HEAD_DIM: tl.constexpr, Q_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, QKV_HALF: tl.constexpr, ATT_ROWS: tl.constexpr,
    ATT_KEYS: tl.constexpr, ATT_SPLITS: tl.constexpr, O_COLS: tl.constexpr, O_SPLIT: tl.constexpr,
    GATE_COLS: tl.constexpr, DOWN_COLS: tl.constexpr, DOWN_SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PHASES: tl.constexpr = 31, POLL_LOAD: tl.constexpr = 0, USE_PDL: tl.constexpr = 0,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # weights are never written by another kernel: asking L2 for them may start before the PDL wait
    _prefetch_qkv(pid, nprog, wqkv_ptr, stride_wqkv, elem_bytes, WIDTH, Q_HEADS, 1, HEAD_DIM, QKV_HALF, PREFETCH)
    pdl_enter(USE_PDL)
    if PHASES & 1:
        _qkv_phase(
            pid, nprog, x_ptr, stride_x, wqkv_ptr, stride_wqkv, qkv_ptr, stride_qkv, cos_ptr, sin_ptr, k_cache_ptr,
            v_cache_ptr, M, S, cache_offset, q_scale, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h,
            eps, WIDTH, HEAD_DIM, Q_HEADS, 1, BLOCK_M, QKV_HALF, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
    # attention reads no weights: the O and gate/up slices can stream in during it
    _prefetch_split(pid, nprog, wo_ptr, stride_wo, elem_bytes, WIDTH, Q_HEADS * HEAD_DIM, O_COLS, O_SPLIT, PREFETCH)
    _grid_sync(sync_ptr, 0, nprog, POLL_LOAD)
    if PHASES & 2:
        _attention_phase(
            pid, nprog, qkv_ptr, stride_qkv, k_cache_ptr, v_cache_ptr, stride_kv_b, stride_kv_t, attn_ptr, stride_attn,
            q_block_ptr, k_block_ptr, sqb_b, sqb_t, skb_b, skb_t, floats_ptr + att_part_off, floats_ptr + att_stats_off,
            sync_ptr + att_count_off, B, S, Tk, logit_scale_log2, Q_HEADS, HEAD_DIM, ATT_ROWS, ATT_KEYS, ATT_SPLITS,
            DOT_PRECISION,
        )  # fmt: skip
    _prefetch_gate_up(pid, nprog, wgu_ptr, stride_wgu, elem_bytes, WIDTH, MLP, GATE_COLS, PREFETCH)
    _grid_sync(sync_ptr, 1, nprog, POLL_LOAD)
    if PHASES & 4:
        _residual_gemm(
            pid, nprog, attn_ptr, stride_attn, wo_ptr, stride_wo, x_ptr, stride_x, floats_ptr + o_part_off,
            sync_ptr + o_count_off, M, WIDTH, Q_HEADS * HEAD_DIM, BLOCK_M, O_COLS, O_SPLIT, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
    _grid_sync(sync_ptr, 2, nprog, POLL_LOAD)
    if PHASES & 8:
        _gate_up_phase(
            pid, nprog, x_ptr, stride_x, wgu_ptr, stride_wgu, h_ptr, stride_h, M, eps, WIDTH, MLP, BLOCK_M, GATE_COLS,
            BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
    _prefetch_split(pid, nprog, wd_ptr, stride_wd, elem_bytes, WIDTH, MLP, DOWN_COLS, DOWN_SPLIT, PREFETCH)
    _grid_sync(sync_ptr, 3, nprog, POLL_LOAD)
    if PHASES & 16:
        _residual_gemm(
            pid, nprog, h_ptr, stride_h, wd_ptr, stride_wd, x_ptr, stride_x, floats_ptr + d_part_off,
            sync_ptr + d_count_off, M, WIDTH, MLP, BLOCK_M, DOWN_COLS, DOWN_SPLIT, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
    _grid_exit(sync_ptr, nprog, _BARRIERS)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _min_tile(device_type: str) -> int:
    # compiled tl.dot needs 16 in every dimension; the interpreter takes smaller tiles (the tiny preset's 8-wide
    # half heads)
    return 8 if device_type != "cuda" or _interpreting() else 16


def expert_layer_config(width: int, mlp: int, num_q_heads: int, head_dim: int,
                        device_type: str = "cuda") -> ExpertLayerConfig:  # fmt: skip
    """The default tiles (measured on the H200 for π0's expert), shrunk where smaller dims need it."""
    c = ExpertLayerConfig()
    floor = _min_tile(device_type)
    k_dims = (width, mlp // c.down_split, num_q_heads * head_dim // c.o_split)
    block_k = next((b for b in (c.block_k, 64, 32, 16, 8) if b >= floor and all(k % b == 0 for k in k_dims)), floor)
    return dataclasses.replace(
        c,
        block_k=block_k,
        qkv_half=max(floor, min(c.qkv_half, head_dim // 2)),
        att_rows=max(c.att_rows, num_q_heads),
        o_cols=max(floor, min(c.o_cols, width)),
        down_cols=max(floor, min(c.down_cols, width)),
        gate_cols=max(floor, min(c.gate_cols, mlp)),
    )


def expert_layer_applies(rows: int, width: int, mlp: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         cfg: ExpertLayerConfig | None = None, device_type: str = "cuda") -> str | None:  # fmt: skip
    """None if the persistent kernel handles these dims with `cfg` (default: `expert_layer_config`'s), else why
    not (the engine then runs the separate kernels)."""
    c = cfg or expert_layer_config(width, mlp, num_q_heads, head_dim, device_type)
    floor = _min_tile(device_type)
    pow2 = [c.block_k, c.qkv_half, c.att_rows, c.att_keys, c.o_cols, c.gate_cols, c.down_cols, c.block_m, head_dim]
    checks = [
        (all(v == triton.next_power_of_2(v) and v >= floor for v in pow2), f"tiles {pow2} not powers of 2 >= {floor}"),
        (num_kv_heads == 1, f"{num_kv_heads} KV heads (the kernel serves one)"),
        (rows <= c.block_m, f"{rows} rows > block_m {c.block_m}"),
        (width % c.block_k == 0 and mlp % c.block_k == 0, f"width {width} / mlp {mlp} not multiples of block_k"),
        ((head_dim // 2) % c.qkv_half == 0, f"half head {head_dim // 2} not a multiple of qkv_half {c.qkv_half}"),
        (c.att_rows % num_q_heads == 0, f"att_rows {c.att_rows} not a multiple of {num_q_heads} heads"),
        (width % c.o_cols == 0 and width % c.down_cols == 0, f"width {width} not a multiple of the column tiles"),
        (mlp % c.gate_cols == 0, f"mlp {mlp} not a multiple of gate_cols {c.gate_cols}"),
        ((num_q_heads * head_dim) % (c.o_split * c.block_k) == 0, "O's K does not split into block_k steps"),
        (mlp % (c.down_split * c.block_k) == 0, "down's K does not split into block_k steps"),
    ]
    return next((why for ok, why in checks if not ok), None)


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"expert_layer: {name} must be {shape}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"expert_layer: {name} must be {dtype}, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"expert_layer: {name} needs a last stride of 1, got {t.stride()}")


def expert_layer(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    w_o: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    qkv: torch.Tensor,
    attn: torch.Tensor,
    mlp: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_block: torch.Tensor,
    k_block: torch.Tensor,
    *,
    cache_offset: int,
    eps: float,
    scale: float,
    num_q_heads: int,
    head_dim: int,
    q_scale: float = 1.0,
    config: ExpertLayerConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """One Gemma layer over the expert's rows in place on `x` (B·S, width), in one launch; equal to

        f = rms_factor(x); gemm(x, w_qkv, qkv, row_scale=f, rope=...)   # Q into qkv, K/V to cache rows offset..
        attention(q, k_cache[:, :offset+S], v_cache[:, :offset+S], attn, scale, q_block, k_block)
        gemm(attn, w_o, x, residual=x); f = rms_factor(x)
        gemm(x, w_gate_up, mlp, gated=True, row_scale=f); gemm(mlp, w_down, x, residual=x)

    up to fp32 summation order. x: (B·S, W); w_qkv: ((Hq + 2)·D, W); w_o: (W, Hq·D); w_gate_up: (2F, W); w_down:
    (W, F), all one dtype (Linear layout, the RMSNorm scales folded in); qkv (B·S, (Hq + 2)·D), attn (B·S, Hq·D),
    mlp (B·S, F): scratch outputs; k_cache / v_cache (B, ≥ offset + S, 1, D); cos / sin as `rope_qk`'s;
    q_block (B, S), k_block (B, offset + S) int32 (query i sees key j iff k_block[j] <= q_block[i]).
    Graph-capturable once the workspace is sized (a first call outside capture sizes it)."""
    m, width = x.shape
    c = config or expert_layer_config(width, w_down.shape[1], num_q_heads, head_dim, x.device.type)
    bsz = q_block.shape[0]
    if q_block.dim() != 2 or m != bsz * q_block.shape[1]:
        raise ValueError(f"expert_layer: q_block must be (B, S) with B·S = {m} rows, got {tuple(q_block.shape)}")
    s = q_block.shape[1]
    mlp_dim = w_down.shape[1]
    why = expert_layer_applies(m, width, mlp_dim, num_q_heads, k_cache.shape[2], head_dim, c, x.device.type)
    if why:
        raise ValueError(f"expert_layer does not apply: {why}")
    keys = cache_offset + s
    n_qkv = (num_q_heads + 2) * head_dim
    _check("x", x, (m, width))
    for name, t, shape in (
        ("w_qkv", w_qkv, (n_qkv, width)),
        ("w_o", w_o, (width, num_q_heads * head_dim)),
        ("w_gate_up", w_gate_up, (2 * mlp_dim, width)),
        ("w_down", w_down, (width, mlp_dim)),
        ("qkv", qkv, (m, n_qkv)),
        ("attn", attn, (m, num_q_heads * head_dim)),
        ("mlp", mlp, (m, mlp_dim)),
    ):
        _check(name, t, shape, x.dtype)
    if k_cache.shape[0] != bsz or k_cache.shape[1] < keys or k_cache.shape[3] != head_dim:
        raise ValueError(f"expert_layer: k_cache must be ({bsz}, >= {keys}, 1, {head_dim}), got {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape or k_cache.dtype != x.dtype:
        raise ValueError("expert_layer: k_cache and v_cache must share shape, strides and x's dtype")
    _check("k_block", k_block, (bsz, keys), torch.int32)
    _check("q_block", q_block, (bsz, s), torch.int32)
    try:
        t, cos_b, cos_t = check_rope_inputs(m, cos, sin, k_cache, v_cache, 1, head_dim, cache_offset)
    except ValueError as e:
        raise ValueError(f"expert_layer: {e}") from None
    if t != s:
        raise ValueError(f"expert_layer: RoPE tables have {t} positions per batch, q_block {s}")

    # scratch: attention partials + stats, the two residual GEMMs' split partials; counters: barriers, tiles
    att_tiles = bsz * triton.cdiv(s, c.att_rows // num_q_heads)
    att_units = att_tiles * c.att_splits
    att_part = att_units * c.att_rows * head_dim
    att_stats = att_units * 2 * c.att_rows
    o_part = c.o_split * c.block_m * width
    d_part = c.down_split * c.block_m * width
    ws = workspace or default_workspace(x.device)
    floats = ws.floats(att_part + att_stats + o_part + d_part)
    n_counters = BARRIERS + 1 + att_tiles + width // c.o_cols + width // c.down_cols
    sync = ws.counters(n_counters)
    offsets = (att_part, att_part + att_stats, att_part + att_stats + o_part)  # stats, O, down partials
    count_offsets = (BARRIERS + 1, BARRIERS + 1 + att_tiles, BARRIERS + 1 + att_tiles + width // c.o_cols)

    if x.device.type == "cpu" or _interpreting():
        # the interpreter runs programs one after another: one program walks every unit, no barrier waits
        programs, prefetch = 1, 0
    else:  # one program per SM (a meta tensor, compile_check's dry run, counts an H200's 132)
        programs, prefetch = c.programs or _num_sms(x.device), c.prefetch
    launch(expert_layer_kernel, (programs,), x)(
        x, w_qkv, w_o, w_gate_up, w_down, qkv, attn, mlp, k_cache, v_cache, cos, sin, q_block, k_block, floats, sync,
        m, bsz, s, keys, int(cache_offset), float(eps), float(q_scale), float(scale) * LOG2E, x.element_size(),
        x.stride(0), w_qkv.stride(0), w_o.stride(0), w_gate_up.stride(0), w_down.stride(0), qkv.stride(0),
        attn.stride(0), mlp.stride(0), *k_cache.stride()[:3], cos_b, cos_t, *q_block.stride(), *k_block.stride(),
        0, *offsets, *count_offsets,
        WIDTH=width, MLP=mlp_dim, HEAD_DIM=head_dim, Q_HEADS=num_q_heads, BLOCK_M=c.block_m, BLOCK_K=c.block_k,
        QKV_HALF=c.qkv_half, ATT_ROWS=c.att_rows, ATT_KEYS=c.att_keys, ATT_SPLITS=c.att_splits, O_COLS=c.o_cols,
        O_SPLIT=c.o_split, GATE_COLS=c.gate_cols, DOWN_COLS=c.down_cols, DOWN_SPLIT=c.down_split,
        PREFETCH=prefetch, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PHASES=c.phases,
        POLL_LOAD=c.poll_load and programs > 1,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return x
