"""Where mode 4 of `gemm_tma` (split K met in-kernel, a Stream-K partition) wins or loses on the 256-row GEMMs.

The same shape and tiles timed as the table's config, the persistent mode 2 (whole tiles) and mode 4 with 1, 2 or
4 programs a tile (1: whole tiles through the mode-4 loop, no partials; 2, 4: each tile's K steps split, the top
program adding the others' partials), each in a CUDA Graph of 20 launches (PDL as in the engine), median µs a
launch; every output checked against fp32 torch. (The first version of this probe, commit 2f07af0, forced the program count instead,
to the SM count among others: classic Stream-K, which lost 1.2-4x; its rows are in
`benchmarks/results/probe_stream_k_classic_NVIDIA-H200.md`.)

    python tools/probe_stream_k.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

SHAPES = [("siglip.fc1", 256, 4304, 1152), ("siglip.o", 256, 1152, 1152), ("siglip.fc2", 256, 1152, 4304),
          ("vlm.o", 256, 2048, 2048)]  # fmt: skip
LAUNCHES = 20


def _time(fn, replays: int = 50) -> float:
    """Median µs of one of LAUNCHES launches of fn, replayed in a CUDA Graph."""
    from vla_rt.triton_kernels.bench_kernels import replay_times_us

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    for _ in range(5):
        graph.replay()
    return statistics.median(replay_times_us(graph, replays)) / LAUNCHES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from vla_rt.triton_kernels import gemm, gemm_config, gpu_name
    from vla_rt.triton_kernels import gemm_tma as gt
    from vla_rt.triton_kernels.launch_configs import GemmConfig

    rows = []
    for name, m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        table = gemm_config(m, n, k, gated=False, dtype=torch.bfloat16, device=a.device)
        runs = [("table", table)]
        for bm, bn, warps in ((128, 128, 8), (64, 128, 4)):
            runs.append((f"mode2 {bm}x{bn}", GemmConfig(bm, bn, 64, 1, 8, warps, 4, 0, 2)))
            runs += [(f"mode4 {bm}x{bn} split {s}", GemmConfig(bm, bn, 64, s, 8, warps, 4, 0, 4)) for s in (1, 2, 4)]
        for label, cfg in runs:
            programs = gt.stream_k_need(m, n, k, cfg, False, a.device)[0] if cfg.tma == gt.STREAM_K else None
            try:
                gemm(a, w, out, config=cfg)
                torch.cuda.synchronize()
                err = float((out.float() - ref).norm() / ref.norm())
                us = _time(lambda cfg=cfg, a=a, w=w, out=out: gemm(a, w, out, config=cfg))
            except Exception as e:  # noqa: BLE001 (a config that does not run is a row, not the end)
                rows.append(dict(shape=f"{name} {m}x{n}x{k}", config=label, error=str(e)[:200]))
                continue
            rows.append(dict(shape=f"{name} {m}x{n}x{k}", config=label, us=us, rel_err=err, programs=programs))
            print(f"{name} {m}x{n}x{k} {label:<28} {us:8.2f} us  err {err:.1e}  programs {programs}", flush=True)
    res = {"device": gpu_name(), "launches_per_graph": LAUNCHES, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    dev = res["device"].replace(" ", "-")
    (args.out / f"probe_stream_k_{dev}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Stream-K probe on {res['device']}", "", "| shape | config | µs | rel. err |", "|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['config']} | {r.get('us', float('nan')):.2f} | {r.get('rel_err', r.get('error'))} |"
              for r in rows]  # fmt: skip
    (args.out / f"probe_stream_k_{dev}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
