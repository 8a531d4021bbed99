"""The floor under the persistent expert kernel's hand-offs (tools/handoff_probe.cu; docs/cuda_expert.md, issue 25).

The kernel's protocol alone (no copies, no MMAs: `ExpertDims.diag = 3`) takes 0.79 ms a step on the H200, ~5.5 µs
a stage, six stages a layer: more than the whole per-op step. This probe times what a stage costs with nothing but
the hand-off: every CTA stores a tile, releases a counter, the next stage's CTAs acquire it and read the tiles.
The per-stage time is the slope between two chain lengths (launch overhead cancels), for each fan-in (how many
producer CTAs a consumer waits for: all of them is a grid barrier) and each size of what a consumer reads (the
activation tensor: x is 128 KB at one row of 64, h 512 KB). If a bare hand-off costs ~1 µs, a design with three
a layer has ~55 µs of chain a step, inside the 0.25 ms target; at today's ~5.5 µs a stage it cannot fit. Measured
on the H200 (2026-12-04, docs/cuda_expert.md): 0.7-0.9 µs a bare hand-off whatever the fan-in, 2.2 µs with a
128 KB bulk read at the grid barrier.

A consumer reads either with 16-byte loads by every thread (`ld`: few in flight, so slow) or with 1D bulk copies
into shared memory (`bulk`: the expert kernel's activation path), `--reads ld,bulk`. `--rings 16,16bare,...` adds
variants in which each stage also passes 16 pages through the CTA's loader-to-consumer mbarrier ring (a GEMM unit's
16 weight pages in the expert kernel, without the copies), polled as the kernel polls or bare: what the ring's
hand-offs cost a unit, beside what the hand-off between CTAs costs; `16loaderbare` / `16consumersbare` check on one
side only, to say whose checks cost what (measured 2026-12-04: kernel-like polls 3.91 µs a stage, bare 3.25, the
consumers' polls bare 3.26, the loader's 3.85, the bulk read alone 2.25).

    python tools/handoff_probe.py [--ctas 132] [--reps 20] [--reads ld,bulk] [--rings 16,16bare] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vla_rt.cuda_kernels import build, driver
from vla_rt.timing import time_calls

SOURCE = Path(__file__).resolve().parent / "handoff_probe.cu"
STAGES = (108, 216)  # one and two steps' worth of six stages a layer x 18 layers; the slope is a stage


class Params(ctypes.Structure):
    _fields_ = [("counters", ctypes.c_void_p), ("tiles", ctypes.c_void_p), ("sink", ctypes.c_void_p),
                ("stages", ctypes.c_int), ("fan_in", ctypes.c_int), ("words", ctypes.c_int),
                ("epoch", ctypes.c_uint)]  # fmt: skip


def fan_ins(ctas: int) -> list[int]:
    """Point to point, a few groups, a large group, the whole grid: divisors of `ctas` near 1, 4, 12, ctas / 4, ctas."""
    wanted = (1, 4, 12, ctas // 4, ctas)
    return sorted({max(d for d in range(1, w + 1) if ctas % d == 0) for w in wanted})


READS = {"ld": 0, "bulk": 1}  # the kernel's BULK define
# RING_PAGES, RING_CHECKS (bit 1: the consumers poll as the kernel does, bit 2: the loader): pages a stage
RINGS = {"0": (0, 3), "16": (16, 3), "16bare": (16, 0), "16loaderbare": (16, 1), "16consumersbare": (16, 2)}
RING_POLLS = {3: "", 0: " (bare polls)", 1: " (the loader's polls bare)", 2: " (the consumers' polls bare)"}


def landing_bytes(read: str, read_kb: int) -> int:
    """Dynamic shared memory a consumer lands its reads in: bulk copies need room for all of them; loads none."""
    return read_kb * 1024 if READS[read] else 0


@dataclass(frozen=True)
class Variant:
    """How a stage's consumer reads, and how many pages it then takes through the CTA's ring."""

    read: str
    ring: str = "0"

    @property
    def pages(self) -> int:
        return RINGS[self.ring][0]

    @property
    def defines(self) -> dict[str, int]:
        return {"BULK": READS[self.read], "RING_PAGES": self.pages, "RING_CHECKS": RINGS[self.ring][1]}

    @property
    def block(self) -> int:
        """128 consumer threads, and the ring's loader warp when there is a ring."""
        return 128 + (32 if self.pages else 0)

    @property
    def label(self) -> str:
        if not self.pages:
            return self.read
        return f"{self.read}, ring of {self.pages} pages" + RING_POLLS[RINGS[self.ring][1]]

    def cases(self, ctas: int, read_kbs: list[int]) -> list[tuple[int, int]]:
        """(fan-in, KB read) to time: every fan-in without a ring (a bulk read of nothing is ld's 0 KB row), the grid
        barrier only with one (the expert kernel's stages wait for most producers of a tensor)."""
        fans = [ctas] if self.pages else fan_ins(ctas)
        return [(f, kb) for f in fans for kb in read_kbs if self.pages or self.read == "ld" or kb > 0]


