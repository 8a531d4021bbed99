"""GEMM with TMA tensor descriptors, optionally persistent: the SigLIP/VLM GEMMs and some of the expert's.

Why a second kernel: `gemm_pointer.py`'s kernel loads A and W tiles through pointers (`cp.async`), which costs registers
and address arithmetic on every thread and reached 0.6-0.8x cuBLAS on the compute-bound shapes (H200:
vlm.gate_up 768 rows 197 µs against cuBLAS 143 µs, `benchmarks/results/kernels_NVIDIA-H200.json`). On sm_90 a
tensor descriptor lets one thread move a whole tile with the Tensor Memory Accelerator into the swizzled shared
memory layout wgmma reads, and zero-fills out-of-bounds rows and the K tail, so the loop needs no masks at all.

`config.tma` picks the kernel (0: `gemm_pointer.py`'s pointer kernel; the others are here): 1, one output tile a
program; 2, persistent: `min(work, SMs)` programs walk the tiles in grouped order, so no wave is partly empty; 3,
persistent with the tile and K loops flattened into one software pipeline (the next tile's loads start during this
tile's epilogue). The tuned H200 table uses all three (docs/kernels.md lists the modes that were tried and lost).

The epilogue is `gemm_epilogue.epilogue_store`, the pointer kernel's, so both round exactly alike, RoPE into the
KV cache included (a tile of pair columns loads the weight rows of both halves of one head, so BLOCK_N must divide
the half head). Split-K writes fp32 partials for `gemm_pointer.py`'s combine kernel (`config.combine == 1` only;
the last-arriving merge stays with the pointer kernel). `gemm` falls back to the pointer kernel where TMA does not
apply (also a base or row stride that is not 16-byte aligned).

Measured on the H200 (tune logs, bf16, `docs/kernels.md`): vlm.gate_up 768 rows 180 -> 155 µs (cuBLAS 156),
vlm.down 768 rows 119 -> 84 µs, expert.o 64 rows 5.7 -> 4.8 µs without split-K; small 256-row GEMMs gain nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .float32_dot import dot_precision
from .gemm_epilogue import epilogue_store, rope_tables, row_scales
from .launch_configs import GemmConfig
from .pdl import launch, pdl_enter

__all__ = ["TMA_MODES", "gemm_tma", "num_programs", "tile_coords", "tma_applies", "tma_config_applies"]

TMA_MODES = {
    0: "pointer loads (gemm_pointer.py)",
    1: "TMA, one tile a program",
    2: "TMA, persistent",
    3: "TMA, persistent, flattened loops",
    4: "TMA, stream-K: the last partial wave's K iterations spread over every SM (gemm_stream_k.py)",
}
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
    acc, acc_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, out_scale_ptr, cos_ptr, sin_ptr,
    k_cache_ptr, v_cache_ptr, M, N, alpha, res_period, rope_t, cache_offset, q_scale, stride_om, stride_rm, stride_cos_b,
    stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE_HALF: tl.constexpr, ROPE_Q_HEADS: tl.constexpr,
    ROPE_KV_HEADS: tl.constexpr, HAS_OUT_SCALE: tl.constexpr, MOD_ROWS: tl.constexpr, MOD_STRIDE: tl.constexpr,
):  # fmt: skip
    """The epilogue of a tile whose whole K sum is in `acc`: the given row scale, the RoPE tables (placeholders
    unless ROPE_HALF > 0), then `epilogue_store`."""
    rs = row_scales(row_scale_ptr, offs_m, M, HAS_ROW_SCALE, BLOCK_M)
    rope_cos = acc
    rope_sin = acc
    if ROPE_HALF > 0:
        rope_cos, rope_sin = rope_tables(cos_ptr, sin_ptr, offs_m, offs_n, M, N, rope_t, stride_cos_b, stride_cos_t,
                                         ROPE_HALF, BLOCK_N)  # fmt: skip
    epilogue_store(
        acc, acc_up, rs, rope_cos, rope_sin, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
        stride_om, stride_rm, k_cache_ptr, v_cache_ptr, rope_t, cache_offset, q_scale, stride_kv_b, stride_kv_t,
        stride_kv_h, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, ROPE_HALF,
        ROPE_Q_HEADS, ROPE_KV_HEADS, BLOCK_N, out_scale_ptr, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
    )  # fmt: skip


@triton.jit
def gemm_tma_kernel(
    a_desc,
    w_desc,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    out_scale_ptr,
    partial_ptr,
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
    HAS_OUT_SCALE: tl.constexpr = False,
    MOD_ROWS: tl.constexpr = 0,
    MOD_STRIDE: tl.constexpr = 0,
):
    PAIRED: tl.constexpr = GATED or ROPE_HALF > 0  # two accumulators: [gate; up] rows, or a head's two halves
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    pdl_enter(USE_PDL)
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
                acc, acc_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, out_scale_ptr, cos_ptr,
                sin_ptr, k_cache_ptr, v_cache_ptr, M, N, alpha, res_period, rope_t, cache_offset, q_scale, stride_om,
                stride_rm, stride_cos_b, stride_cos_t, stride_kv_b, stride_kv_t, stride_kv_h, HAS_BIAS,
                HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, BLOCK_M, BLOCK_N, ROPE_HALF,
                ROPE_Q_HEADS, ROPE_KV_HEADS, HAS_OUT_SCALE, MOD_ROWS, MOD_STRIDE,
            )  # fmt: skip
        else:  # partials (SPLIT_K, M, n_acc) fp32, as the pointer kernel writes them for gemm_combine_kernel
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


def tma_config_applies(cfg: GemmConfig, *, rope_half: int = 0) -> bool:
    """The config side of `tma_applies`, for callers without tensors (the tuner's candidates, compile_check):
    `cfg.tma` set; split-K only with the combine kernel; RoPE (`rope_half` = head_dim / 2) only with BLOCK_N
    dividing the half head."""
    if cfg.tma not in TMA_MODES:
        raise ValueError(f"config.tma must be one of {sorted(TMA_MODES)} ({TMA_MODES}), got {cfg.tma}")
    if cfg.tma == 4 and cfg.split_k > 1:  # stream-K splits K its own way
        return False
    return bool(cfg.tma) and (cfg.split_k == 1 or cfg.combine == 1) and not (rope_half and rope_half % cfg.block_n)


def tma_applies(a: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, *, rope_half: int = 0) -> bool:
    """Whether `gemm` runs `cfg` on the TMA kernel: `tma_config_applies`, and sm_90+ CUDA (or the CPU interpreter,
    or meta tensors for a compile check), 2- or 4-byte elements, 16-byte aligned bases and row strides, contiguous
    rows."""
    if not tma_config_applies(cfg, rope_half=rope_half):
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


def num_programs(device: torch.device) -> int:
    """Programs a persistent launch runs: one a SM (INTERPRETER_PROGRAMS on the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS if device.type == "cpu" else 132


def gemm_tma(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: GemmConfig, n_cols: int, epilogue_args: tuple,
             partials: torch.Tensor, rope_args: tuple, alpha: float, residual_period: int | None,
             residual_stride: int, flags: dict, rope_flags: dict) -> None:  # fmt: skip
    """Launch `gemm_tma_kernel` with `gemm`'s prepared arguments (`epilogue_args` = bias, row scale, residual or
    `out` stand-ins; `flags`: the epilogue constexprs; `rope_args` / `rope_flags` as `gemm._rope_args` returns;
    `partials`: the split-K workspace, which the combine kernel then reduces). Descriptors are built on the host per
    call; inside a CUDA Graph the launch keeps them by value."""
    if cfg.tma not in (1, 2, 3) or not tma_config_applies(cfg):
        raise ValueError(f"gemm_tma needs config.tma in 1..3 and split_k 1 or combine 1, got {cfg}")
    m, k = a.shape
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    work = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n) * cfg.split_k
    programs = work if cfg.tma == 1 else min(work, num_programs(out.device))
    cos, sin, k_cache, v_cache, rope_t, cache_offset, q_scale, *rope_strides = rope_args
    launch(gemm_tma_kernel, (programs,), out)(
        a_desc, w_desc, out, *epilogue_args, partials, cos, sin, k_cache, v_cache, m, n_cols, k, float(alpha),
        residual_period or m, rope_t, cache_offset, q_scale, out.stride(0), residual_stride, *rope_strides, programs,
        **flags,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m,
        FLATTEN=cfg.tma == 3,
        DOT_PRECISION=dot_precision(a.dtype),
        **rope_flags,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
