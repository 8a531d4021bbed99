"""Accuracy of the fast backends against the float32 reference on the GPU, over many random draws.

Same weights and noise for every backend; fresh images, state, prompt, masks and noise per draw. Reports the
median and max relative error ‖a − a_ref‖ / ‖a_ref‖ of the actions for: `reference` in bf16 (openpi's serving
precision, the yardstick for what bf16 costs anyway), `folded` in bf16, and the `triton` engine in bf16.

    python -m vla_rt.bench.accuracy --draws 100 --views 2 --prompt 20 --chunk 50
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vla_rt.bench.latency import device_name
from vla_rt.bench.report import run_dir
from vla_rt.config import preset
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.numerics import rel_err


def random_draws(cfg, draws: int, views: int, prompt: int, chunk: int, seed: int, device):
    """The benchmark's inputs, draw by draw: (images, state, tokens, noise, image_masks, token_mask), fresh for each
    draw from one generator (seed + 1), a view masked out every fourth draw, a random prompt length."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    s = cfg.vision.image_size
    for i in range(draws):
        images = torch.rand(1, views, s, s, 3, generator=g, device=device) * 2 - 1
        state = torch.randn(1, cfg.action_dim, generator=g, device=device)
        noise = torch.randn(1, chunk, cfg.action_dim, generator=g, device=device)
        image_masks = torch.ones(1, views, dtype=torch.bool, device=device)
        if views > 1 and i % 4 == 3:
            image_masks[0, int(torch.randint(0, views, (1,), generator=g, device=device))] = False
        tokens = token_mask = None
        if prompt:
            tokens = torch.randint(0, cfg.vocab_size, (1, prompt), generator=g, device=device)
            n = int(torch.randint(1, prompt + 1, (1,), generator=g, device=device))
            token_mask = (torch.arange(prompt, device=device) < n)[None]
        yield images, state, tokens, noise, image_masks, token_mask


def run_accuracy(preset_name: str, draws: int, views: int, prompt: int, chunk: int, seed: int, device, log=print):
    # the float32 reference must be float32 everywhere: no TF32 in matmuls or in cuDNN's patch convolution
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = preset(preset_name)
    weights = random_weights(cfg, seed=seed, device=device)
    shapes = BuiltShapes(views, chunk, prompt or None, 1)
    ref32 = build_pi0(weights, cfg, backend="reference", device=device, dtype=torch.float32, chunk=chunk)
    ref16 = build_pi0(weights, cfg, backend="reference", device=device, dtype=torch.bfloat16, chunk=chunk)
    folded = build_pi0(weights, cfg, backend="folded", device=device, dtype=torch.bfloat16, chunk=chunk)
    t0 = time.perf_counter()
    from vla_rt.engine.static_engine import build_triton

    triton = build_triton(weights, cfg, device=device, dtype=torch.bfloat16, shapes=shapes)
    build_s = time.perf_counter() - t0
    errors: dict[str, list[float]] = {"reference_bf16": [], "folded_bf16": [], "triton_bf16": []}
    for i, (images, state, tokens, noise, image_masks, token_mask) in enumerate(
        random_draws(cfg, draws, views, prompt, chunk, seed, device)
    ):
        kw = dict(image_masks=image_masks, token_mask=token_mask)
        a_ref = ref32.sample_actions(images, state, tokens, noise, **kw)
        errors["reference_bf16"].append(rel_err(ref16.sample_actions(images, state, tokens, noise, **kw), a_ref))
        errors["folded_bf16"].append(rel_err(folded.sample_actions(images, state, tokens, noise, **kw), a_ref))
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise, image_masks, token_mask)
        errors["triton_bf16"].append(rel_err(triton(x, noise, 10), a_ref))
        if i % 10 == 0:
            log(f"draw {i}: " + ", ".join(f"{k} {v[-1]:.2e}" for k, v in errors.items()))
    summary = {
        k: {"median": float(np.median(v)), "max": float(np.max(v)), "p90": float(np.percentile(v, 90))}
        for k, v in errors.items()
    }
    return {
        "device": device_name(device),
        "preset": preset_name,
        "case": {"views": views, "prompt_len": prompt, "chunk": chunk, "draws": draws, "num_steps": 10},
        "against": "reference float32 (TF32 off), same weights and noise",
        "triton_build_s": build_s,
        "summary": summary,
        "errors": errors,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="pi0")
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: a new run folder under benchmarks/raw/; benchmarks/results updates the committed summaries)",
    )
    args = p.parse_args()
    args.out = args.out or run_dir("accuracy")
    device = torch.device("cuda")
    result = run_accuracy(args.preset, args.draws, args.views, args.prompt, args.chunk, args.seed, device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"accuracy_{result['device']}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    print(f"{'backend':<16} {'median rel err':>15} {'p90':>10} {'max':>10}   ({args.draws} draws, vs fp32 reference)")
    for k, v in result["summary"].items():
        print(f"{k:<16} {v['median']:>15.2e} {v['p90']:>10.2e} {v['max']:>10.2e}")


if __name__ == "__main__":
    main()
