"""Action chunks as the inference thread publishes them and the output thread executes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ActionChunk:
    """A policy output with its schedule: step k is due at `t0 + k * dt` (clock seconds).

    actions: float64 (H, action_dim) in robot units (gripper: 0 open .. 1 closed). frame_seq / t_frame: the frame
    ring entry and capture time of the observation it answers; staleness is judged against t_frame.
    """

    actions: np.ndarray
    t0: float
    dt: float
    frame_seq: int
    t_frame: float
    t_inference_done: float

    @property
    def horizon(self) -> int:
        return int(self.actions.shape[0])

    @property
    def t_end(self) -> float:
        """First time no step of this chunk is due any more."""
        return self.t0 + self.horizon * self.dt

    def step_at(self, t: float) -> int | None:
        """Index of the step due at `t` (the newest with due time <= t), None outside [t0, t_end)."""
        k = math.floor((t - self.t0) / self.dt + 1e-9)  # tolerance: a tick landing exactly on a due time
        return k if 0 <= k < self.horizon else None
