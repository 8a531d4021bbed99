"""Robot profiles: openpi's public observation formats in, the policy's observation out, and back for actions.

A profile does what openpi's robot transforms do (`policies/aloha_policy.py`, `droid_policy.py`,
`libero_policy.py`; see docs/serving.md for the facts): it renames the robot's cameras to the model's views, turns
images into HWC uint8, assembles the state, and on the way back turns un-normalized model actions into robot
commands (delta joints made absolute against the state, the robot's dims, Aloha's joint/gripper conversion).
Normalization, image resizing and prompt tokenization (for π0.5 the state is written into the prompt) are the
policy's job: a profile hands over the raw prompt and the state in the policy's space.

Every field is checked: an unknown or missing key, a wrong shape or dtype, a non-finite number ends in an
`ObservationError` that names the key, what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from vla_rt.serve import aloha

MODEL_VIEWS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")  # π0's image slots, in prefix order
PROMPT_KEYS = ("prompt", "tokenized_prompt", "tokenized_prompt_mask")


class ObservationError(ValueError):
    """An observation that does not fit the robot profile (names the key, expected and found)."""


def _fail(key: str, expected: str, found: object) -> ObservationError:
    return ObservationError(f"{key}: expected {expected}, found {found}")


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {x.shape}"
    return type(x).__name__


def _vector(obs: Mapping[str, Any], key: str, size: int | None) -> np.ndarray:
    """A 1-D vector of finite numbers (`size` entries, or any count when None) as float64."""
    x = obs[key]
    if isinstance(x, (list, tuple)):
        x = np.asarray(x) if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x) else x
    if isinstance(x, (int, float, np.number)) and not isinstance(x, bool):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iuf":
        raise _fail(key, f"a numeric vector of {size or 'N'} values", _describe(x))
    if x.ndim == 0 and size == 1:
        x = x.reshape(1)
    if x.ndim != 1 or (size is not None and x.shape[0] != size) or x.shape[0] == 0:
        raise _fail(key, f"shape ({size or 'N'},)", f"shape {x.shape}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise _fail(key, "finite values", f"NaN or inf at index {np.flatnonzero(~np.isfinite(x)).tolist()}")
    return x


def _image(x: Any, key: str, layout: str) -> np.ndarray:
    """An RGB image -> (H, W, 3) uint8 as openpi's transforms make it.

    layout "chw": must be (3, H, W) (Aloha cameras); "either": (3, H, W) when shape[0] == 3, else (H, W, 3), as
    DROID / LIBERO parse it; "hwc": must be (H, W, 3). Float images in [0, 1] become uint8(255 * x) (openpi's
    truncating cast); float values outside [0, 1] are refused instead of wrapping around.
    """
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "uf":
        raise _fail(key, "an RGB image array of uint8 (or float in [0, 1])", _describe(x))
    if x.dtype.kind == "u" and x.dtype != np.uint8:
        raise _fail(key, "dtype uint8 (or float in [0, 1])", x.dtype)
    expected = {"chw": "shape (3, H, W)", "hwc": "shape (H, W, 3)", "either": "shape (H, W, 3) or (3, H, W)"}[layout]
    chw = x.ndim == 3 and x.shape[0] == 3 and layout != "hwc"
    hwc = x.ndim == 3 and x.shape[2] == 3 and layout != "chw"
    if not (chw or hwc) or min(x.shape) < 1:
        raise _fail(key, expected, f"shape {x.shape}")
    if x.dtype.kind == "f":
        if not np.isfinite(x).all() or float(x.min()) < 0.0 or float(x.max()) > 1.0:
            raise _fail(
                key,
                "float values in [0, 1] (or uint8)",
                f"range [{float(np.nanmin(x)):.3g}, {float(np.nanmax(x)):.3g}]",
            )
        x = (255 * x).astype(np.uint8)
    if chw:
        x = np.transpose(x, (1, 2, 0))
    return np.ascontiguousarray(x)


def _prompt(obs: Mapping[str, Any], default_prompt: str | None, required: bool) -> dict[str, Any]:
    """The prompt fields for the policy: {"prompt": str} or {"prompt_tokens": int ids}, or {} when none is given."""
    text, ids = obs.get("prompt"), obs.get("tokenized_prompt")
    if "tokenized_prompt_mask" in obs and ids is None:
        raise _fail("tokenized_prompt_mask", "to come with tokenized_prompt", "it alone")
    if text is not None and ids is not None:
        raise _fail("prompt", "either 'prompt' (text) or 'tokenized_prompt' (ids)", "both")
    if ids is not None:
        if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            ids = np.asarray(ids, dtype=np.int64)
        if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise _fail("tokenized_prompt", "a 1-D array of integer token ids", _describe(ids))
        mask = obs.get("tokenized_prompt_mask")
        if mask is not None:
            if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != ids.shape:
                raise _fail(
                    "tokenized_prompt_mask", f"a bool array of shape {ids.shape} like tokenized_prompt", _describe(mask)
                )
            # openpi pads ids with a False mask; the valid ids in order give the same model input (masked keys
            # are invisible and positions count valid tokens only)
            ids = ids[mask]
        if ids.size == 0:
            raise _fail("tokenized_prompt", "at least one valid token id", "none")
        return {"prompt_tokens": ids.astype(np.int64)}
    if text is None and default_prompt is not None:
        text = default_prompt
    if text is None:
        if required:
            raise _fail("prompt", "a 'prompt' string or 'tokenized_prompt' ids (openpi's π0 always has a prompt; "
                        "or start the server with --default-prompt)", "neither")  # fmt: skip
        return {}
    if isinstance(text, bytes):  # DROID clients may send the instruction as bytes
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail("prompt", "UTF-8 text", "bytes that are not UTF-8") from None
    if not isinstance(text, str):
        raise _fail("prompt", "a string", _describe(text))
    return {"prompt": text}


@dataclass(frozen=True)
class RobotInputs:
    """A parsed observation: the policy's observation and the state the actions are finished against."""

    policy_obs: dict[str, Any]  # {"images": {model view: (H, W, 3) uint8}, "state": (s,) float64, prompt fields}
    state: np.ndarray  # (s,) float64 robot state in the policy's space (e.g. after Aloha's adapt_to_pi)


