"""The folded backend runs π0.5: folded ≡ reference ≤ 1e-5 in float32 on fresh random weights and inputs, through
every π0.5 graph pass; a broken pass fails the same comparison."""

from __future__ import annotations

import pytest
import torch

from vla_rt import build_pi0, preset
from vla_rt.engine.folded import FoldedPi0
from vla_rt.graph_passes import PI05_PASSES, GraphPass, precompute_adarms
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err

TOL = 1e-5
CFG = preset("tiny_pi05")


def _inputs(seed: int, b=2, v=3, p=9, h=7):
    g = torch.Generator().manual_seed(100 + seed)
    tokens = torch.randint(0, CFG.vocab_size, (b, p), generator=g)
    token_mask = torch.ones(b, p, dtype=torch.bool)
    token_mask[0, 6:] = False  # padded prompt in row 0
    image_masks = torch.tensor([[True, False, True], [True, True, True]])[:b]
    return dict(
        images=torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        state=torch.randn(b, CFG.action_dim, generator=g),
        tokens=tokens,
        noise=torch.randn(b, h, CFG.action_dim, generator=g),
        image_masks=image_masks,
        token_mask=token_mask,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_folded_matches_reference_in_float32(seed):
    weights = random_weights(CFG, seed=seed)
    ref, folded = (build_pi0(weights, CFG, backend=b) for b in ("reference", "folded"))
    x = _inputs(seed)
    for steps in (4, 10):  # a new step count rebuilds the tables
        a = ref.sample_actions(**x, num_steps=steps)
        f = folded.sample_actions(**x, num_steps=steps)
        assert rel_err(f, a) <= TOL, (steps, rel_err(f, a))


def test_folded_bf16_stays_close():
    weights = random_weights(CFG, seed=2)
    x = _inputs(2, b=1, v=2)
    x["image_masks"] = x["image_masks"][:1, :2]
    ref = build_pi0(weights, CFG).sample_actions(**x, num_steps=3)
    bf16 = build_pi0(weights, CFG, backend="folded", dtype=torch.bfloat16).sample_actions(**x, num_steps=3)
    assert 0 < rel_err(bf16, ref) <= 5e-2


def test_a_broken_adarms_pass_fails_the_end_to_end_check(monkeypatch):
    weights = random_weights(CFG, seed=3)
    x = _inputs(3, b=1, v=1, p=4)
    x["image_masks"], x["token_mask"] = x["image_masks"][:1, :1], x["token_mask"][:1, :4]
    ref = build_pi0(weights, CFG).sample_actions(**x, num_steps=3)

    def plus_one_gate(state, ctx):  # `x + y * (1 + gate)` instead of openpi's `x + y * gate`
        out = precompute_adarms.apply(state, ctx)
        t = {k: v + 1 if k.endswith("_gate_table") else v for k, v in out.tensors.items()}
        return out.replace(t)

    broken = tuple(
        GraphPass(p.name, plus_one_gate, p.report) if p.name == precompute_adarms.NAME else p for p in PI05_PASSES
    )
    folded = FoldedPi0(weights, CFG, num_steps=3, passes=broken)
    from vla_rt.inputs import ModelInputs

    inputs = ModelInputs(x["images"], x["state"], x["tokens"], None, x["image_masks"], x["token_mask"])
    assert rel_err(folded(inputs, x["noise"], 3), ref) > 1e-2
    good = FoldedPi0(weights, CFG, num_steps=3)
    assert rel_err(good(inputs, x["noise"], 3), ref) <= TOL
