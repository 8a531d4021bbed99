"""The scheduler between robots and the GPU: stage costs, which stage runs next, the request queue. No torch and no
sockets, so all of it is tested on a CPU with an injected cost model and clock.

The GPU worker runs one stage at a time on the stage engine (`vla_rt.engine.stages`): a prefix stage (P: vision +
VLM prefix for k rows that join) or an expert stage (E: one Euler step for every row in flight). `choose_stage`
picks the next one:

- `stage` (continuous batching, the default): run P for the waiting requests as soon as the pool has free rows and
  every row in flight can afford it, i.e. a row that would meet its deadline without this P still meets it with
  P(k) and the larger expert stages after it (else try fewer rows, else run E). Rows join at the next stage
  boundary and leave after their last step. P waits at most until the rows in flight drain, so no request starves.
- `overlap` (stage-level, the prefix beside the steps): P for the waiting requests starts on its own CUDA stream
  as soon as no other P is running and the pool has free rows, while E keeps stepping the rows in flight (E on
  the higher-priority stream); the worker joins P's rows at the first stage boundary after P finished, or at once
  when nothing else is in flight ("join": the expert stream then waits for P on the GPU). No affordability test:
  P no longer stops the rows in flight, it only shares the GPU with them.
- `batch` (whole requests, as before stages; kept for comparison): a batch in flight runs all its steps before the
  next one forms; a new batch waits at most the window for company.

`StageQueue` holds the waiting requests (one slot per robot: a newer observation replaces the robot's queued one,
keeping its place; first come, first served; a robot with a row in flight waits for it to leave, so it never holds
two rows) and the rows in flight, and hands the worker its next stage.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POLICIES = ("stage", "overlap", "batch")


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch` itself: (1, 2, 4, 8, 12) for 12."""
    if max_batch < 1:
        raise ValueError(f"max_batch: expected a positive batch size, found {max_batch}")
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return (*sizes, max_batch)


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket that holds n rows."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch of {n} rows: expected at most the largest bucket, {max(buckets)}")