@dataclass(frozen=True)
class RobotProfile:
    """How one robot family talks to π0. `cameras` maps the robot's image keys to model views."""

    name: str
    cameras: Mapping[str, str | None]  # robot key -> model view (None: accepted and unused, like Aloha's cam_low)
    state_keys: tuple[tuple[str, int | None], ...]  # concatenated in order; size None = any length
    action_dim: int | None  # the robot's action dims (None: the norm stats' action dims, else the model's)
    chunk: int | None  # openpi's action horizon for this robot (None: the checkpoint's)
    image_layout: str  # "chw", "either" or "hwc" (see `_image`)
    images_key: str | None = None  # cameras nested under this key ("images"), or top-level keys when None
    required_cameras: tuple[str, ...] = ()
    delta_mask: tuple[bool, ...] | None = None  # dims predicted relative to the state (openpi's DeltaActions)
    prompt_required: bool = True
    state_to_policy: Callable[[np.ndarray], np.ndarray] | None = None
    actions_to_robot: Callable[[np.ndarray], np.ndarray] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    pi05: Mapping[str, Any] = field(default_factory=dict)  # what openpi's π0.5 config of this robot changes

    def for_model(self, pi05: bool) -> RobotProfile:
        """The profile for a π0 or π0.5 checkpoint (openpi's pi05_* configs differ in horizon or delta actions)."""
        return replace(self, **self.pi05) if pi05 and self.pi05 else self

    @property
    def views(self) -> int:
        """Model views this profile fills: the engine needs at least these (the rest would always be masked)."""
        used = [MODEL_VIEWS.index(v) for v in self.cameras.values() if v is not None]
        return max(used) + 1 if used else len(MODEL_VIEWS)

    def expected_keys(self) -> list[str]:
        keys = [self.images_key] if self.images_key else list(self.cameras)
        return keys + [k for k, _ in self.state_keys] + list(PROMPT_KEYS)

    def parse(self, obs: Mapping[str, Any], *, default_prompt: str | None = None) -> RobotInputs:
        """An observation as the robot sends it -> RobotInputs. Raises ObservationError."""
        expected = self.expected_keys()
        unknown = sorted(set(obs) - set(expected))
        if unknown:
            raise _fail("observation", f"keys from {expected} ({self.name} profile)", f"unknown {unknown}")
        images = obs.get(self.images_key) if self.images_key else {k: obs[k] for k in self.cameras if k in obs}
        if self.images_key:
            if images is None:
                raise _fail("observation", f"key {self.images_key!r} ({self.name} profile)", f"keys {sorted(obs)}")
            if not isinstance(images, Mapping):
                raise _fail(self.images_key, "a map of camera name -> image", _describe(images))
            extra = sorted(set(images) - set(self.cameras))
            if extra:
                raise _fail(self.images_key, f"camera names from {list(self.cameras)}", f"unknown {extra}")
        missing = [c for c in self.required_cameras if c not in images]
        if missing:
            where = self.images_key or "observation"
            raise _fail(where, f"cameras {list(self.required_cameras)} ({self.name} profile)", f"missing {missing}")
        if not images:
            raise _fail(self.images_key or "observation", f"at least one camera of {list(self.cameras)}", "none")
        views = {}
        for key, image in images.items():
            name = f"{self.images_key}[{key!r}]" if self.images_key else key
            parsed = _image(image, name, self.image_layout)  # checked even when unused (openpi decodes them all)
            if self.cameras[key] is not None:
                views[self.cameras[key]] = parsed
        for key, _ in self.state_keys:
            if key not in obs:
                raise _fail("observation", f"key {key!r} ({self.name} profile)", f"keys {sorted(obs)}")
        state = np.concatenate([_vector(obs, key, size) for key, size in self.state_keys])
        if self.state_to_policy is not None:
            state = self.state_to_policy(state)
        prompt = _prompt(obs, default_prompt, self.prompt_required)
        return RobotInputs({"images": views, "state": state, **prompt}, state)

    def finish(self, actions: np.ndarray, state: np.ndarray, action_dim: int) -> np.ndarray:
        """(H, A) un-normalized model actions -> (H, action_dim) float32 robot commands."""
        actions = np.array(actions, dtype=np.float64)
        if self.delta_mask is not None:
            dims = len(self.delta_mask)
            actions[:, :dims] += np.where(self.delta_mask, state[:dims], 0.0)
        actions = actions[:, :action_dim]
        if self.actions_to_robot is not None:
            actions = self.actions_to_robot(actions)
        return np.ascontiguousarray(actions, dtype=np.float32)

    def example(self, rng: np.random.Generator, *, size: int = 224, prompt: Any = "do something",
                state_dim: int = 8) -> dict[str, Any]:  # fmt: skip
        """An observation like openpi's `make_<robot>_example` (random uint8 images, prompt text or ids);
        `state_dim` sizes a state of free length (the generic profile's)."""
        shape = (3, size, size) if self.image_layout == "chw" else (size, size, 3)
        cams = {k: rng.integers(0, 256, shape, dtype=np.uint8) for k, v in self.cameras.items()}
        obs: dict[str, Any] = {self.images_key: cams} if self.images_key else dict(cams)
        for key, n in self.state_keys:
            obs[key] = rng.uniform(0, 1, n or state_dim)
        if isinstance(prompt, str):
            obs["prompt"] = prompt
        elif prompt is not None:
            obs["tokenized_prompt"] = np.asarray(prompt, dtype=np.int64)
        return obs


