"""`VlaRtConfig`: what `--policy.type=vla_rt` parses into (LeRobot's draccus config registry).

LeRobot's factory resolves a policy by naming convention: the config registered under "vla_rt" is `VlaRtConfig` in
`configuration_vla_rt`, so the policy must be `VlaRtPolicy` in the sibling `modeling_vla_rt` and the processor
factory `make_vla_rt_pre_post_processors` in `processor_vla_rt`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import draccus
from lerobot.configs import PreTrainedConfig
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.optim import AdamWConfig

from vla_rt.arguments import LIMITS
from vla_rt.errors import ArgumentError, CheckpointError, VlaRtError

BACKENDS = ("triton", "folded", "reference")
DTYPES = ("float32", "bfloat16", "float16")
LEROBOT_TYPES = ("pi0", "pi05")
DEFAULT_NUM_STEPS = 10  # LeRobot's π0 / π0.5 num_inference_steps default, and vla-rt's


@PreTrainedConfig.register_subclass("vla_rt")
@dataclass
class VlaRtConfig(PreTrainedConfig):
    """A π0 / π0.5 checkpoint run by vla-rt behind LeRobot's policy interface.

    checkpoint: a LeRobot `pi0` / `pi05` dir, an openpi checkpoint, a native `.safetensors` or `random:<preset>`;
        when unset, `pretrained_path` (LeRobot's `--policy.pretrained_path`) names it.
    backend: `triton` (one CUDA Graph, CUDA only), `folded` or `reference`; unset: triton on CUDA, folded on the CPU.
    dtype: `float32`, `bfloat16` or `float16`; unset: bfloat16 on CUDA, float32 on the CPU.
    num_steps: denoising steps a chunk (the triton engine captures this count); unset: the LeRobot checkpoint's
        `num_inference_steps`, else 10.
    n_action_steps: actions of each chunk that `select_action` plays before it computes the next chunk; unset: the
        LeRobot checkpoint's own `n_action_steps`, else the whole chunk.
    batch_size: the batch the triton engine is captured for (the folded and reference backends take any).
    """

    checkpoint: str | None = None
    backend: str | None = None
    dtype: str | None = None
    num_steps: int | None = None
    n_action_steps: int | None = None
    batch_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # resolves `device` as LeRobot does (cuda, mps or cpu when unset)
        # LeRobot's CLI parser (draccus) turns a ValueError raised while it builds this config into "Couldn't
        # instantiate class VlaRtConfig using the given arguments", its message gone. So a bad setting is kept here
        # and raised by validate_features(), the policy's first step (make_policy), with its message.
        self._setting_error: VlaRtError | None = None
        try:
            self._check_settings()
        except VlaRtError as e:
            self._setting_error = e

    def _check_settings(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ArgumentError("policy.backend", f"one of {list(BACKENDS)} or unset", self.backend)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ArgumentError("policy.dtype", f"one of {list(DTYPES)} or unset", self.dtype)
        for name in ("num_steps", "n_action_steps", "batch_size"):
            value = getattr(self, name)
            if name in ("num_steps", "n_action_steps") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"policy.{name}", "an integer >= 1", value)
        # `--policy.pretrained_path=<LeRobot dir>` names the checkpoint as well as `--policy.checkpoint` does, so its
        # cameras and n_action_steps are kept either way (with pretrained_path alone, n_action_steps was the whole
        # chunk and the cameras the env's or dataset's, silently).
        source = self.checkpoint or self.pretrained_path
        if source is not None:
            self._defaults_from_lerobot_checkpoint(_lerobot_folder(Path(source)))

    # ----- where the weights are -----------------------------------------------------------------------------------
    @property
    def checkpoint_source(self) -> str:
        """The checkpoint to load: `checkpoint`, else `pretrained_path`. Raises ArgumentError when neither is set."""
        source = self.checkpoint or (str(self.pretrained_path) if self.pretrained_path else None)
        if not source:
            raise ArgumentError(
                "policy.checkpoint",
                "a π0 / π0.5 checkpoint: a LeRobot pi0/pi05 dir, an openpi checkpoint, a native .safetensors or "
                "random:<preset> (or --policy.pretrained_path)",
                None,
            )
        return source

    def lerobot_checkpoint_dir(self) -> Path | None:
        """The checkpoint's folder when it is a LeRobot π0 / π0.5 dir (config.json of type pi0 or pi05) or that dir's
        model.safetensors, else None."""
        folder = _lerobot_folder(Path(self.checkpoint_source))
        config = _lerobot_config(folder)
        return folder if config is not None else None

    def resolved_num_steps(self) -> int:
        """`num_steps`, else the LeRobot checkpoint's `num_inference_steps` (what LeRobot's π0 runs it with), else 10.
        Read when the policy is built, so a checkpoint named after the config was made counts too."""
        if self.num_steps is not None:
            return self.num_steps
        folder = self.lerobot_checkpoint_dir()
        saved = _num_inference_steps(folder) if folder is not None else None
        return saved if saved is not None else DEFAULT_NUM_STEPS

    def resolved_device(self) -> str:
        return str(self.device or "cpu")

    def resolved_backend(self) -> str:
        if self.backend is not None:
            return self.backend
        return "triton" if self.resolved_device().startswith("cuda") else "folded"

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"

    def _defaults_from_lerobot_checkpoint(self, folder: Path) -> None:
        """A LeRobot checkpoint names its cameras and their order, and how many actions of a chunk to play: keep
        them, as LeRobot's own π0 does when it loads that checkpoint (the factory fills features from the env or
        dataset only when none are set)."""
        config = _lerobot_config(folder)
        if config is None:
            return
        if self.n_action_steps is None and isinstance(config.get("n_action_steps"), int):
            self.n_action_steps = config["n_action_steps"]
        saved_steps = _num_inference_steps(folder)
        if self.num_steps is not None and saved_steps is not None and self.num_steps != saved_steps:
            logging.warning(  # a speed / quality trade the user chose: kept, but never silently
                "policy.num_steps=%d overrides the checkpoint's num_inference_steps=%d (%s): the actions differ from "
                "LeRobot's π0 on this checkpoint",
                self.num_steps,
                saved_steps,
                folder / "config.json",
            )
        if self.input_features:
            return
        try:
            self.input_features = draccus.decode(dict[str, PolicyFeature], config.get("input_features") or {})
            if not self.output_features:
                self.output_features = draccus.decode(dict[str, PolicyFeature], config.get("output_features") or {})
        except Exception as e:  # draccus raises its own DecodingError family
            raise CheckpointError(
                folder / "config.json", f"input_features / output_features do not decode: {e}"
            ) from None

    # ----- LeRobot's policy-config interface -----------------------------------------------------------------------
    def validate_features(self) -> None:
        """Raises the first bad setting (see __post_init__), then checks the cameras and the action."""
        if getattr(self, "_setting_error", None) is not None:
            raise self._setting_error
        if not self.image_features:
            raise ArgumentError(
                "policy.input_features",
                f"at least one {FeatureType.VISUAL.value} feature (a camera), from the checkpoint's config.json, "
                "the dataset or the env",
                None,
                found_text=str(sorted(self.input_features or {})),
            )
        if self.action_feature is None:
            raise ArgumentError(
                "policy.output_features",
                "an 'action' feature",
                None,
                found_text=str(sorted(self.output_features or {})),
            )

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> None:  # inference only: no training targets to load
        return None

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        return AdamWConfig()  # never used: VlaRtPolicy.forward refuses training

    def get_scheduler_preset(self) -> None:
        return None


def _lerobot_folder(path: Path) -> Path:
    """A LeRobot dir's model.safetensors names that dir (vla-rt loads either): its config.json and processors count."""
    if path.name == "model.safetensors" and path.is_file() and (path.parent / "config.json").is_file():
        return path.parent
    return path


def _num_inference_steps(folder: Path) -> int | None:
    """The denoising steps LeRobot's π0 / π0.5 config.json in `folder` names (`num_inference_steps`), or None."""
    config = _lerobot_config(folder)
    value = config.get("num_inference_steps") if config is not None else None
    if value is None:
        return None
    lo, hi = LIMITS["num_steps"]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointError(
            folder / "config.json", f"num_inference_steps is {value!r}, expected an integer in [{lo}, {hi}]"
        )
    return value


def _lerobot_config(folder: Path) -> dict | None:
    """config.json of a LeRobot π0 / π0.5 dir, or None when `folder` is not one (other formats, random:...)."""
    file = folder / "config.json"
    if not (folder.is_dir() and file.is_file() and (folder / "model.safetensors").is_file()):
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(file, f"not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("type") not in LEROBOT_TYPES:
        return None
    return config
