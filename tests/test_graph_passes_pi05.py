"""π0.5's graph passes against the reference on fresh random weights, each with a deliberately broken variant that
the same comparison catches. (The end-to-end check through the folded backend is in `test_folded_pi05.py`.)"""

from __future__ import annotations

import pytest
import torch

from vla_rt import preset
from vla_rt.graph_passes import (
    PASSES,
    PI05_PASSES,
    PassContext,
    apply_passes,
    fold_adarms,
    format_report_table,
    passes_for,
    precompute_adarms,
)
from vla_rt.model import Pi0Model, random_weights
from vla_rt.model.pi0 import euler_times
from vla_rt.numerics import rel_err

TOL = 1e-5
CFG = preset("tiny_pi05")
STEPS = 5


@pytest.fixture(scope="module", params=[3, 4])
def setup(request):
    weights = random_weights(CFG, seed=request.param)
    model = Pi0Model(CFG)
    model.load_state_dict(weights)
    return model.eval(), weights, PassContext(CFG, num_views=2, chunk=7, num_steps=STEPS)


def _conds(model: Pi0Model) -> torch.Tensor:
    with torch.no_grad():
        return model.time_condition(torch.tensor(euler_times(STEPS)))


def table_errors(model: Pi0Model, tensors: dict[str, torch.Tensor]) -> float:
    """Worst relative error of the scale/shift/gate tables against the reference norms' modulation."""
    cond, errs = _conds(model), []
    with torch.no_grad():
        for i, layer in enumerate(model.expert.layers):
            for norm, short in (("attn_norm", "attn"), ("ffn_norm", "ffn")):
                scale, shift, gate = (m[:, 0] for m in getattr(layer, norm).modulation(cond, torch.float32))
                p = f"expert.layers.{i}.{short}_"
                errs += [rel_err(tensors[p + "scale_table"], scale), rel_err(tensors[p + "gate_table"], gate)]
                if p + "shift_table" in tensors:
                    errs.append(rel_err(tensors[p + "shift_table"], shift))
    return max(errs)


def fold_errors(model: Pi0Model, tensors: dict[str, torch.Tensor], seed: int = 0) -> float:
    """Worst relative error of `(r·x ⊙ (1 + scale)) Wᵀ + bias_table` (and the final GEMM) vs norm-then-linear."""
    g = torch.Generator().manual_seed(seed)
    cond, errs = _conds(model), []
    x = torch.randn(2, 7, CFG.expert.width, generator=g)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + CFG.rms_eps)
    q_rows, q_scale = CFG.expert.num_heads * CFG.expert.head_dim, CFG.expert.head_dim**-0.5
    with torch.no_grad():
        for k in range(STEPS):
            c = cond[k : k + 1].expand(2, -1)
            for i, layer in enumerate(model.expert.layers):
                p = f"expert.layers.{i}."
                h, _ = layer.attn_norm(x, c)
                ref = torch.cat([layer.q_proj(h) * q_scale, layer.k_proj(h), layer.v_proj(h)], -1)
                ours = (r * x * (1 + tensors[p + "attn_scale_table"][k])) @ tensors[p + "qkv.weight"].T
                errs.append(rel_err(ours + tensors[p + "qkv_bias_table"][k], ref))
                assert ref.shape[-1] > q_rows
                h, _ = layer.ffn_norm(x, c)
                ref = torch.cat([layer.gate_proj(h), layer.up_proj(h)], -1)
                ours = (r * x * (1 + tensors[p + "ffn_scale_table"][k])) @ tensors[p + "gate_up.weight"].T
                errs.append(rel_err(ours + tensors[p + "gate_up_bias_table"][k], ref))
            h, _ = model.expert.final_norm(x, c)
            ref = model.action_out_proj(h)
            ours = (r * x) @ tensors["action_out_proj.weight_table"][k].T + tensors["action_out_proj.bias_table"][k]
            errs.append(rel_err(ours, ref))
    return max(errs)


def test_pi05_has_its_own_pipeline():
    assert passes_for(CFG) == PI05_PASSES and passes_for(preset("tiny")) == PASSES
    names = [p.name for p in PI05_PASSES]
    assert names.index(precompute_adarms.NAME) > names.index("precompute_rope_and_fold_q_scale")
    assert "merge_action_time_embedding" not in names


