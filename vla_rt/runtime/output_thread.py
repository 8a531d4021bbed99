"""Output thread: at the control rate, send the gripper the action that is due now, and nothing unsafe.

Each tick looks up the chunk in force (`action_ring.at(now)`) and its step due now. What it sends:

* a fresh, finite action -> that action (clipped to the actuator range); it becomes the command to hold;
* no chunk covering now, or one whose frame is older than `max_action_age_s` -> the last command again ("hold"),
  with `gap_start` / `gap_end` logged once per gap;
* a non-finite action -> logged once per (chunk, step), skipped, the last command held; after `nan_limit` distinct
  non-finite actions in a row the runtime stops safely (`safe_stop`: the configured safe command, then no more).

A NaN can never reach the wire: targets only ever come from finite values and the encoder refuses non-finite ones.
Serial trouble (ack timeout, unplugged port) is logged and the loop keeps its rate; `SerialGripper` reconnects with
backoff on later ticks. With `on_disconnect="stop"` a lost link stops the runtime instead.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from vla_rt.clock import Clock
from vla_rt.robot.gripper import Gripper, GripperDisconnected, GripperError, GripperTimeout
from vla_rt.runtime.actions import ActionChunk
from vla_rt.runtime.events import EventLog
from vla_rt.runtime.ring import TimestampedRing


class OutputLoop:
    def __init__(
        self,
        gripper: Gripper,
        action_ring: TimestampedRing[ActionChunk],
        log: EventLog,
        clock: Clock,
        stop: threading.Event,
        request_stop: Callable[[str], None],
        *,
        control_hz: float,
        max_action_age_s: float,
        initial_action: float,
        action_range: tuple[float, float],
        action_index: int,
        nan_limit: int,
        safe_action: float | None,
        on_disconnect: str,
    ) -> None:
        if on_disconnect not in ("reconnect", "stop"):
            raise ValueError(f"on_disconnect must be 'reconnect' or 'stop', got {on_disconnect!r}")
        self.gripper = gripper
        self.action_ring = action_ring
        self.log = log
        self.clock = clock
        self.stop = stop
        self.request_stop = request_stop
        self.period_s = 1.0 / control_hz
        self.max_action_age_s = max_action_age_s
        self.action_range = action_range
        self.action_index = action_index
        self.nan_limit = nan_limit
        self.safe_action = safe_action
        self.on_disconnect = on_disconnect
        self.hold_target = float(initial_action)  # last finite command chosen; what a gap or a NaN holds
        self.position = float(initial_action)  # last measured jaw position (observation state)
        self.mode = "init"  # "init" (no chunk yet) | "chunk" | "gap" | "safe_stop"
        self._gap_since = 0.0
        self._nan_seen: set[tuple[int, int]] = set()
        self._nan_streak = 0
        self._link_down_since: float | None = None
        self.counters = {"ticks": 0, "commands": 0, "acked": 0, "holds": 0, "gaps": 0, "nan_actions": 0}
        self.counters.update({"clipped": 0, "overruns": 0, "serial_timeouts": 0, "link_losses": 0})

    def run(self) -> None:
        next_tick = self.clock.now()
        while not self.stop.is_set():
            self.clock.sleep_until(next_tick)
            if self.stop.is_set():
                return
            now = self.clock.now()
            self.counters["ticks"] += 1
            decision = self._decide(now)
            if decision is None:  # safe stop
                return
            self._send(*decision)
            next_tick += self.period_s
            late = self.clock.now() - next_tick
            if late >= 0:  # missed whole ticks (slow serial, loaded CPU): skip them rather than burst
                missed = math.floor(late / self.period_s) + 1
                self.counters["overruns"] += missed
                self.log.emit("control_overrun", missed_ticks=missed)
                next_tick += missed * self.period_s

    # --- what to send --------------------------------------------------------------------------------------------
    def _decide(self, now: float) -> tuple[float, str, dict[str, Any]] | None:
        item = self.action_ring.at(now)
        chunk = item.value if item is not None else None
        step = chunk.step_at(now) if chunk is not None else None
        if step is None or now - chunk.t_frame > self.max_action_age_s:
            return self._hold(now, "no chunk covers now" if step is None else "chunk too old")
        if self.mode == "gap":
            self.log.emit("gap_end", duration_ms=(now - self._gap_since) * 1000, chunk_seq=item.seq)
        self.mode = "chunk"
        action = chunk.actions[step]
        if not np.all(np.isfinite(action)):
            return self._non_finite(item.seq, step, action)
        self._nan_streak = 0
        value = float(action[self.action_index])
        low, high = self.action_range
        if not low <= value <= high:
            self.counters["clipped"] += 1
            value = min(max(value, low), high)
        self.hold_target = value
        return value, "chunk", {"chunk_seq": item.seq, "step": step}

    def _hold(self, now: float, reason: str) -> tuple[float, str, dict[str, Any]]:
        if self.mode == "chunk":
            self.mode = "gap"
            self._gap_since = now
            self.counters["gaps"] += 1
            self.log.emit("gap_start", reason=reason, hold_target=self.hold_target)
        self.counters["holds"] += 1
        return self.hold_target, "hold" if self.mode == "gap" else "init", {}

    def _non_finite(self, chunk_seq: int, step: int, action: np.ndarray) -> tuple[float, str, dict[str, Any]] | None:
        key = (chunk_seq, step)
        if key not in self._nan_seen:  # a step is due for several ticks; count and log it once
            self._nan_seen.add(key)
            self._nan_streak += 1
            self.counters["nan_actions"] += 1
            self.log.emit("nan_action", chunk_seq=chunk_seq, step=step, action=action, streak=self._nan_streak)
            if self._nan_streak >= self.nan_limit:
                self._safe_stop(f"{self._nan_streak} non-finite actions in a row")
                return None
        self.counters["holds"] += 1
        return self.hold_target, "hold_nan", {"chunk_seq": chunk_seq, "step": step}

    def _safe_stop(self, reason: str) -> None:
        self.mode = "safe_stop"
        self.log.emit("safe_stop", reason=reason, safe_action=self.safe_action)
        if self.safe_action is not None:
            self._send(float(self.safe_action), "safe", {})
        self.request_stop(reason)

    # --- how it is sent ----------------------------------------------------------------------------------------------
    def _send(self, target: float, source: str, info: dict[str, Any]) -> None:
        try:
            state = self.gripper.send_target(target)
        except GripperTimeout as err:
            self.counters["serial_timeouts"] += 1
            self.counters["commands"] += 1  # the bytes went out; only the ack is missing
            self.log.emit("command_sent", target=target, source=source, acked=False, **info)
            self.log.emit("serial_timeout", error=str(err))
            return
        except GripperDisconnected as err:
            if self._link_down_since is None:
                self._link_down_since = self.clock.now()
                self.counters["link_losses"] += 1
                self.log.emit("serial_link_down", error=str(err))
            if (err.permanent or self.on_disconnect == "stop") and self.mode != "safe_stop":
                self.mode = "safe_stop"
                self.log.emit("safe_stop", reason=f"gripper link lost: {err}", safe_action=None)
                self.request_stop("gripper link lost")
            return
        except GripperError as err:
            self.log.emit("gripper_error", error=str(err))
            return
        if self._link_down_since is not None:
            self.log.emit("serial_link_up", down_ms=(self.clock.now() - self._link_down_since) * 1000)
            self._link_down_since = None
        self.position = state.position
        self.counters["commands"] += 1
        self.counters["acked"] += 1
        self.log.emit("command_sent", t=state.t_sent, target=target, source=source, acked=True, seq=state.seq, **info)
        self.log.emit(
            "ack_received",
            t=state.t_ack,
            seq=state.seq,
            position=state.position,
            moving=state.moving,
            rtt_ms=(state.t_ack - state.t_sent) * 1000,
        )
