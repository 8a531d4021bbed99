"""Cheap checks of the arguments that build a model, run before any expensive work.

`load_pi0(path, device="cuda")` on a machine without CUDA must say so in milliseconds, not after materialising
12 GB of float32 weights; a string dtype, a zero chunk or a float seed must be named, not reach torch as a
`TypeError` three layers down or be silently ignored. Every check raises `ArgumentError(field, expected, found)`.

The upper limits are not model limits but sanity bounds: past them a typo (an extra zero) would allocate tens of
GB or run for minutes before failing; π0 uses 1-3 views, chunk 50, prompts under 48 tokens, 10 steps.
"""

from __future__ import annotations

import argparse
import numbers
import os
import tempfile
from pathlib import Path

import torch

from vla_rt.errors import ArgumentError, FieldError

BACKENDS = ("reference", "folded", "triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LIMITS = {  # field -> (smallest, largest) accepted
    "num_views": (1, 16),
    "chunk": (1, 1024),
    "prompt_len": (0, 2048),
    "batch_size": (1, 1024),
    "num_steps": (1, 1000),
}


def check_int(field: str, value: object, lo: int, hi: int, error: type[ArgumentError] = ArgumentError) -> int:
    """`value` as an int in [lo, hi]; bools, floats (even 3.0) and strings are refused, numpy integers taken."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(field, f"an integer in [{lo}, {hi}]", value)
    if not lo <= int(value) <= hi:
        raise error(field, f"an integer in [{lo}, {hi}]", value)
    return int(value)


def check_optional_int(field: str, value: object) -> int | None:
    if value is None:
        return None
    lo, hi = LIMITS[field]
    return check_int(field, value, lo, hi)


def check_seed(field: str, seed: object) -> int | None:
    """None (draw fresh noise) or an integer in [0, 2**63): a float or string seed would be a different seed."""
    if seed is None:
        return None
    return check_int(field, seed, 0, 2**63 - 1)


def check_device(device: object) -> torch.device:
    """A CPU or an existing CUDA device; CUDA is checked for here, before any weights are built."""
    if not isinstance(device, str | torch.device):
        raise ArgumentError("device", "'cpu', 'cuda' or 'cuda:<index>' (a str or torch.device)", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ArgumentError("device", "'cpu', 'cuda' or 'cuda:<index>'", device) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ArgumentError("device", "'cpu', 'cuda' or 'cuda:<index>' (the backends run on those)", device)
    if not torch.cuda.is_available():
        raise ArgumentError("device", "'cpu' on this machine (torch sees no CUDA device)", device)
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ArgumentError("device", f"a CUDA index in [0, {count}) (this machine has {count} GPUs)", device)
    return dev


def check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        hint = (
            f" (torch.{dtype})"
            if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
            else ""
        )
        raise ArgumentError("dtype", f"a torch.dtype, one of {[str(d) for d in DTYPES]}{hint}", dtype)
    if dtype not in DTYPES:
        raise ArgumentError(
            "dtype", f"a floating-point dtype the backends run, one of {[str(d) for d in DTYPES]}", dtype
        )
    return dtype


def check_build_args(
    backend: object,
    device: object,
    dtype: object,
    num_views: object,
    chunk: object,
    prompt_len: object,
    batch_size: object,
) -> torch.device:
    """Every build argument of `load_pi0` / `build_pi0`; returns the device. Costs microseconds."""
    if backend not in BACKENDS:
        raise ArgumentError("backend", f"one of {BACKENDS}", backend)
    dev = check_device(device)
    check_dtype(dtype)
    for field, value in (("num_views", num_views), ("chunk", chunk), ("prompt_len", prompt_len)):
        check_optional_int(field, value)
    check_optional_int("batch_size", batch_size)
    if backend == "triton":
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ArgumentError(
                "device",
                "a CUDA device for backend 'triton' (set TRITON_INTERPRET=1 to run the kernels in Triton's CPU "
                "interpreter, for tests)",
                device,
            )
        if num_views is None:
            raise ArgumentError("num_views", "an integer for backend 'triton' (it allocates static buffers)", None)
    return dev


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its closest existing ancestor: where a file or folder made at `path` would
    land first, so the one to check before any work."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cannot_create_files_in(directory: Path) -> str | None:
    """None if a new file can be made in `directory` (probed by creating and removing one: /proc or a read-only mount
    refuse it whatever the permission bits say), else the OS's reason."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".vla-rt-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror
    return None


def check_out_dir(path: Path, field: str, error: type[FieldError] = ArgumentError) -> Path:
    """Before the run: `path` is a directory, or can be made one, that takes new files. A run that writes its results
    at its end (`vla-rt bench --out`) would otherwise time every row and then fail on a path under a regular file or
    in a read-only directory, without naming the option."""
    if path.exists() and not path.is_dir():
        raise error(field, "a directory for the results", str(path), found_text=f"{path}, which is not a directory")
    ancestor = nearest_existing(path)
    if not ancestor.is_dir():
        raise error(field, "a directory for the results", str(path),
                    found_text=f"{path}, but {ancestor} is not a directory")  # fmt: skip
    reason = cannot_create_files_in(ancestor)
    if reason is not None:
        raise error(field, "a directory where files can be created", str(path),
                    found_text=f"{path}: cannot create files in {ancestor} ({reason})")  # fmt: skip
    return path


def positive_seconds(text: str) -> float:
    """An option type for a time budget (`vla-rt bench --compile-budget`, the tuner's `--budget-s`): finite and > 0,
    since nan or inf would never stop and 0 or less would stop before any work. argparse turns the error into a usage
    error (exit 2) naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, found {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, found {text!r}")
    return value
