"""`OpenCVCamera`: a real camera (or a video file / stream URL) through `cv2.VideoCapture`.

Devices are opened by index (0 -> /dev/video0) or path; files and URLs by path. Requested width/height/FPS are asked
of the device, and what it actually delivers is read back: a device that ignores the size request gets its frames
resized, so callers always receive the configured shape. Frames are RGB uint8. Capture time is estimated as arrival
time minus the configured pipeline latency (webcams do not report exposure times through OpenCV), and the measured
frame interval is tracked so a 30 FPS camera that really delivers 15 shows up in the logs.

A device (or stream) that stops delivering is not the end of the run: a USB camera unplugged and replugged, or a
driver hiccup, raises `CameraDisconnected`, the dead capture is released, and later reads reopen it, spaced by
exponential backoff on the injectable clock (as `SerialGripper` does for its port), so a momentary glitch costs
frames, not the run. A video file that reached its last frame raises `CameraEndOfStream` instead: its stream is over,
and reopening it would replay the file as if it were new frames.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.errors import ConfigError
from vla_rt.robot.backoff import ReconnectBackoff
from vla_rt.robot.camera import (
    CameraConnectionError,
    CameraDisconnected,
    CameraEndOfStream,
    CameraReadError,
    CameraTimeout,
    Frame,
)

EventSink = Callable[..., Any]


@dataclass
class OpenCVCameraConfig:
    index_or_path: int | str = 0
    name: str = "cam"
    width: int | None = None  # None: whatever the device delivers
    height: int | None = None
    fps: float | None = None  # requested from devices; for files, the playback rate (None: the file's own)
    latency_s: float = 0.0  # known sensor-to-host latency: t_capture = t_arrival - latency_s
    backend: int = cv2.CAP_ANY
    realtime_playback: bool = True  # files: deliver frames at their frame rate, like a camera would
    reconnect_backoff_s: float = 0.05  # first wait before reopening a device that stopped; doubles per failure
    reconnect_backoff_max_s: float = 1.0
    max_reconnect_attempts: int | None = None  # None: keep trying; else CameraDisconnected(permanent=True)


def check_reconnect_config(config: OpenCVCameraConfig) -> None:
    """The backoff fields, checked when the camera is built: a zero or negative backoff would reopen a dead device
    in a tight loop (and flood the log), a NaN would never schedule an attempt. Raises ConfigError naming the field."""
    first, most, limit = config.reconnect_backoff_s, config.reconnect_backoff_max_s, config.max_reconnect_attempts
    for name, value in (("reconnect_backoff_s", first), ("reconnect_backoff_max_s", most)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
            raise ConfigError(name, "seconds > 0 and <= 3600", value)
    if most < first:
        raise ConfigError("reconnect_backoff_max_s", f">= reconnect_backoff_s ({first})", most)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError("max_reconnect_attempts", "an integer >= 1, or None to keep trying", limit)


class OpenCVCamera:
    """`Camera` implementation over `cv2.VideoCapture` (see robot/camera.py)."""

    def __init__(
        self, config: OpenCVCameraConfig, clock: Clock | None = None, on_event: EventSink | None = None
    ) -> None:
        check_reconnect_config(config)
        self.config = config
        self.name = config.name
        self.clock = clock if clock is not None else MonotonicClock()
        self.on_event = on_event or (lambda *a, **k: None)
        self._capture: cv2.VideoCapture | None = None
        self._is_file = False
        self._index = 0
        self._t_last_arrival: float | None = None
        self._t_next_playback: float | None = None
        self.measured_frame_interval_s: float | None = None  # exponential average of arrival intervals
        self.device_fps: float | None = None
        self.device_size: tuple[int, int] | None = None  # (width, height) the device actually delivers
        self._latest: Frame | None = None
        self._latest_changed = threading.Condition()
        self._reader: threading.Thread | None = None
        self._reader_error: Exception | None = None
        self._last_async_index = -1
        self._lost_at: float | None = None  # clock time the device stopped delivering; None: not in an outage
        self._backoff = ReconnectBackoff(config)
        self.counters = {"disconnects": 0, "reconnect_attempts": 0, "reconnects": 0}

    @property
    def source(self) -> str:
        return str(self.config.index_or_path)

    @property
    def is_connected(self) -> bool:
        return self._capture is not None

    def connect(self) -> None:
        """Open and configure the device; raises CameraConnectionError naming it if that fails."""
        if self._capture is not None:
            return
        self._open()
        self._index = 0
        self._lost_at = None
        # A new stream: the last session's frame, error and index must not answer for it (a reused camera would
        # raise the old "end of file" / "unplugged" at once, or skip frames until its index passed the old one).
        with self._latest_changed:
            self._latest, self._reader_error, self._last_async_index = None, None, -1

    def _open(self) -> None:
        """Open and configure the capture (connect, and each reconnect: the frame index runs on across those)."""
        src = self.config.index_or_path
        self._is_file = isinstance(src, str) and os.path.isfile(src)
        capture = cv2.VideoCapture(src, self.config.backend)
        if not capture.isOpened():
            capture.release()
            hint = "no such file" if isinstance(src, str) and not os.path.exists(src) else "device busy or missing?"
            raise CameraConnectionError(f"camera {self.name!r}: cannot open {src!r} with OpenCV ({hint})")
        if not self._is_file:
            if self.config.width:
                capture.set(cv2.CAP_PROP_FRAME_WIDTH, self.config.width)
            if self.config.height:
                capture.set(cv2.CAP_PROP_FRAME_HEIGHT, self.config.height)
            if self.config.fps:
                capture.set(cv2.CAP_PROP_FPS, self.config.fps)
        reported_fps = capture.get(cv2.CAP_PROP_FPS)
        self.device_fps = reported_fps if reported_fps and reported_fps > 0 else None
        self.device_size = (int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)))
        self._t_last_arrival = None
        self._t_next_playback = self.clock.now()
        with self._latest_changed:
            self._reader_error = None
        self._capture = capture

    def disconnect(self) -> None:
        self._release()
        self._lost_at = None  # closed on purpose: no reconnect attempts; a read says "read before connect()"

    def _release(self) -> None:
        capture, self._capture = self._capture, None
        if self._reader is not None:
            self._reader.join(2.0)
            self._reader = None
        if capture is not None:
            capture.release()

    @property
    def playback_interval_s(self) -> float | None:
        """Frame spacing when replaying a file in real time (None for devices or when disabled)."""
        if not (self._is_file and self.config.realtime_playback):
            return None
        fps = self.config.fps or self.device_fps
        return 1.0 / fps if fps else None

    def read(self, timeout_s: float | None = None) -> Frame:
        """Next frame not returned yet. Without a timeout: a plain blocking `VideoCapture.read`. With one: through
        the background reader (as `async_read`), because a blocking OpenCV read cannot be interrupted."""
        if timeout_s is not None:
            return self.async_read(timeout_s)
        self._reopen_when_due(None)
        try:
            return self._read_blocking()
        except CameraDisconnected as err:
            raise self._lost(err) from None

    def _read_blocking(self) -> Frame:
        capture = self._capture
        if capture is None:
            raise CameraReadError(f"camera {self.name!r} ({self.source}): read before connect()")
        interval = self.playback_interval_s
        if interval is not None:
            self.clock.sleep_until(self._t_next_playback)
            self._t_next_playback = max(self._t_next_playback + interval, self.clock.now() - interval)
        ok, bgr = capture.read()
        t_arrival = self.clock.now()
        if not ok or bgr is None:
            failed = f"camera {self.name!r} ({self.source}): read failed after {self._index} frames"
            if self._is_file:
                raise CameraEndOfStream(f"{failed}: end of video file")
            raise CameraDisconnected(f"{failed}: device stopped delivering (unplugged?)")
        frame = Frame(self._to_rgb(bgr), t_arrival - self.config.latency_s, t_arrival, self._index)
        self._index += 1
        if self._t_last_arrival is not None:
            gap = t_arrival - self._t_last_arrival
            avg = self.measured_frame_interval_s
            self.measured_frame_interval_s = gap if avg is None else 0.9 * avg + 0.1 * gap
        self._t_last_arrival = t_arrival
        return frame

    @property
    def measured_fps(self) -> float | None:
        interval = self.measured_frame_interval_s
        return 1.0 / interval if interval else None

    def async_read(self, timeout_s: float = 0.2) -> Frame:
        """Newest frame from a background reader thread, waiting up to `timeout_s` for one not returned yet. While the
        device is down, waits for the next reopen attempt instead (raising CameraDisconnected until one succeeds)."""
        self._reopen_when_due(timeout_s)
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_forever, name=f"opencv-{self.name}", daemon=True)
            self._reader.start()
        with self._latest_changed:
            self._latest_changed.wait_for(
                lambda: (
                    self._reader_error is not None
                    or (self._latest is not None and self._latest.index > self._last_async_index)
                ),
                timeout_s,
            )
            if self._latest is not None and self._latest.index > self._last_async_index:
                self._last_async_index = self._latest.index
                return self._latest
            error = self._reader_error
        if isinstance(error, CameraDisconnected):
            raise self._lost(error) from None
        if error is not None:
            raise error
        raise CameraTimeout(f"camera {self.name!r} ({self.source}): no new frame within {timeout_s * 1000:.0f} ms")

    def _read_forever(self) -> None:
        while self._capture is not None:
            try:
                frame = self._read_blocking()
            except Exception as err:  # noqa: BLE001 - handed to async_read callers
                with self._latest_changed:
                    self._reader_error = err
                    self._latest_changed.notify_all()
                return
            with self._latest_changed:
                self._latest = frame
                self._latest_changed.notify_all()

    def _to_rgb(self, bgr: np.ndarray) -> np.ndarray:
        if bgr.ndim == 2:
            bgr = cv2.cvtColor(bgr, cv2.COLOR_GRAY2BGR)
        width, height = self.config.width, self.config.height
        if width and height and (bgr.shape[1], bgr.shape[0]) != (width, height):
            bgr = cv2.resize(bgr, (width, height), interpolation=cv2.INTER_AREA)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    # --- device loss and recovery ---------------------------------------------------------------------------------
    def _lost(self, err: CameraDisconnected) -> CameraDisconnected:
        """Release the dead capture, schedule the first reopen; returns the exception to raise."""
        self._release()
        self.counters["disconnects"] += 1
        self._lost_at = self.clock.now()
        self._backoff.lost(self._lost_at)
        self.on_event("camera_disconnected", camera=self.name, error=str(err))
        return CameraDisconnected(f"{err}; reopening in {self._backoff.delay_s * 1000:.0f} ms")

    def _reopen_when_due(self, timeout_s: float | None) -> None:
        """Nothing while the device is open. While it is down: wait for the next reopen attempt (at most `timeout_s`,
        so a reading thread still sees its stop flag), then make it; raises CameraDisconnected unless it is open."""
        if self._capture is not None:
            return
        if self._lost_at is None:  # else a reader would start, find no device, and stay dead after connect()
            raise CameraReadError(f"camera {self.name!r} ({self.source}): read before connect()")
        backoff = self._backoff
        if backoff.gave_up():
            raise CameraDisconnected(
                f"{self._down()}; gave up after {backoff.attempts} reconnect attempts", permanent=True
            )
        now = self.clock.now()
        if backoff.wait_s(now) > 0:
            self.clock.sleep_until(backoff.next_t if timeout_s is None else min(backoff.next_t, now + timeout_s))
            now = self.clock.now()
            if backoff.wait_s(now) > 0:
                raise CameraDisconnected(
                    f"{self._down()}; next reconnect attempt in {backoff.wait_s(now) * 1000:.0f} ms"
                )
        self._reconnect()

    def _reconnect(self) -> None:
        """One reopen attempt; raises CameraDisconnected unless it succeeds. The next attempt is timed from the end
        of this one: opening a USB camera can take longer than the first backoff steps."""
        self.counters["reconnect_attempts"] += 1
        attempt = self._backoff.attempt()
        try:
            self._open()
        except CameraConnectionError as err:
            self._backoff.failed(self.clock.now())
            self.on_event("camera_reconnect_failed", camera=self.name, attempt=attempt, error=str(err))
            raise CameraDisconnected(
                f"{self._down()}; reconnect attempt {attempt} failed; next in {self._backoff.delay_s * 1000:.0f} ms"
            ) from err
        self.counters["reconnects"] += 1
        down_ms = (self.clock.now() - self._lost_at) * 1000
        self._lost_at = None
        self._backoff.succeeded()
        self.on_event("camera_reconnected", camera=self.name, attempt=attempt, down_ms=down_ms)

    def _down(self) -> str:
        return f"camera {self.name!r} ({self.source}): disconnected"
