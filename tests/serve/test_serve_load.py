"""Many robots, one worker: 16 real openpi clients at 10 Hz for 10 s, through the load test's own robots (stage-level
scheduling, and with the prefix stage beside the steps)."""

from __future__ import annotations

import pytest

from vla_rt.serve.loadtest import run_round


@pytest.mark.parametrize("scheduler", ["stage", "overlap"])
def test_sixteen_robots_at_10_hz_for_10_s(scheduler, checkpoints, start_server) -> None:
    with start_server(checkpoints["generic"], num_views=1, max_batch=16, prompt_len=8, scheduler=scheduler) as server:
        result = run_round("127.0.0.1", server.port, robots=16, rate_hz=10.0, seconds=10.0, profile="generic",
                           progress=False, image_size=56)  # fmt: skip
    assert result["errors"] == 0 and result["refused"] == 0, result["per_robot"]
    answers = [r["answers"] for r in result["per_robot"]]
    assert len(answers) == 16 and min(answers) >= 3, answers  # every robot answered, again and again
    assert max(answers) <= 2 * min(answers) + 2, (
        answers
    )  # and none starved: one slot per robot, first come first served
    assert result["mean_batch"] > 1.5  # the worker batched observations across connections
