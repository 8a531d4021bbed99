"""Latency benchmark as a hydra experiment: `python experiments/benchmark_latency.py iters=200 cases=...`.

Same runner as `vla-rt bench` (vla_rt/bench/latency.py): every backend at 1/2/3 views beside the roofline, JSON +
Markdown + plot with the device name in the file names, in a new run folder under benchmarks/raw/ unless
`out_dir=benchmarks/results` (the committed summaries).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from vla_rt.arguments import check_out_dir
from vla_rt.bench.latency import BenchConfig, check_case_prompts, run_benchmark, write_results
from vla_rt.bench.report import run_dir
from vla_rt.errors import ConfigError
from vla_rt.experiment_config import BenchmarkLatencyConfig, bench_backends, validate

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs" / "experiment")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="benchmark_latency")
def main(cfg: DictConfig) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    try:  # every value typed and in range (and every backend known) before a model is built
        cfg = validate(cfg, BenchmarkLatencyConfig)
        backends = bench_backends(list(cfg.backends) if cfg.backends is not None else None, cuda)
        preset = cfg.preset or ("pi0" if cuda else "tiny")
        check_case_prompts(tuple(tuple(c) for c in cfg.cases), preset, "cases", ConfigError)
        out_dir = Path(hydra.utils.get_original_cwd()) / (cfg.out_dir or run_dir("bench"))
        check_out_dir(out_dir, "out_dir", ConfigError)  # now, not after every row is timed
    except ConfigError as err:
        raise SystemExit(f"config: {err}") from None
    bench = BenchConfig(
        preset=preset,
        cases=tuple(tuple(c) for c in cfg.cases),
        backends=backends,
        iters=cfg.iters if cuda else min(cfg.iters, 20),
        warmup=cfg.warmup,
        compile_budget_s=cfg.compile_budget_s,
        out_dir=out_dir,
    )
    result = run_benchmark(bench, device)
    for kind, path in write_results(result, bench.out_dir).items():
        print(f"wrote {kind}: {path}")


if __name__ == "__main__":
    main()
