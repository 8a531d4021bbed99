"""The tuner's run: pre-compile the candidates in a worker pool, time them shape by shape in priority order within
a budget, and write the winners into the GPU's launch table (`configs/<gpu-name>.json`), so a 10-minute GPU call
keeps whatever it measured.

`tune()` works in two phases: **pre-compilation** in spawned worker processes (`precompile.py`: every candidate
launched once on exactly the timing phase's inputs, so Triton's cache holds every binary; failures and hangs are
never launched again), then **timing** in this one process, never concurrently (`measure.py`). Shapes go in
priority order (expert GEMMs at M = 64 then 51, expert attention, VLM GEMMs, SigLIP GEMMs, the rest) and in waves
of that order; `budget_s` stops gracefully, and the table is rewritten after every shape. Each measured entry keeps
its time (`us`), cuBLAS's or SDPA's (`torch_us`), the time of the config it replaced (`seed_us`) and
`"src": "tune"`; entries seeded from the heuristics say `"src": "seed"`.

    vla-rt tune --quick --budget-s 480 --log benchmarks/raw/tune_log.json     # = python -m vla_rt.triton_kernels.tuning
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from vla_rt.arguments import LIMITS, positive_seconds
from vla_rt.errors import ArgumentError

from ..attention_configs import _attention_config_cuda, attention_heuristic, attention_key
from ..launch_configs import (
    _gemm_config_cuda,
    dump_table,
    gemm_heuristic,
    gemm_key,
    load_table,
    table_path,
    tile_columns,
)
from ..shapes import AttentionShape, GemmShape, pi0_attention_shapes, pi0_gemm_shapes
from .candidates import ATTENTION_GROUPS, GROUPS, TuneItem, candidates_for, compile_key, plan_items, waves
from .measure import ContextLost, graph_timer, measure_item
from .precompile import STALL_S, Precompiler

__all__ = ["best_entry", "estimate_seconds", "main", "merge_entry", "run_plan", "seed_table", "tune", "tune_on"]

# Estimates for the H200 box (16 cores): one Triton compile on one core, timing one candidate, one shape's setup.
COMPILE_S = 2.0
TIME_S = 0.05
SHAPE_S = 0.6
STARTUP_S = 15.0


def best_entry(record: dict, seed: dict | None = None) -> dict | None:
    """The table entry for a measured record: the fastest candidate's config with `us`, `torch_us`, `seed_us` (the
    time of `seed`, the config it replaces, when that was timed) and how many candidates were timed."""
    timed = [c for c in record["candidates"] if "us" in c]
    if not timed:
        return None
    best = min(timed, key=lambda c: c["us"])
    entry = {k: v for k, v in best.items() if k != "us"}
    entry["us"] = best["us"]
    for key in ("torch_us", "cublas_us"):  # cuBLAS plain, and with the shape's epilogue where one call does it
        if key in record:
            entry[key] = record[key]
    if seed is not None:
        seed_times = [c["us"] for c in timed if {k: c[k] for k in seed if k in c} == seed]
        if seed_times:
            entry["seed_us"] = seed_times[0]
    entry["candidates"] = len(timed)
    entry["src"] = "tune"
    return entry


def merge_entry(table: dict, kind: str, dtype_name: str, key: str, entry: dict) -> dict:
    """Put a measured entry into a table (in place): it replaces whatever was there."""
    table.setdefault(kind, {}).setdefault(dtype_name, {})[key] = entry
    return table


# ---------------------------------------------------------------------------------------------- estimates


def estimate_seconds(
    items: Sequence[TuneItem],
    configs: dict[TuneItem, list],
    workers: int,
    *,
    overlap: bool = False,
    compile_s: float = COMPILE_S,
    time_s: float = TIME_S,
    shape_s: float = SHAPE_S,
    startup_s: float = STARTUP_S,
) -> dict:
    """Rough wall-clock of `tune` for these items: unique compiles spread over the workers, plus timing."""
    keys = {compile_key(it, c) for it in items for c in configs[it]}
    compile_total = len(keys) * compile_s / max(1, workers)
    timing = sum(shape_s + len(configs[it]) * time_s for it in items)
    total = startup_s + (
        max(compile_total, timing) + min(compile_total, timing) * 0.1 if overlap else compile_total + timing
    )
    return {"compiles": len(keys), "candidates": sum(len(v) for v in configs.values()), "compile_s": compile_total,
            "timing_s": timing, "total_s": total}  # fmt: skip


# ------------------------------------------------------------------------------------------------- driver


def run_plan(
    items: Sequence[TuneItem],
    configs: dict[TuneItem, list],
    measure: Callable[[TuneItem, list, float], dict],
    on_record: Callable[[TuneItem, dict], None],
    *,
    budget_s: float | None = None,
    precompiler=None,
    overlap: bool = False,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    start: float | None = None,
    stall_s: float = STALL_S,
) -> dict:
    """The orchestration, free of CUDA (tests drive it with fakes): for each wave, pre-compile its candidates (all
    waves at once with `overlap`), wait for them, then `measure` each item in priority order and hand the record to
    `on_record`. Stops when `budget_s` is spent (also while waiting for compiles). Pre-compiles that make no
    progress for `stall_s` are abandoned (`precompiler.abandon`) and their candidates skipped. Returns a summary."""
    start = clock() if start is None else start
    deadline = start + budget_s if budget_s is not None else math.inf
    done, stopped = [], None

    def elapsed() -> str:
        return f"[{clock() - start:7.1f}s]"

    def wait(futures) -> bool:
        last = progressed = clock()
        while futures:
            left = deadline - clock()
            if left <= 0:
                return False
            poll = min(10.0, left, max(0.05, stall_s))
            finished, futures = cf.wait(futures, timeout=poll, return_when=cf.ALL_COMPLETED)
            futures = list(futures)
            if finished:
                progressed = clock()
            elif futures and clock() - progressed >= stall_s:
                log(f"{elapsed()} pre-compile: {len(futures)} kernels made no progress for {stall_s:.0f} s; "
                    "abandoned (their candidates count as failed)")  # fmt: skip
                precompiler.abandon(futures)
                return True
            if futures and clock() - last >= 9.5:
                last = clock()
                n_done, n_all = precompiler.progress()
                secs = precompiler.seconds
                avg = f", {sum(secs) / len(secs):.1f} s a launch+compile" if secs else ""
                log(f"{elapsed()} pre-compile {n_done}/{n_all} done{avg}")
        return True

    plan = waves(items)
    try:
        if precompiler is not None and overlap:
            for wave in plan:
                for it in wave:
                    precompiler.submit(it, configs[it])
        for w, wave in enumerate(plan):
            if precompiler is not None:
                if not overlap:
                    for it in wave:
                        precompiler.submit(it, configs[it])
                    pending = [f for it in wave for f in precompiler.pending(it, configs[it])]
                    if pending:
                        log(f"{elapsed()} wave {w + 1}/{len(plan)}: pre-compiling {len(pending)} kernels")
                    if not wait(pending):
                        stopped = f"budget reached while pre-compiling wave {w + 1}"
                        break
                    n_done, n_all = precompiler.progress()
                    log(f"{elapsed()} wave {w + 1}/{len(plan)}: pre-compiled ({n_done}/{n_all} in all), timing")
            for it in wave:
                if clock() >= deadline:
                    stopped = "budget reached"
                    break
                if precompiler is not None and overlap and not wait(precompiler.pending(it, configs[it])):
                    stopped = f"budget reached while pre-compiling {it.label}"
                    break
                record = measure(it, configs[it], deadline)
                done.append(it)
                on_record(it, record)
            if stopped:
                break
    except ContextLost as e:
        stopped = str(e)
    finally:
        if precompiler is not None:
            precompiler.shutdown()
    if stopped:
        log(f"{elapsed()} stopped: {stopped}; {len(done)}/{len(items)} shapes measured")
    return {"done": done, "stopped": stopped, "elapsed_s": clock() - start}


def _fmt_cfg(c: dict) -> str:
    if "block_k" in c:
        out = f"{c['block_m']}/{c['block_n']}/{c['block_k']} sk{c['split_k']}"
    else:
        out = f"{c['block_m']}/{c['block_n']} hpp{c['heads_per_program']} split{c['num_splits']}"
    comb = f" comb{c.get('combine', 0)}" if c.get("split_k", c.get("num_splits", 1)) > 1 else ""
    return out + comb + f" w{c['num_warps']} s{c['num_stages']}" + (f" tma{c['tma']}" if c.get("tma") else "")


def tune(
    shapes: Iterable[GemmShape] | None = None,
    gpu_name: str | None = None,
    *,
    attention_shapes: Iterable[AttentionShape] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    path=None,
    quick: bool = False,
    verbose: bool = True,
    groups: Sequence[str] = GROUPS,
    views: Sequence[int] = (1, 2, 3),
    prompts: Sequence[int] = (0, 20),
    chunks: Sequence[int] = (63, 50),
    batches: Sequence[int] = (1,),
    budget_s: float | None = None,
    workers: int | None = None,
    overlap: bool = False,
    max_candidates: int | None = None,
    log_path=None,
    tma_modes: Sequence[int] | None = None,
) -> dict:
    """Time candidates for the π0 GEMM / attention shapes selected by `groups` ("expert", "vlm", "siglip",
    "attention", or "expert_attention" / "prefix_attention" / "siglip_attention"), `views`, `prompts`,
    `chunks` and `batches` (the server's bucket sizes: M times B) on this GPU, and write the winners into the
    table (`path`, default the GPU's table in configs/; starting from it). Returns the table.

    quick: about 20 candidates a shape (cost-model ranked, structurally spread) instead of about 100;
    max_candidates overrides either. budget_s: wall-clock limit; tuning stops gracefully and keeps what was
    measured (the table is rewritten after every shape). workers: pre-compilation processes (default: cores - 1;
    0 compiles in this process while timing). overlap: time a wave while later waves compile (faster, slightly
    noisier). Timing: CUDA Graph replays with L2 defeated by weight copies (`measure.graph_timer`). log_path: every
    candidate's time as JSON. `shapes` / `attention_shapes` replace the π0 lists. tma_modes: only GEMM candidates
    with these `GemmConfig.tma` values (0 = the pointer kernel; e.g. leave out a mode this Triton hangs on)."""
    start = time.monotonic()
    if not torch.cuda.is_available():
        raise RuntimeError("tune needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    return tune_on(
        device, torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count,
        graph_timer, start=start, shapes=shapes, gpu_name=gpu_name,
        attention_shapes=attention_shapes, dtype=dtype, path=path, quick=quick, verbose=verbose, groups=groups,
        views=views, prompts=prompts, chunks=chunks, batches=batches, budget_s=budget_s, workers=workers,
        overlap=overlap, timer_name="graph", max_candidates=max_candidates, log_path=log_path, tma_modes=tma_modes,
    )  # fmt: skip


def tune_on(device, device_name: str, num_sms: int, time_fn, *, start: float, shapes, gpu_name, attention_shapes, dtype,
          path, quick, verbose, groups, views, prompts, chunks, budget_s, workers, overlap, timer_name,
          max_candidates, log_path, tma_modes=None, batches=(1,)) -> dict:  # fmt: skip
    """`tune` on a given device with a given timer (a CPU test drives it in the interpreter with a fake timer)."""
    gpu = (gpu_name or device_name).strip().replace(" ", "-")
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    dname = str(dtype).removeprefix("torch.")
    path = Path(path) if path is not None else table_path(gpu)
    base = path if path.exists() else table_path(gpu)
    table = json.loads(base.read_text()) if base.exists() else {}
    table["gpu"] = device_name
    table["source"] = (
        f"tune() on {table['gpu']}, {datetime.date.today().isoformat()}, {timer_name} timing; entries without "
        '"src": "tune" are seeded from the launch_configs heuristics'
    )
    items = plan_items(
        groups, views, prompts, chunks, batches=batches, shapes=shapes, attention_shapes=attention_shapes
    )
    configs, seeds = {}, {}
    for it in items:
        s = it.shape
        if it.kind == "gemm":
            cur = _gemm_config_cuda(s.m, s.n, s.k, s.gated, dtype, gpu, num_sms, s.rope)
        else:
            cur = _attention_config_cuda(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, dtype, gpu, num_sms)
        seeds[it] = cur.to_dict()
        configs[it] = candidates_for(it, quick, max_candidates, cur, num_sms)
        if tma_modes is not None and it.kind == "gemm":
            configs[it] = [c for c in configs[it] if c.tma in tma_modes or c == cur]  # the incumbent stays
    cores = os.cpu_count() or 2
    workers = max(0, min(16, cores - 1)) if workers is None else workers
    est = estimate_seconds(items, configs, workers, overlap=overlap)
    say = print if verbose else (lambda *_, **__: None)
    say(
        f"tune: {len(items)} shapes, {est['candidates']} candidates, {est['compiles']} distinct kernels on "
        f"{workers} workers; estimated {est['total_s']:.0f} s ({est['compile_s']:.0f} s compiling"
        f"{' alongside' if overlap else ' +'} {est['timing_s']:.0f} s timing)"
        + (f", budget {budget_s:.0f} s" if budget_s is not None else ""),
        flush=True,
    )
    precompiler = Precompiler(workers, str(device), dname) if workers else None
    log_records: list[dict] = []
    summary_rows: list[tuple] = []

    def status(item, cfg):
        return precompiler.status(item, cfg) if precompiler is not None else (None, "")

    def measure(item, cands, deadline):
        return measure_item(item, cands, dtype, time_fn, deadline, status, device)

    def on_record(item, record):
        entry = best_entry(record, seeds[item])
        log_records.append(record)
        if entry is not None:
            merge_entry(table, item.kind, dname, item.key, entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump_table(table))
        if log_path is not None:
            Path(log_path).write_text(json.dumps({"gpu": table["gpu"], "records": log_records}, indent=1) + "\n")
        n_err = sum("error" in c for c in record["candidates"])
        t_str = f"{entry['us']:7.2f} us ({_fmt_cfg(entry)})" if entry else "no candidate ran"
        seed_str = f"seed {entry['seed_us']:.2f}" if entry and "seed_us" in entry else "seed n/a"
        summary_rows.append((item, entry))
        say(
            f"[{time.monotonic() - start:7.1f}s] {len(log_records)}/{len(items)} {item.label:<40} {t_str} | "
            f"{seed_str} | torch {record.get('torch_us', float('nan')):.2f} | {len(record['candidates'])} cand, "
            f"{n_err} failed, {record['compiled_here']} compiled here" + (" | CUT BY BUDGET" if record.get("cut_by_budget") else ""),
            flush=True,
        )  # fmt: skip

    result = run_plan(items, configs, measure, on_record, budget_s=budget_s, precompiler=precompiler,
                      overlap=overlap, log=lambda m: say(m, flush=True), start=start)  # fmt: skip
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    if verbose:
        _print_summary(summary_rows)
        say(f"tune: {len(result['done'])}/{len(items)} shapes in {result['elapsed_s']:.0f} s; wrote {path}")
    return table


def _print_summary(rows: list[tuple]) -> None:
    by_group: dict[str, list[float]] = {}
    for item, entry in rows:
        if entry is None:
            continue
        g = by_group.setdefault(item.group, [0.0, 0.0, 0.0, 0])
        g[0] += entry["us"]
        g[1] += entry.get("seed_us", float("nan"))
        g[2] += entry.get("torch_us", float("nan"))
        g[3] += 1
    print(f"{'group':<18} {'shapes':>6} {'tuned us':>10} {'seed us':>10} {'torch us':>10}")
    for g, (t, sd, tt, n) in by_group.items():
        print(f"{g:<18} {n:>6} {t:10.1f} {sd:10.1f} {tt:10.1f}")


# ------------------------------------------------------------------------------------------------ seeding


def seed_table(
    gpu: str = "NVIDIA-H200", num_sms: int = 132, dtype: torch.dtype = torch.bfloat16, *, reseed: bool = False
) -> dict:
    """Fill a table's π0 entries from the heuristics (no GPU needed; `tune` later replaces them), marked
    `"src": "seed"`. `reseed` also replaces earlier seeds; measured entries (`"src": "tune"`) are always kept."""
    path = table_path(gpu)
    table = json.loads(path.read_text()) if path.exists() else {"gpu": gpu.replace("-", " ")}
    table["source"] = (
        "seeded from the launch_configs heuristics (cost models calibrated on the first H200 run), "
        '"src": "seed"; entries with "src": "tune" are measured by tune()'
    )
    dname, elem = str(dtype).removeprefix("torch."), torch.tensor([], dtype=dtype).element_size()

    def put(entries: dict, key: str, cfg) -> None:
        old = entries.get(key)
        if old is None or (reseed and old.get("src") != "tune" and "us" not in old):
            entries[key] = {**cfg.to_dict(), "src": "seed"}

    gemms = table.setdefault("gemm", {}).setdefault(dname, {})
    for s in pi0_gemm_shapes(chunks=(50, 63)):
        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        put(gemms, gemm_key(s.m, s.n, s.k, s.gated, rope=s.rope),
            gemm_heuristic(s.m, n_cols, s.k, gated=paired, elem_bytes=elem, num_sms=num_sms))  # fmt: skip
    attns = table.setdefault("attention", {}).setdefault(dname, {})
    for s in pi0_attention_shapes():
        put(attns, attention_key(s.b, s.tq, s.tk, s.hq, s.hkv, s.d),
            attention_heuristic(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, num_sms=num_sms))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(table))
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    return table


# -------------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _ints_within(limit: str) -> Callable[[str], tuple[int, ...]]:
    """An option type: comma-separated integers in `LIMITS[limit]` (the range an engine is built for), so a bad
    `--views 0` is a usage error (exit 2) on any machine, not a failure minutes into a GPU call."""
    lo, hi = LIMITS[limit]

    def parse(text: str) -> tuple[int, ...]:
        expected = f"comma-separated integers in [{lo}, {hi}]"
        try:
            values = _ints(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, found {text!r}") from None
        if not values or not all(lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"expected {expected}, found {text!r}")
        return values

    return parse


def _groups(text: str) -> tuple[str, ...]:
    known = GROUPS + ATTENTION_GROUPS
    groups = tuple(g.strip() for g in text.split(",") if g.strip())
    if not groups or not set(groups) <= set(known):
        raise argparse.ArgumentTypeError(f"expected comma-separated names from {list(known)}, found {text!r}")
    return groups


def _count(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, found {text!r}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    """The tuner's command line (`vla-rt tune ...`): every option is checked before the GPU is looked for."""
    p = argparse.ArgumentParser(
        prog="vla-rt tune", description="Autotune the Triton launch configs of the π0 kernels on this GPU."
    )
    p.add_argument("--quick", action="store_true", help="about 20 candidates a shape instead of about 100")
    p.add_argument("--groups", type=_groups, default=GROUPS,
                   help="expert,vlm,siglip,attention (or expert_attention, ...)")  # fmt: skip
    p.add_argument("--views", type=_ints_within("num_views"), default=(1, 2, 3))
    p.add_argument("--prompts", type=_ints_within("prompt_len"), default=(0, 20))
    p.add_argument("--chunks", type=_ints_within("chunk"), default=(63, 50))
    p.add_argument("--batches", type=_ints_within("batch_size"), default=(1,),
                   help="batch sizes the engines are built for (server buckets: 1,2,4,8)")  # fmt: skip
    p.add_argument("--budget-s", type=positive_seconds, default=None, help="wall-clock limit; keeps what was measured")
    p.add_argument("--workers", type=_count(0), default=None, help="pre-compilation processes (default cores - 1)")
    p.add_argument("--overlap", action="store_true", help="time while later waves compile")
    p.add_argument("--max-candidates", type=_count(1), default=None)
    p.add_argument("--gpu-name", default=None, help="table to write (default: this GPU's name)")
    p.add_argument("--out", default=None, help="table path (default: configs/<gpu>.json); starts from the shipped one")
    p.add_argument("--log", default=None, help="write every candidate's time here (JSON)")
    p.add_argument(
        "--tma-modes",
        default=None,
        help="GEMM candidates only with these config.tma values (and the incumbent), e.g. 0,1,2",
    )
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise ArgumentError("device", "a CUDA GPU for vla-rt tune (launch configs are per GPU)", "no CUDA device")
    tune(gpu_name=a.gpu_name, quick=a.quick, groups=a.groups, views=a.views,
         prompts=a.prompts, chunks=a.chunks, batches=a.batches, budget_s=a.budget_s,
         workers=a.workers, overlap=a.overlap,
         max_candidates=a.max_candidates, path=a.out, log_path=a.log,
         tma_modes=_ints(a.tma_modes) if a.tma_modes else None)  # fmt: skip
    return 0
