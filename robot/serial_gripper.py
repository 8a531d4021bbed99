"""Host side of the gripper link: `SerialGripper` over pyserial (protocol in robot/gripper_protocol.py).

Every command waits for its ack (matched by sequence number), so the caller always knows what the device measured
and a dead link is noticed at the next command. Failures raise exceptions that name the port and what happened:
`GripperTimeout` (no ack in time), `GripperDisconnected` (the port failed or vanished). After a disconnect, each later
command first makes one reconnect attempt, spaced by exponential backoff on the injectable clock, so a control loop
keeps its rate while the cable is out and resumes by itself when it is back.

The ack wait is real I/O and uses real time (`time.monotonic`), also under a SimClock, where it costs no simulated
time; backoff spacing uses the injectable clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import serial

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.robot.backoff import ReconnectBackoff
from vla_rt.robot.gripper import GripperDisconnected, GripperError, GripperState, GripperTimeout
from vla_rt.robot.gripper_protocol import (
    STATUS_AT_TARGET,
    STATUS_ERROR,
    STATUS_MOVING,
    Cmd,
    ack_decoder,
    encode_command,
    position_to_u16,
)

EventSink = Callable[..., Any]


@dataclass
class SerialGripperConfig:
    port: str = "/dev/ttyUSB0"
    baudrate: int = 115200
    ack_timeout_s: float = 0.05  # real seconds to wait for an ack
    retries: int = 0  # resends after an ack timeout before GripperTimeout
    reconnect_backoff_s: float = 0.05  # first wait before a reconnect attempt; doubles per failure
    reconnect_backoff_max_s: float = 1.0
    max_reconnect_attempts: int | None = None  # None: keep trying; else GripperDisconnected(permanent=True)


class GripperProtocolError(GripperError):
    """The device answered with its error status."""


class SerialGripper:
    """Gripper controller on a serial port; one thread uses it at a time (the runtime's output thread)."""

    def __init__(
        self, config: SerialGripperConfig, clock: Clock | None = None, on_event: EventSink | None = None
    ) -> None:
        self.config = config
        self.clock = clock if clock is not None else MonotonicClock()
        self.on_event = on_event or (lambda *a, **k: None)
        self._serial: serial.Serial | None = None
        self._decoder = ack_decoder()
        self._seq = 0
        self._backoff = ReconnectBackoff(config)
        self.last_state: GripperState | None = None
        self.counters = {
            "sent": 0,
            "acks": 0,
            "timeouts": 0,
            "stale_acks": 0,
            "disconnects": 0,
            "reconnect_attempts": 0,
            "reconnects": 0,
        }

    @property
    def port(self) -> str:
        return self.config.port

    @property
    def is_connected(self) -> bool:
        return self._serial is not None

    @property
    def garbage_bytes_skipped(self) -> int:
        return self._decoder.skipped_bytes

    @property
    def crc_errors(self) -> int:
        return self._decoder.crc_errors

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open the port; raises GripperDisconnected naming the port if it cannot.

        The port is locked (`exclusive`): a second host on one gripper (another run left going, a second terminal)
        would interleave its commands with ours and could read our acks, so it is refused as busy instead."""
        if self._serial is not None:
            return
        try:
            self._serial = serial.Serial(
                self.config.port,
                self.config.baudrate,
                timeout=min(0.005, self.config.ack_timeout_s),
                write_timeout=1.0,
                exclusive=True,
            )
        except (serial.SerialException, OSError) as err:
            busy = " (busy: another process has it open)" if "exclusively lock" in str(err) else ""
            raise GripperDisconnected(self.port, f"cannot open serial port{busy} ({err})") from err
        self._decoder = ack_decoder()

    def disconnect(self) -> None:
        if self._serial is not None:
            try:
                self._serial.close()
            except (serial.SerialException, OSError):
                pass
            self._serial = None

    # --- commands -------------------------------------------------------------------------------------------------
    def send_target(self, position: float) -> GripperState:
        """Command the jaw target (0 open .. 1 closed; non-finite raises ValueError before anything is sent)."""
        return self._transact(Cmd.SET_TARGET, position_to_u16(position))

    def read_state(self) -> GripperState:
        return self._transact(Cmd.GET_STATE, 0)

    def _transact(self, cmd: Cmd, position_raw: int) -> GripperState:
        if self._serial is None:
            self._reconnect()
        for attempt in range(self.config.retries + 1):
            self._seq = (self._seq + 1) & 0xFF
            try:
                state = self._exchange(cmd, self._seq, position_raw)
            except (serial.SerialException, OSError) as err:
                raise self._lost(err) from err
            if state is not None:
                return state
            self.counters["timeouts"] += 1
            self.on_event("ack_timeout", port=self.port, cmd=cmd.name, seq=self._seq, attempt=attempt)
        raise GripperTimeout(
            self.port,
            f"no ack for {cmd.name} seq={self._seq} within {self.config.ack_timeout_s * 1000:.0f} ms "
            f"({self.config.retries + 1} attempt(s))",
        )

    def _exchange(self, cmd: Cmd, seq: int, position_raw: int) -> GripperState | None:
        """Write one command and read until its ack (None on timeout). Serial errors propagate."""
        link = self._serial
        t_sent = self.clock.now()
        link.write(encode_command(cmd, seq, position_raw))
        self.counters["sent"] += 1
        deadline = time.monotonic() + self.config.ack_timeout_s
        while time.monotonic() < deadline:
            chunk = link.read(max(1, link.in_waiting))
            for ack in self._decoder.feed(chunk):
                if ack.seq != seq or ack.cmd != cmd:
                    self.counters["stale_acks"] += 1  # answer to an earlier, timed-out command
                    continue
                if ack.status & STATUS_ERROR:
                    raise GripperProtocolError(self.port, f"device reported an error for {cmd.name} seq={seq}")
                self.counters["acks"] += 1
                self.last_state = GripperState(
                    position=ack.position,
                    moving=bool(ack.status & STATUS_MOVING),
                    at_target=bool(ack.status & STATUS_AT_TARGET),
                    seq=seq,
                    t_sent=t_sent,
                    t_ack=self.clock.now(),
                    device_time_ms=ack.time_ms,
                )
                return self.last_state
        return None

    # --- link loss and recovery ---------------------------------------------------------------------------------------
    def _lost(self, err: Exception) -> GripperDisconnected:
        """Close the dead port, schedule the first reconnect attempt; returns the exception to raise."""
        self.disconnect()
        self.counters["disconnects"] += 1
        self._backoff.lost(self.clock.now())
        self.on_event("serial_disconnected", port=self.port, error=str(err))
        return GripperDisconnected(
            self.port, f"serial link lost ({err}); reconnecting in {self._backoff.delay_s * 1000:.0f} ms"
        )

    def _reconnect(self) -> None:
        """One reconnect attempt if the backoff allows it; raises GripperDisconnected unless it succeeds."""
        backoff = self._backoff
        if backoff.gave_up():
            raise GripperDisconnected(
                self.port, f"disconnected; gave up after {backoff.attempts} reconnect attempts", True
            )
        now = self.clock.now()
        if backoff.wait_s(now) > 0:
            raise GripperDisconnected(
                self.port, f"disconnected; next reconnect attempt in {backoff.wait_s(now) * 1000:.0f} ms"
            )
        self.counters["reconnect_attempts"] += 1
        attempt = backoff.attempt()
        try:
            self.connect()
        except GripperDisconnected as err:
            backoff.failed(now)
            self.on_event("reconnect_failed", port=self.port, attempt=attempt, error=str(err))
            raise GripperDisconnected(
                self.port,
                f"reconnect attempt {attempt} failed ({err.__cause__}); next in {backoff.delay_s * 1000:.0f} ms",
            ) from err
        self.counters["reconnects"] += 1
        backoff.succeeded()
        self.on_event("reconnected", port=self.port, attempt=attempt)
