"""Demonstration collection: the hydra entry point at reduced size, the on-disk format and its loader."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vla_rt.robot.pen_dataset import EpisodeSpec, action_chunk, load_episode, load_meta, record_expert_episode
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.sim_camera import SimCameraConfig

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "collect_pen_catch.py"


def collect(out_dir: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "n_episodes=6", f"out_dir={out_dir}", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("collect")
    out = root / "demos"
    run = collect(out, root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wrote 6 episodes" in run.stdout and '"expert_caught": 6' in run.stdout
    assert "pen-catch demos" in run.stderr  # the tqdm progress bar
    return out


def test_meta_describes_the_dataset(dataset):
    meta = load_meta(dataset)
    assert meta["n_episodes"] == 6 and len(meta["episodes"]) == 6
    assert meta["camera"]["fps"] == 30.0 and meta["camera"]["latency_frames"] == 2.0
    assert meta["episode"]["close_after_release_s"] == 0.2
    assert all(e["success"] and e["reason"] == "caught" for e in meta["episodes"])
    assert len({round(e["t_release"], 6) for e in meta["episodes"]}) == 6  # jittered releases
    total = sum((dataset / e["file"]).stat().st_size for e in meta["episodes"])
    assert total / 6 < 200_000  # 600 episodes stay far below a few hundred MB


def test_episode_arrays_are_consistent(dataset):
    meta = load_meta(dataset)
    for i, summary in enumerate(meta["episodes"]):
        ep = load_episode(dataset, i)
        n = summary["n_frames"]
        assert ep["frames"].shape == (n, 224, 224, 3) and ep["frames"].dtype == np.uint8
        assert np.all(np.diff(ep["frame_index"]) == 1)  # frame i-1 is the previous camera frame
        assert np.allclose(ep["t_arrival"] - ep["t_capture"], 2 / 30)
        assert np.allclose(np.diff(ep["t_capture"]), 1 / 30)
        release, close = summary["t_release"], summary["t_close_command"]
        assert close == pytest.approx(release + 0.2)
        assert ep["t_capture"][0] >= release - 0.15 and ep["t_capture"][-1] <= release + 0.45
        # Actions: open before the expert's command, closed after it.
        assert np.all(ep["action"][ep["action_t"] < close - 1e-9] == 0.0)
        assert np.all(ep["action"][ep["action_t"] >= close] == 1.0)
        # The pen is visible only in frames captured after it fell into view.
        blue = ((ep["frames"][..., 2] > 120) & (ep["frames"][..., 0] < 100)).any(axis=(1, 2))
        assert not blue[ep["t_capture"] < release].any() and blue.any()
        # The state is the jaw: open until the close command, closed 60 ms after it.
        assert np.all(ep["state"][ep["t_arrival"] <= close, 0] == 0.0)
        assert np.all(ep["state"][ep["t_arrival"] >= close + 0.06, 0] == 1.0)


def test_action_chunk_uses_exact_command_times(dataset):
    summary = load_meta(dataset)["episodes"][0]
    ep = load_episode(dataset, 0)
    close = summary["t_close_command"]
    chunk = action_chunk(ep, close - 0.025, horizon=5, dt=0.01)
    assert chunk.shape == (5, 1) and chunk.dtype == np.float32
    assert chunk[:, 0].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_episodes_regenerate_from_their_seed():
    spec, pen, camera = EpisodeSpec(), PenDropConfig(), SimCameraConfig(image_size=64)
    a, sa = record_expert_episode(11, spec, pen, camera)
    b, sb = record_expert_episode(11, spec, pen, camera)
    c, _ = record_expert_episode(12, spec, pen, camera)
    assert sa == sb and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["t_capture"], c["t_capture"])


def test_refuses_to_overwrite_without_flag(dataset, tmp_path):
    run = collect(dataset, tmp_path)
    assert run.returncode != 0 and "already holds a dataset" in run.stderr
    assert json.loads((dataset / "meta.json").read_text())["n_episodes"] == 6


def test_an_out_dir_under_a_file_is_one_config_line(tmp_path):
    """The bug: `out_dir=notes.txt/demos` ended in a hydra traceback of a NotADirectoryError."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    run = collect(blocker / "demos", tmp_path, f"hydra.run.dir={tmp_path / 'hydra'}")
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip() == (f"config: out_dir: expected a directory for the results, found {blocker / 'demos'}, "
                                  f"but {blocker} is not a directory")  # fmt: skip
