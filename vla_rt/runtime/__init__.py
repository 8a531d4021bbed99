"""Real-time runtime: timestamped rings, the camera / inference / output threads and `Runtime` that runs them.

It drives the device interfaces of `vla_rt.robot` (`Camera`, `Gripper`) on a clock of `vla_rt.clock`; neither of
those imports the runtime (docs/runtime.md, "Layers").
"""

from vla_rt.runtime.actions import ActionChunk
from vla_rt.runtime.events import EventLog, load_events
from vla_rt.runtime.ring import Stamped, TimestampedRing
from vla_rt.runtime.runtime import Runtime, RuntimeConfig

__all__ = ["ActionChunk", "EventLog", "Runtime", "RuntimeConfig", "Stamped", "TimestampedRing", "load_events"]
