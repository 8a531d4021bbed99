"""Renders the image the policy sees in the pen-drop simulation.

A fixed side-on camera frames the lower gripper (base, two fingers with rubber pads) and the space above it up to
just below the pen's hanging tip, so the pen is invisible while held and enters from the top edge as it falls; the
upper gripper is out of view. Shapes are axis-aligned rectangles drawn with exact area coverage (anti-aliased), so
a millimetre of motion changes pixel values smoothly, as on a real sensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_rt.robot.pen_drop import PenDropConfig, PenState

BACKGROUND_TOP = (206, 200, 188)
BACKGROUND_BOTTOM = (168, 162, 150)
GRIPPER_BODY = (60, 62, 70)
FINGER = (95, 98, 108)
PAD = (200, 90, 40)
PEN_BODY = (30, 70, 190)
PEN_TIP = (20, 20, 30)


@dataclass
class PenViewConfig:
    image_size: int = 224  # square images, uint8 RGB
    view_top_m: float = 0.295  # z of the top image row: 5 mm below the hanging pen's tip
    view_bottom_m: float = -0.050
    finger_width_m: float = 0.015
    body_top_m: float = -0.025  # gripper body below the fingers
    body_half_width_m: float = 0.055
    tip_length_m: float = 0.012


class PenRenderer:
    """Scene state -> uint8 (S, S, 3) RGB image. Stateless apart from a cached background."""

    def __init__(self, view: PenViewConfig | None = None, pen: PenDropConfig | None = None) -> None:
        self.view = view or PenViewConfig()
        self.pen = pen or PenDropConfig()
        v = self.view
        self.size = v.image_size
        self.m_per_px = (v.view_top_m - v.view_bottom_m) / self.size
        column = np.linspace(0.0, 1.0, self.size)[:, None, None]
        top, bottom = np.array(BACKGROUND_TOP, float), np.array(BACKGROUND_BOTTOM, float)
        self._background = np.broadcast_to(top + (bottom - top) * column, (self.size, self.size, 3)).astype(np.float32)

    def to_pixels(self, x_m: float, z_m: float) -> tuple[float, float]:
        """(column, row) in pixels, fractional, for a scene point."""
        col = x_m / self.m_per_px + self.size / 2
        row = (self.view.view_top_m - z_m) / self.m_per_px
        return col, row

    def render(self, pen: PenState, jaw_position: float) -> np.ndarray:
        v, p = self.view, self.pen
        image = self._background.copy()
        half_pad = p.jaw_pad_height_m / 2
        gap = p.jaw_open_gap_m * (1.0 - min(max(jaw_position, 0.0), 1.0))
        if pen.phase == "caught":
            gap = max(gap, p.pen_diameter_m)  # the jaws stop on the pen
        self._rect(image, -v.body_half_width_m, v.body_half_width_m, v.view_bottom_m, v.body_top_m, GRIPPER_BODY)
        for side in (-1.0, 1.0):
            inner = side * gap / 2
            outer = side * (gap / 2 + v.finger_width_m)
            x0, x1 = min(inner, outer), max(inner, outer)
            self._rect(image, x0, x1, v.body_top_m, half_pad, FINGER)
            pad_x0, pad_x1 = (x1 - 0.004, x1) if side < 0 else (x0, x0 + 0.004)
            self._rect(image, pad_x0, pad_x1, -half_pad, half_pad, PAD)
        x0, x1 = pen.x - p.pen_diameter_m / 2, pen.x + p.pen_diameter_m / 2
        self._rect(image, x0, x1, pen.tip_z + v.tip_length_m, pen.tip_z + p.pen_length_m, PEN_BODY)
        self._rect(image, x0, x1, pen.tip_z, pen.tip_z + v.tip_length_m, PEN_TIP)
        return np.clip(image + 0.5, 0, 255).astype(np.uint8)

    def _rect(self, image: np.ndarray, x0: float, x1: float, z0: float, z1: float, color: tuple[int, int, int]) -> None:
        """Blend an axis-aligned rectangle [x0,x1] x [z0,z1] (metres) with per-pixel area coverage."""
        c0, r1 = self.to_pixels(x0, z0)
        c1, r0 = self.to_pixels(x1, z1)
        cov_cols, col_start = _coverage(c0, c1, self.size)
        cov_rows, row_start = _coverage(r0, r1, self.size)
        if cov_cols.size == 0 or cov_rows.size == 0:
            return
        alpha = (cov_rows[:, None] * cov_cols[None, :])[..., None]
        region = image[row_start : row_start + cov_rows.size, col_start : col_start + cov_cols.size]
        region += alpha * (np.asarray(color, np.float32) - region)


def _coverage(a: float, b: float, n: int) -> tuple[np.ndarray, int]:
    """Fraction of each pixel [i, i+1) covered by [a, b], for the pixels it touches inside [0, n)."""
    lo, hi = max(int(np.floor(a)), 0), min(int(np.ceil(b)), n)
    if hi <= lo or b <= a:
        return np.zeros(0, np.float32), 0
    edges = np.arange(lo, hi, dtype=np.float32)
    cover = np.minimum(edges + 1, b) - np.maximum(edges, a)
    return np.clip(cover, 0.0, 1.0).astype(np.float32), lo
