"""The `vla-rt` command line.

Each subcommand is a pair of small functions, `_<name>_args(parser)` to declare its options and `cmd_<name>(args)`
to run it (returning an exit code), registered in `COMMANDS`; `build_parser` is the only place the parser is
assembled. To add a subcommand, write the pair and add one line to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vla_rt.checkpoints import CheckpointError, load_checkpoint, save_native
from vla_rt.checkpoints.norm_stats import NormStatsError
from vla_rt.checkpoints.summary import describe_config, format_summary, human_bytes, summarize
from vla_rt.config import preset
from vla_rt.serve.cli_args import cmd_loadtest, cmd_serve, loadtest_args, serve_args

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "keep": None}
# Errors a user can fix (bad path, bad file, missing extra); anything else is a bug and keeps its traceback.
USER_ERRORS = (CheckpointError, NormStatsError, FileNotFoundError, FileExistsError, ImportError, RuntimeError)


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="openpi checkpoint dir, LeRobot π0 dir, native file, or random:<preset>[:seed]")
    p.add_argument("dst", type=Path, help="output .safetensors file (vla-rt native format)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="stored dtype (keep: as in src)")
    p.add_argument("--asset-id", help="openpi assets/<asset_id> whose norm stats to include (needed if several)")
    p.add_argument("--force", action="store_true", help="overwrite dst if it exists")


def cmd_convert(args: argparse.Namespace) -> int:
    """Any supported checkpoint -> one native .safetensors file (weights, dims, source, norm stats)."""
    if args.dst.suffix != ".safetensors":
        raise FileNotFoundError(f"dst {args.dst} must be a file ending in .safetensors")
    if args.dst.exists() and not args.force:
        raise FileExistsError(f"{args.dst} exists; pass --force to overwrite it")
    start = time.perf_counter()
    dtype = DTYPES[args.dtype]
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
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary, ckpt.config))
    if args.passes:
        from vla_rt.graph_passes import format_report_table

        print("\ngraph passes, per inference (chunk 63, prompt 0, 10 steps; vs the eager reference graph):")
        print(format_report_table(ckpt.config))
    return 0


def _parse_cases(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        return tuple(tuple(int(x) for x in case.split(",")) for case in text.split(";") if case)  # type: ignore[misc]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cases: expected 'views,prompt,chunk;...', found {text!r}") from None


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("pi0", "pi05"),
                   help="π0 or π0.5 (default preset: pi0 / pi05 on CUDA, tiny / tiny_pi05 on CPU)")  # fmt: skip
    p.add_argument("--preset", help="model dims (default: by --model; pi0 on CUDA, tiny on CPU)")
    p.add_argument(
        "--cases", type=_parse_cases, help="'views,prompt,chunk;...' (default: 1/2/3 views × (0,63),(20,50))"
    )
    p.add_argument("--backends", help="comma-separated (default: all for the device)")
    p.add_argument("--iters", type=int, help="timed calls per row (default 200 on CUDA, 20 on CPU)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--compile-budget", type=float, default=420.0, help="seconds for the torch.compile row")
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
    from vla_rt.bench.latency import CPU_BACKENDS, CUDA_BACKENDS, BenchConfig, run_benchmark, write_results

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.preset and args.model and preset(args.preset).pi05 != (args.model == "pi05"):
        print(f"vla-rt bench: error: --preset {args.preset!r} is not a {args.model} preset (--model {args.model})",
              file=sys.stderr)  # fmt: skip
        return 2
    default_preset = {"pi0": ("tiny", "pi0"), "pi05": ("tiny_pi05", "pi05")}[args.model or "pi0"][cuda]
    cfg = BenchConfig(
        preset=args.preset or default_preset,
        backends=tuple(args.backends.split(",")) if args.backends else (CUDA_BACKENDS if cuda else CPU_BACKENDS),
        iters=args.iters or (200 if cuda else 20),
        warmup=args.warmup if cuda else min(args.warmup, 3),
        compile_budget_s=args.compile_budget,
        compile_coordinate_descent=not args.compile_no_coordinate_descent,
        **({"out_dir": args.out} if args.out else {}),
    )
    if args.compile_cases:
        cfg.compile_cases = args.compile_cases
    if args.cases:
        cfg.cases = args.cases
    if not cuda:
        print(f"no CUDA device: timing the CPU backends {cfg.backends} on the {cfg.preset!r} preset (wall clock)")
    result = run_benchmark(cfg, device)
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


def cmd_tune(args: argparse.Namespace) -> int:
    """Autotune the Triton launch configs of every π0 GEMM/attention shape on this GPU and store the table."""
    if not torch.cuda.is_available():
        raise RuntimeError("vla-rt tune needs a CUDA GPU (launch configs are per GPU)")
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (run, add_args, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as e:
        print(f"vla-rt {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
