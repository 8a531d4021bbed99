"""Float32 means float32 in the reference: its passes run with TF32 (and oneDNN's reduced float32) switched off.

PyTorch lets cuDNN convolutions use TF32 by default (`torch.backends.cudnn.conv.fp32_precision` starts as "tf32"),
and a user's `torch.set_float32_matmul_precision("high")` does the same to matmuls. TF32 keeps 10 mantissa bits, so
a float32 reference whose patch-embedding convolution ran in TF32 was ~100x further from openpi on CUDA than the
`folded` backend (8e-5 vs 9e-7 relative on actions). The reference is the yardstick every other backend is measured
against, so its float32 math must be IEEE float32 whatever the process set.

The switches are process-wide, so they are set only for the duration of a reference call and restored after (also on
an exception). Inside, they hold the state PyTorch's own "TF32 off" calls produce (`set_float32_matmul_precision(
"highest")`, `cudnn.allow_tf32 = False`: matmuls "ieee", convolutions "none" under parents "none"), because code
that runs inside a reference call still reads the legacy getters (`torch.backends.cudnn.allow_tf32`,
`torch.get_float32_matmul_precision()`: torch.compile's inductor does, when it compiles the reference), and those
raise on states only the per-operator API can make (a convolution at "ieee" beside an RNN at "tf32"). Another
thread relying on these switches while a reference call runs sees TF32 off: harmless for bf16 work, which ignores
them, and the reason this is scoped rather than global.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

# Inside the scope: matmuls explicitly IEEE; everything else "none" (inherit), with every parent "none", which is
# IEEE float32. Parents come first: they are set before, and restored before, the operators under them.
PARENTS = {"generic": "none", "cuda": "none", "mkldnn": "none"}
OPERATORS = {
    "cuda.matmul": "ieee",  # cuBLAS
    "cudnn.conv": "none",  # cuDNN convolutions: the patch embedding
    "cudnn.rnn": "none",  # no RNN here; kept equal to conv, or the legacy cudnn.allow_tf32 getter raises
    "mkldnn.matmul": "ieee",  # oneDNN on the CPU
    "mkldnn.conv": "none",
    "mkldnn.rnn": "none",
}
SCOPE = PARENTS | OPERATORS


def float32_switches() -> dict[str, object]:
    """Every float32 precision switch: name -> the torch.backends object holding its `fp32_precision`."""
    b = torch.backends
    return {
        "generic": b,
        "cuda": b.cudnn,  # `torch.backends.cudnn.fp32_precision` is the whole CUDA backend's switch
        "mkldnn": b.mkldnn,
        "cuda.matmul": b.cuda.matmul,
        "cudnn.conv": b.cudnn.conv,
        "cudnn.rnn": b.cudnn.rnn,
        "mkldnn.matmul": b.mkldnn.matmul,
        "mkldnn.conv": b.mkldnn.conv,
        "mkldnn.rnn": b.mkldnn.rnn,
    }


def float32_precisions() -> dict[str, str]:
    """The value each switch reports ("ieee", "tf32", "bf16" or "none"; an operator at "none" reports its parent's)."""
    return {name: backend.fp32_precision for name, backend in float32_switches().items()}


def _legacy_state() -> dict[str, object]:
    """The legacy getters' answers; None where one raises (the process set its switches through the per-operator
    API only, which those getters refuse to summarize): there is then no legacy state to restore."""
    b = torch.backends
    getters = {
        "matmul_precision": torch.get_float32_matmul_precision,
        "matmul_allow_tf32": lambda: b.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": lambda: b.cudnn.allow_tf32,
    }
    state: dict[str, object] = {}
    for name, getter in getters.items():
        try:
            state[name] = getter()
        except RuntimeError:
            state[name] = None
    return state


def _set_legacy(matmul_precision: object, matmul_allow_tf32: object, cudnn_allow_tf32: object) -> None:
    """Set the legacy switches given (None: leave that one alone)."""
    if matmul_precision is not None:
        torch.set_float32_matmul_precision(matmul_precision)
    if matmul_allow_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = matmul_allow_tf32
    if cudnn_allow_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = cudnn_allow_tf32


@torch.compiler.disable
def _enter() -> tuple[dict[str, str], dict[str, object]]:
    """Switch to IEEE float32; returns what to restore. Never traced: its helpers would compile as graphs of their own."""
    switches = float32_switches()
    saved = float32_precisions(), _legacy_state()
    _set_legacy("highest", False, False)  # PyTorch's own "TF32 off": the legacy getters answer inside
    for name, value in SCOPE.items():
        switches[name].fp32_precision = value
    return saved


@torch.compiler.disable
def _leave(saved: tuple[dict[str, str], dict[str, object]]) -> None:
    precisions, legacy = saved
    _set_legacy(**legacy)
    switches = float32_switches()
    for name in SCOPE:
        switches[name].fp32_precision = precisions[name]


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Within the block, float32 matmuls and convolutions compute in IEEE float32; after it, the switches are back."""
    saved = _enter()
    try:
        yield
    finally:
        _leave(saved)


def float32_is_float32(method: Callable[P, R]) -> Callable[P, R]:
    """Run `method` inside `ieee_float32()`. The wrapper and the switching stay out of torch.compile's graph (the
    switches are not traceable); a compiled call of the method still compiles the method's body, run in the scope."""

    @functools.wraps(method)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        with ieee_float32():
            return method(*args, **kwargs)

    return torch.compiler.disable(scoped, recursive=False)
