"""Which GEMMs cost the Triton engine its accuracy: the engine's actions against the float32 reference with cuBLAS
off, on, and on for one epilogue kind at a time (`triton_kernels/cublas_choice.py`).

Why: `python -m vla_rt.bench.accuracy` (100 draws, 2 views, prompt 20, chunk 50) measured the Triton engine at a
median relative error of 7.5e-3 at b503571 and 1.25e-2 at 87d8ad7 (H200, 2026-12-04), while the bf16 reference and
`folded` stayed at 8.1e-3 / 7.5e-3. The GEMMs handed to cuBLAS came in between. Each mode builds the engine anew
on the same weights; the float32 reference actions are computed once for all modes (same draws as the accuracy
benchmark's `random_draws`).

    python tools/accuracy_bisect.py --draws 20 [--modes default,cublas_off,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from vla_rt.bench.accuracy import random_draws
from vla_rt.config import preset
from vla_rt.engine.static_engine import build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err

# the modules, not the package's re-exported `gemm` function of the same name
gemm_module = importlib.import_module("vla_rt.triton_kernels.gemm")
float32_dot = importlib.import_module("vla_rt.triton_kernels.float32_dot")
ORIGINAL = gemm_module.cublas_gemm


def epilogue_kind(bias, activation, residual) -> str:
    if activation is not None:
        return f"bias+{activation}" if bias is not None else str(activation)
    if residual is not None:
        return "residual+bias" if bias is not None else "residual"
    return "bias" if bias is not None else "plain"


KINDS = ("plain", "bias", "bias+gelu_tanh", "residual", "residual+bias")
MODES = (
    {"default": None, "cublas_off": ()}
    | {f"only_{k}": (k,) for k in KINDS}
    | {f"without_{k}": tuple(x for x in KINDS if x != k) for k in KINDS}
    | {"fp32_ieee": None, "cublas_off_fp32_ieee": ()}
)
# mode -> the epilogue kinds cuBLAS may take (None: all, as shipped); *fp32_ieee: the float32 GEMMs (patch and suffix
# embeddings) on Triton's IEEE dot instead of three TF32 products


def patched(allowed: tuple[str, ...] | None, seen: collections.Counter):
    def cublas_gemm(a, w, out, **kw):
        kind = epilogue_kind(kw.get("bias"), kw.get("activation"), kw.get("residual"))
        if allowed is not None and kind not in allowed:
            return False
        took = ORIGINAL(a, w, out, **kw)
        if took:
            seen[f"{kind} {tuple(a.shape)}x{tuple(w.shape)}"] += 1
        return took

    return cublas_gemm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="pi0", help="model preset (tiny: a CPU smoke run of this tool)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: expected names from {list(MODES)}, found {unknown}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    cfg = preset(args.preset)
    weights = random_weights(cfg, seed=args.seed, device=device)
    shapes = BuiltShapes(args.views, args.chunk, args.prompt, 1)
    ref = build_pi0(weights, cfg, backend="reference", device=device, dtype=torch.float32, chunk=args.chunk)
    cases = list(random_draws(cfg, args.draws, args.views, args.prompt, args.chunk, args.seed, device))
    wanted = [ref.sample_actions(i, s, t, n, image_masks=m, token_mask=tm).clone() for i, s, t, n, m, tm in cases]
    del ref
    torch.cuda.empty_cache()
    rows = []
    for mode in modes:
        seen: collections.Counter = collections.Counter()
        gemm_module.cublas_gemm = patched(MODES[mode], seen)
        float32_dot.FLOAT32_DOT_PRECISION = "ieee" if mode.endswith("fp32_ieee") else "tf32x3"
        t0 = time.perf_counter()
        engine = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
        errs = []
        for (images, state, tokens, noise, masks, tmask), a_ref in zip(cases, wanted, strict=True):
            x = check_model_inputs(cfg, shapes, images, state, tokens, noise, masks, tmask)
            errs.append(rel_err(engine(x, noise, 10), a_ref))
        gemm_module.cublas_gemm = ORIGINAL
        float32_dot.FLOAT32_DOT_PRECISION = "tf32x3"
        row = dict(mode=mode, median=statistics.median(errs), max=max(errs), build_s=time.perf_counter() - t0,
                   cublas_gemms=dict(sorted(seen.items())))  # fmt: skip
        rows.append(row)
        print(f"{mode:<24} median {row['median']:.3e} max {row['max']:.3e}  cuBLAS calls by epilogue: "
              f"{dict(collections.Counter(k.split()[0] for k in seen.elements()))}", flush=True)  # fmt: skip
        del engine
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy_bisect.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
