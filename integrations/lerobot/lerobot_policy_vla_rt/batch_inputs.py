"""A LeRobot batch (after the checkpoint's own pre-processor) -> the arguments of vla-rt's `sample_actions`.

What arrives is what LeRobot's π0 / π0.5 receive: camera images (B, 3, H, W) float in [0, 1] (channels last is
accepted too, as LeRobot does), `observation.state` normalised, and the prompt already tokenised and padded
(`observation.language.tokens` / `.attention_mask`). The images go through LeRobot's own resize-with-pad and
`x * 2 - 1` in the same order as its π0, so both models see the same pixels. A camera missing from the batch is a
masked view: its tokens take no part in attention nor in the position count, exactly like LeRobot's padded view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from lerobot.policies.common.vla_utils import resize_with_pad_torch
from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE

from vla_rt.errors import InputError


@dataclass
class EngineInputs:
    images: torch.Tensor  # (B, V, S, S, 3) float32 in [-1, 1]
    image_masks: torch.Tensor  # (B, V) bool
    state: torch.Tensor  # (B, A) float32, normalised, zero-padded to the model's action width
    tokens: torch.Tensor  # (B, P) int64
    token_mask: torch.Tensor  # (B, P) bool


def _batch_size(batch: Mapping[str, object], camera_keys: list[str]) -> int:
    for key in camera_keys:
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key].shape[0]
    raise InputError("batch", f"at least one of the cameras {camera_keys}", None, found_text=str(sorted(batch)))


def _camera(image: object, key: str, size: int) -> torch.Tensor:
    """One camera, (B, 3, H, W) or (B, H, W, 3) in [0, 1] -> (B, S, S, 3) in [-1, 1]."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or 3 not in (image.shape[1], image.shape[-1]):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise InputError(key, "an image batch (B, 3, H, W) in [0, 1]", shape)
    image = image.to(torch.float32)
    if image.shape[1] == 3:
        image = image.permute(0, 2, 3, 1)
    if image.shape[1:3] != (size, size):
        image = resize_with_pad_torch(image, size, size)
    return image * 2.0 - 1.0


def engine_inputs(
    batch: Mapping[str, object], camera_keys: list[str], image_size: int, action_width: int, device: torch.device
) -> EngineInputs:
    """Checks and converts one pre-processed batch; every problem is an InputError naming the batch key."""
    b = _batch_size(batch, camera_keys)
    views, masks = [], []
    for key in camera_keys:
        if key in batch:
            view = _camera(batch[key], key, image_size).to(device)
            if view.shape[0] != b:
                raise InputError(key, f"batch size {b} (the other cameras')", view.shape[0])
            views.append(view)
            masks.append(torch.ones(b, dtype=torch.bool, device=device))
        else:
            views.append(torch.zeros(b, image_size, image_size, 3, device=device))
            masks.append(torch.zeros(b, dtype=torch.bool, device=device))
    state = torch.zeros(b, action_width, device=device)
    if OBS_STATE in batch:
        raw = batch[OBS_STATE]
        if not isinstance(raw, torch.Tensor) or raw.ndim != 2 or raw.shape[0] != b or raw.shape[1] > action_width:
            found = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise InputError(OBS_STATE, f"a tensor (B={b}, s <= {action_width})", found)
        state[:, : raw.shape[1]] = raw.to(device, torch.float32)
    for key in (OBS_LANGUAGE_TOKENS, OBS_LANGUAGE_ATTENTION_MASK):
        if not isinstance(batch.get(key), torch.Tensor):
            raise InputError(
                key,
                "the tokenised prompt (the checkpoint's pre-processor writes it: run the batch through the "
                "processors from make_pre_post_processors first)",
                None,
                found_text="missing" if key not in batch else type(batch[key]).__name__,
            )
    tokens = batch[OBS_LANGUAGE_TOKENS].to(device, torch.long)
    token_mask = batch[OBS_LANGUAGE_ATTENTION_MASK].to(device).bool()
    return EngineInputs(torch.stack(views, dim=1), torch.stack(masks, dim=1), state, tokens, token_mask)
