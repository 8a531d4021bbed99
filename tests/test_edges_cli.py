"""The `vla-rt` command line at its edges (issue 22): a bad option is a usage error, a bad file or argument prints
its message alone (exit 2), a bug prints one line (exit 1), `--debug` shows the traceback, a closed pipe is quiet."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vla_rt import cli
from vla_rt.cli import main, noisy_rows
from vla_rt.errors import CheckpointError


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: vla-rt" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "--iters", "0"], "--iters: expected a positive integer, found 0"),
        (["bench", "--iters", "-1"], "--iters: expected a positive integer, found -1"),
        (["bench", "--iters", "ten"], "--iters: expected a positive integer, found 'ten'"),
        (["bench", "--warmup", "-2"], "--warmup: expected an integer >= 0, found -2"),
        (["bench", "--compile-budget", "0"], "--compile-budget: expected a number of seconds > 0"),
        (["bench", "--compile-budget", "nan"], "--compile-budget: expected a number of seconds > 0"),
        (["bench", "--cases", "1,0"], "'1,0' (2 numbers, not 3)"),
        (["bench", "--cases", "0,0,4"], "'0,0,4': num_views 0 is outside [1, 16]"),
        (["bench", "--cases", "1,-1,4"], "prompt_len -1 is outside [0, 2048]"),
        (["bench", "--cases", "1,0,0"], "chunk 0 is outside [1, 1024]"),
        (["bench", "--cases", "1,a,4"], "'1,a,4' (not integers)"),
        (["bench", "--cases", ";"], "(no case)"),
        (["bench", "--compile-cases", "2,2"], "(2 numbers, not 3)"),
        (["bench", "--preset", "nope"], "--preset: invalid choice: 'nope'"),
        (["info", "--nope"], "unrecognized arguments: --nope"),
        (["nope"], "invalid choice: 'nope'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_options_are_usage_errors(capsys, argv, words):
    err = _usage_error(capsys, argv)
    assert words in err, err


@pytest.mark.parametrize("backends", ["nope", "reference,nope", "", ","])
def test_unknown_backend_is_refused_not_timed_as_another(capsys, monkeypatch, backends):
    """The bug: `--backends nope` timed static-torch and reported it as 'nope'."""
    import vla_rt.bench.latency as latency

    monkeypatch.setattr(latency, "run_benchmark", lambda *a, **k: pytest.fail("ran the benchmark"))
    assert main(["bench", "--backends", backends, "--no-write"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vla-rt bench: error: --backends: expected names from ['reference'"), err


def test_noisy_machine_warning():
    rows = [
        {"backend": "reference", "views": 1, "median_ms": 10.0, "p90_ms": 11.0},
        {"backend": "folded", "views": 2, "median_ms": 10.0, "p90_ms": 140.0},
        {"backend": "static-torch", "views": 3, "skipped": "x"},
    ]
    warning = noisy_rows(rows)
    assert warning and "in 1 of 2 rows (worst 14x: folded at 2 views)" in warning and "not comparable" in warning
    assert noisy_rows(rows[:1]) is None


def test_bench_prints_the_noisy_warning_and_records_it(capsys, monkeypatch, tmp_path):
    import vla_rt.bench.latency as latency

    rows = [{"backend": "folded", "views": 1, "prompt_len": 0, "chunk": 4, "median_ms": 1.0, "p90_ms": 50.0}]
    monkeypatch.setattr(latency, "run_benchmark", lambda cfg, device: {"rows": rows})
    written = {}
    monkeypatch.setattr(latency, "write_results", lambda result, out: written.update(result) or {})
    assert main(["bench", "--backends", "folded", "--cases", "1,0,4", "--out", str(tmp_path)]) == 0
    assert "warning: noisy timings: p90 >= 3x the median" in capsys.readouterr().err
    assert written["warnings"][0].startswith("noisy timings")


def test_iters_zero_was_twenty_now_refused_and_explicit_iters_kept(monkeypatch):
    import vla_rt.bench.latency as latency

    seen = {}
    monkeypatch.setattr(latency, "run_benchmark", lambda cfg, device: seen.setdefault("cfg", cfg) and {"rows": []})
    assert main(["bench", "--iters", "1", "--backends", "folded", "--cases", "1,0,4", "--no-write"]) == 0
    assert seen["cfg"].iters == 1 and seen["cfg"].cases == ((1, 0, 4),) and seen["cfg"].backends == ("folded",)


def test_a_prompt_longer_than_the_preset_takes_is_refused_before_any_row(monkeypatch, capsys):
    """The bug: `--cases '1,0,4;1,60,4'` timed the first case, then ended in 'tokens: expected at most 48 tokens'."""
    import vla_rt.bench.latency as latency

    monkeypatch.setattr(latency, "run_benchmark", lambda cfg, device: pytest.fail("a row was timed"))
    assert main(["bench", "--backends", "folded", "--cases", "1,0,4;1,60,4", "--no-write"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("vla-rt bench: error: --cases: expected prompt lengths of at most 48 (the 'tiny' preset's "
                           "max_token_len), found 1,60,4 (prompt 60)"), err  # fmt: skip
    seen = {}
    monkeypatch.setattr(latency, "run_benchmark", lambda cfg, device: seen.setdefault("cfg", cfg) and {"rows": []})
    assert main(["bench", "--model", "pi05", "--backends", "folded", "--cases", "1,60,4", "--no-write"]) == 0
    assert seen["cfg"].cases == ((1, 60, 4),)  # π0.5 takes up to 200 tokens


def test_passes_report_names_the_checkpoints_chunk(tmp_path, capsys):
    """The bug: `--passes` printed 'chunk 63' for a chunk-16 checkpoint."""
    from vla_rt.checkpoints import save_native
    from vla_rt.config import preset
    from vla_rt.model.weights import random_weights

    cfg = preset("tiny").replace(chunk=16)
    path = save_native(tmp_path / "c16.safetensors", random_weights(cfg), cfg, source="t")
    assert main(["info", str(path), "--passes"]) == 0
    out = capsys.readouterr().out
    assert "(chunk 16, prompt 0" in out and "chunk 63" not in out


def test_info_json_with_passes_is_one_json_document(capsys):
    """The bug: `info --json --passes` printed the Markdown table after the JSON, so `| jq` failed to parse it."""
    import json

    from vla_rt.config import preset
    from vla_rt.graph_passes import format_report_table

    assert main(["info", "random:tiny", "--json", "--passes"]) == 0
    summary = json.loads(capsys.readouterr().out)
    report = summary["graph_passes"]
    assert report["chunk"] == preset("tiny").chunk
    names = [row["pass"] for row in report["passes"]]
    assert names and all(f"| {name} |" in format_report_table(preset("tiny"), chunk=report["chunk"]) for name in names)
    assert all(set(row["kernels_removed"]) == {"1", "2", "3"} for row in report["passes"])


def test_convert_argument_errors(tmp_path, capsys):
    assert main(["convert", "random:tiny", str(tmp_path / "x.bin")]) == 2
    assert "dst: expected a file name ending in .safetensors, found" in capsys.readouterr().err
    (tmp_path / "d.safetensors").mkdir()
    assert main(["convert", "random:tiny", str(tmp_path / "d.safetensors"), "--force"]) == 2
    assert "not a directory" in capsys.readouterr().err
    src = tmp_path / "s.safetensors"
    assert main(["convert", "random:tiny", str(src)]) == 0
    assert main(["convert", str(src), str(src), "--force"]) == 2
    assert "dst: expected a different file than src" in capsys.readouterr().err
    assert main(["info", str(src), "--asset-id", "robot"]) == 2
    assert "asset_id: expected None for a native checkpoint" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"")
    assert main(["info", str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    for argv in (["--debug", "info", str(bad)], ["info", str(bad), "--debug"]):
        with pytest.raises(CheckpointError, match="empty file"):
            main(argv)


def test_a_bug_is_one_line_without_debug(capsys, monkeypatch):
    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setitem(cli.COMMANDS, "info", (broken, cli.COMMANDS["info"][1], "x"))
    assert main(["info", "random:tiny"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("vla-rt info: internal error: TypeError: unsupported operand (a bug in vla-rt")
        and "\n" == err[-1]
    )
    with pytest.raises(TypeError):
        main(["--debug", "info", "random:tiny"])


def test_interrupt_is_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "info", (interrupted, cli.COMMANDS["info"][1], "x"))
    assert main(["info", "random:tiny"]) == 130
    assert capsys.readouterr().err == "vla-rt info: interrupted\n"


@pytest.mark.parametrize("extra", [[], ["--json"], ["--passes"]])
def test_closed_pipe_is_quiet(extra):
    """The bug: `vla-rt info ... | head -1` ended in a BrokenPipeError traceback."""
    cmd = [sys.executable, "-m", "vla_rt.cli", "info", "random:tiny", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # what `head -1` does after its line, here before the first write so the race is never won
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
