"""Collect pen-catch demonstrations in simulation: each episode a simulated pen drop filmed by the simulated 30 FPS
camera with its 2-frame latency, the expert closing the gripper a fixed time after release (the paper's 200 ms).

Writes the dataset of robot/pen_dataset.py (docs/runtime.md): `<out_dir>/meta.json` + one compressed `.npz` an
episode. Episode i uses seed `seed + i`, so any episode regenerates from its seed.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vla_rt.arguments import check_out_dir
from vla_rt.errors import ConfigError
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.robot.pen_dataset import EpisodeSpec, record_expert_episode, write_episode, write_meta
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.sim_camera import SimCameraConfig

ARRAYS = {  # meta.json's description of each array of an episode file
    "frames": "uint8 (F, S, S, 3) RGB, arrival order",
    "frame_index": "int32 (F,) camera frame counter",
    "t_capture": "float64 (F,) s",
    "t_arrival": "float64 (F,) s",
    "state": "float32 (F, 1) jaw position at t_arrival",
    "action_t": "float64 (A,) s",
    "action": "float32 (A, 1) gripper target 0 open .. 1 closed",
    "jaw_position": "float32 (A,)",
    "command_t": "float64 (K,) s",
    "command_target": "float32 (K,)",
}


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new dataset into an old one unless `overwrite`, then clear the old one. An `out_dir` that
    cannot be a directory (under a regular file, read-only) is a ConfigError naming `out_dir`, not an OSError."""
    check_out_dir(out_dir, "out_dir", ConfigError)
    if (out_dir / "meta.json").exists() or (out_dir / "episodes").exists():
        if not overwrite:
            raise PenCatchSetupError(f"{out_dir} already holds a dataset; pass overwrite=true or another out_dir=")
        shutil.rmtree(out_dir / "episodes", ignore_errors=True)
        (out_dir / "meta.json").unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def collect(
    out_dir: Path, n_episodes: int, seed: int, spec: EpisodeSpec, pen: PenDropConfig, camera: SimCameraConfig
) -> dict[str, Any]:
    """Record `n_episodes` expert episodes into `out_dir` (a progress bar on stderr); returns meta.json's content."""
    episodes = []
    total_bytes = 0
    progress = tqdm(range(n_episodes), desc="pen-catch demos", unit="ep")
    for index in progress:
        arrays, summary = record_expert_episode(seed + index, spec, pen, camera)
        path = write_episode(out_dir, index, arrays)
        total_bytes += path.stat().st_size
        episodes.append({"index": index, "file": str(path.relative_to(out_dir)), **summary})
        progress.set_postfix(caught=sum(e["success"] for e in episodes), MB=f"{total_bytes / 1e6:.1f}")
    meta = {
        "n_episodes": n_episodes,
        "camera": dataclasses.asdict(camera),
        "pen": dataclasses.asdict(pen),
        "episode": dataclasses.asdict(spec),
        "arrays": ARRAYS,
        "episodes": episodes,
    }
    write_meta(out_dir, meta)
    return meta
