"""Before/after check of a refactor: the default engines' actions (bit for bit) and latency on one tree.

Builds random-weight π0 through the public API only (`vla_rt.build_pi0`, `build_graphed_torch`, `StreamingPi0`),
so the same file runs unchanged against an older tree put first on PYTHONPATH. Per case (views, prompt, chunk,
batch) and backend it saves the actions of fixed inputs (seeded on the CPU, so every tree sees the same ones) to a
.safetensors file and the median call latency to a JSON file beside it; `--compare A B` reads two such runs and
says, per case and backend, whether the actions are bit-identical and how the latency moved.

Backends: `triton` (the one-shot Triton engine under one CUDA Graph), `torch-graph` (the same plan on torch ops,
the "CUDA Graph over folded torch ops" baseline), `streaming` (two-stream engine, one denoising step a call: the
time-bias row selected on the device) and `streaming-chunk` (one call a chunk). On a CPU the Triton engine runs in
Triton's interpreter (slow: use `--preset tiny`) and the streaming engine on torch ops.

    # on the GPU, old tree then new tree, then compare:
    PYTHONPATH=/path/to/old python tools/ab_actions.py --out benchmarks/raw/ab_old
    python tools/ab_actions.py --out benchmarks/raw/ab_new
    python tools/ab_actions.py --compare benchmarks/raw/ab_old benchmarks/raw/ab_new
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

if shutil.which("nvidia-smi") is None:  # no GPU: Triton's interpreter, chosen before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

BACKENDS = ("triton", "torch-graph", "streaming", "streaming-chunk")
# (views, prompt, chunk, batch): the benchmark's grid corners, batch 1 (real time) and 2 (the server)
CASES = ((1, 0, 63, 1), (3, 20, 50, 1), (2, 0, 63, 2))
CPU_CASES = ((1, 2, 3, 1), (2, 3, 4, 2))
NUM_STEPS = 10


def _parse_cases(text: str) -> tuple[tuple[int, int, int, int], ...]:
    cases = tuple(tuple(int(v) for v in c.split(",")) for c in text.split(";") if c)
    if not all(len(c) == 4 for c in cases):
        raise SystemExit(f"--cases: expected 'views,prompt,chunk,batch;...', found {text!r}")
    return cases  # type: ignore[return-value]


def case_key(case) -> str:
    views, prompt, chunk, batch = case
    return f"{views}v_p{prompt}_h{chunk}_b{batch}"


def case_inputs(cfg, case, seed: int = 1):
    """(images, state, tokens or None, noise) of one call, drawn on the CPU from `seed`."""
    views, prompt, chunk, batch = case
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(batch, views, s, s, 3, generator=g) * 2 - 1
    state = torch.randn(batch, cfg.action_dim, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g) if prompt else None
    noise = torch.randn(batch, chunk, cfg.action_dim, generator=g)
    return images, state, tokens, noise


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, args: tuple, device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of `fn(*args)` with the device synchronised around each call (a call is ~10-30 ms on a GPU,
    so a host clock is exact enough; it also works on every tree, old or new)."""
    for _ in range(warmup):
        fn(*args)
    samples = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn(*args)
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def build_call(backend: str, weights, cfg, case, device, dtype):
    """A function of the call's inputs that returns the actions (B, H, A), for one backend."""
    import vla_rt
    from vla_rt.inputs import BuiltShapes

    views, prompt, chunk, batch = case
    if backend == "triton":
        model = vla_rt.build_pi0(weights, cfg, backend="triton", device=device, dtype=dtype, num_views=views,
                                 chunk=chunk, prompt_len=prompt, batch_size=batch)  # fmt: skip
        return lambda images, state, tokens, noise: model.sample_actions(images, state, tokens, noise, NUM_STEPS)
    if backend == "torch-graph":
        from vla_rt.engine.static_engine import build_graphed_torch
        from vla_rt.inputs import check_model_inputs

        shapes = BuiltShapes(views, chunk, prompt, batch)
        engine = build_graphed_torch(weights, cfg, device=device, dtype=dtype, shapes=shapes, num_steps=NUM_STEPS)

        def call(images, state, tokens, noise):
            x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
            return engine(x, noise, NUM_STEPS)

        return call
    from vla_rt.engine.streaming_pi0 import StreamingPi0

    steps_per_call = 1 if backend == "streaming" else NUM_STEPS
    engine = StreamingPi0(weights, cfg, BuiltShapes(views, chunk, prompt or None, batch), device=device, dtype=dtype,
                          num_steps=NUM_STEPS, steps_per_call=steps_per_call)  # fmt: skip

    def stream(images, state, tokens, noise):
        version = engine.submit_observation(images, state, tokens)
        engine.wait_ready(version=version)
        actions, kv_version, _ = engine.next_actions(noise)
        if kv_version != version:
            raise RuntimeError(f"streaming: actions conditioned on frame {kv_version}, expected {version}")
        return actions

    return stream


