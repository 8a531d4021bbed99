"""The GPU worker: one thread that takes stages from the scheduler and runs them on the stage engine.

The event loop never runs the model: it decodes, validates, prepares rows (in a small pool if a view needs a resize)
and queues them; this thread is the only one that touches the engine, through its public stage methods (`admit`,
`step`). A prefix stage copies the joining rows (uint8 pixels, masks, state, prompt) into the engine's reused host
buffers (`input_rows`) and draws their noise there; an expert stage advances
every row in flight one step, and the rows that took their last step go back through each request's callbacks,
which must not block (the server's hand the result to the event loop with `call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from vla_rt.engine.stages import StageEngine
from vla_rt.inputs import ModelInputs
from vla_rt.policy import PreparedObservation
from vla_rt.serve.scheduler import InFlight, Stage, StageCosts, StageQueue

log = logging.getLogger("vla_rt.serve")
FAULT = "internal server error while running the model (see the server log)"


@dataclass(frozen=True)
class RowResult:
    """One request's answer from the worker: normalized actions (H, A), or a one-line server fault, and its times."""

    actions: np.ndarray | None
    error: str | None
    queue_ms: float  # enqueued -> its prefix stage began
    prefix_ms: float  # its prefix stage
    expert_ms: float  # its prefix stage ended -> its last step ended (its steps and others' prefixes between)
    prefix_rows: int
    batch_size: float  # mean rows in its expert stages
    stages: int
    superseded: int = 0


class StageRunner:
    """Scheduler stages -> engine calls: stacks the joining rows, draws their noise, runs the stage."""

    def __init__(self, engine: StageEngine, *, prompt_len: int, seed: int | None = None):
        self.engine = engine
        # the denoising noise: seeded for reproducible actions, else drawn from the process's generator
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)
        d = engine.dims
        self.views, self.prompt_len, self.chunk = d.views, prompt_len, d.chunk
        self.size, self.action_dim = engine.cfg.vision.image_size, engine.cfg.action_dim

    def dummy_row(self) -> PreparedObservation:
        """A row for timing: one black view (so attention has a key), zero state, no prompt."""
        masks = torch.zeros(1, self.views, dtype=torch.bool)
        masks[0, 0] = True
        tokens = torch.zeros(1, self.prompt_len, dtype=torch.long)
        images = torch.zeros(1, self.views, self.size, self.size, 3, dtype=torch.uint8)
        return PreparedObservation(images, masks, torch.zeros(1, self.action_dim), tokens, tokens.bool(), None)

    def prefix(self, ids: Sequence[int], rows: Sequence[PreparedObservation], noise: torch.Tensor | None = None):
        """The prefix stage for `rows` (prepared and checked one by one, so stacked without a second check)."""
        self.engine.admit(ids, self._stack(rows, noise))

    def begin_prefix(self, ids: Sequence[int], rows: Sequence[PreparedObservation]) -> None:
        """The prefix stage for `rows` on the engine's prefix stream, beside the expert steps (`join` later)."""
        self.engine.begin_admit(ids, self._stack(rows, None))

    def prefix_ready(self) -> bool:
        return self.engine.prefix_ready()

    def join(self) -> list:
        return self.engine.join()

    def cancel_prefix(self) -> None:
        self.engine.cancel_admit()

    def _stack(self, rows: Sequence[PreparedObservation], noise: torch.Tensor | None) -> ModelInputs:
        """The rows copied into the engine's host buffers for the stage (`input_rows`: nothing allocated per stage),
        a row without a prompt as all-padding tokens; the noise drawn into them unless given."""
        x = self.engine.input_rows(len(rows))
        if any(r.images.dtype != x.images.dtype for r in rows):  # float32 views (a policy not preparing uint8)
            x = replace(x, images=torch.cat([r.images for r in rows]))
        else:
            for dst, r in zip(x.images, rows):
                dst.copy_(r.images[0])
        for i, r in enumerate(rows):
            x.state[i].copy_(r.state[0])
            x.image_masks[i].copy_(r.image_masks[0])
            if r.tokens is None:
                x.tokens[i].zero_()
            else:
                x.tokens[i].copy_(r.tokens[0])
            if r.token_mask is None:
                x.token_mask[i].zero_()
            else:
                x.token_mask[i].copy_(r.token_mask[0])
        if noise is None:
            torch.randn(x.noise.shape, generator=self._generator, out=x.noise)
        else:
            x.noise.copy_(noise)
        return x

    def expert(self) -> dict[int, np.ndarray]:
        """One step for every row in flight: {id: (H, A) float32 normalized actions} of the rows that finished."""
        return {i: a.numpy() for i, a in self.engine.step()}

    def reset(self) -> None:
        self.engine.drop_all()


