"""The robot-side expert's KV receive path, part by part, for a π0-sized KV on this machine (a CPU is enough).

The split's request → actions target is one expert chunk; whatever the expert does with an arriving KV version
(decoding chunk frames, assembling them, copying the whole version into a slot) must not sit in front of an answer.
This times each part for π0's KV dims (18 layers, 1 KV head of 256, 2 views + prompt 20 = 532 keys, 9.8 MB bf16)
with an expert engine of those KV dims and tiny widths (its weights do not matter to the receive path):

    python tools/split_receive.py                      # bf16 and fp8 on the wire, engine in float32 on the CPU
    python tools/split_receive.py --engine-dtype bfloat16
    python tools/split_receive.py --robot-seconds 20 --rate 20

Prints one line per part (median ms over --repeats) and the sum. With --robot-seconds, then the whole robot side:
the prefix server as a child process (`vla-rt serve --role prefix`), the expert role here, a robot at --rate, each
KV format over loopback, on `wide_kv_config` (3 views: a 25.7 MB float32 KV whose import costs about half a chunk
on a CPU). It prints request → actions p50 / p99, and the span of the local chunks that overlapped an install
against those that did not: an answer that waits for an install shows up as the difference.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import torch

from vla_rt import preset
from vla_rt.checkpoints.native import save_native
from vla_rt.config import GemmaConfig
from vla_rt.engine.split_engines import ExpertEngine, expert_subset
from vla_rt.inputs import BuiltShapes
from vla_rt.model import random_weights
from vla_rt.serve.server import ServerThread
from vla_rt.split.kv_codec import KvAssembler, KvLayout, encode_kv

VIEWS, PROMPT = 2, 20


def pi0_kv_config():
    """`tiny` with π0's KV dims (depth 18, 8 heads over 1 KV head of 256): π0's KV bytes, tiny weights."""
    cfg = preset("tiny")
    gemma = dict(depth=18, num_heads=8, num_kv_heads=1, head_dim=256)
    return cfg.replace(
        llm=GemmaConfig(width=64, mlp_dim=128, **gemma), expert=GemmaConfig(width=32, mlp_dim=64, **gemma)
    )


def wide_kv_config():
    """`tiny` with 2 layers of 8 KV heads of 256: a 3-view KV of 25.8 MB in float32 whose import (~15 ms on one core)
    is half a chunk (~30 ms at chunk 4), as π0's import is a large part of its 7 ms chunk on the H200; π0's own 18
    layers make a CPU chunk 100+ ms, against which an import would not show."""
    cfg = preset("tiny")
    gemma = dict(depth=2, num_heads=8, num_kv_heads=8, head_dim=256)
    return cfg.replace(
        llm=GemmaConfig(width=64, mlp_dim=128, **gemma), expert=GemmaConfig(width=32, mlp_dim=64, **gemma)
    )


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def robot_rounds(seconds: float, rate: float, chunk: int, views: int = 3) -> None:
    """The robot side end to end on `wide_kv_config`: request → actions while KV versions keep arriving."""
    from vla_rt.bench.split import wait_healthy
    from vla_rt.bench.split_robot import drive, observations
    from vla_rt.serve.app import ServeConfig
    from vla_rt.split.roles import SplitConfig, build_expert_role

    cfg = wide_kv_config()
    folder = Path(tempfile.mkdtemp(prefix="split-receive-"))
    ckpt = save_native(folder / "pi0kv.safetensors", random_weights(cfg, seed=1), cfg, source="split_receive")
    port, kv_port, log = _free_port(), _free_port(), folder / "prefix.log"
    shape_flags = ["--profile", "generic", "--num-views", str(views), "--chunk", str(chunk), "--prompt-len",
                   str(PROMPT)]  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "vla_rt.cli", "serve", str(ckpt), "--role", "prefix", "--device",
                               "cpu", "--port", str(port), "--kv-port", str(kv_port), *shape_flags],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_healthy(kv_port, server, 300, log)
        frames = observations(16, cfg.vision.image_size, views, PROMPT, seed=1)
        serve = ServeConfig(str(ckpt), profile="generic", num_views=views, chunk=chunk, prompt_len=PROMPT, port=0,
                            device="cpu", seed=0)  # fmt: skip
        for fmt in ("native", "fp8"):
            split = SplitConfig("expert", prefix_server=f"127.0.0.1:{kv_port}", max_kv_age_ms=5000, kv_format=fmt)
            servers = build_expert_role(serve, split)
            chunk_ms = time_chunk(servers.servers[0].service.worker.engine, 5)
            with ServerThread(servers) as thread:
                answers = drive(thread.port, frames, rate, seconds)
                events = list(servers.servers[0].service.worker.events)
            _print_round(fmt, chunk_ms, answers, events)
    finally:
        server.terminate()
        server.wait(30)


def _print_round(fmt: str, chunk_ms: float, answers: list[dict], events: list[dict]) -> None:
    ok = [a for a in answers[3:] if "error" not in a]  # the first ones wait for the first KV
    total = np.array([(a["t_recv"] - a["t_send"]) * 1e3 for a in ok])
    installs = [e for e in events if e["kind"] == "install"]
    install_ms = np.array([(e["end"] - e["start"]) * 1e3 for e in installs])
    local = [e for e in events if e["kind"] == "answer" and e["source"] == "local"][3:]
    overlap = [any(i["start"] < e["end"] and i["end"] > e["start"] for i in installs) for e in local]
    spans = np.array([(e["end"] - e["start"]) * 1e3 for e in local])
    during, apart = spans[np.array(overlap, bool)], spans[~np.array(overlap, bool)]
    print(f"robot side, {fmt} KV (chunk alone {chunk_ms:.2f} ms): request → actions p50 {np.median(total):.2f} / p99 "
          f"{np.percentile(total, 99):.2f} ms over {len(ok)} answers; {len(installs)} installs, "
          f"{np.median(install_ms):.2f} ms each (p50); a local chunk's span p50 / max while an install runs "
          f"{np.median(during):.2f} / {during.max():.2f} ms ({len(during)}), otherwise {np.median(apart):.2f} / "
          f"{apart.max():.2f} ms ({len(apart)}); {len(answers) - len(ok) - 3} refused")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a robot's small CPU: 1)")
    p.add_argument("--robot-seconds", type=float, default=0.0, help="then drive the robot side this long a format")
    p.add_argument("--rate", type=float, default=10.0, help="the robot's requests per second")
    p.add_argument("--chunk", type=int, default=4, help="action horizon of the robot rounds (the receive path does "
                   "not depend on it; the expert's attention over the KV grows with it)")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg, dtype = pi0_kv_config(), getattr(torch, args.engine_dtype)
    shapes = BuiltShapes(VIEWS, args.chunk, PROMPT, 1)
    engine = ExpertEngine.from_expert_weights(expert_subset(random_weights(cfg), cfg), cfg, shapes,
                                              device=torch.device("cpu"), dtype=dtype, num_slots=3)  # fmt: skip
    d, g = engine.dims, cfg.llm
    layout = KvLayout(g.depth, g.num_kv_heads, g.head_dim, d.prefix)
    kv = torch.randn(g.depth, 2, 1, d.prefix, g.num_kv_heads, g.head_dim).to(torch.bfloat16)
    mask = torch.ones(1, d.prefix, dtype=torch.bool)
    mask[0, VIEWS * cfg.vision.num_patches + PROMPT - 3 :] = False  # a padded prompt: the rows path
    for fmt in ("native", "fp8"):
        frames = encode_kv(kv, mask, version=1, t_capture=0.0, fmt=fmt).frames
        parts, done = receive_parts(engine, layout, frames, args.repeats)
        print(f"{fmt} KV on the wire: {len(done.payload) / 1e6:.2f} MB ({done.fmt}), engine {args.engine_dtype}")
        for name, ms in parts.items():
            print(f"  {name:34s} {ms:7.2f} ms")
        print(f"  {'receive path, total':34s} {sum(parts.values()):7.2f} ms")
    if args.robot_seconds:
        robot_rounds(args.robot_seconds, args.rate, args.chunk)


def receive_parts(engine: ExpertEngine, layout: KvLayout, frames: list[bytes], repeats: int) -> tuple[dict, object]:
    """Median ms of each part of the receive path for one version's frames, and the version."""
    decoded = [msgpack.unpackb(f) for f in frames]

    def assemble():
        asm = KvAssembler(layout)
        return [asm.add(m) for m in decoded][-1]

    done = assemble()
    e = engine
    on_device = done.to_device(e.device, e.dtype)  # import_prefix timed alone: a difference of two medians goes < 0
    return {
        f"msgpack decode ({len(frames)} frames)": median_ms(lambda: [msgpack.unpackb(f) for f in frames], repeats),
        "assemble (CRC, copy)": median_ms(assemble, repeats),
        "to_device": median_ms(lambda: done.to_device(e.device, e.dtype), repeats),
        "import_prefix": median_ms(lambda: e.import_prefix(2, *on_device), repeats),
    }, done


def time_chunk(engine: ExpertEngine, repeats: int) -> float:
    g, d = engine.cfg.llm, engine.dims
    kv = torch.randn(g.depth, 2, 1, d.prefix, g.num_kv_heads, g.head_dim).to(engine.dtype)
    engine.import_prefix(0, kv, torch.ones(1, d.prefix, dtype=torch.bool))
    state, noise = torch.zeros(1, engine.cfg.action_dim), torch.randn(1, d.chunk, engine.cfg.action_dim)
    return median_ms(lambda: engine.run_chunk(0, state, noise), repeats)


if __name__ == "__main__":
    main()
