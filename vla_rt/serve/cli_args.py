"""`vla-rt serve` and `vla-rt loadtest`: their flags and what they run (registered in `vla_rt.cli`).

The load test can start the server itself (give it a CHECKPOINT and the same server flags as `vla-rt serve`): it
runs `vla-rt serve` in a child process on a free port, waits for /healthz, runs one round per robot count, and
stops it; or it loads a server that is already running (`--host`, `--port`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from vla_rt.serve.app import ServeConfig, build_server
from vla_rt.serve.profiles import PROFILES
from vla_rt.split.roles import add_split_args, run_role, split_config

API_KEY_ENV = "VLA_RT_API_KEY"
# (flag, ServeConfig field, argparse kwargs): the server's settings, shared by both commands
SERVER_FLAGS: list[tuple[str, str, dict]] = [
    ("--profile", "profile", dict(choices=sorted(PROFILES), default="generic", help="robot observation format")),
    (
        "--backend",
        "backend",
        dict(choices=("reference", "folded", "triton"), help="default: triton on CUDA, folded on a CPU"),
    ),  # fmt: skip
    ("--num-views", "num_views", dict(type=int, help="model camera views (default: the profile's)")),
    ("--chunk", "chunk", dict(type=int, help="actions per answer (default: the profile's, else the checkpoint's)")),
    ("--prompt-len", "prompt_len", dict(type=int, help="prompt tokens (default: the checkpoint's max_token_len)")),
    ("--tokenizer", "tokenizer", dict(help="SentencePiece .model for text prompts (PaliGemma's for real π0)")),
    ("--max-batch", "max_batch", dict(type=int, default=16, help="largest batch bucket (engines for 1, 2, 4, ...)")),
    ("--slo-ms", "slo_ms", dict(type=float, help="admit a robot only if every robot's predicted p99 stays below")),
    ("--batch-window-ms", "window_ms", dict(type=float, default=2.0, help="how long a request waits for company")),
    (
        "--robot-hz",
        "robot_hz",
        dict(type=float, default=10.0, help="a robot's request rate for admission unless its URI says ?hz="),
    ),  # fmt: skip
    ("--default-prompt", "default_prompt", dict(help="prompt for observations that carry none (needs --tokenizer)")),
    ("--max-message-mb", "max_message_mb", dict(type=float, default=10.0, help="larger frames are closed with 1009")),
    ("--seed", "seed", dict(type=int, help="seed of the denoising noise (reproducible actions)")),
]


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {text!r}")
        return value

    return parse


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    for flag, _, kwargs in SERVER_FLAGS:
        p.add_argument(flag, **kwargs)


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


# ----- serve ----------------------------------------------------------------------------------------------------
def serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="openpi checkpoint dir, LeRobot π0 dir, native file, or random:<preset>[:seed]")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help=f"require 'Authorization: Api-Key <key>' (default: ${API_KEY_ENV} if set)")
    _add_server_flags(p)
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve deployment: one worker replica per GPU")
    p.add_argument("--replicas", type=int, help="--ray: worker replicas (default: one per GPU, else 1)")
    add_split_args(p)  # --role prefix|expert, --prefix-server, --max-kv-age-ms, ... (docs/split.md)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field, _ in SERVER_FLAGS}
    return ServeConfig(args.checkpoint, host=args.host, port=args.port, api_key=_api_key(args), **fields)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint to openpi robot clients over websockets, batching robots on one GPU worker."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # our own line per connection says more
    cfg = replace(serve_config(args), device=args.device)
    if args.role != "all":
        return run_role(cfg, split_config(args))
    if args.ray:
        from vla_rt.serve.ray_app import run_ray

        return run_ray(cfg, replicas=args.replicas)
    server = build_server(cfg)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    asyncio.run(main())
    return 0


# ----- loadtest -------------------------------------------------------------------------------------------------
def _robot_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected robot counts such as '1,2,4,8,16', found {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive robot counts, found {text!r}")
    return counts


def loadtest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", help="start `vla-rt serve CHECKPOINT` for the test (else use --port)")
    p.add_argument("--robots", type=_robot_counts, default=(1, 2, 4, 8, 16), help="robot counts, one round each")
    p.add_argument("--rate", type=_positive(float), default=10.0, help="requests per second per robot")
    p.add_argument("--seconds", type=_positive(float), default=10.0, help="length of each round")
    p.add_argument("--host", default="127.0.0.1", help="the server to load (with CHECKPOINT: where it listens)")
    p.add_argument("--port", type=int, help="the server's port (default: 8000, or a free one with CHECKPOINT)")
    p.add_argument("--api-key", help=f"the server's key (default: ${API_KEY_ENV} if set)")
    p.add_argument("--out", type=Path, help="output folder (default: runs/loadtest/<time>; benchmarks/results to "
                                            "commit)")  # fmt: skip
    p.add_argument("--startup-timeout", type=_positive(float), default=900.0, help="seconds to wait for the server")
    _add_server_flags(p)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _server_command(args: argparse.Namespace, port: int) -> list[str]:
    argv = [sys.executable, "-m", "vla_rt.cli", "serve", args.checkpoint, "--host", args.host, "--port", str(port)]
    for flag, _, kwargs in SERVER_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value != kwargs.get("default"):
            argv += [flag, str(value)]
    return argv


def _wait_healthy(host: str, port: int, process: subprocess.Popen | None, log_path: Path | None, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {host}:{port} was not healthy within {timeout:g} s")


def cmd_loadtest(args: argparse.Namespace) -> int:
    """N real openpi-client robots per round against a server; JSON + Markdown + latency-vs-robots plot."""
    try:  # openpi's client is the load generator: an optional dependency (its numpy<2 pin stays out of the core)
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        from vla_rt.serve.loadtest import run_round
    except ImportError as e:
        raise ImportError(f"vla-rt loadtest runs openpi's client ({e}): pip install 'vla-rt[loadtest]' (or "
                          "`pip install --no-deps openpi-client` to keep your numpy)") from None  # fmt: skip
    from vla_rt.serve.loadtest_report import write_report

    out = args.out or Path("runs/loadtest") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    process, log_path = None, None
    port = args.port or (_free_port(args.host) if args.checkpoint else 8000)
    if args.checkpoint:
        log_path = out / "server.log"
        command = _server_command(args, port)
        print(f"starting: {shlex.join(command[1:])}  (log: {log_path})")
        process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_healthy(args.host, port, process, log_path, args.startup_timeout)
        probe = WebsocketClientPolicy(f"ws://{args.host}:{port}/?hz={args.rate:g}", api_key=_api_key(args))
        metadata = probe.get_server_metadata()
        probe._ws.close()  # openpi-client 0.1.2 has no close()
        if metadata["profile"] != args.profile and (args.checkpoint or args.profile != "generic"):
            raise RuntimeError(f"--profile {args.profile}: the server serves {metadata['profile']!r}")
        rounds = []
        for n in args.robots:
            r = run_round(args.host, port, n, args.rate, args.seconds, api_key=_api_key(args),
                          profile=metadata["profile"])  # fmt: skip
            rounds.append(r)
            print(f"{n:4d} robots: {r['requests_per_s']:7.1f} requests/s, p50 {r['p50_ms'] or 0:7.1f} ms, "
                  f"p90 {r['p90_ms'] or 0:7.1f} ms, p99 {r['p99_ms'] or 0:7.1f} ms, refused {r['refused']}, "
                  f"errors {r['errors']}")  # fmt: skip
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    result = {"device": metadata["device"], "server": metadata, "rate_hz": args.rate, "seconds": args.seconds,
              "command": shlex.join(["vla-rt", *sys.argv[1:]]), "rounds": rounds}  # fmt: skip
    for kind, path in write_report(result, out).items():
        print(f"wrote {kind}: {path}")
    return 1 if any(r["errors"] for r in rounds) else 0
