"""SLO admission from stage costs, without a model or torch: on by default, each robot's SLO from its rate, the
prediction the docstring states, refusals that name the reason, never an eviction."""

from __future__ import annotations

import math

import pytest

from vla_rt.serve.admission import Admission
from vla_rt.serve.scheduler import StageCosts

# a prefix stage 10 ms whatever its rows, an expert stage 0.5 ms (p99 = median): easy numbers to check by hand
FLAT = StageCosts.flat(10.0, 0.5, (1, 2, 4), (1, 2, 4))


def test_prediction_follows_the_stated_model() -> None:
    admission = Admission(FLAT, policy="stage", capacity=4)
    one = admission.predict([10.0])
    # alone: 1.1 (P(1) + 10 E(1)), no tail (p99 = median here)
    assert (one.p99_ms, one.prefix_rows, one.expert_rows) == (pytest.approx(1.1 * (10.0 + 10 * 0.5)), 1, 1)
    assert one.utilization == pytest.approx(0.010 * (10.0 + 10 * 0.5))
    two = admission.predict([10.0, 10.0])
    # T = 38.5: the other's arrivals in 38.5 ms: a = 0.385, a99 = min(1, a + 2.33 sqrt(a)) = 1 -> one prefix between
    # its steps, and a stage in progress when it arrives: 1.1 (wait 10 + P 10 + 10 x 0.5 + 1 x 10)
    assert two.p99_ms == pytest.approx(38.5) and two.rows == pytest.approx(0.020 * 38.5)
    a = 0.01 * 49.5 * 2  # three robots: T = 49.5 ms, the others' arrivals during it
    assert math.ceil(a + 2.33 * math.sqrt(a)) >= 2 and admission.predict([10.0] * 3).p99_ms == pytest.approx(49.5)


def test_prediction_charges_one_stage_its_tail_not_every_stage() -> None:
    """The stage costs measured on the H200 (2026-12-03, π0 bf16, 2 views, prompt 20, chunk 50; 10 timings a
    bucket): the robots' p99 measured there was 19.6 ms alone and 43.8 ms for two. Every stage at its p99 predicted
    27.2 / 65.8 ms and admitted 2 robots of 8; the medians plus one tail bracket what was measured."""
    costs = StageCosts({1: 8.10, 2: 15.31, 4: 25.75, 8: 48.51}, {1: 17.23, 2: 35.93, 4: 26.34, 8: 102.63},
                       {1: 0.69, 2: 1.04, 4: 1.50, 8: 2.08, 16: 3.09, 32: 5.64},
                       {1: 1.00, 2: 1.41, 4: 1.95, 8: 2.54, 16: 3.55, 32: 6.24})  # fmt: skip
    admission = Admission(costs, policy="stage", capacity=32, slo_ms=80)
    alone, two = admission.predict([10.0]).p99_ms, admission.predict([10.0, 10.0]).p99_ms
    assert 19.6 <= alone <= 1.5 * 19.6 and abs(two - 43.8) <= 0.05 * 43.8
    assert [admission.try_admit(i, 10.0).admitted for i in range(8)] == [True] * 5 + [False] * 3


def test_one_slow_start_up_timing_does_not_shrink_the_fleet() -> None:
    """The cost model of the H200 fleet run at 264ff5a (15 timings a bucket): a 1-row prefix stage's largest timing
    was 24.2 ms against a median of 8.9, and charging that as the tail admitted 3 robots at 80 ms, where robots
    measured p99 43-46 ms at 3 and 93 ms at 8 without admission. The tail is now the p90's, so one slow timing of
    15 changes nothing; a slow p90 (most timings slow) still does."""
    steady = {1: 8.93, 2: 15.14, 4: 25.89, 8: 48.28}
    expert = {1: [0.68] * 15, 2: [1.04] * 15, 4: [1.50] * 15, 8: [2.05] * 15, 16: [3.01] * 15, 32: [5.53] * 15}

    def admitted(prefix: dict[int, list[float]]) -> int:
        admission = Admission(StageCosts.from_samples(prefix, expert, num_steps=10), policy="stage", capacity=32,
                              slo_ms=80)  # fmt: skip
        return sum(admission.try_admit(i, 10.0).admitted for i in range(16))

    calm = {k: [m] * 15 for k, m in steady.items()}
    one_slow = {k: [m] * 14 + [2.7 * m] for k, m in steady.items()}
    mostly_slow = {k: [m] * 12 + [2.7 * m] * 3 for k, m in steady.items()}  # the p90 is slow too
    assert admitted(one_slow) == admitted(calm) >= 5
    assert admitted(mostly_slow) < admitted(calm)
    assert Admission(StageCosts.from_samples(one_slow, expert, num_steps=10), policy="stage",
                     capacity=32).predict([10.0]).p99_ms <= 1.1 * (8.93 + 10 * 0.68) + 0.01  # fmt: skip


