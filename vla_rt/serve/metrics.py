"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own (several servers in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vla_rt.serve.scheduler import StageCosts

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2,
                     0.3, 0.5, 1.0, 2.0, 5.0)  # fmt: skip
ERROR_KINDS = ("decode", "observation", "too_large", "auth", "refused", "internal")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Counters and histograms the protocol front end and the worker update; `render()` is the /metrics body."""

    def __init__(self, max_rows: int, max_prefix: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("vla_rt_requests", "Observations answered with actions", registry=r)
        self.errors = Counter("vla_rt_errors", "Requests or connections ended by an error, by kind", ["kind"],
                              registry=r)  # fmt: skip
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        self.admitted = Counter("vla_rt_robots_admitted", "Robot connections admitted", registry=r)
        self.refused = Counter("vla_rt_robots_refused", "Robot connections refused by SLO admission", registry=r)
        self.connected = Gauge("vla_rt_robots_connected", "Robots connected now", registry=r)
        self.superseded = Counter("vla_rt_superseded", "Queued observations replaced by a newer one", registry=r)
        self.batch_size = Histogram("vla_rt_batch_size", "Mean rows in a request's expert stages, per request",
                                    registry=r, buckets=tuple(float(b) for b in range(1, max_rows + 1)))  # fmt: skip
        rows = tuple(float(b) for b in range(1, max(max_rows, max_prefix) + 1))
        self.stage_rows = Histogram("vla_rt_stage_rows", "Rows per stage, by stage (prefix: joining rows)",
                                    ["stage"], registry=r, buckets=rows)  # fmt: skip
        self.stage_s = Histogram("vla_rt_stage_seconds", "Stage run time by stage (stack, copies, run, wait)",
                                 ["stage"], registry=r, buckets=LATENCY_BUCKETS_S)  # fmt: skip
        self.queue_s = Histogram("vla_rt_queue_seconds", "Enqueue to the request's prefix stage", registry=r,
                                 buckets=LATENCY_BUCKETS_S)  # fmt: skip
        self.total_s = Histogram("vla_rt_request_seconds", "Frame received to answer ready, per request",
                                 registry=r, buckets=LATENCY_BUCKETS_S)  # fmt: skip
        self.cost = Gauge("vla_rt_cost_model_seconds", "Start-up cost model: stage latency per bucket of rows",
                          ["stage", "rows", "quantile"], registry=r)  # fmt: skip

    def set_cost_model(self, costs: StageCosts) -> None:
        measured_p90 = costs.prefix_p90_ms is not None and costs.expert_p90_ms is not None
        quantiles = (0.5, 0.9, 0.99) if measured_p90 else (0.5, 0.99)
        for stage, cost, buckets in (("prefix", costs.prefix, costs.prefix_buckets),
                                     ("expert", costs.expert, costs.expert_buckets)):  # fmt: skip
            for rows in buckets:
                for quantile in quantiles:
                    self.cost.labels(stage, str(rows), str(quantile)).set(cost(rows, quantile=quantile) / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
