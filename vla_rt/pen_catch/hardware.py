"""Pen-catch trials on the real rig (configs/robot/hardware.yaml): an operator releases the pen and judges the catch.

The devices are checked before the model loads, so a missing camera or gripper costs seconds, not a model load.
Without an observed release time, the reaction is frame capture -> close command (the rig's latency, not a catch
window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vla_rt.clock import Clock, MonotonicClock
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.pen_catch.evaluate import load_policy, load_schedule, runtime_config, torch_threads
from vla_rt.robot.camera import CameraError
from vla_rt.robot.factory import make_camera, make_gripper
from vla_rt.robot.gripper import GripperError
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import Runtime, RuntimeConfig


def _does_not_open(make, error: type[Exception], hint: str) -> list[str]:
    """[] when the device `make()` builds connects and disconnects; else its error and the hint, as one problem."""
    try:
        device = make()
        device.connect()
        device.disconnect()
    except error as err:
        return [f"{err} ({hint})"]
    return []


def check_hardware(robot: dict[str, Any]) -> None:
    """Fail before loading the model, naming every absent device and the key that points at it."""
    problems = []
    port = robot["link"]["port"]
    if not Path(port).exists():
        problems.append(f"serial port {port} not found (gripper controller unplugged? set robot.link.port=...)")
    else:  # a directory, a regular file or a port without permission would pass for it until the first trial
        problems += _does_not_open(lambda: make_gripper(robot["link"]), GripperError,
                                   "not a serial device, or no permission? set robot.link.port=...")  # fmt: skip
    problems += _does_not_open(lambda: make_camera(robot["camera"]), CameraError, "set robot.camera.index_or_path=...")
    if problems:
        raise PenCatchSetupError("hardware mode: the rig is not there:\n  " + "\n  ".join(problems))


def hardware_timeline(events: list[dict]) -> dict[str, float | None]:
    """ms after the trial's start: capture of the frame whose chunk sent the first close, its inference, the command,
    the first ack reporting the jaws closed. Without a release time this is the rig's latency, not a catch window."""
    t0 = select(events, "runtime_start")[0]["t"]
    close = next((e for e in select(events, "command_sent", source="chunk") if e["target"] >= 0.5), None)
    if close is None:
        return {"frame_captured": None, "inference_done": None, "close_command_sent": None, "jaws_closed": None}
    chunk = next(e for e in select(events, "chunk_written") if e["seq"] == close["chunk_seq"])
    frame = next(e for e in select(events, "frame_captured") if e["seq"] == chunk["frame_seq"])
    done = next(e for e in select(events, "inference_done") if e["frame_seq"] == chunk["frame_seq"])
    closed = next((e for e in select(events, "ack_received") if e["position"] >= 0.95), None)

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1000, 1)

    return {
        "frame_captured": ms(frame["t_capture"]),
        "inference_done": ms(done["t"]),
        "close_command_sent": ms(close["t"]),
        "jaws_closed": ms(closed["t"]) if closed else None,
    }


def run_hardware(cfg: DictConfig, checkpoint: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Operator-paced trials on the real rig (the devices are checked before the model is loaded)."""
    robot = OmegaConf.to_container(cfg.robot, resolve=True)
    check_hardware(robot)
    schedule = load_schedule(checkpoint)
    rcfg = runtime_config(cfg, schedule, simulated_time=False)
    rcfg.safe_action = 0.0  # open after each trial, ready for the next pen
    clock = MonotonicClock()
    with torch_threads(cfg.policy.threads):
        policy = load_policy(checkpoint, schedule, cfg)
        return [hardware_trial(i, policy, robot, rcfg, clock, cfg.trial_s, out_dir) for i in range(cfg.trials)]


def _wait_until_live(runtime: Runtime, i: int) -> None:
    """`runtime.wait_until_live()`, its failure (no frame, no chunk, no ack in 10 s) as a one-line setup error."""
    try:
        runtime.wait_until_live()
    except (TimeoutError, RuntimeError) as err:
        raise PenCatchSetupError(f"trial {i}: {err}") from None


def hardware_trial(
    i: int, policy: Any, robot: dict[str, Any], rcfg: RuntimeConfig, clock: Clock, trial_s: float, out_dir: Path
) -> dict[str, Any]:
    """One operator-paced drop: Enter, wait for "release", release the pen, then say whether it was caught.

    "release" comes once the loop is live (a frame seen, a chunk out, a command acked): opening a webcam and the
    first inference take up to seconds, longer than a pen takes to fall, so a pen released at Enter was gone first."""
    input(f"trial {i}: hold the pen over the open gripper and press Enter; release it when told ")
    log_path = out_dir / f"trial_{i:02d}.jsonl"
    camera, gripper = make_camera(robot["camera"], clock), make_gripper(robot["link"], clock)
    runtime = Runtime(camera, policy, gripper, clock, rcfg, log_path)
    try:
        runtime.start()
    except (CameraError, GripperError) as err:  # unplugged since the start-up check or the last trial
        raise PenCatchSetupError(f"trial {i}: the rig is not there: {err}") from None
    try:
        _wait_until_live(runtime, i)
        print(f"trial {i}: release the pen now", flush=True)
        clock.sleep(trial_s)
    finally:  # Ctrl-C too: open the gripper (rcfg.safe_action), join the threads, close the port and the camera
        counters = runtime.stop()
    caught = input("caught? [y/N] ").strip().lower().startswith("y")
    timeline = hardware_timeline(load_events(log_path))
    sent, frame = timeline["close_command_sent"], timeline["frame_captured"]
    reason = "caught" if caught else ("no_close" if sent is None else "missed")
    return {
        "success": caught,
        "reason": reason,
        "reaction_ms": None if sent is None else round(sent - frame, 1),
        "timeline_ms": timeline,
        "counters": counters,
        "log": log_path.name,
    }
