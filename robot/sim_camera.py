"""Simulated camera over the pen-drop scene: fixed frame rate, fixed pipeline latency, fault injection.

Frame k is exposed at `t_k = phase_s + k / fps` on the clock and becomes readable `latency_frames / fps` later (the
paper's camera: 30 FPS, ~2 frames of latency). It is rendered from the scene as it was at `t_k` (pen physics and jaw
position are queried in the past, which the sims keep exact), so the image a reader gets is as old as on hardware.
Like a driver with a one-frame buffer, a late reader gets the newest delivered frame; older ones count as dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.errors import ConfigError
from vla_rt.robot.camera import CameraError, CameraTimeout, Frame
from vla_rt.robot.pen_drop import PenDropSim
from vla_rt.robot.pen_render import PenRenderer, PenViewConfig


@dataclass
class SimCameraConfig:
    name: str = "cam"
    fps: float = 30.0
    latency_frames: float = 2.0
    phase_s: float = 0.0  # exposure time of frame 0 on the clock
    image_size: int = 224


class SimCamera:
    """`Camera` implementation over a `PenDropSim` (see robot/camera.py)."""

    def __init__(
        self,
        sim: PenDropSim,
        config: SimCameraConfig | None = None,
        clock: Clock | None = None,
        view: PenViewConfig | None = None,
    ) -> None:
        self.config = config or SimCameraConfig()
        self.name = self.config.name
        self.sim = sim
        self.clock = clock if clock is not None else MonotonicClock()
        view = view or PenViewConfig(image_size=self.config.image_size)
        self.renderer = PenRenderer(view, sim.config)
        c = self.config
        if not (math.isfinite(c.fps) and c.fps > 0) or not (math.isfinite(c.latency_frames) and c.latency_frames >= 0):
            # a rate <= 0 runs time backwards (every frame "older" than the last); latency < 0 delivers before capture
            raise ConfigError("fps / latency_frames", "fps > 0 and latency_frames >= 0", (c.fps, c.latency_frames))
        self.frame_interval_s = 1.0 / self.config.fps
        self.latency_s = self.config.latency_frames * self.frame_interval_s
        self.dropped = 0
        self._stalls: list[tuple[float, float]] = []
        self._next_index: int | None = None

    @property
    def is_connected(self) -> bool:
        return self._next_index is not None

    def connect(self) -> None:
        """Start streaming: the first frame read is the first one exposed at or after now."""
        self._next_index = max(self._index_at_or_after(self.clock.now()), 0)

    def disconnect(self) -> None:
        self._next_index = None

    def inject_stall(self, t_start: float, duration_s: float) -> None:
        """Frames exposed in [t_start, t_start + duration_s) are never delivered (cable glitch, driver hiccup)."""
        self._stalls.append((t_start, t_start + duration_s))

    def exposure_time(self, index: int) -> float:
        return self.config.phase_s + index * self.frame_interval_s

    def read(self, timeout_s: float | None = None) -> Frame:
        """Next frame not returned yet (the newest delivered one if the reader is late)."""
        if self._next_index is None:
            raise CameraError(f"sim camera {self.name!r}: read before connect()")
        now = self.clock.now()
        newest_delivered = math.floor((now - self.latency_s - self.config.phase_s) / self.frame_interval_s + 1e-9)
        index = max(self._next_index, newest_delivered)
        while self._stalled(self.exposure_time(index)):
            index += 1
        t_arrival = self.exposure_time(index) + self.latency_s
        if timeout_s is not None and t_arrival > now + timeout_s:
            self.clock.sleep_until(now + timeout_s)
            raise CameraTimeout(f"sim camera {self.name!r}: no frame within {timeout_s * 1000:.0f} ms")
        self.clock.sleep_until(t_arrival)
        self.dropped += sum(1 for k in range(self._next_index, index) if not self._stalled(self.exposure_time(k)))
        self._next_index = index + 1
        return self._frame(index, t_arrival)

    def async_read(self, timeout_s: float = 0.2) -> Frame:
        return self.read(timeout_s)

    def render_at(self, t: float) -> np.ndarray:
        """Scene image at exposure time `t` (uint8 (S, S, 3) RGB)."""
        return self.renderer.render(self.sim.state_at(t), self.sim.jaws.position_at(t))

    def _frame(self, index: int, t_arrival: float) -> Frame:
        t_capture = self.exposure_time(index)
        return Frame(self.render_at(t_capture), t_capture, t_arrival, index)

    def _stalled(self, t: float) -> bool:
        return any(start <= t < end for start, end in self._stalls)

    def _index_at_or_after(self, t: float) -> int:
        return math.ceil((t - self.config.phase_s) / self.frame_interval_s - 1e-9)
