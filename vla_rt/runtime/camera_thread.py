"""Camera thread: read frames as they come and publish them, stamped with capture time, into a frame ring.

A camera that lost its device (`CameraDisconnected`) reopens it itself, with backoff, on later reads (OpenCVCamera);
this loop says so once (`camera_link_down`, then `camera_link_up` with the outage's length) instead of logging every
failed read, and writes nothing meanwhile: the inference thread waits for a frame newer than the last it used, so no
old frame goes to the policy as if new. A camera that gives up (`permanent`) stops the runtime safely, as a gripper
that gives up does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vla_rt.clock import Clock
from vla_rt.robot.camera import Camera, CameraDisconnected, CameraError, CameraTimeout, Frame
from vla_rt.runtime.events import EventLog
from vla_rt.runtime.ring import RingClosed, TimestampedRing


class CameraLoop:
    """Blocks on `camera.read` with a stall timeout, so a silent camera is logged (once per stall) and shutdown
    never waits on a dead device longer than that timeout."""

    def __init__(
        self,
        camera: Camera,
        ring: TimestampedRing[Frame],
        log: EventLog,
        clock: Clock,
        stop: threading.Event,
        stall_timeout_s: float,
        request_stop: Callable[[str], None] | None = None,
    ) -> None:
        self.camera = camera
        self.ring = ring
        self.log = log
        self.clock = clock
        self.stop = stop
        self.stall_timeout_s = stall_timeout_s
        self.request_stop = request_stop or (lambda reason: stop.set())
        self.frames = 0
        self.stalls = 0
        self.errors = 0
        self.link_losses = 0
        self._link_down_since: float | None = None

    def run(self) -> None:
        last_arrival: float | None = None
        stalled = False
        while not self.stop.is_set():
            try:
                frame = self.camera.read(timeout_s=self.stall_timeout_s)
            except CameraTimeout:
                if not stalled and not self.stop.is_set():
                    stalled = True
                    self.stalls += 1
                    silent = None if last_arrival is None else (self.clock.now() - last_arrival) * 1000
                    self.log.emit("camera_stall", camera=self.camera.name, silent_ms=silent)
                continue
            except CameraDisconnected as err:  # the camera reopens it on later reads, at its backoff's pace
                if not self._link_down(err):
                    return
                continue
            except CameraError as err:
                self.errors += 1
                self.log.emit("camera_error", camera=self.camera.name, error=str(err))
                self.clock.sleep(self.stall_timeout_s)  # a failing device must not turn this loop into a spin
                continue
            if self._link_down_since is not None:
                down_ms = (frame.t_arrival - self._link_down_since) * 1000
                self.log.emit("camera_link_up", camera=self.camera.name, down_ms=down_ms, index=frame.index)
                self._link_down_since, stalled = None, False
            if stalled:
                stalled = False
                gap = None if last_arrival is None else (frame.t_arrival - last_arrival) * 1000
                self.log.emit("camera_resume", camera=self.camera.name, gap_ms=gap, index=frame.index)
            last_arrival = frame.t_arrival
            try:
                item = self.ring.write(frame.t_capture, frame)
            except RingClosed:
                return
            except ValueError as err:  # capture time went backwards: a driver bug, never feed it to the policy
                self.errors += 1
                self.log.emit("camera_error", camera=self.camera.name, error=str(err))
                self.clock.sleep(self.stall_timeout_s)  # nor spin (under a SimClock a spin never lets time pass)
                continue
            self.frames += 1
            self.log.emit(
                "frame_captured",
                camera=self.camera.name,
                seq=item.seq,
                index=frame.index,
                t_capture=frame.t_capture,
                t_arrival=frame.t_arrival,
            )

    def _link_down(self, err: CameraDisconnected) -> bool:
        """Log the outage once; False when the camera gave up (the runtime is asked to stop)."""
        if self._link_down_since is None:
            self._link_down_since = self.clock.now()
            self.link_losses += 1
            self.log.emit("camera_link_down", camera=self.camera.name, error=str(err))
        if err.permanent:
            self.log.emit("safe_stop", reason=f"camera {self.camera.name!r} lost: {err}", safe_action=None)
            self.request_stop("camera link lost")
            return False
        return True
