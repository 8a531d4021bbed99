"""Programmatic dependent launch (PDL, sm_90+): the next kernel starts while this one finishes.

Why: the action expert is ~200 small kernels per denoising step, each a few µs, so the gaps between kernels
(launch, ramp-up, tail) are a large part of the step (PDL took 0.12 of its 0.85 ms on the H200). With PDL a kernel
launched with `launch_pdl=True` may be scheduled as soon as every program of the kernel before it has executed
`griddepcontrol.launch_dependents`; it then runs its prologue (index arithmetic and, opt-in, for a small-M GEMM an
L2 prefetch of its weight slice, which no earlier kernel writes) and blocks in `griddepcontrol.wait` until the
previous kernel has completed and its memory is visible.

The contract every kernel here keeps (`pdl_enter`): nothing produced or consumed by another kernel is read or
written before the wait, and every program executes the wait. Completion of kernel N+1 therefore implies
completion of kernel N, so ordering stays transitive along the stream even though N+2 may launch early. Kernels
launched without PDL (torch ops in the same graph) are ordered as usual; `griddepcontrol.wait` is a no-op when
nothing was launched programmatically before. Stream capture records PDL launches as programmatic graph edges, so
the CUDA Graphs keep the overlap.

On by default for CUDA devices of compute capability 9.0 or newer, without the weight prefetch (measured: the
prefetch competes with the running kernel for HBM and cancels the gain; numbers at DEFAULT_MODE).
`VLA_RT_PDL=off|on|early` or `pdl_mode(...)` around engine construction chooses; never on the CPU interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["launch", "pdl_settings", "pdl_enter", "pdl_mode", "prefetch_rows_l2"]

# USE_PDL values: 0 no PDL; 1 wait, then let the next kernel launch; 2 let it launch, then wait (the next kernel can
# start while this one still waits on the previous: a two-deep chain)
PDL_MODES = {"off": 0, "on": 1, "early": 2}
# The engine A/B on the H200 (tools/bench_fused.py, π0 bf16, chunk 63): "on" without the weight prefetch saves
# 1.57 / 0.97 ms a call at 1 / 3 views; with the prefetch it gains nothing, and "early" saves less (1.01 / 0.36 ms)
DEFAULT_MODE = "on"
DEFAULT_PREFETCH = False
_OVERRIDE: list[tuple[int, bool]] = []


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _mode(name: str) -> int:
    if name not in PDL_MODES:
        raise ValueError(f"PDL mode must be one of {list(PDL_MODES)}, got {name!r}")
    return PDL_MODES[name]


def pdl_settings(like: torch.Tensor) -> tuple[int, bool]:
    """(USE_PDL value, weight prefetch) for a kernel writing `like`: off unless a CUDA sm_90+ tensor (or a meta
    tensor inside `pdl_mode`, for compile_check), then as `pdl_mode` or `VLA_RT_PDL` (off/on/early, default on)
    says; `VLA_RT_PDL_PREFETCH=1` adds the GEMMs' L2 weight prefetch)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or like.device.type not in ("cuda", "meta"):
        return 0, False
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if like.device.type == "meta":
        return 0, False
    mode = _mode(os.environ.get("VLA_RT_PDL", DEFAULT_MODE))
    if mode and not _device_supports(
        like.device.index if like.device.index is not None else torch.cuda.current_device()
    ):
        return 0, False
    return mode, bool(mode) and os.environ.get("VLA_RT_PDL_PREFETCH", str(int(DEFAULT_PREFETCH))) == "1"


@contextlib.contextmanager
def pdl_mode(mode: str, prefetch: bool = DEFAULT_PREFETCH):
    """Within the block, kernels launch with PDL `mode` ("off"/"on"/"early") and, with PDL,
    one-row-tile GEMMs prefetch their weights iff `prefetch`. Build and capture an engine inside the block to time
    it that way (a CUDA Graph keeps the launch attributes it was captured with)."""
    value = _mode(mode)
    _OVERRIDE.append((value, bool(value) and prefetch))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def launch(kernel, grid, like: torch.Tensor, *, early: bool = False):
    """`kernel[grid]` with the PDL flags set from `like` (the output): the kernel's `USE_PDL` constexpr and the
    launch option agree, so a kernel never waits on a dependency it was not launched with, and vice versa. On meta
    tensors (a shape-only dry run, e.g. compile_check) a real kernel launch is a no-op, while a tool that replaced
    the kernel (a recorder) still sees the call. `early` (where PDL is on): this kernel lets the next one launch
    before its own wait, so a next kernel that streams weights before its wait starts a kernel sooner."""
    if like.device.type == "meta" and type(kernel).__module__.startswith("triton."):
        return lambda *args, **kwargs: None
    launcher = kernel[grid]
    mode, _ = pdl_settings(like)
    if not mode:
        return lambda *args, **kwargs: launcher(*args, USE_PDL=0, **kwargs)
    mode = PDL_MODES["early"] if early else mode
    return lambda *args, **kwargs: launcher(*args, USE_PDL=mode, launch_pdl=True, **kwargs)


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (its results visible) and let the next one launch (order: `USE_PDL`). Call in
    every program before the first load of another kernel's output and before the first store."""
    if USE_PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """One bulk L2 prefetch (sm_90 `cp.async.bulk.prefetch.L2`) of `nbytes` from each address in `row_ptrs`:
    addresses 16-byte aligned, `nbytes` a positive multiple of 16. Only a hint: no data dependency, no wait."""
    sizes = tl.full(row_ptrs.shape, 0, tl.int32) + nbytes
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [row_ptrs, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
