"""Read and write openpi checkpoints (orbax `params/` trees) on the CPU, without importing openpi.

A released openpi checkpoint is a directory holding `params/` (an orbax PyTree checkpoint whose tree has a single
top-level `params` key) and `assets/<asset_id>/norm_stats.json`. A training step directory has the same two entries
plus `train_state/`, and every leaf path there ends in `/value` (added by `nnx.State`), which openpi's
`restore_params` strips when all paths carry it; so do we. jax and orbax are imported only here, lazily, so the rest
of vla-rt works without them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vla_rt.checkpoints.common import (
    LoadedCheckpoint,
    check_shapes,
    describe_dims,
    numpy_to_torch,
    own,
    torch_dtype_of,
    torch_to_numpy,
)
from vla_rt.checkpoints.norm_stats import NormStats, load_norm_stats, save_norm_stats
from vla_rt.checkpoints.openpi_layout import layout, openpi_config, openpi_shapes
from vla_rt.config import Pi0Config
from vla_rt.model.weights import CheckpointError, infer_config, validate_weights

ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt", "_CHECKPOINT_METADATA", "checkpoint")


def _orbax():
    """Imports orbax lazily and pins jax to the CPU.

    Reading weights never needs an accelerator, and a jax GPU backend would preallocate most of the GPU memory that
    the PyTorch engine needs in the same process.
    """
    try:
        import jax
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"reading or writing openpi checkpoints needs jax and orbax-checkpoint ({e}); "
            "install them with `pip install vla-rt[openpi]`"
        ) from None
    try:  # no effect (or an error) once jax has initialised its backends; then whatever the user chose stands
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001
        pass
    return jax, ocp


def is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in ORBAX_MARKERS)


def find_params_dir(path: str | Path) -> Path:
    """Accepts the `params/` dir itself, the checkpoint dir holding it, or a training step dir (which also holds it)."""
    path = Path(path)
    if (path / "params").is_dir() and is_orbax_dir(path / "params"):
        return path / "params"
    if is_orbax_dir(path):
        return path
    steps = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / "params").is_dir()) if path.is_dir() else []
    hint = f"; it holds training steps {steps}: pass one of those step dirs" if steps else ""
    raise CheckpointError(
        f"{path}: not an openpi checkpoint: looked for an orbax params dir (a dir with one of {list(ORBAX_MARKERS)}) "
        f"at {path} and at {path / 'params'}{hint}"
    )


def find_assets(params_dir: Path) -> dict[str, Path]:
    """`asset_id -> norm_stats.json` for every asset beside `params/` (openpi's `assets/<asset_id>/`)."""
    assets = params_dir.parent / "assets"
    if not assets.is_dir():
        return {}
    return {p.parent.name: p for p in sorted(assets.glob("*/norm_stats.json"))}


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}/")
    else:
        yield prefix[:-1], tree


def _strip(flat: dict[str, Any], source: str) -> dict[str, Any]:
    """Drops the top-level `params/` and, when every path has it, the trailing `/value` of training checkpoints."""
    if not flat or not all(k.startswith("params/") for k in flat):
        top = sorted({k.split("/")[0] for k in flat})
        raise CheckpointError(f"{source}: expected a tree under a single top-level 'params' key, found keys {top}")
    flat = {k[len("params/") :]: v for k, v in flat.items()}
    if all(k.endswith("/value") for k in flat):
        flat = {k[: -len("/value")]: v for k, v in flat.items()}
    return flat


def _restore(params_dir: Path, shapes_only: bool) -> dict[str, Any]:
    """Flat `path -> numpy array` (or, with shapes_only, `path -> orbax ArrayMetadata`), stripped of params/ and /value."""
    jax, ocp = _orbax()
    with ocp.PyTreeCheckpointer() as ckptr:
        metadata = ckptr.metadata(params_dir)
        # Current orbax returns a StepMetadata (tree under .item_metadata.tree); older versions returned the tree.
        item = getattr(metadata, "item_metadata", metadata)
        tree = getattr(item, "tree", item)
        if not shapes_only:
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            tree = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
    return _strip(dict(_flatten(tree)), str(params_dir))


