"""The scheduler without a model or torch: buckets, which stage runs next, the stage queue (rows joining and leaving
at every step boundary, fairness, freshest frame), driven by a simulated GPU on an injected clock and cost model."""

from __future__ import annotations

import threading
import time

import pytest

from vla_rt.serve.scheduler import (
    RowView,
    StageCosts,
    StagePlan,
    StageQueue,
    batch_buckets,
    bucket_for,
    choose_stage,
)

# injected stage costs (ms): a prefix stage costs 10 ms a row; an expert stage 1 ms, a little more for more rows
COSTS = StageCosts({1: 10.0, 2: 20.0, 4: 40.0}, {1: 12.0, 2: 23.0, 4: 45.0},
                   {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5}, {1: 1.2, 2: 1.3, 4: 1.4, 8: 1.8}, num_steps=10)  # fmt: skip


def test_buckets_are_powers_of_two_then_the_maximum() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_for((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="max_batch: expected a positive batch size, found 0"):
        batch_buckets(0)
    with pytest.raises(ValueError, match="at most the largest bucket, 8"):
        bucket_for((1, 2, 4, 8), 9)


def test_stage_costs_per_bucket() -> None:
    assert (COSTS.prefix(3), COSTS.prefix(3, p99=True), COSTS.prefix(9)) == (40.0, 45.0, 3 * 40.0)
    assert (COSTS.expert(3), COSTS.expert(8, p99=True), COSTS.expert(50)) == (1.2, 1.8, 1.5)
    assert COSTS.request_ms() == 10.0 + 10 * 1.0  # one row alone: its prefix and its ten steps
    assert COSTS.to_json()["prefix"]["2"] == {"median_ms": 20.0, "p99_ms": 23.0}
    with pytest.raises(ValueError, match="the same expert buckets for median and p99"):
        StageCosts({1: 1.0}, {1: 1.0}, {1: 1.0}, {2: 1.0})
    with pytest.raises(ValueError, match="the same prefix buckets for median and p90"):
        StageCosts({1: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0}, 10, {2: 1.0}, {1: 1.0})


def test_stage_costs_from_timings_keep_median_p90_and_p99() -> None:
    timings = [10.0 + i for i in range(11)] + [40.0]  # 12 timings of a bucket, one of them slow: 10..20, 40
    costs = StageCosts.from_samples({1: timings}, {1: [1.0, 2.0, 3.0]}, num_steps=10)
    assert costs.prefix(1) == pytest.approx(15.5)  # numpy's linear percentiles
    assert costs.prefix(1, quantile=0.9) == pytest.approx(19.9)
    assert costs.prefix(1, True) == pytest.approx(20.0 + 0.89 * 20.0)  # the slow one decides the p99
    assert (costs.prefix_tail(1), costs.expert_tail(1)) == (pytest.approx(4.4), pytest.approx(0.8))
    assert costs.to_json()["prefix"]["1"]["p90_ms"] == pytest.approx(19.9)
    assert COSTS.prefix_tail(2) == 3.0  # no p90 measured: the p99's tail
    with pytest.raises(ValueError, match="expected a quantile of \\[0.5, 0.9, 0.99\\], found 0.95"):
        costs.expert(1, quantile=0.95)  # not silently the median
    with pytest.raises(ValueError, match="timings for every expert bucket, found none for \\[8\\]"):
        StageCosts.from_samples({1: [1.0]}, {1: [1.0], 8: []}, num_steps=10)


def test_stage_costs_keep_the_kernels_own_time_beside_the_wall_clock() -> None:
    """The GPU medians (CUDA events) ride along the wall-clock costs, give a lone row's GPU time, and must cover
    the same buckets; a CPU's costs have none (None, not zero)."""
    costs = StageCosts({1: 12.7, 2: 17.0}, {1: 25.6, 2: 35.9}, {1: 0.74, 4: 1.5}, {1: 1.05, 4: 1.9}, 10,
                       prefix_gpu_ms={1: 6.9, 2: 12.1}, expert_gpu_ms={1: 0.66, 4: 1.4})  # fmt: skip
    assert costs.request_gpu_ms() == pytest.approx(6.9 + 10 * 0.66)
    assert costs.request_ms() == pytest.approx(12.7 + 10 * 0.74)  # admission still charges the wall clock
    assert (
        costs.to_json()["prefix"]["2"]["gpu_median_ms"] == 12.1
        and "gpu_median_ms" not in COSTS.to_json()["prefix"]["2"]
    )
    assert COSTS.request_gpu_ms() is None
    with pytest.raises(ValueError, match="the same expert buckets for median and GPU time"):
        StageCosts({1: 1.0}, {1: 1.0}, {1: 1.0}, {1: 1.0}, expert_gpu_ms={2: 1.0})


def _plan(in_flight, waiting, now=0.0, policy="stage", capacity=8, max_prefix=4, window_s=0.002,
          joining=0) -> StagePlan:  # fmt: skip
    return choose_stage(policy, now, in_flight, waiting, capacity=capacity, max_prefix=max_prefix, costs=COSTS,
                        window_s=window_s, joining=joining)  # fmt: skip


def test_overlap_policy_starts_one_prefix_beside_the_steps_and_joins_it() -> None:
    tight = [RowView(steps=5, deadline=0.008), RowView(steps=0, deadline=1.0)]  # the stage policy would step first
    assert _plan(tight, [0.0] * 3, policy="overlap") == StagePlan("prefix", 3)  # P does not stop the rows in flight
    assert _plan(tight, [0.0] * 3, policy="overlap", joining=2) == StagePlan("expert")  # one prefix at a time
    assert _plan([], [0.0] * 3, policy="overlap", joining=2) == StagePlan("join")  # nothing else to run
    assert _plan([RowView(0, 1.0)] * 6, [0.0] * 3, policy="overlap", joining=2) == StagePlan("expert")  # pool held
    assert _plan([], [0.0] * 9, policy="overlap", capacity=5, joining=0) == StagePlan("prefix", 4)
    assert _plan([], [], policy="overlap") == StagePlan("wait")


def test_overlapped_prefix_rows_are_in_flight_only_once_joined() -> None:
    clock = [0.0]
    queue = StageQueue(policy="overlap", capacity=4, max_prefix=2, costs=COSTS, window_s=0.0, clock=lambda: clock[0])
    for robot in "abc":
        queue.submit(robot, robot, lambda _: None, deadline=1.0)
    first = queue.next_stage(timeout_s=0)
    assert first.kind == "prefix" and [r.request.robot for r in first.rows] == ["a", "b"] and queue.in_flight == 0
    join = queue.next_stage(timeout_s=0)  # "c" waits: one prefix at a time, and nothing is in flight to step
    assert join.kind == "join" and [r.id for r in join.rows] == [r.id for r in first.rows]
    queue.submit("a", "a2", lambda _: None, deadline=1.0)  # a robot whose row is joining waits for it to leave
    clock[0] = 0.005
    queue.prefix_done(first)
    assert queue.in_flight == 2 and all(r.prefix_s == pytest.approx(0.005) for r in first.rows)
    second = queue.next_stage(timeout_s=0)
    assert second.kind == "prefix" and [r.request.robot for r in second.rows] == ["c"]
    assert queue.next_stage(timeout_s=0).kind == "expert"
    queue.prefix_done(second, ok=False)  # a failed prefix: its rows never fly, the others are untouched
    assert queue.in_flight == 2 and all(r.stages == 0 for r in first.rows)


def test_stage_policy_runs_the_prefix_for_arrivals_when_the_rows_in_flight_can_afford_it() -> None:
    relaxed = [RowView(steps=s, deadline=1.0) for s in (0, 3, 9)]  # due in a second: any prefix fits
    assert _plan([], [0.0] * 6) == StagePlan("prefix", 4)  # idle: as many as a prefix stage takes
    assert _plan(relaxed, [0.0] * 3) == StagePlan("prefix", 3)
    assert _plan(relaxed, [0.0] * 9, capacity=5) == StagePlan("prefix", 2)  # only two rows free in the pool
    assert _plan([RowView(0, 1.0)] * 8, [0.0]) == StagePlan("expert")  # the pool is full
    assert _plan(relaxed, []) == StagePlan("expert")
    assert _plan([], []) == StagePlan("wait")


def test_a_row_near_its_deadline_is_not_delayed_by_a_prefix() -> None:
    # 5 steps left at 1.0-1.2 ms: 5-6 ms; with a prefix of k rows first: 10k ms more
    tight = [RowView(steps=5, deadline=0.020), RowView(steps=0, deadline=1.0)]
    assert _plan(tight, [0.0] * 3) == StagePlan("prefix", 1)  # 10 + 6 <= 20 ms, but not 20 or 40 ms more
    tighter = [RowView(steps=5, deadline=0.008), RowView(steps=0, deadline=1.0)]
    assert _plan(tighter, [0.0] * 3) == StagePlan("expert")  # even one row would make it late: step first
    late = [RowView(steps=0, deadline=0.001)]  # late whatever runs next: it does not hold the arrivals back
    assert _plan(late, [0.0] * 2) == StagePlan("prefix", 2)


def test_batch_policy_waits_for_the_batch_in_flight_and_for_company() -> None:
    assert _plan([RowView(3, 1.0)], [0.0] * 5, policy="batch") == StagePlan("expert")  # nobody joins a batch
    assert _plan([], [0.0], now=0.001, policy="batch") == StagePlan("wait", until=0.002)
    assert _plan([], [0.0], now=0.003, policy="batch") == StagePlan("prefix", 1)
    assert _plan([], [0.0] * 9, policy="batch", max_prefix=8) == StagePlan("prefix", 8)  # a full batch: at once


class SimulatedGpu:
    """Runs the queue's stages on a virtual clock: a stage advances it by its cost (the injected COSTS); a fake
    engine counts each row's steps. Records every stage."""

    def __init__(self, queue: StageQueue, clock: list[float]):
        self.queue, self.clock, self.steps, self.log = queue, clock, {}, []

    def run_one(self) -> bool:
        stage = self.queue.next_stage(timeout_s=0)
        if stage is None:
            return False
        rows = [r.id for r in stage.rows]
        if stage.kind == "prefix":
            self.clock[0] += COSTS.prefix(len(rows)) / 1e3
            self.steps.update(dict.fromkeys(rows, 0))
            self.queue.prefix_done(stage)
            self.log.append(("prefix", [r.request.robot for r in stage.rows], None))
            return True
        self.log.append(("expert", [r.request.robot for r in stage.rows], sorted(self.steps[i] for i in rows)))
        self.clock[0] += COSTS.expert(len(rows)) / 1e3
        for i in rows:
            self.steps[i] += 1
        finished = {i for i in rows if self.steps[i] == COSTS.num_steps}
        for row in self.queue.expert_done(stage, finished):
            for callback in row.request.callbacks:
                callback((row.request.robot, row.request.payload, self.clock[0]))
        return True


def test_rows_join_and_leave_at_every_stage_boundary_and_every_robot_is_served_in_turn() -> None:
    clock = [0.0]
    queue = StageQueue(policy="stage", capacity=8, max_prefix=4, costs=COSTS, window_s=0.0, clock=lambda: clock[0])
    gpu = SimulatedGpu(queue, clock)
    robots, period = 6, 0.1
    due = {r: r * 0.013 for r in range(robots)}  # staggered phases: arrivals land between stages
    answers: dict[int, list[tuple[int, float, float]]] = {r: [] for r in range(robots)}
    sent = {r: 0 for r in range(robots)}
    while clock[0] < 1.0:
        for r in range(robots):
            if due[r] <= clock[0] and sent[r] == len(answers[r]):  # openpi's client: one request at a time
                t0 = due[r]

                def answer(result, r=r, t0=t0):
                    answers[r].append((result[1], t0, result[2]))

                queue.submit(r, sent[r], answer, deadline=t0 + period)
                sent[r] += 1
                due[r] += period
        if not gpu.run_one():
            clock[0] = min(due.values())
    assert all(len(a) >= 9 for a in answers.values()), {r: len(a) for r, a in answers.items()}  # every robot, 10 Hz
    assert all([p for p, _, _ in a] == list(range(len(a))) for a in answers.values())  # in order, none lost
    experts = [steps for kind, _, steps in gpu.log if kind == "expert"]
    assert any(len(set(s)) > 1 for s in experts)  # rows at different steps shared an expert stage
    kinds = [kind for kind, _, _ in gpu.log]
    assert any(a == "expert" and b == "prefix" and c == "expert" for a, b, c in zip(kinds, kinds[1:], kinds[2:]))
    assert all(len(set(robots_)) == len(robots_) for _, robots_, _ in gpu.log)  # never two rows of one robot
    latencies = [done - t0 for a in answers.values() for _, t0, done in a]
    assert max(latencies) < 0.1  # within every robot's period (6 robots x 10 Hz fit these costs easily)
    assert all(max(s) < COSTS.num_steps for s in experts)  # a row leaves right after its 10th step, never lingers


def test_arrivals_join_first_come_first_served() -> None:
    clock = [0.0]
    queue = StageQueue(policy="stage", capacity=8, max_prefix=2, costs=COSTS, window_s=0.0, clock=lambda: clock[0])
    for i, robot in enumerate("abcde"):
        clock[0] = i * 0.001
        queue.submit(robot, i, lambda _: None, deadline=10.0)
    joined = []
    for _ in range(3):
        stage = queue.next_stage(timeout_s=0)
        assert stage.kind == "prefix"
        joined.append([r.request.robot for r in stage.rows])
        queue.prefix_done(stage)
    assert joined == [["a", "b"], ["c", "d"], ["e"]]


def test_newer_observation_replaces_the_waiting_one_and_keeps_its_place() -> None:
    queue = StageQueue(policy="stage", capacity=4, max_prefix=4, costs=COSTS, window_s=0.0)
    got = []
    queue.submit("a", "a1", got.append, deadline=1e9)
    queue.submit("b", "b1", got.append, deadline=1e9)
    assert queue.submit("a", "a2", got.append, deadline=1e9) is True  # replaced, still first in line
    stage = queue.next_stage(timeout_s=1)
    rows = [(r.request.robot, r.request.payload, r.request.superseded, len(r.request.callbacks)) for r in stage.rows]
    assert rows == [("a", "a2", 1, 2), ("b", "b1", 0, 1)]


def test_a_robot_with_a_row_in_flight_waits_for_it_to_leave() -> None:
    queue = StageQueue(policy="stage", capacity=4, max_prefix=4, costs=COSTS, window_s=0.0)
    queue.submit("a", 1, lambda _: None, deadline=1e9)
    first = queue.next_stage(timeout_s=1)
    queue.prefix_done(first)
    queue.submit("a", 2, lambda _: None, deadline=1e9)  # its next frame (a client that pipelines)
    queue.submit("b", 3, lambda _: None, deadline=1e9)
    stage = queue.next_stage(timeout_s=1)
    assert stage.kind == "prefix" and [r.request.robot for r in stage.rows] == ["b"]
    queue.prefix_done(stage)
    for _ in range(COSTS.num_steps):
        stage = queue.next_stage(timeout_s=1)
        assert stage.kind == "expert"
        done = queue.expert_done(stage, {r.id for r in stage.rows if r.steps + 1 == COSTS.num_steps})
    assert [r.request.robot for r in done] == ["a", "b"]  # (b joined before either took a step)
    stage = queue.next_stage(timeout_s=1)  # now a's second frame may join
    assert stage.kind == "prefix" and [r.request.payload for r in stage.rows] == [2]


def test_the_engine_and_the_scheduler_must_agree_on_who_finished() -> None:
    queue = StageQueue(policy="stage", capacity=4, max_prefix=4, costs=COSTS, window_s=0.0)
    queue.submit("a", 1, lambda _: None, deadline=1e9)
    queue.prefix_done(queue.next_stage(timeout_s=1))
    with pytest.raises(RuntimeError, match=r"the engine finished rows \[0\], the scheduler counted \[\]"):
        queue.expert_done(queue.next_stage(timeout_s=1), {0})


def test_a_failed_stage_drops_its_rows() -> None:
    queue = StageQueue(policy="stage", capacity=4, max_prefix=4, costs=COSTS, window_s=0.0)
    queue.submit("a", 1, lambda _: None, deadline=1e9)
    queue.prefix_done(queue.next_stage(timeout_s=1), ok=False)
    assert queue.in_flight == 0 and queue.next_stage(timeout_s=0) is None
    queue.submit("b", 1, lambda _: None, deadline=1e9)
    queue.prefix_done(queue.next_stage(timeout_s=1))
    assert [r.request.robot for r in queue.expert_done(queue.next_stage(timeout_s=1), None)] == ["b"]
    assert queue.in_flight == 0


def test_batch_window_waits_then_forms_the_batch() -> None:
    queue = StageQueue(policy="batch", capacity=4, max_prefix=4, costs=COSTS, window_s=0.15)
    queue.submit("a", 1, lambda _: None, deadline=1e9)
    threading.Timer(0.05, lambda: queue.submit("b", 2, lambda _: None, deadline=1e9)).start()
    t0 = time.monotonic()
    stage = queue.next_stage(timeout_s=2)
    waited = time.monotonic() - t0
    assert [r.request.robot for r in stage.rows] == ["a", "b"]
    assert 0.1 <= waited < 1.0  # it waited for the window (company came at 50 ms), not for a full batch


def test_cancel_drops_a_vanished_robots_request_and_close_wakes_the_worker() -> None:
    queue = StageQueue(policy="stage", capacity=2, max_prefix=2, costs=COSTS, window_s=0.0)
    queue.submit("gone", 1, lambda _: None, deadline=1e9)
    assert queue.cancel("gone").payload == 1 and len(queue) == 0 and queue.cancel("gone") is None
    assert queue.next_stage(timeout_s=0.05) is None
    threading.Timer(0.05, queue.close).start()
    assert queue.next_stage() is None  # blocks until closed
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit("late", 1, lambda _: None, deadline=1e9)
    with pytest.raises(ValueError, match="policy: expected one of"):
        StageQueue(policy="eager", capacity=2, max_prefix=2, costs=COSTS, window_s=0.0)
