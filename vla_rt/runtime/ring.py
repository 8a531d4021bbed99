"""Fixed-capacity, timestamped ring buffer: the hand-off between the runtime's threads.

One writer appends items stamped with a non-decreasing time; any number of readers ask for the newest item, the
newest n, the item in force at a time t, or wait for something newer. The lock is held only for a few list
operations (never during a wait or a payload computation), so readers cannot stall the writer. When full, the
oldest item is overwritten and counted in `dropped`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from vla_rt.clock import Clock, MonotonicClock

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stamped(Generic[T]):
    """One ring entry: `seq` counts writes from 0 (gaps in what a reader saw = items it skipped)."""

    seq: int
    t: float
    value: T


class RingClosed(RuntimeError):
    """Written after `close()`."""


class TimestampedRing(Generic[T]):
    """Ring of `Stamped` items; timestamps must be non-decreasing (a later write never claims an earlier time)."""

    def __init__(self, capacity: int, clock: Clock | None = None, name: str = "ring") -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1, got {capacity}")
        self.name = name
        self._capacity = capacity
        self._slots: list[Stamped[T] | None] = [None] * capacity
        self._written = 0  # seq of the next write
        self._dropped = 0
        self._closed = False
        self._lock = threading.Lock()
        self._clock = clock if clock is not None else MonotonicClock()
        self._newer = self._clock.condition()

    # --- writer ------------------------------------------------------------------------------------------------
    def write(self, t: float, value: T) -> Stamped[T]:
        """Append `value` stamped `t`; overwrite the oldest item when full. Raises ValueError if `t` goes back or is
        not finite (a NaN compares false both ways: it would pass the order check, then defeat every staleness test
        and lookup by time that follows)."""
        if not math.isfinite(t):
            raise ValueError(f"{self.name}: timestamp {t!r} is not a finite clock time")
        with self._lock:
            if self._closed:
                raise RingClosed(f"{self.name}: write after close")
            if self._written:
                last = self._slots[(self._written - 1) % self._capacity]
                if t < last.t:
                    raise ValueError(f"{self.name}: timestamp {t!r} is older than the newest item's {last.t!r}")
            item = Stamped(self._written, float(t), value)
            if self._written >= self._capacity:
                self._dropped += 1
            self._slots[self._written % self._capacity] = item
            self._written += 1
        self._newer.notify_all()  # outside our lock: a waiter's predicate takes it
        return item

    def close(self) -> None:
        """Refuse further writes and wake every waiter (shutdown)."""
        with self._lock:
            self._closed = True
        self._newer.notify_all()

    # --- readers -----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def written(self) -> int:
        """Items ever written (= seq of the next write)."""
        return self._written

    @property
    def dropped(self) -> int:
        """Items overwritten because the ring was full."""
        return self._dropped

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return min(self._written, self._capacity)

    @overload
    def latest(self) -> Stamped[T] | None: ...

    @overload
    def latest(self, n: int) -> list[Stamped[T]]: ...

    def latest(self, n: int | None = None) -> Stamped[T] | None | list[Stamped[T]]:
        """Newest item (None if empty); with `n`, up to n newest items, oldest first. O(1) / O(n)."""
        with self._lock:
            if n is None:
                return self._slots[(self._written - 1) % self._capacity] if self._written else None
            first = max(self._written - min(n, self._capacity), 0)
            return [self._slots[s % self._capacity] for s in range(first, self._written)]

    def get(self, seq: int) -> Stamped[T] | None:
        """Item number `seq` if it is still held."""
        with self._lock:
            if self._written - min(self._written, self._capacity) <= seq < self._written:
                return self._slots[seq % self._capacity]
            return None

    def at(self, t: float) -> Stamped[T] | None:
        """Item in force at time `t`: the newest with timestamp <= t (its interval [t_i, t_i+1) covers t).

        None when `t` is before the oldest held item. O(log capacity) bisection over the held sequence numbers.
        """
        with self._lock:
            lo = self._written - min(self._written, self._capacity)
            hi = self._written
            if hi == lo or self._slots[lo % self._capacity].t > t:
                return None
            while hi - lo > 1:  # invariant: slot lo has t_lo <= t; every slot >= hi has time > t
                mid = (lo + hi) // 2
                if self._slots[mid % self._capacity].t <= t:
                    lo = mid
                else:
                    hi = mid
            return self._slots[lo % self._capacity]

    def wait_newer(self, seq: int, timeout_s: float | None) -> Stamped[T] | None:
        """Newest item if its seq > `seq`, waiting up to `timeout_s` clock seconds; None on timeout or close."""
        deadline = None if timeout_s is None else self._clock.now() + timeout_s
        self._newer.wait_until(lambda: self._written - 1 > seq or self._closed, deadline)
        item = self.latest()
        return item if item is not None and item.seq > seq else None
