"""Binary serial protocol between the host and the gripper controller (documented in docs/runtime.md).

Fixed-size frames, little-endian, CRC-8 (polynomial 0x07, init 0x00) over every byte after the sync byte:

    command (host -> gripper), 6 bytes:  0xA5 | cmd u8 | seq u8 | position u16 | crc8
    ack     (gripper -> host), 9 bytes:  0x5A | cmd|0x80 u8 | seq u8 | status u8 | position u16 | time_ms u16 | crc8

position: 0 = fully open .. 65535 = fully closed (the runtime's 0.0 .. 1.0). cmd: 0x01 SET_TARGET, 0x02 GET_STATE
(position ignored). status bits: 0x01 moving, 0x02 at target, 0x80 error (unknown command). time_ms: the device's
millisecond counter modulo 65536 when it measured the position. Distinct sync bytes per direction and the CRC let a
`FrameDecoder` resynchronise after line noise: on a CRC failure it drops only the sync byte and searches again.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum

COMMAND_SYNC = 0xA5
ACK_SYNC = 0x5A
COMMAND_LEN = 6
ACK_LEN = 9
ACK_FLAG = 0x80
POSITION_MAX = 0xFFFF

STATUS_MOVING = 0x01
STATUS_AT_TARGET = 0x02
STATUS_ERROR = 0x80


class Cmd(IntEnum):
    SET_TARGET = 0x01
    GET_STATE = 0x02


def _crc8_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
        table.append(crc)
    return table


_CRC8 = _crc8_table()


def crc8(data: bytes) -> int:
    """CRC-8/SMBUS (poly 0x07): catches every 1- and 2-bit error in these short frames, unlike a byte sum."""
    crc = 0
    for byte in data:
        crc = _CRC8[crc ^ byte]
    return crc


def position_to_u16(position: float) -> int:
    """0.0 (open) .. 1.0 (closed) to the wire's u16; refuses non-finite values (a NaN must never reach a motor)."""
    if not math.isfinite(position):
        raise ValueError(f"gripper position must be finite, got {position!r}")
    return round(min(max(position, 0.0), 1.0) * POSITION_MAX)


def u16_to_position(raw: int) -> float:
    return raw / POSITION_MAX


@dataclass(frozen=True, slots=True)
class Command:
    cmd: int
    seq: int
    position_raw: int


@dataclass(frozen=True, slots=True)
class Ack:
    cmd: int
    seq: int
    status: int
    position_raw: int
    time_ms: int

    @property
    def position(self) -> float:
        return u16_to_position(self.position_raw)


def encode_command(cmd: int, seq: int, position_raw: int = 0) -> bytes:
    body = struct.pack("<BBH", cmd, seq & 0xFF, position_raw)
    return bytes([COMMAND_SYNC]) + body + bytes([crc8(body)])


def encode_ack(cmd: int, seq: int, status: int, position_raw: int, time_ms: int) -> bytes:
    body = struct.pack("<BBBHH", (cmd | ACK_FLAG) & 0xFF, seq & 0xFF, status, position_raw, time_ms & 0xFFFF)
    return bytes([ACK_SYNC]) + body + bytes([crc8(body)])


def _parse_command(frame: bytes) -> Command:
    cmd, seq, pos = struct.unpack("<BBH", frame[1:5])
    return Command(cmd, seq, pos)


def _parse_ack(frame: bytes) -> Ack:
    cmd, seq, status, pos, time_ms = struct.unpack("<BBBHH", frame[1:8])
    return Ack(cmd & ~ACK_FLAG, seq, status, pos, time_ms)


class FrameDecoder:
    """Incremental decoder for one direction: feed raw bytes, get whole valid frames; skips and counts garbage."""

    def __init__(self, sync: int, length: int) -> None:
        self._sync = sync
        self._length = length
        self._parse = _parse_command if sync == COMMAND_SYNC else _parse_ack
        self._buffer = bytearray()
        self.skipped_bytes = 0  # bytes thrown away while searching for a valid frame
        self.crc_errors = 0

    def feed(self, data: bytes) -> list[Command | Ack]:
        self._buffer.extend(data)
        frames: list[Command | Ack] = []
        while True:
            start = self._buffer.find(self._sync)
            if start < 0:
                self.skipped_bytes += len(self._buffer)
                self._buffer.clear()
                return frames
            if start:
                self.skipped_bytes += start
                del self._buffer[:start]
            if len(self._buffer) < self._length:
                return frames
            candidate = bytes(self._buffer[: self._length])
            if crc8(candidate[1:-1]) == candidate[-1]:
                frames.append(self._parse(candidate))
                del self._buffer[: self._length]
            else:
                # A sync byte inside noise, or a corrupted frame: drop just this byte, the real frame may follow.
                self.crc_errors += 1
                self.skipped_bytes += 1
                del self._buffer[:1]

    @property
    def pending(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return len(self._buffer)


def command_decoder() -> FrameDecoder:
    return FrameDecoder(COMMAND_SYNC, COMMAND_LEN)


def ack_decoder() -> FrameDecoder:
    return FrameDecoder(ACK_SYNC, ACK_LEN)
