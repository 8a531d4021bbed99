"""Checkpoints: one entry point, `load_checkpoint`, that recognises every supported format.

- native: a `.safetensors` file with a vla-rt header (`native.py`), written by `vla-rt convert`;
- LeRobot: a dir with `model.safetensors` + `config.json`, or that model.safetensors itself (`lerobot.py`);
- openpi: an orbax `params/` dir, the dir holding it, or a training step dir (`openpi.py`, needs jax + orbax);
- `random:<preset>[:seed]`: seeded random weights of a preset (`pi0`, `pi05`, `tiny`, `tiny_pi05`, `dummy`) for
  tests and benchmarks.

Every reader returns canonical weights (`vla_rt.model.weights`) with a config inferred from their shapes, validated.
"""

from __future__ import annotations

import stat
from pathlib import Path

import torch

from vla_rt.arguments import cannot_create_files_in, nearest_existing
from vla_rt.checkpoints.common import (
    LoadedCheckpoint,
    asset_choice_error,
    check_absolute_actions,
    check_assets_chosen,
    relative_actions_error,
)
from vla_rt.checkpoints.files import check_safetensors, reading, tensor_names
from vla_rt.checkpoints.lerobot import is_lerobot_dir, load_lerobot, missing_lerobot_file, save_lerobot
from vla_rt.checkpoints.native import HEADER_KEY, load_native, looks_native, read_header, save_native
from vla_rt.checkpoints.norm_stats import NormStats, load_norm_stats, save_norm_stats
from vla_rt.checkpoints.openpi import is_orbax_dir, load_openpi, save_openpi
from vla_rt.checkpoints.streaming import place
from vla_rt.config import PRESETS, preset
from vla_rt.errors import ArgumentError, CheckpointError
from vla_rt.model.weights import iter_random_weights, param_shapes

RANDOM_PREFIX = "random:"

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "NormStats",
    "asset_choice_error",
    "check_absolute_actions",
    "check_asset_id",
    "check_assets_chosen",
    "check_destination",
    "describe_path",
    "detect_format",
    "load_checkpoint",
    "load_lerobot",
    "load_native",
    "load_norm_stats",
    "load_openpi",
    "load_random",
    "read_runnable_header",
    "relative_actions_error",
    "save_lerobot",
    "save_native",
    "save_norm_stats",
    "save_openpi",
]


def parse_random_spec(spec: str) -> tuple[str, int]:
    """`random:<preset>[:seed]` -> (preset, seed); the seed defaults to 0."""
    parts = spec[len(RANDOM_PREFIX) :].split(":")
    if len(parts) not in (1, 2) or not parts[0]:
        raise CheckpointError(spec, "expected random:<preset>[:seed], e.g. random:tiny:3")
    if parts[0] not in PRESETS:
        raise CheckpointError(spec, f"unknown preset {parts[0]!r}; known presets: {sorted(PRESETS)}")
    try:
        seed = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise CheckpointError(spec, f"the seed {parts[1]!r} is not an integer") from None
    if not 0 <= seed < 2**63:
        raise CheckpointError(spec, f"the seed {seed} is outside [0, 2**63)")
    return parts[0], seed


