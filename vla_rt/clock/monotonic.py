"""`MonotonicClock`: the wall-clock `Clock` of real runs (time.monotonic, real sleeps, real threads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vla_rt.clock.interface import ClockCondition


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
