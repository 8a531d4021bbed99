"""A camera that loses its device mid-run, through the real drivers on the wall clock: OpenCVCamera on an image
sequence (OpenCV's image2 source: a device-like stream, not a file, that fails when its files are gone and can be
reopened when they are back) and SimGripper's pseudo-terminal through SerialGripper.

"Unplugging" renames the sequence's folder away: the frames OpenCV already buffered come out, then reads fail and
reopening fails until "replugging" renames it back. Each test fails without camera reconnection: before it, the
reader thread stopped for good at the first failed read and the loop logged `camera_error` every stall timeout.
"""

import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from vla_rt.clock import MonotonicClock
from vla_rt.robot.opencv_camera import OpenCVCamera, OpenCVCameraConfig
from vla_rt.robot.serial_gripper import SerialGripper, SerialGripperConfig
from vla_rt.robot.sim_gripper import SimGripper
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import Runtime, RuntimeConfig

N_FRAMES = 20


class ConstantPolicy:
    def infer(self, obs):
        return {"actions": np.full((10, 1), 0.6)}


class UnpluggableCamera:
    """An image sequence on disk that a test can take away and give back, like a USB camera's cable."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.away = folder, folder.with_name(folder.name + "-unplugged")
        folder.mkdir()
        for i in range(N_FRAMES):
            cv2.imwrite(str(folder / f"frame_{i:03d}.png"), np.full((16, 16, 3), 10 * i, np.uint8))
        self.source = str(folder / "frame_%03d.png")

    def unplug(self) -> None:
        self.folder.rename(self.away)

    def replug(self) -> None:
        self.away.rename(self.folder)


@pytest.fixture
def gripper_device():
    device = SimGripper().start()
    yield device
    device.stop()


def build(tmp_path, device, source, **camera_fields):
    clock = MonotonicClock()
    camera = OpenCVCamera(OpenCVCameraConfig(source, **camera_fields), clock)
    gripper = SerialGripper(SerialGripperConfig(port=device.port, ack_timeout_s=0.5), clock)
    config = RuntimeConfig(control_hz=100, dt_action_s=0.02, freeze_gc=False)
    return Runtime(camera, ConstantPolicy(), gripper, clock, config, tmp_path / "events.jsonl"), camera


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def attempt_gaps(events):
    """Seconds between the loss and each reopen attempt of the first outage, and those attempts' events."""
    lost = select(events, "camera_disconnected")[0]
    attempts = []
    for e in events:
        if e["t"] > lost["t"] and e["event"] in ("camera_reconnect_failed", "camera_reconnected"):
            attempts.append(e)
            if e["event"] == "camera_reconnected":
                break
    return np.diff([lost["t"]] + [e["t"] for e in attempts]), attempts


