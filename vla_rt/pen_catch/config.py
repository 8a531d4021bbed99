"""Typed schemas of the pen-catch experiment configs (configs/experiment/*.yaml, configs/robot/*.yaml), with ranges.

The robot nodes are the device config dataclasses themselves (SimCameraConfig, PenDropConfig, ...) plus the `type`
key that picks the device, so a field added to a device is in its schema at once; the ranges say what the physics
and the threads can run: a camera rate <= 0 never delivers a frame, a zero gravity never drops the pen, a zero
control rate divides by zero in the output thread. `validate_pen_catch`, `validate_collect` and `validate_train`
are called first thing by the experiments' entry points; each raises ConfigError naming the dotted field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from vla_rt.arguments import BACKENDS, check_out_dir
from vla_rt.config import PRESETS, preset
from vla_rt.errors import ConfigError
from vla_rt.experiment_config import Limit, non_negative, positive, validate
from vla_rt.robot.opencv_camera import OpenCVCameraConfig
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.serial_gripper import SerialGripperConfig
from vla_rt.robot.sim_camera import SimCameraConfig
from vla_rt.robot.sim_gripper import SimGripperConfig

COUNT = Limit(ge=1, le=10_000_000)
# 10k trials is ~3 h of simulated drops and ~20 MB of trials.json (strict_json refuses past 64 MB)
TRIALS = Limit(ge=1, le=10_000, why="drops")
EPISODES = Limit(ge=1, le=100_000, why="episodes, ~100 kB each on disk")
SEED = Limit(ge=0, le=2**63 - 1, why="a seed for numpy and torch")


# ----- robot nodes ------------------------------------------------------------------------------------------------
@dataclass
class SimCameraNode(SimCameraConfig):
    type: str = "sim"
    LIMITS: ClassVar[dict[str, Limit]] = {
        "type": Limit(choices=("sim",)),
        "fps": positive("frames per second", le=10_000),
        "latency_frames": non_negative("frames between capture and delivery", le=1_000),
        "phase_s": non_negative("seconds", le=3_600),
        # the renderer's view is 345 mm tall: below 32 px the 10 mm pen is thinner than a pixel
        "image_size": Limit(ge=32, le=4096, why="pixels"),
    }


@dataclass
class SimGripperNode(SimGripperConfig):
    type: str = "sim_serial"
    LIMITS: ClassVar[dict[str, Limit]] = {
        "type": Limit(choices=("sim_serial",)),
        "closing_time_s": positive("seconds from open to closed", le=60),
        "initial_position": Limit(ge=0, le=1, why="0 open .. 1 closed"),
    }


@dataclass
class SerialLinkNode(SerialGripperConfig):
    type: str = "serial"
    LIMITS: ClassVar[dict[str, Limit]] = {
        "type": Limit(choices=("serial",)),
        "baudrate": positive("bits per second", le=100_000_000),
        "ack_timeout_s": positive("seconds", le=60),
        "retries": non_negative("resends", le=1_000),
        "reconnect_backoff_s": positive("seconds", le=3_600),
        "reconnect_backoff_max_s": positive("seconds", le=3_600),
        "max_reconnect_attempts": Limit(ge=1, le=1_000_000),
    }

    @staticmethod
    def check(node: DictConfig) -> list[ConfigError]:
        if node.reconnect_backoff_max_s < node.reconnect_backoff_s:
            return [ConfigError("reconnect_backoff_max_s", f">= reconnect_backoff_s ({node.reconnect_backoff_s})",
                                node.reconnect_backoff_max_s)]  # fmt: skip
        return []


@dataclass
class PenNode(PenDropConfig):
    LIMITS: ClassVar[dict[str, Limit]] = {
        "drop_height_m": positive("metres above the jaws", le=100),
        "pen_length_m": positive("metres", le=10),
        "pen_diameter_m": positive("metres", le=1),
        "jaw_pad_height_m": positive("metres", le=1),
        "jaw_open_gap_m": positive("metres", le=1),
        "gravity_m_s2": positive("m/s², 9.81 on Earth", le=1_000),
        "release_delay_s": non_negative("seconds", le=3_600),
        "release_jitter_s": non_negative("seconds", le=3_600),
        "lateral_range_m": non_negative("metres", le=1),
        "physics_dt_s": positive("seconds per physics step", le=0.01),
        "closed_threshold": Limit(gt=0, le=1, why="jaw position counted as closed"),
    }

    @staticmethod
    def check(node: DictConfig) -> list[ConfigError]:
        if node.jaw_open_gap_m <= node.pen_diameter_m:
            return [ConfigError("jaw_open_gap_m", f"> pen_diameter_m ({node.pen_diameter_m}): the pen must fit",
                                node.jaw_open_gap_m)]  # fmt: skip
        if node.release_jitter_s > node.release_delay_s:
            return [ConfigError("release_jitter_s", f"<= release_delay_s ({node.release_delay_s}): no release "
                                "before the episode starts", node.release_jitter_s)]  # fmt: skip
        return []


@dataclass
class OpenCVCameraNode(OpenCVCameraConfig):
    type: str = "opencv"
    index_or_path: Any = 0  # int | str, which OmegaConf cannot type; checked in `check`
    LIMITS: ClassVar[dict[str, Limit]] = {
        "type": Limit(choices=("opencv",)),
        "width": Limit(ge=1, le=16_384, why="pixels"),
        "height": Limit(ge=1, le=16_384, why="pixels"),
        "fps": positive("frames per second", le=10_000),
        "latency_s": non_negative("seconds", le=10),
        "reconnect_backoff_s": positive("seconds", le=3_600),
        "reconnect_backoff_max_s": positive("seconds", le=3_600),
        "max_reconnect_attempts": Limit(ge=1, le=1_000_000),
    }

    @staticmethod
    def check(node: DictConfig) -> list[ConfigError]:
        device = node.index_or_path
        if isinstance(device, bool) or not (
            isinstance(device, str) and device or isinstance(device, int) and device >= 0
        ):
            return [ConfigError("index_or_path", "a device index >= 0 or a path / URL", device)]
        if node.reconnect_backoff_max_s < node.reconnect_backoff_s:
            return [ConfigError("reconnect_backoff_max_s", f">= reconnect_backoff_s ({node.reconnect_backoff_s})",
                                node.reconnect_backoff_max_s)]  # fmt: skip
        return []


@dataclass
class SimRobot:
    camera: SimCameraNode = field(default_factory=SimCameraNode)
    gripper: SimGripperNode = field(default_factory=SimGripperNode)
    link: SerialLinkNode = field(default_factory=SerialLinkNode)
    pen: PenNode = field(default_factory=PenNode)


@dataclass
class HardwareRobot:
    camera: OpenCVCameraNode = field(default_factory=OpenCVCameraNode)
    link: SerialLinkNode = field(default_factory=SerialLinkNode)


# ----- experiments ------------------------------------------------------------------------------------------------
@dataclass
class PolicyNode:
    backend: str = "folded"
    num_steps: int = 10
    warmup: int = 3
    threads: int | None = 1
    latency_ms: float | None = None
    LIMITS: ClassVar[dict[str, Limit]] = {
        "backend": Limit(choices=BACKENDS),
        "num_steps": Limit(ge=1, le=1000, why="flow-matching steps"),
        "warmup": non_negative("inferences", le=10_000),
        "threads": Limit(ge=1, le=1024, why="torch threads"),
        "latency_ms": non_negative("simulated ms an inference takes", le=10_000),
    }


@dataclass
class RuntimeNode:
    control_hz: float = 200.0
    LIMITS: ClassVar[dict[str, Limit]] = {"control_hz": positive("output thread rate", le=100_000)}


@dataclass
class PenCatchConfig:
    mode: str = "sim"
    checkpoint: str = "checkpoints/pen_catch_tiny.safetensors"
    trials: int = 10
    seed: int = 10000
    realtime: bool = False
    trial_s: float = 1.0
    policy: PolicyNode = field(default_factory=PolicyNode)
    runtime: RuntimeNode = field(default_factory=RuntimeNode)
    out_dir: str | None = None
    robot: Any = None  # SimRobot or HardwareRobot, chosen by `mode`
    LIMITS: ClassVar[dict[str, Limit]] = {
        "mode": Limit(choices=("sim", "hardware")),
        "trials": TRIALS,
        "seed": SEED,
        "trial_s": positive("seconds a trial lasts", le=3_600),
    }


def check_cpu_backend(backend: str) -> None:
    """The pen catch runs its policy on the CPU (`evaluate.load_policy`), where 'triton' needs Triton's interpreter:
    refused here, before the model loads, rather than as a traceback from `load_pi0` after it."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("policy.backend", "'reference' or 'folded' (the pen catch runs its policy on the CPU, "
                          "where 'triton' needs TRITON_INTERPRET=1)", backend)  # fmt: skip


