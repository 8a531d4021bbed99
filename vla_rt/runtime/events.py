"""Event log: every runtime event as one JSON object per line, stamped with the runtime clock.

Lines look like `{"t": 1.0333, "event": "frame_captured", "thread": "camera", "seq": 31, ...}`; `t` is the clock
of the run (simulated seconds under a SimClock, `time.monotonic()` otherwise). Non-finite floats are written as the
strings "nan"/"inf"/"-inf" so the file stays strict JSON. Writes take a short lock and go to a buffered file, so a
real-time thread pays a dict-to-string conversion, not a disk flush. The in-memory copy holds those strings, not
dicts: strings are invisible to Python's cyclic garbage collector, so a long run does not make its pauses longer.
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

    def __init__(self, path: str | Path | None, clock: Clock, keep_in_memory: bool = True) -> None:
        self.path = Path(path) if path is not None else None
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
            if self._memory is not None:
                self._memory.append(line)
            if self._file is not None:
                self._file.write(line + "\n")
        return record

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
