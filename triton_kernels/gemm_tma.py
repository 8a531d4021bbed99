"""GEMM with TMA tensor descriptors, optionally persistent: the SigLIP/VLM GEMMs and some of the expert's.

Why a second kernel: `gemm.py`'s kernel loads A and W tiles through pointers (`cp.async`), which costs registers
and address arithmetic on every thread and reached 0.6-0.8x cuBLAS on the compute-bound shapes (H200:
vlm.gate_up 768 rows 197 µs against cuBLAS 143 µs, `benchmarks/results/kernels_NVIDIA-H200.json`). On sm_90 a
tensor descriptor lets one thread move a whole tile with the Tensor Memory Accelerator into the swizzled shared
memory layout wgmma reads, and zero-fills out-of-bounds rows and the K tail, so the loop needs no masks at all.

`config.tma` picks the kernel (0: `gemm.py`'s pointer kernel; the others are here):
1, one output tile a program; 2, persistent: `min(work, SMs)` programs walk the tiles in grouped order, so no
wave is partly empty; 3, persistent with the tile and K loops flattened into one software pipeline (the next
tile's loads start during this tile's epilogue); 4, split-K met in-kernel (`_stream_k`, a Stream-K partition):
`split_k` programs a tile (as many as fit on the SMs at once) share its K steps evenly and meet through fp32
partials in the workspace, the top one adding the others' in a fixed order, so a shape with few tiles (SigLIP's
256-row fc2: 36 tiles of 64 x 128 on 132 SMs) splits K without a combine kernel. Measured on the H200
(`tools/probe_stream_k.py`): sharing every tile across all 132 SMs (classic Stream-K) was 1.2-4x slower than whole
tiles, because an owner adds up to seven 64 KiB partials one after another; two programs a tile beat the split-K +
combine kernel pair (fc2 12.8 -> 12.0 µs). Automatic warp specialisation (`tl.range(warp_specialize=True)`)
was a fourth mode and is gone: with Triton 3.6 on the H200 a 4-warp 128x64 tile of it never finished (a tune
stalled on it), and the 8-warp tiles that ran were no faster than mode 1 (`tools/bench_tma.py`).

The epilogue is `gemm_epilogue.epilogue_store`, the pointer kernel's, so both round exactly alike, RoPE into the
KV cache included (a tile of pair columns loads the weight rows of both halves of one head, so BLOCK_N must divide
the half head). Split-K writes fp32 partials for `gemm.py`'s combine kernel (`config.combine == 1` only; the
last-arriving merge stays with the pointer kernel). No in-loop RMS factor (`rms_eps`) or `ssq_in`, and no opt-in
PDL weight prefetch (`VLA_RT_PDL_PREFETCH`, the pointer kernel's; measured not to pay). `gemm` falls back to the
pointer kernel where TMA does not apply (also a base or row stride that is not 16-byte aligned).

Measured on the H200 (tune logs, bf16, `docs/kernels.md`): vlm.gate_up 768 rows 180 -> 155 µs (cuBLAS 156),
vlm.down 768 rows 119 -> 84 µs, expert.o 64 rows 5.7 -> 4.8 µs without split-K; small 256-row GEMMs gain nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm_epilogue import epilogue_store, rope_tables, row_factors
from .launch_configs import GemmConfig, stream_k_share
from .pdl import launch, pdl_enter

__all__ = ["STREAM_K", "TMA_MODES", "gemm_tma", "stream_k_need", "tma_applies", "tma_config_applies"]

TMA_MODES = {
    0: "pointer loads (gemm.py)",
    1: "TMA, one tile a program",
    2: "TMA, persistent",
    3: "TMA, persistent, flattened loops",
    4: "TMA, split K met in-kernel (a Stream-K partition)",
}
STREAM_K = 4  # the mode whose split_k programs a tile share its K steps and meet in-kernel
INTERPRETER_PROGRAMS = 3  # on the CPU interpreter: few programs, so each walks several tiles (the persistent path)


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of linear tile index `tile` in grouped order: GROUP_M row tiles walk the columns
    together, so a weight tile is read from HBM once and from L2 by the other row tiles."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_rows
    pid_n = (tile % width) // group_rows
    return pid_m, pid_n


@triton.jit
def _tile_rows(tile, num_pid_m, num_pid_n, N, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, ROPE_HALF: tl.constexpr):  # fmt: skip
    """(first output row, first tile column, first weight row, first up weight row) of a tile: with RoPE the
    tile's pair columns (head, i0..) are weight rows head*D + i0.. and HALF below them; GATED: the up rows are N rows
    below the gate rows."""
    pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if ROPE_HALF > 0:
        row_w = (off_n // ROPE_HALF) * (2 * ROPE_HALF) + off_n % ROPE_HALF
        row_up = row_w + ROPE_HALF
    else:
        row_w = off_n
        row_up = N + off_n
    return off_m, off_n, row_w, row_up


@triton.jit
def _whole_tile_epilogue(
    acc, acc_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, ssq_out_ptr, cos_ptr, sin_ptr,
    k_cache_ptr, v_cache_ptr, M, N, K, alpha, res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm,
    stride_ssq_out, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr, SSQ_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROPE_HALF: tl.constexpr, ROPE_Q_HEADS: tl.constexpr, ROPE_KV_HEADS: tl.constexpr,
):  # fmt: skip
    """The epilogue of a tile whose whole K sum is in `acc` (no split, or mode 4's owner): the given row scale, the
    RoPE tables (placeholders unless ROPE_HALF > 0), then `epilogue_store`."""
    rs = row_factors(row_scale_ptr, tl.zeros((BLOCK_M,), dtype=tl.float32), offs_m, M, K, 0.0, 0, HAS_ROW_SCALE,
                     False, 0)  # fmt: skip
    rope_cos = acc
    rope_sin = acc
    if ROPE_HALF > 0:
        rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t,
                                         ROPE_HALF, BLOCK_N)  # fmt: skip
    epilogue_store(
        acc, acc_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
        stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
        stride_kv_h, ssq_out_ptr, stride_ssq_out, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL,
        RESIDUAL_PERIODIC, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, SSQ_OUT,
    )  # fmt: skip


@triton.jit
def _stream_k(
    a_desc, w_desc, out_ptr, bias_ptr, row_scale_ptr, res_ptr, ssq_out_ptr, partial_ptr, flag_ptr, cos_ptr, sin_ptr,
    k_cache_ptr, v_cache_ptr, M, N, K, alpha, res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm,
    stride_ssq_out, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, num_programs,
    HAS_BIAS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, RESIDUAL_PERIODIC: tl.constexpr, SSQ_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROPE_HALF: tl.constexpr, ROPE_Q_HEADS: tl.constexpr, ROPE_KV_HEADS: tl.constexpr,
):  # fmt: skip
    """Mode 4, a Stream-K partition: the tiles' K steps laid end to end, tile after tile, as `total` units, and
    program p takes units [p·total/P, (p+1)·total/P). The host picks P = tiles x s (`stream_k_need`), so each tile's
    steps are split evenly between s programs (any P works here: P = SMs is classic Stream-K, which the H200 probe
    measured slower, as an owner then adds many partials one after another).
    A program walks its range from the top down, one tile segment at a time. A segment that holds its tile's last
    unit is the tile's: that program adds the fp32 partials the programs below it left for the same tile (in
    descending program order: a fixed order, so replays are bit-identical), then runs the epilogue. A segment
    that does not (only a program's first, topmost one can be such) leaves its partial in the program's workspace
    slot and raises the program's flag. Walking down means the lower programs write those partials first thing
    and the owner reads them last thing, so it seldom waits; and a program only ever waits for lower-numbered
    ones, which the CPU interpreter (programs run in order) has already run. The owner clears the flags it read,
    so the next launch starts from zero. Where tiles are shared all programs must be resident at once (P <= SMs);
    with s = 1 nothing is shared and nothing waits."""
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0
    TILE: tl.constexpr = BLOCK_M * BLOCK_N * (2 if PAIRED else 1)  # floats of one partial
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_iters = tl.cdiv(K, BLOCK_K)
    total = num_pid_m * num_pid_n * k_iters
    pid = tl.program_id(0)
    lo = (pid * total) // num_programs
    cur = ((pid + 1) * total) // num_programs
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    while cur > lo:
        tile = (cur - 1) // k_iters
        t_lo = tile * k_iters
        seg_lo = tl.maximum(t_lo, lo)
        off_m, off_n, row_w, row_up = _tile_rows(tile, num_pid_m, num_pid_n, N, GROUP_M, BLOCK_M, BLOCK_N, ROPE_HALF)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc
        if PAIRED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range((seg_lo - t_lo) * BLOCK_K, (cur - t_lo) * BLOCK_K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            acc = tl.dot(a, w_desc.load([row_w, k0]).T, acc, input_precision=DOT_PRECISION)
            if PAIRED:
                acc_up = tl.dot(a, w_desc.load([row_up, k0]).T, acc_up, input_precision=DOT_PRECISION)
        if cur - t_lo < k_iters:  # the tile goes on above this range: its owner sums this partial
            mine = partial_ptr + pid * TILE + tile_offs
            tl.store(mine, acc)
            if PAIRED:
                tl.store(mine + BLOCK_M * BLOCK_N, acc_up)
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release
            tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
        else:
            p = pid - 1
            more = seg_lo > t_lo  # the tile began below this range
            while more:
                while tl.atomic_max(flag_ptr + p, 0, sem="acquire") == 0:
                    pass
                theirs = partial_ptr + p * TILE + tile_offs
                acc += tl.load(theirs, cache_modifier=".cg")
                if PAIRED:
                    acc_up += tl.load(theirs + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                tl.atomic_xchg(flag_ptr + p, 0, sem="relaxed")
                more = (p * total) // num_programs > t_lo
                p -= 1
            _whole_tile_epilogue(
                acc, acc_up, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), out_ptr, bias_ptr,
                row_scale_ptr, res_ptr, ssq_out_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, M, N, K, alpha,
                res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm, stride_ssq_out, stride_cos_b,
                stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED,
                HAS_RESIDUAL, RESIDUAL_PERIODIC, SSQ_OUT, BLOCK_M, BLOCK_N, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS,
            )  # fmt: skip
        cur = seg_lo


@triton.jit
def gemm_tma_kernel(
    a_desc,
    w_desc,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    ssq_out_ptr,
    partial_ptr,
    flag_ptr,
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
    stride_om,
    stride_rm,
    stride_ssq_out,
    stride_cos_b,
    stride_cos_t,
    stride_kv_b,
    stride_kv_t,
    stride_kv_h,
    num_programs,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    SSQ_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE_HALF: tl.constexpr = 0,  # > 0: N counts pair columns (h*D + i, h*D + D/2 + i), RoPE epilogue (D = 2*HALF)
    ROPE_Q_HEADS: tl.constexpr = 0,
    ROPE_KV_HEADS: tl.constexpr = 0,
    USE_PDL: tl.constexpr = 0,
    STREAM_K: tl.constexpr = False,
):
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0  # two accumulators: [gate; up] rows, or a head's two halves
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    pdl_enter(USE_PDL)
    if STREAM_K:
        _stream_k(
            a_desc, w_desc, out_ptr, bias_ptr, row_scale_ptr, res_ptr, ssq_out_ptr, partial_ptr, flag_ptr, cos_ptr,
            sin_ptr, k_cache_ptr, v_cache_ptr, M, N, K, alpha, res_period, rope_t, cache_offset, q_scale, stride_om,
            stride_rm, stride_ssq_out, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h,
            num_programs, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, SSQ_OUT,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS,
        )  # fmt: skip
        return
    # work item = (tile, split); SPLIT_K == 1: one item a tile
    for work in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, num_programs, flatten=FLATTEN):
        off_m, off_n, row_w, row_up = _tile_rows(work // SPLIT_K, num_pid_m, num_pid_n, N, GROUP_M, BLOCK_M, BLOCK_N,
                                                 ROPE_HALF)  # fmt: skip
        k_start = (work % SPLIT_K) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc  # the second accumulator exists only when PAIRED
        if PAIRED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):  # out-of-bounds rows and the K tail arrive as zeros: no masks
            a = a_desc.load([off_m, k0])
            acc = tl.dot(a, w_desc.load([row_w, k0]).T, acc, input_precision=DOT_PRECISION)
            if PAIRED:
                acc_up = tl.dot(a, w_desc.load([row_up, k0]).T, acc_up, input_precision=DOT_PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if SPLIT_K == 1:
            _whole_tile_epilogue(
                acc, acc_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, ssq_out_ptr, cos_ptr,
                sin_ptr, k_cache_ptr, v_cache_ptr, M, N, K, alpha, res_period, rope_t, cache_offset, q_scale,
                stride_om, stride_rm, stride_ssq_out, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t,
                stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, SSQ_OUT,
                BLOCK_M, BLOCK_N, ROPE_HALF, ROPE_Q_HEADS, ROPE_KV_HEADS,
            )  # fmt: skip
        else:  # partials (SPLIT_K, M, n_acc) fp32, as gemm.py's kernel writes them for gemm_combine_kernel
            n_acc = N
            if PAIRED:
                n_acc = 2 * N
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            ptrs = partial_ptr + (work % SPLIT_K) * M * n_acc + offs_m[:, None] * n_acc + offs_n[None, :]
            tl.store(ptrs, acc, mask=mask)
            if PAIRED:
                tl.store(ptrs + N, acc_up, mask=mask)


def _interpreting(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"


def tma_config_applies(cfg: GemmConfig, *, rope_half: int = 0, fused_rms: bool = False) -> bool:
    """The config side of `tma_applies`, for callers without tensors (the tuner's candidates, compile_check):
    `cfg.tma` set; split-K only with the combine kernel (mode 4: with its own in-kernel meeting, combine 0); no in-loop RMS factor (`fused_rms`: `rms_eps` given); RoPE
    (`rope_half` = head_dim / 2) only with BLOCK_N dividing the half head."""
    if cfg.tma not in TMA_MODES:
        raise ValueError(f"config.tma must be one of {sorted(TMA_MODES)} ({TMA_MODES}), got {cfg.tma}")
    return (
        bool(cfg.tma)
        and (cfg.split_k == 1 or cfg.combine == (0 if cfg.tma == STREAM_K else 1))
        and not fused_rms
        and not (rope_half and rope_half % cfg.block_n)
    )


def tma_applies(
    a: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, *, rope_half: int = 0, fused_rms: bool = False
) -> bool:
    """Whether `gemm` runs `cfg` on the TMA kernel: `tma_config_applies`, and sm_90+ CUDA (or the CPU interpreter,
    or meta tensors for a compile check), 2- or 4-byte elements, 16-byte aligned bases and row strides, contiguous
    rows."""
    if not tma_config_applies(cfg, rope_half=rope_half, fused_rms=fused_rms):
        return False
    if a.device.type == "cuda":
        if torch.cuda.get_device_capability(a.device)[0] < 9:
            return False
    elif not (_interpreting(a) or a.device.type == "meta"):
        return False
    for t in (a, w):
        size = t.element_size()
        if size not in (2, 4) or t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16:
            return False
    return True


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS if device.type == "cpu" else 132


def stream_k_need(
    m: int, n_cols: int, k: int, cfg: GemmConfig, paired: bool, device: torch.device
) -> tuple[int, int, int]:
    """(programs, workspace floats, int32 counters) of a mode-4 launch: `stream_k_share` programs a tile, so each
    tile's K steps are split evenly between them; where tiles are shared, one partial tile (two accumulators when
    gated or RoPE) and one flag a program, else no floats and one counter (the kernel's atomics still need an int32
    pointer)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n)
    share = stream_k_share(tiles, triton.cdiv(k, cfg.block_k), cfg.split_k, _num_programs(device))
    programs = tiles * share
    if share == 1:
        return programs, 0, 1
    return programs, programs * cfg.block_m * cfg.block_n * (2 if paired else 1), programs


