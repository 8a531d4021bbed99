"""No observation may span a camera stall: the inference thread never hands the policy an image from before an
outage as if it were current (`InferenceLoop._observation`). Rings, frames, clock and event log are the runtime's
own; the bound is the runtime's camera_stall_timeout_s (here 0.1 s)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vla_rt.clock import SimClock
from vla_rt.robot.camera import Frame
from vla_rt.runtime.events import EventLog
from vla_rt.runtime.inference_thread import InferenceLoop
from vla_rt.runtime.ring import TimestampedRing

STALL_S = 0.1


def _loop(views, cameras=("cam",)):
    clock = SimClock()
    rings = {name: TimestampedRing(8, clock, f"frames/{name}") for name in cameras}
    log = EventLog(None, clock)
    loop = InferenceLoop(
        None, rings, TimestampedRing(4, clock, "actions"), views, lambda: np.zeros(1), log, clock, threading.Event(),
        dt_action_s=0.02, time_origin="inference_done", time_offset_s=0.0, frame_wait_timeout_s=STALL_S,
    )  # fmt: skip
    return loop, rings, log


def _write(ring: TimestampedRing, t: float, value: int):
    return ring.write(t, Frame(np.full((2, 2, 3), value, np.uint8), t, t, value))


def test_a_pair_across_an_outage_repeats_the_newest_frame_and_says_so() -> None:
    loop, rings, log = _loop([("cam", 0), ("cam", -1)])
    _write(rings["cam"], 1.000, 1)
    newest = _write(rings["cam"], 1.033, 2)  # 33 ms apart: a real pair
    obs = loop._observation(newest)
    assert obs["images"]["cam1"][0, 0, 0] == 1 and loop.missing_previous == 0
    newest = _write(rings["cam"], 3.500, 3)  # the first frame after a 2.5 s outage: its "previous" is from before it
    obs = loop._observation(newest)
    assert obs["images"]["cam0"][0, 0, 0] == 3 and obs["images"]["cam1"][0, 0, 0] == 3  # repeated, as at the start
    assert loop.missing_previous == 1
    (event,) = log.events("previous_frame_too_old")
    assert event["camera"] == "cam" and event["gap_ms"] == pytest.approx(2467, abs=1)
    newest = _write(rings["cam"], 3.533, 4)  # the next frame pairs with the first after the outage again
    obs = loop._observation(newest)
    assert obs["images"]["cam1"][0, 0, 0] == 3 and loop.missing_previous == 1


def test_another_cameras_frame_from_before_its_stall_refuses_the_observation() -> None:
    loop, rings, log = _loop([("front", 0), ("wrist", 0)], cameras=("front", "wrist"))
    _write(rings["wrist"], 1.000, 7)
    newest = _write(rings["front"], 1.050, 1)  # the wrist camera's newest is 50 ms older: fine
    assert loop._observation(newest)["images"]["cam1"][0, 0, 0] == 7
    newest = _write(rings["front"], 1.400, 2)  # the wrist camera has sent nothing for 400 ms (unplugged)
    with pytest.raises(RuntimeError, match=r"camera 'wrist': its newest frame is 400 ms older than camera 'front'"):
        loop._observation(newest)
    # through the loop's own step: skipped with the reason, no policy call (the policy here is None)
    assert loop._infer_once(newest) is True
    (skipped,) = log.events("inference_skipped")
    assert "past the stall timeout (100 ms)" in skipped["error"] and loop.inferences == 0
