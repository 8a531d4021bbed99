"""Camera interface shared by real and simulated cameras (LeRobot-like: connect / read / async_read / disconnect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True, slots=True)
class Frame:
    """One camera image with its times on the runtime clock.

    image: uint8 (H, W, 3) RGB. t_capture: when the sensor exposed it (hardware-true for simulated cameras,
    `t_arrival - configured latency` for cameras that only know arrival). t_arrival: when the reader got it.
    index: the device's frame counter (gaps = frames the reader never got).
    """

    image: np.ndarray
    t_capture: float
    t_arrival: float
    index: int


class CameraError(RuntimeError):
    """Base class: every message names the device."""


class CameraConnectionError(CameraError):
    """The device could not be opened or configured."""


class CameraReadError(CameraError):
    """A read failed (device gone, end of a video file, bad frame)."""


class CameraEndOfStream(CameraReadError):
    """A video file has no more frames: the stream is over, not broken, so nothing reconnects to it."""


class CameraDisconnected(CameraReadError):
    """The device stopped delivering (unplugged, driver hiccup) or cannot be reopened yet. `permanent`: no more
    reconnect attempts will be made (the configured limit is reached)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class CameraTimeout(CameraError, TimeoutError):
    """No frame arrived within the requested time."""


@runtime_checkable
class Camera(Protocol):
    name: str

    @property
    def is_connected(self) -> bool: ...

    def connect(self) -> None: ...

    def read(self, timeout_s: float | None = None) -> Frame:
        """Next frame not yet returned, blocking up to `timeout_s` (None = forever); raises CameraTimeout."""

    def async_read(self, timeout_s: float = 0.2) -> Frame:
        """Newest frame available, waiting up to `timeout_s` for one newer than the last returned."""

    def disconnect(self) -> None: ...
