"""`OpenCVCamera`: a real camera (or a video file / stream URL) through `cv2.VideoCapture`.

Devices are opened by index (0 -> /dev/video0) or path; files and URLs by path. Requested width/height/FPS are asked
of the device, and what it actually delivers is read back: a device that ignores the size request gets its frames
resized, so callers always receive the configured shape. Frames are RGB uint8. Capture time is estimated as arrival
time minus the configured pipeline latency (webcams do not report exposure times through OpenCV), and the measured
frame interval is tracked so a 30 FPS camera that really delivers 15 shows up in the logs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import cv2
import numpy as np

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.robot.camera import CameraConnectionError, CameraReadError, CameraTimeout, Frame


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


class OpenCVCamera:
    """`Camera` implementation over `cv2.VideoCapture` (see robot/camera.py)."""

    def __init__(self, config: OpenCVCameraConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock if clock is not None else MonotonicClock()
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
        self._capture = capture
        self._index = 0
        self._t_last_arrival = None
        self._t_next_playback = self.clock.now()
        # A new stream: the last session's frame, error and index must not answer for it (a reused camera would
        # raise the old "end of file" / "unplugged" at once, or skip frames until its index passed the old one).
        with self._latest_changed:
            self._latest, self._reader_error, self._last_async_index = None, None, -1

    def disconnect(self) -> None:
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
        return self._read_blocking()

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
            what = "end of video file" if self._is_file else "device stopped delivering (unplugged?)"
            raise CameraReadError(
                f"camera {self.name!r} ({self.source}): read failed after {self._index} frames: {what}"
            )
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
        """Newest frame from a background reader thread, waiting up to `timeout_s` for one not returned yet."""
        if self._capture is None:  # else a reader would start, find no device, and stay dead after connect()
            raise CameraReadError(f"camera {self.name!r} ({self.source}): read before connect()")
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
            if self._reader_error is not None:
                raise self._reader_error
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
