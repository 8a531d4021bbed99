"""Preallocated scratch memory for the kernels that split a reduction across programs.

Split-K GEMM and split-KV attention write fp32 partial results to a float buffer and count arrivals per output
tile in an int32 counter; the last program to arrive reduces the partials in a fixed order (so results are
deterministic) and resets its counter to zero (so the next launch, or the next CUDA Graph replay, starts clean).

Nothing here allocates during a CUDA Graph capture: a `Workspace` grows only outside capture (warm-up runs size
it), and asking a capturing launch for more than it holds raises instead of allocating from the graph's pool.
Kernels that share a workspace must run in order on one stream; give every concurrent stream its own.
"""

from __future__ import annotations

import torch

__all__ = ["Workspace", "default_workspace"]


class Workspace:
    """fp32 scratch floats plus zero-initialised int32 arrival counters on one device."""

    def __init__(self, device: torch.device | str, num_floats: int = 0, num_counters: int = 0) -> None:
        self.device = torch.device(device)
        self._floats = torch.empty(0, dtype=torch.float32, device=self.device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._retired: list[torch.Tensor] = []
        self.reserve(num_floats, num_counters)

    def reserve(self, num_floats: int, num_counters: int) -> None:
        """Grow (never shrink) to hold at least `num_floats` floats and `num_counters` counters."""
        grow_f = num_floats > self._floats.numel()
        grow_c = num_counters > self._counters.numel()
        if not (grow_f or grow_c):
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"workspace on {self.device} holds {self._floats.numel()} floats / {self._counters.numel()} counters "
                f"but a launch under CUDA Graph capture needs {num_floats} / {num_counters}: run the plan once "
                "before capturing (warm-up sizes the workspace) or pass a Workspace reserved for it"
            )
        # Outgrown buffers stay alive: a CUDA Graph captured earlier still points at them.
        if grow_f:
            self._retired.append(self._floats)
            self._floats = torch.empty(num_floats, dtype=torch.float32, device=self.device)
        if grow_c:
            self._retired.append(self._counters)
            self._counters = torch.zeros(num_counters, dtype=torch.int32, device=self.device)

    def floats(self, n: int) -> torch.Tensor:
        """The first `n` scratch floats (contents undefined)."""
        self.reserve(n, 0)
        return self._floats[:n] if n else self._floats

    def counters(self, n: int) -> torch.Tensor:
        """The first `n` counters; every kernel leaves the counters it used at zero."""
        self.reserve(0, n)
        return self._counters[:n] if n else self._counters

    @property
    def nbytes(self) -> int:
        return self._floats.numel() * 4 + self._counters.numel() * 4


_DEFAULT: dict[torch.device, Workspace] = {}


def default_workspace(device: torch.device | str) -> Workspace:
    """One shared workspace per device, for callers on a single stream."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _DEFAULT.get(device)
    if ws is None:
        ws = _DEFAULT[device] = Workspace(device)
    return ws
