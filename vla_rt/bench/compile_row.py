"""One benchmark row in its own process: the eager reference under torch.compile(mode="max-autotune").

Run by `vla_rt.bench.latency` with a time budget; prints one JSON line with the timing. What gets compiled
(`--scope`): "parts" (default) compiles the two functions a call repeats, `prefix_kv` (vision + VLM prefix, once a
call) and `velocity` (one action-expert step, ten times a call), so Dynamo traces each once and the Euler loop stays
Python; "whole" compiles `sample_actions` with the ten steps unrolled into one graph, which on the H200 did not
finish compiling within 240 s. Before timing, the compiled call is checked against the eager model on the same
inputs (relative error of the actions; a compile that changes the result is an error, not a row).

Progress goes to stderr as each part finishes compiling ("compiled prefix_kv in 212 s"), so a parent that stops
the run at its budget can say how far it got. `--coordinate-descent off` keeps max-autotune's GEMM autotuning and
CUDA graphs but skips its coordinate-descent tuning of every fused pointwise/reduction kernel, which is what makes
the full π0 compile outrun a device lease; the row then says so. Inductor's caches follow TORCHINDUCTOR_CACHE_DIR,
so a second run with the same directory skips what the first one compiled. `--warm prefix_kv` / `--warm velocity`
compiles one part into that cache and exits: two such processes side by side take the cold compile from the sum of
the parts (π0 on the H200: ~350 + ~280 s, over one device call) to the longer one, and the timed run then loads
both from the cache (the row counts the cache hits). The two warm-ups share the GPU while they autotune, so their
GEMM timings are noisier than a lone compile's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch._dynamo.utils import counters
from torch.utils._pytree import tree_map

from vla_rt.bench.latency import random_inputs
from vla_rt.config import preset
from vla_rt.inference import build_pi0
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err as relative_error
from vla_rt.timing import time_calls

# compiled vs eager, same dtype: bf16 roundings in another order (the eager bf16 reference is itself ~8e-3 from fp32)
TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-4}


def compile_kwargs(mode: str, coordinate_descent: bool) -> dict:
    """torch.compile's arguments: the mode as is, or (coordinate descent off) the mode's inductor options with that
    one option turned off (torch.compile takes a mode or options, not both)."""
    if coordinate_descent:
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode), "coordinate_descent_tuning": False}}


def compile_model(model, scope: str, mode: str, coordinate_descent: bool = True, parts=("prefix_kv", "velocity")):
    """The callable to time: `model.sample_actions` with its repeated parts compiled ("parts") or all of it.
    `parts` names which of the two to compile (a warm-up compiles one); the prefix's outputs are copied out either
    way, so velocity sees inputs of one layout whether the prefix ran compiled or eager."""
    kwargs = compile_kwargs(mode, coordinate_descent)
    if scope == "whole":
        return torch.compile(model.sample_actions, **kwargs)
    if scope != "parts":
        raise ValueError(f"scope must be 'parts' or 'whole', got {scope!r}")
    prefix = _timed(torch.compile(model.prefix_kv, **kwargs), "prefix_kv") if "prefix_kv" in parts else model.prefix_kv

    def prefix_kv(*args, **kw):
        torch.compiler.cudagraph_mark_step_begin()  # a new call: nothing from the previous one is read again
        return copied_out(prefix(*args, **kw))

    model.prefix_kv = prefix_kv  # instance attributes shadow the methods
    if "velocity" in parts:
        model.velocity = _timed(torch.compile(model.velocity, **kwargs), "velocity")
    return model.sample_actions


def copied_out(outputs):
    """The prefix's (KV cache, mask) as fresh tensors. max-autotune replays CUDA graphs (inductor's cudagraph trees),
    whose outputs live in a pool the next replay may reuse, and these feed ten velocity calls (on the H200 the
    uncopied version stopped with "accessing tensor output of CUDAGraphs that has been overwritten")."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)


def _timed(fn, name: str):
    """`fn`, reporting on stderr how long its first call (the compile) took."""
    first = [True]

    def call(*args, **kwargs):
        if not first[0]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        first[0] = False
        print(f"compiled {name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return out

    return call


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="pi0")
    p.add_argument("--case", default="1,0,63", help="views,prompt,chunk")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scope", choices=("parts", "whole"), default="parts")
    p.add_argument("--mode", default="max-autotune", help="torch.compile mode")
    p.add_argument(
        "--coordinate-descent",
        choices=("on", "off"),
        default="on",
        help="off: the mode's options without coordinate-descent tuning (see the module docstring)",
    )
    p.add_argument("--warm", choices=("prefix_kv", "velocity"), help="compile this part into the cache and exit")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    views, prompt, chunk = (int(x) for x in args.case.split(","))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = preset(args.preset)
    model = build_pi0(random_weights(cfg, args.seed, device=device), cfg, device=device, dtype=dtype,
                      chunk=chunk).impl  # fmt: skip
    images, state, tokens, noise = random_inputs(cfg, (views, prompt, chunk), device, args.seed + 1)
    coordinate_descent = args.coordinate_descent == "on"
    if args.warm:  # one call of the model with only that part compiled: its graph lands in the cache as timed
        t0 = time.perf_counter()
        compile_model(model, "parts", args.mode, coordinate_descent, parts=(args.warm,))(images, state, tokens, noise)
        print(f"warmed {args.warm} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return 0
    eager = model.sample_actions(images, state, tokens, noise)
    hits_before = counters["inductor"]["fxgraph_cache_hit"]
    compiled = compile_model(model, args.scope, args.mode, coordinate_descent)
    t0 = time.perf_counter()
    out = compiled(images, state, tokens, noise)
    if device.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    rel_err = relative_error(out, eager)
    if not rel_err <= TOLERANCE[dtype]:
        print(f"compiled actions differ from eager: relative error {rel_err:.3e} > {TOLERANCE[dtype]:.0e}",
              file=sys.stderr)  # fmt: skip
        return 1
    timing = time_calls(lambda: compiled(images, state, tokens, noise), warmup=3, iters=args.iters, device=device)
    row = {**timing.to_dict(), "compile_s": compile_s, "scope": args.scope, "mode": args.mode,
           "coordinate_descent": coordinate_descent, "rel_err_vs_eager": rel_err,
           "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"] - hits_before}  # fmt: skip
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
