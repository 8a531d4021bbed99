"""Random cases for the split tests: a preset's config, seeded random weights, one observation (batch 1)."""

from __future__ import annotations

import dataclasses

import torch

from vla_rt.config import preset
from vla_rt.inputs import BuiltShapes
from vla_rt.model import random_weights


def engine_case(preset_name: str, seed: int, views: int, prompt: int, chunk: int, image_size: int = 224):
    """(config, weights, inputs, shapes): batch 1, `views` views (the last one missing when there are 2+), a prompt
    of `prompt` ids padded at the end (the last one masked), chunk `chunk`."""
    cfg = preset(preset_name)
    if image_size != cfg.vision.image_size:
        cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, image_size=image_size))
    g = torch.Generator().manual_seed(seed)
    x = dict(
        images=torch.rand(1, views, image_size, image_size, 3, generator=g) * 2 - 1,
        state=torch.randn(1, cfg.action_dim, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (1, prompt), generator=g),
        noise=torch.randn(1, chunk, cfg.action_dim, generator=g),
        image_masks=torch.arange(views)[None] < max(1, views - 1),
        token_mask=torch.arange(prompt)[None] < prompt - 1,
    )
    return cfg, random_weights(cfg, seed=seed), x, BuiltShapes(views, chunk, prompt, 1)