def load_random(
    spec: str,
    dtype: torch.dtype | None = torch.float32,
    *,
    shapes_only: bool = False,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """Seeded random weights, drawn on the CPU (the same values whatever the target) a tensor at a time."""
    name, seed = parse_random_spec(spec)
    cfg = preset(name)
    if shapes_only:
        weights = {n: torch.empty(s, dtype=dtype or torch.float32, device="meta") for n, s in param_shapes(cfg).items()}
    else:
        weights = {
            n: place(t, None, device) for n, t in iter_random_weights(cfg, seed=seed, dtype=dtype or torch.float32)
        }
    return LoadedCheckpoint(weights, cfg, spec, None, "random", notes=[f"seeded random weights (seed {seed})"])


def describe_path(p: Path) -> str:
    """What is at `p`, in words: 'does not exist', 'is a directory', 'is a character device, not a file', ..."""
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISREG(mode):
        return "is a file" if p.suffix == ".safetensors" else "is a file without the .safetensors suffix"
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return "is " + next((name for test, name in kinds if test(mode)), "not a regular file") + ", not a file"


def check_destination(path: Path, field: str = "dst") -> None:
    """Before any work: a file can be written at `path` (ArgumentError '<field>: ...' naming what is in the way). The
    nearest existing ancestor must be a directory that takes new files (probed by creating and removing one: /proc
    or a read-only mount refuse it whatever the permission bits say); an existing `path` must be a regular file."""
    if path.exists() and not path.is_file():
        raise ArgumentError(field, "a path where a file can be written", str(path),
                            found_text=f"{path}, which {describe_path(path)}")  # fmt: skip
    ancestor = nearest_existing(path.parent)
    if not ancestor.is_dir():
        what = "a file" if ancestor.is_file() else "not a directory"
        raise ArgumentError(
            field, "a path under a directory", str(path), found_text=f"{path}, but {ancestor} is {what}"
        )
    reason = cannot_create_files_in(ancestor)
    if reason is not None:
        found = f"{path}: cannot create files in {ancestor} ({reason})"
        raise ArgumentError(field, "a path in a directory where files can be created", str(path), found_text=found)


def detect_format(path: str | Path) -> str:
    """`native`, `lerobot`, `openpi` or `random`; raises CheckpointError saying what was looked for."""
    if isinstance(path, str) and path.startswith(RANDOM_PREFIX):
        return "random"
    if not isinstance(path, str | Path):
        raise CheckpointError(repr(path), f"expected a path (str or Path), found a {type(path).__name__}")
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        header = check_safetensors(p)
        if read_header(p, header) is not None:
            return "native"
        names = tensor_names(header)
        if looks_native(names):
            raise CheckpointError(
                p,
                "its tensors have vla-rt's canonical names (e.g. 'vision.pos_embed') but it has no vla-rt header "
                f"(safetensors metadata key {HEADER_KEY!r}): write native files with `vla-rt convert` or "
                "vla_rt.checkpoints.save_native, which record the dims and norm stats",
            )
        if not any("paligemma" in n or n.endswith("action_in_proj.weight") for n in names):
            shown = names[:5] + (["..."] if len(names) > 5 else [])
            raise CheckpointError(
                p,
                f"a safetensors file that is neither vla-rt native (no {HEADER_KEY!r} header) nor a LeRobot π0 "
                f"model.safetensors (no PaliGemma / action_in_proj tensors); it holds {len(names)} tensors {shown}",
            )
        return "lerobot"
    if is_lerobot_dir(p):
        return "lerobot"
    if p.is_dir() and (is_orbax_dir(p) or is_orbax_dir(p / "params")):
        return "openpi"
    if (missing := missing_lerobot_file(p)) is not None:
        raise CheckpointError(p, f"a LeRobot π0 / π0.5 dir without its {missing} (it needs model.safetensors and "
                                 "config.json side by side; an incomplete download?)")  # fmt: skip
    raise CheckpointError(
        f"{path}: not a checkpoint vla-rt can read ({describe_path(p)}). Looked for: a native .safetensors file with a vla-rt "
        "header; a LeRobot π0 / π0.5 dir (model.safetensors + config.json) or its model.safetensors; an openpi checkpoint "
        "(an orbax params/ dir with _METADATA, the dir holding params/, or a training step dir); or "
        "random:<preset>[:seed] with a preset in " + str(sorted(PRESETS))
    )


def check_asset_id(path: object, asset_id: object, field: str = "asset_id") -> str | None:
    """An `asset_id` argument, checked before anything is read: None, or an asset directory name for a checkpoint
    that can be an openpi one. A `random:` spec, a file or a LeRobot dir has no assets/ beside params/, and an id
    given there would be ignored while the user believes it chose the robot's norm stats. Stats only, no reads."""
    if asset_id is None:
        return None
    if not isinstance(asset_id, str) or not asset_id.strip() or "/" in asset_id or asset_id in (".", ".."):
        raise ArgumentError(field, "the name of a directory under the openpi checkpoint's assets/, e.g. 'droid'",
                            asset_id)  # fmt: skip
    if isinstance(path, str) and path.startswith(RANDOM_PREFIX):
        kind = "a random: checkpoint"
    elif isinstance(path, str | Path) and Path(path).is_file():
        kind = "a file (native or LeRobot)"
    elif isinstance(path, str | Path) and is_lerobot_dir(Path(path)):
        kind = "a LeRobot dir"
    else:
        return asset_id
    raise ArgumentError(field, f"none for {kind} (only an openpi checkpoint has assets/<asset_id>/)", asset_id)


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    *,
    asset_id: str | None = None,
    shapes_only: bool = False,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """Loads any supported checkpoint as canonical weights + inferred config (+ norm stats where present).

    dtype: float32 by default; None keeps the stored dtype. asset_id picks openpi norm stats when there are several.
    shapes_only: meta tensors (shapes and stored dtypes, no data), for inspecting big checkpoints quickly.
    device: where the weights go (default the CPU); each tensor is read, cast and moved before the next one, so a
    full checkpoint never sits in host memory twice (`streaming.py`).
    """
    kind = detect_format(path)
    if asset_id is not None and kind != "openpi":
        raise ArgumentError("asset_id", f"None for a {kind} checkpoint (openpi assets/<asset_id> only)", asset_id)
    if kind == "random":
        return load_random(str(path), dtype, shapes_only=shapes_only, device=device)
    with reading(path):  # a problem found where the file is not known (shape inference) still names it
        if kind == "native":
            return load_native(path, dtype, shapes_only=shapes_only, progress=progress, device=device)
        if kind == "lerobot":
            return load_lerobot(path, dtype, shapes_only=shapes_only, progress=progress, device=device)
        if kind == "openpi":
            return load_openpi(
                path, dtype, asset_id=asset_id, shapes_only=shapes_only, progress=progress, device=device
            )
    raise AssertionError(kind)


def read_runnable_header(
    path: str | Path, *, asset_id: str | None = None, field: str = "--asset-id", what: str
) -> LoadedCheckpoint:
    """The checkpoint's header (`load_checkpoint(..., shapes_only=True)`: config and norm stats, no weights), refused
    where running it would be silently wrong: norm stats for several openpi assets and none chosen (ArgumentError
    `field`: raw states in, normalised actions out), or LeRobot's relative actions, which `what` does not add back
    (CheckpointError: offsets would reach the robot as positions). Every entry point that runs or converts a model
    reads its header here first, before any weight."""
    meta = load_checkpoint(path, None, asset_id=asset_id, shapes_only=True)
    check_assets_chosen(meta, field)
    check_absolute_actions(meta, what)
    return meta
