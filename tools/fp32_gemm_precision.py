"""The float32 GEMMs of the bf16 engines: "ieee" against "tf32x3" dots, and launch configs for them.

openpi computes the patch embedding and the suffix embedding in float32, so the engines keep those GEMMs in float32
(`vla_rt.engine.weights.FLOAT32_WEIGHTS`). The tuner times bf16 GEMMs only, so these ran on the heuristic's
configs. For each shape the engines run (π0, 1-3 views, chunk 50 / 63, 1-32 rows) this times, in a CUDA Graph:
the heuristic's config under Triton's "ieee" float32 dot (FMA pipes: what ran before) and a handful of configs
under "tf32x3" (three TF32 tensor-core products, `triton_kernels/float32_dot.py`), each checked against float64.
It prints a Markdown table, writes JSON + Markdown under --out, and with --write-table puts the fastest accurate
tf32x3 config of each shape into the GPU's launch table (`gemm` / `float32`):

    python tools/fp32_gemm_precision.py --out /tmp/fp32_gemm --write-table      # on a GPU (~1-2 min)
    python tools/fp32_gemm_precision.py --report benchmarks/results/fp32_gemm_precision_NVIDIA-H200.json  # re-plot

A config whose result is more than 1e-5 from float64 (IEEE float32 itself is ~1e-7) is never picked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vla_rt.numerics import rel_err
from vla_rt.timing import time_graph
from vla_rt.triton_kernels import float32_dot, gemm
from vla_rt.triton_kernels.launch_configs import (
    GemmConfig,
    dump_table,
    gemm_heuristic,
    gemm_key,
    gpu_name,
    load_table,
    table_path,
)

FLOAT32_TOL = 1e-5
# (family, N, K, epilogue, Ms): the patch embedding (256 rows an image, the position embedding a periodic residual);
# the state / action_time GEMM (K = action dim; state at M = B, action_time at B x chunk, silu); mlp_out
FAMILIES = [
    ("patch embedding", 1152, 588, "periodic", (256, 512, 768, 4096, 6144)),
    ("state / action_time", 1024, 32, "silu", (32, 50, 63, 400, 1600, 2016)),
    ("mlp_out", 1024, 1024, "bias", (50, 63, 400, 1600, 2016)),
]
# tf32x3 candidates beside the heuristic's pick: wgmma tiles that compile for sm_90 without spills (32-wide K steps:
# each float32 operand is split in two TF32 tiles, so 64-wide steps spill at 128-row tiles)
CANDIDATES = [
    GemmConfig(64, 64, 32, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    GemmConfig(128, 64, 32, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    GemmConfig(64, 128, 32, num_warps=4, num_stages=4, tma=1),
    GemmConfig(128, 64, 32, num_warps=8, num_stages=4, tma=1),
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3, tma=3),
]
SPLIT_CANDIDATES = [  # few rows, long K: split K so more than a few SMs work
    GemmConfig(64, 64, 32, split_k=4, group_m=1, num_warps=4, num_stages=4, combine=1),
    GemmConfig(64, 128, 32, split_k=8, group_m=1, num_warps=4, num_stages=3, combine=1),
]


def padded(rows: int, cols: int, std: float = 1.0) -> torch.Tensor:
    """A (rows, cols) view of rows padded to a multiple of 8 elements, as the engine allocates them."""
    return (torch.randn(rows, -(-cols // 8) * 8, device="cuda") * std)[:, :cols]


def case(m: int, n: int, k: int, epilogue: str) -> tuple[dict, torch.Tensor]:
    """gemm's arguments for one shape, and the float64 result they should give."""
    a, w = padded(m, k), padded(n, k, std=k**-0.5)
    bias = torch.randn(n, device="cuda")
    kw: dict = {"bias": bias}
    ref = a.double() @ w.double().T + bias.double()
    if epilogue == "silu":
        kw["activation"] = "silu"
        ref = torch.nn.functional.silu(ref)
    if epilogue == "periodic":  # SigLIP's position embedding, one row a patch, added to every image
        pos = torch.randn(256, n, device="cuda")
        kw.update(residual=pos, residual_period=256)
        ref = ref + pos.double().repeat(m // 256, 1)
    kw["out"] = torch.empty(m, n, device="cuda")
    return {"a": a, "w": w, **kw}, ref


def measure(args: dict, ref: torch.Tensor, cfg: GemmConfig, precision: str, replays: int) -> dict:
    """rel_err vs float64 and the median µs of `cfg` under `precision`, or the error that stopped it."""
    shipped, float32_dot.FLOAT32_DOT_PRECISION = float32_dot.FLOAT32_DOT_PRECISION, precision  # read at each launch
    try:
        args["out"].fill_(float("nan"))
        gemm(**args, config=cfg)
        torch.cuda.synchronize()
        err = rel_err(args["out"], ref)
        us = time_graph(lambda _: gemm(**args, config=cfg), calls=20, replays=replays).median_us
        return {"config": cfg.to_dict(), "precision": precision, "rel_err": err, "us": us}
    except Exception as e:  # a candidate this Triton cannot compile or launch is reported, not fatal
        return {"config": cfg.to_dict(), "precision": precision, "error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        float32_dot.FLOAT32_DOT_PRECISION = shipped


def markdown(result: dict) -> str:
    """The table of a run's JSON: per shape, ieee on the heuristic's config against the best tf32x3 config."""
    lines = [
        f"# Float32 GEMMs of the engines on {result['device']}: ieee against tf32x3",
        "",
        f"Median µs of one GEMM in a CUDA Graph; rel_err against float64 (a config over {result['tolerance']:.0e} is "
        f"never picked). Command: `{result['command']}`.",
        "",
        "| GEMM | M x N x K | ieee, heuristic config µs | tf32x3, best config µs | speed-up | ieee rel_err | "
        "tf32x3 rel_err | best config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b, i = r["best"], r["ieee_heuristic"]
        shape = f"{r['m']} x {r['n']} x {r['k']}"
        if b is None or "us" not in i:
            lines.append(f"| {r['family']} | {shape} | {i.get('us', '–')} | – | – | – | – | – |")
            continue
        c = b["config"]
        desc = f"{c['block_m']}/{c['block_n']}/{c['block_k']} sk{c['split_k']} w{c['num_warps']} s{c['num_stages']}"
        desc += f" tma{c['tma']}" if c.get("tma") else ""
        lines.append(f"| {r['family']} | {shape} | {i['us']:.1f} | {b['us']:.1f} | {i['us'] / b['us']:.1f}x | "
                     f"{i['rel_err']:.1e} | {b['rel_err']:.1e} | {desc} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Bars: µs per shape, ieee against the best tf32x3 config (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["best"] is not None and "us" in r["ieee_heuristic"]]
    labels = [f"{r['family']}\n{r['m']}x{r['n']}x{r['k']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.8), 4.5))
    ax.bar([i - 0.2 for i in x], [r["ieee_heuristic"]["us"] for r in rows], 0.4, label="ieee (FMA), heuristic config")
    ax.bar([i + 0.2 for i in x], [r["best"]["us"] for r in rows], 0.4, label="tf32x3 (tensor cores), best config")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs (CUDA Graph, median)")
    ax.set_title(f"float32 GEMMs of the engines on {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(result: dict, out: Path) -> Path:
    """fp32_gemm_precision_<GPU>.json / .md / .png under `out`; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp32_gemm_precision_{result['device']}.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown(result))
    plot(result, path.with_suffix(".png"))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory for fp32_gemm_precision_<GPU>.json / .md")
    p.add_argument("--write-table", action="store_true", help="put each shape's fastest tf32x3 config in the table")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--report", type=Path, default=None, help="rewrite the .md / .png of this JSON (no GPU needed)")
    a = p.parse_args()
    if a.report is not None:
        result = json.loads(a.report.read_text())
        print(f"wrote {write_report(result, a.report.parent)}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("fp32_gemm_precision times Triton kernels on a GPU; this machine has no CUDA device")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for family, n, k, epilogue, ms in FAMILIES:
        for m in ms:
            args, ref = case(m, n, k, epilogue)
            heuristic = gemm_heuristic(m, n, k, gated=False, elem_bytes=4, num_sms=sms)
            before = measure(args, ref, heuristic, "ieee", a.replays)
            cands = [heuristic, *CANDIDATES, *(SPLIT_CANDIDATES if m <= 128 and k >= 512 else [])]
            tried = [measure(args, ref, c, "tf32x3", a.replays) for c in dict.fromkeys(cands)]
            ok = [t for t in tried if "us" in t and t["rel_err"] < FLOAT32_TOL]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row = {"family": family, "m": m, "n": n, "k": k, "ieee_heuristic": before, "tf32x3": tried, "best": best}
            rows.append(row)
            print(f"{family} {m}x{n}x{k}: ieee {before.get('us', float('nan')):.1f} µs, best tf32x3 "
                  f"{best['us'] if best else float('nan'):.1f} µs ({best['config'] if best else 'none'})",
                  flush=True)  # fmt: skip
    gpu = gpu_name(torch.device("cuda"))
    result = {"device": gpu, "tolerance": FLOAT32_TOL, "command": "python tools/fp32_gemm_precision.py", "rows": rows}
    print(markdown(result))
    if a.out is not None:
        print(f"wrote {write_report(result, a.out)}")
    if a.write_table:
        table = json.loads(json.dumps(load_table(gpu)))  # a copy: load_table's dict is cached
        entries = table.setdefault("gemm", {}).setdefault("float32", {})
        for r in rows:
            if r["best"] is not None:
                cfg = GemmConfig.from_dict(r["best"]["config"])
                entries[gemm_key(r["m"], r["n"], r["k"], False)] = {
                    **cfg.to_dict(), "us": round(r["best"]["us"], 3),
                    "ieee_us": round(r["ieee_heuristic"].get("us", float("nan")), 3), "src": "fp32_gemm_precision",
                }  # fmt: skip
        table_path(gpu).write_text(dump_table(table))
        load_table.cache_clear()
        print(f"wrote {len(entries)} float32 entries into {table_path(gpu)}")


if __name__ == "__main__":
    main()
