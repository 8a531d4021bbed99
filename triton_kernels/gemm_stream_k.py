"""Stream-K GEMM (`config.tma = 4`): the TMA kernel's tiles, with the last, partly filled wave's K loop spread over
every SM.

Why: a GEMM of T output tiles on P SMs runs ceil(T / P) waves of whole tiles. Where T is not a multiple of P the
last wave leaves SMs idle: SigLIP's fc2 at 16 images (4096 x 1152, 288 tiles of 128 x 128 on 132 SMs) runs three
waves for 2.18 waves of work, 73% of the machine, and the action expert's down projection at 32 rows (104 tiles)
leaves 28 SMs idle for its whole K. cuBLAS does not lose that time (fc2: 52.8 µs against our 91.9 in the H200
table). Split-K fixes it only by splitting every tile, and pays a partial round trip for all of them.

The schedule (Osama et al., "Stream-K", PPoPP 2023; the "data-parallel + one stream-K wave" hybrid):
- `sk_tiles = T mod P` tiles (all T when T < P) form the stream-K region: their `sk_tiles * I` K iterations
  (I = ceil(K / BLOCK_K) a tile) are split into `sk_programs = min(P, sk_tiles * I)` contiguous, equal ranges, one a
  program, each at least one iteration. A range covers the end of one tile, whole tiles, the start of another.
- the remaining tiles, a multiple of P, run data-parallel: each program walks its share in grouped order after its
  stream-K range.
- a tile covered by one program runs the epilogue directly. A tile shared by several programs: each writes its fp32
  partial into its own slot (program + tile, unique because ranges are contiguous), bumps the tile's counter, and
  the program that arrives last sums the slots in program order (the result does not depend on arrival order),
  runs the epilogue and resets the counter for the next launch or graph replay, as the pointer kernel's split-K
  merge does.

Every program of the grid is resident at once (P programs, one a SM), and no program waits on another: the last
arrival merges, so the kernel cannot deadlock whatever the scheduling. The epilogue is `_whole_tile_epilogue`, the
TMA kernel's, so every epilogue (bias, GELU, GeGLU, RoPE into the cache, residual, alpha, output scale) is exact
as there; only the fp32 summation order of a shared tile differs (deterministic, replay to replay).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .float32_dot import dot_precision
from .gemm_tma import _tile_rows, _whole_tile_epilogue
from .pdl import launch, pdl_enter

__all__ = ["gemm_stream_k", "gemm_stream_k_kernel", "stream_k_plan", "stream_k_workspace"]


def stream_k_plan(m: int, n_cols: int, k: int, block_m: int, block_n: int, block_k: int,
                  programs: int) -> tuple[int, int, int]:  # fmt: skip
    """(stream-K tiles, their K iterations a tile, programs sharing them) for a launch of `programs` programs."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n_cols, block_n)
    iters = triton.cdiv(k, block_k)
    sk_tiles = tiles % programs if tiles >= programs else tiles
    return sk_tiles, iters, min(programs, sk_tiles * iters)


def stream_k_workspace(m: int, n_cols: int, k: int, block_m: int, block_n: int, block_k: int, programs: int, *,
                       paired: bool) -> tuple[int, int]:  # fmt: skip
    """(floats, counters): a partial slot per (program, tile) pair a range can touch (slot = program + tile, so at
    most sk_programs + sk_tiles - 1 of them), a counter a stream-K tile; (0, 0) without a stream-K region."""
    sk_tiles, _, sk_programs = stream_k_plan(m, n_cols, k, block_m, block_n, block_k, programs)
    if sk_tiles == 0:
        return 0, 0
    return (sk_programs + sk_tiles) * block_m * block_n * (2 if paired else 1), sk_tiles


@triton.jit
def _owner(i, total, sk_programs):
    """The program whose stream-K range holds iteration `i`: ranges start at p * total // sk_programs, so the owner
    is the largest p with that start <= i."""
    return ((i + 1) * sk_programs + total - 1) // total - 1


