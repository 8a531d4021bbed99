"""`make_vla_rt_pre_post_processors`: the checkpoint's own processors, so vla-rt sees what LeRobot's π0 sees.

- A LeRobot `pi0` / `pi05` dir that carries its processors (`policy_preprocessor.json` / `policy_postprocessor.json`,
  as `lerobot-train` saves them): those very pipelines are loaded (normalisation, the π0.5 state-in-prompt step,
  the PaliGemma tokenizer step), with their device step moved to the policy's device.
- Any other checkpoint (openpi, native, a LeRobot dir without processor files, random:...): LeRobot's own π0 or
  π0.5 processor factory is built over the checkpoint's norm stats (else the dataset's), with the checkpoint's
  normalisation mode (z-score or quantiles; π0 z-score and π0.5 quantiles when it records none), its prompt
  length and, for a LeRobot dir, its relative-action settings. Normalisation then follows LeRobot's formulas, not
  openpi's (z-score eps 1e-8 instead of 1e-6).

LeRobot calls this when it builds processors "from scratch" (`make_pre_post_processors` without a pretrained
path, e.g. `--policy.type=vla_rt --policy.checkpoint=...`); with `--policy.pretrained_path=<LeRobot dir>` it loads
that dir's processor files itself, which is the same thing.

Either way the pre-processor this factory returns (and so a dir the plugin saved) checks the state's size first
(`StateSizeCheckStep`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lerobot.configs import NormalizationMode, PipelineFeatureType, PolicyFeature
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
from lerobot.processor import (
    AbsoluteActionsProcessorStep,
    NormalizerProcessorStep,
    ObservationProcessorStep,
    PolicyAction,
    PolicyProcessorPipeline,
    ProcessorStepRegistry,
    RelativeActionsProcessorStep,
)
from lerobot.processor.converters import (
    batch_to_transition,
    policy_action_to_transition,
    transition_to_batch,
    transition_to_policy_action,
)
from lerobot.utils.constants import ACTION, OBS_STATE

from vla_rt.checkpoints import load_checkpoint
from vla_rt.errors import CheckpointError, InputError

from .configuration_vla_rt import VlaRtConfig, _lerobot_config

PREPROCESSOR_FILE = "policy_preprocessor.json"
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's π0 / π0.5 processor factories name
POSTPROCESSOR_FILE = "policy_postprocessor.json"
Pipelines = tuple[
    PolicyProcessorPipeline[dict[str, Any], dict[str, Any]], PolicyProcessorPipeline[PolicyAction, PolicyAction]
]


def make_vla_rt_pre_post_processors(
    config: VlaRtConfig, dataset_stats: dict[str, dict[str, torch.Tensor]] | None = None
) -> Pipelines:
    """The pre- and post-processor for `config`'s checkpoint (see the module docstring for which)."""
    folder = config.lerobot_checkpoint_dir()
    if folder is not None and (folder / PREPROCESSOR_FILE).is_file() and (folder / POSTPROCESSOR_FILE).is_file():
        pre, post = _saved_pipelines(folder, config.resolved_device())
    else:
        pre, post = _pipelines_from_stats(config, dataset_stats)
    return _with_state_check(pre), post


@ProcessorStepRegistry.register(name="vla_rt_state_size_check")
@dataclass
class StateSizeCheckStep(ObservationProcessorStep):
    """Refuses an `observation.state` whose size is not the checkpoint's, naming the field and both sizes.

    LeRobot's normaliser subtracts the checkpoint's state stats: the state of another robot (an env or dataset whose
    state dims differ) failed there with torch's bare 'The size of tensor a (2) must match the size of tensor b
    (14)', and a state of one value broadcast silently. This step sits just before the steps that read the state
    (relative actions, the normaliser); `size` is the size of the normaliser's state stats.
    """

    size: int

    def observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        state = observation.get(OBS_STATE)
        shape = getattr(state, "shape", None)
        if shape is not None and (len(shape) == 0 or shape[-1] != self.size):
            raise InputError(
                OBS_STATE,
                f"{self.size} values a row (the checkpoint's state size, from its normalisation stats: the env, "
                "dataset or robot must be the one the checkpoint was trained on)",
                None,
                found_text=f"{shape[-1] if len(shape) else 'a scalar'} (shape {tuple(shape)})",
            )
        return observation

    def get_config(self) -> dict[str, Any]:
        return {"size": self.size}

    def transform_features(
        self, features: dict[PipelineFeatureType, dict[str, PolicyFeature]]
    ) -> dict[PipelineFeatureType, dict[str, PolicyFeature]]:
        return features


def _with_state_check(pre: PolicyProcessorPipeline) -> PolicyProcessorPipeline:
    """`pre` with a StateSizeCheckStep before its first step that reads the state, when its normaliser knows the
    state's size (no state stats: nothing would fail on the size, and no size to check against)."""
    steps = list(pre.steps)
    normaliser = next((s for s in steps if isinstance(s, NormalizerProcessorStep)), None)
    size = _stats_size((normaliser.stats or {}).get(OBS_STATE)) if normaliser is not None else None
    if size is None or any(isinstance(s, StateSizeCheckStep) for s in steps):
        return pre
    first = next(
        i for i, s in enumerate(steps) if isinstance(s, RelativeActionsProcessorStep | NormalizerProcessorStep)
    )
    steps.insert(first, StateSizeCheckStep(size=size))
    pre.steps = steps
    return pre


