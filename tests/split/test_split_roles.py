"""The two roles over loopback, driven by openpi's own client: every answer is the monolithic engine's, bit for bit,
for the KV version it names (π0 with the request's state, π0.5 with the state in its observation's prompt), the
relay answers the first chunk, a mismatched pair is refused by name, and a stale KV is refused in one line."""

from __future__ import annotations

import time

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from split_harness import (
    CHUNK,
    expected_actions,
    observation,
    running_expert,
    running_pair,
    running_prefix,
    write_checkpoint,
)

from vla_rt.split.roles import SplitConfig
from vla_rt.split.shaper import LinkProfile


def _drive(port: int, observations: list[dict], period_s: float) -> list[dict]:
    client = WebsocketClientPolicy("127.0.0.1", port)
    answers = []
    for obs in observations:
        answers.append(client.infer(obs))
        time.sleep(period_s)
    return answers


def test_answers_equal_the_monolithic_engine_for_the_kv_version_they_name(checkpoint) -> None:
    rng = np.random.default_rng(1)
    observations = [observation(rng) for _ in range(10)]
    with running_pair(checkpoint) as pair:
        answers = _drive(pair.robot_port, observations, 0.03)
        expected = expected_actions(pair, checkpoint, observations, answers)
    versions = [a["kv_version"] for a in answers]
    assert versions == sorted(versions) and len(set(versions)) >= 3  # the KV moved on, never backwards
    assert all(0 <= a["kv_age_ms"] < 2000 and a["state_from"] in ("request", "observation") for a in answers)
    for answer, want in zip(answers, expected):
        assert np.array_equal(answer["actions"], want), answer["source"]


def test_pi05_answers_are_conditioned_on_the_state_in_their_prefix(tmp_path, tokenizer_model) -> None:
    checkpoint = write_checkpoint(tmp_path / "tiny_pi05.safetensors", "tiny_pi05", seed=4)
    rng = np.random.default_rng(2)
    observations = [{**observation(rng, prompt=False), "prompt": "open the drawer"} for _ in range(6)]
    serve = dict(prompt_len=64, tokenizer=str(tokenizer_model))
    with running_pair(checkpoint, prefix_serve=serve, serve=serve) as pair:
        answers = _drive(pair.robot_port, observations, 0.03)
        expected = expected_actions(pair, checkpoint, observations, answers, prompt_len=64)
    assert all(a["state_from"] == "observation" for a in answers)  # π0.5 has no state token
    for answer, want in zip(answers, expected):
        assert np.array_equal(answer["actions"], want)


def test_the_relay_answers_before_the_kv_lands(checkpoint) -> None:
    """A downlink of 0.5 Mb/s: the relay frame (~1 KB) lands in ~20 ms, the KV (~10 KB) ~150 ms later. Requests in
    between get the new observation's relay chunk (once), then the expert's own chunks; every one exact."""
    rng = np.random.default_rng(3)
    split = SplitConfig("prefix", kv_port=0, link=LinkProfile(latency_ms=5.0, mbps=0.5))
    observations = [observation(rng) for _ in range(16)]
    with running_pair(checkpoint, prefix_split=split) as pair:
        answers = _drive(pair.robot_port, observations, 0.03)
        expected = expected_actions(pair, checkpoint, observations, answers)
    sources = [a["source"] for a in answers]
    relayed = [a["kv_version"] for a in answers if a["source"] == "relay"]
    assert sources[0] == "relay" and len(relayed) >= 3 and sources.count("local") >= 3, sources
    assert len(set(relayed)) == len(relayed)  # a relay chunk is served once
    for answer, want in zip(answers, expected):
        assert np.array_equal(answer["actions"], want)


def test_a_pair_from_different_checkpoints_or_shapes_is_refused_by_name(checkpoint, tmp_path) -> None:
    other = write_checkpoint(tmp_path / "other.safetensors", seed=9)
    with running_prefix(checkpoint) as (_, kv_port):
        for kw, needle in ((dict(), "fingerprint: expected"), (dict(serve=dict(chunk=CHUNK + 1)), "layout.chunk")):
            ckpt = other if not kw else checkpoint
            with running_expert(ckpt, kv_port, max_kv_age_ms=300.0, **kw) as expert:
                client = expert.servers[1]
                deadline = time.monotonic() + 5
                while needle not in client.last_error and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert needle in client.last_error
                robot = WebsocketClientPolicy("127.0.0.1", expert.port)
                with pytest.raises(RuntimeError, match=f"no KV yet.*{needle.split(':')[0]}"):
                    robot.infer(observation(np.random.default_rng(0)))


