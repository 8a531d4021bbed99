"""What a persistent kernel would pay instead of a kernel boundary: one grid-wide barrier (atomic arrive + spin)
across one program per SM, against one empty kernel launched with programmatic dependent launch inside a CUDA
Graph (what the engine pays per kernel boundary today). Needs CUDA (a barrier deadlocks in the interpreter, which
runs programs one after another).

    python tools/probe_barrier.py [--barriers 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from vla_rt.triton_kernels.pdl import launch, pdl_enter


@triton.jit
def barrier_kernel(counter_ptr, n_barriers, NPROG: tl.constexpr):
    """n_barriers grid barriers: every program arrives (release), then polls (acquire) until all NPROG have."""
    for i in range(n_barriers):
        tl.atomic_add(counter_ptr, 1, sem="release")
        target = (i + 1) * NPROG
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def empty_kernel(x_ptr, USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    if tl.program_id(0) == 0:
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def _time(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--barriers", type=int, default=2000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_barrier needs CUDA")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    result = {"device": torch.cuda.get_device_name(), "programs": sms, "barriers": a.barriers}

    def barriers(n):
        counter.zero_()
        barrier_kernel[(sms,)](counter, n, NPROG=sms, num_warps=4)

    barriers(1)
    torch.cuda.synchronize()
    t0, t1 = _time(lambda: barriers(0)), _time(lambda: barriers(a.barriers))
    result["grid_barrier_us"] = (t1 - t0) / a.barriers
    x = torch.zeros(1, device="cuda")
    for grid in (1, sms):
        graph = torch.cuda.CUDAGraph()
        empty_kernel[(grid,)](x)  # compile
        launch(empty_kernel, (grid,), x)(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(a.barriers):
                launch(empty_kernel, (grid,), x)(x)
        graph.replay()
        torch.cuda.synchronize()
        result[f"pdl_empty_kernel_us_grid{grid}"] = _time(graph.replay, 10) / a.barriers
    print(json.dumps(result))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"probe_barrier_{torch.cuda.get_device_name().replace(' ', '-')}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
