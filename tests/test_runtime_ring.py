"""Timestamped ring buffer: capacity, overwrite + dropped counter, latest, at(t), waits, concurrency."""

import threading

import pytest

from vla_rt.clock import SimClock
from vla_rt.runtime.ring import RingClosed, TimestampedRing


def filled(n: int, capacity: int = 4) -> TimestampedRing[str]:
    ring: TimestampedRing[str] = TimestampedRing(capacity)
    for i in range(n):
        ring.write(10.0 + i, f"v{i}")
    return ring


def test_empty_ring():
    ring = filled(0)
    assert ring.latest() is None and ring.latest(3) == [] and ring.at(100.0) is None
    assert len(ring) == 0 and ring.dropped == 0


def test_overwrites_oldest_and_counts_drops():
    ring = filled(7, capacity=4)
    assert len(ring) == 4 and ring.written == 7 and ring.dropped == 3
    assert [item.value for item in ring.latest(10)] == ["v3", "v4", "v5", "v6"]
    assert ring.get(2) is None and ring.get(3).value == "v3" and ring.get(7) is None


def test_latest_and_latest_n():
    ring = filled(3)
    newest = ring.latest()
    assert (newest.seq, newest.t, newest.value) == (2, 12.0, "v2")
    assert [i.seq for i in ring.latest(2)] == [1, 2]


def test_at_returns_item_whose_interval_covers_t():
    ring = filled(6, capacity=4)  # holds t = 12, 13, 14, 15
    assert ring.at(11.99) is None  # before the oldest held item
    assert ring.at(12.0).value == "v2"
    assert ring.at(13.5).value == "v3"
    assert ring.at(14.999).value == "v4"
    assert ring.at(15.0).value == "v5" and ring.at(1e9).value == "v5"


def test_equal_timestamps_allowed_newest_wins_but_going_back_raises():
    ring = filled(2)
    ring.write(11.0, "same-time")
    assert ring.at(11.0).value == "same-time"
    with pytest.raises(ValueError, match="older"):
        ring.write(10.5, "late")


def test_non_finite_timestamps_are_refused():
    """The bug: a NaN stamp passed the order check (NaN < x is false), and so did every write after it, going back or
    not; a chunk or frame stamped NaN is never judged stale."""
    ring = filled(2)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match=rf"ring: timestamp {bad!r} is not a finite clock time"):
            ring.write(bad, "bad")
    assert ring.written == 2 and ring.latest().value == "v1"
    with pytest.raises(ValueError, match="older than"):
        ring.write(5.0, "back in time")


def test_close_refuses_writes_and_wakes_waiters():
    clock = SimClock()
    ring: TimestampedRing[int] = TimestampedRing(4, clock)
    got = []
    clock.start_thread(lambda: got.append((ring.wait_newer(-1, None), clock.now())), "reader")
    clock.advance(1.0)
    assert got == []
    ring.close()
    clock.advance(0.0)
    assert got == [(None, 1.0)]
    with pytest.raises(RingClosed):
        ring.write(2.0, 1)


def test_wait_newer_in_simulated_time():
    clock = SimClock()
    ring: TimestampedRing[int] = TimestampedRing(4, clock)
    got = []

    def reader():
        got.append(("timeout", ring.wait_newer(-1, 0.2), clock.now()))
        item = ring.wait_newer(-1, 5.0)
        got.append(("item", item.value, clock.now()))
        got.append(("immediate", ring.wait_newer(-1, 5.0).value, clock.now()))

    def writer():
        clock.sleep(0.5)
        ring.write(clock.now(), 42)

    clock.start_thread(reader, "reader")
    clock.start_thread(writer, "writer")
    clock.advance(1.0)
    assert got == [("timeout", None, 0.2), ("item", 42, 0.5), ("immediate", 42, 0.5)]


def test_one_writer_many_readers_smoke():
    """Real threads: readers see consistent snapshots while the writer overwrites at full speed."""
    ring: TimestampedRing[int] = TimestampedRing(64)
    n_items = 20000
    failures: list[str] = []
    done = threading.Event()

    def reader():
        last_seq = -1
        while not done.is_set():
            newest = ring.latest()
            if newest is None:
                continue
            if newest.seq < last_seq or newest.value != newest.seq:
                failures.append(f"latest went back or torn: {newest} after {last_seq}")
            last_seq = newest.seq
            window = ring.latest(8)
            seqs = [i.seq for i in window]
            if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
                failures.append(f"latest(n) not consecutive: {seqs}")
            probe = newest.t - 3.5
            item = ring.at(probe)
            if item is not None and not (item.t <= probe < item.t + 1.0):
                failures.append(f"at({probe}) -> {item}")
            got = ring.wait_newer(newest.seq, 0.5)
            if got is not None and got.seq <= newest.seq:
                failures.append("wait_newer returned an old item")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for r in readers:
        r.start()
    for i in range(n_items):
        ring.write(float(i), i)
    done.set()
    for r in readers:
        r.join(10.0)
    assert failures == []
    assert ring.written == n_items and ring.dropped == n_items - 64
    assert ring.latest().value == n_items - 1
