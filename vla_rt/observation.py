"""Checks of what a robot hands `Pi0Policy`: the observation dict at every call, the norm stats once at load.

A controller must never turn a malformed observation into a plausible action, so nothing here guesses: an extra
camera, an unknown key, a string where a vector belongs, an empty state are all `InputError(field, expected,
found)` before any preprocessing (numpy, PIL, torch never see them). Norm stats are checked against the model when
the policy is made (`NormStatsError`): the width an `infer` would trip over, the entries it would silently skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.errors import InputError, NormStatsError

OBS_KEYS = ("images", "state", "prompt", "prompt_tokens", "noise")
# Past this a frame is no camera image (a 8K sensor is 7680 wide): resizing it would cost seconds and gigabytes.
MAX_IMAGE_SIDE = 8192
STATS_KEYS = ("state", "actions")


def check_obs(obs: object) -> Mapping[str, Any]:
    """The observation is a dict with 'images' and 'state' and no key vla-rt would ignore."""
    if not isinstance(obs, Mapping):
        raise InputError("obs", "a dict with keys 'images' and 'state'", obs)
    unknown = sorted(str(k) for k in obs if k not in OBS_KEYS)
    if unknown:
        raise InputError("obs", f"keys from {list(OBS_KEYS)} (others would be ignored)", None, found_text=str(unknown))
    missing = [k for k in ("images", "state") if k not in obs]
    if missing:
        raise InputError("obs", "keys 'images' and 'state'", None, found_text=f"{sorted(obs)} (no {missing})")
    return obs


def check_one_prompt(obs: Mapping[str, Any]) -> None:
    """Text and ids together: one would be ignored without a word."""
    if obs.get("prompt") is not None and obs.get("prompt_tokens") is not None:
        raise InputError(
            "obs", "one of 'prompt' and 'prompt_tokens' (the other would be ignored)", None, found_text="both"
        )


def camera_images(images: object, camera_names: Sequence[str]) -> dict[str, Any]:
    """`{camera: image}` from a dict (names must be the policy's) or a list in `camera_names` order."""
    if isinstance(images, Mapping):
        unknown = sorted(str(k) for k in images if k not in camera_names)
        if unknown:
            raise InputError("images", f"camera names from {list(camera_names)}", None, found_text=f"unknown {unknown}")
        return dict(images)
    if isinstance(images, list | tuple):
        if len(images) > len(camera_names):
            raise InputError(
                "images",
                f"at most {len(camera_names)} images (one per camera {list(camera_names)})",
                None,
                found_text=f"{len(images)} images",
            )
        return dict(zip(camera_names, images))
    raise InputError("images", "a dict {camera name: uint8 (H, W, 3) image} or a list in camera order", images)


def check_image(name: str, image: object) -> np.ndarray:
    """uint8 (H, W, 3), each side in [1, MAX_IMAGE_SIDE]."""
    field = f"images[{name!r}]"
    try:
        img = np.asarray(image)
    except (TypeError, ValueError):
        raise InputError(field, "a uint8 (H, W, 3) array", image) from None
    if img.dtype != np.uint8:
        raise InputError(field, "dtype uint8 (0..255)", None, found_text=str(img.dtype))
    if img.ndim != 3 or img.shape[2] != 3 or min(img.shape[:2]) < 1:
        raise InputError(field, "shape (H, W, 3) RGB", None, found_text=str(img.shape))
    if max(img.shape[:2]) > MAX_IMAGE_SIDE:
        raise InputError(field, f"sides of at most {MAX_IMAGE_SIDE} pixels", None, found_text=str(img.shape))
    return img


def check_state(state: object, max_dim: int, stats: NormStats | None) -> np.ndarray:
    """A 1-D vector of 1..max_dim real numbers (no wider than the state norm stats), finite; float64."""
    limit = min(max_dim, stats.dim) if stats is not None else max_dim
    why = "the state norm stats' width" if stats is not None and stats.dim < max_dim else "the model's state width"
    expected = f"a 1-D vector of at most {limit} values (at least one; {why})"
    if state is None or isinstance(state, str | bytes | Mapping):
        raise InputError("state", expected, state)
    try:
        x = np.asarray(state)
    except (TypeError, ValueError):
        raise InputError("state", expected, state) from None
    if x.dtype.kind not in "iuf":
        raise InputError("state", expected, None, found_text=f"dtype {x.dtype}")
    if x.ndim != 1 or not 1 <= x.shape[0] <= limit:
        raise InputError("state", expected, None, found_text=f"shape {x.shape}")
    x = x.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise InputError("state", "finite values", None, found_text=f"NaN or inf at index {bad.tolist()}")
    return x


def check_prompt(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise InputError("prompt", "a str (the task instruction)", prompt)
    return prompt


def check_prompt_tokens(ids: object, prompt_len: int, field: str = "prompt_tokens") -> np.ndarray:
    """`field`: 'prompt' for the ids a text prompt became (the robot sent no ids)."""
    expected = f"a 1-D array of at most {prompt_len} integer token ids"
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError):
        raise InputError(field, expected, ids) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputError(field, expected, None, found_text=f"{arr.dtype} {arr.shape}")
    if len(arr) > prompt_len:
        raise InputError(field, f"at most {prompt_len} tokens", None, found_text=f"{len(arr)}")
    return arr.astype(np.int64)


def check_noise(noise: object, chunk: int, action_dim: int) -> np.ndarray:
    expected = f"a finite float array of shape ({chunk}, {action_dim}) (chunk, model action dim)"
    try:
        arr = np.asarray(noise)
    except (TypeError, ValueError):
        raise InputError("noise", expected, noise) from None
    if arr.dtype.kind != "f" or arr.shape != (chunk, action_dim) or not np.isfinite(arr).all():
        raise InputError("noise", expected, None, found_text=f"{arr.dtype} {arr.shape}")
    return arr.astype(np.float32)


def check_norm_stats(
    stats: object, model_dim: int, use_quantiles: bool, source: str, need_state: bool = True
) -> dict[str, NormStats]:
    """The stats a policy will apply: a dict with 'state' (when the model reads the state) and 'actions' NormStats
    no wider than the model, with quantiles when quantile mode is on. Everything `infer` would otherwise trip over,
    or silently skip, at load."""
    if not isinstance(stats, Mapping) or not all(isinstance(v, NormStats) for v in stats.values()):
        raise NormStatsError("norm_stats", "a dict {key: NormStats} (or a norm_stats.json path)", stats, source=source)
    needed = STATS_KEYS if need_state else ("actions",)
    missing = [k for k in needed if k not in stats]
    if missing:
        raise NormStatsError(
            "norm_stats",
            f"entries {list(needed)} (without them the state or the actions stay in normalised units)",
            None,
            source=source,
            found_text=f"{sorted(stats)} (no {missing})",
        )
    for key in (k for k in STATS_KEYS if k in stats):
        s = stats[key]
        if s.dim > model_dim:
            raise NormStatsError(
                f"norm_stats[{key!r}]", f"at most {model_dim} dims (the model's width)", None, source=source,
                found_text=f"{s.dim} dims",
            )  # fmt: skip
        if use_quantiles and not s.has_quantiles:
            raise NormStatsError(
                f"norm_stats[{key!r}]", "q01 and q99 (norm_mode='quantile')", None, source=source, found_text="none"
            )
    return dict(stats)
