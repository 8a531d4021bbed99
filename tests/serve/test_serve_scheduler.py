"""The scheduler without a model: buckets, the batch queue (freshest frame, fairness, window), SLO admission."""

from __future__ import annotations

import threading
import time

import pytest

from vla_rt.serve.scheduler import Admission, BatchQueue, CostModel, batch_buckets, bucket_for

# An injected cost model: batch 1 takes 10 ms, 8 takes 20 ms (p99 a little above the median).
COST = CostModel({1: 10.0, 2: 11.0, 4: 14.0, 8: 20.0}, {1: 12.0, 2: 13.0, 4: 17.0, 8: 25.0})


def test_buckets_are_powers_of_two_then_the_maximum() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_for((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="max_batch: expected a positive batch size, found 0"):
        batch_buckets(0)
    with pytest.raises(ValueError, match="at most the largest bucket, 8"):
        bucket_for((1, 2, 4, 8), 9)


def test_prediction_follows_the_stated_model() -> None:
    admission = Admission(COST, slo_ms=60, window_ms=2)
    p = admission.predict([10.0] * 3)  # 3 robots -> bucket 4: 2 ms + 2 x 17 ms; busy 30/s x 14 ms / 4
    assert (p.batch, p.p99_ms, p.utilization) == (4, 36.0, pytest.approx(30 * 0.014 / 4))
    p = admission.predict([10.0] * 20)  # 20 robots > 8: ceil(20/8) = 3 batches ahead + the one running
    assert (p.batch, p.p99_ms) == (8, 2 + 4 * 25.0)


def test_admission_refuses_the_robot_that_would_break_the_slo_and_never_evicts() -> None:
    admission = Admission(COST, slo_ms=60, window_ms=2)  # 8 robots: 2 + 2 x 25 = 52 ms; 9: 2 + 3 x 25 = 77 ms
    decisions = [admission.try_admit(robot, 10.0) for robot in range(9)]
    assert [d.admitted for d in decisions] == [True] * 8 + [False]
    refusal = decisions[-1].message
    assert "p99 <= 60 ms" in refusal and "predicted p99 77.0 ms" in refusal and "8 robots are admitted" in refusal
    assert sorted(admission.rates) == list(range(8))  # nobody was evicted to make room
    admission.release(3)  # a robot leaves: the next one fits again
    assert admission.try_admit(9, 10.0).admitted


def test_admission_refuses_when_the_gpu_would_be_too_busy() -> None:
    admission = Admission(COST, slo_ms=60, window_ms=2)
    assert not admission.try_admit("alone", 150.0).admitted  # one robot never batches with itself: 150 x 10 ms
    assert all(admission.try_admit(i, 50.0).admitted for i in range(6))  # batch 8: 300 Hz x 20 ms / 8 = 75%
    decision = admission.try_admit(6, 50.0)  # 350 Hz x 20 ms / 8 = 88%, though p99 (52 ms) would still fit
    assert not decision.admitted and "GPU busy 88%" in decision.message and "above the 80%" in decision.message


def test_no_slo_admits_everyone() -> None:
    admission = Admission(COST, slo_ms=None, window_ms=2)
    assert all(admission.try_admit(i, 50.0).admitted for i in range(100))


def test_newer_observation_replaces_the_queued_one_and_keeps_its_place() -> None:
    queue = BatchQueue((1, 2, 4), window_s=0.0)
    got = []
    queue.submit("a", "a1", got.append)
    queue.submit("b", "b1", got.append)
    assert queue.submit("a", "a2", got.append) is True  # replaced, still first in line
    batch = queue.next_batch(timeout_s=1)
    assert [(r.robot, r.payload, r.superseded, len(r.callbacks)) for r in batch.requests] == [
        ("a", "a2", 1, 2), ("b", "b1", 0, 1)]  # fmt: skip
    assert batch.bucket == 2


def test_a_robot_never_has_two_rows_in_a_batch_and_order_is_first_come() -> None:
    queue = BatchQueue((1, 2, 4), window_s=0.0)
    for i in range(6):
        queue.submit(f"r{i}", i, lambda _: None)
    for i in range(3):
        queue.submit(f"r{i}", 10 + i, lambda _: None)  # three robots already queued send again
    first, second = queue.next_batch(timeout_s=1), queue.next_batch(timeout_s=1)
    assert [r.robot for r in first.requests] == ["r0", "r1", "r2", "r3"] and first.bucket == 4
    assert [r.payload for r in first.requests] == [10, 11, 12, 3]
    assert [r.robot for r in second.requests] == ["r4", "r5"] and second.bucket == 2


def test_a_batch_waits_at_most_the_window_for_company() -> None:
    queue = BatchQueue((1, 2, 4), window_s=0.15)
    queue.submit("a", 1, lambda _: None)
    threading.Timer(0.05, lambda: queue.submit("b", 2, lambda _: None)).start()
    t0 = time.monotonic()
    batch = queue.next_batch(timeout_s=2)
    waited = time.monotonic() - t0
    assert [r.robot for r in batch.requests] == ["a", "b"]
    assert 0.1 <= waited < 1.0  # it waited for the window (company came at 50 ms), not for a full bucket


def test_a_full_bucket_does_not_wait() -> None:
    queue = BatchQueue((1, 2), window_s=5.0)
    queue.submit("a", 1, lambda _: None)
    queue.submit("b", 2, lambda _: None)
    t0 = time.monotonic()
    assert len(queue.next_batch(timeout_s=1).requests) == 2 and time.monotonic() - t0 < 1.0


def test_cancel_drops_a_vanished_robots_request_and_close_wakes_the_worker() -> None:
    queue = BatchQueue((1, 2), window_s=0.0)
    queue.submit("gone", 1, lambda _: None)
    assert queue.cancel("gone").payload == 1 and len(queue) == 0 and queue.cancel("gone") is None
    assert queue.next_batch(timeout_s=0.05) is None
    threading.Timer(0.05, queue.close).start()
    assert queue.next_batch() is None  # blocks until closed
    with pytest.raises(RuntimeError, match="closed"):
        queue.submit("late", 1, lambda _: None)