def check_mode_matches_robot(mode: str, robot: Any) -> None:
    """`mode=hardware` on the simulated rig's config (or `mode=sim` on the real rig's) is one mistake about the mode,
    not an unknown key deep in the robot node (`robot.camera.latency_frames: expected a key of [...]`)."""
    if robot is None or not hasattr(robot, "get"):
        return
    # the rig by its shape: only the simulated one has a pen and a simulated gripper (a single wrong key is left to
    # the schema's own error, which names it)
    rig = "sim" if robot.get("pen") is not None else "hardware"
    if rig == mode or rig == "hardware" and robot.get("gripper") is not None:
        return
    if mode == "hardware":
        raise ConfigError("mode", "'sim' with the simulated rig (configs/robot/sim.yaml); for the real rig use "
                          "`--config-name experiment/pen_catch_hardware` (or `mode=hardware robot=hardware`)", mode)  # fmt: skip
    raise ConfigError("mode", "'hardware' with the real rig (configs/robot/hardware.yaml); for the simulated rig use "
                      "`--config-name experiment/pen_catch` (or `mode=sim robot=sim`)", mode)  # fmt: skip


def validate_pen_catch(cfg: DictConfig) -> DictConfig:
    """configs/experiment/pen_catch*.yaml: the experiment, then its robot against the schema its mode needs."""
    checked = validate(cfg, PenCatchConfig)
    check_cpu_backend(checked.policy.backend)
    sim = checked.mode == "sim"
    check_mode_matches_robot(checked.mode, cfg.get("robot"))
    robot = validate(cfg.robot if cfg.get("robot") is not None else {}, SimRobot if sim else HardwareRobot, "robot")
    if sim:
        latest = robot.pen.release_delay_s + robot.pen.release_jitter_s
        if checked.trial_s <= latest:
            raise ConfigError(
                "trial_s",
                f"> {latest:g} s, the latest release (robot.pen.release_delay_s + release_jitter_s): a shorter trial "
                "ends before the pen falls",
                checked.trial_s,
            )
    checked.robot = robot
    return checked


