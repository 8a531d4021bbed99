"""One benchmark row in its own process: the eager reference under torch.compile(mode="max-autotune").

Run by `vla_rt.bench.latency` with a time budget (compiling 3.5B parameters' worth of unrolled layers can take
minutes); prints one JSON line with the timing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vla_rt.bench.latency import random_inputs
from vla_rt.bench.timing import time_calls
from vla_rt.config import preset
from vla_rt.inference import build_pi0
from vla_rt.model import random_weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="pi0")
    p.add_argument("--case", default="1,0,63")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    views, prompt, chunk = (int(x) for x in args.case.split(","))
    device = torch.device("cuda")
    cfg = preset(args.preset)
    model = build_pi0(random_weights(cfg, args.seed, device=device), cfg, device=device, dtype=torch.bfloat16,
                      chunk=chunk).impl  # fmt: skip
    images, state, tokens, noise = random_inputs(cfg, (views, prompt, chunk), device, args.seed + 1)
    compiled = torch.compile(model.sample_actions, mode="max-autotune")
    t0 = time.perf_counter()
    compiled(images, state, tokens, noise)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    timing = time_calls(lambda: compiled(images, state, tokens, noise), warmup=3, iters=args.iters, device=device)
    print(json.dumps({**timing.to_dict(), "compile_s": compile_s,
                      "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}))  # fmt: skip


if __name__ == "__main__":
    main()
