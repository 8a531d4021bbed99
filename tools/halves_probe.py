"""Would an expert stage of 2n rows run faster as two n-row halves on two CUDA streams? A probe, before any engine
change.

Why: the server's expert step E(b) is latency-bound (about nine dependent kernels a layer, each a few µs, many
with fewer programs than SMs), and issue 25 asks E(8) <= 2 E(1) (measured 2.1-2.2x). The rows of a stage are
independent (each reads its own KV cache), so two halves on two streams could fill each other's bubbles (kernel
ramp-up, tails, the PDL hand-offs). If E(n) || E(n) measures under E(2n), the stage engine could capture its larger
buckets as two branches; if not, the idea is settled without touching the package.

Two stage engines are built (same shapes, each its own random weights and pool), so one half's weights are not
the other's: the pair reads twice the weight bytes a real split would, a pessimistic stand-in. Each stage graph
is replayed as the server replays it; times are CUDA events around `--reps` back-to-back replays after warm-up,
medians and p90 over `--trials`:

    python3 tools/halves_probe.py --pairs 4:8 16:32        # on a GPU, ~2 min (two engines' graphs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from vla_rt.inference import load_stages


def _timed(launch, streams: list[torch.cuda.Stream], reps: int) -> float:
    """ms a rep: `launch(i)` issues stream i's work for one rep; every stream starts after one event and the clock
    stops when all are done."""
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for s in streams:
        s.wait_event(start)
    for _ in range(reps):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                launch(i)
    for s in streams:
        main.wait_stream(s)
    end.record(main)
    end.synchronize()
    return start.elapsed_time(end) / reps


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return dict(median_ms=statistics.median(xs), p90_ms=xs[min(len(xs) - 1, int(0.9 * len(xs)))])


def probe_pair(half: int, whole: int, args) -> list[dict]:
    """E(whole) alone, E(half) alone, and two E(half) graphs of two engines at once on two streams."""
    build = dict(backend="triton", device="cuda", dtype=torch.bfloat16, num_views=args.views, chunk=args.chunk,
                 prompt_len=args.prompt, prefix_buckets=[1])  # fmt: skip
    a = load_stages(args.checkpoint, expert_buckets=[half, whole], **build).stages
    b = load_stages(args.checkpoint, expert_buckets=[half], **build).stages
    s0 = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    s1 = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    halves = (a.expert_graphs[half], b.expert_graphs[half])  # a and b own the graphs' buffers: alive to the end
    cases = {
        f"E({whole})": (lambda i: a.expert_graphs[whole].replay(), [s0]),
        f"E({half})": (lambda i: halves[0].replay(), [s0]),
        f"E({half}) || E({half})": (lambda i: halves[i].replay(), [s0, s1]),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for launch, streams in cases.values():  # warm-up: clocks up, L2 / TLB as in the trials
        _timed(launch, streams, args.reps)
    for _ in range(args.trials):  # interleaved, so a clock drift hits every case alike
        for name, (launch, streams) in cases.items():
            times[name].append(_timed(launch, streams, args.reps))
    torch.cuda.synchronize()
    return [dict(case=name, rows=whole if i != 1 else half, **_stats(ts)) for i, (name, ts) in enumerate(times.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="random:pi0")
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--pairs", nargs="+", default=["4:8"], help="half:whole row counts, e.g. 4:8 16:32")
    ap.add_argument("--reps", type=int, default=20, help="replays a timing (back to back)")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("halves_probe: needs a CUDA GPU (it times CUDA Graphs on two streams)")
    pairs = []
    for p in args.pairs:
        half, _, whole = p.partition(":")
        if not (half.isdigit() and whole.isdigit() and 0 < 2 * int(half) == int(whole)):
            sys.exit(f"halves_probe: --pairs expects half:whole with whole = 2 x half, e.g. 4:8, found {p!r}")
        pairs.append((int(half), int(whole)))
    torch.set_num_threads(1)
    rows = []
    for half, whole in pairs:
        rows += probe_pair(half, whole, args)
        torch.cuda.empty_cache()  # the pair's two engines are gone with probe_pair's frame
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; π0 bf16, {args.views} views, prompt {args.prompt}, chunk {args.chunk}; {args.reps} replays a "
          f"timing, {args.trials} trials")  # fmt: skip
    print("| case | median ms | p90 ms |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"halves_probe_{gpu.replace(' ', '-')}.json"
        (args.out / name).write_text(json.dumps(dict(gpu=gpu, argv=sys.argv, rows=rows), indent=1))


if __name__ == "__main__":
    main()