def variants(reads: list[str], rings: list[str]) -> list[Variant]:
    """Each read without a ring, then each ring after bulk reads (the kernel's read path) where asked for."""
    for name, table, opt in ((reads, READS, "--reads"), (rings, RINGS, "--rings")):
        unknown = [x for x in name if x not in table]
        if unknown:
            raise ValueError(f"{opt}: expected a comma-separated subset of {sorted(table)}, found {unknown}")
    ring_read = "bulk" if "bulk" in reads else reads[0]
    return [Variant(r) for r in reads] + [Variant(ring_read, ring) for ring in rings if RINGS[ring][0]]


def words_for(read_kb: int, fan_in: int) -> int:
    """16-byte words each producer stores so that a consumer reads `read_kb` KB from its `fan_in` producers."""
    return read_kb * 1024 // 16 // fan_in


def time_chain(kernel, block: int, ctas: int, fan_in: int, words: int, stages: int, reps: int,
               buffers: dict) -> float:  # fmt: skip
    """Median ms of `reps` launches of a chain of `stages` after one that loads the module (`time_calls`: CUDA events
    around each). The counters start at zero and launch i, its epoch, waits for fan_in x (i + 1)."""
    stream = torch.cuda.current_stream().cuda_stream
    counters = buffers["counters"][: stages * (ctas // fan_in)]
    counters.zero_()
    epochs = itertools.count()

    def launch() -> None:
        p = Params(counters.data_ptr(), buffers["tiles"].data_ptr(), buffers["sink"].data_ptr(), stages, fan_in,
                   words, next(epochs))  # fmt: skip
        kernel.launch(ctas, block, p, stream)

    return time_calls(launch, warmup=1, iters=reps, device=torch.device("cuda")).median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctas", type=int, default=None, help="CTAs (default: one a SM)")
    ap.add_argument("--read-kb", default="0,16,128", help="KB a consumer reads a stage (comma-separated)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reads", default="ld,bulk", help="how a consumer reads: ld (thread loads), bulk (bulk copies)")
    ap.add_argument(
        "--rings",
        default="16,16bare,16loaderbare,16consumersbare",
        help="ring variants: 16 (kernel-like polls), 16bare, 16loaderbare, 16consumersbare; '' for none",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    try:
        chosen = variants(args.reads.split(","), [r for r in args.rings.split(",") if r])
    except ValueError as e:
        ap.error(str(e))
    ctas = args.ctas or torch.cuda.get_device_properties(0).multi_processor_count
    read_kbs = [int(x) for x in args.read_kb.split(",")]
    most_words = max(words_for(kb, 1) for kb in read_kbs) or 1
    buffers = dict(counters=torch.zeros(max(STAGES) * ctas, dtype=torch.int32, device="cuda"),
                   tiles=torch.zeros(2 * ctas * most_words * 4, dtype=torch.int32, device="cuda"),
                   sink=torch.zeros(ctas, dtype=torch.int32, device="cuda"))  # fmt: skip
    kernels, log = {}, ""
    for v in chosen:  # after the tensors: they make torch's context current
        cubin, log = build.compile_cubin(str(SOURCE), v.defines, quiet=True)
        kernels[v] = driver.Kernel(cubin, "handoff_probe", landing_bytes(v.read, max(read_kbs)))
    warm = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    rows = []
    print(f"{ctas} CTAs, chains of {STAGES[0]} and {STAGES[1]} stages, median of {args.reps} launches\n"
          "| variant | fan-in (CTAs a consumer waits for) | KB a consumer reads | µs a stage | chain of 108 ms |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for v, kernel in kernels.items():
        for fan_in, kb in v.cases(ctas, read_kbs):
            words = words_for(kb, fan_in)
            for _ in range(20):  # the SM clock ramps down while the host compiles or prints
                warm = (warm @ warm).clamp_(-1, 1)
            short, long = (time_chain(kernel, v.block, ctas, fan_in, words, s, args.reps, buffers) for s in STAGES)
            us = (long - short) / (STAGES[1] - STAGES[0]) * 1e3
            rows.append(dict(read=v.read, ring_pages=v.pages, ring=v.ring, ctas=ctas, fan_in=fan_in, read_kb=kb,
                             words=words, us_a_stage=us, chain_108_ms=short))  # fmt: skip
            print(f"| {v.label} | {fan_in} | {kb} | {us:.2f} | {short:.3f} |", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "handoff_probe.json").write_text(json.dumps(dict(rows=rows, ptxas=log[-2000:]), indent=1))


if __name__ == "__main__":
    main()
