"""The floor of one GEMM stage of the persistent expert, by tiling (tools/unit_probe.cu; docs/cuda_expert.md, issue 25).

The persistent kernel's GEMM units take 7-8 µs a stage on the H200, and its protocol alone (no copies, no MMAs) 5 µs;
the hand-off between CTAs costs ~0.9 µs and landing 128 KB by bulk copies ~1.3 µs more (tools/handoff_probe.py). This
probe times a chain of stages in which every CTA runs one real B = 1 GEMM unit (64 rows, K = 1024, 128 KB of
weights a CTA, resident as if the loader ran ahead): the grid barrier, the activation slice landed by 16 KB bulk
copies, the wgmmas, the output tile stored, the release. Nothing else: no ring of weight pages, no RMS factors, no
trace, so it is the floor of the unit for a tiling, against which the kernel's unit can be read.

Tilings (`CLUSTER`): c1 is today's kernel, a CTA owns 64 columns over all of K and lands 128 KB before its last MMA.
c2 / c4 split K over a thread-block cluster of 2 / 4 CTAs that own 128 / 256 columns: each CTA lands 64 / 32 KB,
multiplies its K slice into all the cluster's columns (the same MMA work and weight bytes as c1), then the cluster
sums the partials through distributed shared memory in rank order (deterministic) and each CTA stores its 64
columns. Variants add two accumulator chains, one barrier for the whole slice, one bulk store of the output tile
(`BULK_STORE`), m64n64k16 wgmmas over the unit's 64 columns (`N64`), or drop the MMAs / the copies. After the table,
the c1 stage in parts: the bare stage, what the landing and the MMAs add, what each lever changes.

`ATTN` variants time the other unit a layer needs, an attention unit as the expert kernel runs it (64 queries of one
head over 64 keys: Q in registers, K and V landed, S = Q K^T, the online softmax, P V, the fp32 partial stored, by
the threads or by one bulk store), with no masks and no bookkeeping, and (`ATTN` 2) the merge unit after it (16 rows of
a head from five key splits' partials): the numbers docs/cuda_expert.md's rewrite budget lacks (today it reads the
kernel's own attention and merge tails, 6.15 + 3.42 µs).

Measured on the H100 (2026-12-07, docs/cuda_expert.md): c1 5.78 µs a stage (bare 2.71, landing +1.04, MMAs +2.29),
c2 6.49, c4 9.57 (its DSMEM reduction alone costs 4.3 µs): the K split loses.

µs a stage is the slope between chains of 108 and 216 stages (launch overhead cancels). Every variant runs on the
same grid: the most CTAs at which the largest cluster is still co-resident (a grid barrier needs every CTA resident),
plus c1 on every SM for reference.

    python tools/unit_probe.py [--reps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vla_rt.cuda_kernels import build, driver
from vla_rt.timing import time_calls

SOURCE = Path(__file__).resolve().parent / "unit_probe.cu"
STAGES = (108, 216)  # one and two steps' worth of six stages a layer x 18 layers; the slope is a stage
IMAGE_BYTES = 128 * 1024  # x at 64 rows: the activation image a K = 1024 unit reads
W_BYTES, RECV_PEER_BYTES, ALIGN = 65536, 16384, 1024  # the kernel's W_BYTES, 2 x 128 x 16 floats a peer, its align-up
OUT_TILE_BYTES = 8192  # the 64 x 64 bf16 output tile, staged in shared memory for a bulk store
ATTN_LANDED = 4 * 16384  # an attention unit's K and V: two 32-key items of each, 16 KB an item
ATTN_PART_BYTES = 64 * 256 * 4  # its unnormalised fp32 partial, staged for a bulk store
ATTN_OUT_STRIDE = ATTN_PART_BYTES + 64 * 8  # a CTA's partial and its (max, sum) rows in the `out` buffer
Q_FRAG_BYTES = 64 * 256 * 2  # one head's 64 query rows, bf16, in wgmma's A-fragment order
XCH_BYTES = 16384  # N64 = 2: warpgroup 1's 64 x 64 fp32 partial on its way to warpgroup 0
BLOCK = 256


class Params(ctypes.Structure):
    _fields_ = [("counters", ctypes.c_void_p), ("acts", ctypes.c_void_p), ("error", ctypes.c_void_p),
                ("stages", ctypes.c_int), ("epoch", ctypes.c_uint), ("out", ctypes.c_void_p)]  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One build of the probe: the tiling and what a stage does."""

    cluster: int = 1
    acc_chains: int = 1
    one_bar: bool = False
    mma: bool = True
    read: bool = True
    bulk_store: bool = False
    n64: int = 0  # 1: warpgroup 0 alone on m64n64k16 wgmmas; 2: both, alternate k-chunks, summed in shared memory
    attn: int = 0  # 1: an attention unit (64 queries of one head over 64 keys) instead of a GEMM unit; 2: a merge unit

    @property
    def defines(self) -> dict[str, int]:
        return {"CLUSTER": self.cluster, "ACC_CHAINS": self.acc_chains, "ONE_BAR": int(self.one_bar),
                "MMA": int(self.mma), "READ": int(self.read), "BULK_STORE": int(self.bulk_store), "N64": self.n64,
                "ATTN": int(self.attn)}  # fmt: skip

    @property
    def slice_kb(self) -> int:
        """KB of activations a CTA lands a stage (its K slice of x at 64 rows; an attention unit's K and V)."""
        return ATTN_LANDED // 1024 if self.attn else IMAGE_BYTES // self.cluster // 1024

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the weights, the landing buffer, the peers' partials, the 1024-byte align-up."""
        if self.attn:  # no weights; K / V landed, the partial staged for its bulk store
            return ATTN_LANDED + (ATTN_PART_BYTES if self.bulk_store else 0) + ALIGN
        staged = OUT_TILE_BYTES if self.bulk_store else 0
        exchange = XCH_BYTES if self.n64 == 2 else 0
        return W_BYTES + IMAGE_BYTES // self.cluster + (self.cluster - 1) * RECV_PEER_BYTES + staged + exchange + ALIGN

    @property
    def label(self) -> str:
        parts = [f"c{self.cluster}: {64 * self.cluster} columns x K {1024 // self.cluster} a CTA, {self.slice_kb} KB "
                 "landed"]  # fmt: skip
        if self.attn == 1:
            parts = ["attention: 64 queries of a head x 64 keys, 64 KB of K / V landed"]
        if self.attn == 2:
            return "merge: 16 rows of a head from 5 key splits' fp32 partials (80 KB read), 8 KB of bf16 stored"
        if self.acc_chains == 2:
            parts.append("two accumulator chains")
        if self.one_bar:
            parts.append("one barrier for the slice")
        if not self.mma:
            parts.append("no MMAs")
        if not self.read:
            parts.append("no copies")
        if self.bulk_store:
            parts.append("output by one bulk store")
        if self.n64:
            parts.append(
                "m64n64k16 wgmmas, " + ("one warpgroup" if self.n64 == 1 else "two warpgroups on alternate chunks")
            )
        return ", ".join(parts)


