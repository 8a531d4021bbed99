"""`vla-rt serve` and `vla-rt loadtest`: their flags and what they run (registered in `vla_rt.cli`).

The load test can start the server itself (give it a CHECKPOINT and the same server flags as `vla-rt serve`): it
runs `vla-rt serve` in a child process on a free port, waits for /healthz, runs one round per robot count, and
stops it; or it loads a server that is already running (`--host`, `--port`).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from vla_rt.arguments import check_out_dir
from vla_rt.errors import ArgumentError
from vla_rt.serve.app import (
    BOUNDS,
    SERVE_BACKENDS,
    ServeConfig,
    build_server,
    check_bound,
    check_model_settings,
    read_model_config,
    use_cpu_threads,
)
from vla_rt.serve.profiles import PROFILES
from vla_rt.serve.scheduler import POLICIES
from vla_rt.serve.server import check_listen, serve_until_signalled
from vla_rt.split.roles import add_split_args, run_role, split_config

API_KEY_ENV = "VLA_RT_API_KEY"


def _bounded(field: str):
    """An argparse type for a ServeConfig field: the number within `app.BOUNDS`, else a usage error (exit 2)."""
    flag, kind, *_ = BOUNDS[field]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            number = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {number}, found {text!r}") from None
        try:
            return check_bound(field, value)
        except ArgumentError as e:
            raise argparse.ArgumentTypeError(f"expected {e.expected}, found {text!r}") from None

    return parse


# (flag, ServeConfig field, argparse kwargs): the server's settings, shared by both commands
SERVER_FLAGS: list[tuple[str, str, dict]] = [
    ("--profile", "profile", dict(choices=sorted(PROFILES), default="generic", help="robot observation format")),
    ("--backend", "backend", dict(choices=SERVE_BACKENDS, help="default: triton on CUDA, folded on a CPU")),
    ("--num-views", "num_views", dict(type=_bounded("num_views"), help="model camera views (default: the profile's)")),
    (
        "--chunk",
        "chunk",
        dict(type=_bounded("chunk"), help="actions per answer (default: the profile's, else the checkpoint's)"),
    ),  # fmt: skip
    (
        "--prompt-len",
        "prompt_len",
        dict(type=_bounded("prompt_len"), help="prompt tokens (default: the checkpoint's max_token_len)"),
    ),  # fmt: skip
    ("--tokenizer", "tokenizer", dict(help="SentencePiece .model for text prompts (PaliGemma's for real π0)")),
    (
        "--asset-id",
        "asset_id",
        dict(help="openpi checkpoint: whose assets/<asset_id>/norm_stats.json to use (required if it has several)"),
    ),  # fmt: skip
    (
        "--scheduler",
        "scheduler",
        dict(
            choices=POLICIES,
            default="overlap",
            help="overlap: rows join and leave at every denoising step, the prefix stage on its own CUDA stream beside "
            "the steps (default); stage: the same, one stage at a time; batch: whole requests, batch by batch",
        ),
    ),  # fmt: skip
    (
        "--max-batch",
        "max_batch",
        dict(
            type=_bounded("max_batch"),
            default=16,
            help="most rows in flight (the engine's pool; expert stages for 1, 2, 4, ... rows)",
        ),
    ),  # fmt: skip
    (
        "--max-prefix",
        "max_prefix",
        dict(type=_bounded("max_prefix"), help="most rows per prefix stage (default: min(8, --max-batch))"),
    ),  # fmt: skip
    (
        "--expert-sms",
        "expert_sms",
        dict(
            type=_bounded("expert_sms"),
            default=0,
            help="SMs the prefix stages never use (a green-context partition, CUDA 12.4+), so the expert steps beside "
            "them find SMs free at once; the prefix runs on the rest, slower (default 0: all SMs shared)",
        ),
    ),  # fmt: skip
    (
        "--cpu-threads",
        "cpu_threads",
        dict(
            type=_bounded("cpu_threads"),
            help="torch's CPU threads in the server process (default: 1 on CUDA, where its CPU work is copying rows "
            "and OpenMP's barriers stalled it for tens of ms; torch's own on a CPU, where the model runs on them)",
        ),
    ),  # fmt: skip
    (
        "--slo-ms",
        "slo_ms",
        dict(type=_bounded("slo_ms"), help="admission: tighten every robot's SLO (its period) to this p99"),
    ),  # fmt: skip
    ("--no-admission", "admission", dict(action="store_false", help="admit every robot (load tests past capacity)")),
    (
        "--batch-window-ms",
        "window_ms",
        dict(type=_bounded("window_ms"), default=2.0, help="--scheduler batch: how long a request waits for company"),
    ),  # fmt: skip
    (
        "--robot-hz",
        "robot_hz",
        dict(
            type=_bounded("robot_hz"),
            default=10.0,
            help="a robot's request rate for admission unless its URI says ?hz=",
        ),
    ),  # fmt: skip
    ("--default-prompt", "default_prompt", dict(help="prompt for observations that carry none (needs --tokenizer)")),
    (
        "--max-message-mb",
        "max_message_mb",
        dict(type=_bounded("max_message_mb"), default=10.0, help="larger frames are closed with 1009"),
    ),  # fmt: skip
    (
        "--warm-lead-ms",
        "warm_lead_ms",
        dict(
            type=_bounded("warm_lead_ms"),
            default=None,
            help="while the server is idle, re-run a robot's host steps (decode, prepare, finish) on its last frame "
            "this many ms before its next is due, so they run on warm caches (default 2; 0: off; docs/serving.md)",
        ),
    ),  # fmt: skip
    (
        "--cost-iters",
        "cost_iters",
        dict(
            type=_bounded("cost_iters"), help="start-up timing runs per stage bucket (default: 30 on CUDA, 3 on a CPU)"
        ),
    ),  # fmt: skip
    ("--seed", "seed", dict(type=_bounded("seed"), help="seed of the denoising noise (reproducible actions)")),
]


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {text!r}") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, found {text!r}")
        return value

    return parse


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    for flag, field, kwargs in SERVER_FLAGS:
        p.add_argument(flag, dest=field if flag == "--no-admission" else None, **kwargs)


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _key_text(text: str) -> str:
    """An `--api-key` given is a key: an empty one (`--api-key "$KEY"` with KEY unset) would otherwise serve
    everyone without a word, the opposite of what the flag asked for."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty key, found {text!r}")
    return text


