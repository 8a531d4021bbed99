"""`select_action` latency: the vla_rt LeRobot plugin against LeRobot's own π0 / π0.5, in one process, one checkpoint.

For each model, LeRobot's own `PI0Policy` / `PI05Policy` is built at full size with random weights (LeRobot's own
init, on the GPU) and written with its `save_pretrained`; the plugin (`VlaRtPolicy`, default backend: triton under
one CUDA Graph) loads that very dir. Both then get the same pre-processed batch (V cameras at 224 px, a normalised
14-dim state, 48 or 200 prompt tokens of which 20 are real) and every timed `select_action` starts from an empty
queue, so each call computes a whole chunk (LeRobot's time per chunk; the other n_action_steps - 1 calls only pop the
queue). Wall clock around the call, CUDA synchronised before and after. The same noise goes into both for one
chunk, and the relative difference of their actions is reported beside the times.

    python benchmarks/lerobot_latency.py --out benchmarks/raw/lerobot            # on the GPU (~4-6 min)
    python benchmarks/lerobot_latency.py --tiny --device cpu --iters 3          # a CPU smoke test of this script

Writes lerobot_latency_<GPU>.json / .md / .png into --out. The processors are not timed (they are the same for both
and need PaliGemma's tokenizer, which a machine without the hub does not have).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "integrations" / "lerobot", ROOT / "tests" / "lerobot_plugin"):
    sys.path.insert(0, str(extra))  # the plugin from this checkout; the tiny dims for --tiny

from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.pi0.configuration_pi0 import PI0Config  # noqa: E402
from lerobot.policies.pi0.modeling_pi0 import PI0Policy  # noqa: E402
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: E402
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: E402
from lerobot_policy_vla_rt import VlaRtConfig, VlaRtPolicy  # noqa: E402

from vla_rt.numerics import rel_err  # noqa: E402

STATE_DIM = ACTION_DIM = 14
PROMPT_TOKENS = 20


def features(views: int) -> tuple[dict, dict]:
    inputs = {f"observation.images.cam{i}": PolicyFeature(FeatureType.VISUAL, (3, 224, 224)) for i in range(views)}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    return inputs, {"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))}


def batch(views: int, prompt_len: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"observation.images.cam{i}": torch.rand(1, 3, 224, 224, generator=g) for i in range(views)}
    out["observation.state"] = torch.randn(1, STATE_DIM, generator=g)
    out["observation.language.tokens"] = torch.randint(1, vocab, (1, prompt_len), generator=g)
    out["observation.language.attention_mask"] = torch.arange(prompt_len)[None] < PROMPT_TOKENS
    return {k: v.to(device) for k, v in out.items()}


def time_calls(policy, inputs: dict, iters: int, warmup: int, device: str) -> list[float]:
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    times = []
    for i in range(warmup + iters):
        policy.reset()  # every timed call computes a whole chunk
        sync()
        t0 = time.perf_counter()
        policy.select_action(inputs)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min_ms": ordered[0],
        "calls": len(ordered),
    }


def run_model(name: str, args, workdir: Path) -> dict:
    pi05 = name == "pi05"
    inputs, outputs = features(args.views)
    lr_config = (PI05Config if pi05 else PI0Config)(
        device=args.device, dtype=args.lerobot_dtype, input_features=inputs, output_features=outputs
    )
    sizes = contextlib.nullcontext()
    if args.tiny:
        import lerobot_tiny

        sizes = lerobot_tiny.tiny_lerobot_modules()
    t0 = time.perf_counter()
    with sizes, torch.device(args.device):
        lerobot_policy = (PI05Policy if pi05 else PI0Policy)(lr_config).eval()
    folder = workdir / name
    lerobot_policy.save_pretrained(folder)
    build_lerobot_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    plugin = VlaRtPolicy(
        VlaRtConfig(
            checkpoint=str(folder), device=args.device, backend=args.backend, dtype=args.dtype,
            input_features=inputs, output_features=outputs, num_steps=lr_config.num_inference_steps,
        )
    )  # fmt: skip
    build_plugin_s = time.perf_counter() - t0
    engine = plugin.engine
    x = batch(args.views, engine.config.max_token_len, engine.config.vocab_size, args.device)

    with torch.no_grad():
        torch.manual_seed(0)
        ref = lerobot_policy.predict_action_chunk(x)
        torch.manual_seed(0)
        ours = plugin.predict_action_chunk(x)
    accuracy = rel_err(ours.float(), ref.float())

    lerobot_times = time_calls(lerobot_policy, x, args.lerobot_iters, 2, args.device)
    plugin_times = time_calls(plugin, x, args.iters, 10, args.device)
    result = {
        "model": name,
        "views": args.views,
        "prompt_len": engine.config.max_token_len,
        "chunk": engine.chunk,
        "num_steps": plugin.num_steps,
        "plugin": {"backend": engine.backend, "dtype": str(engine.dtype), **summary(plugin_times)},
        "lerobot": {"class": type(lerobot_policy).__name__, "dtype": args.lerobot_dtype, **summary(lerobot_times)},
        "speedup_median": statistics.median(lerobot_times) / statistics.median(plugin_times),
        "rel_err_plugin_vs_lerobot_same_noise": accuracy,
        "build_s": {"lerobot_init_and_save": build_lerobot_s, "plugin_load": build_plugin_s},
        "raw_ms": {"plugin": plugin_times, "lerobot": lerobot_times},
    }
    del lerobot_policy, plugin, engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def write(results: list[dict], args, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = torch.cuda.get_device_name().replace(" ", "-") if args.device.startswith("cuda") else "cpu"
    stem = out / f"lerobot_latency_{gpu}{'_tiny' if args.tiny else ''}"
    env = {"device": gpu, "torch": torch.__version__, "argv": sys.argv[1:]}
    with contextlib.suppress(Exception):
        import lerobot

        env["lerobot"] = lerobot.__version__
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "results": results}, indent=2))
    lines = [
        f"# `select_action` latency: vla_rt plugin vs LeRobot's own policy ({gpu})",
        "",
        f"One process, one checkpoint written by LeRobot's `save_pretrained` (random weights), {args.views} camera(s) at"
        f" 224 px, {PROMPT_TOKENS} prompt tokens, every call computing a whole chunk (`reset()` first); wall clock with"
        f" CUDA synchronised. `python benchmarks/lerobot_latency.py {' '.join(sys.argv[1:])}`; {env}.",
        "",
        "| model | plugin (backend, dtype) | plugin median / p90 | LeRobot (dtype) | LeRobot median / p90 | speed-up |"
        " actions rel. diff (same noise) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, lr = r["plugin"], r["lerobot"]
        lines.append(
            f"| {r['model']} | {p['backend']}, {p['dtype'].removeprefix('torch.')} | {p['median_ms']:.2f} /"
            f" {p['p90_ms']:.2f} ms | {lr['class']} ({lr['dtype']}) | {lr['median_ms']:.1f} / {lr['p90_ms']:.1f} ms |"
            f" {r['speedup_median']:.1f}× | {r['rel_err_plugin_vs_lerobot_same_noise']:.2e} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["model"] for r in results]
    for offset, (who, color) in enumerate((("lerobot", "tab:gray"), ("plugin", "tab:blue"))):
        ax.bar([i + 0.4 * offset for i in range(len(names))], [r[who]["median_ms"] for r in results], 0.4,
               label="LeRobot's own policy" if who == "lerobot" else "vla_rt plugin", color=color)  # fmt: skip
    ax.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("select_action, new chunk (ms, median)")
    ax.set_title(f"{gpu}: {args.views} view(s), chunk, 10 steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    return stem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="pi0,pi05")
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None, help="plugin backend (default: triton on CUDA, folded on CPU)")
    parser.add_argument("--dtype", default=None, help="plugin dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--lerobot-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--lerobot-iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="vla-rt's tiny dims (a smoke test of this script)")
    parser.add_argument("--out", default="benchmarks/raw/lerobot")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            results.append(run_model(name, args, Path(workdir)))
            r = results[-1]
            print(
                f"{name}: plugin {r['plugin']['median_ms']:.2f} ms, LeRobot {r['lerobot']['median_ms']:.1f} ms, "
                f"x{r['speedup_median']:.1f}, rel diff {r['rel_err_plugin_vs_lerobot_same_noise']:.2e}, "
                f"build {r['build_s']}",
                flush=True,
            )
    stem = write(results, args, out)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
