"""The one error measure every accuracy check in vla-rt states its tolerance in (tests, GPU tests, benchmarks)."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over the whole tensor, in float64 (so the measure itself adds no rounding at bf16 or fp32)."""
    return float((a.double() - b.double()).norm() / b.double().norm())
