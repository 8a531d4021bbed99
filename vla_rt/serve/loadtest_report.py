"""The load test's outputs: JSON (everything), Markdown (the table people read), a latency-vs-robots plot."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def loadtest_markdown(result: dict[str, Any]) -> str:
    s = result["server"]
    slo = f"{s['slo_ms']:g} ms" if s.get("slo_ms") else "none"
    lines = [
        f"# `vla-rt loadtest` on {result['device']}",
        "",
        f"`{s.get('checkpoint', '')}` ({s.get('dtype', '')}), profile `{s['profile']}`, backend `{s['backend']}`, "
        f"{s['num_views']} views, prompt {s['prompt_len']}, chunk {s['action_horizon']}, max batch {s['max_batch']}, "
        f"SLO {slo}. Each robot is "
        f"an `openpi-client` connection sending at {result['rate_hz']:g} Hz for {result['seconds']:g} s; latency is "
        "the round trip the robot sees (send, queue, batch, answer), in ms.",
        "",
        "| robots | requests/s | p50 | p90 | p99 | mean batch | refused | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        batch = "–" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}"
        lines.append(f"| {r['robots']} | {r['requests_per_s']:.1f} | {_ms(r['p50_ms'])} | {_ms(r['p90_ms'])} | "
                     f"{_ms(r['p99_ms'])} | {batch} | {r['refused']} | {r['errors']} |")  # fmt: skip
    largest = max(result["rounds"], key=lambda r: r["robots"])
    lines += ["", f"Per robot, {largest['robots']} robots:", "", "| robot | requests/s | p50 | p90 | p99 | note |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in largest["per_robot"]:
        note = r["refused"] or "; ".join(r["errors"])[:120]
        lines.append(f"| {r['robot']} | {r['requests_per_s']:.1f} | {_ms(r['p50_ms'])} | {_ms(r['p90_ms'])} | "
                     f"{_ms(r['p99_ms'])} | {note} |")  # fmt: skip
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def plot_latency(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r for r in result["rounds"] if r["p50_ms"] is not None]
    robots = [r["robots"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, style in (("p50_ms", "o-"), ("p90_ms", "s--"), ("p99_ms", "^-")):
        ax.plot(robots, [r[key] for r in rounds], style, label=key.split("_")[0])
    if result["server"].get("slo_ms"):
        ax.axhline(result["server"]["slo_ms"], color="gray", linestyle=":", label="SLO")
    ax.set_xlabel("robots")
    ax.set_ylabel("round trip (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(robots, [str(n) for n in robots])
    twin = ax.twinx()
    twin.plot(robots, [r["requests_per_s"] for r in rounds], "k.:", label="requests/s")
    twin.set_ylabel("requests/s")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    ax.set_title(f"π0 served to robots at {result['rate_hz']:g} Hz, {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """loadtest_<device>.json / .md / .png in `out_dir` (the device in the name, as every benchmark file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "loadtest_" + re.sub(r"[^A-Za-z0-9._-]+", "-", result["device"]).strip("-")
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "plot": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(result, indent=2))
    paths["markdown"].write_text(loadtest_markdown(result))
    plot_latency(result, paths["plot"])
    return paths
