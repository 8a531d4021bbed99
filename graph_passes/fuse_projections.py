"""Pass: one matrix per group of projections that read the same input.

q, k, v → `qkv` (SigLIP 1152→3456 with bias; LLM 2048→2560; expert 1024→2560), and gate, up → `gate_up`
(2F rows: gate first, then up) so one GEMM with a gated GELU epilogue computes `gelu_tanh(x Wgᵀ) ⊙ (x Wuᵀ)`.
"""

from __future__ import annotations

import torch

from vla_rt.graph_passes.base import GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "fuse_qkv_and_gate_up"


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    for i in layer_ids(t, "vision.blocks."):
        p = f"vision.blocks.{i}.attn."
        require(t, p + "q_proj.weight", pass_name=NAME)
        t[p + "qkv.weight"] = torch.cat([t.pop(p + f"{n}_proj.weight") for n in "qkv"])
        t[p + "qkv.bias"] = torch.cat([t.pop(p + f"{n}_proj.bias") for n in "qkv"])
    for stack in ("llm", "expert"):
        for i in layer_ids(t, f"{stack}.layers."):
            p = f"{stack}.layers.{i}."
            require(t, p + "q_proj.weight", p + "gate_proj.weight", pass_name=NAME)
            t[p + "qkv.weight"] = torch.cat([t.pop(p + f"{n}_proj.weight") for n in "qkv"])
            t[p + "gate_up.weight"] = torch.cat([t.pop(p + "gate_proj.weight"), t.pop(p + "up_proj.weight")])
    return state.replace(t, qkv_fused=True, gate_up_fused=True)


def report(ctx: PassContext) -> PassReport:
    cfg = ctx.cfg
    # per layer and pass: 3 GEMMs → 1 (2 removed) and gate, up, gelu, multiply → 1 GEMM with epilogue (3 removed)
    vision = ctx.num_views * cfg.vision.depth * 2  # SigLIP MLP is not gated
    llm = cfg.llm.depth * (2 + 3)
    expert = cfg.expert.depth * (2 + 3) * ctx.num_steps
    # the gated epilogue also saves the elementwise GELU·up pass: 2 FLOP-ish per element of the (rows, F) product
    flops = 2 * ctx.batch_size * (ctx.prefix_len * cfg.llm.mlp_dim * cfg.llm.depth)
    flops += 2 * ctx.batch_size * ctx.suffix_len * cfg.expert.mlp_dim * cfg.expert.depth * ctx.num_steps
    return PassReport(
        NAME, kernels_removed=vision + llm + expert, weight_bytes_saved=0, flops_saved=flops, note="fewer, fatter GEMMs"
    )


PASS = GraphPass(NAME, apply, report)
