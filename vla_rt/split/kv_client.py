"""The robot-side end of the KV link: one connection to the prefix server, kept up, on its own thread and event loop.

Its own loop, because a KV version is tens of 256 KB frames that arrive in bursts: read, decoded, checked and
assembled on the robot's serving loop, they would sit in front of the robot's requests and answers. On this loop
they only take the GIL for a few Python lines a frame (the copies and CRCs release it), and a robot never waits.

Uplink: the newest observation waits (`offer`); one is in flight at a time and the next goes up when the KV of the
one in flight has landed (or after `in_flight_timeout_s`, or on a new connection). The prefix server is thus never
handed more than it and the link can turn into KV versions, and a robot's request never waits on any of it.
Downlink: relay frames go to `on_relay(version, actions)` as they come; KV chunks go through one `KvAssembler`
(which outlives reconnections, so versions never go backwards) and each whole version to `on_kv(CompleteKv)`.
When the server vanishes, `status()` says since when and why, and the client keeps retrying.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import websockets
from websockets.asyncio.client import connect

from vla_rt.split import messages
from vla_rt.split.kv_codec import CompleteKv, KvAssembler, KvFrameError
from vla_rt.split.kv_server import KV_PATH
from vla_rt.split.shaper import LinkProfile, ShapedSender

log = logging.getLogger("vla_rt.split")
EVENTS_KEPT = 20_000


class KvLinkClient:
    def __init__(self, address: str, layout: messages.LinkLayout, fingerprint: str, kv_format: str,
                 assembler: KvAssembler, *, on_relay: Callable[[int, np.ndarray], None], on_kv: Callable[[CompleteKv], None],
                 api_key: str | None = None, link: LinkProfile | None = None, reconnect_s: float = 0.5,
                 in_flight_timeout_s: float = 5.0, max_message_bytes: int = 16 * 2**20,
                 downlink: LinkProfile | None = None):  # fmt: skip
        self.url = f"ws://{address}{KV_PATH}"
        self.address, self.layout, self.assembler = address, layout, assembler
        self.fingerprint, self.kv_format = fingerprint, kv_format
        self._on_relay, self._on_kv = on_relay, on_kv
        self.api_key, self.link, self.reconnect_s = api_key, link or LinkProfile(), reconnect_s
        self.in_flight_timeout_s, self.max_message_bytes = in_flight_timeout_s, max_message_bytes
        self.downlink = downlink  # test hook: ask the server to shape what it sends this expert
        self._pending: tuple[int, bytes] | None = None  # newest observation not yet sent
        self._pending_lock = threading.Lock()  # `offer` comes from the robot's loop, the pump runs on the link's
        self._in_flight: tuple[int, float] | None = None  # (version, sent at)
        self._sender: ShapedSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the link's own loop, while it runs
        self._wake: asyncio.Event | None = None  # on that loop: wakes the uplink pump
        self._stop: asyncio.Event | None = None  # on that loop: ends the link
        self.connected = False
        self.since = time.monotonic()  # of the current state (connected or not)
        self.last_error = "not connected yet"
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self._receiving, self._wire_bytes = -1, 0  # the version whose chunks are arriving, its frames' bytes so far
        self._sent: deque[int] = deque(maxlen=256)  # versions this expert sent up: the only ones it accepts back

    # ----- uplink ---------------------------------------------------------------------------------------------------
    def offer(self, version: int, frame: bytes) -> None:
        """The newest observation (from any thread: the robot's serving loop); an older one still waiting is
        dropped, and so is this one if a newer one is waiting. Never blocks: it hands the frame to the link's loop."""
        with self._pending_lock:
            if self._pending is not None and self._pending[0] > version:
                return  # a newer observation is already waiting (frames are built on several threads)
            self._pending = (version, frame)
        loop = self._loop
        if loop is not None:  # else the link is not up yet: it sends what is pending once connected
            try:
                loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the link's loop has just closed
                pass

    async def _pump_uplink(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            if self._in_flight is not None and now - self._in_flight[1] > self.in_flight_timeout_s:
                log.warning("no KV for version %d within %.1f s: sending the newest observation",
                            self._in_flight[0], self.in_flight_timeout_s)  # fmt: skip
                self._in_flight = None
            with self._pending_lock:
                if self._pending is None or self._in_flight is not None or self._sender is None:
                    continue
                (version, frame), self._pending = self._pending, None
            self._in_flight = (version, now)
            self._sent.append(version)
            self.events.append({"kind": "uplink", "version": version, "t": now, "bytes": len(frame)})
            await self._sender.push(frame)

    async def _tick(self) -> None:  # re-checks the in-flight timeout even when nothing else happens
        while True:
            await asyncio.sleep(self.in_flight_timeout_s / 4)
            self._wake.set()

    # ----- downlink -------------------------------------------------------------------------------------------------
    def _on_frame(self, frame: bytes | str) -> None:
        msg = messages.decode(frame)
        now = time.monotonic()
        if msg.get("version") not in self._sent:  # e.g. a huge version would block every later one
            raise messages.LinkError(f"version: expected one this expert sent up, found {msg.get('version')!r}")
        if msg["type"] == "relay":
            version, actions = messages.parse_relay(msg, self.layout)
            self.events.append({"kind": "relay", "version": version, "t": now, "prefix_ms": msg.get("prefix_ms"),
                                "relay_ms": msg.get("relay_ms"), "server_start": msg.get("server_start")})  # fmt: skip
            self._on_relay(version, actions)
        elif msg["type"] == "kv":
            if msg.get("version") != self._receiving:
                self._receiving, self._wire_bytes = msg.get("version"), 0
                self.events.append({"kind": "kv_first", "version": self._receiving, "t": now})
            self._wire_bytes += len(frame)
            done = self.assembler.add(msg)
            if self._in_flight is not None and self.assembler.poisoned_version >= self._in_flight[0]:
                self._in_flight = None  # its KV was dropped (a bad chunk): send the newest observation now
                self._wake.set()
            if done is not None:
                done.completed_at = now
                self.events.append({"kind": "kv_complete", "version": done.version, "t": now, "format": done.fmt,
                                    "bytes": done.nbytes, "wire_bytes": self._wire_bytes})  # fmt: skip
                if self._in_flight is not None and done.version >= self._in_flight[0]:
                    self._in_flight = None
                    self._wake.set()
                self._on_kv(done)
        else:
            raise messages.LinkError(f"message type: expected 'relay' or 'kv', found {msg['type']!r}")

    # ----- the connection -------------------------------------------------------------------------------------------
    def _set(self, connected: bool, error: str = "") -> None:
        if connected != self.connected:
            self.connected, self.since = connected, time.monotonic()
        if error:
            self.last_error = error

    def status(self) -> str:
        """One line for a staleness refusal: is the prefix server there, since when."""
        ago = time.monotonic() - self.since
        if self.connected:
            return f"is connected (for {ago:.1f} s) but sent no newer KV"
        return f"is unreachable for {ago:.1f} s ({self.last_error})"

    async def _session(self) -> None:
        headers = {"Authorization": f"Api-Key {self.api_key}"} if self.api_key else None
        async with connect(self.url, additional_headers=headers, compression=None, max_size=self.max_message_bytes,
                           open_timeout=5, ping_interval=5, ping_timeout=5) as ws:  # fmt: skip
            extra = {} if self.downlink is None else {"downlink": {"latency_ms": self.downlink.latency_ms,
                                                                   "mbps": self.downlink.mbps}}  # fmt: skip
            await ws.send(messages.hello(self.layout, self.fingerprint, self.kv_format, **extra))
            reply = messages.decode(await asyncio.wait_for(ws.recv(), 10))
            messages.check_hello(reply, self.layout, self.fingerprint, "expert")
            self._sender = ShapedSender(ws.send, self.link)
            self._set(True)
            self._in_flight = None
            self.assembler.reset_staging()
            self._wake.set()
            log.info("connected to the prefix server at %s (KV as %s)", self.address, self.kv_format)
            try:
                async for frame in ws:
                    self._on_frame(frame)
            except asyncio.CancelledError:  # stopping: say goodbye instead of leaving with 1011
                await asyncio.shield(ws.close(1001, "the expert is stopping"))
                raise
            finally:
                await self._sender.close()
                self._sender = None

    async def serve(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        """Keeps the link up until `stop` is set (the signature of a server, so `SplitServers` runs it beside the
        robot's `PolicyServer`), on a thread and event loop of its own (why: the module's doc); `ready` is set at
        once: robots are served with or without it. Raises what stopped the link, if anything but `stop` did."""
        started, done = threading.Event(), concurrent.futures.Future()
        threading.Thread(target=self._run, args=(started, done), name="vla-rt-kv-link", daemon=True).start()
        await asyncio.to_thread(started.wait)
        if ready is not None:
            ready.set()
        finished, stopping = asyncio.wrap_future(done), asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([finished, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            self._halt()
            if not stop.is_set() and not finished.done():  # cancelled: the thread ends by itself; this loop may not
                finished.cancel()  # outlive it, and a cancelled wrapper is not resolved on a closed loop
        await finished

    def _halt(self) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # its loop has closed already
                pass

    def _run(self, started: threading.Event, done: concurrent.futures.Future) -> None:
        """The link's thread: its own event loop until `_stop`; the outcome goes to `done`."""

        async def link() -> None:
            self._wake, self._stop = asyncio.Event(), asyncio.Event()
            self._loop = asyncio.get_running_loop()
            started.set()
            await self._keep_up(self._stop)

        try:
            asyncio.run(link())
            done.set_result(None)
        except BaseException as e:  # handed to `serve`, on the robot's loop
            done.set_exception(e)
        finally:
            self._loop = None
            started.set()

    async def _keep_up(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._pump_uplink()), asyncio.create_task(self._tick())]
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                session = asyncio.create_task(self._session())
                await asyncio.wait([session, stopping], return_when=asyncio.FIRST_COMPLETED)
                if not session.done():
                    session.cancel()
                    await asyncio.gather(session, return_exceptions=True)
                    break
                try:
                    session.result()
                    self._set(False, "the server closed the link")
                except (OSError, websockets.WebSocketException, TimeoutError) as e:
                    self._set(False, f"{type(e).__name__}: {e}".strip())
                except (messages.LinkError, KvFrameError) as e:  # a protocol fault: say it, retry slowly
                    log.error("KV link to %s: %s", self.address, e)
                    self._set(False, str(e))
                    await self._sleep(stop, 10 * self.reconnect_s)
                if not stop.is_set():
                    await self._sleep(stop, self.reconnect_s)
        finally:
            for t in (*tasks, stopping):
                t.cancel()
            await asyncio.gather(*tasks, stopping, return_exceptions=True)

    @staticmethod
    async def _sleep(stop: asyncio.Event, seconds: float) -> None:
        try:
            await asyncio.wait_for(stop.wait(), seconds)
        except TimeoutError:
            pass
