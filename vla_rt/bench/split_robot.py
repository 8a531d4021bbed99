"""The split benchmark's robot: a minimal openpi-protocol client driving a server at a fixed rate.

It runs in a process of its own (`drive_process`), as a robot does: in the server's process its socket reads,
msgpack decoding and sleeps would share that process's interpreter with the answers it times. The answers come back
as JSON lines on stdout; times are `time.monotonic()`, which on Linux is one clock for every process of a machine,
so they line up with the server's events.

    python -m vla_rt.bench.split_robot --port 8000 --image-size 224 --views 2 --prompt 20 --rate 50 --seconds 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
from websockets.sync.client import connect

from vla_rt.serve.wire import pack, unpack_observation


class Robot:
    """A minimal openpi-protocol client (msgpack over a websocket; the GPU image has no openpi-client)."""

    def __init__(self, port: int):
        self.ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=30).__enter__()
        self.metadata = unpack_observation(self.ws.recv(timeout=30))

    def infer(self, obs: dict) -> dict:
        self.ws.send(pack(obs))
        answer = self.ws.recv(timeout=30)
        if isinstance(answer, str):
            raise RuntimeError(answer)
        return unpack_observation(answer)

    def close(self) -> None:
        self.ws.close()


def observations(n: int, image_size: int, views: int, prompt: int, seed: int, state_dim: int = 8) -> list[dict]:
    rng = np.random.default_rng(seed)
    names = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")[:views]
    return [{"images": {v: rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8) for v in names},
             "state": rng.uniform(-1, 1, state_dim), "tokenized_prompt": rng.integers(1, 1000, prompt)} for _ in range(n)]  # fmt: skip


def drive(port: int, frames: list[dict], rate_hz: float, seconds: float) -> list[dict]:
    """Requests at `rate_hz` for `seconds` (a new observation each); every answer with its client-side times."""
    robot, out = Robot(port), []
    start = next_at = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        t0 = time.monotonic()
        try:
            a = robot.infer(frames[i % len(frames)])
            out.append({"t_send": t0, "t_recv": time.monotonic(), **{k: a[k] for k in a if k != "actions"}})
        except RuntimeError as e:
            out.append({"t_send": t0, "t_recv": time.monotonic(), "error": str(e)[:300]})
            robot = Robot(port)
        i += 1
        next_at += 1 / rate_hz
        time.sleep(max(0.0, next_at - time.monotonic()))
    robot.close()
    return out


def drive_process(port: int, *, image_size: int, views: int, prompt: int, state_dim: int, rate_hz: float,
                  seconds: float, frames: int = 32, seed: int = 1, warmup_s: float = 0.0) -> list[dict]:  # fmt: skip
    """`drive` in a robot process of its own over `observations(frames, ..., seed)`; its answers. `warmup_s`: first
    drive that long and drop those answers (first connections, first copies)."""
    command = [sys.executable, "-m", "vla_rt.bench.split_robot", "--port", str(port), "--image-size", str(image_size),
               "--views", str(views), "--prompt", str(prompt), "--state-dim", str(state_dim), "--rate", str(rate_hz),
               "--seconds", str(seconds), "--frames", str(frames), "--seed", str(seed), "--warmup", str(warmup_s)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + warmup_s + 120)
    if done.returncode != 0:
        raise RuntimeError(f"the robot process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--image-size", type=int, required=True)
    p.add_argument("--views", type=int, required=True)
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--state-dim", type=int, default=8)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup", type=float, default=0.0)
    args = p.parse_args(argv)
    frames = observations(args.frames, args.image_size, args.views, args.prompt, args.seed, args.state_dim)
    if args.warmup > 0:
        drive(args.port, frames[:2], args.rate, args.warmup)
    for answer in drive(args.port, frames, args.rate, args.seconds):
        print(json.dumps(answer, default=lambda o: o.item() if hasattr(o, "item") else str(o)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
