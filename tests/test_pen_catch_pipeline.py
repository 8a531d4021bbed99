"""collect -> train -> evaluate, end to end through the real hydra entry points, at a size CI affords.

Asserts the artefacts and the output format of each stage, not that this 40-step policy catches anything (the
committed checkpoint's catch rate is tests/test_pen_catch_eval.py's job). Also: hardware mode without a rig fails
before loading anything, naming what is missing.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vla_rt.checkpoints import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RESULT_LINE = re.compile(r"^success (\d+)/(\d+), reaction median (\d+|nan) ms, p90 (\d+|nan) ms$")


def run(script: str, *overrides: str, cwd: Path) -> str:
    """Runs experiments/<script> in `cwd` (hydra run dirs land there, not in the repo); returns stdout."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    work = tmp_path_factory.mktemp("pen_catch")
    run("collect_pen_catch.py", "n_episodes=20", "out_dir=data", cwd=work)
    train_out = run(
        "train_pen_catch.py",
        "data_dir=data",
        "n_episodes=20",
        "max_steps=40",
        "batch_size=8",
        "eval_every=20",
        "checkpoint_every=20",
        "threads=1",
        "checkpoint=ckpt/pen_catch.safetensors",
        "loss_plot=ckpt/loss.png",
        cwd=work,
    )
    eval_out = run(
        "pen_catch.py",
        "checkpoint=ckpt/pen_catch.safetensors",
        "trials=2",
        "trial_s=0.8",
        "out_dir=eval",
        "policy.latency_ms=30",
        cwd=work,
    )
    return work, train_out, eval_out


def test_training_writes_checkpoint_sidecar_plot_and_periodic_checkpoints(pipeline):
    work, train_out, _ = pipeline
    ckpt = load_checkpoint(str(work / "ckpt/pen_catch.safetensors"))
    assert ckpt.config.vision.image_size == 112 and ckpt.config.chunk == 16 and ckpt.config.action_dim == 32
    assert set(ckpt.norm_stats) == {"state", "actions"} and ckpt.norm_stats["actions"].dim == 1
    sidecar = json.loads((work / "ckpt/pen_catch.json").read_text())
    assert sidecar["dt_action_s"] == 0.02 and sidecar["horizon"] == 16 and sidecar["camera_names"] == ["cam0", "cam1"]
    assert sidecar["data"]["train_episodes"] == 16 and sidecar["data"]["val_episodes"] == 4
    assert sidecar["result"]["steps"] == 40 and sidecar["result"]["val_loss"] > 0
    assert (work / "ckpt/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_dirs = list((work / "outputs/train_pen_catch").iterdir())
    assert len(run_dirs) == 1
    assert (run_dirs[0] / "step_000020.safetensors").is_file()  # periodic; the final one is the checkpoint itself
    history = json.loads((run_dirs[0] / "history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 41))
    assert {"val_loss", "close_in_window"} <= set(history[19]) and "val_loss" in history[-1]
    summary = json.loads(train_out.strip().splitlines()[-1])
    assert summary["checkpoint"].endswith("pen_catch.safetensors")


def test_evaluation_writes_trials_summary_plot_and_the_result_line(pipeline):
    work, _, eval_out = pipeline
    last = eval_out.strip().splitlines()[-1]
    match = RESULT_LINE.match(last)
    assert match, last
    assert match.group(2) == "2"
    out = work / "eval"
    trials = json.loads((out / "trials.json").read_text())
    assert len(trials) == 2
    for trial in trials:
        assert trial["reason"] in {"caught", "too_early", "too_late", "no_close"}
        timeline = trial["timeline_ms"]
        assert set(timeline) >= {"release", "first_frame_showing_pen", "inference_done", "close_command_sent"}
        assert timeline["first_frame_showing_pen"] is not None and timeline["inference_done"] is not None
        assert trial["counters"]["inferences"] > 10 and trial["counters"]["inference_errors"] == 0
        assert (out / trial["log"]).is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == 2 and summary["caught"] == int(match.group(1))
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hardware_mode_without_the_rig_exits_naming_each_missing_device(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments/pen_catch.py"),
            "--config-name",
            "experiment/pen_catch_hardware",
            "robot.link.port=/dev/no-such-gripper",
            f"robot.camera.index_or_path={tmp_path / 'no-such-camera.mp4'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()
    assert "hardware mode: the rig is not there:" in message
    assert any("serial port /dev/no-such-gripper not found" in line for line in message)
    assert any("no-such-camera.mp4" in line and "robot.camera.index_or_path" in line for line in message)


def test_hardware_check_opens_the_gripper_port_before_the_model_loads(tmp_path):
    """The bug: a port that exists but is no serial device (a directory, a regular file, /dev/null; or one without
    permission) passed the check; the model loaded, the operator pressed Enter, and the trial ended in a traceback."""
    import cv2
    import numpy as np

    from vla_rt.pen_catch import PenCatchSetupError
    from vla_rt.pen_catch.hardware import check_hardware
    from vla_rt.robot.sim_gripper import SimGripper

    video = tmp_path / "camera.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 30, (64, 48))
    for _ in range(3):
        writer.write(np.zeros((48, 64, 3), np.uint8))
    writer.release()
    camera = {"type": "opencv", "index_or_path": str(video)}
    (tmp_path / "notes.txt").write_text("not a port")
    for port in (tmp_path, tmp_path / "notes.txt", "/dev/null"):
        with pytest.raises(PenCatchSetupError) as info:
            check_hardware({"camera": camera, "link": {"type": "serial", "port": str(port)}})
        (problem,) = str(info.value).splitlines()[1:]
        assert f"gripper on {port}: cannot open serial port" in problem and "robot.link.port" in problem, problem
    device = SimGripper().start()  # a real pseudo-terminal passes
    try:
        check_hardware({"camera": camera, "link": {"type": "serial", "port": device.port}})
    finally:
        device.stop()
