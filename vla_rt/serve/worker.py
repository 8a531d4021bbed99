"""The GPU worker: one thread that takes batches from the queue, runs the bucket's model, hands back each row.

The event loop never runs inference: it decodes, validates, prepares rows (in a small thread pool) and enqueues
them; this thread is the only one that touches the model. Rows of different robots differ in images, camera masks,
state and prompt tokens, all of which are inputs of the bucket's engine, so nothing is rebuilt between batches. A
batch of n rows runs in the smallest bucket >= n, padded with dummy rows (one zero view, no prompt) whose actions
are dropped. Results go back through each request's callback, which must not block (the server's callbacks hand
the result to the event loop with `call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vla_rt.inputs import ModelInputs
from vla_rt.policy import PreparedObservation
from vla_rt.serve.engines import ServingModel
from vla_rt.serve.scheduler import Batch, BatchQueue, CostModel

log = logging.getLogger("vla_rt.serve")


@dataclass(frozen=True)
class RowResult:
    """One request's answer from the worker: normalized actions (H, A), or a one-line server fault."""

    actions: np.ndarray | None
    error: str | None
    queue_ms: float
    infer_ms: float
    batch_size: int
    bucket: int
    superseded: int = 0


class BatchRunner:
    """Stacks prepared rows into one bucket-sized batch and runs the bucket's model."""

    def __init__(self, serving: ServingModel, *, seed: int | None = None):
        self.serving = serving
        # the denoising noise: seeded for reproducible actions, else drawn from the process's generator
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)
        model = serving.policy.model
        self.num_steps = serving.policy.num_steps
        self.views = model.shapes.num_views
        self.prompt_len = serving.policy.prompt_len
        self.size = model.config.vision.image_size
        self.chunk, self.action_dim = model.chunk, model.config.action_dim
        self.device = model.device

    def dummy_row(self) -> PreparedObservation:
        """A padding row: one zero view (so attention has a key), zero state, no prompt."""
        masks = torch.zeros(1, self.views, dtype=torch.bool)
        masks[0, 0] = True
        tokens = torch.zeros(1, self.prompt_len, dtype=torch.long)
        return PreparedObservation(torch.zeros(1, self.views, self.size, self.size, 3), masks,
                                   torch.zeros(1, self.action_dim), tokens, tokens.bool(), None)  # fmt: skip

    def _stack(self, rows: Sequence[PreparedObservation]) -> ModelInputs:
        """Rows -> one batch on the model's device (rows were checked one by one when they were prepared)."""
        no_tokens = torch.zeros(1, self.prompt_len, dtype=torch.long)
        d = self.device
        return ModelInputs(
            images=torch.cat([r.images for r in rows]).to(d),
            state=torch.cat([r.state for r in rows]).to(d),
            tokens=torch.cat([no_tokens if r.tokens is None else r.tokens for r in rows]).to(d),
            noise=None,
            image_masks=torch.cat([r.image_masks for r in rows]).to(d),
            token_mask=torch.cat([no_tokens.bool() if r.token_mask is None else r.token_mask for r in rows]).to(d),
        )

    def run(self, rows: Sequence[PreparedObservation], bucket: int) -> np.ndarray:
        """n rows -> (n, H, A) float32 normalized actions, computed in the `bucket` model (n <= bucket)."""
        n = len(rows)
        if not 1 <= n <= bucket:
            raise ValueError(f"batch: expected 1..{bucket} rows for bucket {bucket}, found {n}")
        x = self._stack([*rows, *[self.dummy_row()] * (bucket - n)])
        noise = torch.randn(bucket, self.chunk, self.action_dim, generator=self._generator)
        with torch.no_grad():
            actions = self.serving.runs[bucket](x, noise.to(self.device), self.num_steps)
        return actions[:n].float().cpu().numpy()  # waits for the device


def measure_cost_model(runner: BatchRunner, *, iters: int, warmup: int = 2) -> CostModel:
    """Times each bucket on dummy rows, as the worker calls it (stacking, copies, the engine, the copy back)."""
    median, p99 = {}, {}
    for bucket in runner.serving.buckets:
        rows = [runner.dummy_row()] * bucket
        for _ in range(warmup):
            runner.run(rows, bucket)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.run(rows, bucket)
            times.append((time.perf_counter() - t0) * 1e3)
        median[bucket], p99[bucket] = float(np.median(times)), float(np.percentile(times, 99))
        log.info("cost model: batch %d takes %.2f ms median, %.2f ms p99 (%d calls)", bucket, median[bucket],
                 p99[bucket], iters)  # fmt: skip
    return CostModel(median, p99)


class GpuWorker:
    """The thread that owns the model. `on_batch(batch, infer_s)` reports each batch (metrics); never blocks."""

    def __init__(self, queue: BatchQueue, runner: BatchRunner,
                 on_batch: Callable[[Batch, float], None] | None = None):  # fmt: skip
        self.queue, self.runner, self.on_batch = queue, runner, on_batch
        self._thread = threading.Thread(target=self._loop, name="vla-rt-gpu-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.queue.close()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (batch := self.queue.next_batch()) is not None:
            t0 = time.perf_counter()
            try:
                actions = self.runner.run([r.payload for r in batch.requests], batch.bucket)
                error = None
            except Exception:  # a bug or a device fault: the robots get a one-line message, the log the traceback
                log.exception("batch of %d rows (bucket %d) failed", len(batch.requests), batch.bucket)
                actions, error = None, "internal server error while running the model (see the server log)"
            infer_ms = (time.perf_counter() - t0) * 1e3
            for i, request in enumerate(batch.requests):
                result = RowResult(None if actions is None else actions[i], error,
                                   (batch.formed - request.enqueued) * 1e3, infer_ms, len(batch.requests),
                                   batch.bucket, request.superseded)  # fmt: skip
                for callback in request.callbacks:
                    callback(result)
            if self.on_batch is not None:
                self.on_batch(batch, infer_ms / 1e3)
