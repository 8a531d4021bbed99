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

Statistics are checked when they are made, not when they are first used: every value finite (NaN in a statistic
would otherwise surface as "NaN in the state" at the first inference), std >= 0, q01 <= q99, equal lengths.
Every problem is a `NormStatsError(field, expected, found)` naming the entry and field (`norm_stats['state'].std`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from vla_rt.checkpoints.files import read_json
from vla_rt.errors import InputError, NormStatsError

EPS = 1e-6
STAT_FIELDS = ("mean", "std", "q01", "q99")

Array = TypeVar("Array", np.ndarray, torch.Tensor)


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
                    raise NormStatsError(name, "a 1-D vector of numbers (required)", None)
                continue
            try:
                arr = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise NormStatsError(
                    name, "a 1-D vector of numbers", value, found_text=f"non-numeric values ({e})"
                ) from None
            if arr.ndim != 1 or arr.shape[0] == 0:
                raise NormStatsError(name, "a non-empty 1-D vector", arr, found_text=f"shape {arr.shape}")
            if n is not None and arr.shape[0] != n:
                raise NormStatsError(name, f"{n} entries like 'mean'", arr, found_text=f"{arr.shape[0]} entries")
            bad = np.flatnonzero(~np.isfinite(arr))
            if bad.size:
                raise NormStatsError(
                    name, "finite values", arr, found_text=f"{arr[bad[0]]} at index {bad[:8].tolist()}"
                )
            n = arr.shape[0]
            object.__setattr__(self, name, arr)
        if (self.q01 is None) != (self.q99 is None):
            raise NormStatsError("q01/q99", "both or neither (quantile mode needs both)", None, found_text="only one")
        negative = np.flatnonzero(self.std < 0)
        if negative.size:
            raise NormStatsError(
                "std", "values >= 0", self.std, found_text=f"negative at index {negative[:8].tolist()}"
            )
        if self.q01 is not None and self.q99 is not None:
            inverted = np.flatnonzero(self.q01 > self.q99)
            if inverted.size:
                raise NormStatsError(
                    "q01/q99", "q01 <= q99 in every dim", None, found_text=f"q01 > q99 at index {inverted[:8].tolist()}"
                )

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    @property
    def has_quantiles(self) -> bool:
        return self.q01 is not None

    def _quantiles(self) -> tuple[np.ndarray, np.ndarray]:
        if self.q01 is None or self.q99 is None:
            raise NormStatsError(
                "q01/q99", "quantiles for quantile normalisation (needs 'q01' and 'q99')", None, found_text="none"
            )
        return self.q01, self.q99

    def normalize(self, x: Array, *, use_quantiles: bool = False) -> Array:
        """Raw units -> normalised units over the last axis; x may be shorter than the stats (first dims used)."""
        d = x.shape[-1]
        if d > self.dim:
            raise InputError(
                "x", f"at most {self.dim} dims to normalise (the norm stats' width)", None, found_text=f"{d}"
            )
        if use_quantiles:
            q01, q99 = (_like(s[:d], x) for s in self._quantiles())
            return (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
        mean, std = _like(self.mean[:d], x), _like(self.std[:d], x)
        return (x - mean) / (std + EPS)

    def unnormalize(self, x: Array, *, use_quantiles: bool = False) -> Array:
        """Normalised -> raw units over the last axis; x may be longer than the stats (openpi's padding rules)."""
        d = x.shape[-1]
        if d < self.dim:
            raise InputError(
                "x", f"at least {self.dim} dims to un-normalise (the norm stats' width)", None, found_text=f"{d}"
            )
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
        raise NormStatsError("norm_stats", "a JSON object with a top-level 'norm_stats' key", data, source=source)
    entries = data["norm_stats"]
    if not isinstance(entries, dict) or not entries:
        raise NormStatsError("norm_stats", "a non-empty object of {key: stats}", entries, source=source)
    out = {}
    for key, entry in entries.items():
        field = f"norm_stats[{key!r}]"
        if not isinstance(entry, dict):
            raise NormStatsError(field, "an object with 'mean' and 'std'", entry, source=source)
        missing = [f for f in ("mean", "std") if entry.get(f) is None]
        if missing:
            raise NormStatsError(field, "'mean' and 'std'", None, source=source, found_text=f"it lacks {missing}")
        try:
            out[key] = NormStats(**{f: entry[f] for f in STAT_FIELDS if entry.get(f) is not None})
        except NormStatsError as e:
            raise e.within(field, source) from None
    return out


def norm_stats_to_json(stats: dict[str, NormStats]) -> dict:
    return {"norm_stats": {key: s.to_json() for key, s in stats.items()}}


def load_norm_stats(path: str | Path) -> dict[str, NormStats]:
    """Reads an openpi `norm_stats.json` (the file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "norm_stats.json"
    return norm_stats_from_json(read_json(path), source=str(path))


def save_norm_stats(path: str | Path, stats: dict[str, NormStats]) -> Path:
    """Writes openpi's `norm_stats.json`; `path` is the file or the directory (e.g. `assets/<asset_id>`)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / "norm_stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(norm_stats_to_json(stats), indent=2, allow_nan=False))
    return path


def require_keys(stats: dict[str, NormStats], keys: tuple[str, ...] = ("state", "actions"), source: str = "") -> None:
    """Raises a clear error when the stats lack an entry the policy needs (openpi uses `state` and `actions`)."""
    missing = [k for k in keys if k not in stats]
    if missing:
        raise NormStatsError(
            "norm_stats",
            f"entries {list(keys)}",
            None,
            source=source,
            found_text=f"{sorted(stats)} (they lack {missing})",
        )
