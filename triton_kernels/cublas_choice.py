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

The RoPE form is two launches, so the tuner times it as such (`cublas_us` of a `:rope` entry; no plain `torch_us`
stands in for it): at the server's batched expert shapes our GEMM with the RoPE epilogue is the slow one (H100,
408 rows: 11.7 µs against cuBLAS's plain 6.1), at one robot's 51-64 rows the fused epilogue wins.

A residual with a bias stays ours: cuBLAS would need two calls (`out.addmm_`, then the bias), which rounds the
residual stream to bf16 twice. That is what SigLIP's out projection and fc2 took, and it moved the engine's actions
from a median 7.6e-3 to 1.25e-2 against the float32 reference (H200, 2 views, prompt 20, chunk 50, 20 draws,
`tools/accuracy_bisect.py`; every other form: 7.5-7.6e-3, as all-Triton). Gated, RoPE, row-scaled, alpha, out_scale
and periodic-residual GEMMs stay ours too (a RoPE GEMM's row scale and bias go to `rope_qk`) (their epilogues are where the fusion pays). cuBLAS accumulates in
float32 as ours does, in another order: the engine stays within its accuracy bound, not bit-identical to the
all-Triton engine. `VLA_RT_GEMM_CUBLAS=off` keeps every GEMM on Triton (A/B).
"""

from __future__ import annotations

import functools
import os

import torch

from .launch_configs import _dtype_name, _table_lookup, gemm_key, gpu_name, load_table
from .rope import rope_qk

FASTER = 0.9  # cuBLAS must take at most this share of our measured time (table noise is a few percent)
ENV = "VLA_RT_GEMM_CUBLAS"


def cublas_enabled() -> bool:
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "off"):
        raise ValueError(f"{ENV}: expected 'auto' or 'off', found {value!r}")
    return value == "auto"


def cublas_faster(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, rope: bool = False) -> bool:
    """True when the GPU's table measured cuBLAS at most FASTER x our time for this shape (not gated; `rope`: the
    RoPE-epilogue entry, against cuBLAS + `rope_qk`): the entry `gemm` itself would run, i.e. this M or the smallest
    tabled M above it (`_table_lookup`)."""
    if device.type != "cuda" or not cublas_enabled():
        return False
    return _cublas_faster(m, n, k, _dtype_name(dtype), gpu_name(device), rope)


@functools.lru_cache(maxsize=4096)
def _cublas_faster(m: int, n: int, k: int, dtype: str, gpu: str, rope: bool = False) -> bool:
    entries = load_table(gpu).get("gemm", {}).get(dtype, {})
    entry = _table_lookup(entries, m, gemm_key(m, n, k, False, rope=rope).removeprefix(str(m)))
    # `cublas_us`: cuBLAS timed with the shape's own epilogue (the tuner since 2026-12-04); else the plain GEMM,
    # except for RoPE, whose second launch the plain GEMM's time leaves out
    fallback = None if rope or entry is None else entry.get("torch_us")
    cublas_us = None if entry is None else entry.get("cublas_us", fallback)
    if cublas_us is None or "us" not in entry:
        return False
    return float(cublas_us) <= FASTER * float(entry["us"])


def cublas_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, bias: torch.Tensor | None = None,
                activation: str | None = None, residual: torch.Tensor | None = None, gated: bool = False,
                rope: dict | None = None, row_scale: torch.Tensor | None = None,
                out_scale: torch.Tensor | None = None, alpha: float = 1.0,
                residual_period: int | None = None) -> bool:  # fmt: skip
    """Runs `out = [residual +] act(a @ w.T [+ bias])` as the table above lists and returns True; returns False,
    having done nothing, for an epilogue or layout that one cuBLAS call does not express. Takes `gemm`'s epilogue
    arguments, so `gemm` and the tuner's timing of it share this one decision."""
    if rope is not None:
        return _cublas_rope(a, w, out, bias=bias, row_scale=row_scale, rope=rope, others=(
            gated, activation is not None, residual is not None, out_scale is not None, alpha != 1.0,
            residual_period is not None))  # fmt: skip
    if gated or row_scale is not None or out_scale is not None or alpha != 1.0:
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


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
