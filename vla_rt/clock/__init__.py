"""Clocks: the bottom layer that `vla_rt.runtime` and `vla_rt.robot` both build on (it imports neither).

`Clock` / `ClockCondition` (interface.py) are the interface; `MonotonicClock` (monotonic.py) runs on the wall clock,
`SimClock` (sim.py) in deterministic simulated time.
"""

from vla_rt.clock.interface import Clock, ClockCondition
from vla_rt.clock.monotonic import MonotonicClock
from vla_rt.clock.sim import SimClock, SimCondition, SimThreadError

__all__ = ["Clock", "ClockCondition", "MonotonicClock", "SimClock", "SimCondition", "SimThreadError"]
