"""The model a server runs: one `Pi0Inference` per batch bucket over one copy of the weights, and the policy.

`triton`: a static engine (CUDA Graph) per bucket, all reading the largest bucket's engine weights
(`vla_rt.engine.buckets`). `reference` / `folded`: one model takes any batch size, so every bucket is that model
(the worker still pads to buckets, so the cost model and the batches are the same on every backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vla_rt.checkpoints import load_checkpoint
from vla_rt.engine.buckets import build_triton_buckets
from vla_rt.inference import BACKENDS, Pi0Inference, build_pi0
from vla_rt.inputs import BuiltShapes
from vla_rt.policy import Pi0Policy
from vla_rt.serve.profiles import MODEL_VIEWS
from vla_rt.serve.scheduler import batch_buckets


@dataclass
class ServingModel:
    """{bucket: model} plus the policy whose `prepare` / `finish` turn observations into rows and rows into actions."""

    models: dict[int, Pi0Inference]
    policy: Pi0Policy

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.models))

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
        models = {b: Pi0Inference(e, cfg, e.shapes, backend=backend, device=device, dtype=dtype, impl=e, **common)
                  for b, e in engines.items()}  # fmt: skip
    else:
        model = build_pi0(ckpt.weights, cfg, backend=backend, device=device, dtype=dtype, num_views=num_views,
                          chunk=chunk, prompt_len=prompt_len, **common)  # fmt: skip
        models = dict.fromkeys(buckets, model)
    del ckpt
    policy = Pi0Policy(models[buckets[0]], camera_names=MODEL_VIEWS[:num_views], tokenizer=tokenizer,
                       prompt_len=prompt_len, num_steps=num_steps)  # fmt: skip
    return ServingModel(models, policy)
