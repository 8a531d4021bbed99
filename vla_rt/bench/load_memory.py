"""Peak host memory of loading a checkpoint, measured in a fresh process (the number issue 21 asks for).

    python -m vla_rt.bench.load_memory --preset pi0 --format native --dtype bfloat16 --dir /tmp/ckpts
    python -m vla_rt.bench.load_memory --preset pi05 --format openpi --dtype bfloat16 --dir /tmp/ckpts

Writes the checkpoint with vla-rt's own writers (`save_native` / `save_openpi` / `save_lerobot`, what the tests use)
from seeded random weights in a child process, then loads it with `load_pi0(path, backend="reference",
device=cpu, dtype=stored dtype)` in another child and reports that child's high-water mark (`VmHWM`): the peak, the
resident size just before the load (Python, torch, jax for openpi) and their difference against the stored size.
Not `ru_maxrss`: Linux carries it across `exec` from the parent's address space, so a child started by a 1 GB
pytest process would report a 1 GB peak before it loads anything (what made CI red on a clean machine). A full-size
π0 in bf16 is 7 GB on disk and needs ~7 GB free to write: run one at a time on a shared machine. `--json` appends
the result to a JSON file. Not a test (CI stays fast); `tests/test_checkpoints_streaming.py` checks the same ratio
on a mid-size checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def _status_bytes(field: str) -> int:
    """A size field of /proc/self/status (`VmRSS`: resident now, `VmHWM`: this address space's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def stored_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if "assets" not in p.parts)


def write(preset_name: str, fmt: str, dtype_name: str, out: Path, seed: int = 0) -> Path:
    """Seeded random weights of a preset (or a Pi0Config dict in JSON) written in `fmt`; returns the path."""
    import torch

    from vla_rt.checkpoints import save_lerobot, save_native, save_openpi
    from vla_rt.config import Pi0Config, preset
    from vla_rt.model.weights import random_weights

    cfg = Pi0Config.from_dict(json.loads(preset_name)) if preset_name.startswith("{") else preset(preset_name)
    weights = random_weights(cfg, seed=seed, dtype=getattr(torch, dtype_name))
    if fmt == "native":
        return save_native(out, weights, cfg, source=f"random:{preset_name}:{seed}")
    if fmt == "openpi":
        save_openpi(weights, cfg, out, overwrite=True)
        return out
    if fmt == "lerobot":
        return save_lerobot(weights, cfg, out)
    raise ValueError(f"--format: expected native, openpi or lerobot, found {fmt!r}")


def warm_up(fmt: str) -> None:
    """One-time costs that are not the checkpoint, paid before the baseline: building a module on the meta device
    imports ~900 torch modules (~150 MB) the first time; jax/orbax/tensorstore start their thread pools and caches
    on the first restore. A tiny checkpoint of the same format is loaded once."""
    import tempfile

    import vla_rt

    with tempfile.TemporaryDirectory() as d:
        vla_rt.load_pi0(
            str(write("tiny", fmt, "float32", Path(d) / ("warm.safetensors" if fmt == "native" else "warm"))),
            backend="reference",
        )


def load(path: Path, dtype_name: str, fmt: str) -> dict:
    """In this process: import everything, note the resident size, load, report the peak."""
    import torch

    import vla_rt

    warm_up(fmt)
    before = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = vla_rt.load_pi0(str(path), backend="reference", device="cpu", dtype=getattr(torch, dtype_name))
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    params = sum(p.numel() * p.element_size() for p in model.impl.parameters())
    return {"baseline_rss": before, "peak_rss": peak, "model_bytes": params, "load_seconds": seconds}


def measure(preset_name: str, fmt: str, dtype_name: str, directory: Path, keep: bool = False) -> dict:
    """Writes (child process), loads (another child), returns the numbers; removes the checkpoint unless `keep`."""
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    tag = preset_name if not preset_name.startswith("{") else "custom"
    path = directory / (f"{tag}_{dtype_name}.safetensors" if fmt == "native" else f"{tag}_{fmt}_{dtype_name}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    me = [sys.executable, "-m", "vla_rt.bench.load_memory"]
    subprocess.run([*me, "--write", preset_name, fmt, dtype_name, str(path)], check=True, env=env)
    try:
        out = subprocess.run(
            [*me, "--load", str(path), dtype_name, fmt], check=True, env=env, capture_output=True, text=True
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        result |= {"preset": tag, "format": fmt, "dtype": dtype_name, "stored_bytes": stored_bytes(path)}
    finally:
        if not keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    stored = result["stored_bytes"]
    result["peak_over_stored"] = result["peak_rss"] / stored
    result["load_over_stored"] = (result["peak_rss"] - result["baseline_rss"]) / stored
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="pi0")
    ap.add_argument("--format", default="native", choices=("native", "openpi", "lerobot"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/vla_rt_load_memory"))
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    ap.add_argument("--json", type=Path, help="append the result to this JSON list")
    ap.add_argument("--write", nargs=4, metavar=("PRESET", "FORMAT", "DTYPE", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--load", nargs=3, metavar=("PATH", "DTYPE", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write:
        write(args.write[0], args.write[1], args.write[2], Path(args.write[3]))
        return 0
    if args.load:
        print(json.dumps(load(Path(args.load[0]), args.load[1], args.load[2])))
        return 0
    r = measure(args.preset, args.format, args.dtype, args.dir, keep=args.keep)
    gib = 2**30
    print(
        f"{r['preset']} {r['format']} {r['dtype']}: stored {r['stored_bytes'] / gib:.2f} GiB, "
        f"peak RSS {r['peak_rss'] / gib:.2f} GiB ({r['peak_over_stored']:.2f}x stored), "
        f"baseline {r['baseline_rss'] / gib:.2f} GiB, load adds {r['load_over_stored']:.2f}x stored, "
        f"{r['load_seconds']:.1f} s"
    )
    if args.json:
        rows = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([*rows, r], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
