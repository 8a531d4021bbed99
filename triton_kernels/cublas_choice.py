"""cuBLAS for the GEMMs where the launch table measured it faster, when one cuBLAS call expresses the epilogue.

Why: the tuner times cuBLAS beside our best config for every shape (`torch_us` beside `us`, same timer, in a CUDA
Graph). On the H200 the prefix's wide GEMMs lose to it by 15-40%: Gemma's down projection at 532 rows (one robot,
2 views, prompt 20) takes 82.0 µs against cuBLAS's 54.5; SigLIP's fc2 at 16 images 91.9 against 52.8. The action
expert's skinny GEMMs are ours (cuBLAS is slower there or needs the epilogues we fuse). So `gemm` hands a GEMM to
cuBLAS when the table says cuBLAS takes at most `FASTER` times our time for that shape (`cublas_us`, timed by the
tuner with the shape's own epilogue, else `torch_us`, the plain GEMM), and its epilogue is one that cuBLAS computes
in the same call:

    plain              out = a @ w.T                      torch.mm
    bias               out = a @ w.T + bias               torch.addmm
    bias + gelu_tanh   out = gelu_tanh(a @ w.T + bias)    torch._addmm_activation (cuBLASLt's GELU_BIAS epilogue)
    residual == out    out += a @ w.T                     out.addmm_ (beta = 1: the residual read in the GEMM)
    rope [row scale, bias]  torch.mm, then `rope_qk` applying the row scale and bias before the rotation
    gated [row scale, bias]  torch.mm into bf16 scratch (M, 2N), then the split-K combine kernel as a one-split
                             combine: GeGLU, row scale, bias (a row or π0.5's rows), alpha, out_scale, residual

The RoPE and gated forms are two launches, so the tuner times them as such (`cublas_us` of a `:rope` / `:gated`
entry; no plain `torch_us` stands in for it): at the server's batched expert shapes our paired GEMMs are the slow
ones (H100, 408 rows: QKV + RoPE 11.7 µs, gate/up 17.0, against cuBLAS's plain 6.1 and 12.6), at one robot's
51-64 rows the fused epilogues win.

A residual with a bias stays ours: cuBLAS would need two calls (`out.addmm_`, then the bias), which rounds the
residual stream to bf16 twice. That is what SigLIP's out projection and fc2 took, and it moved the engine's actions
from a median 7.6e-3 to 1.25e-2 against the float32 reference (H200, 2 views, prompt 20, chunk 50, 20 draws,
`tools/accuracy_bisect.py`; every other form: 7.5-7.6e-3, as all-Triton). Gated, RoPE, row-scaled, alpha, out_scale
and periodic-residual GEMMs stay ours too (a RoPE GEMM's row scale and bias go to `rope_qk`, a gated GEMM's
epilogue to the combine kernel) (their epilogues are where the fusion pays). cuBLAS accumulates in
float32 as ours does, in another order: the engine stays within its accuracy bound, not bit-identical to the
all-Triton engine. `VLA_RT_GEMM_CUBLAS=off` keeps every GEMM on Triton (A/B).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .gemm_epilogue import ACTIVATIONS
from .gemm_pointer import combine_tile, gemm_combine_kernel
from .launch_configs import _dtype_name, _table_lookup, gemm_key, gpu_name, load_table
from .pdl import launch
from .rope import rope_qk
from .workspace import Workspace, default_workspace

FASTER = 0.9  # cuBLAS must take at most this share of our measured time (table noise is a few percent)
ENV = "VLA_RT_GEMM_CUBLAS"


def cublas_enabled() -> bool:
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "off"):
        raise ValueError(f"{ENV}: expected 'auto' or 'off', found {value!r}")
    return value == "auto"


def cublas_faster(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, gated: bool = False,
                  rope: bool = False) -> bool:  # fmt: skip
    """True when the GPU's table measured cuBLAS at most FASTER x our time for this shape (`gated` / `rope`: that
    paired entry, against cuBLAS and its epilogue launch): the entry `gemm` itself would run, i.e. this M or the
    smallest tabled M above it (`_table_lookup`)."""
    if device.type != "cuda" or not cublas_enabled():
        return False
    return _cublas_faster(m, n, k, _dtype_name(dtype), gpu_name(device), gated, rope)


@functools.lru_cache(maxsize=4096)
def _cublas_faster(m: int, n: int, k: int, dtype: str, gpu: str, gated: bool = False, rope: bool = False) -> bool:
    entries = load_table(gpu).get("gemm", {}).get(dtype, {})
    entry = _table_lookup(entries, m, gemm_key(m, n, k, gated, rope=rope).removeprefix(str(m)))
    # `cublas_us`: cuBLAS timed with the shape's own epilogue (the tuner since 2026-12-04); else the plain GEMM,
    # except for the paired forms, whose second launch the plain GEMM's time leaves out
    fallback = None if gated or rope or entry is None else entry.get("torch_us")
    cublas_us = None if entry is None else entry.get("cublas_us", fallback)
    if cublas_us is None or "us" not in entry:
        return False
    return float(cublas_us) <= FASTER * float(entry["us"])


def cublas_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                activation: str | None = None, residual: torch.Tensor | None = None, gated: bool = False,
                rope: dict | None = None, row_scale: torch.Tensor | None = None,
                out_scale: torch.Tensor | None = None, alpha: float = 1.0,
                residual_period: int | None = None, workspace: Workspace | None = None) -> bool:  # fmt: skip
    """Runs `out = [residual +] act(a @ w.T [+ bias])` as the table above lists and returns True; returns False,
    having done nothing, for an epilogue or layout that one cuBLAS call does not express. Takes `gemm`'s epilogue
    arguments, so `gemm` and the tuner's timing of it share this one decision."""
    if rope is not None:
        return _cublas_rope(a, w, out, bias=bias, row_scale=row_scale, rope=rope, others=(
            gated, activation is not None, residual is not None, out_scale is not None, alpha != 1.0,
            residual_period is not None))  # fmt: skip
    if gated:
        return _cublas_gated(a, w, out, bias=bias, row_scale=row_scale, activation=activation, residual=residual,
                             out_scale=out_scale, alpha=alpha, residual_period=residual_period,
                             workspace=workspace)  # fmt: skip
    if row_scale is not None or out_scale is not None or alpha != 1.0:
        return False
    if bias is not None and bias.dim() != 1:  # a bias row per row group (π0.5's batch elements): ours only
        return False
    if (
        residual_period is not None
        or out.dtype != a.dtype
        or (bias is not None and bias.dtype != a.dtype)
        or not out.is_contiguous()
    ):
        return False
    if residual is not None and not _same_view(residual, out):
        return False
    wt = w.t()
    if activation == "gelu_tanh":
        # the tanh approximation on CUDA only: PyTorch's CPU `_addmm_activation` applies the exact (erf) GELU
        if bias is None or residual is not None or not a.is_cuda:
            return False
        torch._addmm_activation(bias, a, wt, use_gelu=True, out=out)
    elif activation is not None:
        return False
    elif residual is not None:
        if bias is not None:  # two calls, two bf16 roundings of the residual stream (see above)
            return False
        out.addmm_(a, wt)
    elif bias is not None:
        torch.addmm(bias, a, wt, out=out)
    else:
        torch.mm(a, wt, out=out)
    return True


