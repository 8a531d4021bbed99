"""Injectable clocks: the runtime never calls `time` directly.

Every thread of the runtime and every simulated device asks a `Clock` for the time, sleeps on it, waits on its
conditions and is started through it. With `MonotonicClock` that is ordinary wall-clock threading; with
`vla_rt.runtime.sim_clock.SimClock` the same code runs in simulated time, one thread at a time, deterministically.
"""

from __future__ import annotations

import threading
import time
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


class _ThreadCondition:
    """`threading.Condition` with absolute monotonic deadlines."""

    def __init__(self) -> None:
        self._cond = threading.Condition()

    def notify_all(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], deadline: float | None) -> bool:
        with self._cond:
            while not predicate():
                if deadline is None:
                    self._cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return predicate()
                self._cond.wait(remaining)
            return True


class MonotonicClock:
    """Wall-clock time from `time.monotonic()` (immune to NTP steps), real sleeps and real threads."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        # time.sleep may return early on some platforms; loop until the deadline really passed.
        while (remaining := t - time.monotonic()) > 0:
            time.sleep(remaining)

    def sleep(self, dt: float) -> None:
        self.sleep_until(time.monotonic() + dt)

    def condition(self) -> ClockCondition:
        return _ThreadCondition()

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def join_thread(self, thread: threading.Thread, timeout_s: float) -> bool:
        thread.join(timeout_s)
        return not thread.is_alive()