# ----- serve ----------------------------------------------------------------------------------------------------
def serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="openpi checkpoint dir, LeRobot π0 dir, native file, or random:<preset>[:seed]")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_bounded("port"), default=8000, help="0: any free port")
    p.add_argument("--api-key", type=_key_text,
                   help=f"require 'Authorization: Api-Key <key>' (default: ${API_KEY_ENV} if set)")  # fmt: skip
    _add_server_flags(p)
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve deployment: one worker replica per GPU")
    p.add_argument("--replicas", type=_positive(int), help="--ray: worker replicas (default: one per GPU, else 1)")
    add_split_args(p)  # --role prefix|expert, --prefix-server, --max-kv-age-ms, ... (docs/split.md)


def _flag_value(args: argparse.Namespace, flag: str, field: str):
    return getattr(args, field if flag == "--no-admission" else flag[2:].replace("-", "_"))


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The command's settings, checked (ArgumentError: exit 2 before any work)."""
    values = {field: _flag_value(args, flag, field) for flag, field, _ in SERVER_FLAGS}
    return ServeConfig(args.checkpoint, host=args.host, port=args.port, api_key=_api_key(args), **values).check()


def check_ray_flags(args: argparse.Namespace) -> None:
    """`--replicas` acts only with `--ray`, and `--ray` only on the whole model: refused rather than ignored."""
    if args.replicas is not None and not args.ray:
        raise ArgumentError("--replicas", "--ray with it (the Ray Serve app's worker replicas)", args.replicas)
    if args.ray and args.role != "all":
        raise ArgumentError("--ray", "--role all (Ray Serve runs the whole model; a split role runs without it)",
                            None, found_text=f"--role {args.role}")  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint to openpi robot clients over websockets, batching robots on one GPU worker."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # our own line per connection says more
    cfg = replace(serve_config(args), device=args.device).check()
    split = split_config(args)  # every role: a split flag the role would ignore is refused before anything loads
    check_ray_flags(args)
    if args.role != "export-expert":  # it only writes a file
        check_listen(cfg.host, cfg.port)
    if args.role == "prefix":
        check_listen(cfg.host, split.kv_port, "--kv-port")
    use_cpu_threads(cfg)  # this process serves: every role below builds its engine and cost model here
    if args.role != "all":
        return run_role(cfg, split)
    if args.ray:
        from vla_rt.serve.ray_app import run_ray

        return run_ray(cfg, replicas=args.replicas)
    server = build_server(cfg)

    return serve_until_signalled(server)