def measure_costs(runner: StageRunner, *, iters: int, warmup: int = 1) -> StageCosts:
    """Times each stage as the worker runs it (stacking, copies, the stage, the wait): P(k) for every prefix bucket
    with an empty pool, E(b) for every expert bucket with b rows in flight (each admitted batch stepped to the end)."""
    engine = runner.engine
    zeros = torch.zeros(max(engine.prefix_buckets), runner.chunk, runner.action_dim)
    prefix, expert = {k: [] for k in engine.prefix_buckets}, {b: [] for b in engine.expert_buckets}
    launch: dict[int, list[float]] = {k: [] for k in engine.prefix_buckets}  # host part: until `prefix` returned
    gpu: dict[tuple[str, int], list[float]] = {}  # the stage's kernels alone (CUDA events), beside each total

    def record(table: dict[int, list[float]], stage: str, rows: int, total: float) -> None:
        table[rows].append(total)
        gpu_ms = engine.last_stage_gpu_ms()
        if gpu_ms is not None:
            gpu.setdefault((stage, rows), []).append(gpu_ms)

    row = runner.dummy_row()  # made once: the server's rows come prepared, the stage only copies them

    def timed_prefix(k: int, first: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        runner.prefix(range(first, first + k), [row] * k, zeros[:k])
        t1 = time.perf_counter()
        engine.synchronize()  # the stage's whole time (serving queues the next stage behind it instead)
        return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3

    engine.time_stages = True
    try:
        for rep in range(warmup + iters):
            for b in engine.expert_buckets:
                while engine.in_flight < b:  # fill b rows, timing each prefix stage
                    k = max(k for k in engine.prefix_buckets if k <= b - engine.in_flight)
                    total, host = timed_prefix(k, engine.in_flight)
                    if rep >= warmup:
                        record(prefix, "prefix", k, total)
                        launch[k].append(host)
                while engine.in_flight:
                    t0 = time.perf_counter()
                    runner.expert()
                    engine.synchronize()
                    if rep >= warmup:
                        record(expert, "expert", b, (time.perf_counter() - t0) * 1e3)
        for k in [k for k, times in prefix.items() if not times]:  # a bucket no fill used: time it alone
            for rep in range(warmup + iters):
                total, host = timed_prefix(k, 0)
                if rep >= warmup:
                    record(prefix, "prefix", k, total)
                    launch[k].append(host)
                runner.reset()
    finally:
        engine.time_stages = False
    costs = StageCosts.from_samples(prefix, expert, engine.num_steps)
    medians = {key: float(np.median(times)) for key, times in gpu.items()}
    if all((stage, rows) in medians for stage, table in (("prefix", prefix), ("expert", expert)) for rows in table):
        costs = replace(costs, prefix_gpu_ms={k: medians["prefix", k] for k in prefix},
                        expert_gpu_ms={b: medians["expert", b] for b in expert})  # fmt: skip

    def on_gpu(stage: str, rows: int) -> str:
        """The GPU's own share: a slow total with a steady GPU time waited on the host, not on the kernels."""
        times = gpu.get((stage, rows))
        if not times:
            return ""
        median, p90, top = np.percentile(times, [50, 90, 100])
        return f"; on the GPU {median:.2f} / {p90:.2f} / {top:.2f} ms median / p90 / max"

    for k in costs.prefix_buckets:  # the host's share says whether a slow stage waited on the host or on the GPU
        host = np.percentile(launch[k], [50, 90])
        log.info("cost model: prefix stage of %d rows %.2f ms median, %.2f ms p90, %.2f ms p99 (of which until the "
                 "launch returned: %.2f / %.2f ms median / p90%s)", k, costs.prefix(k), costs.prefix(k, quantile=0.9),
                 costs.prefix(k, True), *host, on_gpu("prefix", k))  # fmt: skip
    for b in costs.expert_buckets:
        log.info("cost model: expert stage of %d rows %.2f ms median, %.2f ms p90, %.2f ms p99%s", b, costs.expert(b),
                 costs.expert(b, quantile=0.9), costs.expert(b, True), on_gpu("expert", b))  # fmt: skip
    return costs


class GpuWorker:
    """The thread that owns the engine. `on_stage(stage, seconds)` reports each stage (metrics); never blocks.

    Under the `overlap` policy a prefix stage only starts (`begin_prefix`) and is remembered; its rows join the pool
    after the first expert stage that sees it finished, or when the queue asks ("join": nothing else in flight)."""

    def __init__(self, queue: StageQueue, runner: StageRunner,
                 on_stage: Callable[[Stage, float], None] | None = None):  # fmt: skip
        self.queue, self.runner, self.on_stage = queue, runner, on_stage
        self._overlap = queue.policy == "overlap"
        self._running: Stage | None = None  # the overlapped prefix stage not joined yet
        self._thread = threading.Thread(target=self._loop, name="vla-rt-gpu-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.queue.close()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (stage := self.queue.next_stage()) is not None:
            t0 = time.perf_counter()
            if stage.kind == "prefix":
                rows, actions, error = self._prefix(stage)
            elif stage.kind == "join":
                rows, actions, error = self._join()
            else:
                rows, actions, error = self._expert(stage)
            if self.on_stage is not None:  # before the answers: a robot that has its answer sees the stage counted
                self.on_stage(stage, time.perf_counter() - t0)
            self._deliver(rows, actions, error)
            if stage.kind == "expert" and self._running is not None and self.runner.prefix_ready():
                self._deliver(*self._join())

    def _prefix(self, stage: Stage) -> tuple[list[InFlight], dict | None, str | None]:
        ids, payloads = [r.id for r in stage.rows], [r.request.payload for r in stage.rows]
        try:
            if self._overlap:
                self.runner.begin_prefix(ids, payloads)
            else:
                self.runner.prefix(ids, payloads)
        except Exception:  # a bug or a device fault: these robots get a one-line message, the log the traceback
            log.exception("prefix stage of %d rows failed", len(stage.rows))
            self.queue.prefix_done(stage, ok=False)
            return stage.rows, None, FAULT
        if self._overlap:
            self._running = stage
        else:
            self.queue.prefix_done(stage)
        return [], None, None

    def _join(self) -> tuple[list[InFlight], dict | None, str | None]:
        """The running prefix stage's rows join the pool (they are in flight for the next expert stage)."""
        stage, self._running = self._running, None
        if stage is None:
            raise RuntimeError("join: no prefix stage running (the queue and the worker disagree)")
        try:
            self.runner.join()
        except Exception:  # its rows get the message; the rows in flight go on
            log.exception("joining a prefix stage of %d rows failed", len(stage.rows))
            self.runner.cancel_prefix()
            self.queue.prefix_done(stage, ok=False)
            return stage.rows, None, FAULT
        self.queue.prefix_done(stage)
        return [], None, None

    def _expert(self, stage: Stage) -> tuple[list[InFlight], dict | None, str | None]:
        try:
            finished = self.runner.expert()
        except Exception:  # the rows in flight are lost with the stage, and a prefix stage not joined: all told
            log.exception("expert stage of %d rows failed", len(stage.rows))
            self.runner.reset()
            lost = self.queue.expert_done(stage, None)
            if self._running is not None:
                self.queue.prefix_done(self._running, ok=False)
                lost, self._running = lost + self._running.rows, None
            return lost, None, FAULT
        return self.queue.expert_done(stage, set(finished)), finished, None

    def _deliver(self, rows: Sequence[InFlight], actions: dict[int, np.ndarray] | None, error: str | None) -> None:
        now = self.queue.clock()
        for row in rows:
            p = row.request
            result = RowResult(None if actions is None else actions[row.id], error, (row.started - p.enqueued) * 1e3,
                               row.prefix_s * 1e3, max(0.0, now - row.started - row.prefix_s) * 1e3, row.prefix_rows,
                               row.expert_rows / max(1, row.steps), row.stages, p.superseded)  # fmt: skip
            for callback in p.callbacks:
                callback(result)
