"""GEMM against a PyTorch-Linear weight with the epilogues π0 needs, optionally split over K.

`out = residual + out_scale * alpha * act(row_scale * (a @ w.T) + bias)`, or with `gated` the GeGLU of a fused
[gate; up] weight. The per-row scale is how RMSNorm fuses into the next GEMM (its scale vector folded into `w`),
`alpha` and a residual aliasing `out` give the Euler step `x += dt * v` and in-place residual adds, a periodic
residual adds SigLIP's position embedding to every view, the output-column scale is π0.5's adaptive-norm gate
before its residual. `rope=dict(...)` (the arguments of `rope_qk` but `qkv`) makes a fused-QKV GEMM rotate Q in
place and write rotated K and plain V into the KV cache in its epilogue.

This module checks the arguments, picks the launch config (`launch_configs`) and the kernel: the TMA kernel
(`gemm_tma.py`, `config.tma` > 0, where it applies) or the pointer-load kernel and its split-K combine
(`gemm_pointer.py`).
"""

from __future__ import annotations

import warnings

import torch
import triton

from .cublas_choice import cublas_faster, cublas_gemm
from .float32_dot import dot_precision
from .gemm_pointer import combine_tile, gemm_combine_kernel, gemm_epilogue_kernel
from .gemm_stream_k import gemm_stream_k, stream_k_workspace
from .gemm_tma import gemm_tma, num_programs, tma_applies
from .launch_configs import GemmConfig, gemm_config
from .pdl import launch
from .rope import check_rope_inputs
from .workspace import Workspace, default_workspace

__all__ = ["ACTIVATIONS", "gemm", "workspace_need"]

ACTIVATIONS = {None: 0, "gelu_tanh": 1, "silu": 2}
_WARNED_UNALIGNED: set[tuple[int, int, int]] = set()