def test_tables_and_folds_match_the_reference(setup):
    model, weights, ctx = setup
    state = apply_passes(weights, ctx)
    t = state.tensors
    assert not any(k.startswith(("time_mlp", "state_proj")) or ".dense." in k for k in t)
    assert "action_out_proj.weight" not in t and t["action_out_proj.weight_table"].shape[0] == STEPS
    assert state.meta["adarms_steps"] == STEPS
    assert table_errors(model, t) <= TOL
    assert fold_errors(model, t) <= TOL


def test_the_tables_are_float32_when_the_weights_are_cast(setup):
    _, weights, ctx = setup
    t = apply_passes(weights, ctx, dtype=torch.bfloat16).tensors
    assert t["expert.layers.0.qkv.weight"].dtype == torch.bfloat16
    assert all(t[k].dtype == torch.float32 for k in t if k.endswith("_table"))


# ----- deliberately broken variants ---------------------------------------------------------------------------------
def _swish_once(t, times, width):
    emb = precompute_adarms.posemb_sincos(torch.tensor(times, dtype=torch.float32), width).double()
    h = torch.nn.functional.silu(emb @ t["time_mlp_in.weight"].double().T + t["time_mlp_in.bias"].double())
    return h @ t["time_mlp_out.weight"].double().T + t["time_mlp_out.bias"].double()  # no swish after layer 2


def test_broken_time_mlp_is_caught(setup, monkeypatch):
    model, weights, ctx = setup
    monkeypatch.setattr(precompute_adarms, "time_condition", _swish_once)
    assert table_errors(model, apply_passes(weights, ctx).tensors) > 1e-3


def test_broken_split_order_is_caught(setup, monkeypatch):
    model, weights, ctx = setup
    real = precompute_adarms.modulation

    def gate_first(t, norm, cond):
        scale, shift, gate = real(t, norm, cond)
        return gate, shift, scale  # openpi's order is scale, shift, gate

    monkeypatch.setattr(precompute_adarms, "modulation", gate_first)
    assert table_errors(model, apply_passes(weights, ctx).tensors) > 1e-3


def test_broken_shift_fold_before_the_q_scale_is_caught(setup):
    """Folding the shift with the unscaled Q rows (the pass run before the Q-scale fold) gives a wrong Q bias."""
    model, weights, ctx = setup
    order = [p for p in PI05_PASSES if p.name != "precompute_rope_and_fold_q_scale"]
    i = [p.name for p in order].index(fold_adarms.NAME)
    order.insert(i + 1, PI05_PASSES[[p.name for p in PI05_PASSES].index("precompute_rope_and_fold_q_scale")])
    assert fold_errors(model, apply_passes(weights, ctx, order).tensors) > 1e-3


def test_broken_final_norm_fold_without_scale_is_caught(setup, monkeypatch):
    model, weights, ctx = setup
    state = apply_passes(weights, ctx)
    t = dict(state.tensors)
    t["action_out_proj.weight_table"] = (
        t["action_out_proj.weight_table"]
        / apply_passes(weights, ctx, PI05_PASSES[:-1]).tensors["expert.final_scale_table"][:, None, :]
    )  # W instead of W diag(1 + s)
    assert fold_errors(model, t) > 1e-3


def test_report_table_lists_the_pi05_passes():
    table = format_report_table(preset("pi05"))
    assert precompute_adarms.NAME in table and fold_adarms.NAME in table and "merge_action_time" not in table


@pytest.mark.parametrize("preset_name", ["tiny_pi05", "tiny"])
def test_passes_keep_the_weights_device(preset_name):
    """The passes run where the weights are (the engines pass CUDA weights): with weights on the meta device, a tensor
    a pass makes on the CPU and mixes in is a device error. Found on the H200: the π0.5 time MLP's Euler times were
    made on the CPU. Only the RoPE tables, built from the config alone, start on the CPU (the engine moves them)."""
    cfg = preset(preset_name)
    weights = {k: v.to("meta") for k, v in random_weights(cfg, seed=0).items()}
    state = apply_passes(weights, PassContext(cfg=cfg))
    assert sorted(k for k, v in state.tensors.items() if v.device.type != "meta") == ["rope.cos", "rope.sin"]
