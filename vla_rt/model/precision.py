"""Float32 means float32 in the reference: its passes run with TF32 (and oneDNN's reduced float32) switched off.

PyTorch lets cuDNN convolutions use TF32 by default (`torch.backends.cudnn.conv.fp32_precision` starts as "tf32"),
and a user's `torch.set_float32_matmul_precision("high")` does the same to matmuls. TF32 keeps 10 mantissa bits, so
a float32 reference whose patch-embedding convolution ran in TF32 was ~100x further from openpi on CUDA than the
`folded` backend (8e-5 vs 9e-7 relative on actions). The reference is the yardstick every other backend is measured
against, so its float32 math must be IEEE float32 whatever the process set.

The switches are process-wide, so they are set only for the duration of a reference call and restored after, to the
exact values found (also on an exception). They are PyTorch's per-operator TF32 switches (the `fp32_precision` API);
the legacy `allow_tf32` getters raise while the two APIs disagree, so this module never reads or writes those.
Another thread reading or relying on these switches while a reference call runs sees "ieee": fine for bf16 work (it
ignores them), and the reason this is scoped rather than global.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def float32_switches() -> dict[str, object]:
    """The per-operator precision switches for float32 math: name -> the backend object holding `fp32_precision`."""
    b = torch.backends
    return {
        "cuda.matmul": b.cuda.matmul,  # cuBLAS matmuls
        "cudnn.conv": b.cudnn.conv,  # cuDNN convolutions (the patch embedding)
        "mkldnn.matmul": b.mkldnn.matmul,  # oneDNN on the CPU
        "mkldnn.conv": b.mkldnn.conv,
    }


def float32_precisions() -> dict[str, str]:
    """The current value of each switch ("ieee", "tf32", "bf16" or "none" = inherit)."""
    return {name: backend.fp32_precision for name, backend in float32_switches().items()}


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Within the block, float32 matmuls and convolutions compute in IEEE float32; after it, the switches are back."""
    switches = float32_switches()
    saved = {name: backend.fp32_precision for name, backend in switches.items()}
    try:
        for backend in switches.values():
            backend.fp32_precision = "ieee"
        yield
    finally:
        for name, backend in switches.items():
            backend.fp32_precision = saved[name]


def float32_is_float32(method: Callable[P, R]) -> Callable[P, R]:
    """Run `method` inside `ieee_float32()`. The wrapper itself stays out of torch.compile's graph (setting the
    switches is not traceable); a compiled call of the method still compiles the method's body."""

    @functools.wraps(method)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        with ieee_float32():
            return method(*args, **kwargs)

    return torch.compiler.disable(scoped, recursive=False)