VARIANTS = (
    Variant(1), Variant(1, acc_chains=2), Variant(1, one_bar=True), Variant(1, mma=False), Variant(1, read=False),
    Variant(1, mma=False, read=False), Variant(1, bulk_store=True), Variant(1, acc_chains=2, bulk_store=True),
    Variant(1, mma=False, read=False, bulk_store=True),
    Variant(1, n64=1), Variant(1, n64=2), Variant(1, n64=1, read=False), Variant(1, n64=2, bulk_store=True),
    Variant(2), Variant(2, acc_chains=2),
    Variant(4), Variant(4, acc_chains=2), Variant(4, mma=False), Variant(4, mma=False, read=False),
    Variant(attn=True), Variant(attn=True, bulk_store=True), Variant(attn=True, mma=False),
    Variant(attn=True, read=False), Variant(attn=True, mma=False, read=False),
    Variant(attn=True, mma=False, read=False, bulk_store=True), Variant(attn=2, mma=False, read=False),
)  # fmt: skip


def parts(rows: list[dict], ctas: int) -> list[str]:
    """The c1 stage in parts, from the rows measured on `ctas` CTAs (each line only where its rows are there): the
    bare stage, what landing the slice and the MMAs add to it, and what the two store / wgmma levers change."""

    def us(**want) -> float | None:
        base = dict(CLUSTER=1, ACC_CHAINS=1, ONE_BAR=0, MMA=1, READ=1, BULK_STORE=0, N64=0, ATTN=0)
        for r in rows:
            knobs = {**base, **want}  # a knob a row lacks (a run from before it existed) had its default
            if r.get("ctas") == ctas and "us_a_stage" in r and all(r.get(k, base[k]) == v for k, v in knobs.items()):
                return r["us_a_stage"]
        return None

    full, bare, landed, multiplied = us(), us(MMA=0, READ=0), us(MMA=0), us(READ=0)
    lines = []
    if None not in (full, bare, landed, multiplied):
        land, mma = landed - bare, multiplied - bare
        lines.append(f"c1 in parts: the bare stage (hand-off, output store, release) {bare:.2f} µs; landing 128 KB adds "
                     f"{land:.2f}; the MMAs add {mma:.2f}; together {full:.2f} µs, {bare + land + mma - full:.2f} µs "
                     "of overlap")  # fmt: skip
    bulk_bare, bulk_full = us(MMA=0, READ=0, BULK_STORE=1), us(BULK_STORE=1)
    if None not in (bare, bulk_bare):
        lines.append(
            f"one bulk store instead of the threads' stores: bare stage {bulk_bare:.2f} against {bare:.2f} µs"
            + (f", the unit {bulk_full:.2f} against {full:.2f}" if None not in (full, bulk_full) else "")
        )
    attn, attn_bulk = us(ATTN=1), us(ATTN=1, BULK_STORE=1)
    attn_bare, attn_landed, attn_mult = us(ATTN=1, MMA=0, READ=0), us(ATTN=1, MMA=0), us(ATTN=1, READ=0)
    if None not in (attn, attn_bare, attn_landed, attn_mult):
        lines.append(f"an attention unit: {attn:.2f} µs a stage; bare {attn_bare:.2f}, landing 64 KB adds "
                     f"{attn_landed - attn_bare:.2f}, the MMAs and softmax add {attn_mult - attn_bare:.2f}"
                     + (f"; its partial by one bulk store {attn_bulk:.2f}" if attn_bulk is not None else ""))  # fmt: skip
    merge = us(ATTN=2, MMA=0, READ=0)
    if merge is not None:
        lines.append(f"a merge unit (five key splits, 16 rows): {merge:.2f} µs a stage"
                     + (f"; attention + merge {attn + merge:.2f}" if attn is not None else ""))  # fmt: skip
    lean, chains = us(ACC_CHAINS=2, BULK_STORE=1), us(ACC_CHAINS=2)
    if None not in (lean, chains):  # the lean unit docs/cuda_expert.md budgets a rewrite with
        lines.append(f"two chains and one bulk store (the lean unit): {lean:.2f} µs a stage against {chains:.2f} "
                     f"with two chains alone; 108 such stages {108 * lean / 1e3:.2f} ms")  # fmt: skip
    for n64 in (1, 2):
        wide, wide_mma = us(N64=n64), us(N64=n64, READ=0)
        if None not in (full, wide):
            lines.append(f"m64n64k16 on {'one warpgroup' if n64 == 1 else 'two warpgroups'}: the unit {wide:.2f} "
                         f"against {full:.2f} µs" + (f"; its MMAs alone add {wide_mma - bare:.2f} against "
                         f"{multiplied - bare:.2f}" if None not in (wide_mma, bare, multiplied) else ""))  # fmt: skip
    return lines