@dataclass(frozen=True)
class StageCosts:
    """Measured stage latencies in milliseconds per bucket: prefix P(k) for k joining rows, expert E(b) for b rows in
    flight; median, p99 and (when measured) p90 of each. `num_steps` expert stages make a request.

    The p90 is what admission charges as a stage's tail: a start-up cost model takes 10-20 timings a bucket, of
    which the "p99" is the largest, so one slow timing sets it (H200, 264ff5a: a 1-row prefix stage median 8.9 ms,
    "p99" 24.2 ms, while the robots' own p99 - p50 served at 1-3 robots was 2-3 ms)."""

    prefix_median_ms: Mapping[int, float]
    prefix_p99_ms: Mapping[int, float]
    expert_median_ms: Mapping[int, float]
    expert_p99_ms: Mapping[int, float]
    num_steps: int = 10
    prefix_p90_ms: Mapping[int, float] | None = None
    expert_p90_ms: Mapping[int, float] | None = None
    # each bucket's median time of its kernels alone (CUDA events; None on a CPU): the wall clock above also holds
    # the host's uploads and launch, which on the H200 made a 1-row prefix 12.7 ms against 6.9 ms of kernels
    prefix_gpu_ms: Mapping[int, float] | None = None
    expert_gpu_ms: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        for name, median, gpu in (("prefix", self.prefix_median_ms, self.prefix_gpu_ms),
                                  ("expert", self.expert_median_ms, self.expert_gpu_ms)):  # fmt: skip
            if gpu is not None and set(median) != set(gpu):
                raise ValueError(f"stage costs: expected the same {name} buckets for median and GPU time, "
                                 f"found {sorted(median)} and {sorted(gpu)}")  # fmt: skip
        for name, median, p99, p90 in (("prefix", self.prefix_median_ms, self.prefix_p99_ms, self.prefix_p90_ms),
                                       ("expert", self.expert_median_ms, self.expert_p99_ms, self.expert_p90_ms)):  # fmt: skip
            for quantile, table in (("p99", p99), ("p90", p90)):
                if table is not None and (not median or set(median) != set(table)):
                    raise ValueError(f"stage costs: expected the same {name} buckets for median and {quantile}, "
                                     f"found {sorted(median)} and {sorted(table)}")  # fmt: skip

    @classmethod
    def from_samples(cls, prefix: Mapping[int, Sequence[float]], expert: Mapping[int, Sequence[float]],
                     num_steps: int) -> StageCosts:  # fmt: skip
        """Median, p90 and p99 of each bucket's timings (ms); every bucket needs at least one."""
        for name, table in (("prefix", prefix), ("expert", expert)):
            empty = sorted(k for k, t in table.items() if not t)
            if empty:
                raise ValueError(f"stage costs: expected timings for every {name} bucket, found none for {empty}")

        def q(table: Mapping[int, Sequence[float]], p: float) -> dict[int, float]:
            return {k: float(np.percentile(t, 100 * p)) for k, t in table.items()}

        return cls(q(prefix, 0.5), q(prefix, 0.99), q(expert, 0.5), q(expert, 0.99), num_steps,
                   q(prefix, 0.9), q(expert, 0.9))  # fmt: skip

    def prefix_tail(self, k: int) -> float:
        """How much slower than its median a slow prefix stage of k rows is (p90 - median; p99 where no p90)."""
        return self.prefix(k, quantile=0.9) - self.prefix(k)

    def expert_tail(self, b: int) -> float:
        return self.expert(b, quantile=0.9) - self.expert(b)

    @classmethod
    def flat(cls, prefix_ms: float, expert_ms: float, prefix_buckets, expert_buckets, num_steps: int = 10):
        """Every bucket the same cost (tests; a cost model where batching is free)."""
        p, e = dict.fromkeys(prefix_buckets, prefix_ms), dict.fromkeys(expert_buckets, expert_ms)
        return cls(p, p, e, e, num_steps)

    @property
    def prefix_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.prefix_median_ms))

    @property
    def expert_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.expert_median_ms))

    def _table(self, stage: str, quantile: float) -> Mapping[int, float]:
        """One stage's costs at `quantile` (0.5, 0.9 or 0.99; 0.9 is the p99 where no p90 was measured)."""
        median, p90, p99 = ((self.prefix_median_ms, self.prefix_p90_ms, self.prefix_p99_ms) if stage == "prefix"
                            else (self.expert_median_ms, self.expert_p90_ms, self.expert_p99_ms))  # fmt: skip
        tables = {0.5: median, 0.9: p99 if p90 is None else p90, 0.99: p99}
        if quantile not in tables:
            raise ValueError(f"stage costs: expected a quantile of {sorted(tables)}, found {quantile}")
        return tables[quantile]

    def prefix(self, k: int, p99: bool = False, *, quantile: float = 0.5) -> float:
        """P for k rows (`quantile` 0.5, 0.9 or 0.99; `p99=True` is 0.99): the bucket holding them, or whole
        largest buckets beyond it."""
        table, largest = self._table("prefix", 0.99 if p99 else quantile), self.prefix_buckets[-1]
        if k > largest:
            return math.ceil(k / largest) * table[largest]
        return table[bucket_for(self.prefix_buckets, max(1, k))]

    def expert(self, b: int, p99: bool = False, *, quantile: float = 0.5) -> float:
        table = self._table("expert", 0.99 if p99 else quantile)
        return table[bucket_for(self.expert_buckets, max(1, min(b, self.expert_buckets[-1])))]

    def request_ms(self, p99: bool = False) -> float:
        """One row alone: its prefix and its steps (the engine call a lone robot pays)."""
        return self.prefix(1, p99) + self.num_steps * self.expert(1, p99)

    def request_gpu_ms(self) -> float | None:
        """`request_ms` from the kernels' own times (None where they were not measured): the GPU's share of a lone
        robot's answer, against which the server's and the network's overhead is measured."""
        if self.prefix_gpu_ms is None or self.expert_gpu_ms is None:
            return None
        prefix = self.prefix_gpu_ms[bucket_for(self.prefix_buckets, 1)]
        return prefix + self.num_steps * self.expert_gpu_ms[bucket_for(self.expert_buckets, 1)]

    def to_json(self) -> dict[str, Any]:
        def rows(stage: str, cost: Callable[..., float], buckets: Sequence[int]) -> dict[str, dict[str, float]]:
            out = {str(b): {"median_ms": cost(b), "p99_ms": cost(b, True)} for b in buckets}
            if (self.prefix_p90_ms if stage == "prefix" else self.expert_p90_ms) is not None:
                for b in buckets:
                    out[str(b)]["p90_ms"] = cost(b, quantile=0.9)
            gpu = self.prefix_gpu_ms if stage == "prefix" else self.expert_gpu_ms
            if gpu is not None:
                for b in buckets:
                    out[str(b)]["gpu_median_ms"] = gpu[b]
            return out

        return {"num_steps": self.num_steps, "prefix": rows("prefix", self.prefix, self.prefix_buckets),
                "expert": rows("expert", self.expert, self.expert_buckets)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StageCosts:
        """`to_json`'s inverse (a server's connect metadata carries it): the load test predicts with it."""

        def column(stage: str, key: str, required: bool = False) -> dict[int, float] | None:
            rows = data[stage]
            missing = [b for b, row in rows.items() if key not in row]
            if missing and required:
                raise ValueError(f"cost model: expected {key} in every {stage} bucket, found none in bucket(s) "
                                 f"{', '.join(missing)}")  # fmt: skip
            return None if missing else {int(b): float(row[key]) for b, row in rows.items()}

        return cls(column("prefix", "median_ms", True), column("prefix", "p99_ms", True),
                   column("expert", "median_ms", True), column("expert", "p99_ms", True), int(data["num_steps"]),
                   prefix_p90_ms=column("prefix", "p90_ms"),
                   expert_p90_ms=column("expert", "p90_ms"), prefix_gpu_ms=column("prefix", "gpu_median_ms"),
                   expert_gpu_ms=column("expert", "gpu_median_ms"))  # fmt: skip


# ----- which stage next --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowView:
    """A row in flight as the policy sees it."""

    steps: int
    deadline: float  # clock seconds by which its answer is due


@dataclass(frozen=True)
class StagePlan:
    kind: str  # "prefix" (rows: how many waiting requests join), "expert", "join" (overlap), or "wait"
    rows: int = 0
    until: float | None = None  # "wait": when to decide again (None: when a request arrives)


def choose_stage(policy: str, now: float, in_flight: Sequence[RowView], waiting: Sequence[float], *, capacity: int,
                 max_prefix: int, costs: StageCosts, window_s: float, joining: int = 0) -> StagePlan:  # fmt: skip
    """The next stage. `waiting`: enqueue times (clock seconds) of the requests that may join, oldest first;
    `joining`: rows of an overlapped prefix stage still running (they hold their pool rows)."""
    free = capacity - len(in_flight) - joining
    if policy == "overlap":
        if waiting and free > 0 and not joining:
            return StagePlan("prefix", min(len(waiting), free, max_prefix))
        if in_flight:
            return StagePlan("expert")
        return StagePlan("join") if joining else StagePlan("wait")
    if policy == "batch":
        if in_flight:
            return StagePlan("expert")
        if not waiting:
            return StagePlan("wait")
        if len(waiting) < capacity and now < waiting[0] + window_s:
            return StagePlan("wait", until=waiting[0] + window_s)
        return StagePlan("prefix", min(len(waiting), capacity, max_prefix))
    if waiting and free > 0:
        most = min(len(waiting), free, max_prefix)
        if not in_flight:
            return StagePlan("prefix", most)
        for k in range(most, 0, -1):
            if _affordable(now, in_flight, k, costs):
                return StagePlan("prefix", k)
    return StagePlan("expert") if in_flight else StagePlan("wait")


def _affordable(now: float, in_flight: Sequence[RowView], k: int, costs: StageCosts) -> bool:
    """Does every row that meets its deadline without a P of k rows still meet it with one?"""
    n = len(in_flight)
    before, after, p = costs.expert(n) / 1e3, costs.expert(n + k) / 1e3, costs.prefix(k) / 1e3
    for row in in_flight:
        left = costs.num_steps - row.steps
        if now + left * before <= row.deadline < now + p + left * after:
            return False
    return True


# ----- the queue ---------------------------------------------------------------------------------------------------
@dataclass
class Pending:
    """A robot's waiting request: the newest payload, and every callback waiting for it."""

    robot: Hashable
    payload: Any
    enqueued: float
    deadline: float
    callbacks: list[Callable[[Any], None]] = field(default_factory=list)
    superseded: int = 0  # older observations this one replaced


@dataclass
class InFlight:
    """A request's row from its prefix stage to its last expert stage, with what its timing fields need."""

    id: int
    request: Pending
    started: float  # its prefix stage began
    prefix_rows: int  # rows in its prefix stage
    prefix_s: float = 0.0
    steps: int = 0
    stages: int = 0  # stages it waited through in flight (its own steps and others' prefixes)
    expert_rows: int = 0  # sum over its expert stages of the rows in them (mean batch = this / steps)


@dataclass(frozen=True)
class Stage:
    kind: str  # "prefix", "expert" or "join" (overlap: the prefix stage running beside, whose rows join now)
    rows: list[InFlight]  # prefix / join: the joining rows; expert: every row in flight
    started: float


class StageQueue:
    """Waiting requests and rows in flight; the worker takes stages with `next_stage` and reports them done.

    Thread-safe: the event loop submits and cancels, the worker thread takes stages."""

    def __init__(self, *, policy: str, capacity: int, max_prefix: int, costs: StageCosts, window_s: float,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, found {policy!r}")
        if window_s < 0 or not math.isfinite(window_s):
            raise ValueError(f"window_s: expected a non-negative wait, found {window_s}")
        self.policy, self.capacity, self.max_prefix, self.costs, self.window_s = (
            policy, capacity, max_prefix, costs, window_s,
        )  # fmt: skip
        self.clock = clock
        self._waiting: OrderedDict[Hashable, Pending] = OrderedDict()
        self._in_flight: dict[int, InFlight] = {}
        self._joining: dict[int, InFlight] = {}  # a prefix stage's rows until prefix_done
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def submit(self, robot: Hashable, payload: Any, callback: Callable[[Any], None], deadline: float) -> bool:
        """Queues a request; returns True when it replaced the robot's waiting older one (which keeps its place)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the stage queue is closed (server shutting down)")
            queued = self._waiting.get(robot)
            if queued is not None:
                queued.payload = payload
                queued.callbacks.append(callback)
                queued.superseded += 1
                return True
            self._waiting[robot] = Pending(robot, payload, self.clock(), deadline, [callback])
            self._cond.notify_all()
            return False

    def cancel(self, robot: Hashable) -> Pending | None:
        """Drops the robot's waiting request (its connection closed); a row in flight finishes unseen."""
        with self._cond:
            return self._waiting.pop(robot, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_stage(self, timeout_s: float | None = None) -> Stage | None:
        """Blocks until a stage should run; None when closed or after `timeout_s` without one."""
        end = None if timeout_s is None else self.clock() + timeout_s
        with self._cond:
            while not self._closed:
                now = self.clock()
                busy = {r.request.robot for r in (*self._in_flight.values(), *self._joining.values())}
                eligible = [p for p in self._waiting.values() if p.robot not in busy]
                rows = [RowView(r.steps, r.request.deadline) for r in self._in_flight.values()]
                plan = choose_stage(self.policy, now, rows, [p.enqueued for p in eligible], capacity=self.capacity,
                                    max_prefix=self.max_prefix, costs=self.costs, window_s=self.window_s,
                                    joining=len(self._joining))  # fmt: skip
                if plan.kind == "prefix":
                    joining = [self._join(p, now, plan.rows) for p in eligible[: plan.rows]]
                    return Stage("prefix", joining, now)
                if plan.kind == "expert":
                    return Stage("expert", list(self._in_flight.values()), now)
                if plan.kind == "join":
                    return Stage("join", list(self._joining.values()), now)
                if end is not None and now >= end:
                    return None
                wake = [t for t in (plan.until, end) if t is not None]
                self._cond.wait(min(wake) - now if wake else None)  # an arrival, a finished stage or the window
            return None

    def _join(self, p: Pending, now: float, k: int) -> InFlight:
        del self._waiting[p.robot]
        row = InFlight(next(self._ids), p, now, k)
        self._joining[row.id] = row
        return row

    def prefix_done(self, stage: Stage, ok: bool = True) -> None:
        """The prefix stage's rows joined the engine's pool (they are in flight from now), or it failed (they are
        dropped). Under `overlap` it ran beside the rows in flight, which it did not hold up."""
        elapsed = self.clock() - stage.started
        with self._cond:
            if self.policy != "overlap":
                for row in self._in_flight.values():
                    row.stages += 1
            for row in stage.rows:
                row.prefix_s = elapsed
                if self._joining.pop(row.id, None) is not None and ok:
                    self._in_flight[row.id] = row
            self._cond.notify_all()

    def expert_done(self, stage: Stage, finished: set[int] | None = None) -> list[InFlight]:
        """Every row of the stage took a step; returns the rows that took their last (they leave). `finished`: the
        ids the engine reported done, checked against the steps counted here; None: the stage failed, all leave."""
        with self._cond:
            for row in stage.rows:
                row.steps += 1
                row.stages += 1
                row.expert_rows += len(stage.rows)
            if finished is None:
                done = list(stage.rows)
            else:
                done = [r for r in stage.rows if r.steps >= self.costs.num_steps]
                if {r.id for r in done} != finished:
                    raise RuntimeError(f"the engine finished rows {sorted(finished)}, the scheduler counted "
                                       f"{sorted(r.id for r in done)}")  # fmt: skip
            for row in done:
                self._in_flight.pop(row.id, None)
            self._cond.notify_all()
            return done
