"""Inference thread: newest frames -> observation -> `policy.infer` -> scheduled action chunk in the action ring.

It always works on the newest frame (never a backlog): if inference is slower than the camera, the frames it had no
time for are skipped and counted. The observation holds, per configured view, a frame of one camera at an offset
(0 = the newest, -1 = the one before it), so "current + previous frame" is `[("cam", 0), ("cam", -1)]`. The policy is
any object with `infer(obs) -> {"actions": (H, action_dim), "timing": {...}}`; this thread knows nothing else of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from vla_rt.clock import Clock
from vla_rt.robot.camera import Frame
from vla_rt.runtime.actions import ActionChunk
from vla_rt.runtime.events import EventLog
from vla_rt.runtime.ring import RingClosed, Stamped, TimestampedRing


class Policy(Protocol):
    def infer(self, obs: dict[str, Any]) -> dict[str, Any]: ...


class InferenceLoop:
    def __init__(
        self,
        policy: Policy,
        frame_rings: dict[str, TimestampedRing[Frame]],
        action_ring: TimestampedRing[ActionChunk],
        views: Sequence[tuple[str, int]],
        state_fn: Callable[[], np.ndarray],
        log: EventLog,
        clock: Clock,
        stop: threading.Event,
        *,
        dt_action_s: float,
        time_origin: str,
        time_offset_s: float,
        frame_wait_timeout_s: float,
        min_latency_s: float = 0.0,
        charge_measured_time: bool = False,
        prompt_tokens: np.ndarray | None = None,
        prompt: str | None = None,
        action_index: int = 0,
        max_action_age_s: float = math.inf,
    ) -> None:
        if time_origin not in ("inference_done", "frame_capture"):
            raise ValueError(f"action time origin must be 'inference_done' or 'frame_capture', got {time_origin!r}")
        self.policy = policy
        self.frame_rings = frame_rings
        self.action_ring = action_ring
        self.views = list(views)
        self.primary = self.views[0][0]
        self.state_fn = state_fn
        self.log = log
        self.clock = clock
        self.stop = stop
        self.dt_action_s = dt_action_s
        self.time_origin = time_origin
        self.time_offset_s = time_offset_s
        self.frame_wait_timeout_s = frame_wait_timeout_s
        self.min_latency_s = min_latency_s
        self.charge_measured_time = charge_measured_time
        self.prompt_tokens = prompt_tokens
        self.prompt = prompt  # text: a π0.5 policy writes the current state into it at every inference
        self.action_index = action_index  # the dimension the output thread sends: every chunk must have it
        self.max_action_age_s = max_action_age_s  # the output thread's staleness bound, to name a late chunk
        self.inferences = 0
        self.errors = 0
        self.frames_skipped = 0
        self.missing_previous = 0
        self.chunks_late = 0  # published with no step the output thread may still send

    def run(self) -> None:
        ring = self.frame_rings[self.primary]
        last_seq = -1
        waiting = False
        while not self.stop.is_set():
            newest = ring.wait_newer(last_seq, self.frame_wait_timeout_s)
            if newest is None:
                if not waiting and not self.stop.is_set() and not ring.closed:
                    waiting = True
                    self.log.emit("inference_waiting", after_seq=last_seq, timeout_ms=self.frame_wait_timeout_s * 1000)
                continue
            waiting = False
            if last_seq >= 0 and newest.seq > last_seq + 1:
                self.frames_skipped += newest.seq - last_seq - 1
            last_seq = newest.seq
            if not self._infer_once(newest):
                return

    def _observation(self, newest: Stamped[Frame]) -> dict[str, Any]:
        """The configured views around `newest`. No view may span a camera stall (`frame_wait_timeout_s`, the
        runtime's camera_stall_timeout_s): another camera's newest frame that much older than `newest` is a camera
        that stopped (unplugged, reconnecting), so the observation is refused (`inference_skipped`) rather than given
        an old image as if current; an earlier frame of a pair that much older than its anchor (the last frame
        before an outage) is treated as missing, as at the first frame: the anchor is repeated, never a pair that
        shows seconds of motion as one frame's."""
        images = {}
        bound = self.frame_wait_timeout_s
        for i, (camera, offset) in enumerate(self.views):
            anchor = newest if camera == self.primary else self.frame_rings[camera].latest()
            if camera != self.primary and anchor is not None and newest.t - anchor.t > bound:
                raise RuntimeError(f"camera {camera!r}: its newest frame is {(newest.t - anchor.t) * 1000:.0f} ms "
                                   f"older than camera {self.primary!r}'s, past the stall timeout "
                                   f"({bound * 1000:.0f} ms)")  # fmt: skip
            item = anchor
            if anchor is not None and offset:
                item = self.frame_rings[camera].get(anchor.seq + offset)
                if item is not None and anchor.t - item.t > bound * abs(offset):
                    self.log.emit("previous_frame_too_old", camera=camera, offset=offset, frame_seq=anchor.seq,
                                  gap_ms=(anchor.t - item.t) * 1000)  # fmt: skip
                    item = None
                if item is None:  # first frame, evicted, or from before a stall: repeat the newest rather than fail
                    self.missing_previous += 1
                    item = anchor
            if item is None:
                raise RuntimeError(f"no frame from camera {camera!r} yet")
            images[f"cam{i}"] = item.value.image
        obs: dict[str, Any] = {"images": images, "state": np.asarray(self.state_fn(), dtype=np.float32)}
        if self.prompt_tokens is not None:
            obs["prompt_tokens"] = self.prompt_tokens
        if self.prompt is not None:
            obs["prompt"] = self.prompt
        return obs

    def _infer_once(self, newest: Stamped[Frame]) -> bool:
        """One observation -> one chunk. Returns False when the action ring is closed (shutdown)."""
        frame = newest.value
        try:
            obs = self._observation(newest)
        except RuntimeError as err:
            self.log.emit("inference_skipped", frame_seq=newest.seq, error=str(err))
            return True
        t_start = self.clock.now()
        self.log.emit("inference_start", frame_seq=newest.seq, frame_age_ms=(t_start - frame.t_capture) * 1000)
        wall_start = time.perf_counter()
        try:
            result = self.policy.infer(obs)
            actions = np.asarray(result["actions"], dtype=np.float64)
            if actions.ndim != 2 or actions.shape[0] == 0:
                raise ValueError(f"policy returned actions of shape {actions.shape}, expected (H, action_dim)")
            if actions.shape[1] <= self.action_index:  # else an IndexError in the output thread, mid-run
                raise ValueError(f"policy returned actions of shape {actions.shape}, expected action_dim > "
                                 f"{self.action_index} (RuntimeConfig.action_index)")  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a failing policy must not take the robot loop down
            self.errors += 1
            self.log.emit("inference_error", frame_seq=newest.seq, error=f"{type(err).__name__}: {err}")
            return True
        wall_s = time.perf_counter() - wall_start
        # Under a SimClock the call took no simulated time: model it (fixed floor and/or the measured cost).
        if self.min_latency_s > 0:
            self.clock.sleep_until(t_start + self.min_latency_s)
        if self.charge_measured_time:
            self.clock.sleep_until(t_start + wall_s)
        t_done = self.clock.now()
        origin = t_done if self.time_origin == "inference_done" else frame.t_capture
        chunk = ActionChunk(actions, origin + self.time_offset_s, self.dt_action_s, newest.seq, frame.t_capture, t_done)
        try:
            item = self.action_ring.write(chunk.t0, chunk)
        except RingClosed:
            return False
        except ValueError as err:  # schedule older than the chunk in force: never replace newer actions
            self.log.emit("chunk_rejected", frame_seq=newest.seq, error=str(err))
            return True
        self.inferences += 1
        timing = result.get("timing", {}) if isinstance(result, dict) else {}
        self.log.emit(
            "inference_done",
            frame_seq=newest.seq,
            duration_ms=(t_done - t_start) * 1000,
            wall_ms=wall_s * 1000,
            policy_timing=timing,
        )
        self.log.emit(
            "chunk_written",
            seq=item.seq,
            frame_seq=newest.seq,
            t0=chunk.t0,
            t_end=chunk.t_end,
            horizon=chunk.horizon,
            nonfinite_steps=int((~np.isfinite(actions)).any(axis=1).sum()),
        )
        self._note_if_late(item.seq, chunk)
        return True

    def _note_if_late(self, seq: int, chunk: ActionChunk) -> None:
        """A chunk ready after its last step was due, or after its frame got too old, is never executed (the output
        thread holds instead). It is still published, so no older chunk runs on, but said so: else a policy too slow
        for its schedule shows up only as a gripper that never moves."""
        done = chunk.t_inference_done
        if done >= chunk.t_end:
            reason = f"ready {(done - chunk.t_end) * 1000:.1f} ms after its last step was due"
        elif done - chunk.t_frame > self.max_action_age_s:
            reason = f"its frame is {(done - chunk.t_frame) * 1000:.1f} ms old, past max_action_age_s"
        else:
            return
        self.chunks_late += 1
        self.log.emit("chunk_late", seq=seq, frame_seq=chunk.frame_seq, reason=reason)
