"""What the runtime writes at its edges (issue 22): event logs bounded in size, results in strict JSON (no bare NaN)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vla_rt.clock import SimClock
from vla_rt.pen_catch.evaluate import summarize
from vla_rt.runtime.events import EventLog, load_events
from vla_rt.strict_json import dumps, to_plain, write_json


def _strict(text: str):
    """json.loads that refuses NaN / Infinity, as jq, browsers and most parsers do."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_event_log_stops_at_its_bound_and_says_so(tmp_path):
    """The bug: a misconfigured run (fps=-30) grew its event log by ~0.4 MB/s without end."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, SimClock(), max_bytes=20_000)
    for i in range(2_000):
        log.emit("camera_error", camera="cam", error="capture time went backwards", i=i)
    log.close()
    size = path.stat().st_size
    assert 19_000 < size <= 20_000
    events = load_events(path)
    assert events[-1]["event"] == "log_truncated" and events[-1]["max_bytes"] == 20_000
    assert log.counts["camera_error"] == 2_000 and log.dropped == 2_000 - (len(events) - 1)
    assert len(log.events()) == len(events)  # the in-memory copy is bounded the same way


def test_event_log_bound_must_leave_room_for_the_truncation_record(tmp_path):
    with pytest.raises(ValueError, match="max_bytes: expected at least 1024"):
        EventLog(None, SimClock(), max_bytes=100)


def test_event_log_lines_are_strict_json(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, SimClock())
    log.emit("inference_done", wall_ms=float("nan"), actions=np.array([1.0, np.inf]), n=np.int64(3))
    log.close()
    record = _strict(path.read_text().strip())
    assert record["wall_ms"] == "nan" and record["actions"] == [1.0, "inf"] and record["n"] == 3


def test_summary_of_trials_without_a_reaction_is_strict_json(tmp_path):
    """The bug: summary.json held a bare NaN (median of no reactions) that strict parsers reject."""
    trials = [{"reaction_ms": None, "success": False, "reason": "no_close"}] * 3
    summary = summarize(trials, "sim")
    assert math.isnan(summary["reaction_ms_median"])  # in memory: a number for the result line
    path = write_json(tmp_path / "summary.json", summary)
    parsed = _strict(path.read_text())
    assert parsed["reaction_ms_median"] is None and parsed["reaction_ms_p90"] is None and parsed["caught"] == 0


def test_to_plain_and_dumps():
    value = {1: np.float32(2.5), "a": (np.array([1, 2]), float("-inf")), "p": __import__("pathlib").Path("/x")}
    assert to_plain(value) == {"1": 2.5, "a": [[1, 2], None], "p": "/x"}
    assert _strict(dumps({"x": float("nan")})) == {"x": None}


def test_write_json_is_bounded_and_atomic(tmp_path):
    path = tmp_path / "trials.json"
    write_json(path, [1, 2, 3])
    with pytest.raises(ValueError, match=r"trials.json: \d+ bytes of JSON, expected at most 100"):
        write_json(path, list(range(1000)), max_bytes=100)
    assert _strict(path.read_text()) == [1, 2, 3]  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trials.json"]  # no temp file left behind
