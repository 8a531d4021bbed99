"""Where the one-launch expert MLP (`triton_kernels.gluon_mlp.expert_mlp`) spends its time, per ring config.

π0's expert shapes (64 rows, width 1024, MLP 4096), bf16, random weights. For each config: the kernel against
float32 torch (one launch), then an 18-layer chain x += O(x); x += MLP(x) in one CUDA Graph with PDL (the O GEMM is
the project's Triton `gemm`, as in the engine), timed with CUDA events against the same chain with the MLP as the
engine's default kernels (`rms_factor`, gated `gemm`, split-K `gemm`); and the global-timer stamps of one mid-chain
launch: per program, when it started, passed the PDL wait, got its first x tile, finished phase 1's MMAs, published h, got its first h
tile, finished phase 2's MMAs, and left (medians over programs, and the launch's span from the first program's
start to the last one's end). A config ending in L runs the whole chain as one launch (`expert_mlp(...,
layers=18)`, the O projection in-kernel, weights streaming across layers: a probe of a kernel that walks the layers
itself); its stamps are the middle layer's.

    python tools/probe_mlp.py --out /tmp/probe_mlp [--configs 12x12s,12x12so,12x12sL] [--replays 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

STAMPS = ("start", "pdl_wait", "first_x_tile", "phase1_mma", "h_published", "first_h_tile", "phase2_mma", "end")


def _rand(*shape, std=1.0, g=None):
    return (torch.randn(*shape, device="cuda", generator=g) * std).to(torch.bfloat16)


def _chain_time(fn, replays: int) -> tuple[float, float]:
    """(median, p90) µs of one replay of fn's CUDA Graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    from vla_rt.triton_kernels.bench_kernels import replay_times_us

    times = sorted(replay_times_us(graph, replays))
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--configs",
        default="12x12s,12x12sr,16x10sr",
        help="w x a stages; s: staggered K order, r: the "
        "RMS factor from an rms_factor launch (row_scale) instead of summed in-kernel, e: that launch lets the MLP "
        "launch early, o: the O projection in the MLP's launch, L: all layers (with O) in one launch",
    )
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    from vla_rt.triton_kernels import gemm, gpu_name, rms_factor
    from vla_rt.triton_kernels.gluon_mlp import MlpConfig, expert_mlp, expert_mlp_applies

    g = torch.Generator(device="cuda").manual_seed(0)
    m, width, ff, layers, eps = 64, 1024, 4096, 18, 1e-6
    w_o = [_rand(width, 2 * width, std=(2 * width) ** -0.5 * 0.5, g=g) for _ in range(layers)]
    w_gu = [_rand(2 * ff, width, std=width**-0.5, g=g) for _ in range(layers)]
    w_d = [_rand(width, ff, std=ff**-0.5, g=g) for _ in range(layers)]
    attn = _rand(m, 2 * width, g=g)  # the O GEMM's input (the attention output in the engine)
    x, h = _rand(m, width, g=g), torch.empty(m, ff, device="cuda", dtype=torch.bfloat16)
    rs = torch.empty(m, device="cuda", dtype=torch.float32)
    x0 = x.clone()
    w_o_all, w_gu_all, w_d_all = torch.cat(w_o), torch.cat(w_gu), torch.cat(w_d)  # the L configs' stacked layers

    def separate():
        for i in range(layers):
            gemm(attn, w_o[i], x, residual=x)
            rms_factor(x, rs, eps)
            gemm(x, w_gu[i], h, gated=True, row_scale=rs)
            gemm(h, w_d[i], x, residual=x)

    results = {"device": gpu_name(), "shapes": f"{m} rows, width {width}, MLP {ff}, {layers} layers, bf16", "rows": []}
    x.copy_(x0)
    med, p90 = _chain_time(separate, args.replays)
    results["rows"].append(
        {"config": "separate kernels", "chain_us": med, "chain_p90_us": p90, "per_layer_us": med / layers}
    )
    print(f"separate kernels: chain {med:.1f} us (p90 {p90:.1f}), {med / layers:.2f} us a layer", flush=True)

    for spec in args.configs.split(","):
        wst, ast = (int(v) for v in spec.rstrip("sreoL").split("x"))
        cfg = MlpConfig(w_stages=wst, a_stages=ast, stagger="s" in spec)
        rows_given = spec.endswith(("r", "e"))
        all_layers = spec.endswith("L")  # the whole chain in one launch
        with_o = spec.endswith(("o", "L"))  # expert_mlp's phase 0 does the O projection (no O gemm in the chain)
        early = spec.endswith("e")  # the rms_factor before it lets it launch before its own PDL wait
        o_args = dict(attn=attn, w_o=w_o[0]) if with_o else {}
        why = expert_mlp_applies(x, w_gu[0], w_d[0], cfg, *o_args.values())
        row = {"config": spec}
        if why:
            row["skipped"] = why
            results["rows"].append(row)
            print(spec, "skipped:", why, flush=True)
            continue
        # correctness of one launch against fp32 torch (with_o: the MLP of x + O(attn))
        xa = _rand(m, width, g=g)
        xf = xa.float()
        x1 = xf + attn.float() @ w_o[0].float().T if with_o else xf
        y = (x1 @ w_gu[0].float().T) * torch.rsqrt(x1.pow(2).mean(-1, keepdim=True) + eps)
        ref = x1 + (F.gelu(y[:, :ff], approximate="tanh") * y[:, ff:]) @ w_d[0].float().T
        out = xa.clone()
        if rows_given:
            rms_factor(out, rs, eps)
            expert_mlp(out, w_gu[0], w_d[0], h, row_scale=rs, config=cfg)
        else:
            expert_mlp(out, w_gu[0], w_d[0], h, rms_eps=eps, config=cfg, **o_args)
        err = ((out.float() - xf) - (ref - xf)).norm() / (ref - xf).norm()
        row["rel_err_update"] = float(err)
        stamps = torch.zeros(ff // 32, 8, dtype=torch.int64, device="cuda")

        def fused(cfg=cfg, stamps=stamps, rows_given=rows_given, early=early, with_o=with_o, all_layers=all_layers):
            if all_layers:
                expert_mlp(x, w_gu_all, w_d_all, h, rms_eps=eps, config=cfg, timing=stamps, attn=attn, w_o=w_o_all,
                           layers=layers)  # fmt: skip
                return
            for i in range(layers):
                timing = stamps if i == layers // 2 else None
                if with_o:
                    expert_mlp(x, w_gu[i], w_d[i], h, rms_eps=eps, config=cfg, timing=timing, attn=attn, w_o=w_o[i])
                    continue
                gemm(attn, w_o[i], x, residual=x)
                if rows_given:
                    rms_factor(x, rs, eps, pdl_early=early)
                    expert_mlp(x, w_gu[i], w_d[i], h, row_scale=rs, config=cfg, timing=timing)
                else:
                    expert_mlp(x, w_gu[i], w_d[i], h, rms_eps=eps, config=cfg, timing=timing)

        x.copy_(x0)
        med, p90 = _chain_time(fused, args.replays)
        row.update(chain_us=med, chain_p90_us=p90, per_layer_us=med / layers)
        # the chain's result against the separate kernels' from the same input (a race would show here)
        x.copy_(x0)
        fused()
        ref_x = x.clone()
        x.copy_(x0)
        separate()
        row["chain_rel_err_vs_separate"] = float((ref_x.float() - x.float()).norm() / x.float().norm())
        t = stamps[:, : len(STAMPS)].double()
        t0 = t[:, 0].min()
        rel = (t - t0) / 1e3  # µs from the first program's start
        row["stamps_median_us"] = {name: float(rel[:, i].median()) for i, name in enumerate(STAMPS)}
        row["stamps_max_us"] = {name: float(rel[:, i].max()) for i, name in enumerate(STAMPS)}
        row["launch_span_us"] = float(rel[:, -1].max())
        results["rows"].append(row)
        print(f"{spec}: rel err {err:.2e}, chain vs separate {row['chain_rel_err_vs_separate']:.2e}; chain {med:.1f} us (p90 {p90:.1f}), {med / layers:.2f} us a layer; "
              f"span {row['launch_span_us']:.2f} us; median stamps "
              + " ".join(f"{k}={v:.2f}" for k, v in row["stamps_median_us"].items()), flush=True)  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    name = results["device"].replace(" ", "-")
    (args.out / f"probe_mlp_{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"probe_mlp_{name}.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    """The results as a Markdown table (stamps: medians over the programs of one mid-chain launch, µs from the
    first program's start)."""
    lines = [f"# One-launch expert MLP on {results['device']}", "", results["shapes"], "",
             "| config (w x a stages) | chain µs | µs a layer | rel. err | launch span µs | phase 1 done | h tile | end |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} | | | | | | |")
            continue
        s = r.get("stamps_median_us")
        stamps = (f"{r['rel_err_update']:.1e} | {r['launch_span_us']:.2f} | {s['phase1_mma']:.2f} | "
                  f"{s['first_h_tile']:.2f} | {s['end']:.2f}") if s else "– | – | – | – | –"  # fmt: skip
        lines.append(f"| {r['config']} | {r['chain_us']:.1f} | {r['per_layer_us']:.2f} | {stamps} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
