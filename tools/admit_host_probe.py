"""Where the host time of a prefix stage goes: `StageEngine.admit` timed on the host (median / p90 over ITERS, the
GPU idle before each), then under torch.profiler (CPU activities), its ops by self CPU time.

Why: the H200 server's start-up cost model (56ea22c) logged a 1-row prefix stage at 12.7 ms median / 24.2 ms p90 on
the wall clock, of which 6.1 / 17.6 ms until `admit` returned, against 6.9 ms of GPU time: the host part is most of
the tail admission charges, and the worker thread launches no expert step meanwhile.

    python3 tools/admit_host_probe.py [--checkpoint random:pi0] [--iters 30] [--max-batch 32 --max-prefix 8]

First H200 run (2026-12-03, buckets 1 / 1): admit returned after 0.58 / 0.82 ms median / p90 and the stage was done
after 7.16 ms: the host's own work is small there. `--max-batch` / `--max-prefix` build the server's buckets and
then run the server's own start-up cost model (`measure_costs`) in this process, without the server's threads: the
next run tells the engine's size apart from the server process as the cause.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from vla_rt.inference import load_stages
from vla_rt.serve.scheduler import batch_buckets
from vla_rt.serve.worker import StageRunner, measure_costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="random:pi0")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--max-batch", type=int, default=1, help="expert buckets 1, 2, 4, ... up to this (the server's)")
    p.add_argument("--max-prefix", type=int, default=1, help="prefix buckets 1, 2, 4, ... up to this")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = load_stages(args.checkpoint, backend="triton", device="cuda", dtype=torch.bfloat16, num_views=2, chunk=50,
                        prompt_len=20, expert_buckets=batch_buckets(args.max_batch),
                        prefix_buckets=batch_buckets(args.max_prefix))  # fmt: skip
    engine = model.stages
    runner = StageRunner(engine, prompt_len=20, seed=0)
    zeros = torch.zeros(1, runner.chunk, runner.action_dim)

    row = runner.dummy_row()

    def admit_ms() -> tuple[float, float]:
        engine.synchronize()
        t0 = time.perf_counter()
        runner.prefix([0], [row], zeros)
        t1 = time.perf_counter()
        engine.synchronize()
        t2 = time.perf_counter()
        runner.reset()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    for _ in range(3):
        admit_ms()
    for timed in (False, True):
        engine.time_stages = timed
        host, total = zip(*[admit_ms() for _ in range(args.iters)])
        print(f"time_stages={timed}: admit returned after {np.median(host):.2f} / {np.percentile(host, 90):.2f} ms "
              f"(median / p90), stage done after {np.median(total):.2f} / {np.percentile(total, 90):.2f} ms")  # fmt: skip
    engine.time_stages = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            admit_ms()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if args.max_batch > 1 or args.max_prefix > 1:  # the server's start-up cost model, its log lines, this process
        measure_costs(runner, iters=10)
        # then with every host step of a prefix stage timed: which one holds the launch for a whole stage at p90;
        # once with torch's CPU threads, once with one (an OpenMP barrier waits for its slowest thread)
        parts = time_parts(engine, runner)
        for threads in (torch.get_num_threads(), 1):
            torch.set_num_threads(threads)
            for times in parts.values():
                times.clear()
            print(f"torch CPU threads: {threads}")
            measure_costs(runner, iters=10)
            for name, times in parts.items():
                if times:
                    median, p90, top = np.percentile(times, [50, 90, 100])
                    print(f"host part {name:>14}: {len(times):4d} calls, {median:.3f} / {p90:.3f} / {top:.3f} ms "
                          "median / p90 / max")  # fmt: skip


def time_parts(engine, runner) -> dict[str, list[float]]:
    """Wraps the prefix stage's host steps (instance attributes, this process only) to time each call."""
    parts: dict[str, list[float]] = {}

    def timed(name: str, fn):
        parts[name] = []

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name].append((time.perf_counter() - t0) * 1e3)

        return call

    for name in ("input_rows", "_upload", "_launch_prefix", "_install", "_fence", "_run_timed", "admit"):
        setattr(engine, name, timed(name, getattr(engine, name)))
    runner._stack = timed("stack", runner._stack)
    for k, graph in engine.prefix_graphs.items():
        graph.replay = timed(f"replay P({k})", graph.replay)
    return parts


if __name__ == "__main__":
    main()
