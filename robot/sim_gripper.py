"""A simulated gripper controller on a pseudo-terminal, speaking the real protocol (robot/gripper_protocol.py).

The host side opens `SimGripper.port` with pyserial exactly as it would open /dev/ttyUSB0, so the code under test is
the real `SerialGripper`. `port` is a stable symlink to the pty's slave (like /dev/serial/by-id/...), which lets a
test unplug the device (the pty disappears, host I/O fails) and plug it back in (a new pty behind the same path).
The jaw physics (`JawDynamics`) runs on an injectable clock; commands are stamped when the device decodes them.
"""

from __future__ import annotations

import os
import select
import tempfile
import threading
import tty
from dataclasses import dataclass
from pathlib import Path

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.robot.gripper_protocol import (
    STATUS_AT_TARGET,
    STATUS_ERROR,
    STATUS_MOVING,
    Cmd,
    Command,
    command_decoder,
    encode_ack,
    position_to_u16,
    u16_to_position,
)
from vla_rt.robot.jaw_dynamics import JawDynamics


@dataclass
class SimGripperConfig:
    closing_time_s: float = 0.060
    initial_position: float = 0.0
    link_dir: str | None = None  # folder for the stable port symlink; a fresh temp dir if None


class SimGripper:
    """Device thread + pty + jaw physics. Use as a context manager or call start()/stop()."""

    def __init__(self, config: SimGripperConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or SimGripperConfig()
        self.clock = clock if clock is not None else MonotonicClock()
        self.jaws = JawDynamics(self.config.closing_time_s, self.config.initial_position, self.clock)
        self._dir = Path(self.config.link_dir or tempfile.mkdtemp(prefix="simgripper-"))
        self.port = str(self._dir / "ttySIMGRIPPER")
        self.received: list[tuple[float, Command]] = []  # every valid command, with its decode time
        self.muted = False  # True: read and drop commands without acting or answering (a hung controller)
        self._decoder = command_decoder()
        self._master: int | None = None
        self._slave: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._requests: list[tuple[str, bytes]] = []
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> SimGripper:
        self._open_pty()
        self._thread = threading.Thread(target=self._serve, name="sim-gripper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5.0)
        self._close_pty()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def __enter__(self) -> SimGripper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- fault injection (executed by the device thread, which owns the fds) --------------------------------------
    def unplug(self) -> None:
        """Pull the cable: the pty and the port path vanish; host reads/writes fail."""
        self._request("unplug")

    def replug(self) -> None:
        """Plug back in: a fresh pty behind the same `port` path."""
        self._request("replug")

    def inject_garbage(self, data: bytes) -> None:
        """Write raw bytes toward the host (line noise between acks)."""
        self._request("garbage", data)

    def _request(self, what: str, data: bytes = b"") -> None:
        with self._lock:
            self._done.clear()
            self._requests.append((what, data))
        os.write(self._wake_w, b"x")
        if not self._done.wait(5.0):
            raise RuntimeError(f"sim gripper did not execute {what!r}")

    # --- physics queries ------------------------------------------------------------------------------------------
    def position_at(self, t: float) -> float:
        return self.jaws.position_at(t)

    @property
    def garbage_bytes_seen(self) -> int:
        """Bytes the device skipped while resynchronising on the host->device line."""
        return self._decoder.skipped_bytes

    # --- internals --------------------------------------------------------------------------------------------------
    def _open_pty(self) -> None:
        self._master, self._slave = os.openpty()
        tty.setraw(self._slave)  # no echo or line editing before pyserial configures its side
        # Keep our slave fd open so the master never sees EIO while the host reopens the port.
        tmp_link = self.port + ".new"
        os.symlink(os.ttyname(self._slave), tmp_link)
        os.replace(tmp_link, self.port)

    def _close_pty(self) -> None:
        if os.path.lexists(self.port):
            os.unlink(self.port)
        for fd in (self._master, self._slave):
            if fd is not None:
                os.close(fd)
        self._master = self._slave = None

    def _serve(self) -> None:
        while not self._stop:
            fds = [self._wake_r] + ([self._master] if self._master is not None else [])
            readable, _, _ = select.select(fds, [], [], 0.5)
            if self._wake_r in readable:
                os.read(self._wake_r, 64)
                self._run_requests()
            if self._master is not None and self._master in readable:
                try:
                    data = os.read(self._master, 4096)
                except OSError:
                    continue
                self._handle(data)

    def _run_requests(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for what, data in requests:
            if what == "unplug":
                self._close_pty()
            elif what == "replug" and self._master is None:
                self._open_pty()
            elif what == "garbage" and self._master is not None:
                os.write(self._master, data)
        if requests:
            self._done.set()

    def _handle(self, data: bytes) -> None:
        for command in self._decoder.feed(data):
            now = self.clock.now()
            self.received.append((now, command))
            if self.muted:
                continue
            status = 0
            if command.cmd == Cmd.SET_TARGET:
                self.jaws.command(u16_to_position(command.position_raw), now)
            elif command.cmd != Cmd.GET_STATE:
                status |= STATUS_ERROR
            position = self.jaws.position_at(now)
            target = self.jaws.target_at(now)
            status |= STATUS_AT_TARGET if abs(position - target) < 1e-9 else STATUS_MOVING
            ack = encode_ack(command.cmd, command.seq, status, position_to_u16(position), int(now * 1000))
            try:
                os.write(self._master, ack)
            except OSError:
                pass  # host gone; nothing to answer
