"""`vla-rt serve --ray`: the same server as a Ray Serve application, one GPU worker replica per GPU.

- `PolicyWorker` (one deployment per GPU, one replica each, so a robot stays on its replica): a `RobotService` —
  the model's stage engine, the stage queue, the worker thread, SLO admission for the robots it holds. It takes
  raw frames and gives back packed answers, so only bytes cross Ray (no observation objects are pickled).
- `Ingress` (FastAPI over Ray Serve's HTTP proxy): openpi's websocket protocol at `/`, `GET /healthz`, `GET /metrics`
  (every replica's metrics, labelled by replica). A new robot goes to the replica with the lowest predicted p99 with
  it (the most headroom) whose admission accepts it; refused everywhere, it is turned away before the handshake
  completes. The API key is checked the same way.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at runtime, and Ray Serve's
class-based views cannot resolve string annotations, so `ws: WebSocket` would become a missing query parameter.)
"""

import asyncio
import hmac
import logging
import signal
import threading
import time
from typing import Any

import ray
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import PlainTextResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from starlette.websockets import WebSocketState

from vla_rt.serve.app import ServeConfig, build_service, use_cpu_threads
from vla_rt.serve.scheduler import StageCosts
from vla_rt.serve.server import parse_rate
from vla_rt.serve.service import CLOSE_BAD_DATA, CLOSE_TOO_BIG, RequestError
from vla_rt.serve.wire import WireError, pack, unpack_observation

log = logging.getLogger("ray.serve")  # Ray Serve configures and collects this one in every replica
app = FastAPI()


async def _refuse(ws: WebSocket, why: str, text: str) -> None:
    """Turns the handshake down. Ray Serve's proxy passes no custom HTTP response (the ASGI websocket denial
    extension), so the robot sees HTTP 403 and the reason goes to the ingress's log."""
    log.info("refused a robot from %s (%s): %s", ws.client, why, text)
    await ws.close(code=1008)


async def _fail(ws: WebSocket, message: str, code: int) -> None:
    await ws.send_text(message)
    if ws.application_state != WebSocketState.DISCONNECTED:
        await ws.close(code, message.encode()[:120].decode(errors="ignore"))


@serve.deployment
class PolicyWorker:
    """One replica: a RobotService on this replica's device (a GPU when Ray gave it one)."""

    def __init__(self, cfg: ServeConfig, replica: int, cost: StageCosts | None = None):
        self.replica = replica
        use_cpu_threads(cfg)  # the replica's own process
        self.service = build_service(cfg, cost)
        self.service.start()

    # async methods all run on the replica's event loop, one at a time: admission needs no lock
    async def predict(self, rate_hz: float | None) -> tuple[float, int]:
        """(predicted p99 ms with one more robot, robots held): the ingress's placement key."""
        admission, rate = self.service.admission, rate_hz or self.service.options.default_rate_hz
        return admission.predict([*admission.rates.values(), rate]).p99_ms, len(admission.rates)

    async def admit(self, rate_hz: float | None) -> tuple[int | None, str, dict[str, Any] | None]:
        robot, decision = self.service.connect(rate_hz)
        metadata = None if robot is None else {**self.service.metadata(robot), "replica": self.replica}
        return robot, decision.message, metadata

    async def infer(self, robot: int, frame: bytes) -> tuple[bool, bytes | str, int]:
        """(True, packed answer, 0) or (False, one-line error, close code)."""
        try:
            try:
                obs = unpack_observation(frame)
            except WireError as e:
                raise RequestError("decode", CLOSE_BAD_DATA, str(e)) from None
            ticket = await self.service.submit(robot, obs, time.monotonic())
            return True, pack(await self.service.answer(ticket)), 0
        except RequestError as e:
            if e.kind != "internal":
                self.service.metrics.errors.labels(e.kind).inc()
            return False, e.message, e.close_code

    async def release(self, robot: int) -> None:
        self.service.disconnect(robot)

    async def metrics(self) -> str:
        return self.service.metrics.render().decode()


def merge_metrics(texts: list[str]) -> str:
    """Prometheus texts of the replicas -> one text, each sample labelled replica="i"."""
    families: dict[str, Any] = {}
    for replica, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, (family.type, family.documentation, []))
            for s in family.samples:
                merged[2].append((s.name, {**s.labels, "replica": str(replica)}, s.value))
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for sample, labels, value in samples:
            inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{sample}{{{inner}}} {value}")
    return "\n".join(lines) + "\n"


