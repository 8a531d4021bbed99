"""The robot side's weights: the action expert and the suffix projections alone, in one safetensors file.

A robot never needs the 3.5B-parameter checkpoint: `save_expert_file` writes the expert's canonical tensors (float32,
so the graph passes fold exactly as they do for the whole model) with a JSON header in safetensors' metadata
(key `vla_rt_split_expert`): the config, the norm stats and a fingerprint of the whole checkpoint. The fingerprint
(SHA-256 over a few of its tensors, VLM and expert) is what the KV link compares at its handshake, so an expert
never decodes KV caches computed by another checkpoint's VLM. π0 in float32: 1.25 GB (0.3B parameters).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vla_rt.checkpoints import load_checkpoint, read_runnable_header
from vla_rt.checkpoints.files import check_safetensors
from vla_rt.checkpoints.native import write_atomically
from vla_rt.checkpoints.norm_stats import NormStats, norm_stats_from_json, norm_stats_to_json
from vla_rt.checkpoints.streaming import read_safetensors, safetensors_index
from vla_rt.config import Pi0Config
from vla_rt.engine.split_engines import expert_subset, expert_weight_names
from vla_rt.errors import CheckpointError
from vla_rt.model.weights import param_shapes

HEADER_KEY = "vla_rt_split_expert"
FORMAT_VERSION = 1
# Tensors the fingerprint hashes: one of the VLM (whose K/V the expert reads), one of the expert, the output head.
FINGERPRINT_TENSORS = ("llm.layers.0.k_proj.weight", "expert.layers.0.k_proj.weight", "action_out_proj.weight")


@dataclass
class ExpertWeights:
    """What the robot-side expert loads: canonical expert tensors and what a policy needs around them."""

    weights: dict[str, torch.Tensor]
    config: Pi0Config
    fingerprint: str
    source: str
    norm_stats: dict[str, NormStats] | None = None
    use_quantile_norm: bool | None = None
    norm_stats_assets: tuple[str, ...] = ()  # a whole openpi checkpoint's assets (`LoadedCheckpoint`)


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex, 16 chars) of `FINGERPRINT_TENSORS` in float32: the same checkpoint gives the same string."""
    h = hashlib.sha256()
    for name in FINGERPRINT_TENSORS:
        t = weights[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_expert_file(
    path: str | Path, checkpoint: str, asset_id: str | None = None, *, field: str = "asset_id"
) -> Path:
    """Reads `checkpoint` (any format `load_checkpoint` reads) and writes its expert half to `path`, with the norm
    stats of openpi's `assets/<asset_id>/` where given.

    An openpi checkpoint with norm stats for several assets and no `asset_id` is refused (ArgumentError `field`;
    the CLI passes '--asset-id') from its header, before any weight is read: the file would carry no norm stats and
    the robot's expert would take raw states in and send actions out in normalised units."""
    read_runnable_header(checkpoint, asset_id=asset_id, field=field, what="a split-expert file")
    ckpt = load_checkpoint(checkpoint, asset_id=asset_id)
    header = {
        "format_version": FORMAT_VERSION,
        "config": ckpt.config.to_dict(),
        "fingerprint": fingerprint(ckpt.weights),
        "source": ckpt.source,
        "norm_stats": norm_stats_to_json(ckpt.norm_stats) if ckpt.norm_stats else None,
        "use_quantile_norm": ckpt.use_quantile_norm,
    }
    tensors = {n: t.detach().cpu().float().contiguous() for n, t in expert_subset(ckpt.weights, ckpt.config).items()}
    return write_atomically(path, tensors, header, HEADER_KEY)


def _header(checkpoint: str) -> dict | None:
    """The split-expert header of `checkpoint`, or None for anything else (a whole checkpoint, `random:...`)."""
    path = Path(checkpoint)
    if checkpoint.startswith("random:") or path.suffix != ".safetensors" or not path.is_file():
        return None
    metadata = check_safetensors(path).get("__metadata__") or {}  # a truncated or foreign file: one named error
    if HEADER_KEY not in metadata:
        return None
    try:
        header = json.loads(metadata[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"the split-expert header is not valid JSON ({e})") from None
    version = header.get("format_version") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(path, f"split-expert header version {version!r}, expected {FORMAT_VERSION}")
    return header


def read_expert_config(path: str, asset_id: str | None = None) -> Pi0Config:
    """The model config of what `load_expert_weights(path)` would load, from a header read alone: a split-expert
    file's own header, else the whole checkpoint's (`load_checkpoint(..., shapes_only=True)`). Lets the expert role
    refuse settings the model cannot run (π0.5 without --tokenizer) before it reads 1.25 GB of weights; and an openpi
    checkpoint with norm stats for several assets without `asset_id` (ArgumentError '--asset-id')."""
    header = _header(str(path))
    if header is None:
        return read_runnable_header(path, asset_id=asset_id, what="vla-rt's split expert").config
    return _header_config(path, header)


def _header_config(path: str, header: dict) -> Pi0Config:
    try:
        return Pi0Config.from_dict(header["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"the split-expert header is malformed ({e})") from None


def load_expert_weights(path: str, asset_id: str | None = None) -> ExpertWeights:
    """The expert half of `path`: a file from `save_expert_file`, or any whole checkpoint (read to the host, then
    everything but the expert dropped before anything reaches a device; `asset_id` picks openpi's norm stats)."""
    header = _header(str(path))
    if header is None:
        ckpt = load_checkpoint(path, asset_id=asset_id)
        return ExpertWeights(expert_subset(ckpt.weights, ckpt.config), ckpt.config, fingerprint(ckpt.weights),
                             ckpt.source, ckpt.norm_stats, ckpt.use_quantile_norm,
                             ckpt.norm_stats_assets)  # fmt: skip
    cfg = _header_config(path, header)
    try:
        stats = norm_stats_from_json(header["norm_stats"], "the split-expert header") if header["norm_stats"] else None
        fp, source, quantiles = str(header["fingerprint"]), str(header["source"]), header["use_quantile_norm"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"the split-expert header is malformed ({e})") from None
    shapes, (_, index) = param_shapes(cfg), safetensors_index(path)
    names = expert_weight_names(shapes, cfg)
    for name in names:
        found = tuple(index[name]["shape"]) if name in index else "missing"
        if found != shapes[name]:
            raise CheckpointError(path, f"tensor {name!r}: expected shape {shapes[name]} (the header's config), "
                                        f"found {found}")  # fmt: skip
    weights = dict(read_safetensors(path, names))  # the checkpoints' reader: every tensor checked for NaN / inf
    return ExpertWeights(weights, cfg, fp, source, stats, quantiles)
