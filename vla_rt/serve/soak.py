"""A soak test of `vla-rt serve`: many real openpi-client robots for a long time, the server's memory sampled.

    python -m vla_rt.serve.soak --minutes 30 --robots 16 --rate 10 --out benchmarks/results    # the full soak
    python -m vla_rt.serve.soak --minutes 0.3 --sample-s 4                                      # a short one (tests)

It starts `vla-rt serve` in a child process (by default on a tiny π0 written to a temporary native checkpoint: 56 px
views, so a 2-core CPU keeps up with 16 robots), runs `--robots` robots at `--rate` Hz over loopback for
`--minutes`, and every `--sample-s` seconds records the server's resident memory (VmRSS of its process) and how
many answers each robot got. It passes when there were no errors and no refusals, every robot was answered in
every sample window, and the memory stayed flat: every sample after the first (start-up and warm-up) within
`--rss-tolerance` (5%) of the first. JSON + Markdown go to `--out` (soak_<device>.json / .md); exit code 1 when a
check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from vla_rt.arguments import check_out_dir
from vla_rt.checkpoints import check_destination
from vla_rt.errors import ArgumentError
from vla_rt.serve.loadtest import RobotRun, run_robot
from vla_rt.serve.loadtest_run import ServerProcess, free_port, server_argv, wait_idle

SERVER_FLAGS = ["--profile", "generic", "--num-views", "1", "--prompt-len", "8", "--chunk", "10", "--max-batch", "16"]


def tiny_checkpoint(folder: Path) -> Path:
    """The tiny preset with 56 px views and random weights, as a native file (what the serving tests serve)."""
    from dataclasses import replace

    from vla_rt.checkpoints.native import save_native
    from vla_rt.config import preset
    from vla_rt.model import random_weights

    cfg = preset("tiny")
    cfg = cfg.replace(vision=replace(cfg.vision, image_size=56))
    return save_native(folder / "tiny56.safetensors", random_weights(cfg, seed=0), cfg, source="soak")


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux /proc)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 1024


def evaluate(samples: list[dict[str, Any]], runs: list[RobotRun], rss_tolerance: float) -> dict[str, Any]:
    """The soak's checks from the samples (t, rss_mb, answers per robot so far) and the robots' runs."""
    errors = sum(len(r.errors) for r in runs)
    refused = sum(r.refused is not None for r in runs)
    windows = []  # answers per robot in each window between samples
    for before, after in zip(samples, samples[1:]):
        windows.append([a - b for a, b in zip(after["answers"], before["answers"])])
    starved = [(i, robot) for i, w in enumerate(windows) for robot, n in enumerate(w) if n == 0]
    base = samples[0]["rss_mb"]
    drift = max(abs(s["rss_mb"] - base) / base for s in samples) if samples else 0.0
    checks = {
        "no_errors": errors == 0,
        "no_refusals": refused == 0,
        "every_robot_answered_in_every_window": bool(windows) and not starved,
        "rss_flat": drift <= rss_tolerance,
    }
    return {"checks": checks, "passed": all(checks.values()), "errors": errors, "refused": refused,
            "starved_windows": starved, "rss_drift": drift,
            "answers_per_window": {"min": int(np.min(windows)) if windows else 0,
                                   "max": int(np.max(windows)) if windows else 0}}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    v = result["verdict"]
    lines = [
        f"# `vla-rt serve` soak on {result['device']}",
        "",
        f"{result['robots']} `openpi-client` robots at {result['rate_hz']:g} Hz over loopback for "
        f"{result['minutes']:g} minutes against `{result['server_command']}`; the server's resident memory "
        f"sampled every {result['sample_s']:g} s.",
        "",
        f"- **{'passed' if v['passed'] else 'FAILED'}**: "
        + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in v["checks"].items()),  # fmt: skip
        f"- answers: {result['answers']} ({result['answers'] / (60 * result['minutes']):.1f} per second), errors "
        f"{v['errors']}, refused {v['refused']}; per robot and window {v['answers_per_window']['min']}–"
        f"{v['answers_per_window']['max']} answers",
        f"- round trip: p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms",
        f"- RSS: first sample {result['samples'][0]['rss_mb']:.1f} MiB, largest drift from it "
        f"{100 * v['rss_drift']:.2f}% (tolerance {100 * result['rss_tolerance']:g}%)",
        "",
        "| minute | RSS MiB | answers in the window (min–max per robot) |",
        "|---|---|---|",
    ]
    for before, after in zip([None, *result["samples"]], result["samples"]):
        w = [
            a - (b if before else 0)
            for a, b in zip(after["answers"], before["answers"] if before else after["answers"])
        ]
        span = f"{min(w)}–{max(w)}" if before else "(first sample)"
        lines.append(f"| {after['t_s'] / 60:.1f} | {after['rss_mb']:.1f} | {span} |")
    return "\n".join(lines) + "\n"


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or str(tiny_checkpoint(Path(tmp)))
        host, port = "127.0.0.1", free_port("127.0.0.1")
        argv = server_argv(checkpoint, host, port, [*SERVER_FLAGS, *args.server_flags])
        log_path = args.log or args.out / "soak_server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with ServerProcess(argv, host, port, log_path, timeout=300) as server:
            wait_idle(host, port, None)
            start = time.monotonic()
            until = start + 60 * args.minutes
            runs = [RobotRun(i) for i in range(args.robots)]  # filled live by the robots' threads

            def robot(i: int) -> None:
                run_robot(f"ws://{host}:{port}/?hz={args.rate:g}", i, args.rate, until, image_size=56, run=runs[i])

            threads = [threading.Thread(target=robot, args=(i,), daemon=True) for i in range(args.robots)]
            for t in threads:
                t.start()
            samples = []
            next_sample = start + args.sample_s
            while time.monotonic() < until:
                time.sleep(max(0.0, min(next_sample, until) - time.monotonic()))
                if time.monotonic() >= next_sample or time.monotonic() >= until:
                    now = time.monotonic()
                    answers = [len(r.answered_at) for r in runs]  # (appended by the robots' threads: a count)
                    samples.append({"t_s": now - start, "rss_mb": rss_mb(server.process.pid), "answers": answers})
                    print(f"[{(now - start) / 60:5.1f} min] server RSS {samples[-1]['rss_mb']:.1f} MiB, answers "
                          f"{sum(answers)}", flush=True)  # fmt: skip
                    next_sample += args.sample_s
            for t in threads:
                t.join(60)
        done = runs
    latencies = [x for r in done for x in r.latencies_ms]
    return {
        "device": f"CPU {platform.processor() or platform.machine()}".strip(),
        "robots": args.robots, "rate_hz": args.rate, "minutes": args.minutes, "sample_s": args.sample_s,
        "rss_tolerance": args.rss_tolerance, "server_command": " ".join(["vla-rt", *argv[3:]]),
        "answers": len(latencies), "p50_ms": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if latencies else float("nan"),
        "samples": samples, "errors": [e for r in done for e in r.errors][:20],
        "verdict": evaluate(samples, done, args.rss_tolerance),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vla_rt.serve.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--robots", type=int, default=16)
    p.add_argument("--rate", type=float, default=10.0, help="requests per second per robot")
    p.add_argument("--sample-s", type=float, default=60.0, help="seconds between memory samples")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--checkpoint", help="what the server serves (default: a tiny π0 with 56 px views)")
    p.add_argument("--out", type=Path, default=Path("runs/soak"), help="where soak_<device>.json / .md go")
    p.add_argument("--log", type=Path, help="the server's log (default: soak_server.log in --out)")
    p.add_argument("server_flags", nargs=argparse.REMAINDER, help="more `vla-rt serve` flags, after --")
    args = p.parse_args(argv)
    args.server_flags = [f for f in args.server_flags if f != "--"]
    if not (args.minutes > 0 and args.robots > 0 and args.rate > 0 and 0 < args.sample_s <= 60 * args.minutes):
        p.error("expected --minutes, --robots, --rate > 0 and 0 < --sample-s <= the soak's length")
    if not 0 <= args.rss_tolerance < math.inf:  # nan or < 0: the memory check would fail whatever the server did
        p.error(f"--rss-tolerance: expected a finite fraction >= 0 (0.05: 5%), found {args.rss_tolerance}")
    try:  # now, not as a traceback (--out) or after the server started (--log)
        check_out_dir(args.out, "--out")
        if args.log is not None:
            check_destination(args.log, "--log")
    except ArgumentError as e:
        p.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_soak(args)
    stem = "soak_" + re.sub(r"[^A-Za-z0-9._-]+", "-", result["device"]).strip("-")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
