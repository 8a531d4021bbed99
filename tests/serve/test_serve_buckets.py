"""Bucket engines share one copy of the weights and compute what an engine built for that batch size computes."""

from __future__ import annotations

import torch

from vla_rt.engine.buckets import build_bucket_engines
from vla_rt.engine.kernels import TorchKernels
from vla_rt.engine.static_engine import StaticPi0Engine
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights


def _inputs(cfg, b: int, views: int, prompt: int, chunk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    masks = torch.rand(b, views, generator=g) > 0.4
    masks[:, 0] = True
    return dict(images=torch.rand(b, views, s, s, 3, generator=g) * 2 - 1, state=torch.randn(b, 32, generator=g),
                tokens=torch.randint(0, cfg.vocab_size, (b, prompt), generator=g),
                token_mask=torch.arange(prompt)[None] < torch.randint(1, prompt + 1, (b, 1), generator=g),
                image_masks=masks, noise=torch.randn(b, chunk, 32, generator=g))  # fmt: skip


def test_buckets_share_weights_and_match_engines_built_per_batch(small_config) -> None:
    cfg, shapes = small_config, BuiltShapes(num_views=2, chunk=5, prompt_len=4)
    weights = random_weights(cfg, seed=5)
    engines = build_bucket_engines(weights, cfg, shapes, (1, 2, 4), kernels=TorchKernels(), device=torch.device("cpu"),
                                   dtype=torch.float32)  # fmt: skip
    assert sorted(engines) == [1, 2, 4]
    shared = {id(e.weights) for e in engines.values()}
    assert len(shared) == 1  # one EngineWeights object, so one copy of every tensor
    ptrs = {b: e.weights.embed_tokens.data_ptr() for b, e in engines.items()}
    assert len(set(ptrs.values())) == 1
    reference = build_pi0(weights, cfg, num_views=2, chunk=5, prompt_len=4)
    for b, engine in engines.items():
        x = _inputs(cfg, b, 2, 4, 5, seed=b)
        own = StaticPi0Engine(weights, cfg, BuiltShapes(2, 5, 4, b), kernels=TorchKernels(), device=torch.device("cpu"),
                              dtype=torch.float32)  # fmt: skip
        checked = check_model_inputs(cfg, BuiltShapes(2, 5, 4, b), x["images"], x["state"], x["tokens"], x["noise"],
                                     x["image_masks"], x["token_mask"])  # fmt: skip
        ours, theirs = engine(checked, x["noise"], 10), own(checked, x["noise"], 10)
        assert ours.shape == (b, 5, 32)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # same plan, same weights: bit-identical
        ref = reference.sample_actions(x["images"], x["state"], x["tokens"], x["noise"], image_masks=x["image_masks"],
                                       token_mask=x["token_mask"])  # fmt: skip
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_a_padded_row_does_not_change_the_real_rows(small_config) -> None:
    """What the worker relies on: rows are independent, so dummy padding rows change nothing."""
    cfg, shapes = small_config, BuiltShapes(num_views=1, chunk=3, prompt_len=2)
    engines = build_bucket_engines(random_weights(cfg, seed=6), cfg, shapes, (1, 2), kernels=TorchKernels(),
                                   device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    x = _inputs(cfg, 2, 1, 2, 3, seed=9)
    one = {k: v[:1] for k, v in x.items()}
    c2 = check_model_inputs(cfg, BuiltShapes(1, 3, 2, 2), x["images"], x["state"], x["tokens"], x["noise"],
                            x["image_masks"], x["token_mask"])  # fmt: skip
    c1 = check_model_inputs(cfg, BuiltShapes(1, 3, 2, 1), one["images"], one["state"], one["tokens"], one["noise"],
                            one["image_masks"], one["token_mask"])  # fmt: skip
    torch.testing.assert_close(engines[2](c2, x["noise"], 10)[:1], engines[1](c1, one["noise"], 10), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