def _cublas_rope(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None,
                 row_scale: torch.Tensor | None, rope: dict, others: tuple[bool, ...]) -> bool:  # fmt: skip
    """The RoPE form: `out = a @ w.T` by cuBLAS, then `rope_qk` on `out` applies the row scale and bias (a (N,) row
    or π0.5's (G, N) rows) in fp32 before rotating Q in place and writing K and V to the cache. Q, K and V are
    rounded twice (the GEMM's output, then the rotated values), where the fused epilogue rounds once."""
    if any(others) or out.dtype != a.dtype or not out.is_contiguous():
        return False
    if bias is not None and bias.dtype != a.dtype:
        return False
    torch.mm(a, w.t(), out=out)
    rope_qk(out, **rope, row_scale=row_scale, bias=bias)
    return True


def _cublas_gated(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, bias, row_scale, activation, residual,
                  out_scale, alpha: float, residual_period, workspace: Workspace | None) -> bool:  # fmt: skip
    """The gated form: `[gate | up] = a @ w.T` by cuBLAS into bf16 scratch (the workspace's floats, M x 2N), then
    `gemm_combine_kernel` as a one-split combine of that buffer: the very epilogue code our kernels run (GeGLU or
    the activation's gate, row scale, bias or π0.5's bias rows, alpha, out_scale, residual). Gate and up are rounded
    to bf16 once before it, where the fused epilogue reads the fp32 accumulators."""
    if a.dtype not in (torch.bfloat16, torch.float16) or out.stride(1) != 1:
        return False
    m, n = out.shape
    ws = workspace or default_workspace(a.device)
    scratch = ws.floats(m * n).view(a.dtype).view(m, 2 * n)  # m * 2n 16-bit values in m * n floats
    torch.mm(a, w.t(), out=scratch)
    mod_rows, mod_stride = 0, 0
    rows = next((t for t in (bias, out_scale) if t is not None and t.dim() == 2), None)
    if rows is not None:  # π0.5's per-row-group modulation (gemm checked both are rows, or neither)
        mod_rows, mod_stride = m // rows.shape[0], rows.stride(0)
    block_m, block_n, warps = combine_tile(m, n)
    dummy = out
    launch(gemm_combine_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), out)(
        scratch, out, bias if bias is not None else dummy, row_scale if row_scale is not None else dummy,
        residual if residual is not None else dummy, out_scale if out_scale is not None else dummy,
        dummy, dummy, dummy, dummy, m, n, float(alpha), residual_period or m, 1, 0, 1.0, out.stride(0),
        residual.stride(0) if residual is not None else 0, 0, 0, 0, 0, 0,
        HAS_BIAS=bias is not None, HAS_ROW_SCALE=row_scale is not None,
        ACTIVATION=ACTIVATIONS["gelu_tanh" if activation is None else activation], GATED=True,
        HAS_RESIDUAL=residual is not None, RESIDUAL_PERIODIC=residual_period is not None,
        HAS_OUT_SCALE=out_scale is not None, MOD_ROWS=mod_rows, MOD_STRIDE=mod_stride,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=1, num_warps=warps, num_stages=1,
    )  # fmt: skip
    return True


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
