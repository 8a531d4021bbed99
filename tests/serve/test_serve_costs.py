"""The start-up cost model (`vla_rt.serve.worker.measure_costs`) on a CPU: the kernels' own time (CUDA events on a
GPU, `StageEngine.last_stage_gpu_ms`) kept per bucket beside the wall clock, and none where nothing timed it."""

from __future__ import annotations

from vla_rt.inference import load_stages
from vla_rt.serve.worker import StageRunner, measure_costs


def test_the_cost_model_keeps_each_buckets_gpu_time_when_the_engine_times_its_stages(monkeypatch) -> None:
    model = load_stages("random:tiny:4", num_views=1, chunk=4, prompt_len=3, expert_buckets=(1, 2),
                        prefix_buckets=(1, 2), num_steps=2)  # fmt: skip
    engine = model.stages
    timed = []

    def gpu_ms() -> float | None:  # what the CUDA events say on a GPU: here a fixed time per stage while timing
        timed.append(engine.time_stages)
        return 0.5 if engine.time_stages else None

    monkeypatch.setattr(engine, "last_stage_gpu_ms", gpu_ms)
    costs = measure_costs(StageRunner(engine, prompt_len=3, seed=0), iters=2)
    assert costs.prefix_gpu_ms == {1: 0.5, 2: 0.5} and costs.expert_gpu_ms == {1: 0.5, 2: 0.5}
    assert costs.request_gpu_ms() == 0.5 + 2 * 0.5 and costs.to_json()["expert"]["2"]["gpu_median_ms"] == 0.5
    assert timed and all(timed) and not engine.time_stages  # timing on while measuring, off afterwards
    monkeypatch.undo()
    plain = measure_costs(StageRunner(engine, prompt_len=3, seed=0), iters=1)
    assert plain.prefix_gpu_ms is None and plain.request_gpu_ms() is None  # a CPU has no events: no made-up time


def test_the_lone_robot_is_measured_against_the_kernels_time_where_the_server_has_it() -> None:
    """The load test's one-robot line: the round trip against the engine's GPU time when the server reports it (the
    cost model's wall clock also holds host work the served path overlaps, which once gave -1.6 ms 'outside the
    engine'), else against the wall clock, said as such."""
    from vla_rt.serve.loadtest_report import _one_robot
    from vla_rt.serve.loadtest_run import one_robot

    rounds = [{"robots": 1, "p50_ms": 18.6, "server_timing": {"prefix_ms": 2.28, "total_ms": 16.78}}]
    one = one_robot(rounds, {"engine_request_ms": 20.1, "engine_request_gpu_ms": 13.5})
    assert one["outside_engine_ms"] == 18.6 - 13.5
    line = _one_robot(one)[0]
    assert "against 13.5 ms of GPU time for the engine's own prefix + steps" in line and "20.1 ms on its wall" in line
    assert "+5.1 ms outside the engine" in line
    wall = one_robot(rounds, {"engine_request_ms": 14.0, "engine_request_gpu_ms": None})
    assert wall["outside_engine_ms"] == 18.6 - 14.0 and "(start-up cost model): +4.6 ms" in _one_robot(wall)[0]


def test_stage_costs_round_trip_through_the_servers_metadata_json() -> None:
    """`StageCosts.to_json` (the connect metadata) and `from_json` (the load test's prediction) agree, with and
    without the p90 and GPU columns; a bucket without its median is refused, naming the column and the bucket."""
    import json

    import pytest

    from vla_rt.serve.scheduler import StageCosts

    full = StageCosts({1: 8.0, 2: 13.0}, {1: 9.5, 2: 14.0}, {1: 0.7, 4: 1.5}, {1: 1.0, 4: 1.9}, 10,
                      prefix_p90_ms={1: 8.1, 2: 13.2}, expert_p90_ms={1: 0.8, 4: 1.6},
                      prefix_gpu_ms={1: 6.9, 2: 12.2}, expert_gpu_ms={1: 0.66, 4: 1.37})  # fmt: skip
    plain = StageCosts({1: 8.0}, {1: 9.5}, {1: 0.7}, {1: 1.0}, 5)
    for costs in (full, plain):
        back = StageCosts.from_json(json.loads(json.dumps(costs.to_json())))
        assert back == costs and back.to_json() == costs.to_json()
    broken = full.to_json()
    del broken["expert"]["4"]["median_ms"]
    with pytest.raises(ValueError, match="expected median_ms in every expert bucket, found none in bucket.s. 4"):
        StageCosts.from_json(broken)
