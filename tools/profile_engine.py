"""Where an expert step's time goes: the kernels of one step's CUDA Graph replay, with their GPU durations and the
gaps between them (torch.profiler / CUPTI), for the Triton engine. `--part vision` / `--part prefix` profile the
SigLIP tower (masks, patches, 27 layers, projector) or the Gemma prefix (text embedding, 18 layers) instead.

    python tools/profile_engine.py --case 1,0,63 --combos default,nopdl [--part step|vision|prefix] [--out DIR]
    python tools/profile_engine.py --case 2,20,50 --batch 8 --part prefix      # a batched stage, as the server runs
    python tools/profile_engine.py --model pi05                               # π0.5's step (adaptive norms)

Per combination (the default engine, and the same with PDL off): the step's wall time (first kernel start to last kernel end), the sum of kernel durations, the
sum of gaps (launch latency and PDL wait the kernels do not hide), per kernel name the count and time, and one
middle layer's kernels in launch order (grid, duration, gap before it). JSON under --out, a summary printed.
Needs CUDA (the Triton engine); the kernel-name → role mapping is by launch order, so the layer listing names
what the plan launches, not a guess.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from vla_rt.bench.latency import random_inputs
from vla_rt.config import preset
from vla_rt.engine.static_engine import build_triton
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.triton_kernels.pdl import pdl_mode

# what the profiled engine is built under: the default, and with programmatic dependent launch off (what PDL hides)
PDL_MODES = {"default": "on", "nopdl": "off"}


def _kernel_events(trace_path: Path) -> list[dict]:
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda e: e["ts"])


def _replays(kernels: list[dict], per_replay: int) -> list[list[dict]]:
    return [kernels[i : i + per_replay] for i in range(0, len(kernels) - per_replay + 1, per_replay)]


def _layer_period(names: list[str], layers: int) -> tuple[int, int] | None:
    """(first kernel, kernels a layer) of the `layers` identical kernel sequences between a part's few head kernels
    (the suffix embedding, patches) and tail kernels (final norm, action projection), or None."""
    for head in range(12):
        for tail in range(6):
            body = len(names) - head - tail
            if body <= 0 or body % layers:
                continue
            period = body // layers
            first = names[head : head + period]
            if all(names[head + i * period : head + (i + 1) * period] == first for i in range(layers)):
                return head, period
    return None


PARTS = {  # what a part's graph records, and how many identical layers it runs
    "step": (lambda e: e.plan.expert_step(e.slot, e.xa, 0, e.num_steps), lambda cfg: cfg.expert.depth),
    "vision": (lambda e: e.plan.vision(e.obs, e.slot, e.act), lambda cfg: cfg.vision.depth),
    "prefix": (lambda e: e.plan.prefix(e.obs, e.slot, e.act), lambda cfg: cfg.llm.depth),
}


def warm_graph(engine, part: str) -> torch.cuda.CUDAGraph:
    """One part (e.g. one expert step) captured as its own graph and replayed 10 times, so what is profiled next runs
    on warm caches and clocks."""
    record, _ = PARTS[part]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record(engine)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def profile_step(engine, replays: int = 20, part: str = "step") -> dict:
    """Profiles `replays` replays of one part (default one expert step) captured as its own graph; the median
    replay's kernels."""
    depth = PARTS[part][1]
    graph = warm_graph(engine, part)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # replays apart: each one's first kernel starts a new window
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        kernels = _kernel_events(path)
    if not kernels or len(kernels) % replays:
        return {"error": f"{len(kernels)} kernel events for {replays} replays (CUPTI may not see graph kernels)"}
    per = len(kernels) // replays
    windows = []
    for ks in _replays(kernels, per):
        start, end = ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks)
        busy = sum(k["dur"] for k in ks)
        windows.append((end - start, busy, ks))
    windows.sort(key=lambda w: w[0])
    wall, busy, ks = windows[len(windows) // 2]
    rows = []
    prev_end = ks[0]["ts"]
    for k in ks:
        args = k.get("args", {})
        rows.append({"name": k["name"][:60], "dur_us": k["dur"], "gap_us": round(k["ts"] - prev_end, 3),
                     "grid": args.get("grid"), "block": args.get("block"),
                     "regs": args.get("registers per thread"), "smem": args.get("shared memory")})  # fmt: skip
        prev_end = max(prev_end, k["ts"] + k["dur"])
    by_name: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_name[r["name"]].append(r["dur_us"])
    layers = depth(engine.cfg)
    per_layer = _layer_period([r["name"] for r in rows], layers)
    middle = None
    if per_layer:
        head, period = per_layer
        i = layers // 2
        middle = rows[head + i * period : head + (i + 1) * period]
    return {"wall_us": wall, "busy_us": busy, "gaps_us": wall - busy, "kernels": len(rows),
            "wall_us_all": [w[0] for w in windows], "by_name": {n: {"count": len(v), "total_us": sum(v),
            "median_us": statistics.median(v)} for n, v in by_name.items()},
            "layer_period": per_layer, "middle_layer": middle, "rows": rows}  # fmt: skip


def use_persistent_step(engine, tiling: dict) -> None:
    """The engine's expert step swapped for the persistent CUDA kernel with `tiling`, measured slower or not: the
    profile is the evidence for its levers (issue 25), not a claim the engine would choose it."""
    from vla_rt.cuda_kernels.expert_step import PersistentExpertStep

    plan = engine.plan
    plan.expert = PersistentExpertStep(plan.w, plan.cfg, plan.d, tiling=tiling)
    plan.expert_why = f"forced by --persistent {json.dumps(tiling)}"
    plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)  # eager first: it uploads the slot's TMA maps,
    torch.cuda.synchronize()  # a host copy a graph capture refuses


