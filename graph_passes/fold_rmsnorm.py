"""Pass: fold every Gemma RMSNorm scale into the linear layer that reads it.

`(x̂ ⊙ (1 + g)) Wᵀ = x̂ [W diag(1 + g)]ᵀ` — the `+1` is the trap (openpi stores the scale as an offset from 1).
Pre-attention norms fold into q/k/v, pre-FFN norms into gate/up, the expert's final norm into `action_out_proj`.
The per-row factor rsqrt(mean(x²) + eps) stays data-dependent; the engine applies it to the GEMM result rows.
The LLM's final norm feeds nothing π0 reads; the prune pass drops it. π0.5's action expert has adaptive norms (no
static scale): they are left to `precompute_adarms` / `fold_adarms`.
"""

from __future__ import annotations

import torch

from vla_rt.graph_passes.base import BF16_BYTES, GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "fold_rmsnorm_scales"


def fold_scale(weight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """W diag(1 + g) for a weight (out, in) and an RMSNorm offset g (in,)."""
    return (weight.double() * (1.0 + scale_offset.double())[None, :]).to(weight.dtype)


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    for stack in ("llm", "expert"):
        for i in layer_ids(t, f"{stack}.layers."):
            p = f"{stack}.layers.{i}."
            if stack == "expert" and ctx.cfg.pi05:
                continue
            require(t, p + "attn_norm.scale", p + "ffn_norm.scale", pass_name=NAME)
            g = t.pop(p + "attn_norm.scale")
            for name in ("q_proj", "k_proj", "v_proj"):
                t[p + name + ".weight"] = fold_scale(t[p + name + ".weight"], g)
            g = t.pop(p + "ffn_norm.scale")
            for name in ("gate_proj", "up_proj"):
                t[p + name + ".weight"] = fold_scale(t[p + name + ".weight"], g)
    if not ctx.cfg.pi05:
        t["action_out_proj.weight"] = fold_scale(t["action_out_proj.weight"], t.pop("expert.final_norm.scale"))
    return state.replace(t, rmsnorm_scales_folded=True)


def report(ctx: PassContext) -> PassReport:
    cfg = ctx.cfg
    b = ctx.batch_size
    # per norm application: `1 + g` and the multiply (2 elementwise kernels, rows × width FLOPs each)
    llm_norms, exp_norms = 2 * cfg.llm.depth, 0 if cfg.pi05 else 2 * cfg.expert.depth + 1
    flops = 2 * llm_norms * b * ctx.prefix_len * cfg.llm.width
    flops += 2 * exp_norms * b * ctx.suffix_len * cfg.expert.width * ctx.num_steps
    return PassReport(
        NAME,
        kernels_removed=2 * (llm_norms + exp_norms * ctx.num_steps),
        weight_bytes_saved=(llm_norms * cfg.llm.width + exp_norms * cfg.expert.width) * BF16_BYTES,
        flops_saved=flops,
        note="(1+g) into next linear",
    )


PASS = GraphPass(NAME, apply, report)
