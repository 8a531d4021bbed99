"""The gripper interface the runtime drives (`Gripper`), the state a device acknowledges and the errors it raises.

Implementations: `SerialGripper` (robot/serial_gripper.py, pyserial). Every error names the port, so a failure in
the output thread says which device failed and how (`GripperTimeout`: no ack in time; `GripperDisconnected`: the
link is down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class GripperState:
    """What the device reported in an ack. position: measured, 0 open .. 1 closed."""

    position: float
    moving: bool
    at_target: bool
    seq: int
    t_sent: float  # clock time the command was written
    t_ack: float  # clock time the ack was decoded
    device_time_ms: int


@runtime_checkable
class Gripper(Protocol):
    """What the runtime's output thread needs from a gripper (SerialGripper is the implementation)."""

    @property
    def is_connected(self) -> bool: ...

    def connect(self) -> None: ...

    def disconnect(self) -> None: ...

    def send_target(self, position: float) -> GripperState:
        """Command a target (0 open .. 1 closed) and return the acknowledged state; raise GripperError subclasses."""


class GripperError(RuntimeError):
    """Base class: every message names the port."""

    def __init__(self, port: str, message: str) -> None:
        super().__init__(f"gripper on {port}: {message}")
        self.port = port


class GripperTimeout(GripperError, TimeoutError):
    """The device did not acknowledge a command in time (link alive but silent, or the ack was corrupted)."""


class GripperDisconnected(GripperError):
    """The port failed, vanished or cannot be opened. `permanent`: no more reconnect attempts will be made."""

    def __init__(self, port: str, message: str, permanent: bool = False) -> None:
        super().__init__(port, message)
        self.permanent = permanent
