"""`tools/ncu_summary.py` reads Nsight Compute's raw CSV (`ncu --import <rep> --csv --page raw`): a header of metric
names, a row of units, one row a launch, values with thousands commas, n/a where a launch lacks a metric, and ncu's
own `==PROF==` lines mixed in. The file here is written in that format; the GPU run is `bash tools/device_session.sh
ncu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from ncu_summary import main, read_raw_csv, summary_table, top_stalls  # noqa: E402

HEADER = ["ID", "Kernel Name", "Grid Size", "gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "lts__t_sector_hit_rate.pct", "launch__registers_per_thread",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"]  # fmt: skip
UNITS = ["", "", "", "nsecond", "%", "%", "register/thread", "ratio", "ratio", "ratio"]


def _write(path: Path, rows: list[list[str]], header: list[str] = HEADER, units: list[str] = UNITS) -> Path:
    def line(cells: list[str]) -> str:
        return ",".join(f'"{c}"' for c in cells)

    text = ["==PROF== Connected to process 123", line(header), line(units), *map(line, rows), "==PROF== Disconnected"]
    path.write_text("\n".join(text) + "\n")
    return path


def test_launches_merge_by_name_in_microseconds(tmp_path) -> None:
    csv_path = _write(tmp_path / "raw.csv", [
        ["0", "attention_kernel", "(16, 1, 1)", "23,880", "41.5", "88.0", "168", "6.5", "1.0", "1.0"],
        ["1", "gemm_kernel", "(128, 1, 1)", "12,000", "70.0", "60.0", "232", "2.0", "3.0", "1.0"],
        ["2", "attention_kernel", "(16, 1, 1)", "24,120", "42.5", "n/a", "168", "7.5", "1.0", "1.0"],
    ])  # fmt: skip
    kernels = {k.name: k for k in read_raw_csv(csv_path)}
    attention = kernels["attention_kernel"]
    assert attention.durations_us == pytest.approx([23.88, 24.12])
    assert attention.median("sm__throughput.avg.pct_of_peak_sustained_elapsed") == pytest.approx(42.0)
    assert attention.median("lts__t_sector_hit_rate.pct") == pytest.approx(88.0)  # the n/a launch left out
    # the issuing warp ('selected') is not a wait; the most cycles first
    assert top_stalls(attention, 2) == "long_scoreboard 7.0, barrier 1.0"
    assert top_stalls(kernels["gemm_kernel"], 1) == "barrier 3.0"
    table = summary_table(list(kernels.values()), top=5, stalls=2)
    first, second = (line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| kernel |"))
    assert first.startswith("| attention_kernel | 2 | 24.00 | 80.0 |")  # 48 of 60 us: sorted by time
    assert second.startswith("| gemm_kernel | 1 | 12.00 | 20.0 |")
    assert "3 launches, 60.0 us of kernel time alone" in table


def test_rates_come_in_the_columns_unit_whatever_unit_ncu_chose(tmp_path) -> None:
    """ncu writes dram__bytes.sum.per_second as Gbyte/s or Tbyte/s by magnitude (a real H200 file had both), and the
    clock in Ghz: the table shows GB/s and GHz, and an unknown unit is left out rather than misread."""
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes.sum.per_second",
              "gpc__cycles_elapsed.max.per_second"]  # fmt: skip
    rows = [["0", "a", "1", "667", "1.45"], ["1", "b", "1", "0.229", "1.3"]]
    kernels = {
        k.name: k for k in read_raw_csv(_write(tmp_path / "tb.csv", rows[1:], header, ["", "", "us", "Tbyte/s", "Ghz"]))
    }
    assert kernels["b"].median("dram__bytes.sum.per_second") == pytest.approx(229.0)
    kernels = {
        k.name: k for k in read_raw_csv(_write(tmp_path / "gb.csv", rows[:1], header, ["", "", "us", "Gbyte/s", "Ghz"]))
    }
    assert kernels["a"].median("dram__bytes.sum.per_second") == pytest.approx(667.0)
    assert kernels["a"].median("gpc__cycles_elapsed.max.per_second") == pytest.approx(1.45)
    assert kernels["a"].durations_us == pytest.approx([1.0])  # "us", as ncu 2026 writes it
    kernels = {
        k.name: k
        for k in read_raw_csv(_write(tmp_path / "odd.csv", rows[:1], header, ["", "", "us", "furlong/s", "Ghz"]))
    }
    assert kernels["a"].median("dram__bytes.sum.per_second") is None


def test_a_file_that_is_not_ncus_raw_csv_says_what_it_lacks(tmp_path) -> None:
    with pytest.raises(SystemExit, match="expected a 'gpu__time_duration.sum' column"):
        read_raw_csv(_write(tmp_path / "details.csv", [["0", "k", "(1, 1, 1)"]], HEADER[:3], UNITS[:3]))
    with pytest.raises(SystemExit, match="expected the gpu__time_duration.sum unit to be one of"):
        read_raw_csv(_write(tmp_path / "cycles.csv", [["0", "k", "(1,1,1)", "5", "1", "1", "1", "1", "1", "1"]],
                            units=["", "", "", "cycle", *UNITS[4:]]))  # fmt: skip
    (tmp_path / "empty.csv").write_text("==PROF== no kernels were profiled\n")
    with pytest.raises(SystemExit, match="found 0 CSV rows"):
        read_raw_csv(tmp_path / "empty.csv")
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "missing.csv")])
