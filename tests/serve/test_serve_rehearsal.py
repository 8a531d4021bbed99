"""`--warm-lead-ms` (opt-in): while the server is idle it re-runs a robot's host steps on its last frame shortly before
the next is due, so they run on warm caches (`tools/host_warmth_probe.py`). It must never change an answer, never
queue anything, never run while a request is waiting or in flight, and stop with the robot."""

from __future__ import annotations

import time

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from serve_helpers import flat_cost

from vla_rt.errors import ArgumentError
from vla_rt.serve.app import ServeConfig, build_service
from vla_rt.serve.profiles import get_profile


def _obs(seed: int) -> dict:
    return get_profile("droid").example(np.random.default_rng(seed), prompt=[1, 4, 2])


def test_warm_lead_is_checked_before_any_work() -> None:
    for bad in (-1.0, float("nan"), 2e3):
        with pytest.raises(ArgumentError, match="--warm-lead-ms"):
            ServeConfig("random:tiny", warm_lead_ms=bad).check()


def test_rehearsal_queues_nothing_and_reports_idle(checkpoints) -> None:
    cfg = ServeConfig(str(checkpoints["droid"]), profile="droid", max_batch=2, prompt_len=8)
    service = build_service(cfg, flat_cost(cfg))
    assert service.idle()
    service.rehearse(_obs(1))
    assert service.rehearsals == 1 and service.idle() and len(service.queue) == 0
    service.queue.submit(7, object(), lambda result: None, deadline=time.monotonic() + 1)
    assert not service.idle()  # a waiting request: the server would skip the rehearsal
    with pytest.raises(ValueError):  # bad input fails the rehearsal as it would the request; the server drops it
        service.rehearse({"nonsense": 1})


def test_rehearsals_run_between_a_robots_frames_and_change_no_answer(checkpoints, start_server) -> None:
    """A robot at 4 Hz (the server's default rate here), lead 30 ms: each frame schedules one rehearsal ~220 ms after
    it, which runs (the server is idle by then); the answers are those of a server without it, frame for frame (same
    seed). At 10 Hz the rehearsal came 70 ms after the frame, and CI's loaded 2-core machine once had not answered by
    then, so that rehearsal was (rightly) skipped as the server was busy."""
    settings = dict(profile="droid", max_batch=2, prompt_len=8, seed=11, robot_hz=4.0)
    frames = [_obs(seed) for seed in range(4)]
    answers = {}
    for lead in (0.0, 30.0):
        with start_server(checkpoints["droid"], warm_lead_ms=lead, **settings) as server:
            client = WebsocketClientPolicy("127.0.0.1", server.port)
            got = []
            for obs in frames:
                got.append(client.infer(obs)["actions"])
                time.sleep(0.3)  # past the 250 ms period: the rehearsal was due while the server idled
            client._ws.close()
            answers[lead] = got
            rehearsals = server.server.service.rehearsals
        assert rehearsals == (0 if lead == 0 else len(frames))
    for a, b in zip(answers[0.0], answers[30.0]):
        np.testing.assert_array_equal(a, b)


def test_the_split_expert_role_refuses_it_by_name() -> None:
    """The robot-side expert (`--role expert`) serves through the same server but prepares nothing on its loop."""
    import argparse

    from vla_rt.split.roles import add_split_args, split_config

    p = argparse.ArgumentParser()
    add_split_args(p)
    args = p.parse_args(["--role", "expert", "--prefix-server", "gpu-box:8001"])
    args.warm_lead_ms = 2.0
    with pytest.raises(ArgumentError, match="--warm-lead-ms"):
        split_config(args)
    for unset in (0.0, None):  # None: the flag not given (the full server's default does not apply here)
        args.warm_lead_ms = unset
        assert split_config(args).role == "expert"


def test_the_server_rehearses_by_default_and_the_flag_sets_it() -> None:
    """Measured on the H200 (docs/serving.md, session 19): 2 ms ahead took a lone robot's p50 down ~0.35 ms."""
    from vla_rt.cli import build_parser
    from vla_rt.serve.app import DEFAULT_WARM_LEAD_MS, server_options
    from vla_rt.serve.cli_args import serve_config

    assert DEFAULT_WARM_LEAD_MS == 2.0
    for argv, lead in (([], 2.0), (["--warm-lead-ms", "0"], 0.0), (["--warm-lead-ms", "5"], 5.0)):
        cfg = serve_config(build_parser().parse_args(["serve", "random:tiny", *argv]))
        assert server_options(cfg).warm_lead_ms == lead, argv
