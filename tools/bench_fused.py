"""A/B of the plan's opt-in kernel fusions (fuse_rms / fuse_rope) and of programmatic dependent launch (PDL) on the
whole engine: one engine per combination,
the same random weights and inputs, whole-call latency and the per-part graphs (vision, VLM prefix, one expert
step), and each combination's output against the unfused engine's.

    python tools/bench_fused.py --cases "1,0,63;3,20,50" --combos off,rms,rope,both,expert --out DIR

Combinations: off (no fusion, PDL as configured), default (the engine's defaults), nopdl, pdl / pdl_pf / pdl_early
(PDL on, on with the GEMMs' L2 weight prefetch, early trigger; triton_kernels/pdl.py), rms (fuse_rms=True), rope
(fuse_rope=True), both, expert (both fusions on the action expert only, the VLM prefix unfused), vlm (both on the
VLM only), partials* / combine_rms* (the norm fusions),
l2pf* (the expert's L2 weight prefetch: with the next layer's QKV, only the layer's own MLP side, with combine_rms),
expert_layer (each action-expert layer as one persistent kernel, triton_kernels/expert_layer.py).
On CUDA: π0, bf16, Triton kernels, CUDA Graphs.
Without CUDA (a smoke test): the given preset in float32 on the torch kernel set, eager.
"""

from __future__ import annotations

import argparse
import gc
import sys
from contextlib import nullcontext
from unittest import mock

import torch

from vla_rt.bench.accuracy import rel_err
from vla_rt.bench.latency import part_timings, random_inputs
from vla_rt.bench.report import write_json_md
from vla_rt.bench.timing import time_calls
from vla_rt.config import preset
from vla_rt.engine import plan as plan_module
from vla_rt.engine.static_engine import build_graphed_torch, build_triton
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.triton_kernels.pdl import pdl_mode

COMBOS = {
    "off": dict(),
    "default": dict(),
    "nopdl": dict(pdl="off"),
    "pdl": dict(pdl="on", prefetch=False),
    "pdl_pf": dict(pdl="on", prefetch=True),
    "pdl_early": dict(pdl="early"),
    "rms": dict(fuse_rms=True),
    "rope": dict(fuse_rope=True),
    "both": dict(fuse_rms=True, fuse_rope=True),
    "expert": dict(fuse_rms="expert", fuse_rope="expert"),
    "vlm": dict(fuse_rms="vlm", fuse_rope="vlm"),
    "rope_expert": dict(fuse_rope="expert"),
    "rms_expert": dict(fuse_rms="expert"),
    "partials": dict(rms_partials=True, fuse_rope="expert"),  # vs "default": the partial sums added
    "partials_expert": dict(rms_partials="expert", fuse_rope="expert"),
    "combine_rms": dict(combine_rms=True, fuse_rope="expert"),  # vs "default": norms from the split-K combines
    "combine_rms_expert": dict(combine_rms="expert", fuse_rope="expert"),
    "l2pf": dict(l2_prefetch=True, fuse_rope="expert"),  # vs "default": the expert's L2 weight prefetch added
    "l2pf_mlp": dict(l2_prefetch=True, fuse_rope="expert", next_qkv=False),  # only the layer's own O/gate-up/down
    "l2pf_combine": dict(l2_prefetch=True, combine_rms=True, fuse_rope="expert"),
    "expert_layer": dict(expert_layer=True),  # vs "default": each expert layer as one persistent kernel
    "skinny": dict(skinny_gluon=True, fuse_rope="expert"),  # vs "default": the expert's QKV and gate/up on Gluon
    "mlp": dict(fused_mlp=True, fuse_rope="expert"),  # vs "default": the expert's MLP as one Gluon launch
    "mlp_rows": dict(fused_mlp=True, fuse_rope="expert", patch={"MLP_RMS_IN_KERNEL": False, "MLP_NORM_EARLY": False}),
    "mlp_early": dict(fused_mlp=True, fuse_rope="expert", patch={"MLP_RMS_IN_KERNEL": False}),  # rms_factor early
    "mlp_o": dict(fused_mlp=True, fuse_rope="expert", patch={"MLP_WITH_O": True}),  # the O projection inside it
    "mlp_skinny": dict(fused_mlp=True, skinny_gluon=True, fuse_rope="expert"),  # and its QKV on Gluon too
}


def _parts(engine, device: torch.device, iters: int) -> dict[str, float]:
    """Median ms of vision, VLM prefix and one expert step, each as its own CUDA Graph (eager without CUDA)."""
    return {name: t["median_ms"] for name, t in part_timings(engine, device, iters).items()}


