"""The server through openpi's real client: every profile, metadata, healthz, metrics, API keys, SLO admission."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from serve_helpers import flat_cost, run_alone
from websockets.exceptions import InvalidStatus

from vla_rt.serve.app import ServeConfig, build_service
from vla_rt.serve.profiles import get_profile
from vla_rt.serve.scheduler import StageCosts

CHUNK = {"aloha": 50, "droid": 10, "libero": 50, "generic": 50}  # openpi's action horizons (the profiles' defaults)
DIMS = {"aloha": 14, "droid": 8, "libero": 7, "generic": 6}


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("profile", ["aloha", "droid", "libero", "generic"])
def test_openpi_client_gets_actions_for_each_profile(profile, checkpoints, tokenizer_model, start_server) -> None:
    with start_server(checkpoints[profile], profile=profile, tokenizer=str(tokenizer_model), prompt_len=24,
                      max_batch=2) as server:  # fmt: skip
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        meta = client.get_server_metadata()
        assert meta["profile"] == profile and meta["action_horizon"] == CHUNK[profile]
        assert meta["action_dim"] == DIMS[profile] and meta["text_prompts"] is True
        if profile == "aloha":
            assert meta["reset_pose"] == [0, -1.5, 1.5, 0, 0, 0]  # openpi's pi0_aloha policy metadata
        obs = get_profile(profile, meta["num_views"]).example(np.random.default_rng(0))
        if profile == "generic":
            obs["state"] = obs["state"][:6]
        answer = client.infer(obs)
        assert answer["actions"].shape == (CHUNK[profile], DIMS[profile]) and answer["actions"].dtype == np.float32
        assert np.isfinite(answer["actions"]).all()
        assert {"infer_ms", "queue_ms", "batch_size", "total_ms"} <= set(answer["server_timing"])
        broker = ActionChunkBroker(client, action_horizon=5)  # openpi's chunk broker: one call per 5 steps
        steps = [broker.infer(obs)["actions"] for _ in range(7)]
        assert all(s.shape == (DIMS[profile],) for s in steps)
        client._ws.close()


@pytest.mark.parametrize("scheduler", ["stage", "overlap"])
def test_served_actions_equal_the_in_process_path(scheduler, checkpoints, start_server) -> None:
    """With a seed, the client's answer is exactly profile -> prepare -> the stages -> finish, in this process."""
    settings = dict(profile="droid", max_batch=2, prompt_len=8, seed=11, scheduler=scheduler)
    obs = get_profile("droid").example(np.random.default_rng(5), prompt=[1, 4, 2])
    with start_server(checkpoints["droid"], **settings) as server:
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        answer = client.infer(obs)
        client._ws.close()
    cfg = ServeConfig(str(checkpoints["droid"]), **settings)
    service = build_service(cfg, flat_cost(cfg))
    inputs = service.profile.parse(obs)
    row = service.policy.prepare(inputs.policy_obs, uint8_images=True)
    expected = service.profile.finish(service.policy.finish(run_alone(service, row, 11)), inputs.state, 8)
    np.testing.assert_allclose(answer["actions"], expected, rtol=1e-6, atol=1e-6)
    other = service.profile.finish(service.policy.finish(run_alone(service, row, 12)), inputs.state, 8)
    assert not np.allclose(other, answer["actions"], atol=1e-3)
    timing = answer["server_timing"]  # the server's own account of the round trip, which adds up
    parts = ("decode_ms", "prepare_ms", "queue_ms", "prefix_ms", "expert_ms", "finish_ms")
    assert all(timing[k] >= 0 for k in parts) and timing["infer_ms"] == timing["prefix_ms"] + timing["expert_ms"]
    assert sum(timing[k] for k in parts) == pytest.approx(timing["total_ms"])
    assert (timing["prefix_rows"], timing["batch_size"], timing["stages"]) == (1, 1.0, 10)


