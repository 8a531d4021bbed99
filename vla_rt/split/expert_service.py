"""The robot-side expert behind openpi's protocol: `vla_rt.serve.server.PolicyServer` serves it like a
`RobotService` (same handshake, health check, API key, error frames), but every answer is computed here.

A request: the robot's observation is parsed by its profile and prepared by the policy (resize, normalise, tokenize)
off the event loop; it goes to the worker, which answers from the newest KV it holds (`expert_worker.py`), and then,
from a prepare thread, up the KV link as the newest observation (`KvLinkClient.offer`: the robot never waits for
that, and an older version offered late never replaces a newer one). The answer is openpi's
`{"actions": (H, action_dim)}` plus `kv_version`, `kv_age_ms`, `source` ("local" or "relay") and `state_from`:
- π0: a local chunk's state token is the robot's current state (`state_from: "request"`); a relay chunk was computed
  on the server from the state captured with its observation (`"observation"`), and its delta actions are made
  absolute against that state.
- π0.5 has no state token: the state is text in the prompt, so it is part of the prefix. A π0.5 chunk is conditioned
  on the state captured with the KV's observation, as old as `kv_age_ms` (`state_from: "observation"`), and its
  actions are finished against that state. A robot that needs the current state in every chunk wants π0, or a
  `--max-kv-age-ms` as tight as its state may drift.
A refusal (stale or no KV) is one text frame (openpi's client raises RuntimeError with it), close code 1013.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vla_rt.policy import Pi0Policy, PreparedObservation
from vla_rt.serve.metrics import ServerMetrics
from vla_rt.serve.profiles import RobotProfile
from vla_rt.serve.service import CLOSE_BAD_DATA, CLOSE_INTERNAL, RequestError, Ticket, robot_state_dim
from vla_rt.split import messages
from vla_rt.split.expert_worker import ChunkRequest, ChunkResult, ExpertWorker
from vla_rt.split.kv_client import KvLinkClient

log = logging.getLogger("vla_rt.split")
CLOSE_TRY_LATER = 1013
STATES_KEPT = 256  # robot states of recent observations, to finish relay and π0.5 answers against


@dataclass(frozen=True)
class Admitted:
    """What `PolicyServer` reads from an admission decision."""

    admitted: bool = True
    message: str = "admitted by the robot-side expert (one chunk at a time, no batching)"


class ExpertService:
    def __init__(self, policy: Pi0Policy, profile: RobotProfile, worker: ExpertWorker, client: KvLinkClient, *,
                 default_prompt: str | None = None, seed: int | None = None, device_name: str = ""):  # fmt: skip
        self.policy, self.profile, self.worker, self.client = policy, profile, worker, client
        self.default_prompt, self.device_name = default_prompt, device_name
        model = policy.model
        self.pi05, self.chunk, self.model_dim = model.config.pi05, model.chunk, model.config.action_dim
        stats = policy.norm_stats or {}
        self.action_dim = profile.action_dim or (stats["actions"].dim if "actions" in stats else self.model_dim)
        self.metrics = ServerMetrics(1, 1)
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="vla-rt-prepare")
        self._ids = itertools.count(1)
        self._states: OrderedDict[int, np.ndarray] = OrderedDict()  # version -> robot state captured with it

    # ----- lifecycle (PolicyServer calls these; the link runs beside it: `roles.build_expert_role`) ------------------
    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def metadata(self, robot_id: int) -> dict[str, Any]:
        """The connect metadata, with the keys `RobotService.metadata` gives a client to build its observations
        and `vla-rt loadtest` to report (vocab size, state dim, model, backend, rows in flight: one chunk at a time)."""
        model = self.policy.model
        return {**self.profile.metadata, "server": "vla-rt", "role": "expert", "robot_id": robot_id,
                "profile": self.profile.name, "action_horizon": self.chunk, "action_dim": self.action_dim,
                "state_dim": robot_state_dim(self.profile, self.policy.norm_stats or {}),
                "num_views": model.shapes.num_views, "cameras": list(self.profile.cameras),
                "prompt_len": self.policy.prompt_len, "vocab_size": model.config.vocab_size,
                "text_prompts": self.policy.tokenizer is not None, "model": "pi05" if self.pi05 else "pi0",
                "backend": model.backend, "max_batch": 1,
                "prefix_server": self.client.address, "kv_format": self.client.kv_format,
                "max_kv_age_ms": self.worker.max_age_s * 1e3, "dtype": str(self.policy.model.dtype)[6:],
                "device": self.device_name, "checkpoint": self.policy.model.source}  # fmt: skip

    def connect(self, rate_hz: float | None) -> tuple[int, Admitted]:
        self.metrics.admitted.inc()
        self.metrics.connected.inc()
        return next(self._ids), Admitted()

    def disconnect(self, robot: int) -> None:
        self.metrics.connected.dec()

    # ----- requests -------------------------------------------------------------------------------------------------
    def _prepare(self, policy_obs: dict[str, Any]) -> PreparedObservation:
        """The one validation of a request (`Pi0Policy.prepare`); views stay uint8 pixels, which is what the uplink
        sends (the expert itself never reads them)."""
        return self.policy.prepare(policy_obs, uint8_images=True)

    def _uplink(self, version: int, row: PreparedObservation, noise: torch.Tensor) -> None:
        """Builds the observation's uplink frame and offers it to the KV link (a prepare thread, after the worker
        has the request: the answer never waits for it)."""
        try:
            self.client.offer(version, messages.observation(version, version * 1e-9, row, noise,
                                                            self.policy.prompt_len))  # fmt: skip
        except Exception:  # the link only misses this observation; the answer is unaffected
            log.exception("building the uplink frame of version %d failed", version)

    async def submit(self, robot: int, obs: Any, received: float, decoded: float | None = None) -> Ticket:
        if not isinstance(obs, dict):
            raise RequestError("decode", CLOSE_BAD_DATA, f"observation: expected a map, found {type(obs).__name__}")
        try:
            inputs = self.profile.parse(obs, default_prompt=self.default_prompt)
            row = await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, inputs.policy_obs)
        except ValueError as e:
            raise RequestError("observation", CLOSE_BAD_DATA, str(e)) from None
        version = time.monotonic_ns()
        noise = row.noise if row.noise is not None else torch.randn(1, self.chunk, self.model_dim,
                                                                     generator=self._generator)  # fmt: skip
        self._states[version] = inputs.state
        while len(self._states) > STATES_KEPT:
            self._states.popitem(last=False)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(result: ChunkResult) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))
            except RuntimeError:  # the event loop is gone
                pass

        # state and noise stay on the host: the answering thread's `start_chunk` uploads them just before its chunk,
        # so the event loop never waits on a device copy (behind whatever else the GPU is running)
        self.worker.submit(ChunkRequest(None if self.pi05 else row.state, noise, received, deliver))
        self._pool.submit(self._uplink, version, row, noise)  # after the worker has it: off the answer's path
        return Ticket(future, inputs, received)

    async def answer(self, ticket: Ticket) -> dict[str, Any]:
        result: ChunkResult = await ticket.future
        if result.error is not None:
            kind = "internal" if result.error.startswith("internal") else "stale"
            self.metrics.errors.labels(kind).inc()
            raise RequestError(kind, CLOSE_INTERNAL if kind == "internal" else CLOSE_TRY_LATER, result.error)
        from_observation = self.pi05 or result.source == "relay"
        state = self._states.get(result.kv_version, ticket.inputs.state) if from_observation else ticket.inputs.state
        actions = self.profile.finish(self.policy.finish(result.actions), state, self.action_dim)
        if not np.isfinite(actions).all():
            self.metrics.errors.labels("internal").inc()
            raise RequestError("internal", CLOSE_INTERNAL, "internal server error: the model produced non-finite "
                               "actions (see the expert's log)")  # fmt: skip
        total_ms = (time.monotonic() - ticket.received) * 1e3
        self.metrics.requests.inc()
        self.metrics.total_s.observe(total_ms / 1e3)
        return {"actions": actions, "kv_version": result.kv_version, "kv_age_ms": result.kv_age_ms,
                "source": result.source, "state_from": "observation" if from_observation else "request",
                "server_timing": {"infer_ms": result.compute_ms, "queue_ms": result.queue_ms,
                                  "total_ms": total_ms}}  # fmt: skip
