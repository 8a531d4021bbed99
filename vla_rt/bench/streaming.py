"""Streaming benchmark: action-expert calls while the VLM refreshes the KV cache, on two CUDA streams.

Per view count: (a) sequential baseline — one VLM pass then a 10-step chunk on one stream; (b) the same two graphs
launched concurrently on the two streams; (c) single-step expert calls back to back while frames arrive at 30 Hz,
and (d) with the VLM re-run flat out. Reports expert calls per second, their GPU latency (median/p90/p99), the VLM
refresh latency and whether every refresh fit in its 33 ms frame period; writes JSON, Markdown and a timeline plot.

    python -m vla_rt.bench.streaming --views 1 2 3 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vla_rt.bench.latency import device_name
from vla_rt.bench.report import run_dir
from vla_rt.config import preset
from vla_rt.engine.streaming_pi0 import StreamingPi0
from vla_rt.inputs import BuiltShapes
from vla_rt.model import random_weights
from vla_rt.timing import time_calls

FRAME_PERIOD_S = 1 / 30


def _stats(xs) -> dict:
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": int(a.size)}  # fmt: skip


def _frame(cfg, views, device, g):
    s = cfg.vision.image_size
    return (torch.rand(1, views, s, s, 3, generator=g, device=device) * 2 - 1,
            torch.randn(1, cfg.action_dim, generator=g, device=device))  # fmt: skip


def sequential_vs_concurrent(engine: StreamingPi0, iters: int = 30) -> dict:
    """One VLM pass + one 10-step chunk: on one stream one after the other, and on the two streams at once."""
    vlm, expert = engine.vlm_graphs[1], engine.expert_graphs[0]
    seq = time_calls(lambda: (vlm.replay(), expert.replay()), warmup=3, iters=iters, device=engine.device)
    vlm_only = time_calls(vlm.replay, warmup=3, iters=iters, device=engine.device)
    expert_only = time_calls(expert.replay, warmup=3, iters=iters, device=engine.device)
    s_vlm, s_exp = engine.scheduler.vlm_stream, engine.scheduler.expert_stream

    def both() -> None:  # the two graphs on their streams, forked from and joined into the timed one
        cur = torch.cuda.current_stream()
        for s, g in ((s_vlm, vlm), (s_exp, expert)):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                g.replay()
        cur.wait_stream(s_vlm)
        cur.wait_stream(s_exp)

    conc = time_calls(both, warmup=3, iters=iters, device=engine.device)
    return {"sequential_ms": seq.median_ms, "concurrent_ms": conc.median_ms, "concurrent_p90_ms": conc.p90_ms,
            "vlm_alone_ms": vlm_only.median_ms, "chunk10_alone_ms": expert_only.median_ms}  # fmt: skip


def paced_run(engine: StreamingPi0, seconds: float, frame_period_s: float | None, g, max_queue: int = 2) -> dict:
    """Single-step expert calls back to back; frames every `frame_period_s` (None: as fast as the VLM takes them)."""
    cfg, views = engine.cfg, engine.dims.views
    sched = engine.scheduler
    images, state = _frame(cfg, views, engine.device, g)
    engine.submit_observation(images, state, None, t_capture=time.perf_counter())
    engine.wait_ready()
    torch.cuda.synchronize()
    sched.trace = []
    base = torch.cuda.Event(enable_timing=True)
    base.record(torch.cuda.current_stream())
    t0 = time.perf_counter()
    next_frame, frames, calls = t0, 0, 0
    outstanding: list = []
    while time.perf_counter() - t0 < seconds:
        now = time.perf_counter()
        if frame_period_s is None or now >= next_frame:
            engine.submit_observation(images, state, None, t_capture=now)
            frames += 1
            next_frame += frame_period_s or 0.0
        engine.expert_call()
        calls += 1
        outstanding.append(sched.trace[-1][3])
        if len(outstanding) > max_queue:  # bounded queue: wait for our own older call, never for the VLM
            outstanding.pop(0).synchronize()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    trace, sched.trace = sched.trace, None
    spans = [(kind, base.elapsed_time(a), base.elapsed_time(b)) for kind, _, a, b in trace]
    expert = [e - s for k, s, e in spans if k == "expert"]
    vlm = [e - s for k, s, e in spans if k == "vlm"]
    period_ms = (frame_period_s or 0) * 1e3
    return {
        "seconds": wall,
        "frames_submitted": frames,
        "vlm_refreshes": len(vlm),
        "frames_dropped": sched.frames_dropped,
        "expert_calls": calls,
        "expert_calls_per_s": calls / wall,
        "expert_call_ms": _stats(expert),
        "vlm_refresh_ms": _stats(vlm),
        "vlm_within_frame_period": bool(vlm) and period_ms > 0 and max(vlm) <= period_ms,
        "timeline": spans[:4000],
    }


def plot_timeline(spans, path: Path, window_ms: float = 120.0, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s for _, s, _ in spans)
    fig, ax = plt.subplots(figsize=(10, 2.6))
    for row, kind, color in ((1, "vlm", "tab:orange"), (0, "expert", "tab:blue")):
        bars = [(s - t0, e - s) for k, s, e in spans if k == kind and s - t0 < window_ms]
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3)
    ax.set_yticks([0, 1], ["action expert stream\n(1 step / call)", "VLM stream\n(vision + prefix)"])
    ax.set_xlim(0, window_ms)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(views_list, seconds: float, chunk: int, preset_name: str, out: Path, log=print) -> dict:
    device = torch.device("cuda")
    cfg = preset(preset_name)
    weights = random_weights(cfg, seed=0, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    result = {"device": device_name(device), "preset": preset_name, "chunk": chunk, "rows": []}
    for views in views_list:
        shapes = BuiltShapes(views, chunk, None, 1)
        chunked = StreamingPi0(weights, cfg, shapes, device=device, dtype=torch.bfloat16, steps_per_call=10)
        images, state = _frame(cfg, views, device, g)
        chunked.submit_observation(images, state, None, 0.0)
        chunked.wait_ready()
        row = {"views": views, **sequential_vs_concurrent(chunked)}
        del chunked
        stepper = StreamingPi0(weights, cfg, shapes, device=device, dtype=torch.bfloat16, steps_per_call=1)
        row["paced_30hz"] = paced_run(stepper, seconds, FRAME_PERIOD_S, g)
        row["flat_out"] = paced_run(stepper, seconds, None, g)
        plot_timeline(row["paced_30hz"]["timeline"], out / f"streaming_timeline_{views}v_{result['device']}.png",
                      title=f"{views} view(s), frames at 30 Hz: VLM refresh vs single-step expert calls")  # fmt: skip
        for mode in ("paced_30hz", "flat_out"):
            row[mode].pop("timeline")
        log(json.dumps({k: v for k, v in row.items() if k not in ("paced_30hz", "flat_out")}))
        for mode in ("paced_30hz", "flat_out"):
            r = row[mode]
            log(
                f"  {mode}: {r['expert_calls_per_s']:.0f} expert calls/s, call p50 {r['expert_call_ms'].get('median')} "
                f"ms, VLM p50 {r['vlm_refresh_ms'].get('median')} max {r['vlm_refresh_ms'].get('max')} ms"
            )
        result["rows"].append(row)
        del stepper
        torch.cuda.empty_cache()
    return result


def markdown(result: dict) -> str:
    lines = [f"# Streaming π0 on {result['device']} (chunk {result['chunk']}, bf16, random weights)", "",
             "| views | sequential VLM+10 steps ms | concurrent ms | VLM alone | 10 steps alone | 30 Hz: expert calls/s "
             "| call p50/p90/p99 ms | VLM p50/max ms | VLM ≤ 33 ms | flat out: calls/s | VLM p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        p, f = r["paced_30hz"], r["flat_out"]
        c, v = p["expert_call_ms"], p["vlm_refresh_ms"]
        lines.append(
            f"| {r['views']} | {r['sequential_ms']:.2f} | {r['concurrent_ms']:.2f} | {r['vlm_alone_ms']:.2f} | "
            f"{r['chunk10_alone_ms']:.2f} | {p['expert_calls_per_s']:.0f} | {c['median']:.3f}/{c['p90']:.3f}/"
            f"{c['p99']:.3f} | {v.get('median', float('nan')):.2f}/{v.get('max', float('nan')):.2f} | "
            f"{p['vlm_within_frame_period']} | {f['expert_calls_per_s']:.0f} | "
            f"{f['vlm_refresh_ms'].get('median', float('nan')):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--views", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--chunk", type=int, default=63)
    p.add_argument("--preset", default="pi0")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: a new run folder under benchmarks/raw/; benchmarks/results updates the committed summaries)",
    )
    args = p.parse_args()
    args.out = args.out or run_dir("streaming")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.views, args.seconds, args.chunk, args.preset, args.out)
    stem = args.out / f"streaming_{result['device']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
