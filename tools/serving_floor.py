"""What one served request's prefix GEMMs cost at best on a GPU, read from its launch table (no GPU needed).

Why: issue 26 asks for >= 200 requests/s (p99 <= 80 ms) of π0 bf16 at 2 views, prompt 20, chunk 50 on one GPU, i.e.
at most 5 ms of GPU time a request at 100% busy. The prefix's GEMMs are most of a request and are compute-bound, so
the tuner's own timings of them (ours, `us`, and cuBLAS beside it, `torch_us` / `cublas_us`, same timer, CUDA
Graphs) bound what any scheduler can reach. This prints, per GEMM of a prefix stage of `--rows` requests, both
timings, the better one and its TFLOP/s, then the sum per request: with our GEMMs, and with the better of the two
for every GEMM (a floor no engine built on these kernels or on cuBLAS beats, whatever its epilogues).

    python tools/serving_floor.py --gpu NVIDIA-H100-80GB-HBM3 --rows 8
    python tools/serving_floor.py --gpu NVIDIA-H200 --rows 8 --expert-ms 3.98 --expert-rows 32

`--expert-ms` (an expert stage of `--expert-rows` rows, e.g. E(32) from the server's start-up cost model) adds the
request's share of its 10 steps, and the requests/s at 100% busy follow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vla_rt.config import Pi0Config  # noqa: E402


def prefix_gemms(cfg: Pi0Config, views: int, prompt: int, rows: int) -> list[tuple[str, int, str]]:
    """(name, how many a stage runs, table key) of a prefix stage of `rows` requests: SigLIP over every view's
    patches, then Gemma over images + prompt; Gemma's last layer computes K / V only (the expert reads nothing
    else of it), its K / V columns at the QKV GEMM's rate."""
    v, g = cfg.vision, cfg.llm
    mi, mt = rows * views * v.num_patches, rows * (views * v.num_patches + prompt)
    patch_k = v.patch_size * v.patch_size * 3
    qkv_n, kv_n = (g.num_heads + 2 * g.num_kv_heads) * g.head_dim, 2 * g.num_kv_heads * g.head_dim
    return [
        ("siglip patch embed", 1, f"{mi}x{v.width}x{patch_k}"),
        ("siglip qkv", v.depth, f"{mi}x{3 * v.width}x{v.width}"),
        ("siglip out", v.depth, f"{mi}x{v.width}x{v.width}"),
        ("siglip fc1", v.depth, f"{mi}x{v.mlp_dim}x{v.width}"),
        ("siglip fc2", v.depth, f"{mi}x{v.width}x{v.mlp_dim}"),
        ("projector", 1, f"{mi}x{g.width}x{v.width}"),
        ("gemma qkv", g.depth - 1 + kv_n / qkv_n, f"{mt}x{qkv_n}x{g.width}"),
        ("gemma o", g.depth - 1, f"{mt}x{g.width}x{g.num_heads * g.head_dim}"),
        ("gemma gate/up", g.depth - 1, f"{mt}x{g.mlp_dim}x{g.width}:gated"),
        ("gemma down", g.depth - 1, f"{mt}x{g.width}x{g.mlp_dim}"),
    ]


def flops(key: str) -> float:
    m, n, k = (int(x) for x in key.split(":")[0].split("x"))
    return 2.0 * m * n * k * (2 if key.endswith(":gated") else 1)  # gated: gate and up, N columns each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", required=True, help="a table under triton_kernels/configs/, e.g. NVIDIA-H200")
    ap.add_argument("--rows", type=int, default=8, help="requests in the prefix stage (the server's largest bucket)")
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--expert-ms", type=float, default=None, help="one expert stage (10 of them a request)")
    ap.add_argument("--expert-rows", type=int, default=32)
    args = ap.parse_args()
    path = ROOT / "triton_kernels" / "configs" / f"{args.gpu}.json"
    if not path.is_file():
        sys.exit(f"--gpu: no launch table {path} (found: {', '.join(p.stem for p in path.parent.glob('*.json'))})")
    table = json.loads(path.read_text())["gemm"]["bfloat16"]
    print(
        f"# Prefix GEMMs of {args.rows} requests on {args.gpu} ({args.views} views, prompt {args.prompt}; {path.name})"
    )
    print("\n| GEMM | per stage | M x N x K | ours µs | cuBLAS µs | best TFLOP/s |\n|---|---|---|---|---|---|")
    ours_ms = best_ms = total_flops = 0.0
    for name, count, key in prefix_gemms(Pi0Config(), args.views, args.prompt, args.rows):
        entry = table.get(key)
        if entry is None or "us" not in entry:
            sys.exit(f"{path.name}: no tuned entry {key!r} ({name}); tune it first (vla-rt tune)")
        theirs = min((entry[k] for k in ("torch_us", "cublas_us") if k in entry), default=None)
        best = min(entry["us"], theirs) if theirs is not None else entry["us"]
        ours_ms += count * entry["us"] / 1e3
        best_ms += count * best / 1e3
        total_flops += count * flops(key)
        cublas = f"{theirs:.1f}" if theirs is not None else "-"
        print(f"| {name} | {count:g} | {key} | {entry['us']:.1f} | {cublas} | {flops(key) / best / 1e6:.0f} |")
    per_ours, per_best = ours_ms / args.rows, best_ms / args.rows
    print(f"\nPer request: {total_flops / args.rows / 1e12:.2f} TFLOP of prefix GEMMs; {per_ours:.2f} ms with ours, "
          f"{per_best:.2f} ms with the better of ours and cuBLAS for every GEMM "
          f"({total_flops / best_ms / 1e9:.0f} TFLOP/s).")  # fmt: skip
    if args.expert_ms is not None:
        expert = 10 * args.expert_ms / args.expert_rows
        floor = per_best + expert
        print(f"With 10 expert steps at {args.expert_ms:g} ms a stage of {args.expert_rows} rows ({expert:.2f} ms a "
              f"request): {floor:.2f} ms a request before attention, norms and the host: at most "
              f"{1e3 / floor:.0f} requests/s at 100% busy.")  # fmt: skip


if __name__ == "__main__":
    main()
