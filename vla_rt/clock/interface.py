"""The interface every clock implements: time, sleeps, conditions and threads in the clock's own time.

Every thread of the runtime and every device (real or simulated) asks a `Clock` for the time, sleeps on it, waits on
its conditions and is started through it, never `time` directly. With `MonotonicClock` that is ordinary wall-clock
threading; with `SimClock` the same code runs in simulated time, one thread at a time, deterministically.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class ClockCondition(Protocol):
    """A condition variable whose deadlines are in the owning clock's time."""

    def notify_all(self) -> None:
        """Wake every waiter so it re-checks its predicate. Call after changing the state the predicate reads."""

    def wait_until(self, predicate: Callable[[], bool], deadline: float | None) -> bool:
        """Block until `predicate()` holds (returns True) or the clock reaches `deadline` (returns its value)."""


@runtime_checkable
class Clock(Protocol):
    """Time source, sleeper and thread starter (seconds, float, never goes backwards)."""

    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...

    def sleep(self, dt: float) -> None: ...

    def condition(self) -> ClockCondition: ...

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread: ...

    def join_thread(self, thread: threading.Thread, timeout_s: float) -> bool: ...