def run(out: Path, cases, backends, preset_name: str, device: torch.device, dtype: torch.dtype, warmup: int,
        iters: int, log=print) -> dict:  # fmt: skip
    from safetensors.torch import save_file

    import vla_rt
    from vla_rt.model import random_weights

    cfg = vla_rt.preset(preset_name)
    weights = random_weights(cfg, seed=0, device=device)
    out.mkdir(parents=True, exist_ok=True)
    actions: dict[str, torch.Tensor] = {}
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "tree": str(Path(vla_rt.__file__).resolve().parents[1]), "preset": preset_name,
              "dtype": str(dtype).removeprefix("torch."), "num_steps": NUM_STEPS, "rows": {}}  # fmt: skip
    for case in cases:
        inputs = tuple(t.to(device) if t is not None else None for t in case_inputs(cfg, case))
        for backend in backends:
            key = f"{case_key(case)}/{backend}"
            call = build_call(backend, weights, cfg, case, device, dtype)
            y = call(*inputs).float().cpu()
            actions[key] = y.contiguous()
            ms = _median_ms(call, inputs, device, warmup, iters)
            result["rows"][key] = {"median_ms": ms, "finite": bool(torch.isfinite(y).all())}
            log(f"{key:<34} median {ms:9.3f} ms  finite {result['rows'][key]['finite']}")
            save_file(actions, str(out / "actions.safetensors"))  # after every row: a cut run keeps what it did
            (out / "latency.json").write_text(json.dumps(result, indent=1) + "\n")
            call = None  # the engine's buffers go before the next one is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result


def compare(a: Path, b: Path) -> tuple[str, bool]:
    """A Markdown table of bit-equality and latency deltas between runs `a` and `b`; True if every common row is
    bit-identical."""
    from safetensors.torch import load_file

    act_a, act_b = load_file(str(a / "actions.safetensors")), load_file(str(b / "actions.safetensors"))
    lat_a = json.loads((a / "latency.json").read_text())["rows"]
    lat_b = json.loads((b / "latency.json").read_text())["rows"]
    lines = [f"A: {a}  B: {b}", "", "| case/backend | bit-identical | max abs diff | A ms | B ms | B - A ms |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    same_all = True
    for key in sorted(set(act_a) | set(act_b)):
        if key not in act_a or key not in act_b:
            lines.append(f"| {key} | only in {'A' if key in act_a else 'B'} | | | | |")
            same_all = False
            continue
        x, y = act_a[key], act_b[key]
        same = x.shape == y.shape and torch.equal(x, y)
        diff = (x - y).abs().max().item() if x.shape == y.shape else float("nan")
        same_all &= same
        ta, tb = lat_a[key]["median_ms"], lat_b[key]["median_ms"]
        lines.append(f"| {key} | {'yes' if same else 'NO'} | {diff:.3g} | {ta:.3f} | {tb:.3f} | {tb - ta:+.3f} |")
    return "\n".join(lines) + "\n", same_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for actions.safetensors and latency.json")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two runs' folders")
    p.add_argument("--cases", type=_parse_cases, help="'views,prompt,chunk,batch;...'")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--preset", help="model dims (default: pi0 on CUDA, tiny on a CPU)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    a = p.parse_args(argv)
    if a.compare:
        table, same = compare(*a.compare)
        print(table)
        return 0 if same else 1
    if a.out is None:
        p.error("give --out (a run) or --compare A B")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backends = tuple(b for b in a.backends.split(",") if b)
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)}; choose from {list(BACKENDS)}")
    run(a.out, a.cases or (CASES if cuda else CPU_CASES), backends, a.preset or ("pi0" if cuda else "tiny"), device,
        torch.bfloat16 if cuda else torch.float32, a.warmup if a.warmup is not None else (10 if cuda else 0),
        a.iters if a.iters is not None else (50 if cuda else 1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
