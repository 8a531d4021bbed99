"""Simulated time as a discrete-event scheduler over real threads.

Threads started with `SimClock.start_thread` are *participants*. Exactly one participant runs at a time: it holds the
baton until it sleeps (`sleep_until`) or waits on a `SimCondition`, then hands the baton back to the *driver*, the
non-participant thread that called `advance`/`run_until`/`sleep_until`. The driver wakes the participant with the
earliest (wake time, scheduling order), sets the clock to that wake time and waits for it to park again. Time never
moves while a participant runs, so a run is a pure function of the participants' code and inputs: same inputs, same
event sequence, however loaded the machine is. Real blocking I/O inside a participant (a serial round trip to a
simulated device) takes real time but no simulated time.

Rules for code run under a SimClock: participants block only through the clock (sleep, its conditions, joins of
other participants are not allowed); non-participant helper threads (a simulated device reading a pty) may read
`now()` and notify conditions but must not sleep on the clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass


class SimThreadError(RuntimeError):
    """A participant thread raised; re-raised in the driver so a bug cannot pass silently."""


@dataclass(eq=False)
class _Participant:
    name: str
    token: int = 0  # bumped on every (re)schedule, so older heap entries are ignored
    done: bool = False
    error: BaseException | None = None


class SimClock:
    """Deterministic simulated clock; see the module docstring for the execution model."""

    def __init__(self, start: float = 0.0, spin_limit: int = 1_000_000) -> None:
        self._now = float(start)
        self._spin_limit = spin_limit  # events at one instant before we call it a busy loop
        self._lock = threading.Lock()
        self._handoff = threading.Condition(self._lock)
        self._driver_lock = threading.Lock()
        self._heap: list[tuple[float, int, int, _Participant]] = []
        self._order = itertools.count()
        self._running: _Participant | None = None
        self._by_thread: dict[int, _Participant] = {}
        self._by_handle: dict[threading.Thread, _Participant] = {}

    # --- time ------------------------------------------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def sleep(self, dt: float) -> None:
        self.sleep_until(self._now + dt)

    def sleep_until(self, t: float) -> None:
        """Participant: park until `t`. Any other thread: drive the simulation up to `t`."""
        me = self._current()
        if me is None:
            self._drive(until=t)
        else:
            self._park(me, max(t, self._now))

    def advance(self, dt: float) -> None:
        """Run every event due in the next `dt` simulated seconds (driver only)."""
        self.run_until(self._now + dt)

    def run_until(self, t: float) -> None:
        if self._current() is not None:
            raise RuntimeError("a SimClock participant cannot drive the clock; call sleep_until instead")
        self._drive(until=t)

    # --- threads -----------------------------------------------------------------------------------------------
    def condition(self) -> SimCondition:
        return SimCondition(self)

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start `target` as a participant; it first runs when the driver reaches the current time."""
        me = _Participant(name)

        def main() -> None:
            with self._lock:
                self._by_thread[threading.get_ident()] = me
                while self._running is not me:
                    self._handoff.wait()
            try:
                target()
            except BaseException as err:  # noqa: BLE001 - handed to the driver, never swallowed
                me.error = err
            finally:
                with self._lock:
                    me.done = True
                    self._running = None
                    self._handoff.notify_all()

        thread = threading.Thread(target=main, name=name, daemon=True)
        with self._lock:
            self._by_handle[thread] = me
            self._schedule(me, self._now)
        thread.start()
        return thread

    def join_thread(self, thread: threading.Thread, timeout_s: float) -> bool:
        """Drive until the participant `thread` returns, for at most `timeout_s` simulated seconds."""
        me = self._by_handle.get(thread)
        if me is None:
            thread.join(timeout_s)
            return not thread.is_alive()
        if self._current() is not None:
            raise RuntimeError("a SimClock participant cannot join another participant")
        self._drive(until=self._now + timeout_s, stop=lambda: me.done)
        if me.done:
            thread.join(5.0)  # it only has to return from its wrapper now
        return me.done

    # --- scheduler internals -------------------------------------------------------------------------------------
    def _current(self) -> _Participant | None:
        return self._by_thread.get(threading.get_ident())

    def _schedule(self, who: _Participant, wake: float) -> None:
        """Caller holds `_lock`."""
        who.token += 1
        heapq.heappush(self._heap, (wake, next(self._order), who.token, who))

    def _park(self, me: _Participant, wake: float | None, waiters: list[_Participant] | None = None) -> None:
        """Give the baton back; return when the driver hands it to `me` again (woken or notified)."""
        with self._lock:
            if self._running is not me:
                raise RuntimeError(f"SimClock participant {me.name!r} is running without the baton")
            if waiters is not None:
                waiters.append(me)
            if wake is not None:
                self._schedule(me, wake)
            else:
                me.token += 1  # forget any earlier wake-up: only a notify wakes it now
            self._running = None
            self._handoff.notify_all()
            while self._running is not me:
                self._handoff.wait()

    def _pop_due(self, until: float) -> _Participant | None:
        """Caller holds `_lock`. Next live participant with wake <= until; sets the clock to its wake time."""
        while self._heap:
            wake, _, token, who = self._heap[0]
            if who.done or token != who.token:
                heapq.heappop(self._heap)
                continue
            if wake > until:
                return None
            heapq.heappop(self._heap)
            self._now = max(self._now, wake)
            return who
        return None

    def _drive(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        with self._driver_lock:
            spins = 0
            while True:
                # Predicates are evaluated with no participant running, outside our lock (they may take others).
                if stop is not None and stop():
                    return
                with self._lock:
                    before = self._now
                    who = self._pop_due(until)
                    if who is None:
                        if math.isfinite(until):
                            self._now = max(self._now, until)
                        return
                    spins = spins + 1 if self._now == before else 0
                    if spins > self._spin_limit:
                        raise RuntimeError(f"SimClock: participants keep waking at t={self._now} without progress")
                    self._running = who
                    self._handoff.notify_all()
                    try:
                        while self._running is not None:
                            self._handoff.wait()
                    except BaseException:  # Ctrl-C in the driver: the participant still runs its slice; let it
                        while self._running is not None:  # reach its next sleep or wait before anything (stop())
                            self._handoff.wait()  # drives the clock again, or two participants would run at once
                        raise
                if who.error is not None:
                    err, who.error = who.error, None
                    raise SimThreadError(f"SimClock participant {who.name!r} raised {err!r}") from err


class SimCondition:
    """Condition variable in simulated time (see `ClockCondition`)."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self._waiters: list[_Participant] = []

    def notify_all(self) -> None:
        clock = self._clock
        with clock._lock:
            for who in self._waiters:
                if not who.done:
                    clock._schedule(who, clock._now)
            self._waiters.clear()

    def wait_until(self, predicate: Callable[[], bool], deadline: float | None) -> bool:
        clock = self._clock
        me = clock._current()
        if me is None:
            clock._drive(until=math.inf if deadline is None else deadline, stop=predicate)
            return predicate()
        while True:
            if predicate():
                return True
            if deadline is not None and clock._now >= deadline:
                return False
            clock._park(me, deadline, waiters=self._waiters)
            with clock._lock:
                if me in self._waiters:
                    self._waiters.remove(me)
