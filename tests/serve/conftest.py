"""Fixtures of the serving tests: a small π0 checkpoint with norm stats, a trained SentencePiece model, servers.

The model has the `tiny` preset's dims with 56 px images (16 patches a view), so a batch of 16 robots runs in well
under a second on two CPU cores: the tests check behaviour (what robots get back, who is refused, what survives a
bad client), never speed. Servers get an injected cost stage costs, so admission is deterministic.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_helpers import flat_cost

from vla_rt import preset
from vla_rt.checkpoints.native import save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import VisionConfig
from vla_rt.model import random_weights
from vla_rt.serve.app import ServeConfig, build_server
from vla_rt.serve.scheduler import StageCosts
from vla_rt.serve.server import ServerThread

IMAGE_SIZE = 56
# (state dims, action dims) of each profile's norm stats, as openpi computes them on the robot's own vectors
STATS_DIMS = {"aloha": (14, 14), "droid": (8, 8), "libero": (8, 7), "generic": (6, 6)}
PROMPTS = ["pick up the red block", "fold the towel", "open the drawer", "put the cup on the plate",
           "do something", "transfer the cube", "stack the bowls", "wipe the table"]  # fmt: skip


def _small_config():
    cfg = preset("tiny")
    return cfg.replace(vision=VisionConfig(**{**cfg.vision.__dict__, "image_size": IMAGE_SIZE}))


def make_stats(rng: np.random.Generator, dim: int) -> NormStats:
    mean = rng.normal(size=dim)
    std = rng.uniform(0.5, 2.0, dim)
    q01 = mean - 2 * std
    return NormStats(mean=mean, std=std, q01=q01, q99=q01 + rng.uniform(1.0, 4.0, dim))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: the server's worker shares two cores with its event loop and up to 16 client threads,
    and OpenMP's spinning workers would fight them (on a loaded machine a batch then takes 100x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{profile (or profile + "_quantile"): native checkpoint with norm stats of that profile's dims}."""
    cfg, weights = _small_config(), random_weights(_small_config(), seed=3)
    root = tmp_path_factory.mktemp("serve_ckpt")
    out = {}
    for i, (name, (state_dim, action_dim)) in enumerate(STATS_DIMS.items()):
        rng = np.random.default_rng(100 + i)
        stats = {"state": make_stats(rng, state_dim), "actions": make_stats(rng, action_dim)}
        for quantile in (False, True):
            key = f"{name}_quantile" if quantile else name
            out[key] = save_native(root / f"{key}.safetensors", weights, cfg, source="test", norm_stats=stats,
                                   use_quantile_norm=quantile)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    """A small SentencePiece model trained here ("\\n" a symbol of its own, as in PaliGemma's vocabulary)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(PROMPTS * 20), model_writer=model, vocab_size=32,
                                   user_defined_symbols=["\n"], add_dummy_prefix=False, minloglevel=2)  # fmt: skip
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


@contextlib.contextmanager
def running_server(checkpoint: Path, *, cost: StageCosts | None = None, **settings) -> Iterator[ServerThread]:
    cfg = ServeConfig(str(checkpoint), port=0, **settings)
    server = build_server(cfg, cost or flat_cost(cfg))
    with server.run_in_thread() as thread:
        yield thread


@pytest.fixture
def small_config():
    """The tests' model dims: `tiny` with 56 px images."""
    return _small_config()


@pytest.fixture(scope="session")
def start_server():
    """`with start_server(checkpoint, profile=..., **ServeConfig fields) as thread:` a server on `thread.port`."""
    return running_server
