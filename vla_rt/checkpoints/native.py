"""vla-rt's native checkpoint: canonical weights in one `.safetensors` file with a JSON header, never pickle.

The header lives in safetensors' `__metadata__` under the key `vla_rt` (safetensors metadata is str -> str):
`{"format": "vla-rt", "format_version": 1, "config": Pi0Config.to_dict(), "source": <original checkpoint>,
"norm_stats": <openpi norm_stats.json structure> | null, "use_quantile_norm": bool | null}`.
The config in the header is not trusted alone: dims are re-inferred from tensor shapes and must agree with it; the
header supplies only what shapes cannot show (head counts, chunk and prompt length defaults).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from vla_rt.arguments import LIMITS
from vla_rt.checkpoints.common import LoadedCheckpoint, safetensors_shapes
from vla_rt.checkpoints.files import check_safetensors, reading
from vla_rt.checkpoints.norm_stats import NormStats, NormStatsError, norm_stats_from_json, norm_stats_to_json
from vla_rt.checkpoints.streaming import read_safetensors
from vla_rt.config import Pi0Config
from vla_rt.errors import CheckpointError
from vla_rt.model.weights import infer_config, validate_weights

HEADER_KEY = "vla_rt"
FORMAT = "vla-rt"
FORMAT_VERSION = 1


def read_header(path: str | Path, header: dict | None = None) -> dict | None:
    """The vla-rt header of a safetensors file, or None when the file has none (e.g. a LeRobot model.safetensors).

    `header` is the file's safetensors header when the caller already read it (`check_safetensors`)."""
    metadata = (check_safetensors(path) if header is None else header).get("__metadata__") or {}
    if HEADER_KEY not in metadata:
        return None
    try:
        header = json.loads(metadata[HEADER_KEY])
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"the vla-rt header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(path, f"the '{HEADER_KEY}' metadata is not a vla-rt header")
    version = header.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(path, f"native format version {version!r}; this vla-rt reads up to {FORMAT_VERSION}")
    return header


def check_header_settings(cfg: Pi0Config, path: str | Path) -> None:
    """The header's settings that no tensor shape confirms: chunk and prompt length in the ranges a model can be built
    for, and finite positive norm epsilons (a chunk of 0 gave empty actions, a negative or NaN epsilon NaN actions,
    a string a TypeError in the first norm)."""
    for name, (lo, hi) in (("chunk", LIMITS["chunk"]), ("max_token_len", (1, LIMITS["prompt_len"][1]))):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise CheckpointError(path, f"the header's config.{name} is {value!r}, expected an integer in [{lo}, {hi}]")
    for name in ("rms_eps", "layernorm_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise CheckpointError(path, f"the header's config.{name} is {value!r}, expected a finite number > 0")


def looks_native(names: list[str]) -> bool:
    """Tensors named in vla-rt's canonical layout (a native file, or one that lost its header)."""
    return "vision.pos_embed" in names or any(n.startswith(("llm.layers.", "expert.layers.")) for n in names)


def save_native(
    path: str | Path,
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    *,
    source: str,
    norm_stats: dict[str, NormStats] | None = None,
    dtype: torch.dtype | None = None,
    use_quantile_norm: bool | None = None,
    progress: bool = False,
) -> Path:
    """Writes canonical weights (cast to `dtype` if given, else as they are) and the header; returns the path."""
    validate_weights(weights, cfg, "weights to save")
    check_header_settings(cfg, path)  # a file this reader would refuse is never written
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "source": source,
        "norm_stats": norm_stats_to_json(norm_stats) if norm_stats else None,
        "use_quantile_norm": use_quantile_norm,
    }
    tensors = {}
    for name, t in tqdm(weights.items(), desc="writing native", unit="tensor", disable=not progress):
        t = t.detach().cpu()
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    return write_atomically(path, tensors, header)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back at once: os has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | Path, tensors: dict[str, torch.Tensor], header: dict,
                     header_key: str = HEADER_KEY) -> Path:  # fmt: skip
    """A safetensors file with `header` as JSON under the metadata key `header_key`, written beside the target and
    renamed over it: an interrupted write leaves the old file (or none), never a truncated one under the final name.
    Its mode is what `open()` would give (0o666 less the umask): safetensors >= 0.8 writes 0o600, which left a
    converted checkpoint unreadable to the other users of a shared machine (a robot's service account)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        save_file(tensors, str(partial), metadata={header_key: json.dumps(header, allow_nan=False), "format": "pt"})
        os.chmod(partial, 0o666 & ~current_umask())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_native(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    *,
    shapes_only: bool = False,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """Reads a native file: canonical weights (float32 by default, `dtype=None` keeps the stored dtype).

    Tensors are read one at a time straight to `device` (default: the CPU), see `streaming`.
    """
    path = Path(path)
    file_header = check_safetensors(path)
    header = read_header(path, file_header)
    if header is None:
        raise CheckpointError(path, "a .safetensors file without a vla-rt header (not written by `vla-rt convert`)")
    with reading(path):
        try:
            stored = Pi0Config.from_dict(header["config"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise CheckpointError(path, f"the header's config is malformed ({e})") from None
        check_header_settings(stored, path)

        weights = safetensors_shapes(path, file_header)
        if not shapes_only:
            names = tqdm(list(weights), desc="reading native", unit="tensor", disable=not progress)
            for name, t in read_safetensors(path, names, dtype=dtype, device=device):
                weights[name] = t

        cfg = infer_config(
            weights,
            head_dim=stored.llm.head_dim,
            vision_heads=stored.vision.num_heads,
            chunk=stored.chunk,
            max_token_len=stored.max_token_len,
            rms_eps=stored.rms_eps,
            layernorm_eps=stored.layernorm_eps,
        )
        validate_weights(weights, cfg, str(path))
    if cfg != stored:
        raise CheckpointError(path, f"the header's config {stored} disagrees with the tensor shapes {cfg}")
    try:
        norm_stats = (
            norm_stats_from_json(header["norm_stats"], "the vla-rt header") if header.get("norm_stats") else None
        )
    except NormStatsError as e:
        raise CheckpointError(path, str(e)) from None
    quantiles = header.get("use_quantile_norm")
    if quantiles not in (None, True, False):
        raise CheckpointError(path, f"the header's use_quantile_norm is {quantiles!r}, expected true, false or null")
    notes = [f"converted from {header.get('source')}"] + (["norm stats in header"] if norm_stats else [])
    return LoadedCheckpoint(
        weights,
        cfg,
        str(path),
        norm_stats,
        "native",
        origin=header.get("source"),
        notes=notes,
        use_quantile_norm=quantiles,
    )
