"""Every graph pass is checked against the reference on fresh random inputs and weights, and shown to be checkable:
the same comparison with that pass deliberately broken must fail.

Norm scales, LayerNorm affines and biases in `random_weights` are random (not ones/zeros), so a fold that drops a
term or forgets the `+1` changes the result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vla_rt import preset
from vla_rt.engine.folded import FoldedPi0
from vla_rt.graph_passes import (
    PASSES,
    PassContext,
    PassState,
    fold_layernorm,
    fold_rmsnorm,
    format_report_table,
    fuse_projections,
    merge_action_time,
    patch_embed_gemm,
    precompute_rope,
    prune_last_layer,
)
from vla_rt.inputs import ModelInputs
from vla_rt.model import Pi0Model, random_weights
from vla_rt.numerics import rel_err

TOL = 1e-5


# ----- deliberately broken variants (each differs from the real pass in one detail) ---------------------------------
def _broken_patch(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    w = t.pop("vision.patch_embed.weight")
    t["vision.patch_embed.weight"] = w.reshape(w.shape[0], -1).contiguous()  # (c, kh, kw) order: wrong for NHWC
    return state.replace(t, patch_order="hwc")


def _broken_layernorm(state: PassState, ctx: PassContext) -> PassState:
    out = fold_layernorm.apply(state, ctx)
    t = dict(out.tensors)
    for k in list(t):  # forget the W·β term of the bias
        if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "fc1.bias")):
            t[k] = state.tensors[k]
    return out.replace(t)


def _broken_rmsnorm(state: PassState, ctx: PassContext) -> PassState:
    original = fold_rmsnorm.fold_scale
    fold_rmsnorm.fold_scale = lambda w, g: (w.double() * g.double()[None, :]).to(w.dtype)  # scale without the +1
    try:
        return fold_rmsnorm.apply(state, ctx)
    finally:
        fold_rmsnorm.fold_scale = original


def _broken_fuse(state: PassState, ctx: PassContext) -> PassState:
    out = fuse_projections.apply(state, ctx)
    t = dict(out.tensors)
    for k in [k for k in t if k.endswith("gate_up.weight")]:
        gate, up = t[k].chunk(2)
        t[k] = torch.cat([up, gate])  # up first: GELU lands on the wrong half
    return out.replace(t)


def _broken_prune(state: PassState, ctx: PassContext) -> PassState:
    out = prune_last_layer.apply(state, ctx)
    t = dict(out.tensors)
    last = out.meta["pruned_last_layer"]
    kv_rows = t[f"llm.layers.{last}.kv.weight"].shape[0]
    t[f"llm.layers.{last}.kv.weight"] = state.tensors[f"llm.layers.{last}.qkv.weight"][:kv_rows]  # Q rows, not KV
    return out.replace(t)


def _broken_merge(state: PassState, ctx: PassContext) -> PassState:
    out = merge_action_time.apply(state, ctx)
    t = dict(out.tensors)
    t["time_bias_table"] = t["time_bias_table"].flip(0)  # t from 0 to 1: the wrong direction
    return out.replace(t)


def _broken_rope(state: PassState, ctx: PassContext) -> PassState:
    out = precompute_rope.apply(state, ctx)
    t = dict(out.tensors)
    t["rope.cos"], t["rope.sin"] = precompute_rope.rope_tables(ctx.max_positions, ctx.cfg.llm.head_dim, 1000.0)
    return out.replace(t)


# pass name -> (broken variant, which intermediate it shows up in)
CASES = {
    patch_embed_gemm.NAME: (_broken_patch, "vision"),
    fold_layernorm.NAME: (_broken_layernorm, "vision"),
    fold_rmsnorm.NAME: (_broken_rmsnorm, "kv_cache"),
    fuse_projections.NAME: (_broken_fuse, "kv_cache"),
    prune_last_layer.NAME: (_broken_prune, "kv_cache"),
    merge_action_time.NAME: (_broken_merge, "velocity"),
    precompute_rope.NAME: (_broken_rope, "kv_cache"),
}


def test_every_pass_has_a_case() -> None:
    assert sorted(CASES) == sorted(p.name for p in PASSES)


def _setup(seed: int):
    cfg = preset("tiny")
    weights = random_weights(cfg, seed=seed)
    model = Pi0Model(cfg)
    model.load_state_dict(weights)
    g = torch.Generator().manual_seed(1000 + seed)
    b, v, p, h = 2, 3, 5, 9
    inputs = dict(
        images=torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        image_masks=torch.tensor([[True, False, True], [True, True, True]]),
        tokens=torch.randint(0, cfg.vocab_size, (b, p), generator=g),
        token_mask=torch.tensor([[True] * p, [True] * 3 + [False] * 2]),
        state=torch.randn(b, cfg.action_dim, generator=g),
        noise=torch.randn(b, h, cfg.action_dim, generator=g),
    )
    return cfg, weights, model, inputs


def _errors(passes, seed: int) -> dict[str, float]:
    """Relative errors of the folded model against the reference: vision tokens, KV cache, velocity, actions."""
    cfg, weights, ref, x = _setup(seed)
    folded = FoldedPi0(weights, cfg, num_steps=4, passes=passes)
    with torch.no_grad():
        err = {"vision": rel_err(folded.encode_images(x["images"]), ref.embed_images(x["images"]))}
        kv_ref, pmask = ref.prefix_kv(x["images"], x["image_masks"], x["tokens"], x["token_mask"])
        kv_fold, pmask_fold = folded.prefix_kv(x["images"], x["image_masks"], x["tokens"], x["token_mask"])
        assert torch.equal(pmask, pmask_fold)
        valid = pmask[:, :, None, None]  # padding tokens' K/V are never read; compare the valid ones
        err["kv_cache"] = max(
            rel_err(a * valid, b * valid)
            for (ka, va), (kb, vb) in zip(kv_fold, kv_ref)
            for a, b in ((ka, kb), (va, vb))
        )
        x_t = x["noise"]
        vel = []
        for step, t in enumerate(folded.state.meta["euler_times"]):
            time = torch.full((2,), t)
            v_ref = ref.velocity(kv_ref, pmask, x["state"], x_t, time)
            vel.append(rel_err(folded.velocity(kv_fold, pmask, folded.state_token(x["state"]), x_t, step), v_ref))
            x_t = x_t - 0.25 * v_ref
        err["velocity"] = max(vel)
        a_ref = ref.sample_actions(
            x["images"],
            x["state"],
            x["tokens"],
            x["noise"],
            4,
            image_masks=x["image_masks"],
            token_mask=x["token_mask"],
        )
        inputs = ModelInputs(x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"], x["token_mask"])
        err["actions"] = rel_err(folded(inputs, x["noise"], 4), a_ref)
    return err


@pytest.mark.parametrize("name", sorted(CASES), ids=sorted(CASES))
def test_pass_is_equivalent(name: str) -> None:
    seed = sorted(CASES).index(name)
    err = _errors(PASSES, seed)
    intermediate = CASES[name][1]
    assert err[intermediate] <= TOL, err
    assert err["actions"] <= TOL, err


@pytest.mark.parametrize("name", sorted(CASES), ids=sorted(CASES))
def test_broken_pass_is_caught(name: str) -> None:
    broken, intermediate = CASES[name]
    passes = [dataclasses.replace(p, apply=broken) if p.name == name else p for p in PASSES]
    err = _errors(passes, seed=7)
    assert err[intermediate] > 100 * TOL, err
    assert err["actions"] > 100 * TOL, err


def test_pruned_layer_has_only_kv() -> None:
    cfg = preset("tiny")
    folded = FoldedPi0(random_weights(cfg, 0), cfg)
    last = cfg.llm.depth - 1
    names = [k for k in folded.w if k.startswith(f"llm.layers.{last}.")]
    assert names == [f"llm.layers.{last}.kv.weight"]
    assert folded.w[names[0]].shape == (2 * cfg.llm.num_kv_heads * cfg.llm.head_dim, cfg.llm.width)
    assert "llm.final_norm.scale" not in folded.w


def test_changing_num_steps_rebuilds_the_time_table() -> None:
    cfg, weights, ref, x = _setup(3)
    folded = FoldedPi0(weights, cfg, num_steps=10)
    inputs = ModelInputs(x["images"], x["state"], None, x["noise"], x["image_masks"], None)
    for steps in (3, 10, 5):
        a = folded(inputs, x["noise"], steps)
        b = ref.sample_actions(x["images"], x["state"], None, x["noise"], steps, image_masks=x["image_masks"])
        assert folded.w["time_bias_table"].shape[0] == steps
        assert rel_err(a, b) <= TOL


def test_report_table_for_full_pi0() -> None:
    table = format_report_table(preset("pi0"))
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(p.name for p in PASSES) <= set(rows)
    # pruning the last layer of the 2B LLM saves q + o (2·2048²) + MLP (3·2048·16384) + norms, in bf16
    mb = float(rows[prune_last_layer.NAME].split("|")[5])
    assert mb == pytest.approx((2 * 2048 * 2048 + 3 * 2048 * 16384 + 2 * 2048) * 2 / 1e6, rel=1e-3)
