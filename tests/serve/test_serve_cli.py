"""`vla-rt loadtest CHECKPOINT`: starts `vla-rt serve` itself, loads it, writes JSON + Markdown + plot."""

from __future__ import annotations

import json

import pytest

from vla_rt.cli import build_parser, main
from vla_rt.serve.admission import Admission
from vla_rt.serve.cli_args import serve_config
from vla_rt.serve.scheduler import StageCosts


def test_loadtest_starts_a_server_and_writes_its_report(checkpoints, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the child server, like this process (see conftest.one_torch_thread)
    out = tmp_path / "run"
    code = main(["loadtest", str(checkpoints["libero"]), "--profile", "libero", "--robots", "1,3", "--rate", "5",
                 "--seconds", "2", "--prompt-len", "8", "--max-batch", "4", "--chunk", "10", "--out", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(next(out.glob("loadtest_*.json")).read_text())
    assert [r["robots"] for r in result["rounds"]] == [1, 3]
    assert all(r["errors"] == 0 and r["refused"] == 0 and r["answers"] > 0 for r in result["rounds"])
    assert result["server"]["profile"] == "libero" and result["server"]["action_horizon"] == 10
    table = next(out.glob("loadtest_*.md")).read_text()
    assert "| robots | requests/s | p50 | p90 | p99 | predicted p99 |" in table and "| 3 |" in table
    # beside each round, what admission's model predicted for it, from the server's own start-up cost model
    costs = StageCosts.from_json(result["server"]["cost_model"])
    for r in result["rounds"]:
        expected = Admission(costs, policy="overlap", capacity=4).predict([5.0] * r["robots"]).p99_ms
        assert r["predicted_p99_ms"] == pytest.approx(expected) and expected > 0
    assert next(out.glob("loadtest_*.png")).stat().st_size > 1000
    assert "robot 1" in (out / "server.log").read_text()  # the server's line per connection


def test_serve_flags_become_the_config(monkeypatch) -> None:
    monkeypatch.setenv("VLA_RT_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "random:tiny", "--profile", "droid", "--max-batch", "8",
                                      "--slo-ms", "60", "--batch-window-ms", "3", "--port", "0"])  # fmt: skip
    cfg = serve_config(args)
    assert (cfg.profile, cfg.max_batch, cfg.slo_ms, cfg.window_ms, cfg.api_key, cfg.port) == (
        "droid", 8, 60.0, 3.0, "from-env", 0)  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser().parse_args(["loadtest", "--robots", "0,2"])


def test_a_pi05_load_test_writes_its_files_beside_pi0s_not_over_them(tmp_path, monkeypatch) -> None:
    from vla_rt.serve import loadtest_report

    monkeypatch.setattr(loadtest_report, "loadtest_markdown", lambda result: "table")
    monkeypatch.setattr(loadtest_report, "plot_latency", lambda result, path: path.write_bytes(b"png"))
    names = {}
    for model in ("pi0", "pi05"):
        result = {"device": "NVIDIA H200", "server": {"model": model}}
        names[model] = sorted(p.name for p in loadtest_report.write_report(result, tmp_path).values())
    assert names["pi0"] == ["loadtest_NVIDIA-H200.json", "loadtest_NVIDIA-H200.md", "loadtest_NVIDIA-H200.png"]
    assert names["pi05"] == [n.replace("loadtest_", "loadtest_pi05_") for n in names["pi0"]]
    assert len(list(tmp_path.iterdir())) == 6  # neither overwrote the other


def test_a_server_that_refuses_the_tests_rate_ends_the_load_test_with_its_reason(checkpoints, start_server) -> None:
    """Admission refusing even one robot at --rate is the server's answer, not a crash: a clear error, exit 2."""
    from vla_rt.serve.loadtest_run import ServerRefusedRobot, metadata

    with start_server(checkpoints["libero"], profile="libero", max_batch=2, slo_ms=0.01) as server:
        with pytest.raises(ServerRefusedRobot, match=r"refused a robot at 10 Hz \(HTTP 503: refused: .*--no-admission"):
            metadata("127.0.0.1", server.port, 10.0, None)


def test_a_load_test_without_a_server_at_its_port_says_so(capsys, tmp_path) -> None:
    from vla_rt.serve.loadtest_run import free_port

    port = free_port("127.0.0.1")  # nothing listens there
    assert main(["loadtest", "--port", str(port), "--robots", "1", "--seconds", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: expected a vla-rt server, found none answering" in err
    assert "internal error" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--replicas", "3"], "--replicas: expected --ray with it (the Ray Serve app's worker replicas), found 3"),
    (["--ray", "--role", "prefix"], "--ray: expected --role all (Ray Serve runs the whole model; a split role runs "
                                    "without it), found --role prefix"),
])  # fmt: skip
def test_a_ray_flag_that_would_be_ignored_is_refused(capsys, monkeypatch, argv, needle) -> None:
    """The bug: `--replicas 3` without `--ray` (and `--ray` with a split role) started a server that ignored it."""
    from vla_rt.serve import cli_args

    def started(*_args, **_kw) -> None:
        raise AssertionError("a server started")

    for name in ("build_server", "run_role", "serve_until_signalled"):
        monkeypatch.setattr(cli_args, name, started)
    assert main(["serve", "random:tiny", "--port", "0", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_busy_port_or_a_host_not_on_this_machine_is_refused_before_the_model_loads(capsys, monkeypatch) -> None:
    """The bug: a second `vla-rt serve` on a busy port (or a mistyped --host) built its engine and cost model, then
    ended in '[Errno 98] error while attempting to bind ...', naming no option."""
    import socket

    from vla_rt.serve import cli_args

    def started(*_args) -> None:
        raise AssertionError("the model loaded")

    for name in ("build_server", "run_role", "use_cpu_threads"):
        monkeypatch.setattr(cli_args, name, started)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for argv, needle in [
            (["--port", str(port)], f"--port: expected a port free on 127.0.0.1 (0: any free port), found {port}, in "
                                    "use (another server on it?)"),
            (["--role", "prefix", "--port", "0", "--kv-port", str(port)], f"--kv-port: expected a port free on "
                                                                          f"127.0.0.1 (0: any free port), found {port}"),
            (["--host", "no-such-host.invalid", "--port", "0"], "--host: expected an address of this machine to "
                                                                "listen on (e.g. 127.0.0.1, 0.0.0.0), found "
                                                                "'no-such-host.invalid' ("),
        ]:  # fmt: skip
            assert main(["serve", "random:tiny", *argv]) == 2
            err = capsys.readouterr().err
            assert needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["serve", "loadtest"])
@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_not_read_as_no_key(capsys, command, key) -> None:
    """The bug: `--api-key "$KEY"` with KEY unset served everyone without authentication, silently."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([command, "random:tiny", "--api-key", key])
    assert stop.value.code == 2
    assert f"--api-key: expected a non-empty key, found {key!r}" in capsys.readouterr().err
    assert serve_config(build_parser().parse_args(["serve", "random:tiny", "--api-key", "k1"])).api_key == "k1"
