"""Where Stream-K (`gemm_tma` mode 4) loses its time on the 256-row GEMMs it was built for.

The first H200 tune (`benchmarks/results/tune_log_stream_k_NVIDIA-H200.json`) timed it 1.2-3.8x slower than the
incumbents. This probe separates the kernel's loop structure from its tile sharing: the same shape and tiles timed
as the persistent mode 2 (whole tiles, one program an SM up to the tile count) and as Stream-K with the program
count forced (`gemm_tma._num_programs`) to the tile count or half of it (every program whole tiles: no partials, no
flags) and to 132 / 2 x tiles (tiles shared, partials and waits), each in a CUDA Graph of 20 launches (PDL as in
the engine), median µs a launch; every output checked against fp32 torch.

    python tools/probe_stream_k.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from unittest import mock

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
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        table = gemm_config(m, n, k, gated=False, dtype=torch.bfloat16, device=a.device)
        runs = [("table", table, None)]
        for bm, bn, warps in ((128, 128, 8), (64, 128, 4)):
            tiles = -(-m // bm) * -(-n // bn)
            runs.append((f"mode2 {bm}x{bn}", GemmConfig(bm, bn, 64, 1, 8, warps, 4, 0, 2), None))
            for programs in sorted({tiles, max(1, tiles // 2), sms, min(2 * tiles, sms)}):  # all resident
                runs.append((f"streamk {bm}x{bn} P={programs}", GemmConfig(bm, bn, 64, 1, 8, warps, 4, 0, 4), programs))
        for label, cfg, programs in runs:
            with mock.patch.object(gt, "_num_programs", (lambda d, p=programs: p) if programs else gt._num_programs):
                try:
                    gemm(a, w, out, config=cfg)
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).norm() / ref.norm())
                    us = _time(lambda cfg=cfg, a=a, w=w, out=out: gemm(a, w, out, config=cfg))
                except Exception as e:  # noqa: BLE001 (a config that does not run is a row, not the end)
                    rows.append(dict(shape=f"{name} {m}x{n}x{k}", config=label, error=str(e)[:200]))
                    continue
            rows.append(dict(shape=f"{name} {m}x{n}x{k}", config=label, us=us, rel_err=err, programs=programs))
            print(f"{name} {m}x{n}x{k} {label:<28} {us:8.2f} us  err {err:.1e}", flush=True)
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
