"""The wide GEMMs (SigLIP's and the VLM's, 256..788 rows) with TMA tensor descriptors, optionally persistent.

Why a second kernel: `gemm.py`'s kernel loads A and W tiles through pointers (`cp.async`), which costs registers
and address arithmetic on every thread and reaches 0.6-0.8x cuBLAS on the compute-bound shapes (H200:
vlm.gate_up 768 rows 197 µs against cuBLAS 143 µs, `benchmarks/results/kernels_NVIDIA-H200.json`). On sm_90 a
tensor descriptor lets one thread move a whole tile with the Tensor Memory Accelerator into the swizzled shared
memory layout wgmma reads, and zero-fills out-of-bounds rows and the K tail, so the loop needs no masks at all.

`config.tma` picks the kernel (0: `gemm.py`'s pointer kernel; the others are here):
1, one output tile a program; 2, persistent: `min(tiles, SMs)` programs walk the tiles in grouped order, so no
wave is partly empty; 3, persistent with the tile and K loops flattened into one software pipeline (the next
tile's loads start during this tile's epilogue). Automatic warp specialisation (`tl.range(warp_specialize=True)`)
was a fourth mode and is gone: with Triton 3.6 on the H200 a 4-warp 128x64 tile of it never finished (a tune
stalled on it), and the 8-warp tiles that ran were no faster than mode 1 (`tools/bench_tma.py`). The epilogue is `gemm_epilogue.epilogue_store`, the pointer kernel's,
so both round exactly alike. No split-K, RoPE or in-loop RMS here: those serve the 64-row expert GEMMs, which are
memory-bound and stay on the pointer kernel. `gemm` falls back to it when the operands cannot be described
(a base or row stride that is not 16-byte aligned).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm_epilogue import epilogue_store, row_factors
from .launch_configs import GemmConfig
from .pdl import launch, pdl_enter

__all__ = ["TMA_MODES", "gemm_tma", "tma_supported"]

TMA_MODES = {
    0: "pointer loads (gemm.py)",
    1: "TMA, one tile a program",
    2: "TMA, persistent",
    3: "TMA, persistent, flattened loops",
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
def gemm_tma_kernel(
    a_desc,
    w_desc,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    ssq_out_ptr,
    M,
    N,
    K,
    alpha,
    res_period,
    stride_om,
    stride_rm,
    stride_ssq_out,
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
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = 0,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pdl_enter(USE_PDL)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc  # the second accumulator exists only when GATED: the up rows, N rows below the gate rows
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # out-of-bounds rows and the K tail arrive as zeros: no masks
            k0 = ki * BLOCK_K
            a = a_desc.load([off_m, k0])
            acc = tl.dot(a, w_desc.load([off_n, k0]).T, acc, input_precision=DOT_PRECISION)
            if GATED:
                acc_up = tl.dot(a, w_desc.load([N + off_n, k0]).T, acc_up, input_precision=DOT_PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rs = row_factors(row_scale_ptr, tl.zeros((BLOCK_M,), dtype=tl.float32), offs_m, M, K, 0.0, 0, HAS_ROW_SCALE,
                         False, 0)  # fmt: skip
        epilogue_store(
            acc, acc_up, rs, acc, acc, offs_m, offs_n, out_ptr, bias_ptr, res_ptr, M, N, alpha, res_period,
            stride_om, stride_rm, out_ptr, out_ptr, 1, 0, 1.0, 0, 0, 0, ssq_out_ptr, stride_ssq_out,
            HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC, 0, 0, 0, BLOCK_N, SSQ_OUT,
        )  # fmt: skip


def _interpreting(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"


def tma_supported(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `a` and `w` can be TMA-described: sm_90+ CUDA (or the CPU interpreter, or meta tensors for a
    compile check), 2- or 4-byte elements, 16-byte aligned bases and row strides, contiguous rows."""
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


def gemm_tma(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    cfg: GemmConfig,
    *,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    activation: int,
    gated: bool,
    alpha: float,
    residual: torch.Tensor | None,
    residual_period: int | None,
    ssq_out: torch.Tensor | None,
) -> None:
    """Launch `gemm_tma_kernel` for `gemm`'s already-checked arguments (`activation` as its ACTIVATIONS code).
    Descriptors are built per call on the host; inside a CUDA Graph the launch keeps them by value."""
    if cfg.tma not in TMA_MODES or cfg.tma == 0 or cfg.split_k != 1:
        raise ValueError(f"gemm_tma needs config.tma in 1..{max(TMA_MODES)} and split_k 1, got {cfg}")
    m, k = a.shape
    n = out.shape[1]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = tiles if cfg.tma == 1 else min(tiles, _num_programs(out.device))
    dummy = out
    launch(gemm_tma_kernel, (programs,), out)(
        a_desc, w_desc, out,
        bias if bias is not None else dummy,
        row_scale if row_scale is not None else dummy,
        residual if residual is not None else dummy,
        ssq_out if ssq_out is not None else dummy,
        m, n, k, float(alpha), residual_period or m, out.stride(0),
        residual.stride(0) if residual is not None else 0,
        ssq_out.stride(0) if ssq_out is not None else 0,
        programs,
        HAS_BIAS=bias is not None,
        HAS_ROW_SCALE=row_scale is not None,
        ACTIVATION=activation,
        GATED=gated,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_PERIODIC=residual_period is not None,
        SSQ_OUT=ssq_out is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        FLATTEN=cfg.tma == 3,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