# ----- loadtest -------------------------------------------------------------------------------------------------
def _robot_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected robot counts such as '1,2,4,8,16', found {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive robot counts, found {text!r}")
    return counts


def _schedulers(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    unknown = [x for x in names if x not in POLICIES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct schedulers of {', '.join(POLICIES)} such as "
                                         f"'stage,batch', found {text!r}")  # fmt: skip
    return names


def loadtest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", help="start `vla-rt serve CHECKPOINT` for the test (else use --port)")
    p.add_argument("--robots", type=_robot_counts, default=(1, 2, 4, 8, 16), help="robot counts, one round each")
    p.add_argument("--rate", type=_positive(float), default=10.0, help="requests per second per robot")
    p.add_argument("--seconds", type=_positive(float), default=10.0, help="length of each round")
    p.add_argument("--host", default="127.0.0.1", help="the server to load (with CHECKPOINT: where it listens)")
    p.add_argument("--port", type=_bounded("port"), help="the server's port (default: 8000, or a free one with "
                   "CHECKPOINT)")  # fmt: skip
    p.add_argument("--api-key", type=_key_text, help=f"the server's key (default: ${API_KEY_ENV} if set)")
    p.add_argument("--out", type=Path, help="output folder (default: runs/loadtest/<time>; benchmarks/results to "
                                            "commit)")  # fmt: skip
    p.add_argument("--startup-timeout", type=_positive(float), default=900.0, help="seconds to wait for the server")
    p.add_argument("--compare", type=_robot_counts, help="robot counts for a comparison of schedulers (one more "
                   "server per scheduler, each admitting every robot; needs CHECKPOINT)")  # fmt: skip
    p.add_argument(
        "--compare-schedulers",
        type=_schedulers,
        default=("overlap", "stage"),
        help="the schedulers --compare starts, e.g. overlap,stage,batch (default: overlap,stage)",
    )
    _add_server_flags(p)


def server_flags(args: argparse.Namespace, **overrides: object) -> list[str]:
    """The server flags of `args` that differ from their defaults, as `vla-rt serve` arguments; `overrides`
    (ServeConfig field -> value) replace them (admission=False adds --no-admission)."""
    argv: list[str] = []
    for flag, field, kwargs in SERVER_FLAGS:
        value = overrides.get(field, _flag_value(args, flag, field))
        if flag == "--no-admission":
            argv += [] if value else [flag]
        elif value is not None and value != kwargs.get("default"):
            argv += [flag, str(value)]
    return argv


def cmd_loadtest(args: argparse.Namespace) -> int:
    """N real openpi-client robots per round against a server; JSON + Markdown + latency-vs-robots plot."""
    if args.checkpoint:  # every server flag checked before anything starts (a bad one: exit 2 at once)
        values = {field: _flag_value(args, flag, field) for flag, field, _ in SERVER_FLAGS}
        cfg = ServeConfig(args.checkpoint, host=args.host, port=args.port or 0, **values).check()
        model_cfg = read_model_config(args.checkpoint, cfg.asset_id)  # a header read, before any server starts
        check_model_settings(cfg, model_cfg)
    elif args.compare:
        raise ArgumentError("--compare", "a CHECKPOINT (the comparison starts a server per scheduler)", None,
                            found_text="no CHECKPOINT")  # fmt: skip
    try:  # openpi's client is the load generator: an optional dependency (its numpy<2 pin stays out of the core)
        from vla_rt.serve import loadtest_run as lt
    except ImportError as e:
        raise ImportError(f"vla-rt loadtest runs openpi's client ({e}): pip install 'vla-rt[loadtest]' (or "
                          "`pip install --no-deps openpi-client` to keep your numpy)") from None  # fmt: skip
    out = args.out or Path("runs/loadtest") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    check_out_dir(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    compare = (
        {s: server_flags(args, scheduler=s, admission=False) for s in args.compare_schedulers} if args.compare else {}
    )
    result = lt.run_loadtest(args.checkpoint, host=args.host, port=args.port, robots=args.robots, rate=args.rate,
                             seconds=args.seconds, api_key=_api_key(args), profile=args.profile, out=out,
                             startup_timeout=args.startup_timeout, flags=server_flags(args), compare=compare,
                             compare_robots=args.compare or (),
                             command=shlex.join(["vla-rt", *sys.argv[1:]]))  # fmt: skip
    rounds, compare_runs = result["rounds"], result["compare"]
    everything = [*rounds, *(r for c in compare_runs.values() for r in c["rounds"])]
    return 1 if any(r["errors"] for r in everything) else 0
