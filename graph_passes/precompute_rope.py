"""Pass: RoPE cos/sin tables for every position the plan can see, and the softmax scale folded into Q where exact.

Positions are `cumsum(valid) - 1`, so which positions occur depends on which camera views are present; the table
covers positions 0 .. prefix_len + suffix_len - 1 and the engine gathers rows by position. The scale
`head_dim^-0.5` commutes with RoPE (a rotation); when it is a power of two (head_dim 16, 64, 256) multiplying the Q
rows of the fused weights by it is exact in every float format, so Q comes out pre-scaled and the attention kernel
runs with scale 1. SigLIP's 72-dim heads (scale 72^-0.5) keep the scale in the kernel.
"""

from __future__ import annotations

import math

import torch

from vla_rt.graph_passes.base import GraphPass, PassContext, PassReport, PassState, layer_ids, require

NAME = "precompute_rope_and_fold_q_scale"


def rope_tables(num_positions: int, head_dim: int, max_wavelength: float = 10_000.0) -> tuple[torch.Tensor, ...]:
    """(cos, sin), each (num_positions, head_dim / 2) float32, computed exactly as `vla_rt.model.gemma.rope`."""
    freq_exponents = (2.0 / head_dim) * torch.arange(head_dim // 2, dtype=torch.float32)
    timescale = max_wavelength**freq_exponents
    radians = torch.arange(num_positions, dtype=torch.float32)[:, None] / timescale
    return torch.cos(radians), torch.sin(radians)


def scale_is_exact(head_dim: int) -> bool:
    """head_dim^-0.5 is a power of two iff log2(head_dim) is an even integer."""
    log = math.log2(head_dim)
    return log.is_integer() and int(log) % 2 == 0


def apply(state: PassState, ctx: PassContext) -> PassState:
    t = dict(state.tensors)
    g = ctx.cfg.llm
    cos, sin = rope_tables(ctx.max_positions, g.head_dim)
    t["rope.cos"], t["rope.sin"] = cos, sin
    fold = scale_is_exact(g.head_dim)
    if fold:
        q_rows = g.num_heads * g.head_dim
        for stack in ("llm", "expert"):
            for i in layer_ids(t, f"{stack}.layers."):
                name = f"{stack}.layers.{i}.qkv.weight"
                if name not in t:  # the pruned last LLM layer has no Q
                    require(t, f"{stack}.layers.{i}.kv.weight", pass_name=NAME)
                    continue
                w = t[name].clone()
                w[:q_rows] *= g.head_dim**-0.5
                t[name] = w
    return state.replace(
        t,
        rope_positions=ctx.max_positions,
        gemma_attn_scale=1.0 if fold else g.head_dim**-0.5,
        vision_attn_scale=ctx.cfg.vision.head_dim**-0.5,
    )


def report(ctx: PassContext) -> PassReport:
    cfg = ctx.cfg
    layer_passes = cfg.llm.depth + cfg.expert.depth * ctx.num_steps
    # per layer pass: arange/pow/div/sin/cos for the angles (5 kernels) and the separate Q scale (1 kernel)
    rows = ctx.batch_size * (ctx.prefix_len * cfg.llm.depth + ctx.suffix_len * cfg.expert.depth * ctx.num_steps)
    half = cfg.llm.head_dim // 2
    flops = rows * half * 3 + rows * cfg.llm.num_heads * cfg.llm.head_dim
    return PassReport(
        NAME,
        kernels_removed=6 * layer_passes,
        weight_bytes_saved=0,
        flops_saved=flops,
        note="tables + exact Q scale" if scale_is_exact(cfg.llm.head_dim) else "tables",
    )


PASS = GraphPass(NAME, apply, report)
