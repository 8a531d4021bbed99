"""`vla-rt convert` / `vla-rt info` say what is wrong with a path before any work (exit 2, one line)."""

from __future__ import annotations

import os
import time

import pytest

from vla_rt.cli import main


def _fails(argv: list[str], capsys) -> str:
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < 5.0  # refused before reading or writing weights
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "internal error" not in err
    return err


def test_convert_refuses_a_destination_under_a_regular_file(tmp_path, capsys) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    for dst in (blocker / "x.safetensors", blocker / "a" / "b" / "x.safetensors"):
        err = _fails(["convert", "random:tiny", str(dst)], capsys)
        assert (
            err
            == f"vla-rt convert: error: dst: expected a path under a directory, found {dst}, but {blocker} is a file"
        )
    assert blocker.read_text() == "a file, not a directory"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_convert_refuses_a_directory_that_takes_no_new_files(capsys) -> None:
    err = _fails(["convert", "random:tiny", "/proc/x.safetensors"], capsys)
    assert "dst: expected a path in a directory where files can be created" in err
    assert "cannot create files in /proc (" in err


def test_convert_into_a_new_directory_still_works(tmp_path) -> None:
    dst = tmp_path / "new" / "dir" / "tiny.safetensors"
    assert main(["convert", "random:tiny", str(dst)]) == 0 and dst.stat().st_size > 0
    assert not [p for p in dst.parent.parent.parent.iterdir() if p.name.startswith(".vla-rt-write-check")]


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_info_names_what_the_path_is(tmp_path, capsys) -> None:
    err = _fails(["info", "/dev/null"], capsys)
    assert err.startswith("vla-rt info: error: /dev/null: not a checkpoint vla-rt can read (is a character device, "
                          "not a file).")  # fmt: skip
    err = _fails(["info", str(tmp_path)], capsys)
    assert "(is a directory)" in err
    err = _fails(["info", str(tmp_path / "missing")], capsys)
    assert "(does not exist)" in err
    (tmp_path / "notes.txt").write_text("x")
    assert "(is a file without the .safetensors suffix)" in _fails(["info", str(tmp_path / "notes.txt")], capsys)


def test_bench_refuses_an_out_dir_it_cannot_write_before_timing(tmp_path, capsys, monkeypatch) -> None:
    """The bug: `vla-rt bench --out notes.txt/run` timed every row, then ended in '[Errno 20] Not a directory'."""
    import vla_rt.bench.latency as latency

    def timed(*_args):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(latency, "run_benchmark", timed)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    err = _fails(["bench", "--out", str(blocker / "run")], capsys)
    assert err == (f"vla-rt bench: error: --out: expected a directory for the results, found {blocker / 'run'}, "
                   f"but {blocker} is not a directory")  # fmt: skip
    err = _fails(["bench", "--out", str(blocker)], capsys)
    assert err.endswith(f"found {blocker}, which is not a directory")
    if os.path.isdir("/proc/self"):
        assert "cannot create files in /proc (" in _fails(["bench", "--out", "/proc/run"], capsys)


def test_loadtest_names_an_out_dir_it_cannot_write(tmp_path, capsys) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    err = _fails(["loadtest", "--port", "1", "--robots", "1", "--seconds", "1", "--out", str(blocker / "r")], capsys)
    assert err.startswith("vla-rt loadtest: error: --out: expected a directory for the results")
