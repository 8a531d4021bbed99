"""`Runtime`: wires cameras, policy, gripper, clock, rings and the event log into the three threads of the paper.

    camera thread(s) --frames--> frame ring(s) --> inference thread --chunks--> action ring --> output thread --> gripper

`start()` connects the devices and starts the threads through the clock (so under a SimClock they are
deterministic participants); `stop()` stops them, joins them, puts the gripper in its safe state and disconnects.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.errors import ConfigError
from vla_rt.experiment_config import Limit, non_negative, positive
from vla_rt.robot.camera import Camera, Frame
from vla_rt.robot.gripper import Gripper, GripperError
from vla_rt.runtime.actions import ActionChunk
from vla_rt.runtime.camera_thread import CameraLoop
from vla_rt.runtime.events import MAX_LOG_BYTES, EventLog
from vla_rt.runtime.inference_thread import InferenceLoop, Policy
from vla_rt.runtime.output_thread import OutputLoop
from vla_rt.runtime.ring import TimestampedRing


@dataclass
class RuntimeConfig:
    control_hz: float = 200.0  # output thread rate
    dt_action_s: float = 0.01  # spacing of a chunk's steps
    action_time_origin: str = "inference_done"  # or "frame_capture" (latency-compensated: actions keep frame time)
    action_time_offset_s: float = 0.0  # added to the origin: step k is due at origin + offset + k * dt_action_s
    max_action_age_s: float = 1.0  # an action whose frame is older than this is stale and never sent
    views: Sequence[tuple[str, int]] | None = None  # (camera, frame offset); None: current + previous of camera 1
    frame_ring_capacity: int = 8
    action_ring_capacity: int = 16
    camera_stall_timeout_s: float = 0.1  # no frame for this long: "camera_stall" (and the inference thread waits)
    min_inference_latency_s: float = 0.0  # publish chunks no earlier than this after inference start
    charge_measured_inference_time: bool = False  # SimClock: inference costs its measured wall time in sim time
    initial_action: float = 0.0  # sent until the first chunk arrives (gripper open)
    action_range: tuple[float, float] = (0.0, 1.0)
    action_index: int = 0  # which action dimension drives the gripper
    nan_limit: int = 3  # distinct non-finite actions in a row before a safe stop
    safe_action: float | None = None  # on safe stop / shutdown: None = hold the last command, 0.0 = open, ...
    on_gripper_disconnect: str = "reconnect"  # or "stop"
    join_timeout_s: float = 2.0
    event_log_max_bytes: int = MAX_LOG_BYTES  # past this the log records `log_truncated` and only counts events
    freeze_gc: bool = True  # gc.freeze() at start: full collections skip the (torch-sized) startup heap
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, copied into the runtime_start event


_RUNTIME_LIMITS = {
    "control_hz": positive("output thread rate", le=100_000),
    "dt_action_s": positive("seconds between a chunk's steps", le=60),
    "action_time_origin": Limit(choices=("inference_done", "frame_capture")),
    "action_time_offset_s": Limit(ge=-60, le=60, why="seconds"),
    "max_action_age_s": positive("seconds", le=3_600),
    "frame_ring_capacity": Limit(ge=1, le=1_000_000),
    "action_ring_capacity": Limit(ge=1, le=1_000_000),
    "camera_stall_timeout_s": positive("seconds", le=60),
    "min_inference_latency_s": non_negative("seconds", le=60),
    "initial_action": Limit(why="a finite gripper target"),
    "action_index": Limit(ge=0, le=1_000_000),
    "nan_limit": Limit(ge=1, le=1_000_000),
    "safe_action": Limit(why="a finite gripper target, or None to hold the last command"),
    "on_gripper_disconnect": Limit(choices=("reconnect", "stop")),
    "join_timeout_s": positive("seconds", le=3_600),
    "event_log_max_bytes": Limit(ge=1024, why="bytes"),
}


def check_runtime_config(cfg: RuntimeConfig) -> None:
    """Every rate, capacity and choice the threads depend on (a zero control rate divides by zero in the output
    thread, a zero stall timeout spins the camera thread); raises ConfigError naming the field."""
    for name, limit in _RUNTIME_LIMITS.items():
        value = getattr(cfg, name)
        if not limit.accepts(value):
            raise ConfigError(name, limit.expected(isinstance(getattr(RuntimeConfig, name, 0.0), int)), value)
    lo, hi = cfg.action_range
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError("action_range", "(low, high) finite with low < high", cfg.action_range)


class Runtime:
    """Real-time camera -> policy -> gripper loop. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        cameras: Camera | Mapping[str, Camera],
        policy: Policy,
        gripper: Gripper,
        clock: Clock | None = None,
        config: RuntimeConfig | None = None,
        log_path: str | Path | None = None,
        prompt_tokens: np.ndarray | None = None,
        prompt: str | None = None,
    ) -> None:
        self.cameras = dict(cameras) if isinstance(cameras, Mapping) else {cameras.name: cameras}
        self.policy = policy
        self.gripper = gripper
        self.clock = clock if clock is not None else MonotonicClock()
        self.config = config or RuntimeConfig()
        cfg = self.config
        check_runtime_config(cfg)  # before any thread, ring or log exists
        self.log = EventLog(log_path, self.clock, max_bytes=cfg.event_log_max_bytes)
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.frame_rings: dict[str, TimestampedRing[Frame]] = {
            name: TimestampedRing(cfg.frame_ring_capacity, self.clock, f"frames/{name}") for name in self.cameras
        }
        self.action_ring: TimestampedRing[ActionChunk] = TimestampedRing(
            cfg.action_ring_capacity, self.clock, "actions"
        )
        first = next(iter(self.cameras))
        views = list(cfg.views) if cfg.views is not None else [(first, 0), (first, -1)]
        self.camera_loops = {
            name: CameraLoop(
                cam,
                self.frame_rings[name],
                self.log,
                self.clock,
                self._stop,
                cfg.camera_stall_timeout_s,
                self.request_stop,
            )
            for name, cam in self.cameras.items()
        }
        self.output = OutputLoop(
            gripper,
            self.action_ring,
            self.log,
            self.clock,
            self._stop,
            self.request_stop,
            control_hz=cfg.control_hz,
            max_action_age_s=cfg.max_action_age_s,
            initial_action=cfg.initial_action,
            action_range=cfg.action_range,
            action_index=cfg.action_index,
            nan_limit=cfg.nan_limit,
            safe_action=cfg.safe_action,
            on_disconnect=cfg.on_gripper_disconnect,
        )
        self.inference = InferenceLoop(
            policy,
            self.frame_rings,
            self.action_ring,
            views,
            lambda: np.array([self.output.position], dtype=np.float32),
            self.log,
            self.clock,
            self._stop,
            dt_action_s=cfg.dt_action_s,
            time_origin=cfg.action_time_origin,
            time_offset_s=cfg.action_time_offset_s,
            frame_wait_timeout_s=cfg.camera_stall_timeout_s,
            min_latency_s=cfg.min_inference_latency_s,
            charge_measured_time=cfg.charge_measured_inference_time,
            prompt_tokens=prompt_tokens,
            prompt=prompt,
            action_index=cfg.action_index,
            max_action_age_s=cfg.max_action_age_s,
        )

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> Runtime:
        """Connect devices (errors propagate: a missing device at start is a setup error) and start the threads."""
        if self._threads:
            raise RuntimeError("runtime already started")
        if self.stopping:  # its rings and log are closed: the threads would exit at once, the devices held open
            raise RuntimeError(f"runtime already stopped ({self.stop_reason}); a Runtime runs once, build a new one")
        opened = []  # what this call connected: closed again if a later device fails, so none is left held open
        try:
            for device in (*self.cameras.values(), self.gripper):
                if not device.is_connected:
                    device.connect()
                    opened.append(device)
        except BaseException:
            for device in reversed(opened):
                device.disconnect()
            raise
        for device in (*self.cameras.values(), self.gripper):  # reconnect attempts and outcomes go to the log
            if hasattr(device, "on_event"):
                device.on_event = lambda event, **fields: self.log.emit(event, **fields)
        if self.config.freeze_gc:
            # A gen-2 collection walks every tracked object: ~90 ms with torch imported, enough to miss a pen.
            # Collect once now, then move the survivors out of the collector's sight for the run.
            gc.collect()
            gc.freeze()
        self.log.emit("runtime_start", cameras=list(self.cameras), config=_loggable(self.config))
        for name, loop in self.camera_loops.items():
            self._threads.append(self.clock.start_thread(self._guard(loop.run), f"camera-{name}"))
        self._threads.append(self.clock.start_thread(self._guard(self.inference.run), "inference"))
        self._threads.append(self.clock.start_thread(self._guard(self.output.run), "output"))
        return self

    def wait_until_live(self, timeout_s: float = 10.0, poll_s: float = 0.005) -> float:
        """Block until the loop is live: every camera has delivered a frame, the policy has returned a chunk and the
        gripper has acknowledged a command. Returns the clock time it was.

        Why: start-up (device connects, the first inference, the first serial round trip) takes tens of ms on a
        workstation and hundreds on a loaded 2-core machine. A wall-clock experiment that starts its event (a pen
        drop) before this returns measures start-up, not the loop. Raises `TimeoutError` naming what is not live
        after `timeout_s` (clock seconds), `RuntimeError` if the runtime stops first (a crashed thread)."""
        if not self._threads:
            raise RuntimeError("wait_until_live() before start()")
        deadline = self.clock.now() + timeout_s
        while True:
            missing = self._not_live()
            if not missing:
                return self.clock.now()
            if self.stopping:
                raise RuntimeError(f"the runtime stopped before it was live ({self.stop_reason}): {'; '.join(missing)}")
            if self.clock.now() >= deadline:
                raise TimeoutError(f"the runtime is not live after {timeout_s:g} s: {'; '.join(missing)}")
            self.clock.sleep(poll_s)

    def _not_live(self) -> list[str]:
        missing = [
            f"camera {name!r} has delivered no frame" for name, loop in self.camera_loops.items() if not loop.frames
        ]
        if not self.inference.inferences:
            missing.append("no inference has finished")
        if not self.output.counters["acked"]:
            missing.append("the gripper has acknowledged no command")
        return missing

    def request_stop(self, reason: str) -> None:
        """Ask every thread to finish (any thread may call it; `stop()` still has to be called to clean up)."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.log.emit("stop_requested", reason=reason)
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> dict[str, int]:
        """Stop and join the threads, send the safe command, disconnect; returns the final counters."""
        self.request_stop("stop() called")
        for ring in [*self.frame_rings.values(), self.action_ring]:
            ring.close()
        stuck = [t.name for t in self._threads if not self.clock.join_thread(t, self.config.join_timeout_s)]
        if stuck:
            self.log.emit("threads_not_joined", threads=stuck)
        if self.config.safe_action is not None and self.gripper.is_connected:
            try:
                self.gripper.send_target(float(self.config.safe_action))
                self.log.emit("safe_state_sent", target=float(self.config.safe_action))
            except GripperError as err:
                self.log.emit("safe_state_failed", error=str(err))
        self.gripper.disconnect()
        for camera in self.cameras.values():
            camera.disconnect()
        final = self.counters()
        self.log.emit("runtime_stop", reason=self.stop_reason, counters=final)
        self.log.close()
        self._threads = []
        if self.config.freeze_gc:
            gc.unfreeze()
        return final

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def counters(self) -> dict[str, int]:
        """Live totals: frames, inferences, commands, drops, faults."""
        totals = {f"output_{k}": v for k, v in self.output.counters.items()}
        for name, loop in self.camera_loops.items():
            totals[f"camera_{name}_frames"] = loop.frames
            totals[f"camera_{name}_stalls"] = loop.stalls
            totals[f"camera_{name}_errors"] = loop.errors
            totals[f"camera_{name}_link_losses"] = loop.link_losses
            camera = self.cameras[name]
            totals.update({f"camera_{name}_{k}": v for k, v in getattr(camera, "counters", {}).items()})
            totals[f"frame_ring_{name}_dropped"] = self.frame_rings[name].dropped
        totals["inferences"] = self.inference.inferences
        totals["inference_errors"] = self.inference.errors
        totals["frames_skipped"] = self.inference.frames_skipped
        totals["previous_frames_repeated"] = self.inference.missing_previous  # first frame, or one from before a stall
        totals["chunks_late"] = self.inference.chunks_late
        totals["action_ring_dropped"] = self.action_ring.dropped
        totals["event_log_dropped"] = self.log.dropped
        totals.update({f"gripper_{k}": v for k, v in getattr(self.gripper, "counters", {}).items()})
        return totals

    def _guard(self, loop: Any) -> Any:
        """Thread body wrapper: an unexpected exception is logged and stops the runtime (fail safe), then re-raised."""

        def body() -> None:
            try:
                loop()
            except Exception as err:
                self.log.emit("thread_crashed", error=f"{type(err).__name__}: {err}")
                self.request_stop(f"{threading.current_thread().name} crashed")
                raise

        return body


def _loggable(config: RuntimeConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(config).items()}
