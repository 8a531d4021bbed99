"""What serving robots means, apart from the transport: admission, requests, the queue, the worker, the metrics.

`RobotService` is used by the websocket server in this process (`server.py`) and by each Ray Serve replica
(`ray_app.py`). A request goes: observation dict -> profile (robot format -> policy format) -> `policy.prepare`
(resize, normalize the state, tokenize; images stay uint8), in a small thread pool when a view needs a resize, else
on the loop -> the stage queue -> the GPU worker (a prefix stage, then its expert steps among the other rows in
flight) -> `policy.finish` (un-normalize) -> profile (robot actions) -> the answer dict with the server's own timing
fields. Bad input raises `RequestError` with a one-line message (key, expected, found) and the websocket close code
for it. The policy is the one validation of a request: what it prepares is valid model input, so nothing checks the
rows again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from vla_rt.policy import PreparedObservation
from vla_rt.serve.admission import Admission, Decision
from vla_rt.serve.engines import ServingModel
from vla_rt.serve.metrics import ServerMetrics
from vla_rt.serve.profiles import RobotInputs, RobotProfile
from vla_rt.serve.scheduler import Stage, StageCosts, StageQueue
from vla_rt.serve.worker import GpuWorker, RowResult, StageRunner

log = logging.getLogger("vla_rt.serve")

CLOSE_BAD_DATA, CLOSE_TOO_BIG, CLOSE_INTERNAL = 1003, 1009, 1011


class RequestError(Exception):
    """A request that ends its connection: `kind` (a metrics label), the close code and a one-line message."""

    def __init__(self, kind: str, close_code: int, message: str):
        super().__init__(message)
        self.kind, self.close_code, self.message = kind, close_code, message


@dataclass(frozen=True)
class ServiceOptions:
    slo_ms: float | None = None  # tightens every robot's SLO (its period) for admission
    admission: bool = True  # False: admit every robot (load tests of an overloaded server)
    policy: str = "overlap"  # "overlap" (stage-level, prefix beside the steps), "stage" or "batch"
    window_ms: float = 2.0  # "batch": how long a request waits for company in its batch
    default_rate_hz: float = 10.0  # a robot's request rate when it does not declare one (`?hz=` in its URI)
    default_prompt: str | None = None  # openpi's InjectDefaultPrompt
    prepare_threads: int = 2
    seed: int | None = None  # of the denoising noise (None: not reproducible)


def robot_state_dim(profile: RobotProfile, stats: dict) -> int | None:
    """What a robot sends: the profile's fixed sizes, else the norm stats' state (None: any length up to the
    model's). Both services put it in their connect metadata, so a client (the load test) sends a state that fits."""
    sizes = [n for _, n in profile.state_keys]
    return sum(sizes) if None not in sizes else (stats["state"].dim if "state" in stats else None)


@dataclass(frozen=True)
class Ticket:
    """A request in the queue: the future the worker resolves, and what finishing its actions needs."""

    future: asyncio.Future
    inputs: RobotInputs
    received: float  # time.monotonic() when its frame arrived
    decode_ms: float = 0.0
    prepare_ms: float = 0.0  # decoded -> queued (the profile, the thread pool hop, policy.prepare)


class RobotService:
    def __init__(self, serving: ServingModel, profile: RobotProfile, costs: StageCosts,
                 options: ServiceOptions = ServiceOptions(), *, device_name: str = ""):  # fmt: skip
        self.serving, self.profile, self.costs, self.options = serving, profile, costs, options
        self.policy = serving.policy
        stats = self.policy.norm_stats or {}
        model_dim = self.policy.model.config.action_dim
        self.action_dim = profile.action_dim or (stats["actions"].dim if "actions" in stats else model_dim)
        if self.action_dim > model_dim:
            raise ValueError(f"profile {profile.name}: expected at most the model's {model_dim} action dims, "
                             f"found {self.action_dim}")  # fmt: skip
        self.state_dim = robot_state_dim(profile, stats)
        engine = serving.stages
        self.metrics = ServerMetrics(engine.capacity, engine.max_prefix)
        self.metrics.set_cost_model(costs)
        self.admission = Admission(costs, policy=options.policy, capacity=engine.capacity, slo_ms=options.slo_ms,
                                   window_ms=options.window_ms, enabled=options.admission)  # fmt: skip
        self.queue = StageQueue(policy=options.policy, capacity=engine.capacity, max_prefix=engine.max_prefix,
                                costs=costs, window_s=options.window_ms / 1e3)  # fmt: skip
        runner = StageRunner(engine, prompt_len=self.policy.prompt_len, seed=options.seed)
        self.worker = GpuWorker(self.queue, runner, on_stage=self._on_stage)
        self._pool = ThreadPoolExecutor(options.prepare_threads, thread_name_prefix="vla-rt-prepare")
        self._ids = itertools.count(1)
        self._slo_s: dict[int, float] = {}  # robot -> its SLO in seconds (each request's deadline)
        self.device_name = device_name
        self.startup: dict[str, float] = {}  # seconds per start-up phase (app.build_service fills it)
        self.rehearsals = 0  # host-step rehearsals run (`rehearse`, the server's --warm-lead-ms)

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
            "max_batch": self.serving.stages.capacity,
            "max_prefix": self.serving.stages.max_prefix,
            "sm_partition": None if (part := self.serving.stages.sm_partition) is None else part.sms,
            "scheduler": self.options.policy,
            "admission": self.options.admission,
            "slo_ms": self.options.slo_ms,
            "model": "pi05" if self.policy.model.config.pi05 else "pi0",
            "backend": self.policy.model.backend,
            "dtype": str(self.policy.model.dtype).removeprefix("torch."),
            "checkpoint": self.policy.model.source,
            "cost_model": self.costs.to_json(),
            "engine_request_ms": self.costs.request_ms(),
            "engine_request_gpu_ms": self.costs.request_gpu_ms(),
            "startup_s": self.startup,
            "device": self.device_name,
        }

    # ----- robots -------------------------------------------------------------------------------------------------
    def connect(self, rate_hz: float | None) -> tuple[int | None, Decision]:
        """Admission for a new robot: (its id, the decision); the id is None when refused."""
        rate = rate_hz or self.options.default_rate_hz
        decision = self.admission.try_admit(robot := next(self._ids), rate)
        if not decision.admitted:
            self.metrics.refused.inc()
            self.metrics.errors.labels("refused").inc()
            return None, decision
        self._slo_s[robot] = self.admission.slo_for(rate) / 1e3
        self.metrics.admitted.inc()
        self.metrics.connected.inc()
        return robot, decision

    def disconnect(self, robot: int) -> None:
        """The robot's connection ended: its waiting request is dropped (a row in flight finishes unseen)."""
        self.queue.cancel(robot)
        self.admission.release(robot)
        self._slo_s.pop(robot, None)
        self.metrics.connected.dec()

    # ----- requests -----------------------------------------------------------------------------------------------
    async def submit(self, robot: int, obs: Any, received: float, decoded: float | None = None) -> Ticket:
        """Validates and prepares one observation and queues it. Raises RequestError for bad input.
        `received` / `decoded`: time.monotonic() when the frame arrived and when it was decoded."""
        decoded = received if decoded is None else decoded
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
            if self._prepares_inline(inputs.policy_obs):
                prepared = self._prepare(inputs.policy_obs)
            else:
                prepared = await loop.run_in_executor(self._pool, self._prepare, inputs.policy_obs)
        except ValueError as e:
            raise RequestError("observation", CLOSE_BAD_DATA, str(e)) from None
        future = loop.create_future()

        def deliver(result: RowResult) -> None:  # on the worker thread: hand over, never block
            try:
                loop.call_soon_threadsafe(_resolve, future, result)
            except RuntimeError:  # the event loop is gone (server stopped)
                pass

        deadline = received + self._slo_s.get(robot, 1.0 / self.options.default_rate_hz)
        if self.queue.submit(robot, prepared, deliver, deadline):
            self.metrics.superseded.inc()
        queued = time.monotonic()
        return Ticket(future, inputs, received, (decoded - received) * 1e3, (queued - decoded) * 1e3)

    def idle(self) -> bool:
        """Nothing waiting and nothing in flight: work on the event loop now delays no request."""
        return len(self.queue) == 0 and self.queue.in_flight == 0

    def rehearse(self, obs: Any) -> None:
        """`submit`'s parse and prepare and `answer`'s finish on an observation, nothing queued, the results dropped
        (the server's `--warm-lead-ms`): their code and data then sit in warm caches for the next real request.
        Only frames `submit` took are rehearsed. Views that need a resize go to the prepare pool in a real request,
        so those are not rehearsed here."""
        inputs = self.profile.parse(obs, default_prompt=self.options.default_prompt)
        if self._prepares_inline(inputs.policy_obs):
            self._prepare(inputs.policy_obs)
        self._robot_actions(np.zeros((self.serving.chunk, self.policy.model.config.action_dim), np.float32), inputs)
        self.rehearsals += 1

    def _robot_actions(self, actions: np.ndarray, inputs: RobotInputs) -> np.ndarray:
        """The worker's normalized (H, A) actions -> the robot's: the policy's un-normalization, then the profile's."""
        return self.profile.finish(self.policy.finish(actions), inputs.state, self.action_dim)

    def _prepares_inline(self, policy_obs: dict[str, Any]) -> bool:
        """True when every view already has the model's size: the row is then a stack and a few checks (~30 µs on
        this repository's CPU), cheaper than the pool's two thread hand-offs (most of the ~1.07 ms `prepare` the H200
        machine's 1-robot path reported). A view to resize (~1 ms for a large image) goes to the pool, so the event
        loop keeps serving the others meanwhile."""
        size = self.policy.model.config.vision.image_size
        views = policy_obs.get("images")
        return isinstance(views, dict) and all(
            isinstance(v, np.ndarray) and v.shape[:2] == (size, size) for v in views.values()
        )

    def _prepare(self, policy_obs: dict[str, Any]) -> PreparedObservation:
        """The policy's row: checked there (the one validation), images left as uint8 pixels for the engine."""
        return self.policy.prepare(policy_obs, uint8_images=True)

    async def answer(self, ticket: Ticket) -> dict[str, Any]:
        """Waits for the worker; returns the answer dict ("actions" (H, action_dim) float32, "server_timing")."""
        result: RowResult = await ticket.future
        if result.error is not None:
            self.metrics.errors.labels("internal").inc()
            raise RequestError("internal", CLOSE_INTERNAL, result.error)
        actions = self._robot_actions(result.actions, ticket.inputs)
        if not np.isfinite(actions).all():  # never hand a robot NaN commands (e.g. a checkpoint with NaN weights)
            log.error("the model produced non-finite actions for robot input %s", sorted(ticket.inputs.policy_obs))
            self.metrics.errors.labels("internal").inc()
            raise RequestError("internal", CLOSE_INTERNAL, "internal server error: the model produced non-finite "
                               "actions (see the server log)")  # fmt: skip
        now = time.monotonic()
        total_ms = (now - ticket.received) * 1e3
        self.metrics.requests.inc()
        self.metrics.queue_s.observe(result.queue_ms / 1e3)
        self.metrics.total_s.observe(total_ms / 1e3)
        self.metrics.batch_size.observe(result.batch_size)
        engine_ms = result.prefix_ms + result.expert_ms
        timing = {
            "decode_ms": ticket.decode_ms,
            "prepare_ms": ticket.prepare_ms,
            "queue_ms": result.queue_ms,
            "prefix_ms": result.prefix_ms,
            "expert_ms": result.expert_ms,
            "infer_ms": engine_ms,
            "finish_ms": total_ms - ticket.decode_ms - ticket.prepare_ms - result.queue_ms - engine_ms,
            "total_ms": total_ms,
            "batch_size": result.batch_size,
            "prefix_rows": result.prefix_rows,
            "stages": result.stages,
        }
        if result.superseded:
            timing["superseded"] = result.superseded
        return {"actions": actions, "server_timing": timing}

    def _on_stage(self, stage: Stage, seconds: float) -> None:
        self.metrics.stage_s.labels(stage.kind).observe(seconds)
        self.metrics.stage_rows.labels(stage.kind).observe(len(stage.rows))


def _resolve(future: asyncio.Future, result: RowResult) -> None:
    if not future.done():
        future.set_result(result)
