"""The server's GPU path (run with `pytest -m gpu tests/serve` on the device): Triton bucket engines under CUDA
Graphs sharing one copy of the weights, each bucket within bf16 tolerance of the float32 reference, and a real
openpi client answered by the triton backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_rt.engine.buckets import build_triton_buckets
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights
from vla_rt.serve.app import ServeConfig, build_server
from vla_rt.serve.profiles import DROID

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


def test_triton_buckets_share_weights_and_match_the_reference(small_config) -> None:
    cfg, device = small_config, torch.device("cuda")
    weights = random_weights(cfg, seed=8)
    engines = build_triton_buckets(weights, cfg, BuiltShapes(2, 10, 8), (1, 2, 4), device=device, dtype=torch.bfloat16)
    assert len({id(e.weights) for e in engines.values()}) == 1 and all(e.graph is not None for e in engines.values())
    reference = build_pi0(weights, cfg, num_views=2, chunk=10, prompt_len=8)
    g = torch.Generator().manual_seed(0)
    for b, engine in engines.items():
        images = torch.rand(b, 2, cfg.vision.image_size, cfg.vision.image_size, 3, generator=g) * 2 - 1
        state, noise = torch.randn(b, 32, generator=g), torch.randn(b, 10, 32, generator=g)
        tokens = torch.randint(0, cfg.vocab_size, (b, 8), generator=g)
        x = check_model_inputs(cfg, BuiltShapes(2, 10, 8, b), images, state, tokens, noise)
        x.images, x.state, x.tokens = x.images.to(device), x.state.to(device), x.tokens.to(device)
        x.image_masks = x.image_masks.to(device)
        out = engine(x, noise.to(device), 10).float().cpu()
        ref = reference.sample_actions(images, state, tokens, noise)
        assert float((out - ref).norm() / ref.norm()) <= BF16_TOL


def test_openpi_client_on_the_triton_backend(checkpoints) -> None:
    """Start-up as `vla-rt serve` does it on CUDA (triton, bf16, the cost model measured), then a real client."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    server = build_server(ServeConfig(str(checkpoints["droid"]), profile="droid", max_batch=4, prompt_len=8, port=0))
    cost = server.service.cost
    assert cost.buckets == (1, 2, 4) and all(0 < cost.median_ms[b] <= cost.p99_ms[b] for b in cost.buckets)
    with server.run_in_thread() as thread:
        client = WebsocketClientPolicy("127.0.0.1", thread.port)
        meta = client.get_server_metadata()
        assert (meta["backend"], meta["dtype"], meta["num_views"]) == ("triton", "bfloat16", 2)
        answer = client.infer(DROID.example(np.random.default_rng(0), prompt=[1, 2, 3]))
        assert answer["actions"].shape == (10, 8) and np.isfinite(answer["actions"]).all()
        client._ws.close()
