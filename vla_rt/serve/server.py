"""`vla-rt serve`'s network front end: openpi's websocket protocol over `websockets`, many robots at once.

The handshake hook answers `GET /healthz` (200) and `GET /metrics` (Prometheus text), checks
`Authorization: Api-Key <key>` (HTTP 401), and runs SLO admission (HTTP 503 with the reason as the body; openpi's
client raises at once instead of retrying). An admitted connection gets the metadata frame, then each binary frame
is decoded (`wire.py`), validated and prepared, and queued for the GPU worker. A reader and a writer task per
connection keep frames and answers in order while a robot's next observation can already wait in the queue (where
it replaces an older queued one). Bad input ends the connection with a one-line text frame (key, expected, found)
and close code 1003; a server fault with 1011; a frame over `--max-message-mb` with 1009 (refused by `websockets`
from the frame header, before the payload is read). Tracebacks go only to the server log.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import websockets
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from vla_rt.errors import ArgumentError
from vla_rt.serve.metrics import CONTENT_TYPE
from vla_rt.serve.service import CLOSE_BAD_DATA, CLOSE_INTERNAL, CLOSE_TOO_BIG, RequestError, RobotService, Ticket
from vla_rt.serve.wire import WireError, pack, unpack_observation

log = logging.getLogger("vla_rt.serve")
INTERNAL_ERROR = "internal server error (see the server log)"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_message_bytes: int = 10 * 2**20
    warm_lead_ms: float = 0.0  # > 0: rehearse a robot's host steps this long before its next frame (`_rehearse`)


@dataclass
class _Robot:
    id: int
    remote: str
    requests: int = 0
    since: float = field(default_factory=time.monotonic)
    send_ms: float | None = None  # the last answer's encode + send (reported in the next answer's timing)
    rate_hz: float | None = None  # its declared request rate (`?hz=`), None: the service's default
    rehearsal: asyncio.TimerHandle | None = None  # the pending rehearsal of its host steps (`warm_lead_ms`)


def parse_rate(query: str) -> float | None:
    """A robot's declared request rate from its URI query (`ws://host:port/?hz=10`); None when not given."""
    values = parse_qs(query).get("hz")
    if not values:
        return None
    try:
        rate = float(values[-1])
    except ValueError:
        raise ValueError(f"hz: expected a request rate in Hz, found {values[-1]!r}") from None
    if not 0 < rate <= 1000:
        raise ValueError(f"hz: expected a request rate in (0, 1000] Hz, found {rate:g}")
    return rate