def common_grid(sms: int, max_clusters: dict[int, int]) -> int:
    """The most CTAs, a multiple of every cluster size, at which every cluster size is co-resident (one CTA a SM)."""
    lcm = math.lcm(*max_clusters)
    fits = min([sms] + [c * n for c, n in max_clusters.items()])
    return fits // lcm * lcm


def time_chain(kernel: driver.Kernel, ctas: int, stages: int, reps: int, buffers: dict) -> float:
    """Median ms of `reps` launches of a chain of `stages` after one that loads the module; launch e waits for
    ctas x (e + 1) on counters zeroed here."""
    stream = torch.cuda.current_stream().cuda_stream
    counters = buffers["counters"][:stages]
    counters.zero_()
    epochs = itertools.count()

    def launch() -> None:
        p = Params(counters.data_ptr(), buffers["acts"].data_ptr(), buffers["error"].data_ptr(), stages, next(epochs),
                   buffers["out"].data_ptr())  # fmt: skip
        kernel.launch(ctas, BLOCK, p, stream)

    return time_calls(launch, warmup=1, iters=reps, device=torch.device("cuda")).median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buffers = dict(counters=torch.zeros(max(STAGES), dtype=torch.int32, device="cuda"),
                   acts=torch.zeros(2 * IMAGE_BYTES + Q_FRAG_BYTES, dtype=torch.uint8, device="cuda"),
                   out=torch.zeros(sms * ATTN_OUT_STRIDE, dtype=torch.uint8, device="cuda"),
                   error=torch.zeros(2, dtype=torch.int32, device="cuda"))  # fmt: skip
    kernels, logs = {}, {}
    for v in VARIANTS:  # after the tensors: they make torch's context current
        cubin, logs[v] = build.compile_cubin(str(SOURCE), v.defines, quiet=True)
        kernels[v] = driver.Kernel(cubin, "unit_probe", v.smem_bytes)
    fits = {v.cluster: k.max_active_clusters(sms, BLOCK) for v, k in kernels.items()}
    grid = common_grid(sms, {c: n if n > 0 else sms // c for c, n in fits.items()})
    warm = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; co-resident clusters by size {fits}; every variant on {grid} "
          f"CTAs (c1 also on {sms}); chains of {STAGES[0]} and {STAGES[1]} stages, median of {args.reps} launches\n"
          "| variant | CTAs | µs a stage | chain of 108 ms | registers |\n|---|---|---|---|---|")  # fmt: skip
    rows = []
    runs = [(v, grid) for v in VARIANTS] + [(VARIANTS[0], sms), (VARIANTS[1], sms)]
    for v, ctas in runs:
        for _ in range(20):  # the SM clock ramps down while the host compiles or prints
            warm = (warm @ warm).clamp_(-1, 1)
        buffers["error"].zero_()
        time_chain(kernels[v], ctas, 2, 1, buffers)  # a grid that is not co-resident times out here, in ~0.1 s
        if buffers["error"][0].item():
            rows.append(dict(**v.defines, label=v.label, ctas=ctas, timed_out=True))
            print(f"| {v.label}: a wait TIMED OUT on {ctas} CTAs (not co-resident?) | {ctas} | – | – | – |", flush=True)
            continue
        short, long = (time_chain(kernels[v], ctas, s, args.reps, buffers) for s in STAGES)
        error = int(buffers["error"][0].item())
        us = (long - short) / (STAGES[1] - STAGES[0]) * 1e3
        regs = build.Resources.parse(logs[v]).registers
        rows.append(dict(**v.defines, label=v.label, ctas=ctas, slice_kb=v.slice_kb, us_a_stage=us,
                         chain_108_ms=short, registers=regs, timed_out=bool(error)))  # fmt: skip
        note = " (a wait TIMED OUT: not co-resident?)" if error else ""
        print(f"| {v.label}{note} | {ctas} | {us:.2f} | {short:.3f} | {regs} |", flush=True)
    for line in parts(rows, grid):
        print(line)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "unit_probe.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), sms=sms,
                                                                    max_clusters=fits, rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
