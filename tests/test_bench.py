"""The roofline reproduces ANCHORS.md's table; the CPU benchmark runs end to end and writes its three files."""

from __future__ import annotations

import json

import pytest

from vla_rt import preset
from vla_rt.bench.latency import BenchConfig, run_benchmark, write_results
from vla_rt.bench.roofline import pi0_roofline

ANCHOR_TABLE = {  # (views, prompt, chunk): (vision, VLM, action expert ×10, total) ms on the H200
    (1, 0, 63): (0.28, 1.21, 1.52, 3.00),
    (2, 0, 63): (0.55, 2.45, 1.55, 4.55),
    (3, 0, 63): (0.83, 3.71, 1.58, 6.11),
    (1, 20, 50): (0.28, 1.31, 1.51, 3.09),
    (2, 20, 50): (0.55, 2.55, 1.53, 4.63),
    (3, 20, 50): (0.83, 3.81, 1.56, 6.19),
}


@pytest.mark.parametrize("case", sorted(ANCHOR_TABLE))
def test_roofline_reproduces_anchor_table(case) -> None:
    views, prompt, chunk = case
    r = pi0_roofline(preset("pi0"), views, chunk, prompt)
    for got, want in zip((r.vision_ms, r.vlm_ms, r.expert_ms, r.total_ms), ANCHOR_TABLE[case]):
        assert got == pytest.approx(want, rel=0.02, abs=0.01)


