"""`tools/host_warmth_probe.py` (issue 26's lone-robot host time): every mode is timed, the host work is the server's
own (decode, profile parse, `Pi0Policy.prepare`), and bad arguments are usage errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "host_warmth_probe.py"


@pytest.fixture(scope="module")
def probe():
    return load_tool("host_warmth_probe")


def test_every_mode_times_the_work_it_is_given(probe) -> None:
    calls = []

    def work() -> float:
        calls.append(1)
        return float(len(calls))

    rows = probe.measure(work, iters=3, period_ms=1.0, spin_ms=0.5, leads=[0.5, 2])
    assert list(rows) == ["back-to-back", "idle", "spin", "dry-0.5", "dry-2"]
    warm_up = 10
    assert len(calls) == warm_up + 3 * 3 + 2 * 2 * 3  # the dry-run modes call the work twice a measured call
    assert all(median <= p90 for median, p90 in rows.values())


def test_host_work_runs_the_servers_first_steps(probe) -> None:
    ms = probe.host_work()()
    assert math.isfinite(ms) and ms > 0  # a duration, never judged here (speed lives in the probe's table)


def test_bad_arguments_are_usage_errors() -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--iters", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--iters >= 1" in proc.stderr
