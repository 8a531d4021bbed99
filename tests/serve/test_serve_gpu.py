"""The server's GPU path (run with `pytest -m gpu tests/serve` on the device): start-up as `vla-rt serve` does it
on CUDA (the stage engine's graphs, the measured stage costs) and real openpi clients answered by the triton
backend, within bf16 tolerance of the float32 reference. (The stage engine itself: tests/test_gpu_stages.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vla_rt.inference import load_pi0
from vla_rt.numerics import rel_err
from vla_rt.serve.app import ServeConfig, build_server
from vla_rt.serve.profiles import DROID

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


def test_openpi_client_on_the_triton_backend(checkpoints) -> None:
    """Start-up as `vla-rt serve` does it on CUDA (triton, bf16, the cost model measured), then a real client."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    server = build_server(ServeConfig(str(checkpoints["droid"]), profile="droid", max_batch=4, prompt_len=8, port=0))
    costs = server.service.costs
    assert costs.prefix_buckets == (1, 2, 4) and costs.expert_buckets == (1, 2, 4)
    assert all(0 < costs.expert_median_ms[b] <= costs.expert_p99_ms[b] for b in costs.expert_buckets)
    assert all(0 < costs.prefix_median_ms[k] <= costs.prefix_p99_ms[k] for k in costs.prefix_buckets)
    with server.run_in_thread() as thread:
        client = WebsocketClientPolicy("127.0.0.1", thread.port)
        meta = client.get_server_metadata()
        assert (meta["backend"], meta["dtype"], meta["num_views"]) == ("triton", "bfloat16", 2)
        obs = DROID.example(np.random.default_rng(0), prompt=[1, 2, 3])
        answer = client.infer(obs)
        assert answer["actions"].shape == (10, 8) and np.isfinite(answer["actions"]).all()
        client._ws.close()
    service = server.service
    inputs = service.profile.parse(obs)
    row = service.policy.prepare(inputs.policy_obs)
    reference = load_pi0(str(checkpoints["droid"]), num_views=2, chunk=10, prompt_len=8)
    noise = torch.randn(1, 10, 32)
    served = service.serving.model.sample_actions(row.images, row.state, row.tokens, noise, image_masks=row.image_masks,
                                                  token_mask=row.token_mask).cpu()  # fmt: skip
    ref = reference.sample_actions(row.images, row.state, row.tokens, noise, image_masks=row.image_masks,
                                   token_mask=row.token_mask)  # fmt: skip
    assert rel_err(served, ref) <= BF16_TOL
