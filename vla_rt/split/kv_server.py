"""The prefix server's KV link: robot-side experts subscribe over a websocket, send observations up, get relay chunks
and KV versions down.

`ws://host:kv_port/kv`. The first frame each way is a hello (`messages.py`): protocol, checkpoint fingerprint, the
shapes that make a KV version meaningful, and the KV format the expert asked for; a mismatch is one text frame naming
the field, then close 1008. After that the expert sends `obs` frames and the server answers each (newest first, one
job per expert queued at a time) with a relay frame, then the KV chunks, through a `ShapedSender` (the slow-link test
hook, a no-op by default). `GET /healthz` answers 200; `Authorization: Api-Key <key>` is checked when a key is set.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus

import websockets
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from vla_rt.split import messages
from vla_rt.split.prefix_service import PrefixJob, PrefixService
from vla_rt.split.shaper import LinkProfile, ShapedSender

log = logging.getLogger("vla_rt.split")
KV_PATH = "/kv"
CLOSE_POLICY, CLOSE_BAD_DATA = 1008, 1003
HELLO_TIMEOUT_S = 10.0


class KvLinkServer:
    def __init__(self, service: PrefixService, layout: messages.LinkLayout, fingerprint: str, *, host: str = "127.0.0.1",
                 port: int = 8001, api_key: str | None = None, link: LinkProfile | None = None,
                 max_message_bytes: int = 16 * 2**20,
                 frame_hook: Callable[[list[bytes]], list[bytes]] | None = None):  # fmt: skip
        self.service, self.layout, self.fingerprint = service, layout, fingerprint
        self.host, self.port, self.api_key, self.max_message_bytes = host, port, api_key, max_message_bytes
        self.link = link or LinkProfile()
        self.frame_hook = frame_hook  # test hook: reorder / corrupt / duplicate the frames of each delivery
        self._ids = itertools.count(1)
        self.subscribers = 0

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?")[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        if self.api_key is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Api-Key {self.api_key}".encode()):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "Authorization: expected 'Api-Key <the server's "
                                          "key>', found " + ("none" if not sent else "a different key") + "\n")  # fmt: skip
        if path != KV_PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, f"path: expected {KV_PATH} (the KV link) or /healthz, "
                                                            f"found {path}\n")  # fmt: skip
        return None

    def _downlink(self, asked: object) -> LinkProfile:
        """The link shaping a subscriber asked for in its hello (a test hook: it only slows its own link)."""
        if asked is None:
            return self.link
        try:
            return LinkProfile(float(asked["latency_ms"]), None if asked["mbps"] is None else float(asked["mbps"]))
        except (TypeError, KeyError, ValueError) as e:
            raise messages.LinkError(
                f"hello.downlink: expected {{latency_ms: >= 0, mbps: > 0 or null}}, found {asked!r} ({e})"
            ) from None

    async def _handler(self, ws: ServerConnection) -> None:
        try:
            first = messages.decode(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S))
            kv_format = messages.check_hello(first, self.layout, self.fingerprint, "prefix server")
            link = self._downlink(first.get("downlink"))
        except (messages.LinkError, TimeoutError) as e:
            text = str(e) or f"hello: expected one within {HELLO_TIMEOUT_S:g} s, found none"
            log.info("refused a subscriber from %s: %s", ws.remote_address, text)
            await ws.send(text)
            await ws.close(CLOSE_POLICY, text[:120])
            return
        except websockets.ConnectionClosed:
            return
        await ws.send(messages.hello(self.layout, self.fingerprint, kv_format, dtype=str(self.service.engine.dtype)))
        sub = next(self._ids)
        self.subscribers += 1
        log.info("expert %d subscribed from %s (KV as %s)", sub, ws.remote_address, kv_format)
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        sender = ShapedSender(ws.send, link)

        def deliver(frames: list[bytes]) -> None:  # on the prefix worker thread
            try:
                loop.call_soon_threadsafe(outbox.put_nowait, frames)
            except RuntimeError:  # the loop is gone
                pass

        async def write() -> None:
            while True:
                frames = await outbox.get()
                for frame in frames if self.frame_hook is None else self.frame_hook(frames):
                    await sender.push(frame)

        writer = asyncio.create_task(write())
        outcome = "closed by the expert"
        try:
            async for frame in ws:
                try:
                    msg = messages.decode(frame)
                    if msg["type"] != "obs":
                        raise messages.LinkError(f"message type: expected 'obs', found {msg['type']!r}")
                    version, t_capture, x, noise = self.service.parse(msg, self.layout)
                except messages.LinkError as e:
                    outcome = f"bad message: {e}"
                    await ws.send(str(e))
                    await ws.close(CLOSE_BAD_DATA, str(e)[:120])
                    break
                self.service.submit(sub, PrefixJob(version, t_capture, x, noise, kv_format, deliver))
        except websockets.ConnectionClosed as e:
            outcome = f"connection lost ({e})"
        finally:
            self.service.forget(sub)
            writer.cancel()
            await sender.close()
            self.subscribers -= 1
            log.info("expert %d left: %s", sub, outcome)

    async def serve(self, stop: asyncio.Event, ready: threading.Event | None = None) -> None:
        async with serve(self._handler, self.host, self.port, compression=None, max_size=self.max_message_bytes,
                         process_request=self._process_request) as server:  # fmt: skip
            self.port = server.sockets[0].getsockname()[1]
            log.info("KV link on ws://%s:%d%s", self.host, self.port, KV_PATH)
            if ready is not None:
                ready.set()
            await stop.wait()
