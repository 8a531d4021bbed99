"""The round trip a robot pays with no model at all: the fleet test's robot against a server that only decodes.

Why: issue 26 asks the one-robot p50 to stay within 3 ms of the engine call, and the fleet test's margin (+1.7 to
+4.2 ms on the H200 across runs) holds the websocket transport of a 2-view observation (~300 KB of uint8 images)
both ways, which no change to the engine or the scheduler can recover. This tool measures that floor on the same
host, so the margin splits into transport and the server's own host work:

- a server process: websockets' asyncio server with `vla-rt serve`'s settings (no compression, the same message
  cap), openpi's metadata for the profile, and per request `wire.unpack_observation` (the server's own decoder) and
  an all-zero action chunk packed by `wire.pack`;
- the robot: `vla_rt.serve.loadtest.run_robot`, the fleet test's own openpi-client robot, at `--rate` Hz with the
  observations the fleet test sends for that metadata.

    python tools/transport_floor.py [--profile generic --views 2 --prompt-len 20 --chunk 50 --seconds 10]

Prints the p50 / p90 / p99 round trip, ms; `--json` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from vla_rt.serve.loadtest import run_robot
from vla_rt.serve.wire import pack, unpack_observation

MAX_MESSAGE_BYTES = 64 * 2**20  # `vla-rt serve --max-message-mb` default


def metadata(profile: str, views: int, prompt_len: int, chunk: int, action_dim: int, state_dim: int) -> dict:
    """What `run_robot` reads from a vla-rt server's metadata to build the fleet test's observations."""
    return {"server": "transport-floor", "profile": profile, "num_views": views, "prompt_len": prompt_len,
            "vocab_size": 257152, "text_prompts": False, "action_horizon": chunk, "action_dim": action_dim,
            "state_dim": state_dim}  # fmt: skip


def serve(port: mp.Value, ready, meta: dict) -> None:
    """The decode-only server (a child process, as `vla-rt serve` is to the fleet test's robots)."""
    from websockets.asyncio.server import serve as ws_serve

    actions = np.zeros((meta["action_horizon"], meta["action_dim"]), np.float32)

    async def handler(ws) -> None:
        await ws.send(pack(meta))
        async for frame in ws:
            t0 = time.perf_counter()
            unpack_observation(frame)
            await ws.send(pack({"actions": actions, "server_timing": {"decode_ms": (time.perf_counter() - t0) * 1e3}}))

    async def main() -> None:
        async with ws_serve(handler, "127.0.0.1", 0, compression=None, max_size=MAX_MESSAGE_BYTES) as server:
            port.value = server.sockets[0].getsockname()[1]
            ready.set()
            await asyncio.Future()

    asyncio.run(main())


def measure(meta: dict, rate_hz: float, seconds: float) -> dict:
    """One robot against the decode-only server for `seconds`: the round trips (ms), warm-up (the first second)
    left out."""
    ctx = mp.get_context("spawn")
    port, ready = ctx.Value("i", 0), ctx.Event()
    server = ctx.Process(target=serve, args=(port, ready, meta), daemon=True)
    server.start()
    try:
        if not ready.wait(30):
            raise SystemExit("transport_floor: the server process did not start within 30 s")
        run = run_robot(f"ws://127.0.0.1:{port.value}", 0, rate_hz, time.monotonic() + seconds)
    finally:
        server.terminate()
        server.join(5)
    if run.errors or run.refused:
        raise SystemExit(f"transport_floor: the robot failed: {run.refused or run.errors[:3]}")
    warm = int(rate_hz)  # the first second: connection and allocator warm-up
    ms = run.latencies_ms[warm:] or run.latencies_ms
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    decode = statistics.median(t.get("decode_ms", 0.0) for t in run.server_timing)
    return {"requests": len(ms), "p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99),
            "server_decode_ms": decode, "rate_hz": rate_hz, "metadata": meta}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="generic")
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--action-dim", type=int, default=32)
    p.add_argument("--state-dim", type=int, default=8)
    p.add_argument("--rate", type=float, default=10.0, help="requests a second (the fleet test's robots: 10)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    a = p.parse_args(argv)
    for name in ("views", "prompt_len", "chunk", "action_dim", "state_dim"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected at least 1, found {getattr(a, name)}")
    if not (a.rate > 0 and a.seconds > 0):
        p.error(f"--rate and --seconds: expected positive numbers, found {a.rate} and {a.seconds}")
    meta = metadata(a.profile, a.views, a.prompt_len, a.chunk, a.action_dim, a.state_dim)
    r = measure(meta, a.rate, a.seconds)
    print(f"transport floor ({a.profile}, {a.views} views, one robot at {a.rate:g} Hz, {r['requests']} requests): "
          f"p50 {r['p50_ms']:.2f} ms, p90 {r['p90_ms']:.2f}, p99 {r['p99_ms']:.2f}; the server's decode "
          f"{r['server_decode_ms']:.2f} ms of it")  # fmt: skip
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
