"""Kinematics of the lower gripper's jaws: a rate-limited position servo.

The jaw position p (0 open .. 1 closed) moves toward the commanded target at a constant speed, a full stroke taking
`closing_time_s` (~60 ms, the paper's gripper). Each command starts a new piecewise-linear segment, stored as a knot,
so the position at any past or present time is exact (the pen physics and the renderer query past times).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from vla_rt.clock import Clock, MonotonicClock


@dataclass(frozen=True, slots=True)
class JawKnot:
    t: float
    position: float
    target: float


class JawDynamics:
    """Position servo with a speed limit; thread-safe (one commander, many readers)."""

    def __init__(
        self,
        closing_time_s: float = 0.060,
        initial_position: float = 0.0,
        clock: Clock | None = None,
        t0: float | None = None,
    ) -> None:
        if closing_time_s <= 0:
            raise ValueError("closing_time_s must be > 0")
        self.closing_time_s = closing_time_s
        self._speed = 1.0 / closing_time_s  # full strokes per second
        self._clock = clock if clock is not None else MonotonicClock()
        start = self._clock.now() if t0 is None else t0
        self._knots = [JawKnot(start, initial_position, initial_position)]
        self._times = [start]
        self._lock = threading.Lock()

    def command(self, target: float, t: float | None = None) -> JawKnot:
        """Set a new target at time `t` (clock now if None; stamped under the lock so readers see a consistent past)."""
        target = min(max(float(target), 0.0), 1.0)
        with self._lock:
            when = self._clock.now() if t is None else t
            if when < self._times[-1]:
                raise ValueError(f"jaw command at t={when} is older than the last one at t={self._times[-1]}")
            knot = JawKnot(when, self._position_locked(when), target)
            self._knots.append(knot)
            self._times.append(when)
            return knot

    def _segment(self, t: float) -> JawKnot:
        i = bisect.bisect_right(self._times, t) - 1
        return self._knots[max(i, 0)]

    def _position_locked(self, t: float) -> float:
        knot = self._segment(t)
        travel = self._speed * max(t - knot.t, 0.0)
        if knot.target >= knot.position:
            return min(knot.position + travel, knot.target)
        return max(knot.position - travel, knot.target)

    def position_at(self, t: float) -> float:
        with self._lock:
            return self._position_locked(t)

    def target_at(self, t: float) -> float:
        with self._lock:
            return self._segment(t).target

    def settle_time(self, t: float) -> float:
        """When the motion in progress at `t` reaches its target, if no new command comes."""
        with self._lock:
            knot = self._segment(t)
            return knot.t + abs(knot.target - knot.position) / self._speed

    def knots(self) -> list[JawKnot]:
        with self._lock:
            return list(self._knots)
