"""Reaction timeline of one pen-catch trial, from the runtime's event log and the simulator's verdict.

release -> first frame showing the falling pen -> inference done on a frame showing it -> first "close" command
sent -> jaws closed; all in ms after the release. This is what `experiments/pen_catch.py` reports per trial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vla_rt.robot.pen_drop import CatchResult, PenDropConfig
from vla_rt.robot.pen_render import PenViewConfig


def time_pen_enters_view(t_release: float, pen: PenDropConfig, view: PenViewConfig) -> float:
    """When the falling tip crosses the top image row."""
    return t_release + math.sqrt(2 * max(pen.drop_height_m - view.view_top_m, 0.0) / pen.gravity_m_s2)


def reaction_timeline(
    events: Sequence[dict[str, Any]],
    result: CatchResult,
    pen: PenDropConfig | None = None,
    view: PenViewConfig | None = None,
    close_threshold: float = 0.5,
) -> dict[str, float | None]:
    """Milestones in ms after release (None where the trial never got there)."""
    pen, view = pen or PenDropConfig(), view or PenViewConfig()
    t_visible = time_pen_enters_view(result.t_release, pen, view)
    first_frame = next((e for e in events if e["event"] == "frame_captured" and e["t_capture"] >= t_visible), None)
    inference = None
    if first_frame is not None:
        inference = next(
            (e for e in events if e["event"] == "inference_done" and e["frame_seq"] >= first_frame["seq"]), None
        )
    close = next(
        (
            e
            for e in events
            if e["event"] == "command_sent" and e["t"] >= result.t_release and e["target"] >= close_threshold
        ),
        None,
    )

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - result.t_release) * 1000, 1)

    return {
        "release": 0.0,
        "pen_enters_view": ms(t_visible),
        "first_frame_showing_pen": ms(first_frame["t_capture"]) if first_frame else None,
        "frame_arrived": ms(first_frame["t_arrival"]) if first_frame else None,
        "inference_done": ms(inference["t"]) if inference else None,
        "close_command_sent": ms(close["t"]) if close else None,
        "jaws_closed": ms(result.t_closed),
    }