def test_a_camera_that_comes_back_is_reopened_and_frames_flow_again(tmp_path, gripper_device):
    webcam = UnpluggableCamera(tmp_path / "webcam")
    runtime, camera = build(tmp_path, gripper_device, webcam.source, reconnect_backoff_s=0.02)
    camera.connect()
    webcam.unplug()
    runtime.start()
    wait_for(lambda: runtime.counters()["camera_cam_reconnect_attempts"] >= 3)
    webcam.replug()
    wait_for(lambda: runtime.log.counts["camera_link_up"] >= 1 and runtime.counters()["inferences"] > N_FRAMES // 2)
    assert runtime.stop_reason is None
    counters = runtime.stop()
    ev = load_events(tmp_path / "events.jsonl")

    down, up = select(ev, "camera_link_down")[0], select(ev, "camera_link_up")[0]
    assert "device stopped delivering (unplugged?)" in down["error"] and webcam.source in down["error"]
    gaps, attempts = attempt_gaps(ev)
    assert [e["event"] for e in attempts[:-1]] == ["camera_reconnect_failed"] * (len(attempts) - 1)
    assert [e["attempt"] for e in attempts] == list(range(1, len(attempts) + 1)) and len(attempts) >= 4
    assert all("cannot open" in e["error"] for e in attempts[:-1])
    backoff = [min(0.02 * 2**i, 1.0) for i in range(len(gaps))]  # 20, 40, 80 ... ms: never faster
    assert all(gap >= expected - 1e-3 for gap, expected in zip(gaps, backoff)), (gaps, backoff)
    reconnected = attempts[-1]
    assert down["t"] < reconnected["t"] <= up["t"] and up["down_ms"] > 0
    # While it was down nothing was written, so no frame went to the policy; the first inference after it is back
    # answers a frame of the new stream, not one from before the outage.
    assert [e for e in select(ev, "frame_captured") if down["t"] < e["t"] < reconnected["t"]] == []
    fresh = {e["seq"] for e in select(ev, "frame_captured") if e["t"] >= up["t"]}
    first_after = next(e for e in select(ev, "inference_start") if e["t"] > up["t"])
    assert first_after["frame_seq"] in fresh
    used = [e["frame_seq"] for e in select(ev, "inference_start")]
    assert used == sorted(set(used))  # each frame used once, never an old one again
    # The gripper held its command meanwhile: every tick acked, nothing but the policy's 0.6 or the initial 0.
    assert {e["target"] for e in select(ev, "command_sent")} <= {0.0, 0.6}
    attempts_logged = len(select(ev, "camera_reconnect_failed")) + len(select(ev, "camera_reconnected"))
    assert counters["camera_cam_reconnect_attempts"] == attempts_logged
    assert counters["camera_cam_disconnects"] == len(select(ev, "camera_disconnected")) >= 1
    assert counters["camera_cam_reconnects"] == len(select(ev, "camera_reconnected")) >= 1
    assert counters["camera_cam_link_losses"] == len(select(ev, "camera_link_down")) >= 1
    assert counters["camera_cam_errors"] == 0 and select(ev, "camera_error") == []


def test_a_camera_that_never_comes_back_is_retried_at_the_backoffs_pace_and_stop_is_prompt(tmp_path, gripper_device):
    webcam = UnpluggableCamera(tmp_path / "webcam")
    runtime, camera = build(
        tmp_path, gripper_device, webcam.source, reconnect_backoff_s=0.02, reconnect_backoff_max_s=0.1
    )
    camera.connect()
    webcam.unplug()
    runtime.start()
    wait_for(lambda: runtime.log.counts["camera_link_down"] == 1)
    time.sleep(1.2)
    t_stop = time.monotonic()
    counters = runtime.stop()
    stop_s = time.monotonic() - t_stop
    ev = load_events(tmp_path / "events.jsonl")

    assert stop_s < 1.0  # the camera thread waits for its next attempt at most one stall timeout (0.1 s)
    assert select(ev, "threads_not_joined") == []
    assert not [t for t in threading.enumerate() if t.name in ("inference", "output", "camera-cam", "opencv-cam")]
    assert not camera.is_connected and select(ev, "camera_reconnected") == [] and select(ev, "camera_link_up") == []
    failed = select(ev, "camera_reconnect_failed")
    gaps = np.diff([select(ev, "camera_disconnected")[0]["t"]] + [e["t"] for e in failed])
    backoff = [min(0.02 * 2**i, 0.1) for i in range(len(gaps))]  # 20, 40, 80, 100, 100 ... ms
    assert all(gap >= expected - 1e-3 for gap, expected in zip(gaps, backoff)), (gaps, backoff)
    assert 6 <= len(failed) <= 1.3 / 0.1 + 3  # kept trying, at most one attempt per 100 ms once backed off
    # The outage is said once; no camera_error (the loop used to log one every stall timeout) and no stalls.
    assert len(select(ev, "camera_link_down")) == 1 and select(ev, "camera_error") == []
    assert select(ev, "camera_stall") == [] and len(select(ev, "camera_disconnected")) == 1
    assert counters["camera_cam_reconnect_attempts"] == len(failed) and counters["camera_cam_reconnects"] == 0


def test_a_camera_that_gives_up_stops_the_runtime_safely(tmp_path, gripper_device):
    webcam = UnpluggableCamera(tmp_path / "webcam")
    runtime, camera = build(tmp_path, gripper_device, webcam.source, reconnect_backoff_s=0.01, max_reconnect_attempts=3)
    camera.connect()
    webcam.unplug()
    runtime.start()
    wait_for(lambda: runtime.stopping)
    assert runtime.stop_reason == "camera link lost"
    runtime.stop()
    ev = load_events(tmp_path / "events.jsonl")
    assert [e["attempt"] for e in select(ev, "camera_reconnect_failed")] == [1, 2, 3]
    (safe,) = select(ev, "safe_stop")
    assert "gave up after 3 reconnect attempts" in safe["reason"] and webcam.source in safe["reason"]


def test_the_end_of_a_video_file_is_not_reconnected(tmp_path, gripper_device):
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 30, (16, 16))
    for i in range(6):
        writer.write(np.full((16, 16, 3), 20 * i, np.uint8))
    writer.release()
    runtime, _ = build(tmp_path, gripper_device, str(video), realtime_playback=False, reconnect_backoff_s=0.01)
    runtime.start()
    wait_for(lambda: runtime.log.counts["camera_error"] >= 3)
    counters = runtime.stop()
    ev = load_events(tmp_path / "events.jsonl")
    assert all("end of video file" in e["error"] for e in select(ev, "camera_error"))
    for name in ("camera_disconnected", "camera_reconnect_failed", "camera_reconnected", "camera_link_down"):
        assert select(ev, name) == []
    assert counters["camera_cam_reconnect_attempts"] == counters["camera_cam_disconnects"] == 0
    assert counters["camera_cam_frames"] >= 1
