"""The split benchmark's robot client, round summary and report on a short real run of the two roles (the GPU
benchmark itself runs on the device: `python -m vla_rt.bench.split`)."""

from __future__ import annotations

import json

from split_harness import IMAGE_SIZE, STATE_DIM, VIEWS, running_pair

from vla_rt.bench.split import monolithic_round
from vla_rt.bench.split_report import markdown, round_summary, write_report
from vla_rt.bench.split_robot import drive, drive_process, observations
from vla_rt.serve.app import ServeConfig


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
    by_source = [summary[f"request_to_actions_{s}_ms"].get("n", 0) for s in ("local", "relay")]
    assert sum(by_source) == summary["answers"] and by_source[1] == summary["relay_answers"]
    result = {"device": "CPU-test", "preset": "tiny", "views": VIEWS, "prompt_len": 8, "chunk": 4, "num_steps": 10,
              "rate_hz": 30.0, "seconds": 0.6, "max_kv_age_ms": 2000.0, "command": "test", "rounds": [summary]}  # fmt: skip
    paths = write_report(result, tmp_path)
    paths["json"].write_text(json.dumps(result))
    text = paths["markdown"].read_text()
    assert (
        "| native (float32) | loopback |" in text and "| split, native (float32) KV, loopback, local answers |" in text
    )
    assert paths["plot"].stat().st_size > 10_000


def test_the_monolithic_round_answers_the_same_robot(checkpoint, tmp_path) -> None:
    """The split's baseline: the same robot client against `vla-rt serve` on the whole model."""
    serve = ServeConfig(str(checkpoint), profile="generic", num_views=VIEWS, prompt_len=5, port=0, device="cpu",
                        seed=0, cost_iters=1)  # fmt: skip

    def robot(port: int, warmup_s: float) -> list[dict]:  # its own process, as in the benchmark
        return drive_process(port, image_size=IMAGE_SIZE, views=VIEWS, prompt=5, state_dim=STATE_DIM, rate_hz=20.0,
                             seconds=0.5, frames=4, seed=0, warmup_s=warmup_s)  # fmt: skip

    mono = monolithic_round(serve, robot)
    assert mono["refused_count"] == 0 and mono["answers"] >= 3
    s = mono["request_to_actions_ms"]
    assert s["n"] == mono["answers"] and s["median"] >= mono["infer_ms"]["median"] > 0
    result = {"device": "CPU-test", "preset": "tiny", "views": VIEWS, "prompt_len": 5, "chunk": 4, "num_steps": 10,
              "rate_hz": 20.0, "seconds": 0.5, "max_kv_age_ms": 2000.0, "command": "test", "rounds": [],
              "monolithic_server": mono}  # fmt: skip
    assert "| monolithic server (`vla-rt serve`" in markdown(result)
