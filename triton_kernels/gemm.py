"""GEMM against a PyTorch-Linear weight with the epilogues π0 needs, optionally split over K.

`out = residual + alpha * act(row_scale * (a @ w.T) + bias)`, or with `gated` the GeGLU of a fused [gate; up]
weight. The per-row scale is how RMSNorm fuses into the next GEMM (its scale vector folded into `w`), `alpha` and a
residual aliasing `out` give the Euler step `x += dt * v` and in-place residual adds, a periodic residual adds
SigLIP's position embedding to every view.

Split-K (for the action expert's 51..64-row GEMMs, which cannot fill 132 SMs otherwise) writes fp32 partials to a
workspace and sums them in split order (deterministic whatever the arrival order), two ways (`config.combine`):
0, one kernel: each program bumps its tile's counter and the program that arrives last sums the partials, runs the
epilogue and resets the counter; 1, two kernels: the partial kernel only stores, and
`gemm_combine_kernel` sums and runs the epilogue over many small tiles, so no single SM reads a whole tile's
partials. Both give bit-identical results.

`rms_out` makes the split-K combine kernel (one program per row then) also write the RMSNorm factor of the rows it
stores, which the next GEMM takes as `row_scale`: the norm after a split-K GEMM costs no launch of its own.

Two fusions remove the action expert's small kernels (off unless asked for):
`rms_eps=eps` computes each A row's RMSNorm factor `rsqrt(mean(a**2) + eps)` from the A tiles the K loop loads
anyway (sum of squares in fp32; with split-K the per-split sums are reduced in split order with the partials) and
applies it where `row_scale` is applied: `rms_factor` + `row_scale` in one kernel. `rope=dict(...)` (the arguments
of `rope_qk` but `qkv`) makes a fused-QKV GEMM rotate Q in place and write rotated K and plain V into the KV cache:
each tile column pairs the weight rows `h*D + i` and `h*D + D/2 + i` of one head (two accumulators, like the gated
[gate; up] pair), so the rotation partners meet in one program with no weight or cache layout change.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .gemm_epilogue import epilogue_store, rope_tables, row_factors
from .gemm_tma import STREAM_K, gemm_tma, stream_k_need, tile_coords, tma_applies
from .launch_configs import GemmConfig, gemm_config
from .norms import rms_factor, row_launch_params
from .pdl import launch, pdl_enter, pdl_settings, prefetch_rows_l2
from .rope import check_rope_inputs
from .workspace import Workspace, default_workspace

__all__ = ["ACTIVATIONS", "gemm"]

ACTIVATIONS = {None: 0, "gelu_tanh": 1, "silu": 2}
RMS_COMBINE_MAX_N = 4096  # widest row the combine kernel takes whole for `rms_out` (registers: 4096 fp32 / 256 threads)
_WARNED_UNALIGNED: set[tuple[int, int, int]] = set()


@triton.jit
def _sum_squares(a_ptrs, offs_k, k_valid):
    """fp32 sum of squares of an A tile's rows (columns < k_valid), from a separate register load (".cg", so it is
    not merged with the tile the dot reads). Summing the dot's own tile gave run-to-run differences on the H200
    (two identical launches differed; suspected: the pipelined wgmma loop recycles that shared-memory stage)."""
    a = tl.load(a_ptrs, mask=offs_k[None, :] < k_valid, other=0.0, cache_modifier=".cg").to(tl.float32)
    return tl.sum(a * a, axis=1)


@triton.jit
def gemm_epilogue_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    partial_ptr,
    counter_ptr,
    ssq_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    K,
    alpha,
    res_period,
    eps,
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
    ssq_out_ptr,
    stride_ssq_in,
    stride_ssq_out,
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
    RMS_NORM: tl.constexpr = False,  # row scale = rsqrt(mean(a**2) + eps) of A's rows, from the tiles loaded here
    ROPE_HALF: tl.constexpr = 0,  # > 0: N counts pair columns (h*D + i, h*D + D/2 + i), RoPE epilogue (D = 2*HALF)
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    SSQ_IN: tl.constexpr = 0,  # > 0: the row scale is the RMS factor from K/16 partial sums at row_scale_ptr
    SSQ_OUT: tl.constexpr = False,  # write per-16-column sums of squares of the output to ssq_out_ptr
    USE_PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (pdl.py)
    PREFETCH_W: tl.constexpr = False,  # with PDL: prefetch this program's weight slice into L2 before the wait
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
    SCALE_ROWS: tl.constexpr = HAS_ROW_SCALE or RMS_NORM or SSQ_IN > 0
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + (k_start + offs_k)[:, None]  # (BLOCK_K, BLOCK_N) view of w.T
    if PREFETCH_W:  # no kernel writes weights: stream them towards L2 while the previous kernel finishes
        k_len_w = tl.minimum(k_per_split, K - k_start)
        if k_len_w > 0:
            w_rows = w_ptr + rows_w * stride_wn + k_start
            nbytes = k_len_w * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            prefetch_rows_l2(w_rows, nbytes)
            if PAIRED:
                prefetch_rows_l2(w_rows + up_offset, nbytes)
    pdl_enter(USE_PDL)
    rs_in = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SSQ_IN > 0 and SPLIT_K == 1:  # before the K loop: its loads overlap the pipeline fill, BLOCK_M floats stay live
        rs_in = row_factors(row_scale_ptr, rs_in, offs_m, M, K, eps, stride_ssq_in, False, False, SSQ_IN)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc  # the second accumulator exists only when PAIRED
    if PAIRED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum of squares of A's rows (RMS_NORM only)
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
        if RMS_NORM:  # from its own (L2-hit) load: see _sum_squares
            ssq += _sum_squares(a_ptrs, offs_k, BLOCK_K)
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
        if RMS_NORM:
            ssq += _sum_squares(a_ptrs, offs_k, k_tail)

    if SPLIT_K == 1:
        if SSQ_IN > 0:
            rs = rs_in
        else:
            rs = row_factors(row_scale_ptr, ssq, offs_m, M, K, eps, stride_ssq_in, HAS_ROW_SCALE, RMS_NORM, 0)
        if ROPE_HALF > 0 and not PREFETCH_ROPE:
            rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b,
                                             stride_cos_t, ROPE_HALF, BLOCK_N)  # fmt: skip
        epilogue_store(
            acc, acc_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
            stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
            stride_kv_h, ssq_out_ptr, stride_ssq_out, HAS_BIAS, SCALE_ROWS, ACTIVATION,
            GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, SSQ_OUT,
        )  # fmt: skip
    else:
        # Partials: (SPLIT_K, M, n_acc) fp32 with n_acc = N, or 2N (first accumulator's columns, then the second's)
        # when paired. RMS_NORM: sums of squares (SPLIT_K, SSQ_COLS, M) after them: one copy per column tile for the
        # in-kernel merge (each tile's last program reads the copies its own splits wrote: no cross-tile ordering),
        # one copy (column tile 0's) for the combine kernel, which starts after this kernel ends.
        n_acc = N
        if PAIRED:
            n_acc = 2 * N
        mask_m = offs_m < M
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * n_acc + tile_offs, acc, mask=mask)
        if PAIRED:
            tl.store(partial_ptr + pid_k * M * n_acc + N + tile_offs, acc_up, mask=mask)
        if RMS_NORM:
            if SPLIT_COMBINE:
                if pid_n == 0:
                    tl.store(ssq_ptr + pid_k * M + offs_m, ssq, mask=mask_m)
            else:
                tl.store(ssq_ptr + (pid_k * num_pid_n + pid_n) * M + offs_m, ssq, mask=mask_m)
        if not SPLIT_COMBINE:
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            tile = pid_m * num_pid_n + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total_up = total
                if PAIRED:
                    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                ssq_total = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for s in range(0, SPLIT_K):  # fixed order: the sum does not depend on who arrived last
                    offs = partial_ptr + s * M * n_acc + tile_offs
                    total += tl.load(offs, mask=mask, other=0.0, cache_modifier=".cg")
                    if PAIRED:
                        total_up += tl.load(offs + N, mask=mask, other=0.0, cache_modifier=".cg")
                    if RMS_NORM:
                        ssq_offs = ssq_ptr + (s * num_pid_n + pid_n) * M + offs_m
                        ssq_total += tl.load(ssq_offs, mask=mask_m, other=0.0, cache_modifier=".cg")
                rs = row_factors(row_scale_ptr, ssq_total, offs_m, M, K, eps, stride_ssq_in, HAS_ROW_SCALE, RMS_NORM,
                                 SSQ_IN)  # fmt: skip
                if ROPE_HALF > 0:
                    rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b,
                                                     stride_cos_t, ROPE_HALF, BLOCK_N)  # fmt: skip
                epilogue_store(
                    total, total_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha,
                    res_period, stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale,
                    stride_kv_b, stride_kv_t, stride_kv_h, ssq_out_ptr, stride_ssq_out, HAS_BIAS, SCALE_ROWS,
                    ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC,
                    ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, SSQ_OUT,
                )  # fmt: skip
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch / graph replay


@triton.jit
def gemm_combine_kernel(
    partial_ptr,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    ssq_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    K,
    alpha,
    res_period,
    eps,
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
    ssq_out_ptr,
    stride_ssq_in,
    stride_ssq_out,
    rms_out_ptr,
    rms_out_eps,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RMS_NORM: tl.constexpr = False,
    ROPE_HALF: tl.constexpr = 0,
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    SSQ_IN: tl.constexpr = 0,
    SSQ_OUT: tl.constexpr = False,
    RMS_OUT: tl.constexpr = False,  # the tile spans whole rows (BLOCK_N >= N): also write their RMSNorm factor
    USE_PDL: tl.constexpr = 0,
):
    """Sum the (SPLIT_K, M, n_acc) fp32 partials of `gemm_epilogue_kernel` in split order, run the epilogue; with
    RMS_OUT, also `rms_factor` of the stored rows (so the next norm needs no launch of its own)."""
    pdl_enter(USE_PDL)
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0
    SCALE_ROWS: tl.constexpr = HAS_ROW_SCALE or RMS_NORM or SSQ_IN > 0
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    n_acc = N
    if PAIRED:
        n_acc = 2 * N
    tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = total
    if PAIRED:
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ssq_total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # unrolled: every split's load is in flight at once
        total += tl.load(partial_ptr + s * M * n_acc + tile_offs, mask=mask, other=0.0)
        if PAIRED:
            total_up += tl.load(partial_ptr + s * M * n_acc + N + tile_offs, mask=mask, other=0.0)
        if RMS_NORM:
            ssq_total += tl.load(ssq_ptr + s * M + offs_m, mask=mask_m, other=0.0)
    rs = row_factors(row_scale_ptr, ssq_total, offs_m, M, K, eps, stride_ssq_in, HAS_ROW_SCALE, RMS_NORM, SSQ_IN)
    rope_cos = total  # (placeholders unless ROPE_HALF > 0)
    rope_sin = total
    if ROPE_HALF > 0:
        rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t,
                                         ROPE_HALF, BLOCK_N)  # fmt: skip
    y = epilogue_store(
        total, total_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
        stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
        stride_kv_h, ssq_out_ptr, stride_ssq_out, HAS_BIAS, SCALE_ROWS, ACTIVATION,
        GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, SSQ_OUT,
    )  # fmt: skip
    if RMS_OUT:  # rms_factor's formula on the values as stored (rounded to out's dtype), as it would read them
        v = tl.where(mask, y.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        factor = tl.math.rsqrt(tl.sum(v * v, axis=1) / N + rms_out_eps)
        tl.store(rms_out_ptr + offs_m, factor, mask=mask_m)


def combine_tile(m: int, n: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split-K combine kernel: 16-row tiles, the widest that still gives two
    programs per SM (64x1024: 16x32 tiles, 128 programs)."""
    block_n = next((bn for bn in (128, 64) if triton.cdiv(m, 16) * triton.cdiv(n, bn) >= 2 * num_sms), 32)
    return 16, block_n, 2 if block_n == 32 else 4


