"""One line a kernel name from Nsight Compute's raw CSV: what limits each kernel of a profiled step.

Why: issue 25 asks for evidence before each lever (L2 hit rate, throughput against peak, what warps wait on), and
`tools/profile_engine.py` only sees durations and gaps. `bash tools/device_session.sh ncu` profiles one expert step
(`profile_engine.py --ncu`: one graph replay between cudaProfilerStart / Stop, every kernel timed alone) and runs this
on `ncu --import <rep> --csv --page raw`: one row a kernel launch, the metric names as the header, their units in
the second row. Launches of one kernel name are merged (median duration, summed time); the table is sorted by time.

    python3 tools/ncu_summary.py ncu_step_b8.csv [--top 12] [--stalls 3]

Columns: the median time alone (us), the share of the step's kernel time, SM, memory, L2, L2→SM (the crossbar into
L1 / shared memory) and TMA-pipe throughput (% of peak), DRAM bytes a second, the L2 hit rate, achieved occupancy
(% of the SM's warps), registers a thread, waves a launch, the clock ncu ran it at (it locks the clocks, to base by
default, so times run longer than under the graph), and the warp stall reasons with the most cycles a issued
instruction (ncu's WarpStateStats).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

NAME = "Kernel Name"
DURATION = "gpu__time_duration.sum"
COLUMNS = {  # short name -> the raw metric (the sections SpeedOfLight, MemoryWorkloadAnalysis, Occupancy, LaunchStats)
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem %": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "L2 %": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "L2→SM %": "l1tex__m_xbar2l1tex_read_sectors.avg.pct_of_peak_sustained_elapsed",  # the crossbar into L1 / smem
    "TMA %": "sm__pipe_tma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "DRAM GB/s": "dram__bytes.sum.per_second",
    "L2 hit %": "lts__t_sector_hit_rate.pct",
    "occ %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "waves": "launch__waves_per_multiprocessor",
    "GHz": "gpc__cycles_elapsed.max.per_second",  # ncu locks the clocks (base by default): times are at this clock
}
# metrics whose unit ncu picks by magnitude: the factor to the column's unit
RATE_TO_GB_S = {
    "byte/second": 1e-9,
    "Kbyte/second": 1e-6,
    "Mbyte/second": 1e-3,
    "Gbyte/second": 1.0,
    "Tbyte/second": 1e3,
    "byte/s": 1e-9,
    "Kbyte/s": 1e-6,
    "Mbyte/s": 1e-3,
    "Gbyte/s": 1.0,
    "Tbyte/s": 1e3,
}
HZ_TO_GHZ = {"hz": 1e-9, "Khz": 1e-6, "Mhz": 1e-3, "Ghz": 1.0, "Hz": 1e-9, "KHz": 1e-6, "MHz": 1e-3, "GHz": 1.0}
SCALED = {"dram__bytes.sum.per_second": RATE_TO_GB_S, "gpc__cycles_elapsed.max.per_second": HZ_TO_GHZ}
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


@dataclass
class KernelRow:
    """Every launch of one kernel name: its durations (us) and, per metric, its values (the median is shown)."""

    name: str
    durations_us: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def median(self, metric: str) -> float | None:
        values = self.metrics.get(metric)
        return statistics.median(values) if values else None


def _number(text: str) -> float | None:
    """ncu writes thousands with commas ("1,234.5") and n/a for a metric a launch lacks."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_raw_csv(path: Path) -> list[KernelRow]:
    """The launches of `path` (ncu --csv --page raw) merged by kernel name, in order of first launch."""
    lines = [line for line in path.read_text().splitlines() if line.startswith('"')]  # ncu prefixes notes with ==
    rows = list(csv.reader(lines))
    if len(rows) < 2:
        raise SystemExit(f"{path}: expected ncu's raw CSV (a header row, a units row, one row a launch), found "
                         f"{len(rows)} CSV rows")  # fmt: skip
    header, units = rows[0], rows[1]
    for column in (NAME, DURATION):
        if column not in header:
            raise SystemExit(f"{path}: expected a {column!r} column (ncu --csv --page raw with the SpeedOfLight "
                             f"section), found {len(header)} columns without it")  # fmt: skip
    name_at, duration_at = header.index(NAME), header.index(DURATION)
    to_us = TO_US.get(units[duration_at])
    if to_us is None:
        raise SystemExit(f"{path}: expected the {DURATION} unit to be one of {sorted(TO_US)}, found "
                         f"{units[duration_at]!r}")  # fmt: skip
    wanted = {i: h for i, h in enumerate(header) if h in COLUMNS.values() or STALL.match(h)}
    kernels: dict[str, KernelRow] = {}
    for row in rows[2:]:
        duration = _number(row[duration_at])
        if duration is None:
            continue
        kernel = kernels.setdefault(row[name_at], KernelRow(row[name_at]))
        kernel.durations_us.append(duration * to_us)
        for i, metric in wanted.items():
            value = _number(row[i]) if i < len(row) else None
            if value is not None and metric in SCALED:
                factor = SCALED[metric].get(units[i])
                value = None if factor is None else value * factor  # an unknown unit: left out, not misread
            if value is not None:
                kernel.metrics.setdefault(metric, []).append(value)
    return list(kernels.values())


def top_stalls(kernel: KernelRow, count: int) -> str:
    """The `count` stall reasons with the most cycles a issued instruction, e.g. 'long_scoreboard 4.1'."""
    stalls = []
    for metric in kernel.metrics:
        match = STALL.match(metric)
        if match and match.group(1) != "selected":  # 'selected' is the issuing warp itself, not a wait
            stalls.append((kernel.median(metric) or 0.0, match.group(1)))
    stalls.sort(reverse=True)
    return ", ".join(f"{reason} {cycles:.1f}" for cycles, reason in stalls[:count] if cycles > 0)


def summary_table(kernels: list[KernelRow], top: int, stalls: int) -> str:
    total = sum(sum(k.durations_us) for k in kernels)
    ranked = sorted(kernels, key=lambda k: -sum(k.durations_us))[:top]
    head = ["kernel", "launches", "median us", "share %", *COLUMNS, "top stalls (cycles / issue)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in ranked:
        cells = [k.name[:48], str(len(k.durations_us)), f"{statistics.median(k.durations_us):.2f}",
                 f"{100 * sum(k.durations_us) / total:.1f}" if total else "-"]  # fmt: skip
        for metric in COLUMNS.values():
            value = k.median(metric)
            cells.append("-" if value is None else f"{value:.3g}")
        cells.append(top_stalls(k, stalls) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{sum(len(k.durations_us) for k in kernels)} launches, {total:.1f} us of kernel time alone "
                 "(each kernel timed by itself: no overlap, no launch gaps)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path, help="ncu --import <rep>.ncu-rep --csv --page raw > this file")
    p.add_argument("--top", type=int, default=12, help="kernel names to list, most time first")
    p.add_argument("--stalls", type=int, default=3, help="stall reasons a kernel")
    a = p.parse_args(argv)
    if not a.csv.is_file():
        raise SystemExit(f"{a.csv}: no such file (expected ncu's raw CSV)")
    print(summary_table(read_raw_csv(a.csv), a.top, a.stalls))


if __name__ == "__main__":
    main(sys.argv[1:])
