"""Timing that means something: CUDA events after warm-up, median and p90 over many calls.

On a machine without CUDA the same interface times with `time.perf_counter` (the CPU backends on `tiny`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


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

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms, "mean_ms": self.mean_ms,
                "n": self.n}  # fmt: skip


def time_calls(fn: Callable[[], object], *, warmup: int = 10, iters: int = 200, device: torch.device | None = None,
               max_seconds: float | None = None) -> Timing:  # fmt: skip
    """Times `fn()` per call: CUDA events on `device` if it is CUDA, else wall clock. Stops early at `max_seconds`."""
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if max_seconds is not None and time.perf_counter() - start_all > max_seconds and len(samples) >= 5:
            break
    return Timing.of(samples)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """The card's copy bandwidth (bytes read + written per second) and bf16 matmul rate, on random data."""
    n = 1 << 30  # 1 GiB of bf16 each way
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = time_calls(lambda: dst.copy_(src), warmup=5, iters=30, device=device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm = time_calls(lambda: a @ b, warmup=5, iters=30, device=device)
    return {
        "copy_bandwidth_bytes_per_s": 2 * n / (copy.median_ms * 1e-3),
        "bf16_matmul_flops_per_s": 2 * 8192**3 / (mm.median_ms * 1e-3),
    }