@dataclass
class ExpertNode:
    close_after_release_s: float = 0.2
    LIMITS: ClassVar[dict[str, Limit]] = {"close_after_release_s": non_negative("seconds", le=60)}


@dataclass
class EpisodeNode:
    pre_release_s: float = 0.15
    post_release_s: float = 0.45
    action_hz: float = 100.0
    LIMITS: ClassVar[dict[str, Limit]] = {
        "pre_release_s": non_negative("seconds", le=3_600),
        "post_release_s": positive("seconds", le=3_600),
        "action_hz": positive("samples per second", le=100_000),
    }


@dataclass
class CollectConfig:
    n_episodes: int = 600
    seed: int = 0
    out_dir: str = "data/pen_catch"
    overwrite: bool = False
    expert: ExpertNode = field(default_factory=ExpertNode)
    episode: EpisodeNode = field(default_factory=EpisodeNode)
    robot: SimRobot = field(default_factory=SimRobot)
    LIMITS: ClassVar[dict[str, Limit]] = {"n_episodes": EPISODES, "seed": SEED}


def validate_collect(cfg: DictConfig) -> DictConfig:
    return validate(cfg, CollectConfig)


@dataclass
class ModelNode:
    preset: str = "tiny"
    image_size: int | None = None
    LIMITS: ClassVar[dict[str, Limit]] = {
        "preset": Limit(choices=tuple(sorted(PRESETS))),
        "image_size": Limit(ge=14, le=4096, why="pixels, a multiple of the patch size"),
    }


