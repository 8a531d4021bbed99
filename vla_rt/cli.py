"""The `vla-rt` command line.

Each subcommand is a pair of small functions, `_<name>_args(parser)` to declare its options and `cmd_<name>(args)`
to run it (returning an exit code), registered in `COMMANDS`; `build_parser` is the only place the parser is
assembled. To add a subcommand, write the pair and add one line to `COMMANDS`.

Errors: options are checked by their argparse `type=` functions (`positive_int`, `cases`, ...: argparse prints the
usage line and exits 2). A user-fixable error while running (`vla_rt.errors.VlaRtError`, a file-system error, a
missing extra) prints `vla-rt <command>: error: <message>` alone and exits 2; anything else is a bug and prints one
line saying so (exit 1). `--debug` (before or after the command) shows the traceback instead. A closed stdout
(`vla-rt info ... | head -1`) ends quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vla_rt.arguments import LIMITS, check_out_dir, positive_seconds
from vla_rt.checkpoints import check_destination, load_checkpoint, read_runnable_header, save_native
from vla_rt.checkpoints.summary import describe_config, format_summary, human_bytes, summarize
from vla_rt.config import PRESETS, preset
from vla_rt.errors import ArgumentError, VlaRtError
from vla_rt.serve.cli_args import cmd_loadtest, cmd_serve, loadtest_args, serve_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "keep": None}
# Errors a user can fix (a bad file, argument or input; the file system; a missing extra): the message alone.
USER_ERRORS = (VlaRtError, OSError, ImportError)
# p90 this many times the median: other processes took the CPU/GPU during the run; a quiet machine gives ~1.1-1.5x.
NOISY_P90_RATIO = 3.0


# ----- option types: argparse turns their ArgumentTypeError into a usage error (exit 2, no traceback) ---------------
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {value}")
    return value


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="openpi checkpoint dir, LeRobot π0 dir, native file, or random:<preset>[:seed]")
    p.add_argument("dst", type=Path, help="output .safetensors file (vla-rt native format)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="stored dtype (keep: as in src)")
    p.add_argument("--asset-id", help="openpi assets/<asset_id> whose norm stats to include (needed if several)")
    p.add_argument("--force", action="store_true", help="overwrite dst if it exists")


def cmd_convert(args: argparse.Namespace) -> int:
    """Any supported checkpoint -> one native .safetensors file (weights, dims, source, norm stats)."""
    if args.dst.suffix != ".safetensors":
        raise ArgumentError("dst", "a file name ending in .safetensors", str(args.dst))
    if args.dst.is_dir():
        raise ArgumentError("dst", "a file name ending in .safetensors, not a directory", str(args.dst))
    if args.dst.exists() and not args.force:
        raise FileExistsError(f"{args.dst} exists; pass --force to overwrite it")
    if args.dst.exists() and Path(args.src).exists() and args.dst.resolve() == Path(args.src).resolve():
        raise ArgumentError("dst", "a different file than src (it is read while dst is written)", str(args.dst))
    check_destination(args.dst)  # before reading anything: a path that cannot be written fails now, not after
    start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    # several openpi assets and none chosen: refused from the header, before the weights are read (the native file
    # would carry no stats and no trace that there were any, so every policy on it would run in normalised units)
    read_runnable_header(args.src, asset_id=args.asset_id, what="a native vla-rt file")  # no field for relative actions
    ckpt = load_checkpoint(args.src, dtype, asset_id=args.asset_id, progress=True)
    save_native(
        args.dst,
        ckpt.weights,
        ckpt.config,
        source=ckpt.origin or ckpt.source,
        norm_stats=ckpt.norm_stats,
        use_quantile_norm=ckpt.use_quantile_norm,
        progress=True,
    )
    total = sum(t.numel() for t in ckpt.weights.values())
    print(f"converted {ckpt.format} checkpoint {ckpt.source}")
    print(
        f"  -> {args.dst} ({human_bytes(args.dst.stat().st_size)}, {len(ckpt.weights)} tensors, {total:,} parameters, dtype {args.dtype})"
    )
    for line in describe_config(ckpt.config):
        print(f"  {line}")
    print(f"  norm stats: {', '.join(sorted(ckpt.norm_stats)) if ckpt.norm_stats else 'none'}")
    for note in ckpt.notes:
        print(f"  note: {note}")
    print(f"  took {time.perf_counter() - start:.1f} s")
    return 0


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "ckpt", nargs="?", default="random:pi0",
        help="openpi checkpoint dir, LeRobot π0 dir, native file, or random:<preset>[:seed] (default: random:pi0)",
    )  # fmt: skip
    p.add_argument("--passes", action="store_true", help="also print what the graph passes save at 1/2/3 views")
    p.add_argument("--asset-id", help="openpi assets/<asset_id> whose norm stats to report")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def cmd_info(args: argparse.Namespace) -> int:
    """Format, inferred dims, parameters per part, bytes in bf16/fp32, norm stats; reads shapes only, no data."""
    ckpt = load_checkpoint(args.ckpt, None, asset_id=args.asset_id, shapes_only=True)
    summary = summarize(ckpt)
    chunk = ckpt.config.chunk  # the checkpoint's own action horizon
    if args.json:  # one JSON document on stdout: the passes go inside it, never as a table after it
        if args.passes:
            from vla_rt.graph_passes import report_rows

            passes = report_rows(ckpt.config, chunk=chunk)
            summary["graph_passes"] = {"chunk": chunk, "prompt_len": 0, "num_steps": 10, "passes": passes}
        print(json.dumps(summary, indent=2))
        return 0
    print(format_summary(summary, ckpt.config))
    if args.passes:
        from vla_rt.graph_passes import format_report_table

        print(f"\ngraph passes, per inference (chunk {chunk}, prompt 0, 10 steps; vs the eager reference graph):")
        print(format_report_table(ckpt.config, chunk=chunk))
    return 0


def _parse_cases(text: str) -> tuple[tuple[int, int, int], ...]:
    """'views,prompt,chunk;...' -> cases, each number in the range a model can be built for."""
    usage = "expected 'views,prompt,chunk;...' e.g. '1,0,63;2,20,50'"
    cases = []
    for case in (c.strip() for c in text.split(";")):
        if not case:
            continue
        parts = case.split(",")
        try:
            numbers = tuple(int(x) for x in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{usage}, found {case!r} (not integers)") from None
        if len(numbers) != 3:
            raise argparse.ArgumentTypeError(f"{usage}, found {case!r} ({len(numbers)} numbers, not 3)")
        for name, value in zip(("num_views", "prompt_len", "chunk"), numbers):
            lo, hi = LIMITS[name]
            if not lo <= value <= hi:
                raise argparse.ArgumentTypeError(f"{usage}, found {case!r}: {name} {value} is outside [{lo}, {hi}]")
        cases.append(numbers)
    if not cases:
        raise argparse.ArgumentTypeError(f"{usage}, found {text!r} (no case)")
    return tuple(cases)  # type: ignore[return-value]


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("pi0", "pi05"),
                   help="π0 or π0.5 (default preset: pi0 / pi05 on CUDA, tiny / tiny_pi05 on CPU)")  # fmt: skip
    p.add_argument(
        "--preset", choices=sorted(PRESETS), help="model dims (default: by --model; pi0 on CUDA, tiny on CPU)"
    )
    p.add_argument(
        "--cases", type=_parse_cases, help="'views,prompt,chunk;...' (default: 1/2/3 views × (0,63),(20,50))"
    )
    p.add_argument("--backends", help="comma-separated (default: all for the device)")
    p.add_argument("--iters", type=positive_int, help="timed calls per row (default 200 on CUDA, 20 on CPU)")
    p.add_argument("--warmup", type=non_negative_int, default=20)
    p.add_argument("--compile-budget", type=positive_seconds, default=420.0, help="seconds for the torch.compile row")
    p.add_argument(
        "--compile-cases", type=_parse_cases, help="cases that get the torch.compile row (default: the first)"
    )
    p.add_argument(
        "--compile-no-coordinate-descent",
        action="store_true",
        help="torch.compile row: max-autotune without its coordinate-descent tuning (π0 cold: ~11 min on the H200)",
    )
    p.add_argument("--out", type=Path, help="where JSON/Markdown/PNG go (default: a new run folder under "
                   "benchmarks/raw/; benchmarks/results updates the committed summaries)")  # fmt: skip
    p.add_argument("--no-write", action="store_true", help="print only")


def cmd_bench(args: argparse.Namespace) -> int:
    """Latency of every backend at 1/2/3 views with CUDA events, beside the roofline (CPU: tiny preset)."""
    from vla_rt.bench.latency import BenchConfig, check_case_prompts, run_benchmark, write_results
    from vla_rt.experiment_config import bench_backends

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.preset and args.model and preset(args.preset).pi05 != (args.model == "pi05"):
        found = f"{args.preset!r} (not a {args.model} preset)"
        raise ArgumentError("--preset", f"a {args.model} preset (--model {args.model})", None, found_text=found)
    default_preset = {"pi0": ("tiny", "pi0"), "pi05": ("tiny_pi05", "pi05")}[args.model or "pi0"][cuda]
    requested = [b for b in args.backends.split(",") if b.strip()] if args.backends is not None else None
    backends = bench_backends(requested, cuda, "--backends", ArgumentError)
    cfg = BenchConfig(
        preset=args.preset or default_preset,
        backends=backends,
        iters=args.iters if args.iters is not None else (200 if cuda else 20),
        warmup=args.warmup if cuda else min(args.warmup, 3),
        compile_budget_s=args.compile_budget,
        compile_coordinate_descent=not args.compile_no_coordinate_descent,
        **({"out_dir": args.out} if args.out else {}),
    )
    if args.compile_cases:
        cfg.compile_cases = args.compile_cases
    if args.cases:
        cfg.cases = args.cases
    check_case_prompts(cfg.cases, cfg.preset, "--cases")
    if not args.no_write:
        check_out_dir(cfg.out_dir, "--out")
    if not cuda:
        print(f"no CUDA device: timing the CPU backends {cfg.backends} on the {cfg.preset!r} preset (wall clock)")
    result = run_benchmark(cfg, device)
    noisy = noisy_rows(result["rows"])
    if noisy:
        result["warnings"] = [noisy]
        print(f"warning: {noisy}", file=sys.stderr)
    if not args.no_write:
        for kind, path in write_results(result, cfg.out_dir).items():
            print(f"wrote {kind}: {path}")
    return 0


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "tune_args",
        nargs=argparse.REMAINDER,
        help="passed to the tuner, vla_rt.triton_kernels.tuning (--quick, --groups, --budget-s, --out, ...; see --help)",
    )


def noisy_rows(rows: list[dict]) -> str | None:
    """A warning when any timed row's p90 is NOISY_P90_RATIO x its median or more (the machine was busy)."""
    ratios = [(r["p90_ms"] / r["median_ms"], r) for r in rows if r.get("median_ms") and r.get("p90_ms") is not None]
    noisy = [(ratio, r) for ratio, r in ratios if ratio >= NOISY_P90_RATIO]
    if not noisy:
        return None
    worst, row = max(noisy, key=lambda x: x[0])
    return (
        f"noisy timings: p90 >= {NOISY_P90_RATIO:g}x the median in {len(noisy)} of {len(ratios)} rows (worst "
        f"{worst:.0f}x: {row['backend']} at {row['views']} views); other work shared this machine, so these numbers "
        "are not comparable: re-run on an idle machine"
    )


