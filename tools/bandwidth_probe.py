"""The memory ceilings of the expert kernel's GEMM units on this GPU (tools/bandwidth_probe.cu; H200 numbers in
docs/cuda_expert.md). Each CTA streams units of 128 KB of its own weights (HBM) and 128 KB of one activation image
that every CTA reads (L2) through rings of bulk copies, with and without TMA multicast of the activation across a
cluster; the copy size and the ring depth vary. Every variant is compiled first and the GPU is kept busy just before
each timing, so no variant runs on clocks that idled during a compile.

    python tools/bandwidth_probe.py [--units 200] [--out DIR]

Prints one row a variant: the time, HBM weight bytes / s and bytes delivered to shared memory / s (the
activation counted once per CTA that received it), and the largest number of co-resident clusters.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from vla_rt.cuda_kernels import build, driver
from vla_rt.timing import time_calls

SOURCE = Path(__file__).resolve().parent / "bandwidth_probe.cu"
UNIT_KB = 128  # a unit's weights (and its activation): 64 columns x K 1024, bf16


def smem_bytes(chunk_kb: int, ring_kb: int) -> int:
    w, a = ring_kb * 7 // 12 // chunk_kb, ring_kb * 5 // 12 // chunk_kb
    return (w + a) * chunk_kb * 1024 + 2 * (w + a) * 8


class Params(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("a", ctypes.c_void_p), ("sink", ctypes.c_void_p),
                ("w_region", ctypes.c_int64), ("units", ctypes.c_int), ("w_chunks", ctypes.c_int),
                ("a_chunks", ctypes.c_int), ("pad", ctypes.c_int)]  # fmt: skip


def defines(v: dict) -> dict:
    return {"CLUSTER": v["cluster"], "MULTICAST": int(v["multicast"]), "CHUNK_KB": v.get("chunk_kb", 8),
            "RING_KB": v.get("ring_kb", 192)}  # fmt: skip


def warm_clocks(ms: float = 150.0) -> None:
    """Busy matmuls for `ms`: the SM clock ramps down while a compile leaves the GPU idle."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            x = (x @ x).clamp_(-1, 1)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > ms:
            return


def run_variant(w, a, sink, *, cluster, multicast, ctas, units, w_chunks, a_chunks, chunk_kb=8, ring_kb=192,
                reps=7) -> dict:  # fmt: skip
    v = dict(cluster=cluster, multicast=multicast, chunk_kb=chunk_kb, ring_kb=ring_kb)
    cubin, _ = build.compile_cubin(str(SOURCE), defines(v), quiet=True)
    kernel = driver.Kernel(cubin, "bandwidth_probe", smem_bytes(chunk_kb, ring_kb))
    chunk = chunk_kb * 1024
    w_chunks, a_chunks = w_chunks * 8 // chunk_kb, a_chunks * 8 // chunk_kb  # given in 8 KB chunks
    region = (w.numel() // ctas) // chunk * chunk
    p = Params(w.data_ptr(), a.data_ptr(), sink.data_ptr(), region, units, w_chunks, a_chunks, 0)
    stream = torch.cuda.current_stream().cuda_stream
    warm_clocks()
    # the first launch loads the module: untimed
    timing = time_calls(lambda: kernel.launch(ctas, 128, p, stream), warmup=1, iters=reps, device=torch.device("cuda"))
    t = timing.median_ms * 1e-3
    w_bytes = ctas * units * w_chunks * chunk
    a_bytes = ctas * units * a_chunks * chunk  # delivered to shared memory
    a_fetched = a_bytes // cluster if multicast else a_bytes
    return dict(cluster=cluster, multicast=multicast, ctas=ctas, w_kb=w_chunks * chunk_kb, a_kb=a_chunks * chunk_kb,
                chunk_kb=chunk_kb, ring_kb=ring_kb,
                ms=t * 1e3, hbm_tb_s=w_bytes / t / 1e12, smem_in_tb_s=(w_bytes + a_bytes) / t / 1e12,
                l2_out_tb_s=(w_bytes + a_fetched) / t / 1e12, unit_us=t / units * 1e6,
                max_clusters=kernel.max_active_clusters(ctas, 128))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.cuda.init()
    w = torch.randint(0, 255, (3 << 30,), dtype=torch.uint8, device="cuda")  # 3 GB: far past the L2
    a = torch.randint(0, 255, (UNIT_KB * 1024,), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(256, dtype=torch.int32, device="cuda")
    variants = [
        dict(cluster=1, multicast=False, ctas=132, w_chunks=16, a_chunks=0),
        dict(cluster=1, multicast=False, ctas=132, w_chunks=0, a_chunks=16),
        dict(cluster=1, multicast=False, ctas=132, w_chunks=16, a_chunks=16),
        dict(cluster=1, multicast=False, ctas=128, w_chunks=16, a_chunks=16),
    ]
    for c, ctas in ((2, 132), (4, 128), (8, 128)):
        variants += [dict(cluster=c, multicast=True, ctas=ctas, w_chunks=0, a_chunks=16),
                     dict(cluster=c, multicast=True, ctas=ctas, w_chunks=16, a_chunks=16),
                     dict(cluster=c, multicast=False, ctas=ctas, w_chunks=16, a_chunks=16)]  # fmt: skip
    # a few SMs alone (a small stage: the rest of the GPU idle): what one SM can take in
    variants += [dict(cluster=1, multicast=False, ctas=4, w_chunks=16, a_chunks=16),
                 dict(cluster=1, multicast=False, ctas=4, w_chunks=0, a_chunks=16),
                 dict(cluster=4, multicast=True, ctas=4, w_chunks=0, a_chunks=16),
                 dict(cluster=8, multicast=True, ctas=8, w_chunks=0, a_chunks=16)]  # fmt: skip
    # copy size and ring depth, every SM and one SM alone
    for ctas in (132, 4):
        for chunk_kb, ring_kb in ((16, 192), (32, 192), (8, 96), (16, 96)):
            variants.append(dict(cluster=1, multicast=False, ctas=ctas, w_chunks=16, a_chunks=16, chunk_kb=chunk_kb,
                                 ring_kb=ring_kb))  # fmt: skip
    with ThreadPoolExecutor(8) as pool:  # every cubin before the first timing
        list(pool.map(lambda d: build.compile_cubin(str(SOURCE), d, quiet=True),
                      [dict(t) for t in {tuple(defines(v).items()) for v in variants}]))  # fmt: skip
    rows = []
    print("| cluster | multicast | CTAs | copy KB | ring KB | W KB | A KB | ms | HBM TB/s | into smem TB/s | out of L2 TB/s "
          "| µs a unit | max clusters |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for v in variants:
        try:
            r = run_variant(w, a, sink, units=args.units, **v)
        except Exception as e:  # a variant that cannot launch (cluster too large) is a row, not the end
            r = {**v, "error": str(e)[:200]}
        rows.append(r)
        if "error" in r:
            print(f"| {v['cluster']} | {v['multicast']} | {v['ctas']} | error: {r['error']} |")
        else:
            print(f"| {r['cluster']} | {r['multicast']} | {r['ctas']} | {r['chunk_kb']} | {r['ring_kb']} | "
                  f"{r['w_kb']} | {r['a_kb']} | {r['ms']:.3f} | {r['hbm_tb_s']:.2f} | {r['smem_in_tb_s']:.2f} | "
                  f"{r['l2_out_tb_s']:.2f} | {r['unit_us']:.2f} | {r['max_clusters']} |", flush=True)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bandwidth_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