def test_cpu_benchmark_writes_json_markdown_and_plot(tmp_path) -> None:
    cfg = BenchConfig(preset="tiny", cases=((1, 0, 7), (2, 3, 5)), backends=("reference", "static-torch"), iters=2,
                      warmup=1, out_dir=tmp_path)  # fmt: skip
    import torch

    result = run_benchmark(cfg, torch.device("cpu"), log=lambda _: None)
    paths = write_results(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert [(r["views"], r["backend"]) for r in data["rows"]] == [
        (1, "reference"), (1, "static-torch"), (2, "reference"), (2, "static-torch")
    ]  # fmt: skip
    assert all(r["median_ms"] > 0 and r["n"] == 2 for r in data["rows"])
    assert "| 2 views, prompt 3, chunk 5 | static-torch |" in paths["md"].read_text()
    assert paths["png"].stat().st_size > 1000


def test_compile_row_compiles_the_repeated_parts_and_checks_them(capsys) -> None:
    """The torch.compile row (CPU, tiny, default mode to keep it short): prefix and one expert step compiled, the
    result checked against eager before timing, one JSON line out."""
    from vla_rt.bench import compile_row

    argv = ["--preset", "tiny", "--case", "1,2,3", "--iters", "2", "--mode", "default", "--device", "cpu"]
    assert compile_row.main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["scope"] == "parts" and row["median_ms"] > 0 and row["rel_err_vs_eager"] < 1e-4


def test_compile_row_refuses_a_compile_that_changes_the_actions(monkeypatch, capsys) -> None:
    from vla_rt.bench import compile_row

    def wrong(model, scope, mode, coordinate_descent=True):
        return lambda *args: model.sample_actions(*args) * 1.01

    monkeypatch.setattr(compile_row, "compile_model", wrong)
    assert compile_row.main(["--preset", "tiny", "--case", "1,0,3", "--iters", "2", "--device", "cpu"]) == 1
    assert "relative error" in capsys.readouterr().err


def test_compile_row_without_coordinate_descent_keeps_the_modes_other_options(capsys) -> None:
    """`--coordinate-descent off` is max-autotune's option set minus that one pass (torch.compile takes options or a
    mode, not both), and the row records it; progress lines go to stderr as each part finishes compiling."""
    from vla_rt.bench import compile_row

    kwargs = compile_row.compile_kwargs("max-autotune", coordinate_descent=False)
    assert kwargs == {"options": {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": False}}
    assert compile_row.compile_kwargs("max-autotune", coordinate_descent=True) == {"mode": "max-autotune"}
    argv = ["--preset", "tiny", "--case", "1,0,3", "--iters", "2", "--mode", "default", "--coordinate-descent", "off",
            "--device", "cpu"]  # fmt: skip
    assert compile_row.main(argv) == 0
    out = capsys.readouterr()
    row = json.loads(out.out.strip().splitlines()[-1])
    assert row["coordinate_descent"] is False and row["rel_err_vs_eager"] < 1e-4
    from vla_rt.bench.latency import _progress

    assert [line.split(" in ")[0] for line in _progress(out.err)] == ["compiled prefix_kv", "compiled velocity"]


def test_compile_row_over_budget_says_how_far_it_got() -> None:
    """A compile stopped at its budget becomes a skipped row naming the parts that had finished (from the partial
    stderr, which the timeout hands over as bytes)."""
    from vla_rt.bench.latency import _progress

    partial = b"W1130 some inductor warning\ncompiled prefix_kv in 212 s\n"
    assert _progress(partial) == ["compiled prefix_kv in 212 s"]
    assert _progress(None) == []


def test_compiled_prefix_outputs_survive_the_next_replay(monkeypatch) -> None:
    """With CUDA graphs, a compiled function's outputs live in a pool the next replay overwrites; the compile row
    copies the prefix's KV cache and mask out, so the ten velocity calls read what this call computed. Simulated
    here with a "compiled" prefix that returns the same pool tensors every call and overwrites them."""
    import torch

    from vla_rt.bench import compile_row

    pool = [torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, dtype=torch.bool)]

    class Model:
        def prefix_kv(self, value):
            return [(pool[0], pool[1])], pool[2]

        def velocity(self, *args):
            return None

        def sample_actions(self, *args):
            return None

    def graph_pool_compile(fn, **kwargs):
        def replay(value):
            pool[0].fill_(value), pool[1].fill_(-value), pool[2].fill_(value > 0)
            return fn(value)

        return replay

    monkeypatch.setattr(compile_row.torch, "compile", graph_pool_compile)
    model = Model()
    compile_row.compile_model(model, "parts", "max-autotune")
    cache1, mask1 = model.prefix_kv(1.0)
    k1, v1 = cache1[0]
    cache2, mask2 = model.prefix_kv(2.0)
    assert torch.equal(k1, torch.ones(2, 3)) and torch.equal(v1, -torch.ones(2, 3)) and bool(mask1.all())
    assert torch.equal(cache2[0][0], torch.full((2, 3), 2.0)) and k1.data_ptr() != pool[0].data_ptr()


def test_markdown_reports_process_and_backend_memory() -> None:
    """The table gives the process's peak (the fp32 source weights included) beside the backend's own, which is what
    a robot's GPU must hold; rows from runs before the backend figure existed show the process peak alone."""
    from vla_rt.bench.report import latency_markdown

    row = {"views": 1, "prompt_len": 0, "chunk": 63, "backend": "triton", "median_ms": 10.2, "p90_ms": 10.3, "n": 200,
           "x_roofline": 3.35, "roofline_ms": 3.05, "peak_memory_gb": 26.5, "backend_memory_gb": 7.04}  # fmt: skip
    old = {**row, "backend": "cuda-graph-torch"}
    del old["backend_memory_gb"]
    result = {"device": "NVIDIA-H200", "preset": "pi0", "dtype": "bfloat16", "num_steps": 10, "torch": "2.11",
              "rows": [row, old]}  # fmt: skip
    md = latency_markdown(result)
    assert "| 3.35 | 3.05 | 26.5 / 7.0 |" in md and "| 26.5 |" in md


def test_compile_row_loads_what_two_parallel_warm_ups_compiled(tmp_path) -> None:
    """`--warm prefix_kv` and `--warm velocity`, run side by side, fill inductor's cache with exactly the graphs the
    timed run asks for (each is one sample_actions call with only its part compiled), so it compiles nothing itself: both parts are cache hits.
    This is what lets π0's ~10-minute cold compile fit one device call (two parts at once, then a cached run)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = [sys.executable, "-m", "vla_rt.bench.compile_row", "--preset", "tiny", "--case", "1,2,3", "--iters", "2",
            "--mode", "default", "--device", "cpu"]  # fmt: skip
    warmers = [subprocess.Popen([*args, "--warm", part], env=env, stderr=subprocess.PIPE, text=True)
               for part in ("prefix_kv", "velocity")]  # fmt: skip
    for proc in warmers:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["fx_graph_cache_hits"] == 2 and row["rel_err_vs_eager"] < 1e-4


def test_runs_write_to_a_new_git_ignored_folder_unless_told() -> None:
    """A benchmark run never overwrites the committed summaries by default: `vla-rt bench` and `BenchConfig` write to
    benchmarks/raw/<kind>-<time>/ (git-ignored), `--out benchmarks/results` writes there."""
    from pathlib import Path

    from vla_rt.bench.report import RAW_DIR, run_dir
    from vla_rt.cli import build_parser

    assert BenchConfig().out_dir.parent == RAW_DIR == Path("benchmarks/raw")
    assert run_dir("streaming").name.startswith("streaming-")
    assert build_parser().parse_args(["bench"]).out is None
    assert build_parser().parse_args(["bench", "--out", "benchmarks/results"]).out == Path("benchmarks/results")
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "/benchmarks/raw/" in ignored


def test_bench_model_pi05_runs_and_writes_its_own_files(tmp_path, capsys) -> None:
    """`vla-rt bench --model pi05` on the CPU: the tiny π0.5 preset through the same backends and cases, written as
    latency_pi05_<device>.* (π0's files stay untouched), no π0 peers; the π0.5 roofline has no state token."""
    from vla_rt.cli import main

    argv = ["bench", "--model", "pi05", "--cases", "1,4,5", "--backends", "folded,static-torch", "--iters", "2",
            "--warmup", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("latency_pi05_*.json")
    data = json.loads(path.read_text())
    assert (data["model"], data["preset"], data["peers"]) == ("π0.5", "tiny_pi05", {})
    assert [r["backend"] for r in data["rows"]] == ["folded", "static-torch"]
    assert all(r["median_ms"] > 0 for r in data["rows"])
    assert path.with_suffix(".md").read_text().startswith("# π0.5 latency")
    assert not list(tmp_path.glob("latency_CPU*"))
    assert main(["bench", "--model", "pi05", "--preset", "tiny", "--no-write"]) == 2
    assert "not a pi05 preset" in capsys.readouterr().err
    pi05, pi0 = preset("pi05"), preset("pi0")
    assert pi0_roofline(pi05, 1, 50, 20).expert_ms < pi0_roofline(pi0, 1, 50, 20).expert_ms
