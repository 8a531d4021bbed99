"""Hardware-mode trials (vla_rt.pen_catch.hardware) on stand-ins for the rig that use the real drivers: a video file
through OpenCVCamera and SimGripper's pseudo-terminal through SerialGripper; the operator's answers are scripted."""

import threading

import cv2
import numpy as np
import pytest

from vla_rt.clock import MonotonicClock
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.pen_catch.hardware import hardware_trial
from vla_rt.robot.gripper_protocol import position_to_u16
from vla_rt.robot.serial_gripper import SerialGripper, SerialGripperConfig
from vla_rt.robot.sim_gripper import SimGripper
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import RuntimeConfig


class ClosingPolicy:
    def infer(self, obs):
        return {"actions": np.ones((20, 1))}


class CtrlCDuringTrial(MonotonicClock):
    """The operator presses Ctrl-C while the trial runs: the main thread's wait ends in KeyboardInterrupt."""

    def sleep(self, dt):
        if threading.current_thread() is threading.main_thread():
            super().sleep(0.5)  # long enough for the loop to close the gripper
            raise KeyboardInterrupt
        super().sleep(dt)


@pytest.fixture
def rig(tmp_path):
    video = tmp_path / "camera.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 30, (64, 48))
    for _ in range(90):
        writer.write(np.zeros((48, 64, 3), np.uint8))
    writer.release()
    device = SimGripper().start()
    robot = {
        "camera": {"type": "opencv", "index_or_path": str(video)},
        "link": {"type": "serial", "port": device.port, "ack_timeout_s": 0.5},
    }
    yield robot, device
    device.stop()


def test_ctrl_c_during_a_trial_opens_the_gripper_and_releases_the_rig(rig, tmp_path, monkeypatch):
    """The bug: a KeyboardInterrupt during the trial skipped runtime.stop(): the gripper stayed closed (no safe command)
    and the threads were left running on the devices until the process died."""
    robot, device = rig
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    rcfg = RuntimeConfig(dt_action_s=0.02, safe_action=0.0)
    with pytest.raises(KeyboardInterrupt):
        hardware_trial(0, ClosingPolicy(), robot, rcfg, CtrlCDuringTrial(), 2.0, tmp_path)
    sent = [command.position_raw for _, command in device.received]
    assert position_to_u16(1.0) in sent and sent[-1] == position_to_u16(0.0)  # closed, then opened on the way out
    events = load_events(tmp_path / "trial_00.jsonl")
    assert select(events, "safe_state_sent") and select(events, "runtime_stop")
    assert not [t for t in threading.enumerate() if t.name in ("inference", "output", "camera-cam")]
    port = SerialGripper(SerialGripperConfig(port=device.port))
    port.connect()  # the trial's host let go of the (exclusively opened) port
    port.disconnect()


def test_the_operator_is_told_to_release_only_once_the_loop_is_live(rig, tmp_path, monkeypatch):
    """The bug: the prompt said 'press Enter, then release it' and the runtime only started at Enter: opening the
    camera and the first inference outlast a pen's 250 ms fall, so the trial measured start-up, not the loop."""
    robot, _ = rig
    clock = MonotonicClock()
    said = []
    monkeypatch.setattr("builtins.input", lambda prompt="": said.append((clock.now(), prompt)) or "n")
    monkeypatch.setattr("builtins.print", lambda *a, **k: said.append((clock.now(), " ".join(map(str, a)))))
    trial = hardware_trial(0, ClosingPolicy(), robot, RuntimeConfig(dt_action_s=0.02), clock, 0.3, tmp_path)
    events = load_events(tmp_path / "trial_00.jsonl")
    ((t_release, _),) = [(t, line) for t, line in said if "release the pen now" in line]
    live = max(select(events, name)[0]["t"] for name in ("frame_captured", "inference_done", "ack_received"))
    assert t_release >= live
    assert trial["reason"] == "missed" and trial["timeline_ms"]["close_command_sent"] is not None


def test_a_gripper_unplugged_since_the_last_trial_is_one_line(rig, tmp_path, monkeypatch):
    robot, device = rig
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    robot["link"]["port"] = str(tmp_path / "ttyGONE")
    with pytest.raises(PenCatchSetupError, match=r"trial 3: the rig is not there: gripper on .*ttyGONE: cannot open"):
        hardware_trial(3, ClosingPolicy(), robot, RuntimeConfig(), MonotonicClock(), 0.3, tmp_path)
