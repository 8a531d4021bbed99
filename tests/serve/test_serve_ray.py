"""`vla-rt serve --ray` on a local Ray instance (CPU): real openpi clients through the Ray Serve ingress."""

from __future__ import annotations

import logging
import socket
import urllib.request

import numpy as np
import pytest

serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'vla-rt[ray]')")
import ray  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402

from vla_rt.serve.app import ServeConfig  # noqa: E402
from vla_rt.serve.ray_app import build_app  # noqa: E402
from vla_rt.serve.scheduler import StageCosts  # noqa: E402

GOOD = {"images": {"base_0_rgb": np.zeros((56, 56, 3), np.uint8)}, "state": np.zeros(6), "tokenized_prompt": [1, 2]}


@pytest.fixture(scope="module")
def ray_server(checkpoints):
    """Two worker replicas (two "GPUs") behind one ingress, on a local 2-CPU Ray instance."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ServeConfig(str(checkpoints["generic"]), num_views=1, prompt_len=8, max_batch=2, api_key="k",
                          slo_ms=40.0)  # fmt: skip
        # each replica: prefix 10 ms, steps 0.5 ms: one robot 15 ms, two 35 ms, a third 45 ms > 40 -> two a replica
        cost = StageCosts.flat(10.0, 0.5, (1, 2), (1, 2))
        serve.run(build_app(cfg, replicas=2, cost=cost), name="vla-rt", route_prefix="/")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_ray_deployment_serves_openpi_clients_across_replicas(ray_server) -> None:
    port = ray_server
    robots = [WebsocketClientPolicy(f"ws://127.0.0.1:{port}/", api_key="k") for _ in range(4)]
    replicas = [r.get_server_metadata()["replica"] for r in robots]
    assert sorted(replicas) == [0, 0, 1, 1]  # spread by headroom: each replica holds what its SLO allows
    for r in robots:
        answer = r.infer(GOOD)
        assert answer["actions"].shape == (50, 6) and np.isfinite(answer["actions"]).all()
    with pytest.raises(InvalidStatus, match="403"):  # both replicas full: refused at the handshake
        WebsocketClientPolicy(f"ws://127.0.0.1:{port}/", api_key="k")
    with pytest.raises(InvalidStatus, match="403"):
        WebsocketClientPolicy(f"ws://127.0.0.1:{port}/", api_key="wrong")
    with pytest.raises(RuntimeError, match=r"Error in inference server:\nstate: expected shape \(N,\)"):
        robots[0].infer({**GOOD, "state": np.zeros((2, 3))})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as response:
        assert response.read() == b"OK\n"
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Api-Key k"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    assert 'vla_rt_requests_total{replica="0"} 2.0' in text and 'vla_rt_requests_total{replica="1"} 2.0' in text
    assert 'vla_rt_robots_refused_total{replica="0"} 1.0' in text
    for r in robots[1:]:
        r._ws.close()


def test_the_load_test_reports_how_the_ingress_spread_the_robots(ray_server) -> None:
    """`vla-rt loadtest` against a `--ray` server: each robot's replica (from the handshake) and the spread."""
    from vla_rt.serve.loadtest import run_round

    summary = run_round("127.0.0.1", ray_server, 2, rate_hz=4.0, seconds=1.0, api_key="k", progress=False,
                        image_size=56)  # fmt: skip
    assert summary["refused"] == 0 and summary["errors"] == 0 and summary["answers"] >= 2
    assert sorted(r["replica"] for r in summary["per_robot"]) == [0, 1]  # the second robot: the emptier replica
    assert summary["by_replica"] == {"0": 1, "1": 1}
