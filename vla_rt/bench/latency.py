"""The latency benchmark: views × (chunk, prompt) cases × backends in one run, beside the roofline and peers.

On CUDA (full π0, bf16, random weights): `reference` eager ("naive torch"), `reference+compile`
(torch.compile max-autotune, in a subprocess with a time budget), `cuda-graph-torch` (the engine's plan on torch
ops under one CUDA Graph) and `triton`; per-part breakdown (vision / VLM / one action-expert step) for the graphed
engines; the card's measured ceilings and the roofline per case. Without CUDA the same command runs the CPU
backends (`reference`, `folded`, `static-torch`) on the `tiny` preset, so it works anywhere. π0.5 (`--model pi05`:
presets `pi05` / `tiny_pi05`) runs the same cases and backends and writes `latency_pi05_<device>.*` beside π0's.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vla_rt.bench.report import latency_markdown, latency_plot, run_dir
from vla_rt.bench.roofline import Ceilings, measure_ceilings, pi0_roofline
from vla_rt.config import preset
from vla_rt.engine.static_engine import build_graphed_torch, build_triton
from vla_rt.errors import ArgumentError, FieldError
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.timing import Timing, time_calls, time_graph

# (views, prompt_len, chunk): the grid (chunk 63 + 1 state token = 64 rows for the expert)
DEFAULT_CASES = ((1, 0, 63), (2, 0, 63), (3, 0, 63), (1, 20, 50), (2, 20, 50), (3, 20, 50))
CUDA_BACKENDS = ("reference", "reference+compile", "cuda-graph-torch", "triton")
CPU_BACKENDS = ("reference", "folded", "static-torch")

# Peers measured on the same H200 (ANCHORS.md, 2026-11-29); not re-run here (their code is not in this repo).
PEERS_H200 = {
    "realtime-vla triton (published kernels)": {
        (1, 0, 63): 15.20, (2, 0, 63): 17.40, (3, 0, 63): 19.98, (1, 20, 50): 17.17, (2, 20, 50): 20.01,
        (3, 20, 50): 22.69,
    },
    "openpi JAX (bf16, jit)": {(3, 20, 50): 33.65},
    "LeRobot 0.6.1 PI0Pytorch": {(1, 20, 50): 362.0, (2, 20, 50): 299.0, (3, 20, 50): 324.0},
}  # fmt: skip


@dataclass
class BenchConfig:
    preset: str = "pi0"
    cases: tuple[tuple[int, int, int], ...] = DEFAULT_CASES
    backends: tuple[str, ...] = CUDA_BACKENDS
    iters: int = 200
    warmup: int = 20
    num_steps: int = 10
    seed: int = 0
    compile_budget_s: float = 420.0
    compile_cases: tuple[tuple[int, int, int], ...] = ((1, 0, 63),)
    compile_coordinate_descent: bool = True  # False: max-autotune without its coordinate-descent pass (compile_row)
    reference_iters: int = 30  # eager π0 is ~100x slower; fewer calls keep the run inside a lease
    max_seconds_per_row: float = 60.0
    out_dir: Path = field(default_factory=lambda: run_dir("bench"))  # (report.run_dir: git-ignored)
    extra: dict = field(default_factory=dict)


def check_case_prompts(
    cases: tuple[tuple[int, int, int], ...], preset_name: str, field: str, error: type[FieldError] = ArgumentError
) -> None:
    """Every case's prompt fits the preset's `max_token_len` (48 for π0): a longer one would fail as an InputError on
    'tokens' only after every row before it was timed. `field` names the option (`--cases`, or `cases` with its index
    appended) in the error."""
    limit = preset(preset_name).max_token_len
    for i, (views, prompt, chunk) in enumerate(cases):
        if prompt > limit:
            name = field if error is ArgumentError else f"{field}[{i}]"
            expected = f"prompt lengths of at most {limit} (the {preset_name!r} preset's max_token_len)"
            raise error(name, expected, None, found_text=f"{views},{prompt},{chunk} (prompt {prompt})")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    import platform

    return f"CPU-{platform.machine()}"


def random_inputs(cfg, case, device, seed):
    """(images, state, tokens or None, noise) of one call for case (views, prompt, chunk), batch 1, from `seed`."""
    views, prompt, chunk = case
    g = torch.Generator(device=device).manual_seed(seed)
    images = torch.rand(1, views, cfg.vision.image_size, cfg.vision.image_size, 3, generator=g, device=device) * 2 - 1
    state = torch.randn(1, cfg.action_dim, generator=g, device=device)
    tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g, device=device) if prompt else None
    noise = torch.randn(1, chunk, cfg.action_dim, generator=g, device=device)
    return images, state, tokens, noise


def part_timings(engine, device, iters: int) -> dict[str, dict]:
    """Times vision, VLM prefix and one expert step of a static engine's plan, each captured as its own CUDA Graph
    (launched eagerly without CUDA)."""
    plan, obs, slot, act, xa = engine.plan, engine.obs, engine.slot, engine.act, engine.xa
    parts = {
        "vision": lambda: plan.vision(obs, slot, act),
        "vlm": lambda: plan.prefix(obs, slot, act),
        "expert_step": lambda: plan.expert_step(slot, xa, 0, engine.num_steps),
    }
    out = {}
    for name, fn in parts.items():
        if device.type == "cuda":
            timing = time_graph(lambda i, fn=fn: fn(), replays=iters, device=device)
        else:
            timing = time_calls(fn, warmup=5, iters=iters, device=device)
        out[name] = timing.to_dict()
    return out


def _compile_row(case, cfg: BenchConfig, device) -> dict:
    """torch.compile(max-autotune) in a subprocess so that a compile that outruns its budget cannot stall the run."""
    cmd = [sys.executable, "-m", "vla_rt.bench.compile_row", "--preset", cfg.preset, "--case", ",".join(map(str, case)),
           "--iters", str(cfg.reference_iters), "--seed", str(cfg.seed),
           "--coordinate-descent", "on" if cfg.compile_coordinate_descent else "off"]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.compile_budget_s)
    except subprocess.TimeoutExpired as stopped:
        done = _progress(stopped.stderr)
        return {"skipped": f"compile + timing exceeded the {cfg.compile_budget_s:.0f} s budget"
                           + (f" ({'; '.join(done)})" if done else " (no part had finished compiling)")}  # fmt: skip
    if proc.returncode != 0:
        return {
            "skipped": f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
        }
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.perf_counter() - t0
    row["compile_progress"] = _progress(proc.stderr)
    return row


def _progress(stderr: str | bytes | None) -> list[str]:
    """compile_row's "compiled <part> in <s> s" lines from its (possibly partial) stderr."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    return [line.strip() for line in (stderr or "").splitlines() if line.startswith("compiled ")]


