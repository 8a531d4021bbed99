"""The reaction-timeline plot of an evaluation: one row a trial, the milestones of each drop in ms, and (simulation)
the window in which closed jaws catch the pen. Drawn on a bare `Figure` (no pyplot): the caller's matplotlib backend
is left alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

MILESTONES = {  # timeline key -> (label, marker, colour)
    "first_frame_showing_pen": ("first frame showing the pen (capture)", "o", "tab:blue"),
    "frame_arrived": ("that frame arrives (camera latency)", "s", "tab:cyan"),
    "inference_done": ("π0 inference done", "D", "tab:purple"),
    "close_command_sent": ("close command sent", "v", "tab:red"),
    "jaws_closed": ("jaws closed", "*", "black"),
    "frame_captured": ("frame that triggered the close (capture)", "o", "tab:blue"),
}


def plot_timelines(trials: list[dict[str, Any]], path: Path, title: str) -> None:
    fig = Figure(figsize=(9, 0.45 * len(trials) + 1.8))
    ax = fig.subplots()
    shown: set[str] = set()
    for row, trial in enumerate(trials):
        window = trial.get("jaws_closed_window_ms")
        if window:
            ax.barh(row, window[1] - window[0], left=window[0], height=0.6, color="tab:green", alpha=0.18)
        for key, value in trial["timeline_ms"].items():
            if key in MILESTONES and value is not None:
                label, marker, colour = MILESTONES[key]
                ax.plot(value, row, marker, color=colour, label=None if key in shown else label)
                shown.add(key)
        ax.text(1.005, row, trial["reason"], transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    handles, _ = ax.get_legend_handles_labels()
    if any(t.get("jaws_closed_window_ms") for t in trials):
        ax.axvline(0, color="grey", lw=0.8)
        handles.append(Patch(color="tab:green", alpha=0.18, label="jaws closed in this window: caught"))
    ax.set_yticks(range(len(trials)), [f"trial {i}" for i in range(len(trials))])
    ax.invert_yaxis()
    x_label = "ms after release" if any(t.get("jaws_closed_window_ms") for t in trials) else "ms after trial start"
    ax.set(xlabel=x_label, title=title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.09, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
