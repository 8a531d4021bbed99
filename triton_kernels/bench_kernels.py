"""Time every kernel at the real π0 shapes against torch / cuBLAS on the GPU and print a table.

Each measurement captures a CUDA Graph of back-to-back launches (the way the engine runs them, so launch gaps are
the in-graph ones) and times replays with CUDA events. GEMM launches cycle through enough weight copies to exceed
twice the L2, so skinny GEMMs are measured at HBM bandwidth as in inference, not out of L2. Columns: our kernel,
cuBLAS alone (`torch.mm`, the floor ANCHORS.md quotes), torch with the epilogue as separate ops, the roofline
max(bytes / 4.23 TB/s, FLOPs / 800 TFLOP/s), the speedup over cuBLAS (GEMMs) or torch (the rest), and what our
kernel reaches (weight TB/s for skinny GEMMs, TFLOP/s otherwise).

The RoPE GEMM (the action expert's QKV with the RoPE epilogue, kernel `gemm+rope`) has `unfused_us` beside it: the
kernels it replaces (the GEMM with row_scale, then rope_qk, each at its table config) timed the same way; the
speedup column is then unfused / fused.

    python -m vla_rt.triton_kernels.bench_kernels [--views 1,3] [--out kernels.json]
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import attention
from .gemm import gemm
from .norms import layernorm, rms_factor
from .patchify import patchify
from .rope import rope_qk
from .shapes import pi0_attention_shapes, pi0_gemm_shapes

__all__ = ["bench_kernels", "replay_times_us", "time_in_graph"]

HBM = 4.23e12
FLOPS = 800e12
L2_DEFEAT_BYTES = 128 << 20


def time_in_graph(launch, copies: int = 1, launches: int = 20, replays: int = 20) -> float:
    """Microseconds per call of `launch(i)` (i cycles over `copies` input sets) inside a replayed CUDA Graph."""
    calls = max(copies, launches)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):  # warm-up: compile, size workspaces
            launch(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            launch(i % copies)
    for _ in range(3):
        graph.replay()
    return statistics.median(replay_times_us(graph, replays)) / calls


def replay_times_us(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    """Microseconds of each of `replays` replays of `graph`, by CUDA events around each one."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _padded(rows: int, cols: int, dtype, dev, std: float = 1.0) -> torch.Tensor:
    """(rows, cols) view of a (rows, cols rounded up to 8) allocation: 16-byte aligned rows, as the engine allocates
    its activations and weights (SigLIP's patch GEMM: K = 588 in 592-wide buffers)."""
    return torch.randn(rows, -(-cols // 8) * 8, device=dev).mul_(std).to(dtype)[:, :cols]


def _gemm_row(s, dtype, dev) -> dict:
    n_w = s.n * (2 if s.gated else 1)
    w_bytes = n_w * s.k * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / w_bytes)))
    ws = [_padded(n_w, s.k, dtype, dev, std=s.k**-0.5) for _ in range(copies)]
    a = _padded(s.m, s.k, dtype, dev)
    out = torch.empty(s.m, s.n, device=dev, dtype=dtype)
    mm_out = torch.empty(s.m, n_w, device=dev, dtype=dtype)
    bias = torch.randn(n_w, device=dev).to(dtype) if s.bias else None
    rs = torch.rand(s.m, device=dev) + 0.5 if s.row_scale else None
    period = 256 if s.name == "siglip.patch" and s.residual else None  # the position embedding, once per view
    res = torch.randn(period or s.m, s.n, device=dev).to(dtype) if s.residual else None
    kw = dict(bias=bias, row_scale=rs, activation=s.activation, gated=s.gated, residual=res, residual_period=period)

    def ours(i):
        gemm(a, ws[i], out, **kw)

    def cublas(i):
        torch.mm(a, ws[i].T, out=mm_out)

    def unfused(i):
        y = torch.mm(a, ws[i].T)
        y = y * rs[:, None].to(dtype) if rs is not None else y
        y = y + bias if bias is not None else y
        if s.gated:
            g, u = y.chunk(2, dim=-1)
            y = F.gelu(g, approximate="tanh") * u
        elif s.activation == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        elif s.activation == "silu":
            y = F.silu(y)
        if res is not None:
            y = y + (res.repeat(s.m // period, 1) if period else res)
        out.copy_(y)

    flops = 2 * s.m * n_w * s.k
    t = time_in_graph(ours, copies)
    return {
        "kernel": "gemm",
        "name": s.name,
        "shape": f"{s.m}x{s.n}x{s.k}" + (" gated" if s.gated else ""),
        "us": t,
        "cublas_us": time_in_graph(cublas, copies),
        "torch_us": time_in_graph(unfused, copies),
        "roofline_us": max(w_bytes / HBM, flops / FLOPS) * 1e6,
        "reach": f"{w_bytes / t / 1e6:.2f} TB/s" if s.m <= 128 else f"{flops / t / 1e6:.0f} TFLOP/s",
    }


def _unfused_rope(x: dict):
    """What the RoPE epilogue replaces, on the same inputs: the GEMM with its row scale, then `rope_qk`."""
    kw = {k: v for k, v in x["kw"].items() if k != "rope"}

    def launch(i: int) -> None:
        gemm(x["a"], x["ws"][i], x["out"], **kw)
        rope_qk(x["out"], **x["kw"]["rope"])

    return launch


def _rope_row(s, dtype, dev) -> dict:
    """The RoPE-epilogue GEMM against the launches it replaces, on the same inputs (tune's)."""
    from .tune import _gemm_launch, _gemm_setup

    n_w = s.n * (2 if s.gated else 1)
    w_bytes = n_w * s.k * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / w_bytes)))
    x = _gemm_setup(s, dtype, dev, copies)
    a, wl, mm_out = x["a"], x["ws"], x["mm_out"]
    flops = 2 * s.m * n_w * s.k
    t = time_in_graph(lambda i: _gemm_launch(x, None, i), copies)
    return {
        "kernel": "gemm+rope",
        "name": s.name + ":rope",
        "shape": f"{s.m}x{s.n}x{s.k}" + (" gated" if s.gated else ""),
        "us": t,
        "cublas_us": time_in_graph(lambda i: torch.mm(a, wl[i].T, out=mm_out), copies),
        "torch_us": float("nan"),
        "unfused_us": time_in_graph(_unfused_rope(x), copies),
        "roofline_us": max(w_bytes / HBM, flops / FLOPS) * 1e6,
        "reach": f"{w_bytes / t / 1e6:.2f} TB/s" if s.m <= 128 else f"{flops / t / 1e6:.0f} TFLOP/s",
    }


