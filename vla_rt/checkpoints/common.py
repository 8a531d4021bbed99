"""What every checkpoint reader shares: the result type, shape checking in the checkpoint's own names, tensor casts.

Readers report problems in the names the user sees in their checkpoint (openpi paths, LeRobot keys), not in vla-rt's
canonical names, so the message points at the file's contents.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vla_rt.checkpoints.files import check_safetensors, tensor_names
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import Pi0Config
from vla_rt.errors import ArgumentError, CheckpointError

Shape = tuple[int, ...]


@dataclass
class LoadedCheckpoint:
    """Canonical weights (see `vla_rt.model.weights`) with the config inferred from their shapes.

    `source` is where the weights were read from (a path or `random:<preset>[:seed]`); `format` is one of
    `openpi`, `lerobot`, `native`, `random`; `origin` is the checkpoint a native file was converted from; `notes`
    are facts worth showing a user (tensors deliberately ignored, norm stats found or not). openpi records no
    normalisation mode in a checkpoint (π0 uses z-score, π0.5 quantiles), so `use_quantile_norm` is None there.
    `norm_stats_assets` are the openpi assets holding norm stats (`assets/<asset_id>/norm_stats.json`), whichever was
    used: with several and none chosen `norm_stats` is None, and a policy must refuse to run rather than feed raw
    states to the model (`Pi0Policy`), so the choices travel with the weights. `relative_actions`: a LeRobot
    checkpoint trained with `use_relative_actions` predicts each action as an offset from the current state; LeRobot's
    processors add the state back, vla-rt's own policy does not, so it refuses such a model
    (`check_absolute_actions`) rather than send offsets to a robot as positions (the LeRobot plugin runs it).
    """

    weights: dict[str, torch.Tensor]
    config: Pi0Config
    source: str
    norm_stats: dict[str, NormStats] | None = None
    format: str = ""
    origin: str | None = None
    notes: list[str] = field(default_factory=list)
    use_quantile_norm: bool | None = None  # the normalisation mode where the checkpoint records one (LeRobot, native)
    norm_stats_assets: tuple[str, ...] = ()  # openpi: every asset id with norm stats beside params/
    relative_actions: bool = False  # LeRobot's use_relative_actions: actions are offsets from the state


def relative_actions_error(source: str, what: str) -> CheckpointError:
    """The refusal of a relative-action checkpoint by `what` (vla-rt's policy, a converted file, a split expert)."""
    return CheckpointError(
        source,
        f"config.json use_relative_actions is true: the model predicts each action as an offset from the current "
        f"state, which LeRobot's processors add back and {what} does not (the robot would get offsets as "
        "positions); run it through the LeRobot plugin (`--policy.type=vla_rt --policy.checkpoint=...`, "
        "docs/lerobot.md), which applies LeRobot's relative-action steps",
    )


def check_absolute_actions(ckpt: LoadedCheckpoint, what: str) -> None:
    """CheckpointError where `ckpt` predicts actions relative to the state (LeRobot's use_relative_actions)."""
    if ckpt.relative_actions:
        raise relative_actions_error(ckpt.source, what)


def check_assets_chosen(ckpt: LoadedCheckpoint, field: str) -> None:
    """ArgumentError `field` where the checkpoint has norm stats for several openpi assets and none was chosen."""
    if ckpt.norm_stats is None and ckpt.norm_stats_assets:
        raise asset_choice_error(field, ckpt.norm_stats_assets)


def asset_choice_error(field: str, assets: tuple[str, ...], alternative: str = "") -> ArgumentError:
    """The error for an openpi checkpoint with norm stats for several assets and none chosen: running it would feed
    raw states to the model and return actions in normalised units, which openpi itself never does (its policy loads
    the config's asset_id and fails without it)."""
    return ArgumentError(
        field,
        f"one of {list(assets)} (the checkpoint's assets/<asset_id>/norm_stats.json; without one the states go in "
        f"raw and the actions come back in normalised units){alternative}",
        None,
        found_text="none chosen",
    )


def check_shapes(found: Mapping[str, Shape], expected: Mapping[str, Shape], source: str, context: str = "") -> None:
    """Raises CheckpointError listing every missing, unexpected and misshaped tensor with expected vs found shape."""
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name!r} (expected shape {tuple(shape)})")
        elif tuple(found[name]) != tuple(shape):
            problems.append(f"tensor {name!r} has shape {tuple(found[name])}, expected {tuple(shape)}")
    for name, shape in found.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} with shape {tuple(shape)}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        ctx = f"\n{context}" if context else ""
        raise CheckpointError(source, f"{len(problems)} problem(s) with the weights:\n  {shown}{more}{ctx}")


def describe_dims(cfg: Pi0Config) -> str:
    """One line of the inferred dims, appended to shape errors: a wrong anchor tensor shows up here."""
    v, g, e = cfg.vision, cfg.llm, cfg.expert
    return (
        f"(dims inferred from the checkpoint: vision width {v.width} depth {v.depth} mlp {v.mlp_dim} heads "
        f"{v.num_heads} patch {v.patch_size} image {v.image_size}; llm width {g.width} depth {g.depth} mlp "
        f"{g.mlp_dim}; expert width {e.width} mlp {e.mlp_dim}; heads {g.num_heads}x{g.head_dim} kv {g.num_kv_heads}; "
        f"vocab {cfg.vocab_size}; action dim {cfg.action_dim})"
    )


_NUMPY_TO_TORCH = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


def torch_dtype_of(np_dtype: object) -> torch.dtype:
    name = np.dtype(np_dtype).name
    if name not in _NUMPY_TO_TORCH:
        raise CheckpointError(f"unsupported tensor dtype {name!r} in checkpoint")
    return _NUMPY_TO_TORCH[name]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def safetensors_shapes(path: str | Path, header: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a meta tensor (shape and dtype, no data), in header order.

    Reads only the (checked) header; pass `header` when the caller already has it from `check_safetensors`."""
    header = check_safetensors(path) if header is None else header
    out = {}
    for key in tensor_names(header):
        dtype = header[key]["dtype"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(path, f"tensor {key!r} has dtype {dtype}, expected a float dtype (F32, BF16, ...)")
        out[key] = torch.empty(header[key]["shape"], dtype=_SAFETENSORS_DTYPES[dtype], device="meta")
    return out


def numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy where possible; bfloat16 (ml_dtypes, as orbax returns it) goes through a uint16 view."""
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """bfloat16 becomes an ml_dtypes bfloat16 array (what jax/orbax store); other dtypes map directly."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # a jax dependency; only needed when writing bf16 for orbax

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def own(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None = None) -> torch.Tensor:
    """A contiguous copy in `dtype` (None keeps the stored dtype) on `device` that shares no storage with its source.

    Layout conversions slice stacked arrays into per-layer views; owning copies keep a big stacked array from staying
    alive through one view and keep safetensors from refusing tensors that share memory.
    """
    dtype = dtype or t.dtype
    if t.device.type == "meta":
        return t.to(dtype=dtype)
    if device is not None and torch.device(device) != t.device:
        return t.to(device=device, dtype=dtype, memory_format=torch.contiguous_format)  # a copy by construction
    if t.dtype == dtype:
        return t.clone(memory_format=torch.contiguous_format)
    return t.to(dtype=dtype, memory_format=torch.contiguous_format)
