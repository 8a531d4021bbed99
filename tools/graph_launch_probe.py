"""How much of a stage's time on an idle GPU is its CUDA Graph's launch: the latency a lone robot's prefix pays.

Why: a lone robot's request waits, on the host, for its prefix stage's `graph.replay()` (~0.26-0.28 ms of
`cudaGraphLaunch` for the prefix graph on the H200, `docs/runs/admit_host_2026-12-03_ecdf319_NVIDIA-H200.log`).
If the GPU only starts the graph's first kernel once the whole launch is submitted, that time is on the robot's
critical path (the GPU is idle then), and splitting the prefix into a short head graph and the rest would hide most
of it behind the head's kernels. This measures it for the stage engine's own graphs (random π0 bf16, 2 views,
prompt 20, chunk 50, buckets 1):

- `host`: the wall time of `replay()` itself, the GPU busy (submission only);
- `idle`: events around the replay on an idle GPU (the event before it completes at once, so any wait for the
  launch lands inside);
- `queued`: the same behind a ~3 ms spin kernel, so the launch is submitted before the GPU reaches the first event;
- `exposed` = idle - queued: what the launch costs a stage that starts on an idle GPU.

Rows: the prefix graph P(1), the expert graph E(1), and the prefix as two graphs (vision, then the VLM layers:
`Pi0Plan.vision` / `Pi0Plan.prefix` captured apart over the same buffers), launched back to back.

    python3 tools/graph_launch_probe.py [--iters 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vla_rt.engine.buffers import first_rows
from vla_rt.graph_capture import graph_capture
from vla_rt.inference import load_stages

SPIN_CYCLES = 6_000_000  # ~3 ms at the H200's ~1.98 GHz: longer than any launch measured here


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_launch(launch, stream: torch.cuda.Stream, iters: int) -> dict[str, float]:
    """Medians (ms) of `launch()`'s host time with the GPU busy, its GPU span from an idle start and from a queued one."""
    host, idle, queued = [], [], []
    with torch.cuda.stream(stream):
        for _ in range(3):
            launch()
        for _ in range(iters):
            stream.synchronize()
            start, end = _events()
            start.record()
            launch()
            end.record()
            end.synchronize()
            idle.append(start.elapsed_time(end))
            stream.synchronize()
            torch.cuda._sleep(SPIN_CYCLES)
            start, end = _events()
            start.record()
            t0 = time.perf_counter()
            launch()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            queued.append(start.elapsed_time(end))
    row = {name: statistics.median(v) for name, v in (("host", host), ("idle", idle), ("queued", queued))}
    row["exposed"] = row["idle"] - row["queued"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="random:pi0")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    model = load_stages(args.checkpoint, backend="triton", device="cuda", dtype=torch.bfloat16, num_views=2,
                        chunk=50, prompt_len=20)  # fmt: skip
    engine = model.stages
    stream = engine.stream
    plan, kb = engine.plans[1], 1
    obs, act = first_rows(engine.obs, kb, engine.max_prefix), first_rows(engine.act, kb, engine.max_prefix)
    slot = first_rows(engine.staged.slot, kb, engine.max_prefix)
    vision, vlm = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with graph_capture(vision):
        plan.vision(obs, slot, act)
    with graph_capture(vlm):
        plan.prefix(obs, slot, act)
    prefix = engine.prefix_graphs[1]

    def split() -> None:
        vision.replay()
        vlm.replay()

    rows = {"prefix P(1)": time_launch(prefix.replay, stream, args.iters),
            "prefix as vision + VLM graphs": time_launch(split, stream, args.iters),
            "vision graph alone": time_launch(vision.replay, stream, args.iters),
            "expert E(1)": time_launch(engine.expert_graphs[1].replay, stream, args.iters)}  # fmt: skip
    gpu = torch.cuda.get_device_name()
    print(f"# CUDA Graph launch on an idle GPU ({gpu}, π0 bf16, 2 views, prompt 20, chunk 50, medians of "
          f"{args.iters}, ms)\n")  # fmt: skip
    print("| graph | host: replay() | idle start | queued start | exposed launch |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['host']:.3f} | {r['idle']:.3f} | {r['queued']:.3f} | {r['exposed']:+.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"graph_launch_probe_{gpu.replace(' ', '-')}.json"
    path.write_text(json.dumps({"gpu": gpu, "iters": args.iters, "rows": rows}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
