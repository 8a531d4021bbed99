"""How much a prefix stage running beside the expert steps slows them, and whether SM partitions help.

Under `vla-rt serve --scheduler overlap` (the default) a prefix stage runs on a low-priority stream while the expert
stream steps the rows in flight. Stream priority only orders the blocks waiting for an SM; the prefix GEMMs' blocks
hold an SM for tens of µs each, so a step of ~100 short kernels waits behind them. The H200 fleet run at badb5ac
hints at the size of it: p50 18.2 ms at 1 robot, 45 ms at 4 (`docs/runs/fleet_2026-12-03_badb5ac_NVIDIA-H200.md`).
This probe measures it on one stage engine (random π0 bf16, 2 views, prompt 20, chunk 50 by default) by replaying
the engine's own CUDA Graphs, each between two CUDA events, with no host work between stages:

- alone: E(b), one expert step over b rows; P(k), a prefix stage of k rows;
- overlapped: the expert steps that run while one P(k) runs on the prefix stream, and P(k)'s own time then;
- partitioned: the same with green contexts (`cuGreenCtxCreate`, CUDA 12.4+ driver API): the expert stream on
  `s` SMs and the prefix on the rest ("split"), or only the prefix confined to the rest ("fence");
- rows "ops": the same variants with PyTorch GEMMs in place of the graphs (a chain of 20 mid-size GEMMs beside the
  8-row prefix's gate/up GEMM), which answer whether a partition shields anything even where a graph captured in
  the primary context will not replay on a green context's stream.
- variants "split+cap" / "fence+cap": the graphs captured anew on the green contexts' streams. The first H200 run
  found that a graph captured in the primary context and replayed on a green stream ignores the partition (E(4) on
  16 "SMs" as fast as on all), while PyTorch ops launched there keep to it; a kernel node keeps the context of the
  stream it was captured on, so these say whether graphs captured on the partition keep to it.

    python3 tools/overlap_probe.py --expert-rows 4 16 --prefix-rows 1 8 --expert-sms 16 32 --out /tmp/overlap

Prints a Markdown table and writes overlap_probe_<GPU>.json. A variant the driver or the graph replay refuses is a
row with its error, not a crash: whether a graph captured in the primary context replays on a green context's
stream is one of the things this measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from vla_rt.engine.sm_partition import SmPartition
from vla_rt.inference import load_stages
from vla_rt.serve.worker import StageRunner


def replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, times: int) -> list[float]:
    """Each replay between two events on `stream`, back to back; the GPU times in ms."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(times)]
    with torch.cuda.stream(stream):
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
    stream.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def overlapped_ms(expert: torch.cuda.CUDAGraph, prefix: torch.cuda.CUDAGraph, expert_stream: torch.cuda.Stream,
                  prefix_stream: torch.cuda.Stream, max_steps: int = 400) -> tuple[list[float], float]:  # fmt: skip
    """One prefix replay on `prefix_stream` and expert steps on `expert_stream` until it is done (each step synced, so
    the steps counted are those that started while it ran): the steps' times and the prefix's."""
    p0, p1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(prefix_stream):
        p0.record()
        prefix.replay()
        p1.record()
    steps = []
    with torch.cuda.stream(expert_stream):
        while not p1.query() and len(steps) < max_steps:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            expert.replay()
            e1.record()
            e1.synchronize()
            steps.append(e0.elapsed_time(e1))
    p1.synchronize()
    return steps, p0.elapsed_time(p1)


class Eager:
    """Stands in for a graph: `replay()` launches PyTorch ops. If the engine's graphs will not replay on a green
    context's stream, these still say whether a partition shields a chain of kernels from a big GEMM beside it."""

    def __init__(self, fn):
        self.replay = fn


