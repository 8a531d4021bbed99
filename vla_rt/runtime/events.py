"""Event log: every runtime event as one JSON object per line, stamped with the runtime clock.

Lines look like `{"t": 1.0333, "event": "frame_captured", "thread": "camera", "seq": 31, ...}`; `t` is the clock
of the run (simulated seconds under a SimClock, `time.monotonic()` otherwise). Non-finite floats are written as the
strings "nan"/"inf"/"-inf" so the file stays strict JSON. Writes take a short lock and go to a buffered file, so a
real-time thread pays a dict-to-string conversion, not a disk flush. The in-memory copy holds those strings, not
dicts: strings are invisible to Python's cyclic garbage collector, so a long run does not make its pauses longer.

The log is bounded (`max_bytes`, file and memory alike): a run that logs without end (a device spinning on an
error, a misconfigured rate) must not fill the disk. Past the bound one `log_truncated` record says so, later events
are only counted (`counts` stays complete, and `dropped` says how many lines were not written).
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from vla_rt.clock import Clock

MAX_LOG_BYTES = 256 * 2**20  # a simulated pen-catch trial logs ~0.5 MB; an hour on the rig at 200 Hz ~150 MB
_TRUNCATION_RESERVE = 512  # bytes kept free for the one log_truncated record


def _plain(value: Any) -> Any:
    """JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to strings."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class EventLog:
    """Thread-safe JSON-lines event writer (optionally also kept in memory for tests and live counters)."""

    def __init__(
        self, path: str | Path | None, clock: Clock, keep_in_memory: bool = True, max_bytes: int = MAX_LOG_BYTES
    ) -> None:
        if max_bytes < 1024:
            raise ValueError(f"max_bytes: expected at least 1024 (room for the truncation record), found {max_bytes}")
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.bytes = 0  # written (and kept in memory) so far
        self.dropped = 0  # lines past max_bytes, counted but not written
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        self._memory: list[str] | None = [] if keep_in_memory else None
        self.counts: Counter[str] = Counter()

    def emit(self, event: str, t: float | None = None, **fields: Any) -> dict[str, Any]:
        """Record `event` at clock time `t` (now if None) with `fields`; returns the stored record."""
        record = {"t": self._clock.now() if t is None else float(t), "event": event}
        record["thread"] = threading.current_thread().name
        record.update(_plain(fields))
        line = json.dumps(record, allow_nan=False)
        with self._lock:
            self.counts[event] += 1
            if self.dropped or self.bytes + len(line) + 1 > self.max_bytes - _TRUNCATION_RESERVE:
                if not self.dropped:
                    note = {"t": record["t"], "event": "log_truncated", "thread": record["thread"]}
                    self._append(json.dumps(note | {"max_bytes": self.max_bytes, "first_dropped": event}))
                self.dropped += 1
                return record
            self._append(line)
        return record

    def _append(self, line: str) -> None:
        self.bytes += len(line) + 1
        if self._memory is not None:
            self._memory.append(line)
        if self._file is not None:
            self._file.write(line + "\n")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """In-memory records (all, or those named `name`)."""
        with self._lock:
            lines = list(self._memory or [])
        records = [json.loads(line) for line in lines]
        return records if name is None else [r for r in records if r["event"] == name]

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read an event log written by `EventLog` (list of dicts, file order)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select(events: Iterable[dict[str, Any]], name: str, **match: Any) -> list[dict[str, Any]]:
    """Events named `name` whose fields equal every `match` item."""
    return [e for e in events if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Count of each event name (a first look at a run)."""
    return dict(Counter(e["event"] for e in events))
