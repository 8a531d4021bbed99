"""The folded backend as `load_pi0` / `build_pi0` reach it, at shapes and call sequences beyond the built defaults:
it must give the reference's actions (float32, ≤ 1e-5) wherever the reference runs, and the same actions for the same
call whatever ran before it."""

from __future__ import annotations

import pytest
import torch

from vla_rt import build_pi0, preset
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err

TOL = 1e-5


def _inputs(cfg, seed: int, b=1, v=1, p=0, h=4):
    g = torch.Generator().manual_seed(seed)
    return dict(
        images=torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        state=torch.randn(b, cfg.action_dim, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (b, p), generator=g) if p else None,
        noise=torch.randn(b, h, cfg.action_dim, generator=g),
    )


@pytest.mark.parametrize("name", ["tiny", "tiny_pi05"])
@pytest.mark.parametrize(("views", "chunk"), [(10, 4), (1, 2300)])
def test_more_positions_than_the_default_rope_table_match_the_reference(name, views, chunk):
    """Built without num_views / chunk, the folded model's RoPE table covered 8 views and 4x the checkpoint's chunk:
    10 views (16 are allowed) or a longer noise chunk ended in 'IndexError: index 2297 is out of bounds'."""
    cfg = preset(name)
    weights = random_weights(cfg, seed=5)
    ref, folded = (build_pi0(weights, cfg, backend=b) for b in ("reference", "folded"))
    x = _inputs(cfg, 7, v=views, p=3, h=chunk)
    a = ref.sample_actions(**x, num_steps=1)
    f = folded.sample_actions(**x, num_steps=1)
    assert rel_err(f, a) <= TOL


def test_the_same_call_gives_the_same_actions_after_a_call_with_another_step_count():
    """π0.5 in bfloat16: a call with 3 steps rebuilt the modulation tables from the bf16-rounded matrices, and every
    later 10-step call returned actions 1e-3 apart from the first one's (max 1e-2), for the same inputs and noise."""
    cfg = preset("tiny_pi05")
    folded = build_pi0(random_weights(cfg, seed=2), cfg, backend="folded", dtype=torch.bfloat16)
    x = _inputs(cfg, 3, v=2, p=5, h=6)
    first = folded.sample_actions(**x, num_steps=10)
    three = folded.sample_actions(**x, num_steps=3)
    assert torch.equal(folded.sample_actions(**x, num_steps=10), first)
    assert torch.equal(folded.sample_actions(**x, num_steps=3), three)
