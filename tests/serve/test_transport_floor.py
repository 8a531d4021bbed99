"""`tools/transport_floor.py`: the fleet test's robot against a decode-only server in its own process. The numbers are
the host's; what is checked is that the round trip is measured through the real pieces (openpi-client, the server's
wire decoder, a separate process) and that bad options are refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import transport_floor  # noqa: E402


def test_one_robot_round_trips_through_the_wire_decoder(tmp_path, capsys) -> None:
    out = tmp_path / "floor.json"
    assert transport_floor.main(["--seconds", "1.5", "--rate", "20", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] >= 5  # 30 sent at 20 Hz, the first second's 20 left out
    assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    assert r["server_decode_ms"] > 0  # the server decoded each observation with vla-rt's own decoder
    assert r["metadata"]["num_views"] == 2 and r["metadata"]["action_horizon"] == 50
    assert "transport floor (generic, 2 views" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--views", "0"], "--views: expected at least 1, found 0"),
    (["--rate", "0"], "--rate and --seconds: expected positive numbers"),
    (["--seconds", "-1"], "--rate and --seconds: expected positive numbers"),
])  # fmt: skip
def test_bad_options_are_refused_before_any_server_starts(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        transport_floor.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
