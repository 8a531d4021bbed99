"""Pass: fold SigLIP's LayerNorm affine (γ, β) into the linear layers that read the norm's output.

`(x̂ γ + β) Wᵀ + b = x̂ (W diag γ)ᵀ + (W β + b)`: the normalisation (mean, variance) stays data-dependent, the
affine becomes part of the next weights. norm1 feeds q/k/v, norm2 feeds fc1, the final norm feeds the projector.
"""

from __future__ import annotations

import torch

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "fold_layernorm_affine"


def fold_affine(weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor):
    """Returns (W diag γ, W β + b) for y = (x̂ γ + β) Wᵀ + b, in float64 for one rounding at the end."""
    w64 = weight.double()
    return (w64 * gamma.double()[None, :]).to(weight.dtype), (bias.double() + w64 @ beta.double()).to(bias.dtype)


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    for i in layer_ids(t, "vision.blocks."):
        p = f"vision.blocks.{i}."
        require(t, p + "norm1.weight", p + "attn.q_proj.weight", pass_name=NAME)
        for norm, targets in (("norm1", ("attn.q_proj", "attn.k_proj", "attn.v_proj")), ("norm2", ("mlp.fc1",))):
            gamma, beta = t.pop(p + norm + ".weight"), t.pop(p + norm + ".bias")
            for target in targets:
                t[p + target + ".weight"], t[p + target + ".bias"] = fold_affine(
                    t[p + target + ".weight"], t[p + target + ".bias"], gamma, beta
                )
    gamma, beta = t.pop("vision.final_norm.weight"), t.pop("vision.final_norm.bias")
    t["projector.weight"], t["projector.bias"] = fold_affine(t["projector.weight"], t["projector.bias"], gamma, beta)
    return state.replace(t, layernorm_affine_folded=True)


def report(ctx: PassContext) -> PassReport:
    v = ctx.cfg.vision
    norms = 2 * v.depth + 1
    rows = ctx.batch_size * ctx.num_views * v.num_patches
    # each affine is a multiply and an add over the (rows, width) activation; γ and β (2 vectors) disappear
    return PassReport(
        NAME,
        kernels_removed=2 * norms,
        weight_bytes_saved=2 * norms * v.width * BF16_BYTES,
        flops_saved=2 * norms * rows * v.width,
        note="γ,β into next linear",
    )


PASS = GraphPass(NAME, apply, report)
