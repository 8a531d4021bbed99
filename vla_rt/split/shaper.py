"""A slow link on a fast one: latency and bandwidth applied to the frames one side of the KV link sends.

The test hook of the transport (`--link-latency-ms`, `--link-mbps`; also what the tests and the benchmark use over
real loopback sockets). A frame of n bytes occupies the link for 8n / bandwidth seconds after the previous one
leaves it, then arrives `latency` later; frames keep their order and the link stays pipelined (a 20 ms latency
delays every frame by 20 ms, it does not cap the rate at one frame per 20 ms). The sender never blocks: frames are
queued with their delivery time, and one task sends each when it is due.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    latency_ms: float = 0.0
    mbps: float | None = None  # None: as fast as the socket

    def __post_init__(self) -> None:
        # finite too: a NaN passed `< 0` / `<= 0` and made every frame's due time NaN
        latency_ok = math.isfinite(self.latency_ms) and self.latency_ms >= 0
        if not latency_ok or (self.mbps is not None and not (math.isfinite(self.mbps) and self.mbps > 0)):
            raise ValueError(f"link: expected latency >= 0 ms and bandwidth > 0 Mb/s, found {self.latency_ms} ms, "
                             f"{self.mbps} Mb/s")  # fmt: skip

    @property
    def shaped(self) -> bool:
        return self.latency_ms > 0 or self.mbps is not None

    def transfer_s(self, nbytes: int) -> float:
        """Time on the wire of `nbytes` (no latency)."""
        return 0.0 if self.mbps is None else nbytes * 8 / (self.mbps * 1e6)


class ShapedSender:
    """Sends frames through `send` as if over a link of `profile`; use `await push(frame)` and `close()`."""

    def __init__(self, send: Callable[[bytes | str], Awaitable[None]], profile: LinkProfile | None = None):
        self._send, self.profile = send, profile or LinkProfile()
        self._queue: asyncio.Queue[tuple[float, bytes | str] | None] = asyncio.Queue()
        self._free_at = 0.0  # when the link has finished putting the previous frame on the wire
        self._task = asyncio.create_task(self._pump()) if self.profile.shaped else None
        self.error: BaseException | None = None

    async def push(self, frame: bytes | str) -> None:
        if self.error is not None:
            raise self.error
        if self._task is None:
            await self._send(frame)
            return
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + self.profile.transfer_s(len(frame))
        await self._queue.put((self._free_at + self.profile.latency_ms / 1e3, frame))

    async def _pump(self) -> None:
        while (item := await self._queue.get()) is not None:
            due, frame = item
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await self._send(frame)
            except BaseException as e:  # the connection is gone: the next push says so
                self.error = e
                return

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