def ncu_window(engine, part: str = "step") -> None:
    """One replay of `part`'s graph between cudaProfilerStart / Stop and nothing else profiled: the window for Nsight
    Compute (`ncu --profile-from-start off --graph-profiling node`, `bash tools/device_session.sh ncu`), which times
    each kernel alone and reads its counters. torch.profiler stays off here: it and ncu would both hold CUPTI."""
    graph = warm_graph(engine, part)
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    graph.replay()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="1,0,63", help="views,prompt,chunk")
    p.add_argument("--combos", default="default", help=f"comma-separated of {list(PDL_MODES)}")
    p.add_argument("--batch", type=int, default=1, help="rows the engine is built for (the server's batched stages)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--part", default="step", choices=list(PARTS), help="what the profiled graph records")
    p.add_argument("--out", type=Path, default=Path("benchmarks/raw"), help="where the JSON goes (git-ignored)")
    p.add_argument("--model", default="pi0", choices=["pi0", "pi05"], help="π0 or π0.5 (random weights)")
    p.add_argument("--ncu", action="store_true", help="only open a profiler window around one replay (`ncu_window`)")
    p.add_argument("--persistent", metavar="TILING_JSON", default=None,
                   help='the step on the persistent CUDA kernel with this tiling (e.g. \'{"acc_chains": 2}\'), '
                        "whatever the measured table says (issue 25's evidence); --part step only")  # fmt: skip
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine needs CUDA (it profiles the Triton engine's graph)")
    views, prompt, chunk = (int(v) for v in a.case.split(","))
    tiling = None
    if a.persistent is not None:
        if a.part != "step":
            raise SystemExit(f"--persistent: profiles the expert step only, not --part {a.part}")
        try:
            tiling = json.loads(a.persistent)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"--persistent: expected a JSON object of tiling options, found {a.persistent!r} ({e})"
            ) from None
        if not isinstance(tiling, dict):
            raise SystemExit(f"--persistent: expected a JSON object of tiling options, found {a.persistent!r}")
    cfg = preset(a.model)
    device = torch.device("cuda")
    weights = random_weights(cfg, seed=0, device=device)
    shapes = BuiltShapes(views, chunk, prompt or None, a.batch)
    rows = [random_inputs(cfg, (views, prompt, chunk), device, seed) for seed in range(1, a.batch + 1)]
    images, state, tokens, noise = (None if t[0] is None else torch.cat(t) for t in zip(*rows))
    x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
    result = {"device": torch.cuda.get_device_name(), "model": a.model, "case": a.case, "batch": a.batch,
              "part": a.part, "persistent": tiling, "combos": {}}  # fmt: skip
    for combo in a.combos.split(","):
        with pdl_mode(PDL_MODES[combo]):
            engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
        if tiling is not None:
            use_persistent_step(engine, tiling)
        engine(x, noise, engine.num_steps)
        if a.ncu:
            ncu_window(engine, a.part)
            print(f"== {combo}: one {a.part} replay in the profiler window")
            del engine
            torch.cuda.empty_cache()
            continue
        r = profile_step(engine, a.replays, a.part)
        result["combos"][combo] = r
        if "error" in r:
            print(combo, r["error"])
            continue
        print(f"== {combo}: {a.part} wall {r['wall_us']:.1f} us, kernels {r['kernels']} busy {r['busy_us']:.1f} us, "
              f"gaps {r['gaps_us']:.1f} us; layer period {r['layer_period']}")  # fmt: skip
        for n, v in sorted(r["by_name"].items(), key=lambda kv: -kv[1]["total_us"]):
            print(f"   {n:<60} x{v['count']:<4} total {v['total_us']:8.1f} us  median {v['median_us']:6.2f}")
        for row in r["middle_layer"] or []:
            print(f"   layer: {row['name']:<40} grid {row['grid']} block {row['block']} regs {row['regs']} "
                  f"dur {row['dur_us']:.2f} gap {row['gap_us']:.2f}")  # fmt: skip
        del engine
        torch.cuda.empty_cache()
    if a.ncu:
        return
    a.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "-")
    path = a.out / f"profile_{a.model}_{a.part}_{views}v_b{a.batch}_{name}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