def torch_work(device: torch.device) -> tuple[Eager, Eager]:
    """(expert-like, prefix-like): 20 dependent 512 x 4096 x 4096 GEMMs (~20 µs each, so the GPU, not the host's
    launches, sets the pace) and 4 GEMMs of the 8-row prefix's gate/up shape (4256 x 2048 x 16384)."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    x, w = randn(512, 4096), randn(4096, 4096, scale=4096**-0.5)
    a, b = randn(4256, 2048), randn(2048, 16384)

    def expert_like() -> None:
        y = x
        for _ in range(20):
            y = torch.mm(y, w)

    def prefix_like() -> None:
        for _ in range(4):
            torch.mm(a, b)

    return Eager(expert_like), Eager(prefix_like)


def capture_on(engine, stage: str, rows: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A new graph of one stage's kernels captured on `stream` (a green context's: its kernel nodes keep that context,
    hence its SMs), through the engine's public `capture_stage`."""
    torch.cuda.synchronize()
    graph = engine.capture_stage(stage, rows, stream)
    torch.cuda.synchronize()
    return graph


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def probe(engine, args) -> list[dict]:
    rows = []
    variants: list[tuple[str, int | None, SmPartition | None, str | None]] = [("shared", None, None, None)]
    names = ("split", "fence", *(("split+cap", "fence+cap") if args.capture_green else ()))
    for s in args.expert_sms:
        for name in names:
            try:
                variants.append((name, s, SmPartition(engine.device, s), None))
            except (OSError, RuntimeError) as e:  # an old driver, or a split it refuses
                variants.append((name, s, None, str(e)))
    cases = [
        (b, k, engine.expert_graphs[b], engine.prefix_graphs[k]) for b in args.expert_rows for k in args.prefix_rows
    ]
    if args.torch_ops:  # rows "ops": PyTorch GEMMs instead of the engine's graphs (see torch_work)
        cases.append(("ops", "ops", *torch_work(engine.device)))
    for b, k, expert, prefix in cases:
        for name, s, green, error in variants:
            if b == "ops" and name.endswith("+cap"):  # ops are launched, not replayed: the same as split / fence
                continue
            row = dict(variant=name, expert_sms=s, expert_rows=b, prefix_rows=k, error=error)
            if green is not None:
                row.update(green_sms=green.sms)
            if error is None:
                streams = {"expert": engine.stream, "prefix": engine.prefix_stream}
                e_graph, p_graph = expert, prefix
                if green is not None:
                    split = name.startswith("split")
                    streams = dict(green.streams) if split else {**streams, "prefix": green.streams["prefix"]}
                try:
                    if name.endswith("+cap"):  # the graphs captured on the partition's streams
                        p_graph = capture_on(engine, "prefix", k, streams["prefix"])
                        if split:
                            e_graph = capture_on(engine, "expert", b, streams["expert"])
                    alone_e = replay_ms(e_graph, streams["expert"], args.iters)
                    alone_p = replay_ms(p_graph, streams["prefix"], max(3, args.iters // 4))
                    runs = [
                        overlapped_ms(e_graph, p_graph, streams["expert"], streams["prefix"])
                        for _ in range(args.overlaps)
                    ]
                    steps = [t for step_times, _ in runs for t in step_times]
                    row.update(expert_alone_ms=median(alone_e), prefix_alone_ms=median(alone_p),
                               expert_overlapped_ms=median(steps), expert_overlapped_max_ms=max(steps, default=None),
                               steps_during_prefix=len(steps) / len(runs),
                               prefix_overlapped_ms=median([p for _, p in runs]))  # fmt: skip
                except RuntimeError as e:
                    row.update(error=f"{type(e).__name__}: {e}"[:300])
                    try:
                        torch.cuda.synchronize()
                    except RuntimeError:  # a sticky error: the rows after this one will say so too
                        pass
            rows.append(row)
            print(markdown_row(row), flush=True)
    return rows


HEADER = ("| variant | expert SMs | E rows | P rows | E alone ms | E beside P ms (max) | steps during P | P alone ms | "
          "P beside E ms |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def markdown_row(r: dict) -> str:
    def f(x) -> str:
        return "–" if x is None else f"{x:.3f}"

    sms = "all" if r["expert_sms"] is None else str(r.get("green_sms", {}).get("expert", r["expert_sms"]))
    head = f"| {r['variant']} | {sms} | {r['expert_rows']} | {r['prefix_rows']} |"
    if r.get("error"):
        return f"{head} {r['error']} | | | | |"
    return (f"{head} {f(r['expert_alone_ms'])} | {f(r['expert_overlapped_ms'])} ({f(r['expert_overlapped_max_ms'])}) | "
            f"{r['steps_during_prefix']:.1f} | {f(r['prefix_alone_ms'])} | {f(r['prefix_overlapped_ms'])} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="random:pi0")
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--expert-rows", type=int, nargs="+", default=[4, 16])
    p.add_argument("--prefix-rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--expert-sms", type=int, nargs="*", default=[16, 32], help="green-context partitions to try")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--overlaps", type=int, default=5, help="prefix stages overlapped per case")
    p.add_argument("--no-capture-green", dest="capture_green", action="store_false",
                   help="skip the variants whose graphs are captured on the green contexts' streams")  # fmt: skip
    p.add_argument("--no-torch-ops", dest="torch_ops", action="store_false",
                   help="skip the rows of PyTorch GEMMs beside each other (they need no graph replay)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("overlap_probe: needs a CUDA GPU (it replays the stage engine's CUDA Graphs)")
    model = load_stages(args.checkpoint, backend="triton", device="cuda", dtype=torch.bfloat16, num_views=args.views,
                        chunk=args.chunk, prompt_len=args.prompt, expert_buckets=sorted(set(args.expert_rows)),
                        prefix_buckets=sorted(set(args.prefix_rows)))  # fmt: skip
    engine = model.stages
    runner = StageRunner(engine, prompt_len=args.prompt, seed=0)
    while engine.free:  # real KV in every pool row the graphs read
        k = max(k for k in engine.prefix_buckets if k <= engine.free)
        runner.prefix(range(engine.in_flight, engine.in_flight + k), [runner.dummy_row()] * k)
    engine.synchronize()
    print(HEADER, flush=True)
    rows = probe(engine, args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name().replace(" ", "-")
        meta = dict(checkpoint=args.checkpoint, views=args.views, prompt=args.prompt, chunk=args.chunk, gpu=gpu,
                    torch=torch.__version__, iters=args.iters, overlaps=args.overlaps)  # fmt: skip
        path = args.out / f"overlap_probe_{gpu}.json"
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (args.out / f"overlap_probe_{gpu}.md").write_text("\n".join([HEADER, *map(markdown_row, rows)]) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