def load_openpi(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    *,
    asset_id: str | None = None,
    shapes_only: bool = False,
    progress: bool = False,
) -> LoadedCheckpoint:
    """Reads an openpi π0 checkpoint into canonical weights (float32 by default; `dtype=None` keeps the stored dtype).

    Dims come from tensor shapes (head counts from the einsum axes). Norm stats are read from `assets/<asset_id>/`
    when `asset_id` is given or exactly one asset exists; with several and none chosen, `notes` lists them.
    `shapes_only` reads only the metadata and returns meta tensors (for `vla-rt info`).
    """
    params_dir = find_params_dir(path)
    source = str(params_dir)
    if progress and not shapes_only:
        tqdm.write(f"restoring the orbax tree of {params_dir} (all arrays at once; large checkpoints take a while)")
    flat = _restore(params_dir, shapes_only)
    shapes = {k: tuple(v.shape) for k, v in flat.items()}
    cfg = openpi_config(shapes, source)
    check_shapes(shapes, openpi_shapes(cfg), source, describe_dims(cfg))

    weights: dict[str, torch.Tensor] = {}
    leaves = layout(cfg)
    for leaf in tqdm(leaves, desc="reading openpi", unit="tensor", disable=not progress):
        value = flat.pop(leaf.path)
        if shapes_only:
            t = torch.empty(value.shape, dtype=torch_dtype_of(value.dtype), device="meta")
        else:
            t = numpy_to_torch(value)
        weights.update({name: own(x, dtype) for name, x in leaf.read(t).items()})
        del value, t

    inferred = infer_config(weights, head_dim=cfg.llm.head_dim, vision_heads=cfg.vision.num_heads)
    validate_weights(weights, inferred, source)
    if inferred != cfg:
        raise CheckpointError(f"{source}: dims from openpi shapes {cfg} differ from canonical inference {inferred}")
    norm_stats, notes = _pick_norm_stats(params_dir, asset_id)
    return LoadedCheckpoint(weights, cfg, source, norm_stats, format="openpi", notes=notes)


def _pick_norm_stats(params_dir: Path, asset_id: str | None) -> tuple[dict[str, NormStats] | None, list[str]]:
    assets = find_assets(params_dir)
    if asset_id is not None:
        if asset_id not in assets:
            raise CheckpointError(
                f"{params_dir.parent}: no norm stats for asset {asset_id!r}; found assets {sorted(assets)}"
            )
        return load_norm_stats(assets[asset_id]), [f"norm stats: assets/{asset_id}/norm_stats.json"]
    if len(assets) == 1:
        ((only, file),) = assets.items()
        return load_norm_stats(file), [f"norm stats: assets/{only}/norm_stats.json"]
    if assets:
        return None, [f"norm stats for several assets {sorted(assets)}: choose one with asset_id"]
    return None, ["no norm stats (no assets/<asset_id>/norm_stats.json beside params/)"]


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def save_openpi(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    path: str | Path,
    *,
    value_suffix: bool = False,
    norm_stats: dict[str, NormStats] | None = None,
    asset_id: str = "vla_rt",
    overwrite: bool = False,
) -> Path:
    """Writes `path/params/` exactly as openpi saves params (`PyTreeCheckpointer().save(dir, {"params": tree})`).

    `value_suffix=True` writes the training-checkpoint variant (every leaf under a `value` key). Norm stats go to
    `path/assets/<asset_id>/norm_stats.json`. Weights keep their dtype (bf16 becomes ml_dtypes bfloat16, as in JAX).
    Returns the params dir.
    """
    _, ocp = _orbax()
    validate_weights(weights, cfg, "weights to save")
    params_dir = Path(path) / "params"
    if params_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{params_dir} exists; pass overwrite=True to replace it")
        shutil.rmtree(params_dir)
    flat = {leaf.path: torch_to_numpy(leaf.write(weights)) for leaf in layout(cfg)}
    if value_suffix:
        flat = {f"{k}/value": v for k, v in flat.items()}
    params_dir.parent.mkdir(parents=True, exist_ok=True)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(params_dir.absolute(), {"params": _nest(flat)})
    if norm_stats is not None:
        save_norm_stats(Path(path) / "assets" / asset_id, norm_stats)
    return params_dir