def run_benchmark(cfg: BenchConfig, device: torch.device, log=print) -> dict:
    """Runs every case × backend; returns the result dict (also what gets written as JSON)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model_cfg = preset(cfg.preset)
    ceilings = measure_ceilings(device) if cuda else None
    roof_c = Ceilings(ceilings["copy_bandwidth_bytes_per_s"], ceilings["bf16_matmul_flops_per_s"]) if cuda else None
    weights = random_weights(model_cfg, seed=cfg.seed, device=device)
    result = {
        "device": device_name(device),
        "model": "π0.5" if model_cfg.pi05 else "π0",
        "preset": cfg.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "num_steps": cfg.num_steps,
        "torch": torch.__version__,
        "ceilings": ceilings,
        "rows": [],
        # the peers' numbers are π0's (ANCHORS.md has no π0.5 row on the H200)
        "peers": {} if model_cfg.pi05 else {name: {",".join(map(str, k)): v for k, v in rows.items()}
                                              for name, rows in PEERS_H200.items()},
    }  # fmt: skip
    for case in cfg.cases:
        views, prompt, chunk = case
        roof = pi0_roofline(model_cfg, views, chunk, prompt, cfg.num_steps, roof_c) if cuda else None
        anchor_roof = pi0_roofline(model_cfg, views, chunk, prompt, cfg.num_steps)
        images, state, tokens, noise = random_inputs(model_cfg, case, device, cfg.seed + 1)
        for backend in cfg.backends:
            row = {"views": views, "prompt_len": prompt, "chunk": chunk, "backend": backend,
                   "roofline_ms": roof.total_ms if roof else None, "roofline_anchor_ms": anchor_roof.total_ms}  # fmt: skip
            if backend == "reference+compile":
                row.update(_compile_row(case, cfg, device) if case in cfg.compile_cases else
                           {"skipped": "not among the compile cases (each costs minutes of compiling)"})  # fmt: skip
            else:
                row.update(_time_backend(backend, model_cfg, weights, case, (images, state, tokens, noise), cfg, device,
                                         dtype))  # fmt: skip
            if roof and "median_ms" in row:
                row["x_roofline"] = row["median_ms"] / roof.total_ms
            log(_row_line(row))
            result["rows"].append(row)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return result


def _time_backend(backend, model_cfg, weights, case, inputs, cfg: BenchConfig, device, dtype) -> dict:
    views, prompt, chunk = case
    images, state, tokens, noise = inputs
    shapes = BuiltShapes(views, chunk, prompt or None, 1)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        held_before = torch.cuda.memory_allocated(device)  # the fp32 source weights every backend is built from
    t0 = time.perf_counter()
    engine = None
    if backend in ("reference", "folded"):
        model = build_pi0(weights, model_cfg, backend=backend, device=device, dtype=dtype, chunk=chunk)

        def call():
            return model.sample_actions(images, state, tokens, noise, cfg.num_steps)

        iters = cfg.reference_iters if backend == "reference" and cuda else cfg.iters
    else:
        build = build_triton if backend == "triton" else build_graphed_torch
        engine = build(weights, model_cfg, device=device, dtype=dtype, shapes=shapes, num_steps=cfg.num_steps)
        x = check_model_inputs(model_cfg, shapes, images, state, tokens, noise)

        def call():
            return engine(x, noise, cfg.num_steps)

        iters = cfg.iters
    build_s = time.perf_counter() - t0
    if cuda:
        build_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # from here: what the backend holds and needs while it runs
    timing: Timing = time_calls(call, warmup=cfg.warmup if iters == cfg.iters else 3, iters=iters, device=device,
                                max_seconds=cfg.max_seconds_per_row)  # fmt: skip
    row = {**timing.to_dict(), "build_s": build_s}
    if cuda:
        run_peak = torch.cuda.max_memory_allocated(device)
        row["peak_memory_gb"] = max(build_peak, run_peak) / 1e9  # the whole process, fp32 source weights included
        row["backend_memory_gb"] = (run_peak - held_before) / 1e9  # its own weights, buffers and transients
        if engine is not None and engine.graph is not None:
            row["parts"] = part_timings(engine, device, iters=50)
    return row


def _row_line(row: dict) -> str:
    case = f"{row['views']}v p{row['prompt_len']} h{row['chunk']}"
    if "median_ms" not in row:
        return f"{case:14s} {row['backend']:18s} {row.get('skipped', '')}"
    ratio = f"  {row['x_roofline']:.2f}x roofline" if row.get("x_roofline") else ""
    return f"{case:14s} {row['backend']:18s} median {row['median_ms']:9.2f} ms  p90 {row['p90_ms']:9.2f} ms{ratio}"


def write_results(result: dict, out_dir: Path) -> dict[str, Path]:
    """JSON + Markdown table + bar plot, the device name in every file name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"latency_{'pi05_' if result.get('model') == 'π0.5' else ''}{result['device']}"
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(result, indent=2))
    paths["md"].write_text(latency_markdown(result))
    latency_plot(result, paths["png"])
    return paths