def test_healthz_metrics_and_api_key(checkpoints, start_server, monkeypatch) -> None:
    key = "s3cret"
    with start_server(checkpoints["generic"], num_views=1, max_batch=2, api_key=key) as server:
        assert _get(server.port, "/healthz") == (200, "OK\n")  # open, for load balancers
        for headers in ({}, {"Authorization": "Api-Key wrong"}, {"Authorization": key}):
            status, body = _get(server.port, "/metrics", headers)
            assert status == 401 and "expected 'Api-Key <the server's key>'" in body
        for api_key in (None, "wrong"):
            with pytest.raises(InvalidStatus) as err:
                WebsocketClientPolicy("127.0.0.1", server.port, api_key=api_key)
            assert err.value.response.status_code == 401
        client = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)
        obs = {"images": {"base_0_rgb": np.zeros((56, 56, 3), np.uint8)}, "state": np.zeros(6)}
        for _ in range(3):
            client.infer(obs)
        client._ws.close()
        status, text = _get(server.port, "/metrics", {"Authorization": f"Api-Key {key}"})
    assert status == 200
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["vla_rt_requests_total"]) == 3
    assert float(lines['vla_rt_errors_total{kind="auth"}']) == 5
    assert float(lines["vla_rt_robots_admitted_total"]) == 1 and float(lines["vla_rt_robots_connected"]) == 0
    assert float(lines["vla_rt_batch_size_count"]) == 3 and float(lines['vla_rt_batch_size_bucket{le="1.0"}']) == 3
    for name in ("vla_rt_queue_seconds_count", "vla_rt_request_seconds_count"):
        assert float(lines[name]) == 3
    stages = {k: float(lines[f'vla_rt_stage_seconds_count{{stage="{k}"}}']) for k in ("prefix", "expert")}
    assert stages == {"prefix": 3, "expert": 30}  # one prefix and ten steps a request
    assert 'vla_rt_cost_model_seconds{quantile="0.99",rows="2",stage="expert"}' in lines


def test_admission_refuses_at_connect_and_never_evicts(checkpoints, start_server) -> None:
    # prefix stages 10 ms, expert stages 0.5 ms; robots at 5 Hz, SLO 66 ms: 4 robots 60.5 ms, a fifth 71.5 ms
    cost = StageCosts.flat(10.0, 0.5, (1, 2, 4), (1, 2, 4))
    obs = {"images": {"base_0_rgb": np.zeros((56, 56, 3), np.uint8)}, "state": np.zeros(6)}
    with start_server(checkpoints["generic"], num_views=1, max_batch=4, slo_ms=66, robot_hz=5, cost=cost) as server:
        for _ in range(5):  # plain HTTP GETs of / are admitted, then fail the handshake: their slots come back
            assert _get(server.port, "/")[0] == 426
        robots = [WebsocketClientPolicy("127.0.0.1", server.port) for _ in range(4)]
        with pytest.raises(InvalidStatus) as err:
            WebsocketClientPolicy("127.0.0.1", server.port)
        assert err.value.response.status_code == 503
        reason = err.value.response.body.decode()
        assert "the SLO is p99 <= 66 ms" in reason and "predicted p99 71.5 ms" in reason and "4 robots" in reason
        assert all(r.infer(obs)["actions"].shape == (50, 6) for r in robots)  # the admitted ones keep being served
        with pytest.raises(InvalidStatus, match="503"):
            WebsocketClientPolicy(f"ws://127.0.0.1:{server.port}/?hz=1")  # a slow robot still adds its prefixes
        robots.pop()._ws.close()  # one leaves: there is room again
        for _ in range(50):  # (the server notices the close asynchronously)
            try:
                robots.append(WebsocketClientPolicy("127.0.0.1", server.port))
                break
            except InvalidStatus:
                time.sleep(0.05)
        assert len(robots) == 4 and robots[-1].infer(obs)["actions"].shape == (50, 6)
        for r in robots:
            r._ws.close()
        status, body = _get(server.port, "/?hz=abc")
        assert status == 400 and "hz: expected a request rate in Hz, found 'abc'" in body


