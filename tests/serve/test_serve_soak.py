"""The soak script (`python -m vla_rt.serve.soak`): a short run passes its checks, and each check can fail."""

from __future__ import annotations

import json

import pytest

from vla_rt.serve.loadtest import RobotRun
from vla_rt.serve.soak import evaluate, main


def test_a_short_soak_passes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the child server (see conftest.one_torch_thread)
    code = main(["--minutes", "0.25", "--robots", "4", "--sample-s", "5", "--out", str(tmp_path)])
    result = json.loads(next(tmp_path.glob("soak_*.json")).read_text())
    assert code == 0 and result["verdict"]["passed"] and len(result["samples"]) >= 3, result["verdict"]
    assert result["answers"] >= 4 * 10 * 15 * 0.5  # 4 robots at 10 Hz for 15 s (a shared CI machine: half at least)
    assert "| minute | RSS MiB |" in next(tmp_path.glob("soak_*.md")).read_text()


def _samples(rss, answers):
    return [{"t_s": 60.0 * i, "rss_mb": r, "answers": a} for i, (r, a) in enumerate(zip(rss, answers))]


def test_each_check_can_fail() -> None:
    fine = [RobotRun(0), RobotRun(1)]
    ok = evaluate(_samples([100, 101, 102], [[0, 0], [600, 600], [1200, 1200]]), fine, 0.05)
    assert ok["passed"]
    growing = evaluate(_samples([100, 103, 106], [[0, 0], [600, 600], [1200, 1200]]), fine, 0.05)
    assert not growing["checks"]["rss_flat"] and growing["rss_drift"] == 0.06
    starved = evaluate(_samples([100, 100, 100], [[0, 0], [600, 0], [1200, 0]]), fine, 0.05)
    assert not starved["checks"]["every_robot_answered_in_every_window"] and starved["starved_windows"] == [
        (0, 1),
        (1, 1),
    ]
    broken = evaluate(
        _samples([100, 100], [[0, 0], [600, 600]]), [RobotRun(0, errors=["x"]), RobotRun(1, refused="503")], 0.05
    )
    assert not broken["checks"]["no_errors"] and not broken["checks"]["no_refusals"]


def test_an_out_or_log_it_cannot_write_is_one_usage_line(tmp_path, capsys) -> None:
    """The bug: `--out notes.txt/soak` ended in a NotADirectoryError traceback; `--log` under a file, after the server
    was started."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    for argv, needle in [
        (["--out", str(blocker / "soak")], f"error: --out: expected a directory for the results, found "
                                           f"{blocker / 'soak'}, but {blocker} is not a directory"),
        (["--out", str(tmp_path), "--log", str(blocker / "server.log")], "error: --log: expected a path under a "
                                                                          "directory"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as info:
            main(["--minutes", "0.01", "--sample-s", "0.5", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("tolerance", ["nan", "-0.1", "inf"])
def test_an_rss_tolerance_that_no_soak_could_meet_is_one_usage_line(tmp_path, capsys, tolerance) -> None:
    """The bug: `--rss-tolerance nan` (or < 0) ran the whole soak, then failed its memory check whatever the server
    did."""
    with pytest.raises(SystemExit) as info:
        main(["--minutes", "0.01", "--sample-s", "0.5", "--out", str(tmp_path), "--rss-tolerance", tolerance])
    assert info.value.code == 2
    assert "--rss-tolerance: expected a finite fraction >= 0 (0.05: 5%)" in capsys.readouterr().err
