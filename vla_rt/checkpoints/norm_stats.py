"""Normalisation statistics of state and actions, with openpi's exact formulas.

π0 works in a normalised space: the policy normalises the robot state before the model and un-normalises the actions
after it. The statistics come with a checkpoint (openpi's `assets/<asset_id>/norm_stats.json`, LeRobot's processor
files, or the native header) and must be applied exactly as openpi does, including how it treats vectors longer or
shorter than the statistics (openpi `transforms.py`, `Normalize` / `Unnormalize`):

- z-score:  normalize `(x - mean) / (std + 1e-6)`; unnormalize `x * (std + 1e-6) + mean`.
- quantile: normalize `(x - q01) / (q99 - q01 + 1e-6) * 2 - 1`; unnormalize `(x + 1) / 2 * (q99 - q01 + 1e-6) + q01`.
- normalize uses the first `x.shape[-1]` entries of the stats (raw robot vectors may be shorter than the stats).
- unnormalize works on model-width vectors (e.g. 32 action dims) that are longer than the stats: z-score pads the
  stats with mean 0 / std 1 (so extra dims are scaled by 1 + 1e-6, as in openpi), quantile passes extra dims through
  unchanged.
- Anything else (a vector longer than the stats when normalising, shorter when un-normalising) is an error in openpi
  (a broadcasting failure); here it is a ValueError that names the sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

EPS = 1e-6
STAT_FIELDS = ("mean", "std", "q01", "q99")

Array = TypeVar("Array", np.ndarray, torch.Tensor)


class NormStatsError(ValueError):
    """A norm stats file or entry is malformed (missing fields, wrong lengths, not numbers)."""


def _like(stat: np.ndarray, x: Array) -> Array:
    """The statistic as the same kind of array as x (numpy or torch, same dtype and device)."""
    if isinstance(x, torch.Tensor):
        return torch.as_tensor(stat, dtype=x.dtype, device=x.device)
    return stat.astype(np.result_type(x.dtype, np.float32), copy=False)


def _concat(a: Array, b: Array) -> Array:
    return torch.cat([a, b], dim=-1) if isinstance(a, torch.Tensor) else np.concatenate([a, b], axis=-1)


@dataclass(frozen=True, eq=False)
class NormStats:
    """Statistics of one vector quantity (e.g. `state` or `actions`): 1-D float64 arrays of equal length.

    `q01`/`q99` are optional (openpi computes them, older files may lack them); quantile mode requires them.
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = None
        for name in STAT_FIELDS:
            value = getattr(self, name)
            if value is None:
                if name in ("mean", "std"):
                    raise NormStatsError(f"norm stats field {name!r} is required")
                continue
            arr = np.asarray(value, dtype=np.float64)
            if arr.ndim != 1:
                raise NormStatsError(f"norm stats field {name!r} must be a 1-D vector, got shape {arr.shape}")
            if n is not None and arr.shape[0] != n:
                raise NormStatsError(f"norm stats field {name!r} has {arr.shape[0]} entries, 'mean' has {n}")
            n = arr.shape[0]
            object.__setattr__(self, name, arr)
        if (self.q01 is None) != (self.q99 is None):
            raise NormStatsError("norm stats give only one of 'q01' and 'q99'; quantile mode needs both")

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    @property
    def has_quantiles(self) -> bool:
        return self.q01 is not None

    def _quantiles(self) -> tuple[np.ndarray, np.ndarray]:
        if self.q01 is None or self.q99 is None:
            raise NormStatsError("quantile normalisation needs 'q01' and 'q99', which these norm stats lack")
        return self.q01, self.q99

    def normalize(self, x: Array, *, use_quantiles: bool = False) -> Array:
        """Raw units -> normalised units over the last axis; x may be shorter than the stats (first dims used)."""
        d = x.shape[-1]
        if d > self.dim:
            raise ValueError(f"cannot normalise a vector of {d} dims with norm stats of {self.dim} dims")
        if use_quantiles:
            q01, q99 = (_like(s[:d], x) for s in self._quantiles())
            return (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
        mean, std = _like(self.mean[:d], x), _like(self.std[:d], x)
        return (x - mean) / (std + EPS)

    def unnormalize(self, x: Array, *, use_quantiles: bool = False) -> Array:
        """Normalised -> raw units over the last axis; x may be longer than the stats (openpi's padding rules)."""
        d = x.shape[-1]
        if d < self.dim:
            raise ValueError(f"cannot un-normalise a vector of {d} dims with norm stats of {self.dim} dims")
        if use_quantiles:
            q01, q99 = (_like(s, x) for s in self._quantiles())
            head = (x[..., : self.dim] + 1.0) / 2.0 * (q99 - q01 + EPS) + q01
            return head if d == self.dim else _concat(head, x[..., self.dim :])
        pad = d - self.dim
        mean = _like(np.pad(self.mean, (0, pad), constant_values=0.0), x)
        std = _like(np.pad(self.std, (0, pad), constant_values=1.0), x)
        return x * (std + EPS) + mean

    def to_json(self) -> dict[str, list[float]]:
        return {name: getattr(self, name).tolist() for name in STAT_FIELDS if getattr(self, name) is not None}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NormStats):
            return NotImplemented
        return all(
            (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
            for a, b in ((getattr(self, f), getattr(other, f)) for f in STAT_FIELDS)
        )


def norm_stats_from_json(data: object, source: str = "norm stats") -> dict[str, NormStats]:
    """Parses openpi's `{"norm_stats": {key: {"mean", "std", "q01"?, "q99"?}}}` structure."""
    if not isinstance(data, dict) or "norm_stats" not in data:
        raise NormStatsError(f"{source}: expected a JSON object with a top-level 'norm_stats' key")
    entries = data["norm_stats"]
    if not isinstance(entries, dict) or not entries:
        raise NormStatsError(f"{source}: 'norm_stats' must be a non-empty object of {{key: stats}}")
    out = {}
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            raise NormStatsError(f"{source}: norm_stats[{key!r}] must be an object with 'mean' and 'std'")
        missing = [f for f in ("mean", "std") if entry.get(f) is None]
        if missing:
            raise NormStatsError(f"{source}: norm_stats[{key!r}] lacks {missing}")
        try:
            fields = {f: np.asarray(entry[f], dtype=np.float64) for f in STAT_FIELDS if entry.get(f) is not None}
        except (TypeError, ValueError) as e:
            raise NormStatsError(f"{source}: norm_stats[{key!r}] holds non-numeric values ({e})") from None
        try:
            out[key] = NormStats(**fields)
        except NormStatsError as e:
            raise NormStatsError(f"{source}: norm_stats[{key!r}]: {e}") from None
    return out


def norm_stats_to_json(stats: dict[str, NormStats]) -> dict:
    return {"norm_stats": {key: s.to_json() for key, s in stats.items()}}


def load_norm_stats(path: str | Path) -> dict[str, NormStats]:
    """Reads an openpi `norm_stats.json` (the file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "norm_stats.json"
    if not path.is_file():
        raise FileNotFoundError(f"norm stats file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NormStatsError(f"{path}: not valid JSON ({e})") from None
    return norm_stats_from_json(data, source=str(path))


def save_norm_stats(path: str | Path, stats: dict[str, NormStats]) -> Path:
    """Writes openpi's `norm_stats.json`; `path` is the file or the directory (e.g. `assets/<asset_id>`)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / "norm_stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(norm_stats_to_json(stats), indent=2))
    return path


def require_keys(stats: dict[str, NormStats], keys: tuple[str, ...] = ("state", "actions"), source: str = "") -> None:
    """Raises a clear error when the stats lack an entry the policy needs (openpi uses `state` and `actions`)."""
    missing = [k for k in keys if k not in stats]
    if missing:
        where = f"{source}: " if source else ""
        raise NormStatsError(f"{where}norm stats lack {missing}; they have {sorted(stats)}")
