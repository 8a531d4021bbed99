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
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .launch_configs import GemmConfig, gemm_config
from .workspace import Workspace, default_workspace

__all__ = ["ACTIVATIONS", "gemm"]

ACTIVATIONS = {None: 0, "gelu_tanh": 1, "silu": 2}
_WARNED_UNALIGNED: set[tuple[int, int, int]] = set()


@triton.jit
def gelu_tanh(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the tanh-approximate GELU without a tanh intrinsic.
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:
        x = gelu_tanh(x)
    elif ACTIVATION == 2:
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _epilogue_store(
    acc,
    acc_up,
    offs_m,
    offs_n,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    M,
    N,
    alpha,
    res_period,
    stride_om,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
):
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_ROW_SCALE:
        rs = tl.load(row_scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * rs[:, None]
        if GATED:
            acc_up = acc_up * rs[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACTIVATION)
    if GATED:
        acc = acc * acc_up
    acc = acc * alpha
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        res_rows = offs_m
        if RESIDUAL_PERIODIC:
            res_rows = offs_m % res_period
        res = tl.load(res_ptr + res_rows[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        acc = acc + res.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    M,
    N,
    K,
    alpha,
    res_period,
    stride_am,
    stride_wn,
    stride_om,
    stride_rm,
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
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row tiles walk the columns together so their weight tiles are reused from L2.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N read a valid row instead of masking (their results are never stored).
    rows_a = offs_m % M
    rows_w = offs_n % N
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + (k_start + offs_k)[:, None]  # (BLOCK_K, BLOCK_N) view of w.T
    up_offset = N * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc  # the up-projection accumulator exists only when GATED
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Unmasked main loop (masks that depend on the loop index can stop the pipeliner), then one masked tail step.
    k_len = tl.minimum(k_per_split, K - k_start)
    k_main = k_per_split
    if not EVEN_K:
        k_main = (k_len // BLOCK_K) * BLOCK_K
    for _k in range(0, k_main, BLOCK_K):
        a = tl.load(a_ptrs)
        w = tl.load(w_ptrs)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(a, tl.load(w_ptrs + up_offset), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EVEN_K:
        k_tail = k_len - k_main  # in [0, BLOCK_K); <= 0 for splits past the end of K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_tail, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_tail, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=offs_k[:, None] < k_tail, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)

    if SPLIT_K == 1:
        _epilogue_store(
            acc, acc_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, M, N, alpha, res_period,
            stride_om, stride_rm, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC,
        )  # fmt: skip
    else:
        # Partials: (SPLIT_K, M, n_acc) fp32 with n_acc = N, or 2N (gate columns then up columns) when gated.
        n_acc = N
        if GATED:
            n_acc = 2 * N
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * n_acc + tile_offs, acc, mask=mask)
        if GATED:
            tl.store(partial_ptr + pid_k * M * n_acc + N + tile_offs, acc_up, mask=mask)
        if not SPLIT_COMBINE:
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) release below
            tile = pid_m * num_pid_n + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                total_up = total
                if GATED:
                    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):  # fixed order: the sum does not depend on who arrived last
                    offs = partial_ptr + s * M * n_acc + tile_offs
                    total += tl.load(offs, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        total_up += tl.load(offs + N, mask=mask, other=0.0, cache_modifier=".cg")
                _epilogue_store(
                    total, total_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, M, N, alpha,
                    res_period, stride_om, stride_rm, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL,
                    RESIDUAL_PERIODIC,
                )  # fmt: skip
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch / graph replay


@triton.jit
def gemm_combine_kernel(
    partial_ptr,
    out_ptr,
    bias_ptr,
    row_scale_ptr,
    res_ptr,
    M,
    N,
    alpha,
    res_period,
    stride_om,
    stride_rm,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_PERIODIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Sum the (SPLIT_K, M, n_acc) fp32 partials of `gemm_epilogue_kernel` in split order, run the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    n_acc = N
    if GATED:
        n_acc = 2 * N
    tile_offs = offs_m[:, None] * n_acc + offs_n[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = total
    if GATED:
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # unrolled: every split's load is in flight at once
        total += tl.load(partial_ptr + s * M * n_acc + tile_offs, mask=mask, other=0.0)
        if GATED:
            total_up += tl.load(partial_ptr + s * M * n_acc + N + tile_offs, mask=mask, other=0.0)
    _epilogue_store(
        total, total_up, offs_m, offs_n, out_ptr, bias_ptr, row_scale_ptr, res_ptr, M, N, alpha, res_period,
        stride_om, stride_rm, HAS_BIAS, HAS_ROW_SCALE, ACTIVATION, GATED, HAS_RESIDUAL, RESIDUAL_PERIODIC,
    )  # fmt: skip


def combine_tile(m: int, n: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the split-K combine kernel: 16-row tiles, the widest that still gives two
    programs per SM (64x1024: 16x32 tiles, 128 programs)."""
    block_n = next((bn for bn in (128, 64) if triton.cdiv(m, 16) * triton.cdiv(n, bn) >= 2 * num_sms), 32)
    return 16, block_n, 2 if block_n == 32 else 4


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols:
        raise ValueError(f"{name} must be ({rows}, {cols}), got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have last stride 1, got strides {t.stride()}")


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
    config: GemmConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """`out = residual + alpha * epilogue(a @ w.T)`, accumulated in fp32, stored in `out.dtype`.

    a: (M, K), last stride 1 (any row stride); w: (N_w, K) Linear layout, last stride 1, same dtype as `a`.
    Epilogue, in this order: `* row_scale[:, None]` (fp32 (M,)), `+ bias` ((N_w,)), then
    `act(y)` (activation in None / "gelu_tanh" / "silu"), or if `gated` (w = [gate rows; up rows], N_w = 2N)
    `act(gate) * up` with act defaulting to gelu_tanh; `* alpha`; `+ residual` ((M, N), or (P, N) read at row
    r % P with `residual_period=P`; may alias `out`). out: (M, N), last stride 1, any dtype.
    Fast path: row strides of `a` and `w` multiples of 8 elements (16 bytes), so pad odd K (SigLIP's 588) in the
    allocation and pass `[:, :K]` views; other strides work but do not pipeline.
    config: launch config (default: the GPU's table or the heuristic). workspace: split-K scratch (default: the
    device's shared one). Launch-only (no allocation once the workspace is sized, no host sync): graph-capturable.
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
    if residual is not None:
        _check_rows("residual", residual, residual_period or m, n)
    elif residual_period is not None:
        raise ValueError("residual_period given without residual")

    if a.is_cuda and (a.stride(0) % 8 or w.stride(0) % 8) and (m, n, k) not in _WARNED_UNALIGNED:
        _WARNED_UNALIGNED.add((m, n, k))
        warnings.warn(
            f"gemm {m}x{n}x{k}: row strides {a.stride(0)}, {w.stride(0)} are not multiples of 8 elements, so loads "
            "cannot be 16-byte vectors and the K loop will not pipeline; allocate rows padded to a multiple of 8 "
            "and pass a [:, :K] view",
            stacklevel=2,
        )
    cfg = config or gemm_config(m, n, k, gated=gated, dtype=a.dtype, device=a.device)
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    combine = cfg.split_k > 1 and cfg.combine == 1
    if cfg.split_k > 1:
        ws = workspace or default_workspace(a.device)
        partials = ws.floats(cfg.split_k * m * n * (2 if gated else 1))
        counters = out if combine else ws.counters(num_tiles)
    else:
        partials = counters = out  # unused
    dummy = out
    epilogue_args = (
        bias if bias is not None else dummy,
        row_scale if row_scale is not None else dummy,
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
    _launch(gemm_epilogue_kernel, (num_tiles, cfg.split_k), out)(
        a, w, out, *epilogue_args, partials, counters,
        m, n, k, float(alpha), residual_period or m,
        a.stride(0), w.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        **flags,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m,
        EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        SPLIT_COMBINE=combine,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if combine:
        cbm, cbn, cwarps = combine_tile(m, n)
        _launch(gemm_combine_kernel, (triton.cdiv(m, cbm), triton.cdiv(n, cbn)), out)(
            partials, out, *epilogue_args, m, n, float(alpha), residual_period or m,
            out.stride(0), residual.stride(0) if residual is not None else 0,
            **flags, BLOCK_M=cbm, BLOCK_N=cbn, SPLIT_K=cfg.split_k, num_warps=cwarps, num_stages=1,
        )  # fmt: skip
    return out


def _launch(kernel, grid, like: torch.Tensor):
    """`kernel[grid]`; on meta tensors (a shape-only dry run, e.g. compile_check) a real kernel launch is a no-op,
    while a tool that replaced the kernel (a recorder) still sees the call."""
    if like.device.type == "meta" and type(kernel).__module__.startswith("triton."):
        return lambda *args, **kwargs: None
    return kernel[grid]