def run(cases, combos, *, preset_name: str, iters: int, num_steps: int = 10, seed: int = 0, log=print) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    build = build_triton if cuda else build_graphed_torch
    cfg = preset(preset_name)
    weights = random_weights(cfg, seed=seed, device=device)
    rows = []
    for views, prompt, chunk in cases:
        shapes = BuiltShapes(views, chunk, prompt or None, 1)
        images, state, tokens, noise = random_inputs(cfg, (views, prompt, chunk), device, seed + 1)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        baseline = None
        for combo in combos:
            # no fusion unless the combo says so ("default": the engine's own defaults, plan.TRITON_FUSIONS)
            no_fusion = dict.fromkeys(plan_module.TRITON_FUSIONS, False)
            flags = dict(COMBOS[combo]) if combo == "default" else {**no_fusion, **COMBOS[combo]}
            pdl = pdl_mode(flags.pop("pdl"), flags.pop("prefetch", True)) if "pdl" in flags else nullcontext()
            next_qkv = mock.patch.object(
                plan_module, "L2_PREFETCH_NEXT_QKV", flags.pop("next_qkv", plan_module.L2_PREFETCH_NEXT_QKV)
            )
            # plan knobs (module constants) the combo sets for its build
            patch = flags.pop("patch", {})
            knobs = mock.patch.multiple(plan_module, **patch) if patch else nullcontext()
            with pdl, next_qkv, knobs:  # graphs captured (and parts timed) under the combo's PDL mode
                row, out = _measure(build, weights, cfg, shapes, x, noise, flags, device, dtype, num_steps, iters)
            baseline = out if combo == "off" else baseline
            row.update(views=views, prompt_len=prompt, chunk=chunk, combo=combo, flags=COMBOS[combo],
                       rel_err_vs_off=rel_err(out, baseline) if baseline is not None else None)  # fmt: skip
            rows.append(row)
            p = row["parts_ms"]
            log(f"{views}v p{prompt} h{chunk} {combo:<7} median {row['median_ms']:8.3f} ms  vision {p['vision']:.3f}"
                f"  vlm {p['vlm']:.3f}  expert step {p['expert_step']:.4f}  vs off {row['rel_err_vs_off']}")  # fmt: skip
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "preset": preset_name,
            "dtype": str(dtype).removeprefix("torch."), "num_steps": num_steps, "rows": rows}  # fmt: skip


def _measure(build, weights, cfg, shapes, x, noise, flags, device, dtype, num_steps, iters):
    """Build one engine, time whole calls and its parts; (row, actions)."""
    engine = build(weights, cfg, device=device, dtype=dtype, shapes=shapes, num_steps=num_steps, **flags)
    out = engine(x, noise, num_steps).clone()
    timing = time_calls(lambda: engine(x, noise, num_steps), warmup=10, iters=iters, device=device, max_seconds=60)
    row = {**timing.to_dict(), "parts_ms": _parts(engine, device, max(5, iters // 4)),
           "finite": bool(torch.isfinite(out).all())}  # fmt: skip
    return row, out


def table(result: dict) -> str:
    """Markdown: per case and combination, ms and the change against `off` (negative = faster)."""
    lines = ["| case | combo | median ms | Δ ms | VLM ms | Δ | expert step ms | Δ | rel. err vs off |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base = {}
    for r in result["rows"]:
        case = (r["views"], r["prompt_len"], r["chunk"])
        if r["combo"] == "off":
            base[case] = r
        b = base.get(case)

        def delta(v, ref):
            return f"{v - ref:+.3f}" if ref is not None else "–"

        p = r["parts_ms"]
        err = "–" if r["rel_err_vs_off"] is None else f"{r['rel_err_vs_off']:.1e}"
        lines.append(
            f"| {case[0]}v p{case[1]} h{case[2]} | {r['combo']} | {r['median_ms']:.3f} | "
            f"{delta(r['median_ms'], b and b['median_ms'])} | {p['vlm']:.3f} | {delta(p['vlm'], b and b['parts_ms']['vlm'])} | "
            f"{p['expert_step']:.4f} | {delta(p['expert_step'], b and b['parts_ms']['expert_step'])} | {err} |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1,0,63;3,20,50", help="views,prompt,chunk;... ")
    p.add_argument("--combos", default="off,rms,rope,both,expert", help=",".join(COMBOS) + " ('off' first)")
    p.add_argument("--preset", default=None, help="default: pi0 on CUDA, tiny without")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=None, help="directory for fused_<device>.json / .md")
    a = p.parse_args(argv)
    cases = [tuple(int(v) for v in c.split(",")) for c in a.cases.split(";") if c.strip()]
    combos = [c for c in a.combos.split(",") if c]
    unknown = [c for c in combos if c not in COMBOS]
    if unknown:
        p.error(f"unknown combos {unknown}; use {list(COMBOS)}")
    if "off" in combos:  # the baseline first, so every other row has its deltas
        combos = ["off"] + [c for c in combos if c != "off"]
    name = a.preset or ("pi0" if torch.cuda.is_available() else "tiny")
    result = run(cases, combos, preset_name=name, iters=a.iters)
    md = table(result)
    print(md)
    if a.out:
        write_json_md(a.out, "fused", result, f"# fuse_rms / fuse_rope A/B on {result['device']}\n\n{md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