def _attention_row(s, dtype, dev) -> dict:
    q = torch.randn(s.b, s.tq, s.hq, s.d, device=dev).to(dtype)
    k = torch.randn(s.b, s.tk, s.hkv, s.d, device=dev).to(dtype)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    blocks = {}
    if s.masked:
        k_block = torch.zeros(s.b, s.tk, dtype=torch.int32, device=dev)
        k_block[:, s.tk - s.tq :] = 1 if s.tq < s.tk else 0
        blocks = dict(q_block=torch.ones(s.b, s.tq, dtype=torch.int32, device=dev), k_block=k_block)
    mask = (blocks["k_block"][:, None, :] <= blocks["q_block"][:, :, None])[:, None] if blocks else None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def ours(i):
        attention(q, k, v, out, scale=s.d**-0.5, **blocks)

    def sdpa(i):
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=s.hq != s.hkv)
        out.copy_(o.transpose(1, 2))

    flops = 4 * s.b * s.hq * s.tq * s.tk * s.d
    kv_bytes = 2 * k.numel() * k.element_size()
    t = time_in_graph(ours)
    return {
        "kernel": "attention",
        "name": s.name,
        "shape": f"b{s.b} {s.tq}x{s.tk} h{s.hq}/{s.hkv} d{s.d}",
        "us": t,
        "cublas_us": float("nan"),
        "torch_us": time_in_graph(sdpa),
        "roofline_us": max(kv_bytes / HBM, flops / FLOPS) * 1e6,
        "reach": f"{flops / t / 1e6:.0f} TFLOP/s",
    }


