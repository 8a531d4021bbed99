"""SLO admission from measured stage costs, on by default: a robot is admitted only if, with it, every robot's
predicted p99 stays within its SLO; an admitted robot is never evicted. No torch: tested with injected costs.

A robot's SLO is its period (it wants the answer before its next frame: 100 ms at 10 Hz, declared with `?hz=` in
its URI or `--robot-hz`), tightened by `--slo-ms`. The fleet's latency is shared, so a new robot must fit the
tightest SLO of all.

Prediction for the stage policy (scheduler.py), n robots at R = sum(r_i) requests per second, solved as a fixed
point in the request latency T (a handful of iterations), every stage at its median cost plus the largest tail
(p90 - median, `StageCosts.prefix_tail`) of one of them, the medians with a 10% margin: a request's life is a dozen
stages, GPU stage times are near constant with rare slow ones, and charging every stage its p99 (the sum of p99s)
refused robots the GPU had room for (H200, 2026-12-03, π0 2 views, prompt 20, chunk 50: 1 / 2 robots measured p99
19.6 / 43.8 ms; the sum of p99s predicted 27.2 / 65.8 and admitted only 2 of 8). The tail is the p90's, not the
p99's: the start-up cost model's p99 is the largest of 10-20 timings, and in the next run (264ff5a) one slow 1-row
prefix timing (24.2 ms against a median of 8.9) made the prediction for a lone robot 32.6 ms where it measured
21.4, and admission held the fleet to 3 robots (robots measured p99 43-46 ms; 8 robots without admission 93 ms):
- rows in flight B = min(R · T, n, pool): Little's law;
- the other robots' requests arriving during one request's life: a = (R - R/n) · T on average, a99 = a + 2.33 √a
  at the 99th percentile (Poisson's normal approximation), at most n - 1; each gets a prefix stage interleaved with
  this request's expert stages (at most one before each): m = min(steps, ⌈a99⌉) stages of k = ⌈a99 / m⌉ rows (at
  most the largest prefix bucket);
- T = 1.1 (wait + P(k) + steps · E(B) + m · P(k)) + tail, where wait = the stage in progress when it arrives (none
  for a lone robot): its own prefix, its steps, the others' prefixes between them; tail = the larger p90 - median of
  P(k) and E(B) (p99 - median for costs measured without a p90).
The GPU is busy rho = R · (P(k) / k + steps · E(B) / B) at median costs (each request's share of a prefix stage and
of its steps); admitted only if T <= the SLO, rho <= `max_utilization` and R · T rows fit the pool.

For the whole-batch policy: a batch of B = min(n, pool) rows costs L(B) = P(B) + steps · E(B); a request waits at
most the window, the batch in progress and the ⌈n / pool⌉ batches ahead (its own included): T = w + (⌈n / pool⌉
+ 1) · L(B), rho = R · L(B) / B.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from vla_rt.serve.scheduler import POLICIES, StageCosts

FIXED_POINT_ITERS = 60
P99_Z = 2.33  # the normal quantile of 99%
MEDIAN_MARGIN = 1.10  # on the medians: host work between stages and the answer's send, which the stages leave out
UNBOUNDED_MS = 1e6


@dataclass(frozen=True)
class Prediction:
    """What the scheduler expects for a fleet of `robots` robots asking at `rate_hz` in total."""

    robots: int
    rate_hz: float
    p99_ms: float
    utilization: float
    rows: float  # rows in flight on average (stage) or the batch (batch)
    prefix_rows: int  # rows per prefix stage
    expert_rows: int  # rows per expert stage

    def describe(self) -> str:
        p99 = "unbounded" if self.p99_ms >= UNBOUNDED_MS else f"{self.p99_ms:.1f} ms"
        return (f"{self.robots} robots at {self.rate_hz:g} Hz in total: predicted p99 {p99}, prefix stages of "
                f"{self.prefix_rows} rows, expert stages of {self.expert_rows} rows, GPU busy "
                f"{100 * self.utilization:.0f}%")  # fmt: skip


@dataclass(frozen=True)
class Decision:
    admitted: bool
    prediction: Prediction
    slo_ms: float  # the SLO the fleet must meet with this robot
    message: str


class Admission:
    """Admits robots while every admitted robot's predicted p99 stays within its SLO (never evicts).

    `enabled=False` admits everyone (still predicting). Called from one thread (the event loop)."""

    def __init__(self, costs: StageCosts, *, policy: str, capacity: int, slo_ms: float | None = None,
                 window_ms: float = 0.0, enabled: bool = True, max_utilization: float = 0.8):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, found {policy!r}")
        if slo_ms is not None and not 0 < slo_ms < math.inf:
            raise ValueError(f"slo_ms: expected a positive latency bound, found {slo_ms}")
        if not 0 < max_utilization <= 1:
            raise ValueError(f"max_utilization: expected a fraction in (0, 1], found {max_utilization}")
        self.costs, self.policy, self.capacity, self.slo_ms = costs, policy, capacity, slo_ms
        self.window_ms, self.enabled, self.max_utilization = window_ms, enabled, max_utilization
        self.rates: dict[Hashable, float] = {}

    def slo_for(self, rate_hz: float) -> float:
        """A robot's SLO in ms: its period, tightened by --slo-ms."""
        return min(1e3 / rate_hz, self.slo_ms if self.slo_ms is not None else math.inf)

    def predict(self, rates: Sequence[float]) -> Prediction:
        if not rates:
            return Prediction(0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        return self._predict_batch(rates) if self.policy == "batch" else self._predict_stage(rates)

    def _predict_stage(self, rates: Sequence[float]) -> Prediction:
        c, n, steps = self.costs, len(rates), self.costs.num_steps
        per_ms = sum(rates) / 1e3
        largest_prefix = c.prefix_buckets[-1]
        t = c.request_ms(p99=True)
        for _ in range(FIXED_POINT_ITERS):
            b = max(1, math.ceil(min(per_ms * t, n, self.capacity)))
            others = (per_ms - per_ms / n) * t
            others99 = min(n - 1, others + P99_Z * math.sqrt(others))
            m = min(steps, math.ceil(others99))
            k = min(largest_prefix, max(1, math.ceil(others99 / max(m, 1))))
            wait = max(c.prefix(k), c.expert(b)) if n > 1 else 0.0
            tail = max(c.prefix_tail(k), c.expert_tail(b))
            t_next = MEDIAN_MARGIN * (wait + c.prefix(k) + steps * c.expert(b) + m * c.prefix(k)) + tail
            converged = abs(t_next - t) < 1e-6
            t = min(t_next, UNBOUNDED_MS)
            if converged or t >= UNBOUNDED_MS:
                break
        busy = per_ms * (c.prefix(k) / k + steps * c.expert(b) / b)
        return Prediction(n, float(sum(rates)), t, busy, min(per_ms * t, n), k, b)

    def _predict_batch(self, rates: Sequence[float]) -> Prediction:
        c, n = self.costs, len(rates)
        b = min(n, self.capacity)
        rounds = math.ceil(n / self.capacity)

        def batch_ms(p99: bool) -> float:
            return c.prefix(b, p99) + c.num_steps * c.expert(b, p99)

        p99 = self.window_ms + (rounds + 1) * batch_ms(True)
        busy = sum(rates) / 1e3 * batch_ms(False) / b
        return Prediction(n, float(sum(rates)), p99, busy, float(b), b, b)

    def try_admit(self, robot: Hashable, rate_hz: float) -> Decision:
        if not 0 < rate_hz < math.inf:
            raise ValueError(f"rate_hz: expected a positive request rate, found {rate_hz}")
        rates = [*self.rates.values(), rate_hz]
        slo = min(self.slo_for(r) for r in rates)
        with_it = self.predict(rates)
        admitted = len(self.rates)
        why = ""
        if with_it.p99_ms > slo:
            why = f"the SLO is p99 <= {slo:g} ms and with this robot {with_it.describe()}"
        elif with_it.utilization > self.max_utilization:
            why = (f"with this robot {with_it.describe()}, above the {100 * self.max_utilization:.0f}% that keeps "
                   f"the SLO ({slo:g} ms) under load")  # fmt: skip
        elif with_it.rows > self.capacity:
            why = (f"with this robot {with_it.describe()}: {with_it.rows:.1f} rows in flight, more than the "
                   f"{self.capacity} the pool holds")  # fmt: skip
        if why and self.enabled:
            return Decision(False, with_it, slo, f"refused: {why}; {admitted} robots are admitted")
        self.rates[robot] = rate_hz
        return Decision(True, with_it, slo, f"admitted (SLO {slo:g} ms): {with_it.describe()}")

    def release(self, robot: Hashable) -> None:
        self.rates.pop(robot, None)
