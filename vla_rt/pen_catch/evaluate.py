"""Evaluate a trained pen-catch policy live: camera thread -> inference thread (Pi0Policy on the current + previous
frame) -> output thread -> SerialGripper -> the simulated rig, one pen drop a trial.

By default in simulated time (`SimClock`) with the policy's measured compute charged to the clock, so a slow model is
late as it would be live, and scheduling is deterministic; `cfg.policy.latency_ms` charges a fixed simulated latency
instead (the same trials on any machine, however loaded: what the tests use); `cfg.realtime` runs the same trial on
the wall clock.
Reaction = release -> first close command sent. `cfg` is the hydra config of configs/experiment/pen_catch.yaml.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from vla_rt.clock import Clock, MonotonicClock, SimClock
from vla_rt.errors import ConfigError
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.policy import Pi0Policy
from vla_rt.robot.factory import build_config, build_sim_pen_rig
from vla_rt.robot.pen_drop import CatchResult, PenDropConfig, PenDropSim
from vla_rt.robot.pen_render import PenViewConfig
from vla_rt.robot.pen_timeline import reaction_timeline
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import Runtime, RuntimeConfig

SIDECAR_KEYS = ("dt_action_s", "horizon", "camera_names", "action_dim")


def load_schedule(checkpoint: Path) -> dict[str, Any]:
    """The sidecar the trainer writes next to the weights: chunk timing and views the runtime must reproduce."""
    sidecar = checkpoint.with_suffix(".json")
    if not checkpoint.is_file():
        raise PenCatchSetupError(
            f"no checkpoint at {checkpoint}: train one with `python experiments/train_pen_catch.py`"
        )
    if not sidecar.is_file():
        raise PenCatchSetupError(
            f"{sidecar} is missing: it holds the action schedule (dt, horizon) the policy was trained for"
        )
    try:
        schedule = json.loads(sidecar.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PenCatchSetupError(f"{sidecar}: expected the JSON sidecar train_pen_catch.py writes, found invalid "
                                 f"JSON ({e})") from None  # fmt: skip
    if not isinstance(schedule, dict):
        raise PenCatchSetupError(f"{sidecar}: expected a JSON object, found a {type(schedule).__name__}")
    missing = [k for k in SIDECAR_KEYS if k not in schedule]
    if missing:
        raise PenCatchSetupError(f"{sidecar}: lacks {missing}; re-run experiments/train_pen_catch.py")
    return schedule


def load_policy(checkpoint: Path, schedule: dict[str, Any], cfg: DictConfig) -> Pi0Policy:
    """Pi0Policy on the CPU in float32 (the trained weights), warmed up so the first trial is not charged for it."""
    policy = Pi0Policy.from_pretrained(
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
    fixed_ms = cfg.policy.get("latency_ms")
    if fixed_ms is not None and not simulated_time:
        raise ConfigError("policy.latency_ms", "null with realtime=true (the wall clock is the latency)", fixed_ms)
    return RuntimeConfig(
        control_hz=cfg.runtime.control_hz,
        dt_action_s=schedule["dt_action_s"],
        action_time_origin="frame_capture",  # as trained: step k belongs to t_capture + k * dt
        charge_measured_inference_time=simulated_time and fixed_ms is None,
        min_inference_latency_s=0.0 if fixed_ms is None else fixed_ms / 1000,
        initial_action=0.0,
        safe_action=None,
        extra={"checkpoint": cfg.checkpoint},
    )


def run_drop(runtime: Runtime, sim: PenDropSim, clock: Clock, duration_s: float) -> tuple[dict[str, int], CatchResult]:
    """One pen drop seen by `runtime`'s threads for `duration_s` clock seconds; returns (final counters, verdict).

    Simulated start-up is instant, so the episode starts with the threads. On the wall clock start-up is paid for
    real (hundreds of ms on a loaded machine): the pen hangs until the loop is live, then its episode starts.
    The runtime is stopped on every way out (an exception, Ctrl-C): else its threads keep driving the gripper's port
    and the camera until the process dies."""
    try:
        if isinstance(clock, SimClock):
            sim.reset(clock.now())
            runtime.start()
            clock.advance(duration_s)
        else:
            sim.reset(clock.now(), t_release=math.inf)
            runtime.start()
            sim.reset(runtime.wait_until_live())
            clock.sleep(duration_s)
    finally:  # threads joined, gripper to its safe command, port and camera closed
        counters = runtime.stop()
    return counters, sim.result(clock.now())


def run_sim_trial(policy: Any, cfg: DictConfig, rcfg: RuntimeConfig, seed: int, log_path: Path) -> dict[str, Any]:
    """One drop in the simulated rig; returns verdict, reaction timeline (ms after release) and runtime counters."""
    robot = OmegaConf.to_container(cfg.robot, resolve=True)
    clock: Clock = MonotonicClock() if cfg.realtime else SimClock()
    rig = build_sim_pen_rig(robot, clock, seed)
    try:
        runtime = Runtime(rig.camera, policy, rig.gripper, clock, rcfg, log_path)
        counters, result = run_drop(runtime, rig.sim, clock, cfg.trial_s)
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


def say(line: str) -> None:
    """Progress on stdout as it happens (a trial takes seconds; a parent process reads the lines as they come)."""
    print(line, flush=True)


def run_sim(cfg: DictConfig, checkpoint: Path, out_dir: Path, log: Callable[[str], None] = say) -> list[dict[str, Any]]:
    """`cfg.trials` drops, trial i with seed `cfg.seed + i`, each logged to `out_dir/trial_<i>.jsonl`."""
    schedule = load_schedule(checkpoint)
    rcfg = runtime_config(cfg, schedule, simulated_time=not cfg.realtime)
    trials = []
    with torch_threads(cfg.policy.threads):
        policy = load_policy(checkpoint, schedule, cfg)
        for i in range(cfg.trials):
            trials.append(run_sim_trial(policy, cfg, rcfg, cfg.seed + i, out_dir / f"trial_{i:02d}.jsonl"))
            log(describe_trial(i, trials[-1]))
    return trials


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
    """The evaluation's last printed line: `success K/N, reaction median X ms, p90 Y ms`."""
    return (
        f"success {summary['caught']}/{summary['trials']}, reaction median {summary['reaction_ms_median']:.0f} ms, "
        f"p90 {summary['reaction_ms_p90']:.0f} ms"
    )


def describe_trial(i: int, trial: dict[str, Any]) -> str:
    t = trial["timeline_ms"]
    return (
        f"trial {i:2d} seed {trial['seed']}: {trial['reason']:9s} first frame {t['first_frame_showing_pen']} ms, "
        f"inference done {t['inference_done']} ms, close sent {t['close_command_sent']} ms, "
        f"jaws closed {t['jaws_closed']} ms (window {trial['jaws_closed_window_ms']})"
    )