def gemm_tma(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    n_cols: int,
    epilogue_args: tuple,
    partials: torch.Tensor,
    rope_args: tuple,
    ssq_out: torch.Tensor | None,
    alpha: float,
    residual_period: int | None,
    residual_stride: int,
    flags: dict,
    rope_flags: dict,
    counters: torch.Tensor | None = None,
) -> None:
    """Launch `gemm_tma_kernel` with `gemm`'s prepared arguments (`epilogue_args` = bias, row scale, residual or
    `out` stand-ins; `flags`: the epilogue constexprs; `rope_args` / `rope_flags` as `gemm._rope_args` returns;
    `partials`: the split-K workspace, which `gemm`'s combine kernel then reduces, or Stream-K's partial tiles with
    `counters` its zeroed flags, `stream_k_need` of each). Descriptors are built on the host
    per call; inside a CUDA Graph the launch keeps them by value."""
    if cfg.tma not in TMA_MODES or cfg.tma == 0 or not tma_config_applies(cfg):
        raise ValueError(f"gemm_tma needs config.tma in 1..{max(TMA_MODES)} and split_k 1, or combine 1 (mode 4: 0), "
                         f"got {cfg}")  # fmt: skip
    m, k = a.shape
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    work = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n) * cfg.split_k
    programs = work if cfg.tma == 1 else min(work, _num_programs(out.device))
    stream_k = cfg.tma == STREAM_K
    if stream_k:
        paired = flags["GATED"] or rope_flags["ROPE_HALF"] > 0
        programs, floats, n_counters = stream_k_need(m, n_cols, k, cfg, paired, out.device)
        if (
            counters is None
            or counters.dtype != torch.int32
            or counters.numel() < n_counters
            or partials.numel() < floats
        ):
            raise ValueError(f"gemm_tma Stream-K needs {floats} partial floats and {n_counters} int32 counters")
    cos, sin, k_cache, v_cache, rope_t, cache_offset, q_scale, *rope_strides = rope_args
    launch(gemm_tma_kernel, (programs,), out)(
        a_desc, w_desc, out, *epilogue_args, ssq_out if ssq_out is not None else out, partials,
        counters if stream_k else out, cos, sin, k_cache, v_cache, m, n_cols, k, float(alpha), residual_period or m, rope_t, cache_offset, q_scale,
        out.stride(0), residual_stride, ssq_out.stride(0) if ssq_out is not None else 0, *rope_strides, programs,
        **flags,
        SSQ_OUT=ssq_out is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m,
        FLATTEN=cfg.tma == 3,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **rope_flags,
        STREAM_K=stream_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