def workspace_need(m: int, n: int, cfg: GemmConfig, *, paired: bool = False, k: int | None = None,
                   programs: int = 132) -> tuple[int, int]:  # fmt: skip
    """(floats, counters) of workspace a launch with `cfg` uses; `n` counts tile columns (pair columns when
    `paired`: gated, or RoPE's head halves): the split-K partials, and a counter a tile for the in-kernel merge;
    for stream-K (`cfg.tma == 4`, needs `k`), the shared tiles' partial slots on `programs` SMs."""
    if cfg.tma == 4 and cfg.split_k == 1:
        if k is None:
            raise ValueError("workspace_need: a stream-K config (tma 4) needs k")
        return stream_k_workspace(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, programs, paired=paired)
    if cfg.split_k == 1:
        return 0, 0
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return cfg.split_k * m * n * (2 if paired else 1), 0 if cfg.combine == 1 else tiles


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
    out_scale: torch.Tensor | None = None,
    rope: dict | None = None,
    config: GemmConfig | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """`out = residual + out_scale * alpha * epilogue(a @ w.T)`, accumulated in fp32, stored in `out.dtype`.

    a: (M, K), last stride 1 (any row stride); w: (N_w, K) Linear layout, last stride 1, same dtype as `a`.
    Epilogue, in this order: `* row_scale[:, None]` (fp32 (M,)), `+ bias` ((N_w,)), then
    `act(y)` (activation in None / "gelu_tanh" / "silu"), or if `gated` (w = [gate rows; up rows], N_w = 2N)
    `act(gate) * up` with act defaulting to gelu_tanh; `* alpha`; `* out_scale[None, :]` (contiguous (N,), any
    float dtype: π0.5's adaptive-norm gate, `x + y * gate`); bias and out_scale may instead hold G rows, (G, N_w) /
    (G, N) with unit column stride and one row stride, M = G * R: output row r takes row r // R (π0.5's batch
    elements, each at its own Euler step; both 2-D or neither); `+ residual` ((M, N), or (P, N) read at row r % P with
    `residual_period=P`; may alias `out`). out: (M, N), last stride 1, any dtype.
    rope: a dict of `rope_qk`'s arguments but qkv (cos, sin, k_cache, v_cache, num_q_heads, num_kv_heads,
    head_dim, cache_offset=0, q_scale=1.0), for a fused [Q; K; V] weight (N_w = (Hq + 2 Hkv) D): equal to this GEMM
    then `rope_qk(out, **rope)` (Q rotated in `out`, rotated K and plain V in the cache rows), except that the K and
    V columns of `out` are scratch (not written by our kernels; cuBLAS's form leaves its GEMM output there) and our
    kernels round once (the fp32 accumulator is rotated). Only with
    row_scale and bias (π0.5's folded shift, added before the rotation; no activation, gating, alpha, out_scale or
    residual); k_cache and v_cache share strides. A tile column then pairs the weight rows `h*D + i` and `h*D + D/2 + i` of
    one head, so the rotation partners meet in one program (and `config.block_n` counts pairs, as for `gated`).
    Fast path: row strides of `a` and `w` multiples of 8 elements (16 bytes), so pad odd K (SigLIP's 588) in the
    allocation and pass `[:, :K]` views; other strides work but do not pipeline.
    Without `config`, a GEMM whose table entry measured cuBLAS at <= 0.9x our time and whose epilogue one cuBLAS call
    expresses (plain, bias, bias + gelu_tanh, residual aliasing `out`, + bias; RoPE as cuBLAS + `rope_qk`) runs on
    cuBLAS (`cublas_choice`).
    config: launch config (default: the GPU's table or the heuristic); `config.tma` > 0 runs `gemm_tma`'s TMA
    kernel where `gemm_tma.tma_applies` (split-K only with the combine kernel, RoPE only with BLOCK_N dividing the
    half head, 16-byte aligned operands), elsewhere the pointer kernel with the same tiles. workspace: split-K
    scratch (default: the device's shared one). Launch-only (no allocation once the workspace is sized, no host
    sync): graph-capturable.
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
    mod_rows, mod_stride = _modulation_rows(m, n_w, n, bias, out_scale)
    if row_scale is not None and (
        row_scale.shape != (m,) or row_scale.dtype != torch.float32 or row_scale.stride(0) != 1
    ):
        raise ValueError(f"row_scale must be contiguous float32 ({m},), got {row_scale.dtype} {tuple(row_scale.shape)}")
    if residual is not None:
        _check_rows("residual", residual, residual_period or m, n)
    elif residual_period is not None:
        raise ValueError("residual_period given without residual")
    rope_args, rope_flags = (
        (out, out, out, out, 1, 0, 1.0, 0, 0, 0, 0, 0),
        dict(ROPE_HALF=0, ROPE_Q_HEADS=0, ROPE_KV_HEADS=0),
    )
    if rope is not None:
        if gated or activation is not None or alpha != 1.0 or residual is not None or out_scale is not None:
            raise ValueError("rope takes only row_scale and bias: no activation, gated, alpha, out_scale or residual")
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
    if (
        config is None
        and cublas_faster(m, n, k, a.dtype, a.device, rope=rope is not None)
        and cublas_gemm(a, w, out, bias=bias, activation=activation, residual=residual, gated=gated, rope=rope,
                        row_scale=row_scale, out_scale=out_scale, alpha=alpha, residual_period=residual_period)
    ):  # fmt: skip
        return out  # the table measured cuBLAS faster at this shape (`cublas_choice`)
    cfg = config or gemm_config(m, n, k, gated=gated, dtype=a.dtype, device=a.device, rope=rope is not None)
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n_cols, cfg.block_n)
    combine = cfg.split_k > 1 and cfg.combine == 1
    partials = counters = out  # unused without split-K
    on_tma = tma_applies(a, w, cfg, rope_half=rope_flags["ROPE_HALF"])  # else the pointer kernel, same tiles
    stream_k = on_tma and cfg.tma == 4
    programs = num_programs(a.device) if stream_k else 0
    if cfg.split_k > 1 or stream_k:
        ws = workspace or default_workspace(a.device)
        n_floats, n_counters = workspace_need(m, n_cols, cfg, paired=paired, k=k, programs=programs)
        partials = ws.floats(n_floats) if n_floats else out
        counters = out if combine or not n_counters else ws.counters(n_counters)
    dummy = out
    epilogue_args = (
        bias if bias is not None else dummy,
        row_scale if row_scale is not None else dummy,
        residual if residual is not None else dummy,
        out_scale if out_scale is not None else dummy,
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_ROW_SCALE=row_scale is not None,
        ACTIVATION=act,
        GATED=gated,
        HAS_RESIDUAL=residual is not None,
        RESIDUAL_PERIODIC=residual_period is not None,
        HAS_OUT_SCALE=out_scale is not None,
        MOD_ROWS=mod_rows,
        MOD_STRIDE=mod_stride,
    )
    residual_stride = residual.stride(0) if residual is not None else 0
    cos, sin, k_cache, v_cache, rope_t, cache_offset, q_scale, *rope_strides = rope_args
    if stream_k:
        gemm_stream_k(a, w, out, cfg, n_cols, epilogue_args, partials, counters, rope_args, alpha, residual_period,
                      residual_stride, flags, rope_flags, programs)  # fmt: skip
    elif on_tma:
        gemm_tma(a, w, out, cfg, n_cols, epilogue_args, partials, rope_args, alpha, residual_period,
                 residual_stride, flags, rope_flags)  # fmt: skip
    else:
        launch(gemm_epilogue_kernel, (num_tiles, cfg.split_k), out)(
            a, w, out, *epilogue_args, partials, counters, cos, sin, k_cache, v_cache,
            m, n_cols, k, float(alpha), residual_period or m, rope_t, cache_offset, q_scale,
            a.stride(0), w.stride(0), out.stride(0), residual_stride, *rope_strides,
            **flags,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k,
            GROUP_M=cfg.group_m,
            EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
            DOT_PRECISION=dot_precision(a.dtype),
            SPLIT_COMBINE=combine,
            **rope_flags,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    if combine:
        cbm, cbn, cwarps = combine_tile(m, n_cols)
        launch(gemm_combine_kernel, (triton.cdiv(m, cbm), triton.cdiv(n_cols, cbn)), out)(
            partials, out, *epilogue_args, cos, sin, k_cache, v_cache, m, n_cols, float(alpha),
            residual_period or m, rope_t, cache_offset, q_scale, out.stride(0), residual_stride, *rope_strides,
            **flags, BLOCK_M=cbm, BLOCK_N=cbn, SPLIT_K=cfg.split_k, **rope_flags, num_warps=cwarps, num_stages=1,
        )  # fmt: skip
    return out


def _modulation_rows(m: int, n_w: int, n: int, bias: torch.Tensor | None,
                     out_scale: torch.Tensor | None) -> tuple[int, int]:  # fmt: skip
    """(MOD_ROWS, MOD_STRIDE) of the epilogue: (0, 0) for (N_w,) / (N,) vectors; for (G, ·) rows, the output rows
    per row (M / G) and their row stride. Checks the shapes, naming the argument."""
    given = {name: t for name, t, cols in (("bias", bias, n_w), ("out_scale", out_scale, n)) if t is not None}
    for name, t, cols in (("bias", bias, n_w), ("out_scale", out_scale, n)):
        if t is None:
            continue
        if t.dim() == 1 and (t.shape[0] != cols or t.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous ({cols},) or rows (G, {cols}), got {tuple(t.shape)}")
        if t.dim() == 2 and (t.shape[1] != cols or t.stride(1) != 1 or t.shape[0] < 1 or m % t.shape[0]):
            raise ValueError(f"{name} rows: expected (G, {cols}) with unit column stride and G dividing the {m} rows, "
                             f"got {tuple(t.shape)} strides {t.stride()}")  # fmt: skip
        if t.dim() not in (1, 2):
            raise ValueError(f"{name} must be ({cols},) or (G, {cols}), got {tuple(t.shape)}")
    dims = {t.dim() for t in given.values()}
    if dims != {2}:
        if len(dims) > 1:
            raise ValueError("bias and out_scale: expected both 1-D or both 2-D (rows), found one of each")
        return 0, 0
    rows = {t.shape[0] for t in given.values()}
    strides = {t.stride(0) for t in given.values()}
    if len(rows) > 1 or len(strides) > 1:
        raise ValueError(f"bias and out_scale rows: expected the same row count and stride, found "
                         f"{[tuple(t.shape) for t in given.values()]} strides {[t.stride(0) for t in given.values()]}")  # fmt: skip
    return m // rows.pop(), strides.pop()
