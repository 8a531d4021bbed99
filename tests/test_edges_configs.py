"""Experiment configs at their edges (issue 22): each bad value is one ConfigError naming the dotted field, found
when the config is composed, before a device, a model or a thread exists."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from vla_rt.clock import SimClock
from vla_rt.errors import ConfigError
from vla_rt.experiment_config import BenchmarkLatencyConfig, bench_backends, validate
from vla_rt.pen_catch.config import validate_collect, validate_pen_catch, validate_train
from vla_rt.robot.camera import Frame
from vla_rt.runtime.camera_thread import CameraLoop
from vla_rt.runtime.events import EventLog
from vla_rt.runtime.ring import TimestampedRing

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _compose(name: str, overrides: list[str] = (), folder: Path = CONFIGS):
    with initialize_config_dir(str(folder), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_every_committed_config_validates():
    assert validate_pen_catch(_compose("experiment/pen_catch")).robot.camera.fps == 30.0
    hardware = validate_pen_catch(_compose("experiment/pen_catch_hardware"))
    assert hardware.mode == "hardware" and hardware.robot.camera.index_or_path == 0
    assert validate_collect(_compose("experiment/collect_pen_catch")).n_episodes == 600
    assert validate_train(_compose("experiment/train_pen_catch")).model.image_size == 112
    bench = validate(_compose("benchmark_latency", folder=CONFIGS / "experiment"), BenchmarkLatencyConfig)
    assert [list(c) for c in bench.cases][0] == [1, 0, 63]


PEN_CATCH_EDGES = [
    # the list: how each ended before is in /work/notes/issue-22.md
    ("robot.camera.fps=-30", "robot.camera.fps", "a number > 0 and <= 10000 (frames per second)"),
    ("robot.camera.fps=0", "robot.camera.fps", "a number > 0"),
    ("runtime.control_hz=0", "runtime.control_hz", "a number > 0 and <= 100000 (output thread rate)"),
    ("robot.camera.image_size=0", "robot.camera.image_size", "an integer >= 32 and <= 4096 (pixels)"),
    ("robot.pen.gravity_m_s2=0", "robot.pen.gravity_m_s2", "a number > 0 and <= 1000"),
    ("robot.camera.latency_frames=-1", "robot.camera.latency_frames", "a number >= 0"),
    ("trial_s=0", "trial_s", "a number > 0"),
    ("trials=-1", "trials", "an integer >= 1 and <= 10000 (drops)"),
    ("realtime=maybe", "realtime", "true or false"),
    # beyond the list
    ("trials=abc", "trials", "an integer"),
    ("trials=2.5", "trials", "an integer"),
    ("robot.camera.fps=inf", "robot.camera.fps", "a number > 0"),
    ("robot.camera.fps=nan", "robot.camera.fps", "a number > 0"),
    ("+robot.camera.fsp=30", "robot.camera.fsp", "a key of ['name', 'fps'"),
    ("+extra=1", "extra", "a key of ['mode', 'checkpoint'"),
    ("mode=simulation", "mode", "one of ['sim', 'hardware']"),
    ("policy.backend=tensorrt", "policy.backend", "one of ['reference', 'folded', 'triton']"),
    ("policy.num_steps=0", "policy.num_steps", "an integer >= 1 and <= 1000"),
    ("policy.threads=0", "policy.threads", "an integer >= 1"),
    ("seed=-1", "seed", "an integer >= 0"),
    ("robot.camera.type=opencv", "robot.camera.type", "one of ['sim']"),
    ("robot.gripper.closing_time_s=0", "robot.gripper.closing_time_s", "a number > 0"),
    ("robot.gripper.initial_position=2", "robot.gripper.initial_position", "a number >= 0 and <= 1"),
    ("robot.link.ack_timeout_s=-1", "robot.link.ack_timeout_s", "a number > 0"),
    ("robot.link.baudrate=fast", "robot.link.baudrate", "an integer"),
    ("robot.pen.physics_dt_s=1", "robot.pen.physics_dt_s", "a number > 0 and <= 0.01"),
    ("robot.pen.jaw_open_gap_m=0.005", "robot.pen.jaw_open_gap_m", "> pen_diameter_m (0.01): the pen must fit"),
    ("robot.pen.release_jitter_s=0.5", "robot.pen.release_jitter_s", "<= release_delay_s (0.3)"),
    ("trial_s=0.2", "trial_s", "> 0.35 s, the latest release"),
]


@pytest.mark.parametrize(("override", "field", "expected"), PEN_CATCH_EDGES, ids=[e[0] for e in PEN_CATCH_EDGES])
def test_pen_catch_config_edges(override, field, expected):
    with pytest.raises(ConfigError) as info:
        validate_pen_catch(_compose("experiment/pen_catch", [override]))
    err = info.value
    assert err.field == field and str(err).startswith(f"{field}: expected ") and expected in str(err), str(err)


@pytest.mark.parametrize(
    ("text", "value"), [("no", False), ("false", False), ("off", False), ("yes", True), ("true", True)]
)
def test_realtime_strings_become_booleans(text, value):
    """The bug: `realtime=no` was the truthy string 'no' and the trial ran in real time."""
    checked = validate_pen_catch(_compose("experiment/pen_catch", [f"realtime={text}"]))
    assert checked.realtime is value


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("robot.camera.index_or_path=-1", "robot.camera.index_or_path", "a device index >= 0 or a path"),
        ("robot.camera.width=0", "robot.camera.width", "an integer >= 1"),
        ("robot.link.reconnect_backoff_max_s=0.01", "robot.link.reconnect_backoff_max_s", ">= reconnect_backoff_s"),
        ("robot.link.max_reconnect_attempts=0", "robot.link.max_reconnect_attempts", "an integer >= 1"),
        ("robot.camera.reconnect_backoff_s=0", "robot.camera.reconnect_backoff_s", "a number > 0"),
        ("robot.camera.reconnect_backoff_max_s=0.01", "robot.camera.reconnect_backoff_max_s", ">= reconnect_backoff_s"),
        ("robot.camera.max_reconnect_attempts=0", "robot.camera.max_reconnect_attempts", "an integer >= 1"),
    ],
)
def test_hardware_config_edges(override, field, expected):
    with pytest.raises(ConfigError) as info:
        validate_pen_catch(_compose("experiment/pen_catch_hardware", [override]))
    assert info.value.field == field and expected in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("name", "override", "expected"),
    [
        ("experiment/pen_catch", "mode=hardware", "'sim' with the simulated rig (configs/robot/sim.yaml); for the "
         "real rig use `--config-name experiment/pen_catch_hardware` (or `mode=hardware robot=hardware`), found "
         "'hardware'"),
        ("experiment/pen_catch_hardware", "mode=sim", "'hardware' with the real rig (configs/robot/hardware.yaml); "
         "for the simulated rig use `--config-name experiment/pen_catch` (or `mode=sim robot=sim`), found 'sim'"),
    ],
)  # fmt: skip
def test_a_mode_that_does_not_match_the_rig_names_mode(name, override, expected):
    """The bug: `mode=hardware` (the yaml's own comment lists `sim | hardware`) on the simulated rig's config was
    refused as `robot.camera.latency_frames: expected a key of [...]`, and `mode=sim` on the real rig's as
    `robot.camera.index_or_path: expected a key of [...]`: nothing said the mode and the robot config disagree."""
    with pytest.raises(ConfigError) as info:
        validate_pen_catch(_compose(name, [override]))
    assert str(info.value) == f"mode: expected {expected}", str(info.value)
    matched = validate_pen_catch(_compose("experiment/pen_catch", ["mode=hardware", "robot=hardware"]))
    assert matched.mode == "hardware" and matched.robot.camera.type == "opencv"


@pytest.mark.parametrize(
    ("name", "override", "field", "expected"),
    [
        ("collect_pen_catch", "n_episodes=0", "n_episodes", "an integer >= 1 and <= 100000"),
        ("collect_pen_catch", "episode.action_hz=0", "episode.action_hz", "a number > 0"),
        ("collect_pen_catch", "overwrite=perhaps", "overwrite", "true or false"),
        ("collect_pen_catch", "robot.camera.fps=-1", "robot.camera.fps", "a number > 0"),
        ("train_pen_catch", "max_steps=0", "max_steps", "an integer >= 1"),
        ("train_pen_catch", "lr=-0.1", "lr", "a number > 0"),
        ("train_pen_catch", "batch_size=0", "batch_size", "an integer >= 1"),
        ("train_pen_catch", "action.horizon=0", "action.horizon", "an integer >= 1 and <= 1024"),
        ("train_pen_catch", "action.dt_s=0", "action.dt_s", "a number > 0"),
        ("train_pen_catch", "model.preset=huge", "model.preset", "one of ['dummy', 'pi0'"),
        ("train_pen_catch", "model.image_size=100", "model.image_size", "a multiple of the patch size 14"),
        ("train_pen_catch", "min_lr_fraction=2", "min_lr_fraction", "a number >= 0 and <= 1"),
    ],
)
def test_collect_and_train_config_edges(name, override, field, expected):
    validator = validate_collect if name.startswith("collect") else validate_train
    with pytest.raises(ConfigError) as info:
        validator(_compose(f"experiment/{name}", [override]))
    assert info.value.field == field and expected in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("iters=0", "iters", "an integer >= 1"),
        ("warmup=-1", "warmup", "an integer >= 0"),
        ("compile_budget_s=0", "compile_budget_s", "a number > 0"),
        ("preset=nope", "preset", "null or one of"),
        ("cases=[[1,0]]", "cases[0]", "[views, prompt_len, chunk] with num_views in [1, 16]"),
        ("cases=[[0,0,4]]", "cases[0]", "[views, prompt_len, chunk]"),
        ("cases=[]", "cases", "at least one"),
    ],
)
def test_benchmark_config_edges(override, field, expected):
    with pytest.raises(ConfigError) as info:
        validate(_compose("benchmark_latency", [override], CONFIGS / "experiment"), BenchmarkLatencyConfig)
    assert info.value.field == field and expected in str(info.value), str(info.value)


def test_benchmark_backends_are_checked():
    assert bench_backends(None, cuda=False) == ("reference", "folded", "static-torch")
    with pytest.raises(ConfigError, match=r"^backends: expected names from \['reference', 'folded', 'static-torch'\]"):
        bench_backends(["nope"], cuda=False)


def test_bad_override_ends_the_script_in_one_line_before_any_work():
    """Through the real entry point: one line on stderr, no traceback, no trial run, no model loaded."""
    cmd = [sys.executable, str(ROOT / "experiments" / "pen_catch.py"), "robot.camera.fps=-30", "hydra.run.dir=/tmp/x"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc
    assert (
        proc.stderr.strip()
        == "config: robot.camera.fps: expected a number > 0 and <= 10000 (frames per second), found -30.0"
    )
    assert "Traceback" not in proc.stderr and "trial" not in proc.stdout


def test_benchmark_out_dir_under_a_file_ends_the_script_before_any_row(tmp_path):
    """The bug: `out_dir=notes.txt/run` timed every row, then ended in a hydra traceback of a NotADirectoryError."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    cmd = [sys.executable, str(ROOT / "experiments" / "benchmark_latency.py"), f"out_dir={blocker / 'run'}",
           "iters=1", "cases=[[1,0,4]]", f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc
    assert proc.stderr.strip() == (f"config: out_dir: expected a directory for the results, found {blocker / 'run'}, "
                                   f"but {blocker} is not a directory")  # fmt: skip
    assert "median" not in proc.stdout


def test_benchmark_prompt_longer_than_the_preset_takes_ends_the_script_before_any_row(tmp_path):
    """The bug: `cases=[[1,0,4],[1,60,4]]` timed the first case, then ended in a hydra traceback of an InputError."""
    cmd = [sys.executable, str(ROOT / "experiments" / "benchmark_latency.py"), f"out_dir={tmp_path / 'run'}",
           "iters=1", "cases=[[1,0,4],[1,60,4]]", f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc
    assert proc.stderr.strip() == ("config: cases[1]: expected prompt lengths of at most 48 (the 'tiny' preset's "
                                   "max_token_len), found 1,60,4 (prompt 60)")  # fmt: skip
    assert "median" not in proc.stdout


def test_triton_backend_is_refused_before_the_pen_catch_model_loads(monkeypatch):
    """The bug: `policy.backend=triton` passed validation, then `load_pi0` on the CPU raised a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as info:
        validate_pen_catch(_compose("experiment/pen_catch", ["policy.backend=triton"]))
    assert info.value.field == "policy.backend" and "TRITON_INTERPRET=1" in str(info.value), str(info.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter: the CPU can run it
    assert validate_pen_catch(_compose("experiment/pen_catch", ["policy.backend=triton"])).policy.backend == "triton"


def test_a_bad_sidecar_is_one_error_naming_it(tmp_path):
    """The bug: a sidecar that is not JSON raised json.JSONDecodeError with no file name."""
    from vla_rt.pen_catch import PenCatchSetupError
    from vla_rt.pen_catch.evaluate import load_schedule

    checkpoint = tmp_path / "pc.safetensors"
    checkpoint.write_bytes(b"")
    for text, words in [('{"dt_action_s": 0.02', "invalid JSON"), ("[1, 2]", "a JSON object, found a list")]:
        (tmp_path / "pc.json").write_text(text)
        with pytest.raises(PenCatchSetupError, match=rf"^{tmp_path / 'pc.json'}: expected .*{words}"):
            load_schedule(checkpoint)


def test_a_truncated_checkpoint_ends_pen_catch_in_one_line(tmp_path):
    """The bug: a CheckpointError (here: a truncated file) escaped the entry point as a hydra traceback."""
    source = ROOT / "checkpoints" / "pen_catch_tiny.safetensors"
    (tmp_path / "cut.safetensors").write_bytes(source.read_bytes()[:50_000])
    (tmp_path / "cut.json").write_text(source.with_suffix(".json").read_text())
    cmd = [sys.executable, str(ROOT / "experiments" / "pen_catch.py"), "trials=1",
           f"checkpoint={tmp_path / 'cut.safetensors'}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith(f"{tmp_path / 'cut.safetensors'}: truncated"), proc.stderr


def test_pen_catch_out_dir_under_a_file_ends_in_one_line_before_the_model_loads(tmp_path):
    """The bug: `out_dir=notes.txt/run` ended pen_catch.py in a hydra traceback of a NotADirectoryError."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    cmd = [sys.executable, str(ROOT / "experiments" / "pen_catch.py"), "trials=1", f"out_dir={blocker / 'run'}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"config: out_dir: expected a directory for the results, found {blocker / 'run'}, "
                                   f"but {blocker} is not a directory")  # fmt: skip
    assert "trial" not in proc.stdout


def test_train_n_episodes_beyond_the_dataset_is_a_config_error():
    """The bug: `n_episodes=100` on a 6-episode dataset ended in a traceback of a bare ValueError; now the entry
    point's `config: n_episodes: ...` line, naming how many the dataset holds."""
    from vla_rt.pen_catch.samples import split_episodes

    meta = {"episodes": [{"file": f"{i}.npz"} for i in range(6)]}
    with pytest.raises(ConfigError) as info:
        split_episodes(meta, 100, 1)
    assert str(info.value) == "n_episodes: expected null or at most 6 (the episodes the dataset holds), found 100"
    assert [len(part) for part in split_episodes(meta, 5, 1)] == [4, 1]


def test_train_output_paths_are_checked_before_any_data_or_step(tmp_path):
    """The bug: `checkpoint=notes.txt/pc.safetensors` (or `loss_plot=/proc/loss.png`, `loss_plot=loss.txt`) trained
    for minutes, then ended in a hydra traceback of an OSError / matplotlib's ValueError, the weights or the plot lost.
    Now the entry point's `config: <field>: ...` line, before the dataset is even looked for."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    cases = [
        ([f"checkpoint={blocker / 'pc.safetensors'}"],
         f"config: checkpoint: expected a directory for the results, found {blocker}, which is not a directory"),
        ([f"checkpoint={tmp_path}"], f"config: checkpoint: expected a file path, found {tmp_path}, which is a directory"),
        ([f"loss_plot={tmp_path / 'loss.txt'}"],
         "config: loss_plot: expected a file name ending in one of ['.avif', "),
    ]  # fmt: skip
    for overrides, message in cases:
        cmd = [sys.executable, str(ROOT / "experiments" / "train_pen_catch.py"), f"data_dir={tmp_path / 'none'}",
               f"checkpoint={tmp_path / 'ok.safetensors'}", f"loss_plot={tmp_path / 'ok.png'}", *overrides,
               f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().startswith(message), proc.stderr
        assert not (tmp_path / "ok.safetensors").exists()


def test_sim_camera_refuses_a_rate_that_runs_time_backwards():
    from vla_rt.robot.pen_drop import PenDropSim
    from vla_rt.robot.sim_camera import SimCamera, SimCameraConfig

    class Jaws:
        position = 0.0

        def position_at(self, t):
            return 0.0

    for fps, latency in ((-30.0, 2.0), (0.0, 2.0), (30.0, -1.0), (float("nan"), 2.0)):
        with pytest.raises(ConfigError, match="fps > 0 and latency_frames >= 0"):
            SimCamera(PenDropSim(Jaws(), seed=0), SimCameraConfig(fps=fps, latency_frames=latency), SimClock())


class BackwardsCamera:
    """A driver bug: every frame is stamped earlier than the last, and delivered at once."""

    name = "cam"
    is_connected = True

    def __init__(self):
        self.index = 0

    def read(self, timeout_s=None):
        self.index += 1
        return Frame(np.zeros((4, 4, 3), np.uint8), 100.0 - self.index, 0.0, self.index)


def test_camera_thread_does_not_spin_on_backwards_timestamps(tmp_path):
    """The bug under `fps=-30`: the camera loop logged 'capture time went backwards' without letting simulated time
    pass, so the run hung while the event log grew."""
    clock = SimClock()
    log = EventLog(tmp_path / "events.jsonl", clock)
    stop = threading.Event()
    ring = TimestampedRing(4, clock, "frames")
    loop = CameraLoop(BackwardsCamera(), ring, log, clock, stop, stall_timeout_s=0.1)
    thread = clock.start_thread(loop.run, "camera")
    done = threading.Thread(target=clock.advance, args=(1.0,), daemon=True)
    done.start()
    done.join(timeout=60)
    assert not done.is_alive(), "simulated time did not advance: the camera thread spins"
    stop.set()
    ring.close()
    clock.join_thread(thread, 2.0)
    assert 5 <= loop.errors <= 11  # one error per stall timeout (0.1 s) of simulated time, not thousands


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        ({"control_hz": 0.0}, "control_hz", "a number > 0"),
        ({"dt_action_s": -0.01}, "dt_action_s", "a number > 0"),
        ({"camera_stall_timeout_s": 0.0}, "camera_stall_timeout_s", "a number > 0"),
        ({"frame_ring_capacity": 0}, "frame_ring_capacity", "an integer >= 1"),
        ({"nan_limit": 0}, "nan_limit", "an integer >= 1"),
        ({"action_time_origin": "now"}, "action_time_origin", "one of ['inference_done', 'frame_capture']"),
        ({"on_gripper_disconnect": "panic"}, "on_gripper_disconnect", "one of ['reconnect', 'stop']"),
        ({"safe_action": float("nan")}, "safe_action", "a finite gripper target"),
        ({"initial_action": float("inf")}, "initial_action", "a finite gripper target"),
        ({"action_range": (1.0, 0.0)}, "action_range", "low < high"),
        ({"event_log_max_bytes": 10}, "event_log_max_bytes", "an integer >= 1024"),
    ],
)
def test_runtime_config_is_checked_before_any_thread(change, field, expected):
    """From Python (no hydra) too: a zero control rate was a ZeroDivisionError inside the output thread."""
    from vla_rt.runtime.runtime import Runtime, RuntimeConfig

    class Device:
        name = "cam"
        is_connected = False

        def connect(self):
            raise AssertionError("a device was connected before the config was checked")

    with pytest.raises(ConfigError) as info:
        Runtime(Device(), policy=None, gripper=Device(), clock=SimClock(), config=RuntimeConfig(**change))
    assert info.value.field == field and expected in str(info.value), str(info.value)
