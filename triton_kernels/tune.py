"""Measure candidate launch configs on the current GPU and write the winners to `configs/<gpu-name>.json`.

`tune(shapes, gpu_name)` times every candidate with `triton.testing.do_bench` (which flushes L2 between runs, so
the skinny GEMMs are measured at weight bandwidth, as in real inference), checks each result against torch once,
and merges the fastest into the table (entries keep their time in `us`, the torch time in `torch_us`). `vla-rt
tune` calls it; on a machine without CUDA it raises.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable

import torch

from .attention import attention, attention_reference
from .gemm import gemm
from .launch_configs import (
    SMEM_BYTES,
    AttentionConfig,
    GemmConfig,
    _attention_config_cuda,
    _gemm_config_cuda,
    attention_key,
    dump_table,
    gemm_key,
    heads_per_program,
    load_table,
    table_path,
)
from .launch_configs import gpu_name as current_gpu_name
from .shapes import AttentionShape, GemmShape, pi0_attention_shapes, pi0_gemm_shapes

__all__ = ["attention_candidates", "gemm_candidates", "seed_table", "tune"]


def gemm_candidates(m: int, n: int, k: int, gated: bool, elem_bytes: int = 2, quick: bool = False) -> list[GemmConfig]:
    """Configs worth timing for this shape: split-K and narrow tiles for skinny M, big tiles for wide M.
    `quick` keeps one stage count and one BLOCK_K (about 15 candidates instead of about 80)."""
    out = []
    if m <= 128:
        block_m = 64 if m > 32 else max(16, 1 << math.ceil(math.log2(m)))
        for block_n in (32, 64, 128):
            for block_k in (64, 128):
                for split_k in (1, 2, 4, 8, 16):
                    if split_k > 1 and k // split_k < block_k:
                        continue
                    for stages in (3, 4, 6):
                        out.append(GemmConfig(block_m, block_n, block_k, split_k, 1, 4, stages))
    else:
        for block_m, block_n, warps in ((128, 256, 8), (128, 128, 8), (128, 128, 4), (128, 64, 4), (64, 256, 8),
                                        (64, 128, 4), (256, 128, 8)):  # fmt: skip
            for block_k in (64, 128):
                for split_k in (1, 2):
                    for stages in (3, 4, 5):
                        out.append(GemmConfig(block_m, block_n, block_k, split_k, 8, warps, stages))
    rows = 2 if gated else 1
    if quick:
        out = [c for c in out if c.num_stages in (4, 3 if gated else 4) and c.block_k == (128 if m <= 128 else 64)]
    return [
        c
        for c in out
        if (c.block_m + c.block_n * rows) * c.block_k * elem_bytes * c.num_stages <= SMEM_BYTES
        and c.block_m * c.block_n * rows <= 128 * 256  # fp32 accumulators must fit in registers
    ]


def attention_candidates(s: AttentionShape, quick: bool = False) -> list[AttentionConfig]:
    block_d = max(16, 1 << math.ceil(math.log2(s.d)))
    hpp_max = heads_per_program(s.hq, s.hkv)
    out = []
    for hpp in sorted({1, hpp_max}):
        for block_m in (32, 64, 128):
            if block_m % hpp or (block_d >= 256 and block_m > 64):
                continue
            for block_n in (32, 64, 128):
                if block_d >= 256 and block_n > 64:
                    continue
                for splits in (1, 2, 4, 8, 16):
                    if splits > math.ceil(s.tk / block_n):
                        continue
                    for warps in (4, 8):
                        if quick and (block_n != 64 or warps != (8 if block_d >= 256 else 4)):
                            continue
                        out.append(AttentionConfig(block_m, block_n, hpp, splits, warps, 2))
    return out


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3  # ms -> us


def _gemm_inputs(s: GemmShape, dtype: torch.dtype, device: torch.device) -> dict:
    n_w = s.n * (2 if s.gated else 1)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype, std=1.0):
        return (torch.randn(*shape, device=device, generator=g) * std).to(dt)

    return dict(
        a=rand(s.m, s.k),
        w=rand(n_w, s.k, std=s.k**-0.5),
        out=torch.empty(s.m, s.n, device=device, dtype=dtype),
        bias=rand(n_w) if s.bias else None,
        row_scale=rand(s.m, dt=torch.float32).abs() + 0.5 if s.row_scale else None,
        residual=rand(s.m, s.n) if s.residual else None,
        activation=s.activation,
        gated=s.gated,
    )


def _gemm_torch(a, w, out, bias, row_scale, residual, activation, gated):
    y = (a.float() @ w.float().T) * (row_scale[:, None] if row_scale is not None else 1.0)
    y = y + (bias.float() if bias is not None else 0.0)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.gelu(gate, approximate="tanh") * up
    elif activation == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = torch.nn.functional.silu(y)
    return y + (residual.float() if residual is not None else 0.0)


def _tune_gemm(s: GemmShape, dtype, device, verbose, quick) -> dict:
    x = _gemm_inputs(s, dtype, device)
    ref = _gemm_torch(**x)
    args = {k: v for k, v in x.items() if k not in ("a", "w", "out")}
    best = None
    for cfg in gemm_candidates(s.m, s.n, s.k, s.gated, x["a"].element_size(), quick):
        try:
            gemm(x["a"], x["w"], x["out"], config=cfg, **args)
            err = ((x["out"].float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"relative error {err:.2e}")
            t = _bench(lambda cfg=cfg: gemm(x["a"], x["w"], x["out"], config=cfg, **args))
        except Exception as e:  # a config that fails to compile or run is skipped, not fatal
            if verbose:
                print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    a, w = x["a"], x["w"]
    torch_us = _bench(lambda: torch.mm(a, w.T))
    if best is None:
        raise RuntimeError(f"no candidate config ran for {s}")
    return {**best[1].to_dict(), "us": round(best[0], 2), "torch_us": round(torch_us, 2)}


def _tune_attention(s: AttentionShape, dtype, device, verbose, quick) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(s.b, s.tq, s.hq, s.d, device=device, generator=g).to(dtype)
    k = torch.randn(s.b, s.tk, s.hkv, s.d, device=device, generator=g).to(dtype)
    v = torch.randn(s.b, s.tk, s.hkv, s.d, device=device, generator=g).to(dtype)
    out = torch.empty_like(q)
    blocks = {}
    if s.masked:  # prefix keys block 0; the last tq keys (the suffix in the expert case) one more block
        k_block = torch.zeros(s.b, s.tk, dtype=torch.int32, device=device)
        k_block[:, s.tk - s.tq :] = 1 if s.tq < s.tk else 0
        blocks = dict(q_block=torch.ones(s.b, s.tq, dtype=torch.int32, device=device), k_block=k_block)
    ref = attention_reference(q, k, v, scale=s.d**-0.5, **blocks)
    best = None
    for cfg in attention_candidates(s, quick):
        try:
            attention(q, k, v, out, scale=s.d**-0.5, config=cfg, **blocks)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"relative error {err:.2e}")
            t = _bench(lambda cfg=cfg: attention(q, k, v, out, scale=s.d**-0.5, config=cfg, **blocks))
        except Exception as e:
            if verbose:
                print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError(f"no candidate config ran for {s}")
    return {**best[1].to_dict(), "us": round(best[0], 2)}


def tune(
    shapes: Iterable[GemmShape] | None = None,
    gpu_name: str | None = None,
    *,
    attention_shapes: Iterable[AttentionShape] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    path=None,
    quick: bool = False,
    verbose: bool = True,
) -> dict:
    """Time candidates for each GEMM (default: every π0 GEMM) and attention shape on this GPU; write the table.

    gpu_name: the table to write (default: this GPU's). Returns the table as written. Takes minutes: each candidate
    is compiled once and timed with L2 flushed; `quick` times about 15 candidates a shape instead of about 80.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("tune needs a CUDA GPU")
    device = torch.device("cuda")
    gpu = (gpu_name or current_gpu_name(device)).replace(" ", "-")
    shapes = list(pi0_gemm_shapes() if shapes is None else shapes)
    attention_shapes = list(pi0_attention_shapes() if attention_shapes is None else attention_shapes)
    path = path or table_path(gpu)
    table = json.loads(path.read_text()) if path.exists() else {}
    table["gpu"] = torch.cuda.get_device_name(device)
    table["source"] = f"tune() on {table['gpu']}, {datetime.date.today().isoformat()}, triton.testing.do_bench"
    dname = str(dtype).removeprefix("torch.")
    for s in shapes:
        entry = _tune_gemm(s, dtype, device, verbose, quick)
        table.setdefault("gemm", {}).setdefault(dname, {})[gemm_key(s.m, s.n, s.k, s.gated)] = entry
        if verbose:
            print(f"{s.name:<22} {gemm_key(s.m, s.n, s.k, s.gated):<22} {entry}", flush=True)
    for s in attention_shapes:
        entry = _tune_attention(s, dtype, device, verbose, quick)
        table.setdefault("attention", {}).setdefault(dname, {})[attention_key(s.b, s.tq, s.tk, s.hq, s.hkv, s.d)] = (
            entry
        )
        if verbose:
            print(f"{s.name:<22} {entry}", flush=True)
    path.write_text(dump_table(table))
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    return table


def seed_table(gpu: str = "NVIDIA-H200", num_sms: int = 132, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Fill a table's missing π0 entries from the heuristics (no GPU needed; `tune` later replaces them)."""
    from .launch_configs import attention_heuristic, gemm_heuristic

    path = table_path(gpu)
    table = json.loads(path.read_text()) if path.exists() else {"gpu": gpu.replace("-", " ")}
    table.setdefault("source", "seeded from launch_configs heuristics (not measured); run tune() to measure")
    dname, elem = str(dtype).removeprefix("torch."), torch.tensor([], dtype=dtype).element_size()
    gemms = table.setdefault("gemm", {}).setdefault(dname, {})
    for s in pi0_gemm_shapes(chunks=(50, 63)):
        cfg = gemm_heuristic(s.m, s.n, s.k, gated=s.gated, elem_bytes=elem, num_sms=num_sms)
        gemms.setdefault(gemm_key(s.m, s.n, s.k, s.gated), cfg.to_dict())
    attns = table.setdefault("attention", {}).setdefault(dname, {})
    for s in pi0_attention_shapes():
        cfg = attention_heuristic(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, num_sms=num_sms)
        attns.setdefault(attention_key(s.b, s.tq, s.tk, s.hq, s.hkv, s.d), cfg.to_dict())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(table))
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    return table
