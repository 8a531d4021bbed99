"""The split benchmark's robot client, round summary and report on a short real run of the two roles (the GPU
benchmark itself runs on the device: `python -m vla_rt.bench.split`)."""

from __future__ import annotations

import json

from split_harness import IMAGE_SIZE, STATE_DIM, VIEWS, running_pair

from vla_rt.bench.split import drive, observations
from vla_rt.bench.split_report import round_summary, write_report


def test_a_round_is_summarised_and_reported(checkpoint, tmp_path) -> None:
    frames = observations(6, IMAGE_SIZE, VIEWS, 5, seed=0, state_dim=STATE_DIM)
    with running_pair(checkpoint) as pair:
        answers = drive(pair.robot_port, frames, rate_hz=30.0, seconds=0.6)
        events = list(pair.service.worker.events) + list(pair.client.events)
    summary = round_summary("native", None, answers, events, "float32")
    assert summary["answers"] >= 8 and summary["refused_count"] == 0
    assert summary["installs"] >= 2 and summary["kv_payload_bytes"]["n"] >= 2
    assert summary["kv_payload_bytes"]["median"] <= summary["kv_wire_bytes"]["median"]
    assert summary["uplink_to_installed_ms"]["median"] >= summary["uplink_to_relay_ms"]["median"] > 0
    result = {"device": "CPU-test", "preset": "tiny", "views": VIEWS, "prompt_len": 8, "chunk": 4, "num_steps": 10,
              "rate_hz": 30.0, "seconds": 0.6, "max_kv_age_ms": 2000.0, "command": "test", "rounds": [summary]}  # fmt: skip
    paths = write_report(result, tmp_path)
    paths["json"].write_text(json.dumps(result))
    assert "| native (float32) | loopback |" in paths["markdown"].read_text()
    assert paths["plot"].stat().st_size > 10_000