@dataclass
class ActionNode:
    horizon: int = 16
    dt_s: float = 0.02
    LIMITS: ClassVar[dict[str, Limit]] = {
        "horizon": Limit(ge=1, le=1024, why="chunk steps"),
        "dt_s": positive("seconds between chunk steps", le=60),
    }


@dataclass
class TrainConfig:
    model: ModelNode = field(default_factory=ModelNode)
    data_dir: str = "data/pen_catch"
    n_episodes: int | None = None
    val_episodes: int = 30
    action: ActionNode = field(default_factory=ActionNode)
    seed: int = 0
    max_steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    noise_on_padding: bool = False
    decision_weight: float = 3.0
    threads: int | None = None
    eval_every: int = 500
    checkpoint_every: int = 500
    checkpoint: str = "checkpoints/pen_catch_tiny.safetensors"
    loss_plot: str = "docs/pen_catch_loss.png"
    LIMITS: ClassVar[dict[str, Limit]] = {
        "n_episodes": COUNT,
        "val_episodes": non_negative("held-out episodes", le=10_000_000),
        "seed": SEED,
        "max_steps": COUNT,
        "batch_size": Limit(ge=1, le=65_536),
        "lr": positive("learning rate", le=10),
        "min_lr_fraction": Limit(ge=0, le=1),
        "warmup_steps": non_negative("steps", le=10_000_000),
        "weight_decay": non_negative(le=10),
        "grad_clip": positive("max gradient norm", le=1e6),
        "decision_weight": positive("sampling weight", le=1e6),
        "threads": Limit(ge=1, le=1024, why="torch threads"),
        "eval_every": COUNT,
        "checkpoint_every": COUNT,
    }

    @staticmethod
    def check(node: DictConfig) -> list[ConfigError]:
        size, patch = node.model.image_size, preset(node.model.preset).vision.patch_size
        if size is not None and size % patch:
            return [ConfigError("model.image_size", f"a multiple of the patch size {patch}", size)]
        return []


def validate_train(cfg: DictConfig) -> DictConfig:
    return validate(cfg, TrainConfig)


# what `plot_losses` (matplotlib's Figure.savefig) can write, by file ending
PLOT_SUFFIXES = (".avif", ".eps", ".gif", ".jpeg", ".jpg", ".pdf", ".pgf", ".png", ".ps", ".raw", ".rgba", ".svg",
                 ".svgz", ".tif", ".tiff", ".webp")  # fmt: skip


def check_output_file(path: Path, field: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """Before the work: `path` can be written as a file (not a directory, its folder creatable and writable, an
    ending the writer knows). Training writes its checkpoint and loss plot only at its end, minutes in; a bad path
    there ended in a traceback with the trained weights lost or the plot missing."""
    if path.is_dir():
        raise ConfigError(field, "a file path", str(path), found_text=f"{path}, which is a directory")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(field, f"a file name ending in one of {list(suffixes)}", str(path))
    check_out_dir(path.parent, field, ConfigError)
    return path


def check_train_outputs(checkpoint: Path, loss_plot: Path) -> None:
    """`checkpoint` (+ its `.json` sidecar) and `loss_plot`, checked before the data is read."""
    check_output_file(checkpoint, "checkpoint")
    check_output_file(loss_plot, "loss_plot", PLOT_SUFFIXES)