def test_pi05_checkpoint_serves_text_prompts(tokenizer_model, start_server) -> None:
    """π0.5 writes the state into the prompt: the policy builds it per request, the profile just passes the text. A
    prompt whose tokens with the state overrun prompt_len is refused with its count (openpi cuts it, and the cut
    drops the state): 6 state values make 38 tokens of this tokenizer, 32 values more than 48."""
    with start_server("random:tiny_pi05", num_views=1, max_batch=2, prompt_len=48, chunk=4,
                      tokenizer=str(tokenizer_model)) as server:  # fmt: skip
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        meta = client.get_server_metadata()
        assert (meta["model"], meta["text_prompts"], meta["prompt_len"]) == ("pi05", True, 48)
        obs = {"images": {"base_0_rgb": np.zeros((32, 32, 3), np.uint8)}, "state": np.full(6, 0.5), "prompt": "wipe"}
        assert client.infer(obs)["actions"].shape == (4, 32)
        with pytest.raises(
            RuntimeError, match=r"prompt: expected a text prompt or prompt_tokens \(π0.5 needs a text prompt"
        ):
            client.infer({k: v for k, v in obs.items() if k != "prompt"})
        client = WebsocketClientPolicy("127.0.0.1", server.port)
        with pytest.raises(RuntimeError, match=r"prompt: expected at most 48 tokens with the state written in"):
            client.infer({**obs, "state": np.full(32, 0.5)})


@pytest.mark.parametrize("argv", [["serve"], ["loadtest", "--robots", "1"], ["serve", "--role", "prefix"]])
def test_a_pi05_server_without_a_tokenizer_is_refused_before_any_build(argv, monkeypatch, capsys) -> None:
    """A π0.5 refuses fixed token ids (they would freeze the state it reads from its prompt) and needs a tokenizer
    for text: without --tokenizer it could answer no robot, so the command stops at the checkpoint's header."""
    import vla_rt.serve.app as app
    import vla_rt.split.roles as roles
    from vla_rt.cli import main

    def forbidden(*args, **kwargs):
        raise AssertionError("built an engine for a π0.5 server without a tokenizer")

    monkeypatch.setattr(app, "build_serving_model", forbidden)
    monkeypatch.setattr(roles, "load_checkpoint", forbidden)
    command, *flags = argv
    assert main([command, "random:tiny_pi05", *flags]) == 2  # the builders above fail the test if reached
    err = capsys.readouterr().err
    assert "--tokenizer: expected a SentencePiece .model for a π0.5 checkpoint" in err, err
    assert "found no --tokenizer for random:tiny_pi05" in err, err


def test_views_at_the_model_size_are_prepared_on_the_event_loop_others_in_the_pool(checkpoints) -> None:
    """The prepare pool costs two thread hand-offs; a row whose views need no resize skips it (and gets the same
    row), a view to resize still goes there so the event loop keeps serving."""
    import asyncio

    cfg = ServeConfig(str(checkpoints["generic"]), profile="generic", max_batch=2, prompt_len=8)
    service = build_service(cfg, flat_cost(cfg))
    pooled = []
    real_pool = service._pool

    class CountingPool:
        def submit(self, fn, *args):
            pooled.append(args)
            return real_pool.submit(fn, *args)

    service._pool = CountingPool()
    rng = np.random.default_rng(0)
    size = service.policy.model.config.vision.image_size

    def obs(side: int) -> dict:
        views = {name: rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for name in ("base_0_rgb",)}
        return {"images": views, "state": rng.normal(size=6)}

    async def submit(o: dict) -> None:
        ticket = await service.submit(0, o, time.monotonic())
        ticket.future.cancel()  # the worker is not started: only the preparing is under test

    try:
        for side, expect_pooled in ((size, 0), (size + 8, 1)):
            asyncio.run(submit(obs(side)))
            assert len(pooled) == expect_pooled
        row = service._prepare(service.profile.parse(obs(size)).policy_obs)
        assert row.images.shape[-3:-1] == (size, size) and row.images.dtype == torch.uint8
    finally:
        real_pool.shutdown()  # the worker never started: nothing else to stop
