"""Train π0 to catch the pen: `python experiments/train_pen_catch.py [max_steps=3000] [n_episodes=600] ...`.

Data: the demonstrations of `experiments/collect_pen_catch.py` (docs/runtime.md). Loss: π0's flow-matching loss,
AdamW with warmup + cosine decay, gradient clipping (vla_rt.pen_catch.train and .samples do the work). Writes: the
native checkpoint (+ a JSON sidecar with the action schedule the runtime needs and the recipe), a loss plot,
periodic checkpoints and the loss history in the hydra run dir. docs/pen_catch.md has the choices and results.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from vla_rt.errors import ConfigError
from vla_rt.pen_catch.config import check_train_outputs, validate_train
from vla_rt.pen_catch.train import train

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="experiment/train_pen_catch")
def main(cfg: DictConfig) -> None:
    cwd = Path(hydra.utils.get_original_cwd())
    try:  # every value typed and in range, and the output paths writable, before the data is read
        cfg = validate_train(cfg)
        check_train_outputs(cwd / cfg.checkpoint, cwd / cfg.loss_plot)
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    root = cwd / cfg.data_dir
    if not (root / "meta.json").exists():
        raise SystemExit(
            f"no pen-catch dataset at {root}: run `python experiments/collect_pen_catch.py out_dir={cfg.data_dir}`"
        )
    run_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    try:  # the values only the dataset can check (n_episodes): raised as it is read, before any training step
        summary = train(cfg, root, run_dir, checkpoint=cwd / cfg.checkpoint, loss_plot=cwd / cfg.loss_plot)
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