def _small_rows(dtype, dev, views: int) -> list[dict]:
    rows = []
    m = 256 * views
    x = torch.randn(m, 1152, device=dev).to(dtype)
    y = torch.empty_like(x)
    f = torch.empty(m, device=dev)
    xv = torch.randn(m, 2048, device=dev).to(dtype)
    qkv = torch.randn(m, 2560, device=dev).to(dtype)
    cache = torch.empty(1, m + 64, 1, 256, device=dev, dtype=dtype)
    ang = torch.randn(m, 128, device=dev)
    cos, sin = ang.cos(), ang.sin()
    img = torch.rand(views, 224, 224, 3, device=dev) * 2 - 1
    patches = torch.empty(views * 256, 640, device=dev, dtype=dtype)[:, :588]

    def torch_rope(i):
        q = qkv[:, :2048].view(m, 8, 256).float()
        q1, q2 = q[..., :128], q[..., 128:]
        c, s_ = cos[:, None], sin[:, None]
        qkv[:, :2048].copy_(torch.cat([q1 * c - q2 * s_, q2 * c + q1 * s_], -1).view(m, 2048))

    cases = [
        ("layernorm", f"{m}x1152", lambda i: layernorm(x, y, 1e-6), lambda i: y.copy_(F.layer_norm(x, (1152,)))),
        ("rms_factor", f"{m}x2048", lambda i: rms_factor(xv, f, 1e-6),
         lambda i: f.copy_(torch.rsqrt(xv.float().pow(2).mean(-1) + 1e-6))),
        ("rope_qk", f"{m} tok 8+1+1 heads", lambda i: rope_qk(qkv, cos, sin, cache, cache, num_q_heads=8,
         num_kv_heads=1, head_dim=256), torch_rope),
        ("patchify", f"{views}x224x224x3", lambda i: patchify(img, patches, 14),
         lambda i: patches.copy_(img.view(views, 16, 14, 16, 14, 3).permute(0, 1, 3, 2, 4, 5).reshape(-1, 588))),
    ]  # fmt: skip
    for name, shape, ours, ref in cases:
        rows.append(
            {"kernel": name, "name": name, "shape": shape, "us": time_in_graph(ours), "cublas_us": float("nan"),
             "torch_us": time_in_graph(ref), "roofline_us": float("nan"), "reach": ""}
        )  # fmt: skip
    return rows


def bench_kernels(
    dtype: torch.dtype = torch.bfloat16,
    *,
    views=(1, 2, 3),
    prompts=(0, 20),
    chunks=(50, 63),
    path: str | Path | None = None,
) -> list[dict]:
    """Time every kernel at π0's shapes on this GPU, print the table, return its rows (and write JSON to `path`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kernels needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for s in pi0_gemm_shapes(views=views, prompts=prompts, chunks=chunks):
        rows.append(_rope_row(s, dtype, dev) if s.rope else _gemm_row(s, dtype, dev))
        _print_row(rows[-1], header=len(rows) == 1)
    for s in pi0_attention_shapes(views=views, prompts=prompts, chunks=chunks):
        rows.append(_attention_row(s, dtype, dev))
        _print_row(rows[-1])
    for r in _small_rows(dtype, dev, max(views)):
        rows.append(r)
        _print_row(r)
    if path is not None:
        Path(path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return rows


def _print_row(r: dict, header: bool = False) -> None:
    if header:
        print(f"{'kernel':<10} {'name':<20} {'shape':<26} {'ours us':>8} {'cuBLAS':>8} {'torch':>8} {'roofl.':>8} "
              f"{'speedup':>9}  reach")  # fmt: skip
    if "unfused_us" in r:  # the RoPE GEMM: the torch column shows the unfused kernels, the speedup is against them
        ratio, torch_us = r["unfused_us"] / r["us"], r["unfused_us"]
    else:
        ratio = r["cublas_us"] / r["us"] if r["cublas_us"] == r["cublas_us"] else r["torch_us"] / r["us"]
        torch_us = r["torch_us"]
    print(f"{r['kernel']:<10} {r['name']:<20} {r['shape']:<26} {r['us']:8.2f} {r['cublas_us']:8.2f} "
          f"{torch_us:8.2f} {r['roofline_us']:8.2f} {ratio:8.2f}x  {r['reach']}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Time the π0 kernels on this GPU against cuBLAS / torch.")
    p.add_argument("--views", default="1,2,3")
    p.add_argument("--prompts", default="0,20")
    p.add_argument("--chunks", default="50,63")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    ints = {k: tuple(int(v) for v in getattr(a, k).split(",") if v) for k in ("views", "prompts", "chunks")}
    bench_kernels(path=a.out, **ints)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
