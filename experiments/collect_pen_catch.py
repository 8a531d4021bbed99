"""Collect pen-catch demonstrations in simulation: `python experiments/collect_pen_catch.py [n_episodes=20] ...`.

Each episode is a simulated pen drop filmed by the simulated 30 FPS camera with its 2-frame latency, with the
expert closing the gripper 200 ms after release (the paper's demonstrations). Writes the dataset described in
robot/pen_dataset.py and docs/runtime.md: `<out_dir>/meta.json` + one compressed `.npz` per episode. The work is
done by vla_rt.pen_catch.collect.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from vla_rt.errors import ConfigError
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.pen_catch.collect import collect, prepare_out_dir
from vla_rt.pen_catch.config import validate_collect
from vla_rt.robot.factory import build_config
from vla_rt.robot.pen_dataset import EpisodeSpec
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.sim_camera import SimCameraConfig

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="experiment/collect_pen_catch")
def main(cfg: DictConfig) -> None:
    try:  # every value typed and in range before anything is written
        cfg = validate_collect(cfg)
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    out_dir = Path(hydra.utils.get_original_cwd()) / cfg.out_dir
    try:
        prepare_out_dir(out_dir, cfg.overwrite)
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    except PenCatchSetupError as err:
        raise SystemExit(str(err)) from None
    pen = build_config(PenDropConfig, OmegaConf.to_container(cfg.robot.pen))
    camera = build_config(SimCameraConfig, OmegaConf.to_container(cfg.robot.camera))
    spec = EpisodeSpec(
        close_after_release_s=cfg.expert.close_after_release_s,
        closing_time_s=cfg.robot.gripper.closing_time_s,
        pre_release_s=cfg.episode.pre_release_s,
        post_release_s=cfg.episode.post_release_s,
        action_hz=cfg.episode.action_hz,
    )
    start = time.perf_counter()
    meta = collect(out_dir, cfg.n_episodes, cfg.seed, spec, pen, camera)
    total_mb = sum((out_dir / e["file"]).stat().st_size for e in meta["episodes"]) / 1e6
    caught = sum(e["success"] for e in meta["episodes"])
    print(json.dumps({"out_dir": str(out_dir), "episodes": cfg.n_episodes, "expert_caught": caught}))
    print(f"wrote {cfg.n_episodes} episodes, {total_mb:.1f} MB, in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
