"""Validation of model-level inputs: every bad input raises an InputError (a ValueError) naming the field, expected
and found value.

The model sees openpi's normalized layout: images (B, V, S, S, 3) float in [-1, 1], state (B, A) float,
tokens (B, P) int64, noise (B, H, A). A model built for fixed shapes (views, chunk, prompt length) says so when
called with others, instead of silently recompiling or reading past a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_rt.arguments import LIMITS
from vla_rt.config import Pi0Config
from vla_rt.errors import InputError

# Images are compared against [-1, 1] with a little slack for resampling round-off.
_RANGE_SLACK = 1e-3


@dataclass(frozen=True)
class BuiltShapes:
    """Static shapes a model was built for; None means 'any' (the reference backend)."""

    num_views: int | None = None
    chunk: int | None = None
    prompt_len: int | None = None
    batch_size: int | None = None


def images_to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [0, 255] -> float32 [-1, 1] as openpi scales them (x / 255 * 2 - 1). The policy runs it on the
    host and the stage engine on the device after a uint8 upload: the same elementwise ops, so the same floats."""
    return images.float() / 255.0 * 2.0 - 1.0


@dataclass
class ModelInputs:
    images: torch.Tensor
    state: torch.Tensor
    tokens: torch.Tensor | None
    noise: torch.Tensor | None
    image_masks: torch.Tensor
    token_mask: torch.Tensor | None


def _fail(field: str, expected: str, found: object) -> InputError:
    return InputError(field, expected, found, found_text=str(found))


def _tensor_or_none(field: str, value: object) -> None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise _fail(field, "a torch.Tensor or None", type(value).__name__)


def check_model_inputs(
    cfg: Pi0Config,
    shapes: BuiltShapes,
    images: torch.Tensor,
    state: torch.Tensor,
    tokens: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    image_masks: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    num_steps: int = 10,
) -> ModelInputs:
    """Checks shapes, dtypes, ranges and finiteness; returns the inputs with default masks filled in."""
    s = cfg.vision.image_size
    for field, value in (
        ("tokens", tokens),
        ("noise", noise),
        ("image_masks", image_masks),
        ("token_mask", token_mask),
    ):
        _tensor_or_none(field, value)
    lo, hi = LIMITS["num_steps"]
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not lo <= num_steps <= hi:
        raise _fail("num_steps", f"an integer number of denoising steps in [{lo}, {hi}]", repr(num_steps))
    if not isinstance(images, torch.Tensor):
        raise _fail("images", "a torch.Tensor", type(images).__name__)
    if images.ndim != 5 or images.shape[2:] != (s, s, 3):
        raise _fail("images", f"shape (B, V, {s}, {s}, 3) (NHWC per view)", tuple(images.shape))
    if not images.is_floating_point():
        raise _fail("images", "a floating-point dtype with values in [-1, 1]", images.dtype)
    b, v = images.shape[:2]
    if shapes.num_views is not None and v != shapes.num_views:
        raise _fail("images", f"{shapes.num_views} views (the model was built for that many)", f"{v} views")
    if v < 1:
        raise _fail("images", "at least one view", v)
    if shapes.batch_size is not None and b != shapes.batch_size:
        raise _fail("images", f"batch size {shapes.batch_size} (the model was built for it)", b)
    if not torch.isfinite(images).all():
        raise _fail("images", "finite values", "NaN or inf")
    lo, hi = float(images.min()), float(images.max())
    if lo < -1 - _RANGE_SLACK or hi > 1 + _RANGE_SLACK:
        raise _fail("images", "values in [-1, 1] (uint8 x -> x/255*2-1)", f"range [{lo:.3g}, {hi:.3g}]")

    if not isinstance(state, torch.Tensor) or state.ndim != 2 or state.shape != (b, cfg.action_dim):
        found = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise _fail("state", f"shape ({b}, {cfg.action_dim}) (padded to the action dim)", found)
    if not state.is_floating_point():
        raise _fail("state", "a floating-point dtype", state.dtype)
    if not torch.isfinite(state).all():
        bad = (~torch.isfinite(state)).nonzero()[0].tolist()
        raise _fail("state", "finite values", f"NaN or inf at index {tuple(bad)}")

    if tokens is not None:
        if tokens.ndim != 2 or tokens.shape[0] != b:
            raise _fail("tokens", f"shape ({b}, P) int64 token ids", tuple(tokens.shape))
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise _fail("tokens", "an integer dtype (token ids)", tokens.dtype)
        p = tokens.shape[1]
        limit = shapes.prompt_len if shapes.prompt_len is not None else cfg.max_token_len
        if p > limit:
            raise _fail("tokens", f"at most {limit} tokens (the built maximum prompt length)", f"{p} tokens")
        if shapes.prompt_len is not None and p not in (0, shapes.prompt_len):
            raise _fail("tokens", f"exactly {shapes.prompt_len} tokens (pad with token_mask=False)", f"{p} tokens")
        if p and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
            raise _fail("tokens", f"ids in [0, {cfg.vocab_size})", f"range [{int(tokens.min())}, {int(tokens.max())}]")
        if token_mask is not None and token_mask.shape != tokens.shape:
            raise _fail("token_mask", f"shape {tuple(tokens.shape)} like tokens", tuple(token_mask.shape))
    elif token_mask is not None:
        raise _fail("token_mask", "None when tokens is None", tuple(token_mask.shape))

    if noise is not None:
        h = noise.shape[1] if noise.ndim == 3 else None
        if noise.ndim != 3 or noise.shape[0] != b or noise.shape[2] != cfg.action_dim:
            raise _fail("noise", f"shape ({b}, H, {cfg.action_dim})", tuple(noise.shape))
        if shapes.chunk is not None and h != shapes.chunk:
            raise _fail("noise", f"chunk length {shapes.chunk} (the model was built for it)", f"{h}")
        if not noise.is_floating_point():
            raise _fail("noise", "a floating-point dtype", noise.dtype)
        if not torch.isfinite(noise).all():
            raise _fail("noise", "finite values", "NaN or inf")

    if image_masks is None:
        image_masks = torch.ones(b, v, dtype=torch.bool, device=images.device)
    elif image_masks.shape != (b, v):
        raise _fail("image_masks", f"shape ({b}, {v})", tuple(image_masks.shape))
    return ModelInputs(images, state, tokens, noise, image_masks.bool(), token_mask)