def _stats_size(stats: dict | None) -> int | None:
    """The last dim of a feature's normalisation stats (mean, std, q01, ...: all the same size), or None."""
    for value in (stats or {}).values():
        shape = torch.as_tensor(value).shape
        if len(shape):
            return int(shape[-1])
    return None


def _saved_pipelines(folder: Path, device: str) -> Pipelines:
    overrides = {}
    if _has_step(folder / PREPROCESSOR_FILE, "device_processor"):
        overrides["device_processor"] = {"device": device}
    pre = PolicyProcessorPipeline.from_pretrained(
        folder,
        config_filename=PREPROCESSOR_FILE,
        overrides=overrides,
        to_transition=batch_to_transition,
        to_output=transition_to_batch,
    )
    post = PolicyProcessorPipeline.from_pretrained(
        folder,
        config_filename=POSTPROCESSOR_FILE,
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )
    # Relative actions (`use_relative_actions`): the post-processor's absolute step reads the state the
    # pre-processor's relative step cached; that link is not saved, so it is made again, as LeRobot's
    # make_pre_post_processors does for a pretrained path (without it every action raised RuntimeError).
    relative = next((s for s in pre.steps if isinstance(s, RelativeActionsProcessorStep)), None)
    for step in post.steps:
        if relative is not None and isinstance(step, AbsoluteActionsProcessorStep) and step.relative_step is None:
            step.relative_step = relative
    return pre, post


def prompt_tokenizer_name(config: VlaRtConfig) -> str:
    """The tokenizer the checkpoint's pre-processor loads: its tokenizer step's `tokenizer_name`, else PaliGemma's."""
    folder = config.lerobot_checkpoint_dir()
    if folder is not None and (folder / PREPROCESSOR_FILE).is_file():
        for step in _steps(folder / PREPROCESSOR_FILE):
            if isinstance(step, dict) and step.get("registry_name") == "tokenizer_processor":
                name = (step.get("config") or {}).get("tokenizer_name")
                if isinstance(name, str) and name:
                    return name
    return PALIGEMMA_TOKENIZER


def _steps(file: Path) -> list:
    try:
        steps = json.loads(file.read_text()).get("steps", [])
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(file, f"not a LeRobot processor file ({e})") from None
    return steps if isinstance(steps, list) else []


def _has_step(file: Path, registry_name: str) -> bool:
    return any(isinstance(s, dict) and s.get("registry_name") == registry_name for s in _steps(file))


def _lerobot_stats(norm_stats: dict) -> dict[str, dict[str, torch.Tensor]]:
    """vla-rt's openpi-style stats (`state`, `actions`) -> LeRobot's (`observation.state`, `action`)."""
    out = {}
    for key, feature in (("state", OBS_STATE), ("actions", ACTION)):
        if key in norm_stats:
            stats = norm_stats[key]
            fields = {"mean": stats.mean, "std": stats.std, "q01": stats.q01, "q99": stats.q99}
            out[feature] = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in fields.items() if v is not None}
    return out


def _pipelines_from_stats(config: VlaRtConfig, dataset_stats: dict | None) -> Pipelines:
    ckpt = load_checkpoint(config.checkpoint_source, shapes_only=True)
    model = ckpt.config
    quantiles = ckpt.use_quantile_norm if ckpt.use_quantile_norm is not None else model.pi05
    mode = NormalizationMode.QUANTILES if quantiles else NormalizationMode.MEAN_STD
    stats = _lerobot_stats(ckpt.norm_stats) if ckpt.norm_stats else dataset_stats
    pi_config = (PI05Config if model.pi05 else PI0Config)(
        device=config.resolved_device(),
        input_features=dict(config.input_features or {}),
        output_features=dict(config.output_features or {}),
        chunk_size=model.chunk,
        n_action_steps=min(config.n_action_steps or model.chunk, model.chunk),
        tokenizer_max_length=model.max_token_len,
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": mode, "ACTION": mode},
        **_relative_action_settings(config, ckpt.relative_actions),
    )
    make = make_pi05_pre_post_processors if model.pi05 else make_pi0_pre_post_processors
    return make(pi_config, dataset_stats=stats)


RELATIVE_ACTION_FIELDS = ("use_relative_actions", "relative_exclude_joints", "action_feature_names")


def _relative_action_settings(config: VlaRtConfig, use_relative_actions: bool) -> dict[str, Any]:
    """A LeRobot checkpoint's relative-action settings (config.json), for its rebuilt processors. A checkpoint trained
    with `use_relative_actions` predicts deltas from the state: processors built without them play each delta as an
    absolute position, silently. Other checkpoints record none ({}: LeRobot's defaults, relative actions off).
    `use_relative_actions` is the checkpoint reader's (`LoadedCheckpoint.relative_actions`, checked there); the two
    lists beside it are checked here."""
    folder = config.lerobot_checkpoint_dir()
    saved = _lerobot_config(folder) if folder is not None else None
    if saved is None:
        return {}
    settings = {key: saved[key] for key in RELATIVE_ACTION_FIELDS[1:] if key in saved}
    for key, value in settings.items():
        if not _is_name_list(key, value):
            raise CheckpointError(folder / "config.json", f"{key} is {value!r}, expected a list of names")
    if "use_relative_actions" in saved:
        settings["use_relative_actions"] = use_relative_actions
    return settings


def _is_name_list(key: str, value: object) -> bool:
    if key == "action_feature_names" and value is None:
        return True
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
