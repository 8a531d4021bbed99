"""Every `vla-rt serve` / `vla-rt loadtest` option is checked up front: a bad one is a usage error (exit 2, one
line naming the flag, expected and found) before any checkpoint is read or engine built."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from vla_rt.cli import main
from vla_rt.serve.app import ServeConfig, use_cpu_threads

SERVE = ["serve", "random:tiny"]
BAD_VALUES = [
    (["--port", "99999"], "argument --port: expected an integer in [0, 65535], found '99999'"),
    (["--port", "-1"], "argument --port: expected an integer in [0, 65535], found '-1'"),
    (["--slo-ms", "-1"], "argument --slo-ms: expected a number in (0, 1e+06], found '-1'"),
    (["--slo-ms", "nan"], "argument --slo-ms: expected a number in (0, 1e+06], found 'nan'"),
    (["--slo-ms", "0"], "argument --slo-ms: expected a number in (0, 1e+06], found '0'"),
    (["--batch-window-ms", "nan"], "argument --batch-window-ms: expected a number in [0, 10000], found 'nan'"),
    (["--batch-window-ms", "-2"], "argument --batch-window-ms: expected a number in [0, 10000], found '-2'"),
    (["--max-batch", "0"], "argument --max-batch: expected an integer in [1, 1024], found '0'"),
    (["--max-batch", "4.5"], "argument --max-batch: expected an integer, found '4.5'"),
    (["--max-prefix", "0"], "argument --max-prefix: expected an integer in [1, 1024], found '0'"),
    (["--robot-hz", "0"], "argument --robot-hz: expected a number in (0, 1000], found '0'"),
    (["--robot-hz", "inf"], "argument --robot-hz: expected a number in (0, 1000], found 'inf'"),
    (["--max-message-mb", "-1"], "argument --max-message-mb: expected a number in (0, 4096], found '-1'"),
    (["--num-views", "4"], "argument --num-views: expected an integer in [1, 3], found '4'"),
    (["--chunk", "0"], "argument --chunk: expected an integer in [1, 1024], found '0'"),
    (["--prompt-len", "0"], "argument --prompt-len: expected an integer in [1, 2048], found '0'"),
    (["--seed", "-3"], "argument --seed: expected an integer in [0, 9.22337e+18], found '-3'"),
    (["--cost-iters", "0"], "argument --cost-iters: expected an integer in [1, 10000], found '0'"),
    (["--expert-sms", "-8"], "argument --expert-sms: expected an integer in [0, 1024], found '-8'"),
    (["--cpu-threads", "0"], "argument --cpu-threads: expected an integer in [1, 1024], found '0'"),
    (["--backend", "reference"], "argument --backend: invalid choice: 'reference'"),
    (["--scheduler", "eager"], "argument --scheduler: invalid choice: 'eager'"),
]
BAD_COMBINATIONS = [
    (
        ["--max-batch", "4", "--max-prefix", "8"],
        "--max-prefix: expected at most --max-batch (4): prefix rows join the pool, found 8",
    ),  # fmt: skip
    (
        ["--profile", "aloha", "--num-views", "2"],
        "--num-views: expected at least the 3 model views the aloha profile fills, found 2",
    ),  # fmt: skip
    (
        ["--tokenizer", "/nonexistent/spm.model"],
        "--tokenizer: expected the path of a SentencePiece .model file, found '/nonexistent/spm.model'",
    ),  # fmt: skip
    (
        ["--default-prompt", "fold"],
        "--default-prompt: expected a text prompt with --tokenizer PATH (a SentencePiece .model), found no --tokenizer",
    ),  # fmt: skip
]


@pytest.fixture(autouse=True)
def nothing_is_built(monkeypatch):
    """Any engine build or checkpoint read fails the test: the checks must come first."""
    import vla_rt.checkpoints as checkpoints
    import vla_rt.serve.app as app

    def forbidden(*args, **kwargs):
        raise AssertionError("reached the checkpoint / engine build before refusing the options")

    monkeypatch.setattr(checkpoints, "load_checkpoint", forbidden)  # the header read (`read_runnable_header`) too
    monkeypatch.setattr(app, "build_serving_model", forbidden)


def _usage_error(argv: list[str], capsys) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and time.perf_counter() - t0 < 2.0
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", BAD_VALUES, ids=[" ".join(f) for f, _ in BAD_VALUES])
@pytest.mark.parametrize("command", ["serve", "loadtest"])
def test_a_bad_value_is_a_usage_error(command, flags, message, capsys) -> None:
    assert message in _usage_error([command, "random:tiny", *flags], capsys)


@pytest.mark.parametrize("flags, message", BAD_COMBINATIONS, ids=[" ".join(f) for f, _ in BAD_COMBINATIONS])
def test_settings_that_contradict_each_other_are_refused_before_any_work(flags, message, capsys) -> None:
    for command in ("serve", "loadtest"):
        t0 = time.perf_counter()
        assert main([command, "random:tiny", *flags]) == 2 and time.perf_counter() - t0 < 2.0
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"vla-rt {command}: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rate", "nan"], "argument --rate: expected a positive float, found 'nan'"),
        (["--seconds", "0"], "argument --seconds: expected a positive float, found '0'"),
        (["--robots", "0,2"], "argument --robots: expected positive robot counts, found '0,2'"),
        (["--compare", "8,x"], "argument --compare: expected robot counts such as '1,2,4,8,16', found '8,x'"),
        (
            ["--compare-schedulers", "stage,fast"],
            "argument --compare-schedulers: expected distinct schedulers of "
            "stage, overlap, batch such as 'stage,batch', found 'stage,fast'",
        ),
        (["--compare-schedulers", "stage,stage"], "found 'stage,stage'"),
        (["--startup-timeout", "-5"], "argument --startup-timeout: expected a positive float, found '-5'"),
        (["--port", "70000"], "argument --port: expected an integer in [0, 65535], found '70000'"),
    ],
)
def test_loadtest_options(flags, message, capsys) -> None:
    assert message in _usage_error(["loadtest", *flags], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the server's device is a CPU only without CUDA")
def test_an_sm_partition_on_a_cpu_is_refused_before_any_work(capsys) -> None:
    for command in ("serve", "loadtest"):
        assert main([command, "random:tiny", "--expert-sms", "32"]) == 2
        assert "--expert-sms: expected 0 on a CPU (an SM partition needs a CUDA device), found 32" in (
            capsys.readouterr().err)  # fmt: skip


def test_compare_needs_a_checkpoint_to_start_its_servers(capsys) -> None:
    assert main(["loadtest", "--compare", "8"]) == 2
    assert "--compare: expected a CHECKPOINT (the comparison starts a server per scheduler), found no CHECKPOINT" in (
        capsys.readouterr().err)  # fmt: skip


def test_the_serving_process_sets_its_cpu_threads_before_it_builds(monkeypatch) -> None:
    """`vla-rt serve` sets torch's intra-op threads before it builds anything (the cost model runs at build): one on
    CUDA unless told, and on a CPU, where the model runs on them, torch's own."""
    import vla_rt.serve.cli_args as cli_args

    seen = []
    monkeypatch.setattr(cli_args, "build_server", lambda cfg: seen.append(torch.get_num_threads()) or cfg)
    monkeypatch.setattr(cli_args, "serve_until_signalled", lambda server: 0)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert main(["serve", "random:tiny", "--device", "cpu"]) == 0
        assert main(["serve", "random:tiny", "--device", "cpu", "--cpu-threads", "2"]) == 0
        assert seen == [3, 2]
        cuda = replace(ServeConfig("random:tiny"), device="cpu")
        monkeypatch.setattr(ServeConfig, "resolved_device", lambda self: torch.device("cuda"))
        use_cpu_threads(cuda)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
