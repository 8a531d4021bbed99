"""Falling-pen physics and the catch judge (the paper's §7 experiment, in simulation).

Coordinates: z up (m), z = 0 on the centre line of the lower gripper's jaw pads, x across the jaws. The pen (a
vertical rod) hangs from the upper gripper with its tip `drop_height_m` above z = 0 and is released at a jittered
time; it then falls under gravity, integrated in steps of `physics_dt_s` with the exact constant-acceleration update.
Each step checks the two interactions with the jaws, whose position comes from a `JawSource` (the SimGripper's
servo model or a bare `JawDynamics`):

* the tip reaches the top of the jaw pads while the gap is narrower than the pen -> the pen lands on the jaws
  ("too_early": they closed before it arrived). A wider gap lets it through wherever it is across the jaws: the
  fingers' chamfered tops steer it in, so the lateral position only changes what the camera sees;
* the jaws finish closing (position crosses `closed_threshold`): the pen is caught iff it spans the whole pad height
  at that moment, else the jaws closed "too_early" (tip not through yet) or "too_late" (pen already gone).

With the defaults the catch window (jaws finished closing) is 251..296 ms after release, the tip reaches the jaws
after 247 ms, and the expert who commands "close" 200 ms after release finishes closing at 260 ms.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class JawSource(Protocol):
    def position_at(self, t: float) -> float:
        """Jaw position (0 open .. 1 closed) at clock time t (past or present)."""


@dataclass
class PenDropConfig:
    drop_height_m: float = 0.30  # pen tip above the jaw centre line at release
    pen_length_m: float = 0.14
    pen_diameter_m: float = 0.010
    jaw_pad_height_m: float = 0.020  # pads span z in [-h/2, +h/2]
    jaw_open_gap_m: float = 0.050
    gravity_m_s2: float = 9.81
    release_delay_s: float = 0.30  # nominal release time after the episode starts
    release_jitter_s: float = 0.05  # release uniformly within +-jitter of the nominal time
    lateral_range_m: float = 0.010  # pen x uniformly within +-range
    physics_dt_s: float = 0.0005
    closed_threshold: float = 0.95  # jaw position at which the jaws count as "finished closing"


@dataclass(frozen=True, slots=True)
class PenState:
    t: float
    tip_z: float  # m, lower end of the pen
    velocity: float  # m/s, negative = falling
    x: float  # m, lateral position of the pen axis
    phase: str  # "held" | "falling" | "caught" | "landed_on_jaws"


@dataclass(frozen=True, slots=True)
class CatchResult:
    success: bool
    reason: str  # "caught" | "too_early" | "too_late" | "no_close"
    t_closed: float | None  # clock time the jaws finished closing (None if they never did)
    t_release: float
    window: tuple[float, float]  # closing-finished times that catch an undisturbed fall


class PenDropSim:
    """One pen drop per episode; thread-safe; advances lazily to the latest time anyone asks about."""

    def __init__(self, jaws: JawSource, config: PenDropConfig | None = None, seed: int | None = None) -> None:
        self.config = config or PenDropConfig()
        self.jaws = jaws
        self._rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self.reset(0.0)

    # --- episodes ------------------------------------------------------------------------------------------------
    def reset(self, t_start: float, t_release: float | None = None, x: float | None = None) -> None:
        """New episode at `t_start`: release time and lateral position drawn from the seeded RNG unless given."""
        c = self.config
        jitter = self._rng.uniform(-c.release_jitter_s, c.release_jitter_s)
        lateral = self._rng.uniform(-c.lateral_range_m, c.lateral_range_m)
        with self._lock:
            self.t_release = t_start + c.release_delay_s + jitter if t_release is None else t_release
            self.x = lateral if x is None else x
            self._history = [PenState(t_start, c.drop_height_m, 0.0, self.x, "held")]
            self._times = [t_start]
            self._jaw_prev = self.jaws.position_at(t_start)
            self.t_closed: float | None = None
            self.reason: str | None = None

    def window(self) -> tuple[float, float]:
        """Closing-finished times that catch an undisturbed fall: pen tip below the pads .. pen top above them."""
        c = self.config
        enter = math.sqrt(2 * (c.drop_height_m + c.jaw_pad_height_m / 2) / c.gravity_m_s2)
        leave = math.sqrt(2 * (c.drop_height_m + c.pen_length_m - c.jaw_pad_height_m / 2) / c.gravity_m_s2)
        return self.t_release + enter, self.t_release + leave

    def result(self, t: float) -> CatchResult:
        """The judge's verdict once the episode is simulated up to `t`."""
        self.advance_to(t)
        with self._lock:
            reason = self.reason
            if reason is None:
                pen_gone = self._history[-1].tip_z + self.config.pen_length_m < -self.config.jaw_pad_height_m / 2
                reason = "no_close" if pen_gone or t >= self.window()[1] else "pending"
            return CatchResult(reason == "caught", reason, self.t_closed, self.t_release, self.window())

    # --- state --------------------------------------------------------------------------------------------------------
    def state_at(self, t: float) -> PenState:
        """Pen state at any time up to the present (exact: propagated from the last integration step)."""
        self.advance_to(t)
        with self._lock:
            i = max(bisect.bisect_right(self._times, t) - 1, 0)
            s = self._history[i]
        if s.phase != "falling" or t <= s.t:
            return s
        dt = t - s.t
        g = self.config.gravity_m_s2
        return PenState(t, s.tip_z + s.velocity * dt - 0.5 * g * dt * dt, s.velocity - g * dt, s.x, s.phase)

    def advance_to(self, t: float) -> None:
        with self._lock:
            while self._times[-1] < t:
                last = self._times[-1]
                step_end = min(t, last + self.config.physics_dt_s)
                if last < self.t_release <= step_end:
                    step_end = self.t_release  # start falling exactly at the release
                self._step(step_end)

    # --- integration -------------------------------------------------------------------------------------------------
    def _step(self, t1: float) -> None:
        c = self.config
        s = self._history[-1]
        dt = t1 - s.t
        jaw1 = self.jaws.position_at(t1)
        jaw0, self._jaw_prev = self._jaw_prev, jaw1
        t_close = None
        if self.t_closed is None and jaw0 < c.closed_threshold <= jaw1:
            # Linear between the two samples (exact: the servo moves at constant speed).
            t_close = s.t + dt * (c.closed_threshold - jaw0) / (jaw1 - jaw0)
        if s.phase == "held":
            phase = "falling" if t1 >= self.t_release else "held"
            new = PenState(t1, s.tip_z, 0.0, s.x, phase)
        elif s.phase == "falling":
            new = self._fall(s, t1)
            pad_top = c.jaw_pad_height_m / 2
            if s.tip_z > pad_top >= new.tip_z:
                t_hit = s.t + self._time_to_reach(s, pad_top)
                if t_close is None or t_hit < t_close:
                    gap = c.jaw_open_gap_m * (1 - self.jaws.position_at(t_hit))
                    if gap < c.pen_diameter_m:
                        self._append(PenState(t_hit, pad_top, 0.0, s.x, "landed_on_jaws"))
                        self.reason = self.reason or "too_early"
                        self._finish_close(t_close)
                        self._append(PenState(t1, pad_top, 0.0, s.x, "landed_on_jaws"))
                        return
        else:  # caught or resting on the jaws: nothing moves any more
            new = PenState(t1, s.tip_z, 0.0, s.x, s.phase)
        if t_close is not None:
            self._finish_close(t_close)
            if self.reason == "caught":
                at_close = self._fall(s, t_close) if s.phase == "falling" else s
                self._append(PenState(t_close, at_close.tip_z, 0.0, s.x, "caught"))
                new = PenState(t1, at_close.tip_z, 0.0, s.x, "caught")
        self._append(new)

    def _finish_close(self, t_close: float | None) -> None:
        """Judge the moment the jaws finish closing (first time only)."""
        if t_close is None or self.t_closed is not None:
            return
        self.t_closed = t_close
        if self.reason is not None:
            return
        c = self.config
        s = self._history[-1]
        tip = self._fall(s, t_close).tip_z if s.phase == "falling" else s.tip_z
        half_pad = c.jaw_pad_height_m / 2
        if tip > -half_pad:
            self.reason = "too_early"
        elif tip + c.pen_length_m < half_pad:
            self.reason = "too_late"
        else:
            self.reason = "caught"

    def _fall(self, s: PenState, t1: float) -> PenState:
        dt = t1 - s.t
        g = self.config.gravity_m_s2
        return PenState(t1, s.tip_z + s.velocity * dt - 0.5 * g * dt * dt, s.velocity - g * dt, s.x, "falling")

    def _time_to_reach(self, s: PenState, z: float) -> float:
        """Time after s.t at which a falling pen's tip reaches height z (positive root of the fall equation)."""
        g = self.config.gravity_m_s2
        drop = s.tip_z - z  # >= 0
        return (s.velocity + math.sqrt(s.velocity**2 + 2 * g * drop)) / g

    def _append(self, state: PenState) -> None:
        self._history.append(state)
        self._times.append(state.t)