def workspace_need(m: int, n: int, cfg: GemmConfig, *, paired: bool = False, rms: bool = False,
                   k: int | None = None, device: torch.device | None = None) -> tuple[int, int]:  # fmt: skip
    """(floats, counters) of workspace a launch with `cfg` uses; `n` counts tile columns (pair columns when
    `paired`: gated, or RoPE's head halves). Split-K partials, plus the RMS sums of squares when `rms`; mode 4
    (`cfg.tma` 4, `gemm_tma.stream_k_need`): a partial tile and a flag a program where tiles are shared (K and the
    device set the program count; without them, the current CUDA device's SMs or the interpreter's count)."""
    if cfg.tma == STREAM_K and not rms:
        dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        _, floats, counters = stream_k_need(m, n, k or 1 << 30, cfg, paired, dev)
        return floats, counters
    if cfg.split_k == 1:
        return 0, 0
    tiles_n = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(m, cfg.block_m) * tiles_n
    floats = cfg.split_k * m * n * (2 if paired else 1)
    if rms:
        floats += cfg.split_k * m * (1 if cfg.combine == 1 else tiles_n)
    return floats, 0 if cfg.combine == 1 else tiles


def _check_ssq(name: str, t: torch.Tensor, groups: int, m: int) -> None:
    if t.shape != (groups, m) or t.dtype != torch.float32 or t.stride(1) != 1:
        raise ValueError(f"{name} must be float32 ({groups}, {m}) with last stride 1 (per-16-column sums of squares "
                         f"of {m} rows), got {t.dtype} {tuple(t.shape)} strides {t.stride()}")  # fmt: skip


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols:
        raise ValueError(f"{name} must be ({rows}, {cols}), got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have last stride 1, got strides {t.stride()}")


