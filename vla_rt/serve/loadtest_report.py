"""The load test's outputs: JSON (everything), Markdown (the table people read), a latency-vs-robots plot."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vla_rt.serve.admission import UNBOUNDED_MS


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _predicted_ms(value: float | None) -> str:
    """Admission's prediction, which says "unbounded" past the fleet's capacity."""
    return "unbounded" if value is not None and value >= UNBOUNDED_MS else _ms(value)


def _rounds_table(rounds: list[dict[str, Any]]) -> list[str]:
    """One row a round; with the server's cost model, admission's predicted p99 for the robots it admitted."""
    predicted = any(r.get("predicted_p99_ms") is not None for r in rounds)
    extra = (" predicted p99 |", "---|") if predicted else ("", "")
    lines = [
        f"| robots | requests/s | p50 | p90 | p99 |{extra[0]} mean batch | refused | errors |",
        f"|---|---|---|---|---|{extra[1]}---|---|---|",
    ]
    for r in rounds:
        batch = "–" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}"
        guess = f" {_predicted_ms(r.get('predicted_p99_ms'))} |" if predicted else ""
        lines.append(f"| {r['robots']} | {r['requests_per_s']:.1f} | {_ms(r['p50_ms'])} | {_ms(r['p90_ms'])} | "
                     f"{_ms(r['p99_ms'])} |{guess} {batch} | {r['refused']} | {r['errors']} |")  # fmt: skip
    spread = [r for r in rounds if r.get("by_replica")]
    if spread:  # Ray Serve: where the ingress placed the admitted robots
        lines += ["", "Admitted robots per worker replica: " + "; ".join(
            f"{r['robots']} robots: " + ", ".join(f"replica {k} {n}" for k, n in r["by_replica"].items())
            for r in spread) + "."]  # fmt: skip
    return lines


def _compare_table(compare: dict[str, Any]) -> list[str]:
    """The compared schedulers side by side at the robot counts they share (every server admits every robot)."""
    runs = {name: {r["robots"]: r for r in c["rounds"]} for name, c in compare.items()}
    head = " | ".join(f"{name} p50 | {name} p99 | {name} req/s" for name in runs)
    lines = [f"| robots | {head} |", "|---|" + "---|" * (3 * len(runs))]
    for n in sorted(set.intersection(*(set(r) for r in runs.values()))):
        cells = " | ".join(f"{_ms(r[n]['p50_ms'])} | {_ms(r[n]['p99_ms'])} | {r[n]['requests_per_s']:.1f}"
                           for r in runs.values())  # fmt: skip
        lines.append(f"| {n} | {cells} |")
    return lines


def _one_robot(one: dict[str, Any]) -> list[str]:
    t = one.get("server_timing", {})
    parts = ", ".join(f"{k.removesuffix('_ms')} {t[k]:.2f}" for k in ("decode_ms", "prepare_ms", "queue_ms",
                      "prefix_ms", "expert_ms", "finish_ms", "prev_send_ms") if k in t)  # fmt: skip
    if one.get("engine_request_gpu_ms") is None:
        against = f"{one['engine_request_ms']:.1f} ms for the engine's own prefix + steps (start-up cost model)"
    else:
        against = (f"{one['engine_request_gpu_ms']:.1f} ms of GPU time for the engine's own prefix + steps (start-up "
                   f"cost model, CUDA events; {one['engine_request_ms']:.1f} ms on its wall clock)")  # fmt: skip
    return [f"One robot: p50 round trip {one['p50_ms']:.1f} ms against {against}: {one['outside_engine_ms']:+.1f} ms "
            f"outside the engine. The server's own timing fields (medians, ms): {parts}; total in the server "
            f"{t.get('total_ms', float('nan')):.2f}."]  # fmt: skip


def loadtest_markdown(result: dict[str, Any]) -> str:
    s = result["server"]
    slo = f"{s['slo_ms']:g} ms" if s.get("slo_ms") else "each robot's period"
    admission = "on" if s.get("admission", True) else "off"
    lines = [
        f"# `vla-rt loadtest` on {result['device']}",
        "",
        f"`{s.get('checkpoint', '')}` ({s.get('model', 'pi0')}, {s.get('dtype', '')}), profile `{s['profile']}`, "
        f"backend `{s['backend']}`, {s['num_views']} views, prompt {s['prompt_len']}, chunk {s['action_horizon']}, "
        f"scheduler `{s.get('scheduler', 'batch')}`, {s['max_batch']} rows in flight at most, admission {admission} "
        f"(SLO {slo}). Each robot is an `openpi-client` connection sending at {result['rate_hz']:g} Hz for "
        f"{result['seconds']:g} s; latency is the round trip the robot sees, in ms.",
        "",
        *_rounds_table(result["rounds"]),
    ]
    if result.get("one_robot"):
        lines += ["", *_one_robot(result["one_robot"])]
    if result.get("compare"):
        names = ", ".join(f"`--scheduler {name}`" for name in result["compare"])
        lines += ["", f"Schedulers in the same run ({names}), each admitting every robot:", "",
                  *_compare_table(result["compare"])]  # fmt: skip
    if result.get("startup_s"):
        startup = ", ".join(f"{name} {sec:.0f} s" for name, sec in result["startup_s"].items())
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in s.get("startup_s", {}).items())
        lines += ["", f"Server start-up (spawn to healthy): {startup}; the main server's phases: {phases}."]
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
    compare = result.get("compare") or {}
    fig, axes = plt.subplots(1, 2 if compare else 1, figsize=(12 if compare else 6.5, 4), squeeze=False)
    ax = axes[0][0]
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
    ax.set_title(f"{result['server'].get('model', 'pi0')} served to robots at {result['rate_hz']:g} Hz, "
                 f"{result['device']}", fontsize=9)  # fmt: skip
    if compare:
        cx = axes[0][1]
        for name, style in zip(compare, ("-", "--", ":", "-.")):
            done = [r for r in compare[name]["rounds"] if r["p50_ms"] is not None]
            for key, marker in (("p50_ms", "o"), ("p99_ms", "^")):
                cx.plot([r["robots"] for r in done], [r[key] for r in done], marker + style,
                        label=f"{name} {key.split('_')[0]}")  # fmt: skip
        cx.set_xlabel("robots (every robot admitted)")
        cx.set_ylabel("round trip (ms)")
        cx.set_title(" vs ".join(compare) + " scheduling", fontsize=9)
        cx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """loadtest_<device>.json / .md / .png in `out_dir` (the device in the name, as every benchmark file);
    loadtest_pi05_<device>.* for a π0.5 server, beside π0's instead of over it (as `vla-rt bench` names latency)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = (result.get("server") or {}).get("model", "pi0")  # "server" is None until its metadata was read
    stem = "loadtest_" + ("" if model == "pi0" else f"{model}_")
    stem += re.sub(r"[^A-Za-z0-9._-]+", "-", result["device"]).strip("-")
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "plot": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(result, indent=2))
    paths["markdown"].write_text(loadtest_markdown(result))
    plot_latency(result, paths["plot"])
    return paths