def test_each_robot_gets_its_period_as_slo_tightened_by_slo_ms() -> None:
    admission = Admission(FLAT, policy="stage", capacity=4)
    assert (admission.slo_for(10.0), admission.slo_for(50.0)) == (100.0, 20.0)
    assert Admission(FLAT, policy="stage", capacity=4, slo_ms=60).slo_for(10.0) == 60.0
    fast = admission.try_admit("fast", 80.0)  # 12.5 ms to answer, 16.5 ms predicted alone
    assert not fast.admitted and "the SLO is p99 <= 12.5 ms" in fast.message


def test_admission_refuses_the_robot_that_would_break_the_slo_and_never_evicts() -> None:
    admission = Admission(FLAT, policy="stage", capacity=4, slo_ms=66)  # robots at 5 Hz: 16.5, 38.5, 49.5, 60.5, 71.5
    decisions = [admission.try_admit(robot, 5.0) for robot in range(5)]
    assert [d.admitted for d in decisions] == [True] * 4 + [False]
    refusal = decisions[-1].message
    assert refusal.startswith("refused: the SLO is p99 <= 66 ms and with this robot 5 robots at 25 Hz")
    assert "predicted p99 71.5 ms" in refusal and refusal.endswith("4 robots are admitted")
    assert sorted(admission.rates) == list(range(4))  # nobody was evicted to make room
    admission.release(3)  # a robot leaves: the next one fits again
    assert admission.try_admit(9, 5.0).admitted


def test_a_slow_robot_is_held_to_the_tightest_slo_of_the_fleet() -> None:
    admission = Admission(FLAT, policy="stage", capacity=4)
    assert admission.try_admit("fast", 40.0).admitted  # 25 ms period: alone 16.5 ms
    slow = admission.try_admit("slow", 1.0)  # its own SLO is 1 s, but with it the fast robot's 25 ms breaks
    assert not slow.admitted and "the SLO is p99 <= 25 ms" in slow.message


def test_admission_refuses_when_the_gpu_would_be_too_busy_or_the_pool_too_small() -> None:
    cheap = StageCosts.flat(0.9, 0.09, (1, 2, 4), (1, 2, 4))
    admission = Admission(cheap, policy="stage", capacity=4)
    busy = admission.try_admit("greedy", 500.0)  # 500 Hz x (0.9 + 10 x 0.09) ms = 90% of the GPU, 1.98 ms of its 2
    assert not busy.admitted and "GPU busy 90%" in busy.message and "above the 80%" in busy.message
    small = Admission(StageCosts.flat(10.0, 0.1, (1,), (1,)), policy="stage", capacity=1)
    assert small.try_admit(0, 25.0).admitted  # 12.1 ms of its 40: a third of a row in flight
    pool = small.try_admit(1, 25.0)  # 34.1 ms, within the SLO and 55% busy, but 1.7 rows in flight
    assert not pool.admitted and "more than the 1 the pool holds" in pool.message


def test_without_admission_every_robot_is_admitted_with_its_prediction() -> None:
    admission = Admission(FLAT, policy="stage", capacity=4, enabled=False)
    decisions = [admission.try_admit(i, 50.0) for i in range(50)]
    assert all(d.admitted for d in decisions) and decisions[-1].prediction.p99_ms > 100


def test_whole_batch_prediction() -> None:
    admission = Admission(FLAT, policy="batch", capacity=4, window_ms=2)
    p = admission.predict([10.0] * 3)  # a batch of 3: 10 + 10 x 0.5 = 15 ms; the one in progress and its own
    assert (p.p99_ms, p.prefix_rows, p.utilization) == (2 + 2 * 15.0, 3, pytest.approx(30 * 0.015 / 3))
    assert admission.predict([10.0] * 9).p99_ms == 2 + 4 * 15.0  # 9 robots: 3 batches ahead, plus the one running


def test_arguments() -> None:
    with pytest.raises(ValueError, match="slo_ms: expected a positive latency bound, found -1"):
        Admission(FLAT, policy="stage", capacity=4, slo_ms=-1)
    with pytest.raises(ValueError, match="policy: expected one of"):
        Admission(FLAT, policy="eager", capacity=4)
    with pytest.raises(ValueError, match="rate_hz: expected a positive request rate, found nan"):
        Admission(FLAT, policy="stage", capacity=4).try_admit(0, float("nan"))
