"""When an engine takes the persistent expert step: only on a GPU and at a shape where it measured faster.

`tools/cuda_expert_check.py bench --write-choice` times the persistent step (each tiling it is given) against the
per-op Triton step in the same process and writes `configs/<GPU name>.json`: per model (π0, π0.5) and shape
(batch, prefix keys, chunk) the fastest tiling and both times. `persistent_expert_step` is the builder
`vla_rt.engine.expert_step.CANDIDATES` tries: it returns the kernel's step where the table says it wins, else one
line saying why not (no CUDA, not Hopper, not measured here, measured slower), which the plan keeps as
`plan.expert_why`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def table_path(gpu_name: str) -> Path:
    return CONFIG_DIR / f"{gpu_name.replace(' ', '-')}.json"


@functools.cache
def measured(gpu_name: str) -> dict[tuple[str, int, int, int], dict]:
    """{(model, batch, prefix, chunk): {"tiling": {...}, "persistent_ms": float, "per_op_ms": float}} for a GPU ({}
    when none was measured); model is "pi0" or "pi05"."""
    path = table_path(gpu_name)
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["steps"]
    return {(r.get("model", "pi0"), r["batch"], r["prefix"], r["chunk"]): r for r in rows}


def persistent_expert_step(kernels, weights, cfg, dims, workspace=None, *, device: torch.device,
                           sm_count: int | None = None):  # fmt: skip
    """A `PersistentExpertStep` where it measured faster than the per-op step here, else the reason (one line)."""
    if getattr(kernels, "name", "") != "triton":
        return "the per-op step is this kernel set's own (only the Triton engine swaps it)"
    from vla_rt.cuda_kernels.expert_step import PersistentExpertStep, why_not

    why = why_not(cfg, dims, device, weights.expert[0].qkv.dtype)
    if why:
        return why
    gpu = torch.cuda.get_device_name(device)
    model = "pi05" if cfg.pi05 else "pi0"
    row = measured(gpu).get((model, dims.batch, dims.prefix, dims.chunk))
    if row is None:
        return f"not measured on {gpu} for {model} at B={dims.batch}, {dims.prefix} prefix keys, chunk {dims.chunk}"
    if row["persistent_ms"] >= row["per_op_ms"]:
        return (f"measured slower on {gpu} at this shape ({row['persistent_ms']:.3f} vs {row['per_op_ms']:.3f} ms "
                f"a step)")  # fmt: skip
    return PersistentExpertStep(weights, cfg, dims, sm_count=sm_count, tiling=row["tiling"])