ALOHA = RobotProfile(
    name="aloha",
    cameras={
        "cam_high": "base_0_rgb",
        "cam_low": None,
        "cam_left_wrist": "left_wrist_0_rgb",
        "cam_right_wrist": "right_wrist_0_rgb",
    },  # fmt: skip
    state_keys=(("state", 14),),
    action_dim=14,
    chunk=50,
    image_layout="chw",
    images_key="images",
    required_cameras=("cam_high",),
    delta_mask=aloha.DELTA_MASK,
    state_to_policy=aloha.state_to_pi,
    actions_to_robot=aloha.actions_from_pi,
    metadata={"reset_pose": [0, -1.5, 1.5, 0, 0, 0]},
)
DROID = RobotProfile(
    name="droid",
    cameras={"observation/exterior_image_1_left": "base_0_rgb", "observation/wrist_image_left": "left_wrist_0_rgb"},
    state_keys=(("observation/joint_position", 7), ("observation/gripper_position", 1)),
    action_dim=8,
    chunk=10,
    image_layout="either",
    required_cameras=("observation/exterior_image_1_left", "observation/wrist_image_left"),
    pi05={"chunk": 15},  # pi05_droid: action_horizon 15
)
LIBERO = RobotProfile(
    name="libero",
    cameras={"observation/image": "base_0_rgb", "observation/wrist_image": "left_wrist_0_rgb"},
    state_keys=(("observation/state", 8),),
    action_dim=7,
    chunk=50,
    image_layout="either",
    required_cameras=("observation/image", "observation/wrist_image"),
    delta_mask=(True,) * 6 + (False,),  # openpi's pi0_libero trains with extra_delta_transform=True
    pi05={"delta_mask": None},  # pi05_libero: extra_delta_transform=False
)
GENERIC = RobotProfile(
    name="generic",
    cameras={v: v for v in MODEL_VIEWS},
    state_keys=(("state", None),),
    action_dim=None,
    chunk=None,
    image_layout="hwc",
    images_key="images",
    prompt_required=False,
)
PROFILES = {p.name: p for p in (ALOHA, DROID, LIBERO, GENERIC)}


def get_profile(name: str, num_views: int | None = None) -> RobotProfile:
    """The named profile; the generic one offers as many views as the model has (`num_views`)."""
    if name not in PROFILES:
        raise ValueError(f"profile: expected one of {sorted(PROFILES)}, found {name!r}")
    profile = PROFILES[name]
    if name == "generic" and num_views is not None:
        if not 1 <= num_views <= len(MODEL_VIEWS):
            raise ValueError(f"num_views: expected 1..{len(MODEL_VIEWS)} for the generic profile, found {num_views}")
        profile = replace(profile, cameras={v: v for v in MODEL_VIEWS[:num_views]})
    return profile
