"""What a checkpoint holds, in numbers a person reads: parameters per part, bytes per dtype, dims, norm stats.

Used by `vla-rt info` and `vla-rt convert`; works on meta tensors, so it never needs the weights' data.
"""

from __future__ import annotations

from collections import Counter

import torch

from vla_rt.checkpoints.common import LoadedCheckpoint
from vla_rt.config import Pi0Config

PARTS = ("vision", "projector", "embeddings", "llm", "expert", "suffix heads")


def part_of(name: str) -> str:
    """The part of π0 a canonical tensor belongs to (the text embedding table is its own part: 0.5B of 2.9B)."""
    if name == "llm.embed_tokens.weight":
        return "embeddings"
    head = name.split(".")[0]
    if head in ("vision", "projector", "llm", "expert"):
        return head
    return "suffix heads"


def parameter_counts(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    counts = dict.fromkeys(PARTS, 0)
    for name, t in weights.items():
        counts[part_of(name)] += t.numel()
    return counts


def stored_dtypes(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tensor count per dtype, e.g. {'bfloat16': 300, 'float32': 12}."""
    return dict(sorted(Counter(str(t.dtype).removeprefix("torch.") for t in weights.values()).items()))


def describe_config(cfg: Pi0Config) -> list[str]:
    v, g, e = cfg.vision, cfg.llm, cfg.expert
    return [
        f"vision: width {v.width}, depth {v.depth}, mlp {v.mlp_dim}, {v.num_heads} heads x {v.head_dim}, "
        f"patch {v.patch_size}, image {v.image_size} ({v.num_patches} tokens/view)",
        f"llm:    width {g.width}, depth {g.depth}, mlp {g.mlp_dim}, {g.num_heads} heads x {g.head_dim}, {g.num_kv_heads} kv heads",
        f"expert: width {e.width}, depth {e.depth}, mlp {e.mlp_dim}, {e.num_heads} heads x {e.head_dim}, {e.num_kv_heads} kv heads",
        f"vocab {cfg.vocab_size}, action dim {cfg.action_dim}, chunk {cfg.chunk}, max prompt tokens {cfg.max_token_len}",
    ]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def summarize(ckpt: LoadedCheckpoint) -> dict:
    """A JSON-ready summary of a loaded checkpoint."""
    counts = parameter_counts(ckpt.weights)
    total = sum(counts.values())
    stats = ckpt.norm_stats or {}
    return {
        "model": ckpt.config.model_name,
        "source": ckpt.source,
        "format": ckpt.format,
        "origin": ckpt.origin,
        "config": ckpt.config.to_dict(),
        "stored_dtypes": stored_dtypes(ckpt.weights),
        "parameters": counts,
        "total_parameters": total,
        "bytes": {"bfloat16": 2 * total, "float32": 4 * total},
        "norm_stats": {k: {"dim": s.dim, "quantiles": s.has_quantiles} for k, s in stats.items()} or None,
        "use_quantile_norm": ckpt.use_quantile_norm,
        "norm_stats_assets": list(ckpt.norm_stats_assets),  # openpi: the assets/<asset_id>/ to choose from
        "relative_actions": ckpt.relative_actions,  # LeRobot's use_relative_actions (vla-rt's policy refuses it)
        "notes": list(ckpt.notes),
    }


def format_summary(summary: dict, cfg: Pi0Config) -> str:
    lines = [
        f"checkpoint: {summary['source']}",
        f"model:      {summary['model']}",
        f"format:     {summary['format']}",
    ]
    if summary["origin"]:
        lines.append(f"converted from: {summary['origin']}")
    lines += ["dims (inferred from tensor shapes):"] + [f"  {line}" for line in describe_config(cfg)]
    dtypes = ", ".join(f"{d} ({n} tensors)" for d, n in summary["stored_dtypes"].items())
    lines += [f"stored dtypes: {dtypes}", "parameters:"]
    rows = list(summary["parameters"].items()) + [("total", summary["total_parameters"])]
    for part, n in rows:
        lines.append(f"  {part:<13} {n:>15,}   {human_bytes(2 * n):>11} bf16   {human_bytes(4 * n):>11} fp32")
    stats = summary["norm_stats"]
    if stats:
        described = ", ".join(
            f"{k} (dim {s['dim']}{', with quantiles' if s['quantiles'] else ''})" for k, s in stats.items()
        )
        lines.append(f"norm stats: {described}")
    else:
        lines.append("norm stats: none")
    if summary["use_quantile_norm"] is not None:
        lines.append(f"normalisation mode: {'quantile' if summary['use_quantile_norm'] else 'z-score'}")
    lines += [f"note: {n}" for n in summary["notes"]]
    return "\n".join(lines)
