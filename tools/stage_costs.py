"""The serving stage engine's stage costs per bucket, for each kernel set, against the bf16 roofline.

The server's admission and throughput rest on two numbers per bucket: P(k), a prefix stage (vision + VLM) of k new
rows, and E(b), one expert step over b rows in flight. This times both exactly as the server's cost model does
(`vla_rt.serve.worker.measure_costs`: stacking, copies, the stage, the wait) for each backend given, so a kernel set
that is faster at batched shapes shows up per stage and per row before it is wired into serving:

    python tools/stage_costs.py --backends triton folded --out /tmp/stage_costs      # on a GPU (~3 min)

"folded" on a GPU is the engine plan on PyTorch ops (cuBLAS GEMMs, SDPA) under the same CUDA Graphs. Prints a
Markdown table and writes stage_costs_<GPU>.json beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vla_rt.bench.roofline import pi0_roofline
from vla_rt.inference import load_stages
from vla_rt.serve.worker import StageRunner, measure_costs


def stage_rows(backend: str, args) -> list[dict]:
    t0 = time.perf_counter()
    model = load_stages(args.checkpoint, backend=backend, device=args.device, dtype=torch.bfloat16,
                        num_views=args.views, chunk=args.chunk, prompt_len=args.prompt,
                        expert_buckets=args.expert_buckets, prefix_buckets=args.prefix_buckets)  # fmt: skip
    build_s = time.perf_counter() - t0
    costs = measure_costs(StageRunner(model.stages, prompt_len=args.prompt, seed=0), iters=args.iters)
    cfg = model.stages.cfg
    roofline = {  # the stage's bf16 roofline at b rows
        "prefix": lambda r: r.vision_ms + r.vlm_ms,
        "expert": lambda r: r.expert_step_ms,
    }
    rows = []
    for stage, cost, buckets in (("prefix", costs.prefix, costs.prefix_buckets),
                                 ("expert", costs.expert, costs.expert_buckets)):  # fmt: skip
        for b in buckets:
            roof = pi0_roofline(cfg, args.views, args.chunk, args.prompt, batch=b)
            rows.append(dict(backend=backend, stage=stage, rows=b, median_ms=cost(b), p99_ms=cost(b, True),
                             roofline_ms=roofline[stage](roof), build_s=build_s))  # fmt: skip
    del model
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| backend | stage | rows | median ms | p99 ms | ms a row | roofline ms | x roofline |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['backend']} | {r['stage']} | {r['rows']} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | "
                   f"{r['median_ms'] / r['rows']:.2f} | {r['roofline_ms']:.2f} | "
                   f"{r['median_ms'] / r['roofline_ms']:.1f} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="random:pi0")
    ap.add_argument("--backends", nargs="+", default=["triton", "folded"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--expert-buckets", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--prefix-buckets", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch's CPU threads, as `vla-rt serve` sets them on "
                    "CUDA (torch's 16 stalled the row copies for tens of ms on the H200 machine)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.cpu_threads)
    rows = []
    for backend in args.backends:
        rows += stage_rows(backend, args)
        print(markdown(rows), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "CPU"
        (args.out / f"stage_costs_{gpu}.json").write_text(json.dumps(dict(gpu=gpu, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
