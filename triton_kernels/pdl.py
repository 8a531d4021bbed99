"""Programmatic dependent launch (PDL, sm_90+): the next kernel starts while this one finishes.

Why: the action expert is ~200 small kernels per denoising step, each a few µs, so the gaps between kernels
(launch, ramp-up, tail) are a large part of the step (PDL took 0.12 of its 0.85 ms on the H200). With PDL a kernel
launched with `launch_pdl=True` may be scheduled as soon as every program of the kernel before it has executed
`griddepcontrol.launch_dependents`; it then runs its prologue (index arithmetic) and blocks in
`griddepcontrol.wait` until the previous kernel has completed and its memory is visible.

The contract every kernel here keeps (`pdl_enter`): nothing produced or consumed by another kernel is read or
written before the wait, and every program executes the wait, then lets the next kernel launch. Completion of
kernel N+1 therefore implies completion of kernel N, so ordering stays transitive along the stream. Kernels
launched without PDL (torch ops in the same graph) are ordered as usual; `griddepcontrol.wait` is a no-op when
nothing was launched programmatically before. Stream capture records PDL launches as programmatic graph edges, so
the CUDA Graphs keep the overlap.

On by default for CUDA devices of compute capability 9.0 or newer (measured on the H200: 1.4 / 1.0 ms a call
faster at 1 / 3 views; docs/kernels.md also lists the variants that lost). `VLA_RT_PDL=off` or `pdl_mode("off")`
around engine construction turns it off (for A/B runs and the bitwise test); never on the CPU interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["launch", "pdl_enter", "pdl_mode", "pdl_on"]

# USE_PDL values: 0 no PDL; 1 wait, then let the next kernel launch
PDL_MODES = {"off": 0, "on": 1}
DEFAULT_MODE = "on"
_OVERRIDE: list[int] = []


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _mode(name: str) -> int:
    if name not in PDL_MODES:
        raise ValueError(f"PDL mode must be one of {list(PDL_MODES)}, got {name!r}")
    return PDL_MODES[name]


def pdl_on(like: torch.Tensor) -> int:
    """The USE_PDL value for a kernel writing `like`: off unless a CUDA sm_90+ tensor (or a meta tensor inside
    `pdl_mode`, for compile_check), then as `pdl_mode` or `VLA_RT_PDL` (off/on, default on) says."""
    if os.environ.get("TRITON_INTERPRET") == "1" or like.device.type not in ("cuda", "meta"):
        return 0
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if like.device.type == "meta":
        return 0
    mode = _mode(os.environ.get("VLA_RT_PDL", DEFAULT_MODE))
    if mode and not _device_supports(
        like.device.index if like.device.index is not None else torch.cuda.current_device()
    ):
        return 0
    return mode


@contextlib.contextmanager
def pdl_mode(mode: str):
    """Within the block, kernels launch with PDL `mode` ("off" / "on"). Build and capture an engine inside the block
    to time it that way (a CUDA Graph keeps the launch attributes it was captured with)."""
    _OVERRIDE.append(_mode(mode))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def launch(kernel, grid, like: torch.Tensor):
    """`kernel[grid]` with the PDL flags set from `like` (the output): the kernel's `USE_PDL` constexpr and the
    launch option agree, so a kernel never waits on a dependency it was not launched with, and vice versa. On meta
    tensors (a shape-only dry run, e.g. compile_check) a real kernel launch is a no-op, while a tool that replaced
    the kernel (a recorder) still sees the call."""
    if like.device.type == "meta" and type(kernel).__module__.startswith("triton."):
        return lambda *args, **kwargs: None
    launcher = kernel[grid]
    mode = pdl_on(like)
    if not mode:
        return lambda *args, **kwargs: launcher(*args, USE_PDL=0, **kwargs)
    return lambda *args, **kwargs: launcher(*args, USE_PDL=mode, launch_pdl=True, **kwargs)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (its results visible), then let the next one launch. Call in every program
    before the first load of another kernel's output and before the first store."""
    if USE_PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
