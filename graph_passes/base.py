"""What every graph pass shares: the static context, the weights-in-flight, and the analytic report.

A pass is a pure function `(PassState, PassContext) -> PassState`: it never mutates its input, and it changes
only weights that do not depend on the observation. Its report (kernels removed, weight bytes saved, FLOPs saved
per inference, relative to the eager reference graph) is computed from dimensions alone, so the table for the full
π0 needs no 3.5B-parameter weights in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vla_rt.config import Pi0Config

BF16_BYTES = 2


@dataclass(frozen=True)
class PassContext:
    """The static shapes a plan is built for."""

    cfg: Pi0Config
    num_views: int = 3
    chunk: int = 50
    prompt_len: int = 0
    num_steps: int = 10
    batch_size: int = 1

    @property
    def prefix_len(self) -> int:
        return self.num_views * self.cfg.vision.num_patches + self.prompt_len

    @property
    def suffix_len(self) -> int:
        """[state token, actions] for π0; the actions alone for π0.5."""
        return self.chunk + (0 if self.cfg.pi05 else 1)

    @property
    def max_positions(self) -> int:
        return self.prefix_len + self.suffix_len


@dataclass(frozen=True)
class PassState:
    """Weights in flight (flat dict, float32 while passes run) plus plan facts later passes and backends read."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def replace(self, tensors: dict[str, torch.Tensor] | None = None, **meta: Any) -> PassState:
        return dataclasses.replace(
            self, tensors=self.tensors if tensors is None else tensors, meta={**self.meta, **meta}
        )


@dataclass(frozen=True)
class PassReport:
    name: str
    kernels_removed: int
    weight_bytes_saved: int
    flops_saved: int
    note: str = ""


@dataclass(frozen=True)
class GraphPass:
    name: str
    apply: Callable[[PassState, PassContext], PassState]
    report: Callable[[PassContext], PassReport]


def layer_ids(tensors: dict[str, torch.Tensor], prefix: str) -> list[int]:
    """Sorted layer indices i present as `prefix.{i}.*`."""
    ids = {int(k[len(prefix) :].split(".")[0]) for k in tensors if k.startswith(prefix)}
    return sorted(ids)


def require(tensors: dict[str, torch.Tensor], *names: str, pass_name: str) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"graph pass {pass_name!r} needs tensors {missing}: was a pass applied out of order?")