@serve.deployment(ray_actor_options={"num_cpus": 0})  # I/O only: the CPUs and GPUs go to the workers
@serve.ingress(app)
class Ingress:
    def __init__(self, workers: list, api_key: str | None, max_message_bytes: int):
        self.workers, self.api_key, self.max_message_bytes = workers, api_key, max_message_bytes
        # one placement at a time: robots connecting together would all read the same predictions and all pick
        # the same replica (seen: two robots at once both went to replica 0 of two empty ones)
        self._placing = asyncio.Lock()

    def _authorized(self, header: str | None) -> bool:
        return self.api_key is None or hmac.compare_digest((header or "").encode(), f"Api-Key {self.api_key}".encode())

    @app.get("/healthz")
    def healthz(self) -> PlainTextResponse:
        return PlainTextResponse("OK\n")

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization")):
            return PlainTextResponse("Authorization: expected 'Api-Key <the server's key>'\n", status_code=401)
        return Response(merge_metrics([await w.metrics.remote() for w in self.workers]), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/")
    async def robot(self, ws: WebSocket) -> None:
        if not self._authorized(ws.headers.get("authorization")):
            await _refuse(ws, "API key", "Authorization: expected 'Api-Key <the server's key>'")
            return
        try:
            rate = parse_rate(str(ws.url.query))
        except ValueError as e:
            await _refuse(ws, "bad URI", str(e))
            return
        async with self._placing:
            predictions = [await w.predict.remote(rate) for w in self.workers]
            order = sorted(range(len(self.workers)), key=lambda i: predictions[i])  # most headroom, fewest robots
            robot, worker, reasons = None, None, []
            for i in order:
                robot, message, metadata = await self.workers[i].admit.remote(rate)
                if robot is not None:
                    worker = self.workers[i]
                    break
                reasons.append(f"replica {i}: {message}")
        if worker is None:
            await _refuse(ws, "SLO admission", "; ".join(reasons))
            return
        try:
            await ws.accept()
            await ws.send_bytes(pack(metadata))
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                frame = message.get("bytes")
                if frame is None:
                    await _fail(ws, "frame: expected a binary msgpack frame (openpi's protocol), found a text frame",
                                CLOSE_BAD_DATA)  # fmt: skip
                    return
                if len(frame) > self.max_message_bytes:
                    await ws.close(CLOSE_TOO_BIG, f"frame with {len(frame)} bytes exceeds limit of "
                                   f"{self.max_message_bytes} bytes")  # fmt: skip
                    return
                ok, answer, code = await worker.infer.remote(robot, frame)
                if not ok:
                    await _fail(ws, answer, code)
                    return
                await ws.send_bytes(answer)
        except WebSocketDisconnect:
            return
        finally:
            await worker.release.remote(robot)


def build_app(cfg: ServeConfig, replicas: int, *, gpus_per_replica: float = 0.0, cost: StageCosts | None = None):
    """The Ray Serve application: `replicas` worker deployments and the ingress."""
    workers = [
        PolicyWorker.options(
            name=f"PolicyWorker{i}", num_replicas=1, ray_actor_options={"num_gpus": gpus_per_replica}
        ).bind(cfg, i, cost)  # fmt: skip
        for i in range(replicas)
    ]
    return Ingress.bind(workers, cfg.api_key, int(cfg.max_message_mb * 2**20))


def run_ray(cfg: ServeConfig, replicas: int | None = None) -> int:
    """Starts (or joins, with RAY_ADDRESS) a Ray cluster and serves until SIGINT / SIGTERM."""
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    def handle_signals() -> None:  # (again after start-up: ray.init installs handlers of its own)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    handle_signals()
    ray.init(ignore_reinit_error=True)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        replicas = replicas or max(1, gpus)
        share = min(1.0, gpus / replicas) if gpus else 0.0  # a whole GPU per replica, or a share of the ones there are
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(cfg, replicas, gpus_per_replica=share), name="vla-rt", route_prefix="/")
        handle_signals()
        log.info("Ray Serve: %d worker replicas (%d GPUs) behind ws://%s:%d", replicas, gpus, cfg.host, cfg.port)
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
