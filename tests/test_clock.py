"""Clocks: the wall clock, and the SimClock's deterministic discrete-event execution of real threads."""

import threading
import time

import pytest

from vla_rt.clock import MonotonicClock, SimClock, SimThreadError


def test_monotonic_clock_sleeps_until_deadline_and_condition_times_out():
    clock = MonotonicClock()
    t0 = clock.now()
    clock.sleep_until(t0 + 0.02)
    assert clock.now() >= t0 + 0.02
    cond = clock.condition()
    start = clock.now()
    assert cond.wait_until(lambda: False, start + 0.03) is False
    assert clock.now() >= start + 0.03


def test_monotonic_condition_wakes_on_notify():
    clock = MonotonicClock()
    cond = clock.condition()
    box = []

    def writer():
        time.sleep(0.02)
        box.append(1)
        cond.notify_all()

    threading.Thread(target=writer).start()
    assert cond.wait_until(lambda: bool(box), clock.now() + 10.0) is True


def _two_periodic_threads(clock: SimClock) -> list[tuple[str, float]]:
    trace: list[tuple[str, float]] = []

    def periodic(name: str, period: float, count: int):
        def body():
            for _ in range(count):
                trace.append((name, clock.now()))
                clock.sleep(period)

        return body

    clock.start_thread(periodic("fast", 0.010, 7), "fast")
    clock.start_thread(periodic("slow", 0.025, 3), "slow")
    clock.advance(1.0)
    return trace


def test_sim_clock_interleaves_threads_in_time_order_deterministically():
    trace = _two_periodic_threads(SimClock())
    times = [t for _, t in trace]
    assert times == sorted(times)
    assert [(n, round(t, 6)) for n, t in trace] == [
        ("fast", 0.0),
        ("slow", 0.0),
        ("fast", 0.01),
        ("fast", 0.02),
        ("slow", 0.025),
        ("fast", 0.03),
        ("fast", 0.04),
        ("slow", 0.05),  # equal wake times run in scheduling order: slow went to sleep first (at 0.025)
        ("fast", 0.05),
        ("fast", 0.06),
    ]
    assert _two_periodic_threads(SimClock()) == trace  # same code, same trace, however loaded the machine is


def test_sim_clock_long_simulated_sleep_costs_no_real_time():
    clock = SimClock()
    woke = []
    clock.start_thread(lambda: (clock.sleep(3600.0), woke.append(clock.now())), "sleeper")
    start = time.perf_counter()
    clock.advance(7200.0)
    assert woke == [3600.0]
    assert clock.now() == 7200.0
    assert time.perf_counter() - start < 2.0


def test_sim_condition_wakes_waiter_at_notify_time_or_deadline():
    clock = SimClock()
    cond = clock.condition()
    flag = []
    results = []

    def waiter():
        results.append(("notified", cond.wait_until(lambda: bool(flag), clock.now() + 1.0), clock.now()))
        results.append(("timeout", cond.wait_until(lambda: len(flag) > 1, clock.now() + 0.25), clock.now()))

    def notifier():
        clock.sleep(0.3)
        flag.append(1)
        cond.notify_all()

    clock.start_thread(waiter, "waiter")
    clock.start_thread(notifier, "notifier")
    clock.advance(2.0)
    assert results == [("notified", True, 0.3), ("timeout", False, 0.55)]


def test_sim_clock_non_participant_sleep_drives_time():
    clock = SimClock(start=5.0)
    seen = []
    clock.start_thread(lambda: [seen.append(clock.now()) or clock.sleep(0.1) for _ in range(3)], "ticker")
    clock.sleep_until(5.15)  # the test thread is the driver here
    assert clock.now() == 5.15
    assert [round(t, 9) for t in seen] == [5.0, 5.1]


def test_sim_clock_reraises_participant_errors_in_driver():
    clock = SimClock()

    def broken():
        clock.sleep(0.1)
        raise ValueError("boom")

    clock.start_thread(broken, "broken")
    with pytest.raises(SimThreadError, match="broken.*boom"):
        clock.advance(1.0)


def test_sim_clock_join_drives_until_thread_returns():
    clock = SimClock()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            clock.sleep(0.05)

    thread = clock.start_thread(loop, "loop")
    clock.advance(0.2)
    stop.set()
    assert clock.join_thread(thread, timeout_s=1.0) is True
    assert not thread.is_alive()
    assert clock.now() == pytest.approx(0.25)  # it noticed the flag at its next wake-up


def test_sim_clock_refuses_driving_from_a_participant():
    clock = SimClock()
    errors = []

    def rogue():
        try:
            clock.advance(1.0)
        except RuntimeError as err:
            errors.append(str(err))

    clock.start_thread(rogue, "rogue")
    clock.advance(0.1)
    assert errors and "participant cannot drive" in errors[0]
