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
frame capture -> close command). The work is done by vla_rt.pen_catch (evaluate, hardware, plot); docs/pen_catch.md
explains the numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from vla_rt.arguments import check_out_dir
from vla_rt.errors import ConfigError, VlaRtError
from vla_rt.pen_catch import PenCatchSetupError
from vla_rt.pen_catch.config import validate_pen_catch
from vla_rt.pen_catch.evaluate import result_line, run_sim, summarize
from vla_rt.pen_catch.hardware import run_hardware
from vla_rt.pen_catch.plot import plot_timelines
from vla_rt.strict_json import write_json

REPO = Path(__file__).resolve().parents[1]


def resolve_checkpoint(path: str) -> Path:
    """Relative to where the command runs; failing that, to the repository (so the default works from anywhere)."""
    here = Path(hydra.utils.to_absolute_path(path))
    in_repo = REPO / path
    return in_repo if not here.exists() and not Path(path).is_absolute() and in_repo.exists() else here


@hydra.main(version_base=None, config_path=str(REPO / "configs"), config_name="experiment/pen_catch")
def main(cfg: DictConfig) -> None:
    try:  # every value typed and in range, and the output dir writable, before a device, a model or a thread starts
        cfg = validate_pen_catch(cfg)
        run_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
        out_dir = check_out_dir(Path(hydra.utils.to_absolute_path(cfg.out_dir or run_dir)), "out_dir", ConfigError)
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_checkpoint(cfg.checkpoint)
    try:
        run = run_sim if cfg.mode == "sim" else run_hardware
        trials = run(cfg, checkpoint, out_dir)
    except (PenCatchSetupError, VlaRtError) as err:  # a missing sidecar, a truncated checkpoint, ...: one line
        raise SystemExit(str(err)) from None
    except KeyboardInterrupt:  # the runtime of the trial in flight is stopped by then (run_drop's finally)
        print(f"interrupted: no trials.json or summary.json written; the event logs so far are in {out_dir}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(130) from None
    summary = summarize(trials, cfg.mode)
    summary |= {"realtime": bool(cfg.realtime), "checkpoint": cfg.checkpoint, "out_dir": str(out_dir)}
    write_json(out_dir / "trials.json", trials)  # strict JSON: a median of no reactions is null, not NaN
    write_json(out_dir / "summary.json", summary)
    plot_timelines(trials, out_dir / "timeline.png", title=result_line(summary))
    print(f"wrote {out_dir / 'trials.json'}, {out_dir / 'summary.json'}, {out_dir / 'timeline.png'}")
    print(result_line(summary))


if __name__ == "__main__":
    main()
