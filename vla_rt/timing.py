"""Timing that means something: CUDA events after warm-up, median and p90 over many samples.

One module for every benchmark (`vla_rt.bench`) and the kernel tuner (`vla_rt.triton_kernels.tuning`), so they all
time alike. It sits at the bottom of the package (it imports only torch and numpy) because the kernel package may
not import the bench layer above it, and both need it.

- `time_calls(fn)`: `fn()` per sample with CUDA events around each call (wall clock without CUDA).
- `time_graph(launch)`: `launch(i)` recorded `calls` times in one CUDA Graph, after eager warm-up launches on a side
  stream (which compile kernels and size workspaces); each sample is one timed replay divided by `calls`. This is
  how the engine runs kernels, so in-graph launch gaps are what is measured; cycling `launch(i)` over `copies` input
  sets (weight copies larger than the L2) measures a kernel at HBM bandwidth, as in inference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vla_rt.graph_capture import graph_capture

__all__ = ["Timing", "time_calls", "time_graph"]


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Timing:
        a = np.asarray(samples_ms)
        return cls(float(np.median(a)), float(np.percentile(a, 90)), float(np.percentile(a, 99)), float(a.mean()),
                   len(a))  # fmt: skip

    @property
    def median_us(self) -> float:
        return self.median_ms * 1e3

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms, "mean_ms": self.mean_ms,
                "n": self.n}  # fmt: skip


def _event_ms(run: Callable[[], object], device: torch.device | None = None) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def time_calls(fn: Callable[[], object], *, warmup: int = 10, iters: int = 200, device: torch.device | None = None,
               max_seconds: float | None = None) -> Timing:  # fmt: skip
    """Times `fn()` per call: CUDA events on `device` if it is CUDA, else wall clock. Stops early at `max_seconds`
    (after at least 5 samples)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    for _ in range(iters):
        if cuda:
            samples.append(_event_ms(fn, device))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if max_seconds is not None and time.perf_counter() - start_all > max_seconds and len(samples) >= 5:
            break
    return Timing.of(samples)


def time_graph(launch: Callable[[int], object], *, copies: int = 1, calls: int = 1, replays: int = 20,
               warmup: int = 3, device: torch.device | str | None = None) -> Timing:  # fmt: skip
    """Per-call time of `launch(i)` (i cycling over `copies` input sets) inside a replayed CUDA Graph of
    max(copies, calls) launches: `warmup` eager launches on a side stream, capture, 3 untimed replays, then
    `replays` replays timed with CUDA events, each divided by the launches it holds."""
    device = torch.device(device if device is not None else "cuda")
    n = max(copies, calls)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(min(n, warmup)):
            launch(i % copies)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for i in range(n):
            launch(i % copies)
    for _ in range(3):
        graph.replay()
    return Timing.of([_event_ms(graph.replay, device) / n for _ in range(replays)])
