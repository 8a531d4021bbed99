"""The persistent action-expert layer kernel against the separate kernels it replaces, on the GPU in hand.

One "step" = the 18 expert layers of π0 (bf16, random weights, a filled KV cache), captured in a CUDA Graph and
replayed; CUDA events, median and p90. Rows: the separate Triton kernels (the engine's default expert path:
rms_factor, QKV GEMM + RoPE epilogue, attention, O, rms_factor, gate/up, down) and the persistent kernel under
each config of the sweep; every row's x after the 18 layers is compared with the separate path's. The roofline
is the layers' weight bytes over the copy bandwidth measured in the same run.

    python tools/bench_expert_layer.py [--cases "1,0,63;3,0,63"] [--sweep default|small|none] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch

from vla_rt import triton_kernels as tk
from vla_rt.bench.accuracy import rel_err
from vla_rt.bench.report import write_json_md
from vla_rt.bench.timing import measure_ceilings, time_calls
from vla_rt.triton_kernels.expert_layer import ExpertLayerConfig, expert_layer, expert_layer_config

W, F, HQ, D, LAYERS = 1024, 4096, 8, 256, 18

BEST2 = dict(o_cols=32, o_split=4, down_cols=64, down_split=8, num_stages=4)
SWEEPS = {
    "none": [],
    "small": [dict(), dict(prefetch=0), dict(att_splits=8), dict(num_warps=8)],
    # per-phase cost: each row runs the phases of the bits set (barriers always); differences = a phase's cost
    "profile": [dict(phases=0), dict(phases=1), dict(phases=3), dict(phases=7), dict(phases=15), dict()],
    # residual GEMMs with wider column tiles and deeper K splits: less of A re-read from L2 per unit
    "tiles": [
        dict(down_cols=64, down_split=8),
        dict(o_cols=32, o_split=4),
        dict(o_cols=32, o_split=4, down_cols=64, down_split=8),
        dict(o_cols=32, o_split=4, down_cols=64, down_split=8, prefetch=1),
        dict(o_cols=32, o_split=4, down_cols=64, down_split=8, num_stages=4),
        dict(o_cols=32, o_split=4, down_cols=64, down_split=8, block_k=64, num_stages=5),
        dict(o_cols=32, o_split=4, down_cols=64, down_split=8, gate_cols=64),
    ],
    # on the best tiles of "tiles": barrier poll, K step, attention splits
    "round2": [
        {**BEST2, "poll_load": 0},
        BEST2,
        {**BEST2, "phases": 0},
        {**BEST2, "block_k": 256, "num_stages": 3},
        {**BEST2, "att_splits": 1},
        {**BEST2, "att_splits": 2},
        {**BEST2, "att_keys": 32},
    ],
    "default": [
        dict(),
        dict(prefetch=0),
        dict(att_splits=2),
        dict(att_splits=8),
        dict(att_rows=32, att_splits=8),
        dict(num_warps=8),
        dict(num_stages=2),
        dict(num_stages=4),
        dict(o_split=4, down_split=4),
        dict(o_split=1, down_split=1, o_cols=16, down_cols=16),
        dict(gate_cols=16),
        dict(block_k=64),
    ],
}


def make_layers(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    return [
        dict(qkv=rnd((HQ + 2) * D, W, std=W**-0.5), o=rnd(W, HQ * D, std=(HQ * D) ** -0.5),
             gate_up=rnd(2 * F, W, std=W**-0.5), down=rnd(W, F, std=F**-0.5))
        for _ in range(LAYERS)
    ]  # fmt: skip


def make_state(prefix: int, rows: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = prefix + rows
    st = dict(
        x=torch.randn(rows, W, generator=g, device="cuda").to(torch.bfloat16),
        k=[torch.randn(1, keys, 1, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)],
        v=[torch.randn(1, keys, 1, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)],
    )
    pos = torch.arange(prefix, keys, dtype=torch.float32, device="cuda")[:, None]
    freq = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float32, device="cuda") / (D // 2))
    st["cos"], st["sin"] = torch.cos(pos * freq)[None].contiguous(), torch.sin(pos * freq)[None].contiguous()
    q_block = torch.full((1, rows), 2, dtype=torch.int32, device="cuda")
    q_block[:, 0] = 1
    k_block = torch.zeros((1, keys), dtype=torch.int32, device="cuda")
    k_block[:, prefix:] = q_block
    st["q_block"], st["k_block"] = q_block, k_block
    return st


class Buffers:
    def __init__(self, rows: int):
        z = dict(device="cuda", dtype=torch.bfloat16)
        self.x = torch.empty(rows, W, **z)
        self.qkv = torch.empty(rows, (HQ + 2) * D, **z)
        self.attn = torch.empty(rows, HQ * D, **z)
        self.mlp = torch.empty(rows, F, **z)
        self.rms = torch.empty(rows, device="cuda")
        self.ws = tk.Workspace("cuda")


def separate_step(layers, st, buf: Buffers, prefix: int) -> None:
    """The engine's default expert layers (fuse_rope="expert"), as separate Triton kernels."""
    rows = buf.x.shape[0]
    for i, lw in enumerate(layers):
        tk.rms_factor(buf.x, buf.rms, 1e-6)
        rope = dict(cos=st["cos"], sin=st["sin"], k_cache=st["k"][i], v_cache=st["v"][i], cache_offset=prefix,
                    num_q_heads=HQ, num_kv_heads=1, head_dim=D)  # fmt: skip
        tk.gemm(buf.x, lw["qkv"], buf.qkv, row_scale=buf.rms, rope=rope, workspace=buf.ws)
        q = buf.qkv.view(1, rows, -1, D)[:, :, :HQ]
        tk.attention(q, st["k"][i], st["v"][i], buf.attn.view(1, rows, HQ, D), scale=D**-0.5,
                     q_block=st["q_block"], k_block=st["k_block"], workspace=buf.ws)  # fmt: skip
        tk.gemm(buf.attn, lw["o"], buf.x, residual=buf.x, workspace=buf.ws)
        tk.rms_factor(buf.x, buf.rms, 1e-6)
        tk.gemm(buf.x, lw["gate_up"], buf.mlp, gated=True, row_scale=buf.rms, workspace=buf.ws)
        tk.gemm(buf.mlp, lw["down"], buf.x, residual=buf.x, workspace=buf.ws)


