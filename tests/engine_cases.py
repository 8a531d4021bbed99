"""Random engine test cases (config, weights, inputs) that tests/test_engine*.py check against the reference."""

from __future__ import annotations

import dataclasses

import torch

from vla_rt.config import preset
from vla_rt.model import random_weights


def random_case(preset_name: str, seed: int, b: int, v: int, p: int, h: int, image_size: int):
    """(the preset's config at `image_size`-px views, its random weights, inputs): batch b, v views, p prompt tokens
    (padded at random), chunk h. `image_size` < 224 shrinks SigLIP's patch grid (56: 4 x 4 patches a view), which
    keeps the same code paths with far fewer rows (what the interpreter tests pay for)."""
    cfg = preset(preset_name)
    if image_size != cfg.vision.image_size:
        cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, image_size=image_size))
    g = torch.Generator().manual_seed(seed)
    x = dict(
        images=torch.rand(b, v, image_size, image_size, 3, generator=g) * 2 - 1,
        state=torch.randn(b, cfg.action_dim, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (b, p), generator=g),
        noise=torch.randn(b, h, cfg.action_dim, generator=g),
        image_masks=torch.rand(b, v, generator=g) > 0.3,
        token_mask=torch.arange(p)[None].expand(b, -1) < torch.randint(1, p + 1, (b, 1), generator=g),
    )
    x["image_masks"][:, 0] = True  # at least one view present
    return cfg, random_weights(cfg, seed=seed), x
