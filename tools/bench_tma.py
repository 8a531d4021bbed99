"""Time the TMA GEMM kernel's modes against the launch table's entry and torch (cuBLAS) on the wide π0 GEMMs.

Each (shape, config) is checked against an fp32 reference, then timed like `tune` does (CUDA Graph replay over
weight copies that defeat L2). Run one mode per process under `timeout` when trying modes that may not compile or
may hang on this Triton (the 3.6 tune stalled on two warp-specialized kernels, a mode since removed):

    for m in 1 2 3; do timeout 60 python tools/bench_tma.py --modes $m --out tma_$m.json; done
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from vla_rt.triton_kernels.bench_kernels import L2_DEFEAT_BYTES
from vla_rt.triton_kernels.launch_configs import GemmConfig, gemm_config
from vla_rt.triton_kernels.shapes import pi0_gemm_shapes
from vla_rt.triton_kernels.tune import _gemm_launch, _gemm_outputs, _gemm_reference, _gemm_setup, _time_graph

DEFAULT_SHAPES = "vlm.gate_up:256,vlm.gate_up:768,vlm.down:768"
# (block_m, block_n, block_k, warps, stages): the tiles cuBLAS-class kernels use on sm_90, gated ones at most 128x128
TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4))


def find_shape(spec: str):
    name, m = spec.split(":")
    for s in pi0_gemm_shapes(views=(1, 2, 3), prompts=(0, 20), chunks=()):
        if s.name == name and s.m == int(m):
            return s
    raise SystemExit(f"no π0 GEMM {spec!r}")


def time_config(x: dict, cfg: GemmConfig, copies: int, ref: torch.Tensor) -> dict:
    try:
        _gemm_launch(x, cfg, 0)
        torch.cuda.synchronize()
        got = _gemm_outputs(x)
        rel = ((got - ref).norm() / ref.norm()).item()
        if not rel < 2e-2:
            return {"error": f"relative error {rel:.2e}"}
        return {"us": round(_time_graph(lambda i: _gemm_launch(x, cfg, i), copies), 3), "rel_err": rel}
    except Exception as e:  # a config this Triton cannot compile: report, go on
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="name:rows, comma-separated")
    p.add_argument("--modes", default="1,2,3", help="TMA modes to time (0 = the pointer kernel at the same tiles)")
    p.add_argument("--out", default=None, help="append the rows to this JSON file")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for spec in a.shapes.split(","):
        s = find_shape(spec)
        w_bytes = s.n * (2 if s.gated else 1) * s.k * 2
        copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / w_bytes)))
        x = _gemm_setup(s, torch.bfloat16, dev, copies)
        ref = _gemm_reference(x)
        table = gemm_config(s.m, s.n, s.k, gated=s.gated, dtype=torch.bfloat16, device=dev)
        base = {"shape": spec, "m": s.m, "n": s.n, "k": s.k, "gated": s.gated}
        torch_us = _time_graph(lambda i, x=x: torch.mm(x["a"], x["ws"][i].T, out=x["mm_out"]), copies)
        rows.append({**base, "config": "torch", "us": round(torch_us, 3)})
        rows.append({**base, "config": "table", **dataclasses.asdict(table), **time_config(x, table, copies, ref)})
        table_us = rows[-1].get("us", float("nan"))
        for mode in map(int, a.modes.split(",")):
            for bm, bn, bk, warps, stages in TILES:
                if s.gated and bn > 128:
                    continue
                cfg = GemmConfig(bm, bn, bk, 1, 8, warps, stages, 0, mode)
                rows.append({**base, "config": f"tma{mode}", **dataclasses.asdict(cfg),
                             **time_config(x, cfg, copies, ref)})  # fmt: skip
                r = rows[-1]
                print(f"{spec:<18} {r['config']:<6} {bm}/{bn}/{bk} w{warps} s{stages}  "
                      f"{r.get('us', float('nan')):8.2f} us  {r.get('error', '')}", flush=True)  # fmt: skip
        print(f"{spec:<18} table  {table_us:8.2f} us ({table})  torch {torch_us:8.2f} us", flush=True)
        if a.out:
            path = Path(a.out)
            old = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(old + rows, indent=1) + "\n")
            rows = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