def persistent_step(layers, st, buf: Buffers, prefix: int, cfg: ExpertLayerConfig) -> None:
    for i, lw in enumerate(layers):
        expert_layer(buf.x, lw["qkv"], lw["o"], lw["gate_up"], lw["down"], buf.qkv, buf.attn, buf.mlp, st["k"][i],
                     st["v"][i], st["cos"], st["sin"], st["q_block"], st["k_block"], cache_offset=prefix, eps=1e-6,
                     scale=D**-0.5, num_q_heads=HQ, head_dim=D, config=cfg, workspace=buf.ws)  # fmt: skip


def time_step(step, st, buf: Buffers, iters: int) -> tuple[dict, torch.Tensor]:
    """(timing of the graphed step, x after one step from st's x)."""
    buf.x.copy_(st["x"])
    step()  # compile, size the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    buf.x.copy_(st["x"])
    graph.replay()
    out = buf.x.clone()
    t = time_calls(graph.replay, warmup=5, iters=iters, device=torch.device("cuda"))
    return {"median_ms": t.median_ms, "p90_ms": t.p90_ms}, out


def run(cases, sweep: list[dict], iters: int, log=print) -> dict:
    bw = measure_ceilings(torch.device("cuda"))["copy_bandwidth_bytes_per_s"]
    layers = make_layers(0)
    weight_bytes = sum(t.nbytes for lw in layers for t in lw.values())
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_TBps": bw / 1e12,
        "rows": [],
        "weight_MB": weight_bytes / 1e6,
    }
    for views, prompt, chunk in cases:
        prefix, rows = 256 * views + prompt, chunk + 1
        st = make_state(prefix, rows, 1)
        buf = Buffers(rows)
        roofline = weight_bytes / bw * 1e3
        base, ref = time_step(functools.partial(separate_step, layers, st, buf, prefix), st, buf, iters)
        case = f"{views}v p{prompt} h{chunk}"
        entries = [dict(case=case, path="separate", **base, roofline_ms=roofline, rel_err=0.0)]
        log(f"{case} separate {base['median_ms']:.4f} ms (roofline {roofline:.4f})")
        default = expert_layer_config(W, F, HQ, D)
        for change in sweep:
            cfg = dataclasses.replace(default, **change)
            try:
                t, out = time_step(functools.partial(persistent_step, layers, st, buf, prefix, cfg), st, buf, iters)
            except Exception as e:  # a config that does not compile or fit: recorded, the sweep goes on
                log(f"{case} {change} failed: {type(e).__name__}: {str(e)[:200]}")
                entries.append(dict(case=case, path="persistent", change=change, error=str(e)[:500]))
                continue
            err = rel_err(out, ref)
            entries.append(dict(case=case, path="persistent", change=change, config=dataclasses.asdict(cfg), **t,
                                roofline_ms=roofline, rel_err=err, speedup=base["median_ms"] / t["median_ms"]))  # fmt: skip
            log(f"{case} persistent {change} {t['median_ms']:.4f} ms  x{base['median_ms'] / t['median_ms']:.2f}"
                f"  err {err:.2e}")  # fmt: skip
        result["rows"] += entries
    return result


def table(result: dict) -> str:
    lines = [f"Expert step (18 layers, bf16) on {result['device']}; copy {result['copy_TBps']:.2f} TB/s",
             "", "| case | path | config change | median ms | p90 ms | × roofline | vs separate | rel. err |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['path']} | {r['change']} | failed | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['path']} | {r.get('change', '')} | {r['median_ms']:.4f} | {r['p90_ms']:.4f} | "
                     f"{r['median_ms'] / r['roofline_ms']:.2f} | {r.get('speedup', 1.0):.2f}× | {r['rel_err']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1,0,63;3,0,63")
    p.add_argument("--sweep", default="default", help="comma-separated: " + ",".join(SWEEPS))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_layer needs CUDA (grid barriers deadlock in the interpreter)")
    cases = [tuple(int(v) for v in c.split(",")) for c in a.cases.split(";") if c.strip()]
    result = run(cases, [c for name in a.sweep.split(",") for c in SWEEPS[name]], a.iters)
    md = table(result)
    print(md)
    if a.out:
        write_json_md(a.out, "expert_layer", result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
