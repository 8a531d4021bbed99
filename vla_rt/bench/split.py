"""The split π0 on one machine: the prefix server and the robot-side expert as two processes, a robot in front.

The prefix server is `vla-rt serve --role prefix` in a child process. This process is the robot side: it builds the
expert from the expert's weights alone (its GPU memory is measured before anything else touches the GPU here),
serves it (`--role expert`'s objects) and drives it with a robot at a fixed rate, one round per KV format (bf16,
fp8) and link (loopback as it is; throttled to 20 ms / 100 Mb/s each way). Then, with the whole model built here
too, the monolithic engine's call time, bit-identity of split and monolithic actions on a fresh KV, and the accuracy
of each KV format against the float32 reference. Writes `split_<device>.json/.md/.png` to --out; each phase is
bounded, and the JSON is rewritten after every phase, so a run cut short still leaves what it measured.

    python -m vla_rt.bench.split --out benchmarks/results                          # H200: random:pi0 bf16, 2 views
    python -m vla_rt.bench.split --preset tiny --device cpu --seconds 2 --out /tmp/split-dry   # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from vla_rt.bench.latency import device_name
from vla_rt.bench.split_report import markdown, round_summary, round_trip_ms, stats, write_report
from vla_rt.bench.split_robot import drive_process
from vla_rt.checkpoints import load_checkpoint
from vla_rt.engine.split_engines import ExpertEngine, expert_subset
from vla_rt.serve.app import ServeConfig, build_server
from vla_rt.serve.server import ServerThread
from vla_rt.split.expert_file import ExpertWeights, fingerprint
from vla_rt.split.roles import NUM_STEPS, SplitConfig, expert_servers, role_shapes
from vla_rt.split.shaper import LinkProfile
from vla_rt.timing import time_calls

SLOW_LINK = LinkProfile(latency_ms=20.0, mbps=100.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(msg: str) -> None:
    print(f"[split-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _nvidia_smi(*query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_used_mb(index: int = 0) -> float | None:
    """Memory in use on GPU `index`, every process together (works in a container that hides other PIDs)."""
    lines = _nvidia_smi("--query-gpu=memory.used").strip().splitlines()
    return float(lines[index]) if len(lines) > index else None


def gpu_memory_mb(pid: int) -> float | None:
    """One process's GPU memory as the driver counts it (context and allocator), or None where nvidia-smi does not
    list it (a container's PID namespace)."""
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def monolithic_round(serve: ServeConfig, robot: Callable[[int, float], list[dict]]) -> dict:
    """The same robot (`robot(port, warmup_s)` -> its answers) against `vla-rt serve` (the whole model, one robot's
    pool), so the split's request → actions has its baseline over the same client, protocol and machine."""
    t0 = time.monotonic()
    server = build_server(replace(serve, max_batch=1, port=0))
    startup_s = time.monotonic() - t0
    with ServerThread(server) as thread:
        answers = robot(thread.port, 1.0)  # after a second of warm-up: first connections, first copies
    # its CUDA Graphs go now: the cycle collector could otherwise destroy them while a later engine captures its own
    # (cudaGraphExecDestroy during a capture invalidates that capture; it did on the H200)
    del server, thread
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ok = [a for a in answers if "error" not in a]
    return {"startup_s": startup_s, "answers": len(ok), "refused_count": len(answers) - len(ok),
            "request_to_actions_ms": stats(map(round_trip_ms, ok)),
            "infer_ms": stats(a["server_timing"]["infer_ms"] for a in ok),
            "queue_ms": stats(a["server_timing"]["queue_ms"] for a in ok),
            "server_total_ms": stats(a["server_timing"]["total_ms"] for a in ok)}  # fmt: skip


def start_prefix_server(args, port: int, kv_port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "vla_rt.cli", "serve", f"random:{args.preset}", "--role", "prefix",
               "--device", args.prefix_device or args.device, "--port", str(port), "--kv-port", str(kv_port),
               "--profile", "generic", "--num-views", str(args.views), "--chunk", str(args.chunk), "--prompt-len",
               str(args.prompt_len)]  # fmt: skip
    _log("starting the prefix server: " + " ".join(command[1:]))
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the prefix server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the prefix server was not healthy within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def engine_timings(engine: ExpertEngine, device: torch.device) -> dict:
    """One chunk and one step of the expert on a finite random KV, CUDA events (wall clock on a CPU)."""
    g, d = engine.cfg.llm, engine.dims
    kv = torch.randn(g.depth, 2, 1, d.prefix, g.num_kv_heads, g.head_dim, device=device).to(engine.dtype)
    engine.import_prefix(0, kv, torch.ones(1, d.prefix, dtype=torch.bool, device=device))
    state = torch.zeros(1, engine.cfg.action_dim, device=device)
    noise = torch.randn(1, d.chunk, engine.cfg.action_dim, device=device)
    chunk = time_calls(lambda: engine.run_chunk(0, state, noise), warmup=3, iters=50, device=device, max_seconds=20)
    engine.start_chunk(0, state, noise)

    def one_step() -> None:
        if engine.step():
            engine.start_chunk(0, state, noise)

    step = time_calls(one_step, warmup=3, iters=100, device=device, max_seconds=10)
    while engine.chunk_slot >= 0:  # leave no chunk open: the rounds' worker starts its own
        engine.step()
    return {"chunk": chunk.to_dict(), "step": step.to_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="pi0")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="the robot side's")
    p.add_argument("--prefix-device", help="the prefix server's (default: --device; cuda:0 with --device cuda:1 "
                   "puts the two roles on two GPUs)")  # fmt: skip
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--rate", type=float, default=50.0, help="the robot's requests per second")
    p.add_argument("--seconds", type=float, default=6.0, help="length of each round")
    p.add_argument("--max-kv-age-ms", type=float, default=1000.0)
    p.add_argument("--startup-timeout", type=float, default=330.0, help="seconds for the prefix server to be up")
    p.add_argument("--accuracy-draws", type=int, default=4, help="0: skip the monolithic / accuracy phase")
    p.add_argument(
        "--no-monolithic-round",
        dest="monolithic_round",
        action="store_false",
        help="skip the round against the monolithic server (the request → actions baseline)",
    )
    p.add_argument("--out", type=Path, required=True, help="where split_<device>.json/.md/.png go")
    p.add_argument("--log-dir", type=Path, help="where the prefix server's log goes (default: --out)")
    args = p.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = (args.log_dir or out) / "split_prefix_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # `timeout` sends SIGTERM: leave through `finally`, so the prefix server is stopped and the results are written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device = torch.device(args.device)
    dev_name = device_name(device)
    result: dict = {"device": dev_name, "prefix_device": args.prefix_device or args.device, "preset": args.preset,
                    "views": args.views, "prompt_len": args.prompt_len, "chunk": args.chunk, "rate_hz": args.rate,
                    "seconds": args.seconds, "num_steps": NUM_STEPS,
                    "max_kv_age_ms": args.max_kv_age_ms, "command": " ".join(["python -m vla_rt.bench.split",
                                                                             *(argv or sys.argv[1:])]),
                    "phases": {}, "rounds": []}  # fmt: skip

    def save() -> None:
        (out / f"split_{dev_name}.json").write_text(json.dumps(result, indent=1, default=float) + "\n")

    context_mb = None
    if device.type == "cuda":  # the CUDA context's own memory, before the prefix server touches the GPU
        index = device.index if device.index is not None else torch.cuda.current_device()
        before = gpu_used_mb(index)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
        after = gpu_used_mb(index)
        context_mb = None if before is None or after is None else after - before
    port, kv_port = _free_port(), _free_port()
    server = start_prefix_server(args, port, kv_port, log)
    try:
        t0 = time.monotonic()
        _log(f"loading random:{args.preset} on the host (the prefix server draws the same weights meanwhile)")
        ckpt = load_checkpoint(f"random:{args.preset}")
        cfg = ckpt.config
        ew = ExpertWeights(expert_subset(ckpt.weights, cfg), cfg, fingerprint(ckpt.weights), ckpt.source)
        serve = ServeConfig(ew.source, profile="generic", num_views=args.views, chunk=args.chunk,
                            prompt_len=args.prompt_len, port=0, device=args.device, seed=0)  # fmt: skip
        b = role_shapes(serve, cfg)
        cfg = cfg.replace(chunk=b.shapes.chunk)
        result["phases"]["load_s"] = time.monotonic() - t0
        g = cfg.llm  # what a refresh weighs at each view count (computed; the rounds measure the built one)
        per_row = 2 * g.depth * g.num_kv_heads * g.head_dim  # K and V of every layer, elements
        rows = {v: v * cfg.vision.num_patches + args.prompt_len for v in (1, 2, 3)}
        result["kv_bytes_computed"] = {v: {"bf16": n * per_row * 2, "fp8": n * per_row} for v, n in rows.items()}
        t0 = time.monotonic()
        engine = ExpertEngine.from_expert_weights(ew.weights, cfg, b.shapes, device=b.device, dtype=b.dtype,
                                                  num_steps=NUM_STEPS, num_slots=3)  # fmt: skip
        result["phases"]["expert_build_s"] = time.monotonic() - t0
        result["expert_engine"] = {"dtype": str(b.dtype)[6:], "expert_step": engine.expert.name,
                                   "bytes": engine.memory_bytes(), **engine_timings(engine, device)}  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            reserved = torch.cuda.memory_reserved(device) / 2**20
            result["expert_memory"] = {"torch_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                                       "torch_reserved_mb": reserved, "cuda_context_mb": context_mb,
                                       "context_plus_reserved_mb": None if context_mb is None else context_mb + reserved,
                                       "process_mb": gpu_memory_mb(os.getpid())}  # fmt: skip
        _log(f"expert built: {result['expert_engine']['chunk']['median_ms']:.2f} ms a chunk, memory "
             f"{result.get('expert_memory')}")  # fmt: skip
        save()
        t0 = time.monotonic()
        wait_healthy(kv_port, server, args.startup_timeout, log)
        result["phases"]["prefix_server_ready_s"] = time.monotonic() - t0
        result["prefix_server_memory_mb"] = gpu_memory_mb(server.pid) if device.type == "cuda" else None

        def robot(port: int, warmup_s: float = 0.0) -> list[dict]:  # a robot process of its own, as on a machine
            return drive_process(port, image_size=cfg.vision.image_size, views=args.views, prompt=args.prompt_len,
                                 state_dim=8, rate_hz=args.rate, seconds=args.seconds, warmup_s=warmup_s)  # fmt: skip

        for kv_format, link in (("native", None), ("fp8", None), ("native", SLOW_LINK), ("fp8", SLOW_LINK)):
            split = SplitConfig("expert", prefix_server=f"127.0.0.1:{kv_port}", max_kv_age_ms=args.max_kv_age_ms,
                                kv_format=kv_format, link=link or LinkProfile())  # fmt: skip
            servers = expert_servers(engine, ew, b, serve, split)
            with ServerThread(servers) as thread:
                _log(f"round: KV {kv_format}, link {link or 'loopback'}")
                answers = robot(thread.port)
                service = servers.servers[0].service
                events = list(service.worker.events) + list(service.client.events)
            result["rounds"].append(round_summary(kv_format, link, answers, events, str(b.dtype)[6:]))
            if device.type == "cuda":  # this round's memory; then the blocks its installer stream cached go back
                result["rounds"][-1]["process_mb"] = gpu_memory_mb(os.getpid())
                result["rounds"][-1]["torch_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
                torch.cuda.empty_cache()  # (each round builds a new worker: a new stream, whose cache no one reuses)
            save()
        if device.type == "cuda":
            # the most any round held (each measured at its end, before its worker's cached blocks went back)
            mem = result["expert_memory"]
            rounds = result["rounds"]
            mem["process_mb_after_rounds"] = max((x["process_mb"] for x in rounds if x["process_mb"]), default=None)
            mem["torch_reserved_mb_after_rounds"] = max(x["torch_reserved_mb"] for x in rounds)
        save()
        write_report(result, out)  # the rounds' report now; the whole-model phase below adds to it
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    if args.monolithic_round:  # the prefix server has stopped: the GPU is this process's alone, as on a robot
        _log("round: the monolithic server (vla-rt serve, the whole model) with the same robot")
        result["monolithic_server"] = monolithic_round(serve, robot)
        save()
    if args.accuracy_draws:
        from vla_rt.bench.split_accuracy import monolithic_and_accuracy

        t0 = time.monotonic()
        result["monolithic"] = monolithic_and_accuracy(ckpt.weights, cfg, b.shapes, engine, device, b.dtype,
                                                       draws=args.accuracy_draws)  # fmt: skip
        result["phases"]["monolithic_s"] = time.monotonic() - t0
    save()
    for kind, path in write_report(result, out).items():
        _log(f"wrote {kind}: {path}")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
