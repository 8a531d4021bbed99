"""Real-time runtime: clocks, timestamped rings, the camera / inference / output threads and `Runtime`.

Names load lazily so `vla_rt.robot` modules can import `vla_rt.runtime.clock` without pulling in the threads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Clock": "clock",
    "MonotonicClock": "clock",
    "SimClock": "sim_clock",
    "SimThreadError": "sim_clock",
    "TimestampedRing": "ring",
    "Stamped": "ring",
    "EventLog": "events",
    "load_events": "events",
    "ActionChunk": "actions",
    "Runtime": "runtime",
    "RuntimeConfig": "runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"vla_rt.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'vla_rt.runtime' has no attribute {name!r}")
