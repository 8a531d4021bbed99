"""Time every Triton kernel at the real π0 shapes against torch / cuBLAS on the GPU and print a table.

Each measurement is `vla_rt.timing.time_graph`: a CUDA Graph of back-to-back launches (the way the engine runs
them, so launch gaps are the in-graph ones), replays timed with CUDA events. GEMM launches cycle through enough
weight copies to exceed twice the L2, so skinny GEMMs are measured at HBM bandwidth as in inference; their inputs
are the tuner's (`tuning.measure.gemm_inputs`: rows padded as the engine allocates them). Columns: our kernel,
cuBLAS alone (`torch.mm`, the floor ANCHORS.md quotes), torch with the epilogue as separate ops (for the RoPE GEMM:
the Triton GEMM then `rope_qk`, what the epilogue replaces), the roofline max(bytes / 4.23 TB/s, FLOPs /
800 TFLOP/s), the speedup over cuBLAS (GEMMs), the unfused kernels (RoPE) or torch (the rest), and what our kernel
reaches (weight TB/s for skinny GEMMs, TFLOP/s otherwise).

    python -m vla_rt.bench.kernels [--views 1,3] [--out benchmarks/raw/kernels.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from vla_rt.timing import time_graph
from vla_rt.triton_kernels import attention, gemm, layernorm, patchify, rms_factor, rope_qk
from vla_rt.triton_kernels.launch_configs import gemm_config
from vla_rt.triton_kernels.shapes import GemmShape, pi0_attention_shapes, pi0_gemm_shapes
from vla_rt.triton_kernels.tuning.measure import gemm_inputs, launch_gemm, weight_copies

__all__ = ["bench_kernels"]

HBM = 4.23e12
FLOPS = 800e12


def _us(launch, copies: int = 1) -> float:
    return time_graph(launch, copies=copies, calls=20, replays=20).median_us


def _torch_epilogue(x: dict, s: GemmShape):
    """The GEMM as cuBLAS plus its epilogue as separate torch ops, into the same output."""
    kw, a, out = x["kw"], x["a"], x["out"]
    rs, bias, res, period = kw["row_scale"], kw["bias"], kw["residual"], kw["residual_period"]

    def launch(i: int) -> None:
        y = torch.mm(a, x["ws"][i].T)
        y = y * rs[:, None].to(y.dtype) if rs is not None else y
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

    return launch


def _unfused_rope(x: dict):
    """What the RoPE epilogue replaces, on the same inputs: the GEMM with its row scale, then `rope_qk`."""
    kw = {k: v for k, v in x["kw"].items() if k != "rope"}

    def launch(i: int) -> None:
        gemm(x["a"], x["ws"][i], x["out"], **kw)
        rope_qk(x["out"], **x["kw"]["rope"])

    return launch


def gemm_row(s: GemmShape, dtype: torch.dtype, dev) -> dict:
    """One GEMM shape: ours, cuBLAS, torch's (or, with RoPE, the unfused kernels'), on the tuner's inputs."""
    copies = weight_copies(s, dtype)
    x = gemm_inputs(s, dtype, dev, copies)
    n_w = s.n * (2 if s.gated else 1)
    w_bytes = n_w * s.k * torch.tensor([], dtype=dtype).element_size()
    flops = 2 * s.m * n_w * s.k
    # our kernel with the table's config, given explicitly: without one `gemm` may hand the shape to cuBLAS
    # (`cublas_choice`), and this row compares the two
    cfg = gemm_config(s.m, s.n, s.k, gated=s.gated, dtype=dtype, device=dev, rope=s.rope)
    t = _us(lambda i: launch_gemm(x, cfg, i), copies)
    row = {
        "kernel": "gemm+rope" if s.rope else "gemm",
        "name": s.name + (":rope" if s.rope else ""),
        "shape": f"{s.m}x{s.n}x{s.k}" + (" gated" if s.gated else ""),
        "us": t,
        "cublas_us": _us(lambda i: torch.mm(x["a"], x["ws"][i].T, out=x["mm_out"]), copies),
        "torch_us": float("nan") if s.rope else _us(_torch_epilogue(x, s), copies),
        "roofline_us": max(w_bytes / HBM, flops / FLOPS) * 1e6,
        "reach": f"{w_bytes / t / 1e6:.2f} TB/s" if s.m <= 128 else f"{flops / t / 1e6:.0f} TFLOP/s",
    }
    if s.rope:
        row["unfused_us"] = _us(_unfused_rope(x), copies)
    return row


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

    def sdpa(i):
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=s.hq != s.hkv)
        out.copy_(o.transpose(1, 2))

    flops = 4 * s.b * s.hq * s.tq * s.tk * s.d
    kv_bytes = 2 * k.numel() * k.element_size()
    t = _us(lambda i: attention(q, k, v, out, scale=s.d**-0.5, **blocks))
    return {
        "kernel": "attention",
        "name": s.name,
        "shape": f"b{s.b} {s.tq}x{s.tk} h{s.hq}/{s.hkv} d{s.d}",
        "us": t,
        "cublas_us": float("nan"),
        "torch_us": _us(sdpa),
        "roofline_us": max(kv_bytes / HBM, flops / FLOPS) * 1e6,
        "reach": f"{flops / t / 1e6:.0f} TFLOP/s",
    }


def _small_rows(dtype, dev, views: int) -> list[dict]:
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
    return [{"kernel": name, "name": name, "shape": shape, "us": _us(ours), "cublas_us": float("nan"),
             "torch_us": _us(ref), "roofline_us": float("nan"), "reach": ""}
            for name, shape, ours, ref in cases]  # fmt: skip


def bench_kernels(dtype: torch.dtype = torch.bfloat16, *, views=(1, 2, 3), prompts=(0, 20), chunks=(50, 63),
                  path: str | Path | None = None) -> list[dict]:  # fmt: skip
    """Time every kernel at π0's shapes on this GPU, print the table, return its rows (and write JSON to `path`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kernels needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = []
    for s in pi0_gemm_shapes(views=views, prompts=prompts, chunks=chunks):
        rows.append(gemm_row(s, dtype, dev))
        print_row(rows[-1], header=len(rows) == 1)
    for s in pi0_attention_shapes(views=views, prompts=prompts, chunks=chunks):
        rows.append(_attention_row(s, dtype, dev))
        print_row(rows[-1])
    for r in _small_rows(dtype, dev, max(views)):
        rows.append(r)
        print_row(r)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return rows


def print_row(r: dict, header: bool = False) -> None:
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
    p = argparse.ArgumentParser(description="Time the π0 kernels on this GPU against cuBLAS / torch.")
    p.add_argument("--views", default="1,2,3")
    p.add_argument("--prompts", default="0,20")
    p.add_argument("--chunks", default="50,63")
    p.add_argument("--out", default=None, help="write the rows as JSON here (e.g. benchmarks/raw/kernels.json)")
    a = p.parse_args(argv)
    ints = {k: tuple(int(v) for v in getattr(a, k).split(",") if v) for k in ("views", "prompts", "chunks")}
    bench_kernels(path=a.out, **ints)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
