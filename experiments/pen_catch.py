"""Catch the falling pen with the trained π0 running live: `python experiments/pen_catch.py [trials=10] ...`.

camera thread -> frame ring -> inference thread (Pi0Policy on the current + previous frame) -> action ring ->
output thread -> SerialGripper -> gripper. Modes:

* `mode=sim` (default): the simulated rig of configs/robot/sim.yaml (pen physics + renderer + 2-frame camera latency,
  SimGripper on a pty driven by the real SerialGripper). By default in simulated time (`SimClock`): deterministic
  scheduling, with the policy's measured compute time charged to the clock, so a slow model is late as it would be
  live. `realtime=true` runs the same trial on the wall clock.
* `mode=hardware` (`--config-name experiment/pen_catch_hardware`): OpenCV camera + serial gripper of
  configs/robot/hardware.yaml; an operator releases the pen and judges the catch.

Writes to the output dir: `trials.json` (per-trial verdict, reaction timeline, runtime counters), `summary.json`,
`timeline.png`, one event log per trial. The last line printed is `success K/N, reaction median X ms, p90 Y ms`,
reaction = release -> first close command sent (simulation; on hardware, where the release time is unobserved,
frame capture -> close command). docs/pen_catch.md explains the numbers.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import matplotlib
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import vla_rt
from vla_rt.clock import Clock, MonotonicClock, SimClock
from vla_rt.robot.camera import CameraError
from vla_rt.robot.factory import build_config, build_sim_pen_rig, make_camera, make_gripper
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.pen_render import PenViewConfig
from vla_rt.robot.pen_timeline import reaction_timeline
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import Runtime, RuntimeConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def load_schedule(checkpoint: Path) -> dict[str, Any]:
    """The sidecar the trainer writes next to the weights: chunk timing and views the runtime must reproduce."""
    sidecar = checkpoint.with_suffix(".json")
    if not checkpoint.is_file():
        raise SystemExit(f"no checkpoint at {checkpoint}: train one with `python experiments/train_pen_catch.py`")
    if not sidecar.is_file():
        raise SystemExit(f"{sidecar} is missing: it holds the action schedule (dt, horizon) the policy was trained for")
    schedule = json.loads(sidecar.read_text())
    missing = [k for k in ("dt_action_s", "horizon", "camera_names", "action_dim") if k not in schedule]
    if missing:
        raise SystemExit(f"{sidecar}: lacks {missing}; re-run experiments/train_pen_catch.py")
    return schedule


def load_policy(checkpoint: Path, schedule: dict[str, Any], cfg: DictConfig) -> vla_rt.Pi0Policy:
    """Pi0Policy on the CPU in float32 (the trained weights), warmed up so the first trial is not charged for it."""
    policy = vla_rt.Pi0Policy.from_pretrained(
        str(checkpoint),
        backend=cfg.policy.backend,
        device="cpu",
        dtype=torch.float32,
        chunk=schedule["horizon"],
        camera_names=tuple(schedule["camera_names"]),
        action_dim=schedule["action_dim"],
        num_steps=cfg.policy.num_steps,
        seed=cfg.seed,
    )
    blank = np.zeros((224, 224, 3), np.uint8)
    for _ in range(cfg.policy.warmup):
        policy.infer({"images": {name: blank for name in policy.camera_names}, "state": np.zeros(1, np.float32)})
    return policy


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count for a block (process-wide, so restored after: callers may be test sessions)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def runtime_config(cfg: DictConfig, schedule: dict[str, Any], simulated_time: bool) -> RuntimeConfig:
    return RuntimeConfig(
        control_hz=cfg.runtime.control_hz,
        dt_action_s=schedule["dt_action_s"],
        action_time_origin="frame_capture",  # as trained: step k belongs to t_capture + k * dt
        charge_measured_inference_time=simulated_time,
        initial_action=0.0,
        safe_action=None,
        extra={"checkpoint": cfg.checkpoint},
    )


def run_sim_trial(policy: Any, cfg: DictConfig, rcfg: RuntimeConfig, seed: int, log_path: Path) -> dict[str, Any]:
    """One drop in the simulated rig; returns verdict, reaction timeline (ms after release) and runtime counters."""
    robot = OmegaConf.to_container(cfg.robot, resolve=True)
    clock: Clock = MonotonicClock() if cfg.realtime else SimClock()
    rig = build_sim_pen_rig(robot, clock, seed)
    try:
        rig.sim.reset(clock.now())
        runtime = Runtime(rig.camera, policy, rig.gripper, clock, rcfg, log_path)
        runtime.start()
        if isinstance(clock, SimClock):
            clock.advance(cfg.trial_s)
        else:
            clock.sleep(cfg.trial_s)
        counters = runtime.stop()
        result = rig.sim.result(clock.now())
    finally:
        rig.close()
    events = load_events(log_path)
    pen = build_config(PenDropConfig, robot["pen"])
    view = PenViewConfig(image_size=robot["camera"].get("image_size", 224))
    timeline = reaction_timeline(events, result, pen, view)
    window_ms = [round((t - result.t_release) * 1000, 1) for t in result.window]
    return {
        "seed": seed,
        "success": result.success,
        "reason": result.reason,
        "reaction_ms": timeline["close_command_sent"],
        "timeline_ms": timeline,
        "jaws_closed_window_ms": window_ms,
        "inference_ms": summarize_inference(events),
        "counters": counters,
        "log": log_path.name,
    }


def summarize_inference(events: list[dict]) -> dict[str, float]:
    done = select(events, "inference_done")
    wall = np.array([e["wall_ms"] for e in done]) if done else np.array([math.nan])
    return {"count": len(done), "median_ms": round(float(np.median(wall)), 2), "max_ms": round(float(wall.max()), 2)}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(trials: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    reactions = [t["reaction_ms"] for t in trials if t["reaction_ms"] is not None]
    reasons: dict[str, int] = {}
    for t in trials:
        reasons[t["reason"]] = reasons.get(t["reason"], 0) + 1
    return {
        "mode": mode,
        "trials": len(trials),
        "caught": sum(bool(t["success"]) for t in trials),
        "reasons": reasons,
        "reaction_definition": "release -> first close command sent"
        if mode == "sim"
        else "capture of the frame that triggered the close -> close command sent",
        "reaction_ms_median": round(percentile(reactions, 50), 1),
        "reaction_ms_p90": round(percentile(reactions, 90), 1),
    }


def result_line(summary: dict[str, Any]) -> str:
    return (
        f"success {summary['caught']}/{summary['trials']}, reaction median {summary['reaction_ms_median']:.0f} ms, "
        f"p90 {summary['reaction_ms_p90']:.0f} ms"
    )


def resolve_checkpoint(path: str) -> Path:
    """Relative to where the command runs; failing that, to the repository (so the default works from anywhere)."""
    here = Path(hydra.utils.to_absolute_path(path))
    in_repo = Path(__file__).resolve().parents[1] / path
    return in_repo if not here.exists() and not Path(path).is_absolute() and in_repo.exists() else here


def run_sim(cfg: DictConfig, out_dir: Path) -> list[dict[str, Any]]:
    checkpoint = resolve_checkpoint(cfg.checkpoint)
    schedule = load_schedule(checkpoint)
    rcfg = runtime_config(cfg, schedule, simulated_time=not cfg.realtime)
    trials = []
    with torch_threads(cfg.policy.threads):
        policy = load_policy(checkpoint, schedule, cfg)
        for i in range(cfg.trials):
            trials.append(run_sim_trial(policy, cfg, rcfg, cfg.seed + i, out_dir / f"trial_{i:02d}.jsonl"))
            print_trial(i, trials[-1])
    return trials


def print_trial(i: int, trial: dict[str, Any]) -> None:
    t = trial["timeline_ms"]
    print(
        f"trial {i:2d} seed {trial['seed']}: {trial['reason']:9s} first frame {t['first_frame_showing_pen']} ms, "
        f"inference done {t['inference_done']} ms, close sent {t['close_command_sent']} ms, "
        f"jaws closed {t['jaws_closed']} ms (window {trial['jaws_closed_window_ms']})",
        flush=True,
    )


# --- hardware -----------------------------------------------------------------------------------------------------
def check_hardware(robot: dict[str, Any]) -> None:
    """Fail before loading the model, naming every absent device and the key that points at it."""
    problems = []
    port = robot["link"]["port"]
    if not Path(port).exists():
        problems.append(f"serial port {port} not found (gripper controller unplugged? set robot.link.port=...)")
    try:
        camera = make_camera(robot["camera"])
        camera.connect()
        camera.disconnect()
    except CameraError as err:
        problems.append(f"{err} (set robot.camera.index_or_path=...)")
    if problems:
        raise SystemExit("hardware mode: the rig is not there:\n  " + "\n  ".join(problems))


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


def run_hardware(cfg: DictConfig, out_dir: Path) -> list[dict[str, Any]]:
    """Operator-paced trials on the real rig (the devices are checked before the model is loaded)."""
    robot = OmegaConf.to_container(cfg.robot, resolve=True)
    check_hardware(robot)
    checkpoint = resolve_checkpoint(cfg.checkpoint)
    schedule = load_schedule(checkpoint)
    rcfg = runtime_config(cfg, schedule, simulated_time=False)
    rcfg.safe_action = 0.0  # open after each trial, ready for the next pen
    clock = MonotonicClock()
    with torch_threads(cfg.policy.threads):
        policy = load_policy(checkpoint, schedule, cfg)
        return [hardware_trial(i, policy, robot, rcfg, clock, cfg.trial_s, out_dir) for i in range(cfg.trials)]


def hardware_trial(
    i: int, policy: Any, robot: dict[str, Any], rcfg: RuntimeConfig, clock: Clock, trial_s: float, out_dir: Path
) -> dict[str, Any]:
    """One operator-paced drop: Enter, release the pen, then say whether it was caught."""
    input(f"trial {i}: hold the pen over the open gripper, press Enter, then release it ")
    log_path = out_dir / f"trial_{i:02d}.jsonl"
    camera, gripper = make_camera(robot["camera"], clock), make_gripper(robot["link"], clock)
    runtime = Runtime(camera, policy, gripper, clock, rcfg, log_path)
    runtime.start()
    clock.sleep(trial_s)
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


# --- plot ---------------------------------------------------------------------------------------------------------
MILESTONES = {  # timeline key -> (label, marker, colour)
    "first_frame_showing_pen": ("first frame showing the pen (capture)", "o", "tab:blue"),
    "frame_arrived": ("that frame arrives (camera latency)", "s", "tab:cyan"),
    "inference_done": ("π0 inference done", "D", "tab:purple"),
    "close_command_sent": ("close command sent", "v", "tab:red"),
    "jaws_closed": ("jaws closed", "*", "black"),
    "frame_captured": ("frame that triggered the close (capture)", "o", "tab:blue"),
}


def plot_timelines(trials: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(trials) + 1.8))
    shown: set[str] = set()
    for row, trial in enumerate(trials):
        window = trial.get("jaws_closed_window_ms")
        if window:
            ax.barh(row, window[1] - window[0], left=window[0], height=0.6, color="tab:green", alpha=0.18)
        for key, value in trial["timeline_ms"].items():
            if key in MILESTONES and value is not None:
                label, marker, colour = MILESTONES[key]
                ax.plot(value, row, marker, color=colour, label=None if key in shown else label)
                shown.add(key)
        ax.text(1.005, row, trial["reason"], transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    handles, _ = ax.get_legend_handles_labels()
    if any(t.get("jaws_closed_window_ms") for t in trials):
        ax.axvline(0, color="grey", lw=0.8)
        handles.append(Patch(color="tab:green", alpha=0.18, label="jaws closed in this window: caught"))
    ax.set_yticks(range(len(trials)), [f"trial {i}" for i in range(len(trials))])
    ax.invert_yaxis()
    x_label = "ms after release" if any(t.get("jaws_closed_window_ms") for t in trials) else "ms after trial start"
    ax.set(xlabel=x_label, title=title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.09, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="experiment/pen_catch")
def main(cfg: DictConfig) -> None:
    if cfg.mode not in ("sim", "hardware"):
        raise SystemExit(f"mode: expected 'sim' or 'hardware', found {cfg.mode!r}")
    run_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    out_dir = Path(hydra.utils.to_absolute_path(cfg.out_dir or run_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = run_sim(cfg, out_dir) if cfg.mode == "sim" else run_hardware(cfg, out_dir)
    summary = summarize(trials, cfg.mode)
    summary |= {"realtime": bool(cfg.realtime), "checkpoint": cfg.checkpoint, "out_dir": str(out_dir)}
    (out_dir / "trials.json").write_text(json.dumps(trials, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_timelines(trials, out_dir / "timeline.png", title=result_line(summary))
    print(f"wrote {out_dir / 'trials.json'}, {out_dir / 'summary.json'}, {out_dir / 'timeline.png'}")
    print(result_line(summary))


if __name__ == "__main__":
    main()