def cmd_tune(args: argparse.Namespace) -> int:
    """Autotune the Triton launch configs of every π0 GEMM/attention shape on this GPU and store the table. The tuner
    parses and checks its own options (`main` hands it everything after `tune`), then looks for the GPU."""
    from vla_rt.triton_kernels.tuning.run import main as tune_main

    return tune_main(args.tune_args) or 0


Command = tuple[Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None], str]
COMMANDS: dict[str, Command] = {
    "convert": (cmd_convert, _convert_args, "convert an openpi / LeRobot / random checkpoint to native .safetensors"),
    "info": (cmd_info, _info_args, "show a checkpoint's format, dims, parameter counts and norm stats"),
    "bench": (cmd_bench, _bench_args, "latency of every backend at 1/2/3 views beside the roofline"),
    "tune": (cmd_tune, _tune_args, "autotune Triton launch configs for this GPU"),
    "serve": (cmd_serve, serve_args, "serve a checkpoint to openpi robot clients (websocket), many robots one GPU"),
    "loadtest": (cmd_loadtest, loadtest_args, "N openpi-client robots against a server: requests/s, latency"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vla-rt", description="Real-time π0 inference: checkpoints, benchmarks, robots."
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (run, add_args, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=name != "tune")  # tune: the tuner's
        # SUPPRESS: the subcommand's default must not overwrite a `vla-rt --debug <command>` given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
        add_args(p)
        p.set_defaults(run=run)
    return parser


def _quiet_stdout() -> None:
    """After a reader closed our stdout (`| head -1`): point it at /dev/null so the exit-time flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (an in-process caller's captured stdout)
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "tune":  # `vla-rt tune --quick ...`: argparse's REMAINDER takes no leading option, so hand over
        args.tune_args = [a for a in argv[argv.index("tune") + 1 :] if a != "--debug"]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"vla-rt {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"vla-rt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line by default, the traceback with --debug
        if args.debug:
            raise
        print(
            f"vla-rt {args.command}: internal error: {type(e).__name__}: {e} "
            "(a bug in vla-rt: run again with --debug for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
