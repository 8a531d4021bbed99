"""The scheduler between robots and the GPU: batch buckets, SLO admission from a cost model, the request queue.

No torch and no sockets here, so all of it is tested on a CPU with an injected cost model.

- `CostModel`: engine latency (median, p99) per batch bucket, measured at start-up by the worker.
- `Admission`: robot i asks at rate r_i. With n robots the worker runs batches of B = bucket(min(n, max batch));
  a request waits at most the batching window w, then for the batch in progress and for the batches ahead of it,
  k = ceil(n / max batch) of them at most (its own included): predicted p99 = w + (k + 1) * L_p99(B). The GPU is
  busy a fraction rho = sum(r_i) * L_median(B) / B. A new robot is admitted only if, with it, the predicted p99 stays
  within the SLO and rho <= `max_utilization`; an admitted robot is never evicted, so a refusal names the SLO,
  the prediction and the fleet it protects.
- `BatchQueue`: one slot per robot (a newer observation replaces its queued older one: robots want the freshest
  frame, and a robot never holds two rows of a batch), first come first served across robots, and a batch waits
  at most the window for company after its oldest request arrived.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


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
class CostModel:
    """Engine latency per batch bucket in milliseconds: {bucket: median}, {bucket: p99}."""

    median_ms: Mapping[int, float]
    p99_ms: Mapping[int, float]

    def __post_init__(self) -> None:
        if not self.median_ms or set(self.median_ms) != set(self.p99_ms):
            raise ValueError(f"cost model: expected the same buckets for median and p99, found "
                             f"{sorted(self.median_ms)} and {sorted(self.p99_ms)}")  # fmt: skip

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.median_ms))

    def to_json(self) -> dict[str, dict[str, float]]:
        return {str(b): {"median_ms": self.median_ms[b], "p99_ms": self.p99_ms[b]} for b in self.buckets}


@dataclass(frozen=True)
class Prediction:
    """What the scheduler expects for a fleet of `robots` robots asking at `rate_hz` in total."""

    robots: int
    rate_hz: float
    batch: int  # the bucket the fleet runs at
    p99_ms: float
    utilization: float

    def describe(self) -> str:
        return (f"{self.robots} robots at {self.rate_hz:g} Hz in total: batch {self.batch}, predicted p99 "
                f"{self.p99_ms:.1f} ms, GPU busy {100 * self.utilization:.0f}%")  # fmt: skip


@dataclass(frozen=True)
class Decision:
    admitted: bool
    prediction: Prediction
    message: str


class Admission:
    """Admits robots while every admitted robot's predicted p99 stays within the SLO (never evicts).

    Called from one thread (the server's event loop)."""

    def __init__(self, cost: CostModel, *, slo_ms: float | None, window_ms: float, max_utilization: float = 0.8):
        if slo_ms is not None and slo_ms <= 0:
            raise ValueError(f"slo_ms: expected a positive latency bound, found {slo_ms}")
        if not 0 < max_utilization <= 1:
            raise ValueError(f"max_utilization: expected a fraction in (0, 1], found {max_utilization}")
        self.cost, self.slo_ms, self.window_ms, self.max_utilization = cost, slo_ms, window_ms, max_utilization
        self.rates: dict[Hashable, float] = {}

    def predict(self, rates: Sequence[float]) -> Prediction:
        n, largest = len(rates), max(self.cost.buckets)
        batch = bucket_for(self.cost.buckets, max(1, min(n, largest)))
        rounds = max(1, math.ceil(n / largest))
        p99 = self.window_ms + (rounds + 1) * self.cost.p99_ms[batch]
        utilization = sum(rates) * self.cost.median_ms[batch] / 1e3 / batch
        return Prediction(n, float(sum(rates)), batch, p99, utilization)

    def try_admit(self, robot: Hashable, rate_hz: float) -> Decision:
        if rate_hz <= 0 or not math.isfinite(rate_hz):
            raise ValueError(f"rate_hz: expected a positive request rate, found {rate_hz}")
        with_it = self.predict([*self.rates.values(), rate_hz])
        if self.slo_ms is not None and with_it.p99_ms > self.slo_ms:
            return Decision(False, with_it, f"refused: the SLO is p99 <= {self.slo_ms:g} ms and with this robot "
                            f"{with_it.describe()}; {len(self.rates)} robots are admitted")  # fmt: skip
        if self.slo_ms is not None and with_it.utilization > self.max_utilization:
            return Decision(False, with_it, f"refused: with this robot {with_it.describe()}, above the "
                            f"{100 * self.max_utilization:.0f}% that keeps the SLO ({self.slo_ms:g} ms) under load; "
                            f"{len(self.rates)} robots are admitted")  # fmt: skip
        self.rates[robot] = rate_hz
        return Decision(True, with_it, f"admitted: {with_it.describe()}")

    def release(self, robot: Hashable) -> None:
        self.rates.pop(robot, None)


@dataclass
class Pending:
    """A robot's queued request: the newest payload, and every callback waiting for it."""

    robot: Hashable
    payload: Any
    enqueued: float
    callbacks: list[Callable[[Any], None]] = field(default_factory=list)
    superseded: int = 0  # older observations this one replaced


@dataclass(frozen=True)
class Batch:
    requests: list[Pending]
    bucket: int
    formed: float


class BatchQueue:
    """Thread-safe queue of robots' requests, taken by the worker in batches (see the module docstring)."""

    def __init__(self, buckets: Sequence[int], window_s: float):
        if window_s < 0:
            raise ValueError(f"window_s: expected a non-negative wait, found {window_s}")
        self.buckets, self.window_s = tuple(sorted(buckets)), window_s
        self._pending: OrderedDict[Hashable, Pending] = OrderedDict()
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending)

    def submit(self, robot: Hashable, payload: Any, callback: Callable[[Any], None]) -> bool:
        """Queues a request; returns True when it replaced the robot's queued older one (which keeps its place)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch queue is closed (server shutting down)")
            queued = self._pending.get(robot)
            if queued is not None:
                queued.payload = payload
                queued.callbacks.append(callback)
                queued.superseded += 1
                return True
            self._pending[robot] = Pending(robot, payload, time.monotonic(), [callback])
            self._cond.notify_all()
            return False

    def cancel(self, robot: Hashable) -> Pending | None:
        """Drops the robot's queued request (its connection closed); returns it, or None if none was queued."""
        with self._cond:
            return self._pending.pop(robot, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_batch(self, timeout_s: float | None = None) -> Batch | None:
        """Blocks for work; returns up to the largest bucket's worth of requests, or None when closed / timed out."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        largest = self.buckets[-1]
        with self._cond:
            while True:
                while not self._pending and not self._closed:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._cond.wait(left)
                if not self._pending:
                    return None  # closed and drained
                oldest = next(iter(self._pending.values()))
                deadline = oldest.enqueued + self.window_s
                while len(self._pending) < largest and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._pending:  # (requests may have been cancelled while waiting)
                    break
            take = [self._pending.popitem(last=False)[1] for _ in range(min(largest, len(self._pending)))]
            return Batch(take, bucket_for(self.buckets, len(take)), time.monotonic())