class PolicyServer:
    """Serves a `RobotService` over websockets. `serve()` runs until `stop` is set; `run_in_thread()` for tests."""

    def __init__(self, service: RobotService, options: ServerOptions = ServerOptions()):
        if options.warm_lead_ms > 0 and not callable(getattr(service, "rehearse", None)):
            raise ValueError(f"warm_lead_ms: expected 0 for a {type(service).__name__} (it has no host steps to "
                             f"rehearse), found {options.warm_lead_ms}")  # fmt: skip
        self.service, self.options = service, options
        self._robots: dict[object, _Robot] = {}  # connection id -> robot, from admission to the handler's end
        self.port: int | None = None

    # ----- handshake ----------------------------------------------------------------------------------------------
    def _plain(self, connection: ServerConnection, status: HTTPStatus, text: str) -> Response:
        return connection.respond(status, text if text.endswith("\n") else text + "\n")

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path == "/healthz":
            return self._plain(connection, HTTPStatus.OK, "OK")
        key = self.options.api_key
        if key is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Api-Key {key}".encode()):
                self.service.metrics.errors.labels("auth").inc()
                found = "no Authorization header" if not sent else "a different key"
                log.info("refused %s: wrong API key (%s)", connection.remote_address, found)
                return self._plain(connection, HTTPStatus.UNAUTHORIZED,
                                   f"Authorization: expected 'Api-Key <the server's key>', found {found}")  # fmt: skip
        if url.path == "/metrics":
            response = self._plain(connection, HTTPStatus.OK, "")
            response.body = self.service.metrics.render()
            for name, value in (("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(response.body)))):
                del response.headers[name]
                response.headers[name] = value
            return response
        if url.path not in ("", "/"):
            return self._plain(connection, HTTPStatus.NOT_FOUND, f"path: expected / (websocket), /healthz or "
                               f"/metrics, found {url.path}")  # fmt: skip
        try:
            rate = parse_rate(url.query)
        except ValueError as e:
            return self._plain(connection, HTTPStatus.BAD_REQUEST, str(e))
        robot, decision = self.service.connect(rate)
        if robot is None:
            log.info("refused robot from %s: %s", connection.remote_address, decision.message)
            return self._plain(connection, HTTPStatus.SERVICE_UNAVAILABLE, decision.message)
        self._robots[connection.id] = _Robot(robot, _address(connection), rate_hz=rate)
        log.info("robot %d connected from %s (%s)", robot, _address(connection), decision.message)
        return None

    def _process_response(self, connection: ServerConnection, request: Request, response: Response) -> None:
        if response.status_code != HTTPStatus.SWITCHING_PROTOCOLS and connection.id in self._robots:
            self._release(connection)  # admitted, then the handshake failed: the handler will never run

    def _release(self, connection: ServerConnection) -> _Robot | None:
        robot = self._robots.pop(connection.id, None)
        if robot is not None:
            self.service.disconnect(robot.id)
        return robot

    # ----- connection ---------------------------------------------------------------------------------------------
    async def _handler(self, ws: ServerConnection) -> None:
        robot = self._robots[ws.id]
        answers: asyncio.Queue = asyncio.Queue()
        writer = asyncio.create_task(self._write(ws, robot, answers))
        outcome = "closed by the robot"
        try:
            await ws.send(pack(self.service.metadata(robot.id)))
            outcome, bad_input = await self._read(ws, robot, answers)
            if bad_input:  # the writer answers what came before, sends the error and closes
                await writer
        except websockets.ConnectionClosed as e:
            outcome = self._closed(e)
        finally:
            writer.cancel()
            if robot.rehearsal is not None:
                robot.rehearsal.cancel()
            self._release(ws)
            seconds = time.monotonic() - robot.since
            log.info("robot %d (%s) disconnected after %d answers in %.1f s: %s", robot.id, robot.remote,
                     robot.requests, seconds, outcome)  # fmt: skip

    async def _read(self, ws: ServerConnection, robot: _Robot, answers: asyncio.Queue) -> tuple[str, bool]:
        """Frames -> queued tickets (in order) until the robot leaves or sends bad input: (how it ended, bad input)."""
        try:
            async for frame in ws:
                received = time.monotonic()
                try:
                    if isinstance(frame, str):
                        raise RequestError("decode", CLOSE_BAD_DATA, "frame: expected a binary msgpack frame "
                                           "(openpi's protocol), found a text frame")  # fmt: skip
                    try:
                        obs = unpack_observation(frame)
                    except WireError as e:
                        raise RequestError("decode", CLOSE_BAD_DATA, str(e)) from None
                    ticket = await self.service.submit(robot.id, obs, received, time.monotonic())
                except Exception as e:
                    if not isinstance(e, RequestError):  # a bug: the robot gets one line, the log the traceback
                        log.exception("robot %d: preparing an observation failed", robot.id)
                        e = RequestError("internal", CLOSE_INTERNAL, INTERNAL_ERROR)
                        self.service.metrics.errors.labels("internal").inc()
                    await answers.put(e)
                    return f"bad input ({e.kind}): {e.message}", True
                await answers.put(ticket)
                if self.options.warm_lead_ms > 0:
                    self._schedule_rehearsal(robot, frame, received)
        except websockets.ConnectionClosed as e:
            return self._closed(e), False
        return "closed by the robot", False

    def _schedule_rehearsal(self, robot: _Robot, frame: bytes, received: float) -> None:
        """`warm_lead_ms` before this robot's next frame is due, rehearse its host steps on this frame."""
        if robot.rehearsal is not None:
            robot.rehearsal.cancel()
        rate = robot.rate_hz if robot.rate_hz is not None else self.service.options.default_rate_hz
        due = received + 1.0 / rate - self.options.warm_lead_ms / 1e3
        delay = due - time.monotonic()
        if delay > 0:  # else the next frame is nearly here: nothing to gain
            robot.rehearsal = asyncio.get_running_loop().call_later(delay, self._rehearse, robot, frame)

    def _rehearse(self, robot: _Robot, frame: bytes) -> None:
        """A robot's host steps (decode, then the service's parse / prepare / finish) on its last frame, the results
        dropped, so the real ones of its next frame run on warm caches: a lone robot's host steps measured several
        times slower 100 ms apart than back to back, and a dry run within a few ms warms them where a busy spin does
        not (`tools/host_warmth_probe.py`). Only while the server is otherwise idle, where it cannot delay anyone."""
        robot.rehearsal = None
        if not self.service.idle():
            return
        try:
            self.service.rehearse(unpack_observation(frame))
        except Exception:  # a frame that decoded and prepared once; whatever fails here, the real request reports
            log.debug("robot %d: rehearsal failed", robot.id, exc_info=True)

    async def _write(self, ws: ServerConnection, robot: _Robot, answers: asyncio.Queue) -> None:
        """Answers in request order; an error is sent as one text frame, then the connection closes with its code."""
        while (item := await answers.get()) is not None:
            try:
                if isinstance(item, RequestError):
                    raise item
                assert isinstance(item, Ticket)
                try:
                    answer = await self.service.answer(item)
                except RequestError:
                    raise
                except Exception:  # a bug: as above
                    log.exception("robot %d: finishing an answer failed", robot.id)
                    self.service.metrics.errors.labels("internal").inc()
                    raise RequestError("internal", CLOSE_INTERNAL, INTERNAL_ERROR) from None
            except RequestError as e:
                if e.kind != "internal":
                    self.service.metrics.errors.labels(e.kind).inc()
                await ws.send(e.message)
                await ws.close(e.close_code, e.message.encode()[:120].decode(errors="ignore"))
                return
            timing = answer.get("server_timing")
            if robot.send_ms is not None and isinstance(timing, dict):
                timing["prev_send_ms"] = robot.send_ms
            t0 = time.monotonic()
            await ws.send(pack(answer))
            robot.send_ms = (time.monotonic() - t0) * 1e3
            robot.requests += 1

    def _closed(self, e: websockets.ConnectionClosed) -> str:
        if e.sent is not None and e.sent.code == CLOSE_TOO_BIG:
            self.service.metrics.errors.labels("too_large").inc()
            return f"closed with 1009: {e.sent.reason}"
        code = e.rcvd.code if e.rcvd is not None else None
        return "closed by the robot" if code in (1000, 1001) else f"connection lost ({e})"

    # ----- running ------------------------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event | None = None, ready: threading.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        self.service.start()
        try:
            async with serve(self._handler, self.options.host, self.options.port, compression=None,
                             max_size=self.options.max_message_bytes, process_request=self._process_request,
                             process_response=self._process_response) as server:  # fmt: skip
                self.port = server.sockets[0].getsockname()[1]
                log.info("serving the %s profile on ws://%s:%d (GET /healthz, GET /metrics)",
                         self.service.profile.name, self.options.host, self.port)  # fmt: skip
                if ready is not None:
                    ready.set()
                await stop.wait()
        finally:
            self.service.stop()

    def run_in_thread(self) -> ServerThread:
        return ServerThread(self)


class ServerThread:
    """A PolicyServer on its own event loop in a background thread (tests, the load test); use as a context."""

    def __init__(self, server: PolicyServer):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vla-rt-server", daemon=True)

    def _run(self) -> None:
        self._loop.run_until_complete(self.server.serve(self._stop, self._ready))

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the server did not start within 60 s")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port


def _address(connection: ServerConnection) -> str:
    addr = connection.remote_address
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


def serve_until_signalled(server: PolicyServer) -> int:
    """Runs a server in this process until SIGINT or SIGTERM (the `vla-rt serve` roles); returns the exit code."""
    import signal

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    asyncio.run(main())
    return 0


def check_listen(host: str, port: int, port_flag: str = "--port") -> None:
    """Before the model loads: `host` is an address of this machine and `port` is free on it (0: any free port; a
    bind and close, with SO_REUSEADDR as asyncio's server uses). A second server on a busy port, or a mistyped host,
    otherwise failed with a bare OSError only after the engine and its cost model were built."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ArgumentError("--host", "an address of this machine to listen on (e.g. 127.0.0.1, 0.0.0.0)", host,
                            found_text=f"{host!r} ({e.strerror})") from None  # fmt: skip
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ArgumentError(port_flag, f"a port free on {host} (0: any free port)", port,
                                        found_text=f"{port}, in use (another server on it?)") from None  # fmt: skip
                if e.errno == errno.EADDRNOTAVAIL:
                    raise ArgumentError("--host", "an address of this machine to listen on (e.g. 127.0.0.1, "
                                        "0.0.0.0)", host, found_text=f"{host!r} ({e.strerror})") from None  # fmt: skip
                raise ArgumentError(f"--host / {port_flag}", "an address and port this user may listen on", None,
                                    found_text=f"{host}:{port} ({e.strerror})") from None  # fmt: skip