@triton.jit
def _tile_k_loop(a_desc, w_desc, off_m, row_w, row_up, k_first, k_last, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The fp32 sums of K iterations k_first..k_last - 1 of one tile (TMA zero-fills the K tail and missing rows)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    if PAIRED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_first, k_last):
        k0 = ki * BLOCK_K
        a = a_desc.load([off_m, k0])
        acc = tl.dot(a, w_desc.load([row_w, k0]).T, acc, input_precision=DOT_PRECISION)
        if PAIRED:
            acc_up = tl.dot(a, w_desc.load([row_up, k0]).T, acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up


@triton.jit
def gemm_stream_k_kernel(
    a_desc, w_desc, out_ptr, bias_ptr, row_scale_ptr, res_ptr, out_scale_ptr, partial_ptr, counter_ptr,
    cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
    M, N, K, alpha, res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm, stride_cos_b, stride_cos_t,
    stride_kv_b, stride_kv_t, stride_kv_h,
    num_programs, sk_tiles, sk_programs,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE_HALF: tl.constexpr = 0,
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
    HAS_OUT_SCALE: tl.constexpr = False,
    MOD_ROWS: tl.constexpr = 0,
    MOD_STRIDE: tl.constexpr = 0,
):  # fmt: skip
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0
    SLOT: tl.constexpr = BLOCK_M * BLOCK_N * (2 if PAIRED else 1)  # one partial: [acc; acc_up], fp32
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    iters = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    pdl_enter(USE_PDL)
    slot_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    # the stream-K region: this program's contiguous range of the first sk_tiles tiles' K iterations
    total = sk_tiles * iters
    it = total  # programs past sk_programs have no range
    end = total
    if pid < sk_programs:
        it = pid * total // sk_programs
        end = (pid + 1) * total // sk_programs
    while it < end:
        tile = it // iters
        tile_start = tile * iters
        seg_end = tl.minimum(end, tile_start + iters)
        off_m, off_n, row_w, row_up = _tile_rows(tile, num_pid_m, num_pid_n, N, GROUP_M, BLOCK_M, BLOCK_N,
                                                 ROPE_HALF)  # fmt: skip
        acc, acc_up = _tile_k_loop(a_desc, w_desc, off_m, row_w, row_up, it - tile_start, seg_end - tile_start,
                                   BLOCK_M, BLOCK_N, BLOCK_K, PAIRED, DOT_PRECISION)  # fmt: skip
        first = _owner(tile_start, total, sk_programs)
        last = _owner(tile_start + iters - 1, total, sk_programs)
        owner = first == last
        if first != last:  # shared: partial into this program's slot, the last arrival merges in program order
            slot_ptr = partial_ptr + (pid + tile) * SLOT + slot_offs
            tl.store(slot_ptr, acc)
            if PAIRED:
                tl.store(slot_ptr + BLOCK_M * BLOCK_N, acc_up)
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            owner = arrived == last - first
            if owner:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if PAIRED:
                    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in range(first, last + 1):  # fixed order: the sum does not depend on who arrived last
                    src = partial_ptr + (p + tile) * SLOT + slot_offs
                    acc += tl.load(src, cache_modifier=".cg")
                    if PAIRED:
                        acc_up += tl.load(src + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch / graph replay
        if owner:
            _whole_tile_epilogue(
                acc, acc_up, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), out_ptr, bias_ptr,
                row_scale_ptr, res_ptr, out_scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, M, N, alpha,
                res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm, stride_cos_b, stride_cos_t,
                stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL,
                RESIDUAL_PERIODIC, BLOCK_M, BLOCK_N, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
            )  # fmt: skip
        it = seg_end

    # the data-parallel region: whole tiles, a multiple of num_programs of them, in grouped order
    for tile in range(sk_tiles + pid, num_pid_m * num_pid_n, num_programs):
        off_m, off_n, row_w, row_up = _tile_rows(tile, num_pid_m, num_pid_n, N, GROUP_M, BLOCK_M, BLOCK_N,
                                                 ROPE_HALF)  # fmt: skip
        acc, acc_up = _tile_k_loop(a_desc, w_desc, off_m, row_w, row_up, 0, iters, BLOCK_M, BLOCK_N, BLOCK_K,
                                   PAIRED, DOT_PRECISION)  # fmt: skip
        _whole_tile_epilogue(
            acc, acc_up, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), out_ptr, bias_ptr,
            row_scale_ptr, res_ptr, out_scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, M, N, alpha,
            res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm, stride_cos_b, stride_cos_t, stride_kv_b,
            stride_kv_t, stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC,
            BLOCK_M, BLOCK_N, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
        )  # fmt: skip


def gemm_stream_k(a, w, out, cfg, n_cols: int, epilogue_args: tuple, partials, counters, rope_args: tuple,
                  alpha: float, residual_period: int | None, residual_stride: int, flags: dict, rope_flags: dict,
                  programs: int) -> None:  # fmt: skip
    """Launch `gemm_stream_k_kernel` with `gemm`'s prepared arguments on `programs` programs (the SM count);
    `partials` / `counters`: `stream_k_workspace`'s scratch (stand-ins when the plan has no stream-K region)."""
    if cfg.tma != 4 or cfg.split_k != 1:
        raise ValueError(f"gemm_stream_k needs config.tma 4 and split_k 1, got {cfg}")
    m, k = a.shape
    sk_tiles, _, sk_programs = stream_k_plan(m, n_cols, k, cfg.block_m, cfg.block_n, cfg.block_k, programs)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n)
    grid = programs if tiles >= programs else sk_programs  # all programs resident: one a SM at most
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    cos, sin, k_cache, v_cache, rope_t, cache_offset, q_scale, *rope_strides = rope_args
    launch(gemm_stream_k_kernel, (grid,), out)(
        a_desc, w_desc, out, *epilogue_args, partials, counters, cos, sin, k_cache, v_cache, m, n_cols, k,
        float(alpha), residual_period or m, rope_t, cache_offset, q_scale, out.stride(0), residual_stride,
        *rope_strides, grid, sk_tiles, sk_programs,
        **flags,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DOT_PRECISION=dot_precision(a.dtype),
        **rope_flags,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