ROPE_KEYS = ("cos", "sin", "k_cache", "v_cache", "num_q_heads", "num_kv_heads", "head_dim")


def _rope_args(rope: dict, out: torch.Tensor) -> tuple[tuple, dict]:
    """Checks `rope` (rope_qk's arguments but qkv) against `out`; returns the kernel's runtime args and constexprs."""
    missing = [k for k in ROPE_KEYS if k not in rope]
    unknown = set(rope) - set(ROPE_KEYS) - {"cache_offset", "q_scale"}
    if missing or unknown:
        raise ValueError(
            f"rope needs {list(ROPE_KEYS)} (+ cache_offset, q_scale); missing {missing}, unknown {unknown}"
        )
    hq, hkv, d = rope["num_q_heads"], rope["num_kv_heads"], rope["head_dim"]
    cos, sin, k_cache, v_cache = rope["cos"], rope["sin"], rope["k_cache"], rope["v_cache"]
    offset, q_scale = rope.get("cache_offset", 0), rope.get("q_scale", 1.0)
    if hq < 0 or hkv < 1:
        raise ValueError(f"rope: num_q_heads must be >= 0 and num_kv_heads >= 1, got {hq}, {hkv}")
    if out.shape[1] != (hq + 2 * hkv) * d:
        raise ValueError(f"rope: out has {out.shape[1]} columns, expected ({hq} + 2 * {hkv}) * {d}")
    try:  # what rope_qk checks too
        t, cos_b, cos_t = check_rope_inputs(out.shape[0], cos, sin, k_cache, v_cache, hkv, d, offset)
    except ValueError as e:
        raise ValueError(f"rope: {e}") from None
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("rope: k_cache and v_cache must share strides and dtype")
    half = d // 2
    args = (cos, sin, k_cache, v_cache, t, int(offset), float(q_scale), cos_b, cos_t, *k_cache.stride()[:3])
    return args, dict(ROPE_HALF=half, ROPE_Q_HEADS=hq, ROPE_KV_HEADS=hkv)


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    activation: str | None = None,
    gated: bool = False,
    alpha: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_period: int | None = None,
    rms_eps: float | None = None,
    rope: dict | None = None,
    ssq_in: torch.Tensor | None = None,
    ssq_out: torch.Tensor | None = None,
    rms_out: torch.Tensor | None = None,
    rms_out_eps: float | None = None,
    config: GemmConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """`out = residual + alpha * epilogue(a @ w.T)`, accumulated in fp32, stored in `out.dtype`.

    a: (M, K), last stride 1 (any row stride); w: (N_w, K) Linear layout, last stride 1, same dtype as `a`.
    Epilogue, in this order: `* row_scale[:, None]` (fp32 (M,)), `+ bias` ((N_w,)), then
    `act(y)` (activation in None / "gelu_tanh" / "silu"), or if `gated` (w = [gate rows; up rows], N_w = 2N)
    `act(gate) * up` with act defaulting to gelu_tanh; `* alpha`; `+ residual` ((M, N), or (P, N) read at row
    r % P with `residual_period=P`; may alias `out`). out: (M, N), last stride 1, any dtype.
    rms_eps: instead of `row_scale`, scale row r by `rsqrt(mean(a[r]**2) + rms_eps)` computed here from A (fp32
    sum of squares): equal to `rms_factor(a, f, rms_eps)` then `row_scale=f`, in one kernel.
    ssq_out: fp32 (N / 16, M) (last stride 1, any row stride; N a multiple of 16): also write, per row, the sums of
    squares of the stored output over each 16 columns. ssq_in (with rms_eps, K a multiple of 16): the RMS factor of
    A's rows from such partial sums, (K / 16, M), written by the GEMM that produced `a` — so RMSNorm costs neither a
    launch nor a second pass over A; equal to `rms_factor` up to fp32 summation order.
    rms_out (fp32 (M,), contiguous) with rms_out_eps: also write the RMSNorm factor of the stored output rows,
    `rms_factor(out, rms_out, rms_out_eps)` — the next GEMM's `row_scale`. With a split-K config that has a combine
    kernel (`config.combine == 1`), that kernel computes it while it holds the rows (one program a row, no extra
    launch); otherwise an `rms_factor` launch follows the GEMM.
    rope: a dict of `rope_qk`'s arguments but qkv (cos, sin, k_cache, v_cache, num_q_heads, num_kv_heads,
    head_dim, cache_offset=0, q_scale=1.0), for a fused [Q; K; V] weight (N_w = (Hq + 2 Hkv) D): equal to this GEMM
    then `rope_qk(out, **rope)` (Q rotated in `out`, rotated K and plain V in the cache rows), except that the K and
    V columns of `out` are not written and there is one rounding (the fp32 accumulator is rotated). Only with
    row_scale / rms_eps (no bias, activation, gating, alpha or residual); k_cache and v_cache share strides.
    Fast path: row strides of `a` and `w` multiples of 8 elements (16 bytes), so pad odd K (SigLIP's 588) in the
    allocation and pass `[:, :K]` views; other strides work but do not pipeline.
    config: launch config (default: the GPU's table or the heuristic; with `rope`, block_n counts pair columns as
    for `gated`; `config.tma` > 0 runs `gemm_tma`'s TMA kernel where `gemm_tma.tma_applies`: no rms_eps / ssq_in,
    split-K only with the combine kernel, RoPE only with BLOCK_N dividing the half head, 16-byte aligned operands;
    elsewhere the pointer kernel with the same tiles). workspace: split-K scratch
    (default: the device's shared one). Launch-only (no allocation once
    the workspace is sized, no host sync): graph-capturable.
    """
    m, k = a.shape
    n_w = w.shape[0]
    n = n_w // 2 if gated else n_w
    _check_rows("a", a, m, k)
    _check_rows("w", w, n_w, k)
    _check_rows("out", out, m, n)
    if gated and n_w % 2:
        raise ValueError(f"gated GEMM needs an even number of weight rows, got {n_w}")
    if a.dtype != w.dtype:
        raise ValueError(f"a and w must share a dtype, got {a.dtype} and {w.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    act = ACTIVATIONS["gelu_tanh" if gated and activation is None else activation]
    if bias is not None and (bias.shape != (n_w,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous ({n_w},), got {tuple(bias.shape)}")
    if row_scale is not None and (
        row_scale.shape != (m,) or row_scale.dtype != torch.float32 or row_scale.stride(0) != 1
    ):
        raise ValueError(f"row_scale must be contiguous float32 ({m},), got {row_scale.dtype} {tuple(row_scale.shape)}")
    if rms_eps is not None and row_scale is not None:
        raise ValueError("give row_scale or rms_eps, not both")
    if ssq_in is not None:
        if rms_eps is None or k % 16:
            raise ValueError(f"ssq_in needs rms_eps and K a multiple of 16, got rms_eps={rms_eps}, K={k}")
        _check_ssq("ssq_in", ssq_in, k // 16, m)
    if ssq_out is not None:
        if n % 16 or rope is not None:
            raise ValueError(f"ssq_out needs N a multiple of 16 and no rope, got N={n}, rope={rope is not None}")
        _check_ssq("ssq_out", ssq_out, n // 16, m)
    if rms_out is not None:
        if rms_out_eps is None or rope is not None:
            raise ValueError(f"rms_out needs rms_out_eps and no rope, got rms_out_eps={rms_out_eps}, "
                             f"rope={rope is not None}")  # fmt: skip
        if rms_out.shape != (m,) or rms_out.dtype != torch.float32 or rms_out.stride(0) != 1:
            raise ValueError(f"rms_out must be contiguous float32 ({m},), got {rms_out.dtype} {tuple(rms_out.shape)}")
    elif rms_out_eps is not None:
        raise ValueError("rms_out_eps given without rms_out")
    in_loop_rms = rms_eps is not None and ssq_in is None
    if residual is not None:
        _check_rows("residual", residual, residual_period or m, n)
    elif residual_period is not None:
        raise ValueError("residual_period given without residual")
    rope_args, rope_flags = (
        (out, out, out, out, 1, 0, 1.0, 0, 0, 0, 0, 0),
        dict(ROPE_HALF=0, ROPE_Q_HEADS=0, ROPE_KV_HEADS=0),
    )
    if rope is not None:
        if gated or bias is not None or activation is not None or alpha != 1.0 or residual is not None:
            raise ValueError("rope takes only row_scale / rms_eps: no bias, activation, gated, alpha or residual")
        rope_args, rope_flags = _rope_args(rope, out)
    paired = gated or rope is not None
    n_cols = n // 2 if rope is not None else n  # tile columns: output columns, or (head, i) pairs with rope

    if a.is_cuda and (a.stride(0) % 8 or w.stride(0) % 8) and (m, n, k) not in _WARNED_UNALIGNED:
        _WARNED_UNALIGNED.add((m, n, k))
        warnings.warn(
            f"gemm {m}x{n}x{k}: row strides {a.stride(0)}, {w.stride(0)} are not multiples of 8 elements, so loads "
            "cannot be 16-byte vectors and the K loop will not pipeline; allocate rows padded to a multiple of 8 "
            "and pass a [:, :K] view",
            stacklevel=2,
        )
    cfg = config or gemm_config(
        m, n, k, gated=gated, dtype=a.dtype, device=a.device, rms=in_loop_rms, rope=rope is not None
    )
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n)
    combine = cfg.split_k > 1 and cfg.combine == 1
    partials = counters = ssq = out  # unused without split-K
    use_tma = tma_applies(a, w, cfg, rope_half=rope_flags["ROPE_HALF"], fused_rms=rms_eps is not None)
    sk_counters = None
    if use_tma and cfg.tma == STREAM_K:  # partial tiles and flags where programs share a tile (split_k > 1)
        _, n_floats, n_counters = stream_k_need(m, n_cols, k, cfg, paired, a.device)
        ws = workspace or default_workspace(a.device)
        partials, sk_counters = ws.floats(n_floats), ws.counters(n_counters)
    elif cfg.split_k > 1:
        ws = workspace or default_workspace(a.device)
        n_floats, n_counters = workspace_need(m, n_cols, cfg, paired=paired, rms=in_loop_rms)
        floats = ws.floats(n_floats)
        n_partials = cfg.split_k * m * n_cols * (2 if paired else 1)
        partials = floats[:n_partials]
        ssq = floats[n_partials:] if in_loop_rms else out
        counters = out if combine else ws.counters(n_counters)
    dummy = out
    epilogue_args = (
        bias if bias is not None else dummy,
        row_scale if row_scale is not None else (ssq_in if ssq_in is not None else dummy),
        residual if residual is not None else dummy,
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_ROW_SCALE=row_scale is not None,
        ACTIVATION=act,
        GATED=gated,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_PERIODIC=residual_period is not None,
    )
    fused = dict(RMS_NORM=in_loop_rms, SSQ_IN=k // 16 if ssq_in is not None else 0, SSQ_OUT=ssq_out is not None,
                 **rope_flags)  # fmt: skip
    ssq_args = (
        ssq_out if ssq_out is not None else dummy,
        ssq_in.stride(0) if ssq_in is not None else 0,
        ssq_out.stride(0) if ssq_out is not None else 0,
    )
    eps = float(rms_eps) if rms_eps is not None else 0.0
    cos, sin, k_cache, v_cache, rope_t, cache_offset, q_scale, *rope_strides = rope_args
    if use_tma:
        gemm_tma(a, w, out, cfg, n_cols, epilogue_args, partials, rope_args, ssq_out, alpha, residual_period,
                 residual.stride(0) if residual is not None else 0, flags, rope_flags, sk_counters)  # fmt: skip
    else:
        # one row tile: the GEMM streams its weights (memory-bound), so fetch them while the previous kernel finishes
        prefetch_w = (
            pdl_settings(out)[1] and triton.cdiv(m, cfg.block_m) == 1 and k % 8 == 0 and w.stride(0) % 8 == 0
            and w.data_ptr() % 16 == 0
        )  # fmt: skip
        launch(gemm_epilogue_kernel, (num_tiles, cfg.split_k), out)(
            a, w, out, *epilogue_args, partials, counters, ssq, cos, sin, k_cache, v_cache,
            m, n_cols, k, float(alpha), residual_period or m, eps, rope_t, cache_offset, q_scale,
            a.stride(0), w.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0, *rope_strides,
            *ssq_args,
            **flags,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k,
            GROUP_M=cfg.group_m,
            EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
            DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            SPLIT_COMBINE=combine,
            **fused,
            PREFETCH_W=prefetch_w,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    rms_in_combine = combine and rms_out is not None and triton.next_power_of_2(n_cols) <= RMS_COMBINE_MAX_N
    if combine:
        cbm, cbn, cwarps = combine_tile(m, n_cols)
        if rms_in_combine:  # one program a row, as in rms_factor: the row's factor needs all of its columns
            row = row_launch_params(n_cols)
            cbm, cbn, cwarps = 1, row["BLOCK_N"], row["num_warps"]
        launch(gemm_combine_kernel, (triton.cdiv(m, cbm), triton.cdiv(n_cols, cbn)), out)(
            partials, out, *epilogue_args, ssq, cos, sin, k_cache, v_cache, m, n_cols, k, float(alpha),
            residual_period or m, eps, rope_t, cache_offset, q_scale,
            out.stride(0), residual.stride(0) if residual is not None else 0, *rope_strides, *ssq_args,
            rms_out if rms_in_combine else dummy, float(rms_out_eps or 0.0),
            **flags, BLOCK_M=cbm, BLOCK_N=cbn, SPLIT_K=cfg.split_k, **fused, RMS_OUT=rms_in_combine,
            num_warps=cwarps, num_stages=1,
        )  # fmt: skip
    if rms_out is not None and not rms_in_combine:
        rms_factor(out, rms_out, rms_out_eps)
    return out
