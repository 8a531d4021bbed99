"""Read and write openpi checkpoints (orbax `params/` trees) on the CPU, without importing openpi.

A released openpi checkpoint is a directory holding `params/` (an orbax PyTree checkpoint whose tree has a single
top-level `params` key) and `assets/<asset_id>/norm_stats.json`. A training step directory has the same two entries
plus `train_state/`, and every leaf path there ends in `/value` (added by `nnx.State`), which openpi's
`restore_params` strips when all paths carry it; so do we. jax and orbax are imported only here, lazily, so the rest
of vla-rt works without them.
"""

from __future__ import annotations

import math
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
from vla_rt.checkpoints.files import check_finite
from vla_rt.checkpoints.norm_stats import NormStats, load_norm_stats, save_norm_stats
from vla_rt.checkpoints.openpi_layout import layout, openpi_config, openpi_shapes
from vla_rt.config import Pi0Config
from vla_rt.errors import CheckpointError
from vla_rt.model.weights import infer_config, param_shapes, validate_weights

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


def restore_group_bytes(total: int) -> int:
    """How many bytes of leaves one orbax call restores (a larger leaf goes alone): 1/16 of the tree, within
    [4 MiB, 256 MiB]. Host memory then peaks near the converted result plus one group (and orbax's transient
    buffers for it), not at the whole tree in numpy plus its conversion; small trees still take one call."""
    return min(max(total // 16, 4 * 2**20), 256 * 2**20)


def _metadata_tree(ckptr: Any, params_dir: Path) -> Any:
    metadata = ckptr.metadata(params_dir.absolute())  # orbax finds no tree metadata under a relative path
    # Current orbax returns a StepMetadata (tree under .item_metadata.tree); older versions returned the tree.
    item = getattr(metadata, "item_metadata", metadata)
    return getattr(item, "tree", item)


def _orbax_error(params_dir: Path, e: Exception) -> CheckpointError:
    return CheckpointError(params_dir, f"orbax cannot read it ({type(e).__name__}: {str(e)[:300]})")


_PARAMS_HINT = "an interrupted download or copy? a complete params/ holds _METADATA, manifest.ocdbt, ocdbt.process_*/"


def _check_orbax_files(params_dir: Path) -> None:
    """Names a missing `_METADATA` or OCDBT manifest before orbax is asked: it answers those with a log warning and no
    tree (not an error), and its reader threads then print tracebacks on their way out."""
    metadata = params_dir / "_METADATA"
    if not metadata.is_file():
        raise CheckpointError(
            params_dir, f"expected the orbax tree metadata file _METADATA, found none ({_PARAMS_HINT})"
        )
    if not (params_dir / "manifest.ocdbt").is_file() and '"use_ocdbt": true' in metadata.read_text(errors="replace"):
        raise CheckpointError(
            params_dir,
            f"_METADATA says the arrays are in an OCDBT database, but there is no manifest.ocdbt ({_PARAMS_HINT})",
        )


def _restore(params_dir: Path, shapes_only: bool) -> dict[str, Any]:
    """Flat `path -> orbax ArrayMetadata` (with shapes_only) or `path -> numpy array` of the whole tree, stripped."""
    jax, ocp = _orbax()
    _check_orbax_files(params_dir)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            tree = _metadata_tree(ckptr, params_dir)
            if not shapes_only:
                restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
                tree = ckptr.restore(
                    params_dir.absolute(), args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
                )
    except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many types for a damaged checkpoint)
        raise _orbax_error(params_dir, e) from None
    if tree is None:
        raise CheckpointError(params_dir, f"orbax finds no tree in it: _METADATA is damaged ({_PARAMS_HINT})")
    if not isinstance(tree, dict):
        raise CheckpointError(params_dir, f"the orbax tree is a {type(tree).__name__}, expected a dict of arrays")
    return _strip(dict(_flatten(tree)), str(params_dir))


def _restore_groups(params_dir: Path, paths: list[str], nbytes: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:
    """Restores the (stripped) leaf `paths` a group at a time, in the given order, with orbax's partial restore."""
    jax, ocp = _orbax()
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = _metadata_tree(ckptr, params_dir)
        full = dict(_flatten(tree))
        # stripped path -> stored path (with params/ and, in training checkpoints, /value)
        stored = dict(zip(_strip(dict.fromkeys(full), str(params_dir)), full))
        budget = restore_group_bytes(sum(nbytes[p] for p in paths))
        group: list[str] = []
        size = 0
        for path in [*paths, None]:
            if path is not None and (not group or size + nbytes[path] <= budget):
                group.append(path)
                size += nbytes[path]
                continue
            item = _nest({stored[p]: full[stored[p]] for p in group})
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            try:
                out = ckptr.restore(
                    params_dir.absolute(),
                    args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
                )
            except Exception as e:  # noqa: BLE001  (as in _restore)
                raise _orbax_error(params_dir, e) from None
            flat = dict(_flatten(out))
            yield {p: flat[stored[p]] for p in group}
            del out, flat
            group, size = ([path], nbytes[path]) if path is not None else ([], 0)


def load_openpi(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    *,
    asset_id: str | None = None,
    shapes_only: bool = False,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """Reads an openpi π0 / π0.5 checkpoint into canonical weights (float32 by default; `dtype=None` keeps the
    stored dtype), on `device` (default: the CPU).

    Dims come from tensor shapes (head counts from the einsum axes). Norm stats are read from `assets/<asset_id>/`
    when `asset_id` is given or exactly one asset exists; with several and none chosen, `norm_stats` is None and
    `norm_stats_assets` lists them (`Pi0Policy` then refuses to run).
    `shapes_only` reads only the metadata and returns meta tensors (for `vla-rt info`). Leaves are restored a group
    at a time, largest first, and converted as they arrive, so host memory stays near the result's size.
    """
    params_dir = find_params_dir(path)
    source = str(params_dir)
    meta = _restore(params_dir, shapes_only=True)
    shapes = {k: tuple(v.shape) for k, v in meta.items()}
    cfg = openpi_config(shapes, source)
    check_shapes(shapes, openpi_shapes(cfg), source, describe_dims(cfg))
    assets = find_assets(params_dir)
    norm_stats, notes = _pick_norm_stats(params_dir, assets, asset_id)  # a small file: fails before minutes of reads

    leaves = {leaf.path: leaf for leaf in layout(cfg)}
    nbytes = {p: math.prod(shapes[p]) * np.dtype(meta[p].dtype).itemsize for p in leaves}
    order = sorted(leaves, key=lambda p: -nbytes[p])  # largest first: conversion copies stay small at the end
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(order), desc="reading openpi", unit="leaf", disable=not progress)
    groups = [{p: meta[p] for p in order}] if shapes_only else _restore_groups(params_dir, order, nbytes)
    for group in groups:
        for p, value in group.items():
            if shapes_only:
                t = torch.empty(value.shape, dtype=torch_dtype_of(value.dtype), device="meta")
            else:
                t = numpy_to_torch(value)
            for name, stored in leaves[p].read(t).items():
                weights[name] = own(stored, dtype, device)
                check_finite(weights[name], f"{p} ({name})", source, stored)
            del value, t
            bar.update()
        group.clear()
    bar.close()
    weights = {name: weights[name] for name in param_shapes(cfg)}  # canonical order

    inferred = infer_config(weights, head_dim=cfg.llm.head_dim, vision_heads=cfg.vision.num_heads)
    validate_weights(weights, inferred, source)
    if inferred != cfg:
        raise CheckpointError(f"{source}: dims from openpi shapes {cfg} differ from canonical inference {inferred}")
    return LoadedCheckpoint(
        weights, cfg, source, norm_stats, format="openpi", notes=notes, norm_stats_assets=tuple(assets)
    )


def _pick_norm_stats(
    params_dir: Path, assets: dict[str, Path], asset_id: str | None
) -> tuple[dict[str, NormStats] | None, list[str]]:
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
        return None, [f"norm stats for several assets {sorted(assets)}, none chosen (asset_id / --asset-id): none used"]
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
