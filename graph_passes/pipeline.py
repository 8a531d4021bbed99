"""`apply_passes`: canonical weights + static shapes -> engine weights, through every pass in a fixed order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vla_rt.config import Pi0Config
from vla_rt.graph_passes import (
    fold_adarms,
    fold_layernorm,
    fold_rmsnorm,
    fuse_projections,
    merge_action_time,
    patch_embed_gemm,
    precompute_adarms,
    precompute_rope,
    prune_last_layer,
)
from vla_rt.graph_passes.base import GraphPass, PassContext, PassReport, PassState

# Order matters: norms fold into the separate matrices before they are fused; pruning slices the fused QKV;
# the Q scale is folded into the fused (and pruned) QKV.
PASSES: tuple[GraphPass, ...] = (
    patch_embed_gemm.PASS,
    fold_layernorm.PASS,
    fold_rmsnorm.PASS,
    fuse_projections.PASS,
    prune_last_layer.PASS,
    merge_action_time.PASS,
    precompute_rope.PASS,
)
# π0.5: no action-time MLP to merge; the adaptive-norm tables come after the Q-scale fold so that the QKV bias table
# is built from the scaled Q rows.
PI05_PASSES: tuple[GraphPass, ...] = (
    patch_embed_gemm.PASS,
    fold_layernorm.PASS,
    fold_rmsnorm.PASS,
    fuse_projections.PASS,
    prune_last_layer.PASS,
    precompute_rope.PASS,
    precompute_adarms.PASS,
    fold_adarms.PASS,
)


def passes_for(cfg: Pi0Config) -> tuple[GraphPass, ...]:
    """The pass pipeline of this model: `PASSES` for π0, `PI05_PASSES` for π0.5."""
    return PI05_PASSES if cfg.pi05 else PASSES


def apply_passes(
    weights: dict[str, torch.Tensor],
    ctx: PassContext,
    passes: Sequence[GraphPass] | None = None,
    dtype: torch.dtype | None = None,
) -> PassState:
    """Runs the passes (default: `passes_for(ctx.cfg)`) in float32 (one rounding at the end) and casts matrices to
    `dtype` if given.

    RoPE tables and the per-step tables (`*_table`: π0's time bias, π0.5's modulation) stay float32: the engine
    applies them in float32 anyway.
    """
    passes = passes_for(ctx.cfg) if passes is None else passes
    state = PassState({k: v.detach().float() for k, v in weights.items()})
    for p in passes:
        state = p.apply(state, ctx)
    if dtype is not None:
        keep_f32 = ("rope.cos", "rope.sin")
        state = state.replace(
            {k: v if k in keep_f32 or k.endswith("_table") else v.to(dtype) for k, v in state.tensors.items()}
        )
    return state


def pass_reports(ctx: PassContext, passes: Sequence[GraphPass] | None = None) -> list[PassReport]:
    return [p.report(ctx) for p in (passes_for(ctx.cfg) if passes is None else passes)]


def format_report_table(
    cfg: Pi0Config, views: Sequence[int] = (1, 2, 3), chunk: int = 63, prompt_len: int = 0, num_steps: int = 10
) -> str:
    """Markdown table: pass, kernels removed, weight bytes saved, GFLOPs saved, per inference at each view count."""
    head = "| pass | " + " | ".join(f"kernels −, {v}v" for v in views) + " | weight MB saved (bf16) | "
    head += " | ".join(f"GFLOP saved, {v}v" for v in views) + " | note |"
    lines = [head, "|" + "---|" * (2 * len(views) + 3)]
    reports = {v: pass_reports(PassContext(cfg, v, chunk, prompt_len, num_steps)) for v in views}
    totals = {v: [0, 0, 0] for v in views}
    for i, p in enumerate(passes_for(cfg)):
        rs = [reports[v][i] for v in views]
        for v, r in zip(views, rs):
            totals[v][0] += r.kernels_removed
            totals[v][1] += r.weight_bytes_saved
            totals[v][2] += r.flops_saved
        lines.append(
            f"| {p.name} | "
            + " | ".join(str(r.kernels_removed) for r in rs)
            + f" | {rs[0].weight_bytes_saved / 1e6:.2f} | "
            + " | ".join(f"{r.flops_saved / 1e9:.3f}" for r in rs)
            + f" | {rs[0].note} |"
        )
    lines.append(
        "| **total** | "
        + " | ".join(str(totals[v][0]) for v in views)
        + f" | {totals[views[0]][1] / 1e6:.2f} | "
        + " | ".join(f"{totals[v][2] / 1e9:.3f}" for v in views)
        + " | |"
    )
    return "\n".join(lines)


def report_rows(
    cfg: Pi0Config, views: Sequence[int] = (1, 2, 3), chunk: int = 63, prompt_len: int = 0, num_steps: int = 10
) -> list[dict]:
    """What `format_report_table` shows, as data (`vla-rt info --passes --json`): one dict a pass, each saving
    keyed by view count, in plain units (kernels, bytes, FLOPs) so a script need not parse the table's rounding."""
    reports = {v: pass_reports(PassContext(cfg, v, chunk, prompt_len, num_steps)) for v in views}
    return [
        {
            "pass": p.name,
            "note": reports[views[0]][i].note,
            "kernels_removed": {str(v): reports[v][i].kernels_removed for v in views},
            "weight_bytes_saved": {str(v): reports[v][i].weight_bytes_saved for v in views},
            "flops_saved": {str(v): reports[v][i].flops_saved for v in views},
        }
        for i, p in enumerate(passes_for(cfg))
    ]
