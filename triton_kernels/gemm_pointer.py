"""The pointer-load GEMM kernel (`cp.async` tiles, any alignment) and its split-K combine kernel; `gemm.py` launches
them where the TMA kernel (`gemm_tma.py`) does not apply.

Split-K writes fp32 partials to a workspace and sums them in split order (deterministic whatever the arrival
order), two ways (`config.combine`): 0, one kernel: each program bumps its tile's counter and the program that
arrives last sums the partials, runs the epilogue and resets the counter; 1, two kernels: the partial kernel only
stores, and `gemm_combine_kernel` sums and runs the epilogue over many small tiles, so no single SM reads a whole
tile's partials. Both give bit-identical results.

With RoPE (`ROPE_HALF` > 0) each tile column pairs the weight rows `h*D + i` and `h*D + D/2 + i` of one head (two
accumulators, like the gated [gate; up] pair), so the rotation partners meet in one program with no weight or cache
layout change.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemm_epilogue import epilogue_store, rope_tables, row_scales
from .gemm_tma import tile_coords
from .pdl import pdl_enter

__all__ = ["combine_tile", "gemm_combine_kernel", "gemm_epilogue_kernel"]


@triton.jit
def gemm_epilogue_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    out_scale_ptr,
    partial_ptr,
    counter_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    K,
    alpha,
    res_period,
    rope_t,
    cache_offset,
    q_scale,
    stride_am,
    stride_wn,
    stride_om,
    stride_rm,
    stride_cos_b,
    stride_cos_t,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_COMBINE: tl.constexpr = False,  # split-K partials only; gemm_combine_kernel finishes
    ROPE_HALF: tl.constexpr = 0,  # > 0: N counts pair columns (h*D + i, h*D + D/2 + i), RoPE epilogue (D = 2*HALF)
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (pdl.py)
    HAS_OUT_SCALE: tl.constexpr = False,  # output columns times out_scale before the residual (π0.5's gate)
    MOD_ROWS: tl.constexpr = 0,  # > 0: bias / out_scale hold a row per MOD_ROWS output rows, MOD_STRIDE apart
    MOD_STRIDE: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)  # grouped order: weight tiles reused from L2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N read a valid row instead of masking (their results are never stored).
    rows_a = offs_m % M
    rows_w = offs_n % N
    if ROPE_HALF > 0:  # pair column p = (head, i): weight rows head*D + i and head*D + HALF + i
        rows_w = (rows_w // ROPE_HALF) * (2 * ROPE_HALF) + rows_w % ROPE_HALF
        up_offset = ROPE_HALF * stride_wn
    else:
        up_offset = N * stride_wn
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0  # two accumulators: [gate; up] or the two halves of a head
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + (k_start + offs_k)[:, None]  # (BLOCK_K, BLOCK_N) view of w.T
    pdl_enter(USE_PDL)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc  # the second accumulator exists only when PAIRED
    if PAIRED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rope_cos = acc  # (placeholders unless ROPE_HALF > 0)
    rope_sin = acc
    # RoPE tables of a small tile (the expert's), loaded now: their latency hides behind the K loop; a wide tile
    # (the VLM's, compute-bound) loads them in the epilogue instead of holding 2 * BLOCK_M * BLOCK_N registers
    PREFETCH_ROPE: tl.constexpr = ROPE_HALF > 0 and SPLIT_K == 1 and BLOCK_M * BLOCK_N <= 4096
    if PREFETCH_ROPE:
        rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t,
                                         ROPE_HALF, BLOCK_N)  # fmt: skip
    # Unmasked main loop (masks that depend on the loop index can stop the pipeliner), then one masked tail step.
    k_len = tl.minimum(k_per_split, K - k_start)
    k_main = k_per_split
    if not EVEN_K:
        k_main = (k_len // BLOCK_K) * BLOCK_K
    for _k in range(0, k_main, BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if PAIRED:
            acc_up = tl.dot(a, tl.load(w_ptrs + up_offset), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EVEN_K:
        k_tail = k_len - k_main  # in [0, BLOCK_K); <= 0 for splits past the end of K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_tail, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_tail, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if PAIRED:
            w_up = tl.load(w_ptrs + up_offset, mask=offs_k[:, None] < k_tail, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)

    if SPLIT_K == 1:
        rs = row_scales(row_scale_ptr, offs_m, M, HAS_ROW_SCALE, BLOCK_M)
        if ROPE_HALF > 0 and not PREFETCH_ROPE:
            rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b,
                                             stride_cos_t, ROPE_HALF, BLOCK_N)  # fmt: skip
        epilogue_store(
            acc, acc_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
            stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
            stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, ROPE_HALF,
            ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, out_scale_ptr, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
        )  # fmt: skip
    else:
        # Partials: (SPLIT_K, M, n_acc) fp32 with n_acc = N, or 2N (first accumulator's columns, then the second's)
        # when paired.
        n_acc = N
        if PAIRED:
            n_acc = 2 * N
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * n_acc + tile_offs, acc, mask=mask)
        if PAIRED:
            tl.store(partial_ptr + pid_k * M * n_acc + N + tile_offs, acc_up, mask=mask)
        if not SPLIT_COMBINE:
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            tile = pid_m * num_pid_n + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total_up = total
                if PAIRED:
                    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):  # fixed order: the sum does not depend on who arrived last
                    offs = partial_ptr + s * M * n_acc + tile_offs
                    total += tl.load(offs, mask=mask, other=0.0, cache_modifier=".cg")
                    if PAIRED:
                        total_up += tl.load(offs + N, mask=mask, other=0.0, cache_modifier=".cg")
                rs = row_scales(row_scale_ptr, offs_m, M, HAS_ROW_SCALE, BLOCK_M)
                if ROPE_HALF > 0:
                    rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b,
                                                     stride_cos_t, ROPE_HALF, BLOCK_N)  # fmt: skip
                epilogue_store(
                    total, total_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha,
                    res_period, stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale,
                    stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL,
                    RESIDUAL_PERIODIC, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, out_scale_ptr, HAS_OUT_SCALE,
                    MOD_ROWS, MOD_STRIDE,
                )  # fmt: skip
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch / graph replay


@triton.jit
def gemm_combine_kernel(
    partial_ptr,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    out_scale_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    alpha,
    res_period,
    rope_t,
    cache_offset,
    q_scale,
    stride_om,
    stride_rm,
    stride_cos_b,
    stride_cos_t,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ROPE_HALF: tl.constexpr = 0,
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
    HAS_OUT_SCALE: tl.constexpr = False,
    MOD_ROWS: tl.constexpr = 0,
    MOD_STRIDE: tl.constexpr = 0,
):
    """Sum the (SPLIT_K, M, n_acc) fp32 partials of a split-K GEMM kernel in split order, run the epilogue."""
    pdl_enter(USE_PDL)
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    n_acc = N
    if PAIRED:
        n_acc = 2 * N
    tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = total
    if PAIRED:
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # unrolled: every split's load is in flight at once
        total += tl.load(partial_ptr + s * M * n_acc + tile_offs, mask=mask, other=0.0)
        if PAIRED:
            total_up += tl.load(partial_ptr + s * M * n_acc + N + tile_offs, mask=mask, other=0.0)
    rs = row_scales(row_scale_ptr, offs_m, M, HAS_ROW_SCALE, BLOCK_M)
    rope_cos = total  # (placeholders unless ROPE_HALF > 0)
    rope_sin = total
    if ROPE_HALF > 0:
        rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t,
                                         ROPE_HALF, BLOCK_N)  # fmt: skip
    epilogue_store(
        total, total_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
        stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
        stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, ROPE_HALF,
        ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, out_scale_ptr, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
    )  # fmt: skip


def combine_tile(m: int, n: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split-K combine kernel: 16-row tiles, the widest that still gives two
    programs per SM (64x1024: 16x32 tiles, 128 programs)."""
    block_n = next((bn for bn in (128, 64) if triton.cdiv(m, 16) * triton.cdiv(n, bn) >= 2 * num_sms), 32)
    return 16, block_n, 2 if block_n == 32 else 4
