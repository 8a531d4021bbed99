"""Collect pen-catch demonstrations in simulation: `python experiments/collect_pen_catch.py [n_episodes=20] ...`.

Each episode is a simulated pen drop filmed by the simulated 30 FPS camera with its 2-frame latency, with the
expert closing the gripper 200 ms after release (the paper's demonstrations). Writes the dataset described in
robot/pen_dataset.py and docs/runtime.md: `<out_dir>/meta.json` + one compressed `.npz` per episode.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from vla_rt.robot.factory import build_config
from vla_rt.robot.pen_dataset import EpisodeSpec, record_expert_episode, write_episode, write_meta
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.sim_camera import SimCameraConfig

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if (out_dir / "meta.json").exists() or (out_dir / "episodes").exists():
        if not overwrite:
            raise SystemExit(f"{out_dir} already holds a dataset; pass overwrite=true or another out_dir=")
        shutil.rmtree(out_dir / "episodes", ignore_errors=True)
        (out_dir / "meta.json").unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="experiment/collect_pen_catch")
def main(cfg: DictConfig) -> None:
    out_dir = Path(hydra.utils.get_original_cwd()) / cfg.out_dir
    prepare_out_dir(out_dir, cfg.overwrite)
    pen = build_config(PenDropConfig, OmegaConf.to_container(cfg.robot.pen))
    camera = build_config(SimCameraConfig, OmegaConf.to_container(cfg.robot.camera))
    spec = EpisodeSpec(
        close_after_release_s=cfg.expert.close_after_release_s,
        closing_time_s=cfg.robot.gripper.closing_time_s,
        pre_release_s=cfg.episode.pre_release_s,
        post_release_s=cfg.episode.post_release_s,
        action_hz=cfg.episode.action_hz,
    )
    episodes = []
    total_bytes = 0
    start = time.perf_counter()
    progress = tqdm(range(cfg.n_episodes), desc="pen-catch demos", unit="ep")
    for index in progress:
        arrays, summary = record_expert_episode(cfg.seed + index, spec, pen, camera)
        path = write_episode(out_dir, index, arrays)
        total_bytes += path.stat().st_size
        episodes.append({"index": index, "file": str(path.relative_to(out_dir)), **summary})
        progress.set_postfix(caught=sum(e["success"] for e in episodes), MB=f"{total_bytes / 1e6:.1f}")
    meta = {
        "n_episodes": cfg.n_episodes,
        "camera": dataclasses.asdict(camera),
        "pen": dataclasses.asdict(pen),
        "episode": dataclasses.asdict(spec),
        "arrays": {
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
        },
        "episodes": episodes,
    }
    write_meta(out_dir, meta)
    caught = sum(e["success"] for e in episodes)
    print(json.dumps({"out_dir": str(out_dir), "episodes": cfg.n_episodes, "expert_caught": caught}))
    print(f"wrote {cfg.n_episodes} episodes, {total_bytes / 1e6:.1f} MB, in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
