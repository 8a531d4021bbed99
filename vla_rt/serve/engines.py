"""The model a server runs: a backend function per batch bucket over one copy of the weights, and the policy.

`triton`: a static engine (CUDA Graph) per bucket, all reading the largest bucket's engine weights
(`vla_rt.engine.buckets`). `reference` / `folded`: one model takes any batch size, so every bucket is that model
(the worker still pads to buckets, so the cost model and the batches are the same on every backend).

The worker calls the backend functions (`vla_rt.inference.BackendFn`: checked inputs, noise, steps) rather than
`Pi0Inference.sample_actions`, because every row was already checked on its own when it was prepared
(`RobotService`): checking the stacked batch again would cost the worker, on the critical path, a pass over every
image of the batch (~5-50 ms at batch 16 on a host CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vla_rt.checkpoints import load_checkpoint
from vla_rt.engine.buckets import build_triton_buckets
from vla_rt.inference import BACKENDS, BackendFn, Pi0Inference, build_pi0
from vla_rt.inputs import BuiltShapes, ModelInputs
from vla_rt.model import Pi0Model
from vla_rt.policy import Pi0Policy
from vla_rt.serve.profiles import MODEL_VIEWS
from vla_rt.serve.scheduler import batch_buckets


@dataclass
class ServingModel:
    """{bucket: backend function} plus the policy whose `prepare` / `finish` turn observations into rows and rows
    into actions (its model is the bucket-1 model: config, shapes, device, norm stats)."""

    runs: dict[int, BackendFn]
    policy: Pi0Policy

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.runs))

    @property
    def shapes(self) -> BuiltShapes:
        return self.policy.model.shapes

    @property
    def chunk(self) -> int:
        return self.policy.model.chunk


def build_serving_model(
    path: str,
    *,
    backend: str,
    device: str | torch.device,
    dtype: torch.dtype,
    num_views: int,
    chunk: int | None,
    prompt_len: int | None,
    max_batch: int,
    tokenizer: str | None = None,
    num_steps: int = 10,
) -> ServingModel:
    """Loads the checkpoint once and builds the bucket models. `chunk` / `prompt_len` None: the checkpoint's."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, found {backend!r}")
    if not 1 <= num_views <= len(MODEL_VIEWS):
        raise ValueError(f"num_views: expected 1..{len(MODEL_VIEWS)} (π0's image slots), found {num_views}")
    device = torch.device(device)
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton': expected a CUDA device, found {device} (use --backend folded on a CPU)")
    if prompt_len is not None and prompt_len < 1:
        raise ValueError(
            f"prompt_len: expected at least 1 token (π0's prompt is BOS + text + '\\n'), found {prompt_len}"
        )
    buckets = batch_buckets(max_batch)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    chunk = chunk or cfg.chunk
    prompt_len = cfg.max_token_len if prompt_len is None else prompt_len
    common = dict(source=ckpt.source, norm_stats=ckpt.norm_stats, use_quantile_norm=ckpt.use_quantile_norm)
    if backend == "triton":
        cfg = cfg.replace(chunk=chunk)
        engines = build_triton_buckets(ckpt.weights, cfg, BuiltShapes(num_views, chunk, prompt_len), buckets,
                                       device=device, dtype=dtype, num_steps=num_steps)  # fmt: skip
        one = engines[buckets[0]]
        model = Pi0Inference(one, cfg, one.shapes, backend=backend, device=device, dtype=dtype, impl=one, **common)
        runs: dict[int, BackendFn] = dict(engines)
    else:
        model = build_pi0(ckpt.weights, cfg, backend=backend, device=device, dtype=dtype, num_views=num_views,
                          chunk=chunk, prompt_len=prompt_len, **common)  # fmt: skip
        runs = dict.fromkeys(buckets, model.impl if backend == "folded" else _reference_run(model.impl))
    del ckpt
    policy = Pi0Policy(model, camera_names=MODEL_VIEWS[:num_views], tokenizer=tokenizer, prompt_len=prompt_len,
                       num_steps=num_steps)  # fmt: skip
    return ServingModel(runs, policy)


def _reference_run(model: Pi0Model) -> BackendFn:
    """The eager reference as a backend function (its own `sample_actions` takes the tensors one by one)."""

    def run(x: ModelInputs, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
        return model.sample_actions(x.images, x.state, x.tokens, noise, num_steps, image_masks=x.image_masks,
                                    token_mask=x.token_mask)  # fmt: skip

    return run
