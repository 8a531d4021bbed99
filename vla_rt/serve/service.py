"""What serving robots means, apart from the transport: admission, requests, the queue, the worker, the metrics.

`RobotService` is used by the websocket server in this process (`server.py`) and by each Ray Serve replica
(`ray_app.py`). A request goes: observation dict -> profile (robot format -> policy format) -> `policy.prepare` in a
small thread pool (resize, normalize, tokenize: never on the event loop) -> the batch queue -> the GPU worker ->
`policy.finish` (un-normalize) -> profile (robot actions) -> the answer dict. Bad input raises `RequestError`
with a one-line message (key, expected, found) and the websocket close code for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vla_rt.inputs import check_model_inputs
from vla_rt.policy import PreparedObservation
from vla_rt.serve.engines import ServingModel
from vla_rt.serve.metrics import ServerMetrics
from vla_rt.serve.profiles import RobotInputs, RobotProfile
from vla_rt.serve.scheduler import Admission, Batch, BatchQueue, CostModel, Decision
from vla_rt.serve.worker import BatchRunner, GpuWorker, RowResult

log = logging.getLogger("vla_rt.serve")

CLOSE_BAD_DATA, CLOSE_TOO_BIG, CLOSE_INTERNAL = 1003, 1009, 1011


class RequestError(Exception):
    """A request that ends its connection: `kind` (a metrics label), the close code and a one-line message."""

    def __init__(self, kind: str, close_code: int, message: str):
        super().__init__(message)
        self.kind, self.close_code, self.message = kind, close_code, message


@dataclass(frozen=True)
class ServiceOptions:
    slo_ms: float | None = None  # admission bound on every robot's predicted p99 (None: admit every robot)
    window_ms: float = 2.0  # how long a request waits for company in its batch
    default_rate_hz: float = 10.0  # a robot's request rate when it does not declare one (`?hz=` in its URI)
    default_prompt: str | None = None  # openpi's InjectDefaultPrompt
    prepare_threads: int = 2
    seed: int | None = None  # of the denoising noise (None: not reproducible)


@dataclass(frozen=True)
class Ticket:
    """A request in the queue: the future the worker resolves, and what finishing its actions needs."""

    future: asyncio.Future
    inputs: RobotInputs
    received: float  # time.monotonic() when its frame arrived


class RobotService:
    def __init__(self, serving: ServingModel, profile: RobotProfile, cost: CostModel,
                 options: ServiceOptions = ServiceOptions(), *, device_name: str = ""):  # fmt: skip
        self.serving, self.profile, self.cost, self.options = serving, profile, cost, options
        self.policy = serving.policy
        stats = self.policy.norm_stats or {}
        model_dim = self.policy.model.config.action_dim
        self.action_dim = profile.action_dim or (stats["actions"].dim if "actions" in stats else model_dim)
        if self.action_dim > model_dim:
            raise ValueError(f"profile {profile.name}: expected at most the model's {model_dim} action dims, "
                             f"found {self.action_dim}")  # fmt: skip
        sizes = [n for _, n in profile.state_keys]
        # what a robot sends: the profile's fixed sizes, else the norm stats' state (None: any length up to the model's)
        self.state_dim = sum(sizes) if None not in sizes else (stats["state"].dim if "state" in stats else None)
        self.metrics = ServerMetrics(serving.buckets)
        self.metrics.set_cost_model(cost)
        self.admission = Admission(cost, slo_ms=options.slo_ms, window_ms=options.window_ms)
        self.queue = BatchQueue(serving.buckets, options.window_ms / 1e3)
        self.worker = GpuWorker(self.queue, BatchRunner(serving, seed=options.seed), on_batch=self._on_batch)
        self._pool = ThreadPoolExecutor(options.prepare_threads, thread_name_prefix="vla-rt-prepare")
        self._ids = itertools.count(1)
        self.device_name = device_name

    # ----- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def metadata(self, robot_id: int) -> dict[str, Any]:
        """The dict sent to a robot on connect (openpi's clients return it from `get_server_metadata()`)."""
        shapes = self.serving.shapes
        return {
            **self.profile.metadata,
            "server": "vla-rt",
            "robot_id": robot_id,
            "profile": self.profile.name,
            "action_horizon": self.serving.chunk,
            "action_dim": self.action_dim,
            "state_dim": self.state_dim,
            "num_views": shapes.num_views,
            "cameras": list(self.profile.cameras),
            "prompt_len": self.policy.prompt_len,
            "vocab_size": self.policy.model.config.vocab_size,
            "text_prompts": self.policy.tokenizer is not None,
            "max_batch": max(self.serving.buckets),
            "slo_ms": self.options.slo_ms,
            "backend": self.policy.model.backend,
            "dtype": str(self.policy.model.dtype).removeprefix("torch."),
            "checkpoint": self.policy.model.source,
            "device": self.device_name,
        }

    # ----- robots -------------------------------------------------------------------------------------------------
    def connect(self, rate_hz: float | None) -> tuple[int | None, Decision]:
        """Admission for a new robot: (its id, the decision); the id is None when refused."""
        decision = self.admission.try_admit(robot := next(self._ids), rate_hz or self.options.default_rate_hz)
        if not decision.admitted:
            self.metrics.refused.inc()
            self.metrics.errors.labels("refused").inc()
            return None, decision
        self.metrics.admitted.inc()
        self.metrics.connected.inc()
        return robot, decision

    def disconnect(self, robot: int) -> None:
        """The robot's connection ended: its queued request is dropped (an in-flight one finishes unseen)."""
        self.queue.cancel(robot)
        self.admission.release(robot)
        self.metrics.connected.dec()

    # ----- requests -----------------------------------------------------------------------------------------------
    async def submit(self, robot: int, obs: Any, received: float) -> Ticket:
        """Validates and prepares one observation and queues it. Raises RequestError for bad input."""
        if not isinstance(obs, dict):
            raise RequestError("decode", CLOSE_BAD_DATA, f"observation: expected a map, found {type(obs).__name__}")
        try:
            inputs = self.profile.parse(obs, default_prompt=self.options.default_prompt)
        except ValueError as e:
            raise RequestError("observation", CLOSE_BAD_DATA, str(e)) from None
        if "prompt" in inputs.policy_obs and self.policy.tokenizer is None:
            raise RequestError("observation", CLOSE_BAD_DATA, "prompt: a text prompt needs the server started with "
                               "--tokenizer PATH (a SentencePiece .model), found no tokenizer; or send "
                               "'tokenized_prompt' ids")  # fmt: skip
        loop = asyncio.get_running_loop()
        try:
            prepared = await loop.run_in_executor(self._pool, self._prepare, inputs.policy_obs)
        except ValueError as e:
            raise RequestError("observation", CLOSE_BAD_DATA, str(e)) from None
        future = loop.create_future()

        def deliver(result: RowResult) -> None:  # on the worker thread: hand over, never block
            try:
                loop.call_soon_threadsafe(_resolve, future, result)
            except RuntimeError:  # the event loop is gone (server stopped)
                pass

        if self.queue.submit(robot, prepared, deliver):
            self.metrics.superseded.inc()
        return Ticket(future, inputs, received)

    def _prepare(self, policy_obs: dict[str, Any]) -> PreparedObservation:
        """The policy's row, checked as the model will check its batch: a row that would fail there is refused
        here, alone, instead of failing the batch of every robot it would share."""
        row = self.policy.prepare(policy_obs)
        model = self.policy.model
        check_model_inputs(model.config, replace(model.shapes, batch_size=None), row.images, row.state, row.tokens,
                           row.noise, row.image_masks, row.token_mask, self.policy.num_steps)  # fmt: skip
        return row

    async def answer(self, ticket: Ticket) -> dict[str, Any]:
        """Waits for the worker; returns the answer dict ("actions" (H, action_dim) float32, "server_timing")."""
        result: RowResult = await ticket.future
        if result.error is not None:
            self.metrics.errors.labels("internal").inc()
            raise RequestError("internal", CLOSE_INTERNAL, result.error)
        actions = self.profile.finish(self.policy.finish(result.actions), ticket.inputs.state, self.action_dim)
        if not np.isfinite(actions).all():  # never hand a robot NaN commands (e.g. a checkpoint with NaN weights)
            log.error("the model produced non-finite actions for robot input %s", sorted(ticket.inputs.policy_obs))
            self.metrics.errors.labels("internal").inc()
            raise RequestError("internal", CLOSE_INTERNAL, "internal server error: the model produced non-finite "
                               "actions (see the server log)")  # fmt: skip
        total_ms = (time.monotonic() - ticket.received) * 1e3
        self.metrics.requests.inc()
        self.metrics.queue_s.observe(result.queue_ms / 1e3)
        self.metrics.total_s.observe(total_ms / 1e3)
        timing = {"infer_ms": result.infer_ms, "queue_ms": result.queue_ms, "batch_size": result.batch_size,
                  "bucket": result.bucket, "total_ms": total_ms}  # fmt: skip
        if result.superseded:
            timing["superseded"] = result.superseded
        return {"actions": actions, "server_timing": timing}

    def _on_batch(self, batch: Batch, infer_s: float) -> None:
        self.metrics.batch_size.observe(len(batch.requests))
        self.metrics.inference_s.observe(infer_s)


def _resolve(future: asyncio.Future, result: RowResult) -> None:
    if not future.done():
        future.set_result(result)
