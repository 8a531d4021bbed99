"""Pen-catch demonstrations: the expert episode recorder and the on-disk dataset format.

An episode is simulated in its own simulated time (a SimClock starting at 0): the pen is released at a jittered time,
the expert commands "close" `close_after_release_s` after the release (it knows the release time: it is the
demonstrator, not the policy), and the simulated camera films it with its latency and a random frame phase, exactly
as the runtime would receive it.

Layout (documented in docs/runtime.md):

    <out_dir>/meta.json                 format, version, camera/action rates, sim configs, one entry per episode
    <out_dir>/episodes/ep_000000.npz    compressed numpy arrays of one episode:
        frames        uint8   (F, S, S, 3)  RGB images as delivered to the policy, in arrival order
        frame_index   int32   (F,)          camera frame counter (consecutive: frame i-1 is the previous frame)
        t_capture     float64 (F,)          exposure time, episode seconds
        t_arrival     float64 (F,)          delivery time = t_capture + latency
        state         float32 (F, 1)        jaw position (0 open .. 1 closed) at t_arrival
        action_t      float64 (A,)          action timeline at `action_hz`, episode seconds
        action        float32 (A, 1)        gripper target (0 open, 1 closed) in force at action_t
        jaw_position  float32 (A,)          simulated jaw position at action_t
        command_t     float64 (K,)          exact times of the expert's commands (the action is piecewise constant)
        command_target float32 (K,)         target set by each command
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vla_rt.clock import SimClock
from vla_rt.robot.jaw_dynamics import JawDynamics
from vla_rt.robot.pen_drop import PenDropConfig, PenDropSim
from vla_rt.robot.sim_camera import SimCamera, SimCameraConfig

FORMAT = "vla-rt/pen-catch-demos"
VERSION = 1


@dataclass
class EpisodeSpec:
    close_after_release_s: float = 0.200  # the paper's expert
    closing_time_s: float = 0.060
    pre_release_s: float = 0.15  # frames kept from this long before the release ...
    post_release_s: float = 0.45  # ... to this long after it
    action_hz: float = 100.0


def record_expert_episode(
    seed: int, spec: EpisodeSpec, pen: PenDropConfig, camera: SimCameraConfig
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Simulate one demonstration. Returns (arrays for the .npz, JSON-able episode summary)."""
    rng = np.random.default_rng(seed)
    clock = SimClock()
    jaws = JawDynamics(spec.closing_time_s, 0.0, clock, t0=0.0)
    sim = PenDropSim(jaws, pen, seed=int(rng.integers(2**31)))
    sim.reset(0.0)
    t_close_cmd = sim.t_release + spec.close_after_release_s
    jaws.command(1.0, t_close_cmd)
    phase = float(rng.uniform(0.0, 1.0 / camera.fps))  # the camera is not synchronised with the release
    cam = SimCamera(sim, dataclasses.replace(camera, phase_s=phase), clock)
    cam.connect()
    t_first, t_end = sim.t_release - spec.pre_release_s, sim.t_release + spec.post_release_s
    frames = []
    while True:
        frame = cam.read()
        if frame.t_capture > t_end:
            break
        if frame.t_capture >= t_first:
            frames.append(frame)
    action_t = np.arange(0.0, t_end + 1e-9, 1.0 / spec.action_hz)
    arrays = {
        "frames": np.stack([f.image for f in frames]),
        "frame_index": np.array([f.index for f in frames], np.int32),
        "t_capture": np.array([f.t_capture for f in frames]),
        "t_arrival": np.array([f.t_arrival for f in frames]),
        "state": np.array([[jaws.position_at(f.t_arrival)] for f in frames], np.float32),
        "action_t": action_t,
        "action": np.array([[jaws.target_at(t)] for t in action_t], np.float32),
        "jaw_position": np.array([jaws.position_at(t) for t in action_t], np.float32),
        "command_t": np.array([k.t for k in jaws.knots()]),
        "command_target": np.array([k.target for k in jaws.knots()], np.float32),
    }
    result = sim.result(t_end)
    summary = {
        "seed": seed,
        "t_release": sim.t_release,
        "pen_x_m": sim.x,
        "camera_phase_s": phase,
        "t_close_command": t_close_cmd,
        "t_closed": result.t_closed,
        "catch_window": list(result.window),
        "success": result.success,
        "reason": result.reason,
        "n_frames": len(frames),
    }
    return arrays, summary


def episode_path(root: str | Path, index: int) -> Path:
    return Path(root) / "episodes" / f"ep_{index:06d}.npz"


def write_episode(root: str | Path, index: int, arrays: dict[str, np.ndarray]) -> Path:
    path = episode_path(root, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def write_meta(root: str | Path, meta: dict[str, Any]) -> Path:
    path = Path(root) / "meta.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **meta}, indent=1))
    return path


def load_meta(root: str | Path) -> dict[str, Any]:
    meta = json.loads((Path(root) / "meta.json").read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{root}: not a {FORMAT} v{VERSION} dataset (found {meta.get('format')} v{meta.get('version')})"
        )
    return meta


def load_episode(root: str | Path, index: int) -> dict[str, np.ndarray]:
    with np.load(episode_path(root, index)) as data:
        return {key: data[key] for key in data.files}


def action_chunk(episode: dict[str, np.ndarray], t0: float, horizon: int, dt: float) -> np.ndarray:
    """Gripper targets due at t0 + k*dt (k < horizon), float32 (horizon, 1): the training target for a frame.

    With t0 = the frame's t_capture this matches the runtime's `action_time_origin="frame_capture"`. Exact (from the
    command times), not quantised to the stored `action_hz` timeline."""
    times = t0 + dt * np.arange(horizon)
    idx = np.searchsorted(episode["command_t"], times, side="right") - 1
    return episode["command_target"][np.clip(idx, 0, None)].astype(np.float32)[:, None]
