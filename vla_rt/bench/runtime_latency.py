"""Frame-to-command latency of the real-time runtime with a full-size π0 in the loop.

The pen-drop rig (simulated 30 FPS camera with its 2-frame pipeline latency, SimGripper on a pty driven by the real
SerialGripper) runs in wall-clock time; the inference thread calls `Pi0Policy` on `backend` (triton on CUDA,
random π0 weights); every event goes to the log, from which we read, per action chunk: frame capture → frame
arrival → inference start/done → first command sent from that chunk.

    python -m vla_rt.bench.runtime_latency --views 1 2 --seconds 6
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from vla_rt.bench.latency import device_name
from vla_rt.bench.report import run_dir
from vla_rt.inference import load_pi0
from vla_rt.policy import Pi0Policy

ROBOT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "robot" / "sim.yaml"


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "n": int(a.size)}  # fmt: skip


def latencies_from_events(events: list[dict]) -> dict[str, dict[str, float]]:
    """Per chunk: frame age at inference start, inference time, frame→command and arrival→command (ms)."""
    frames = {e["seq"]: e for e in events if e["event"] == "frame_captured"}
    chunks = {e["seq"]: e["frame_seq"] for e in events if e["event"] == "chunk_written"}
    first_cmd: dict[int, float] = {}
    for e in events:
        if e["event"] == "command_sent" and e.get("source") == "chunk" and e["chunk_seq"] not in first_cmd:
            first_cmd[e["chunk_seq"]] = e["t"]
    to_cmd, arrival_to_cmd = [], []
    for chunk_seq, t_cmd in first_cmd.items():
        frame = frames.get(chunks.get(chunk_seq))
        if frame is not None:
            to_cmd.append((t_cmd - frame["t_capture"]) * 1e3)
            arrival_to_cmd.append((t_cmd - frame["t_arrival"]) * 1e3)
    starts = [e["frame_age_ms"] for e in events if e["event"] == "inference_start"]
    done = [e for e in events if e["event"] == "inference_done"]
    return {
        "frame_to_command_ms": _stats(to_cmd),
        "arrival_to_command_ms": _stats(arrival_to_cmd),
        "frame_age_at_inference_start_ms": _stats(starts),
        "inference_wall_ms": _stats([e["wall_ms"] for e in done]),
        "policy_model_ms": _stats([e["policy_timing"].get("model_ms", float("nan")) for e in done]),
    }


def run_runtime(views: int, seconds: float, backend: str, preset: str, device: str, seed: int = 0) -> dict:
    from vla_rt.clock import MonotonicClock
    from vla_rt.robot.factory import build_sim_pen_rig as build_rig
    from vla_rt.runtime.events import load_events
    from vla_rt.runtime.runtime import Runtime, RuntimeConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_pi0(f"random:{preset}:{seed}", backend=backend, device=device, dtype=dtype, num_views=views, chunk=50)
    policy = Pi0Policy(model, camera_names=tuple(f"cam{i}" for i in range(views)), action_dim=1, seed=seed)
    clock = MonotonicClock()
    robot = yaml.safe_load(ROBOT_CONFIG.read_text())
    rig = build_rig(robot, clock, seed)
    rig.sim.reset(clock.now())
    cfg = RuntimeConfig(views=[("cam", -i) for i in range(views)], action_time_origin="inference_done",
                        dt_action_s=0.02)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "events.jsonl"
        runtime = Runtime(rig.camera, policy, rig.gripper, clock, cfg, log_path).start()
        clock.sleep_until(clock.now() + seconds)
        counters = runtime.stop()
        events = load_events(log_path)
    rig.close()
    return {"views": views, "backend": backend, "preset": preset, "seconds": seconds, "counters": counters,
            **latencies_from_events(events)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--views", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--backend", default=None, help="default: triton on CUDA, folded on CPU")
    p.add_argument("--preset", default=None, help="default: pi0 on CUDA, tiny on CPU")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: a new run folder under benchmarks/raw/; benchmarks/results updates the committed summaries)",
    )
    args = p.parse_args()
    args.out = args.out or run_dir("runtime_latency")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    backend = args.backend or ("triton" if cuda else "folded")
    preset = args.preset or ("pi0" if cuda else "tiny")
    rows = [run_runtime(v, args.seconds, backend, preset, device) for v in args.views]
    result = {"device": device_name(torch.device(device)), "rows": rows,
              "note": "wall-clock run; simulated 30 FPS camera with 2 frames of pipeline latency"}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"runtime_latency_{result['device']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    print(f"{'views':>5} {'frame→cmd med':>14} {'p90':>8} {'arrival→cmd med':>16} {'infer med':>10} {'chunks':>7}")
    for r in rows:
        f, a, i = r["frame_to_command_ms"], r["arrival_to_command_ms"], r["inference_wall_ms"]
        print(
            f"{r['views']:>5} {f.get('median', float('nan')):>14.1f} {f.get('p90', float('nan')):>8.1f} "
            f"{a.get('median', float('nan')):>16.1f} {i.get('median', float('nan')):>10.1f} {f.get('n', 0):>7}"
        )


if __name__ == "__main__":
    main()
