"""Helpers the serving tests import (fixtures live in conftest.py)."""

from __future__ import annotations

import numpy as np

from vla_rt.serve.app import ServeConfig
from vla_rt.serve.scheduler import StageCosts, batch_buckets


def flat_cost(cfg: ServeConfig, prefix_ms: float = 1.0, expert_ms: float = 0.1) -> StageCosts:
    """Stage costs where every bucket takes the same time: admission then never refuses a test's few robots."""
    return StageCosts.flat(prefix_ms, expert_ms, batch_buckets(cfg.resolved_max_prefix()), batch_buckets(cfg.max_batch))


def run_alone(service, row, seed: int) -> np.ndarray:
    """What the server computes for one prepared row with the denoising noise of `seed`: the worker's runner on the
    service's engine (its first prefix stage draws the noise), stepped until the row leaves. (H, A) float32."""
    from vla_rt.serve.worker import StageRunner

    runner = StageRunner(service.serving.stages, prompt_len=service.policy.prompt_len, seed=seed)
    runner.prefix([-1], [row])
    while True:
        done = runner.expert()
        if done:
            return done[-1]