def test_a_stale_kv_is_refused_in_one_line(checkpoint) -> None:
    rng = np.random.default_rng(4)
    with running_pair(checkpoint, max_kv_age_ms=250.0) as pair:
        robot = WebsocketClientPolicy("127.0.0.1", pair.robot_port)
        assert robot.infer(observation(rng))["kv_age_ms"] < 250
        pair.service.client.offer = lambda version, frame: None  # the uplink goes quiet: no newer KV will come
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match=r"\nstale KV: the newest prefix \(version \d+\) is \d+ ms old, over "
                                               r"--max-kv-age-ms 250; the prefix server is connected"):  # fmt: skip
            robot.infer(observation(rng))


def test_the_first_request_after_an_idle_spell_waits_for_its_own_observations_kv(checkpoint) -> None:
    """The bug: a robot that paused longer than --max-kv-age-ms (between episodes) had its next request refused as
    `stale KV` (its connection closed) although that request's own observation was already on its way up."""
    rng = np.random.default_rng(6)
    with running_pair(checkpoint, max_kv_age_ms=1000.0) as pair:
        robot = WebsocketClientPolicy("127.0.0.1", pair.robot_port)
        first = robot.infer(observation(rng))
        time.sleep(1.2)  # the robot idles: every KV the expert holds is now over the bound
        answer = robot.infer(observation(rng))
        assert answer["kv_version"] > first["kv_version"] and answer["kv_age_ms"] < 1000


def test_the_prefix_servers_own_port_answers_whole_observations(checkpoint) -> None:
    """The bug: a robot without a GPU pointed at the prefix server's openpi port (docs/split.md) got 'internal
    server error' on every request: the default overlap scheduler asked the whole-call model for a prefix stage."""
    rng = np.random.default_rng(7)
    with running_prefix(checkpoint) as (prefix, _):
        robot = WebsocketClientPolicy("127.0.0.1", prefix.servers[0].port)
        for _ in range(2):
            actions = robot.infer(observation(rng))["actions"]
            assert actions.shape[0] == CHUNK and np.isfinite(actions).all()


def test_the_prefix_role_honours_no_admission(checkpoint) -> None:
    """The bug: `--role prefix --no-admission` still refused robots (the flag never reached its service)."""
    from split_harness import serve_config

    from vla_rt.serve.scheduler import StageCosts
    from vla_rt.split.roles import build_prefix_role

    slow = StageCosts({1: 500.0}, {1: 500.0}, {1: 0.1}, {1: 0.1}, num_steps=1)  # no robot meets a 100 ms SLO
    for admission in (True, False):
        prefix = build_prefix_role(serve_config(checkpoint, admission=admission), SplitConfig("prefix", kv_port=0),
                                   cost=slow)  # fmt: skip
        assert prefix.servers[0].service.admission.try_admit("robot", 10.0).admitted is not admission


def test_vla_rt_loadtest_runs_against_a_robot_side_expert(checkpoint, tmp_path) -> None:
    """The bug: `vla-rt loadtest --port <expert>` crashed (KeyError 'vocab_size' in every robot, then an internal
    error on 'backend' in the report): the expert's connect metadata lacked what the load test reads."""
    from vla_rt.serve.loadtest_run import run_loadtest

    with running_pair(checkpoint) as pair:
        result = run_loadtest(None, host="127.0.0.1", port=pair.robot_port, robots=[1], rate=5.0, seconds=1.0,
                              api_key=None, profile="generic", out=tmp_path, startup_timeout=10.0, flags=[],
                              compare={}, compare_robots=(), command="test")  # fmt: skip
    (only,) = result["rounds"]
    assert only["errors"] == 0 and only["refused"] == 0 and only["answers"] > 0, only
    assert result["server"]["backend"] == "split-expert" and result["server"]["max_batch"] == 1
    (report,) = tmp_path.glob("loadtest_*.md")
    assert "backend `split-expert`" in report.read_text()
