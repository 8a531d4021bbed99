"""The GPU tools' reports, built from a run's JSON on the CPU (the timing itself needs a GPU): tools/
fp32_gemm_precision.py (the Markdown row of each shape, the speed-up, a shape with no accurate tf32x3 config reported
as such) and tools/overlap_probe.py (its rows, a variant the driver refused)."""

import json

from tool_modules import load_tool


def _tool(name: str = "fp32_gemm_precision"):
    return load_tool(name)


def _row(m, ieee_us, best_us, tma=0):
    config = {"block_m": 64, "block_n": 128, "block_k": 32, "split_k": 1, "num_warps": 4, "num_stages": 4}
    best = None if best_us is None else {"config": {**config, "tma": tma}, "rel_err": 1e-7, "us": best_us}
    return {"family": "mlp_out", "m": m, "n": 1024, "k": 1024, "best": best, "tf32x3": [],
            "ieee_heuristic": {"config": config, "rel_err": 4e-7, "us": ieee_us}}  # fmt: skip


def test_report_from_json(tmp_path):
    tool = _tool()
    result = {"device": "GPU-X", "tolerance": 1e-5, "command": "python tools/fp32_gemm_precision.py",
              "rows": [_row(1600, 200.0, 50.0, tma=1), _row(50, 20.0, None)]}  # fmt: skip
    path = tmp_path / "fp32_gemm_precision_GPU-X.json"
    path.write_text(json.dumps(result))
    assert tool.write_report(json.loads(path.read_text()), tmp_path) == path
    md = path.with_suffix(".md").read_text()
    assert "| mlp_out | 1600 x 1024 x 1024 | 200.0 | 50.0 | 4.0x | 4.0e-07 | 1.0e-07 | 64/128/32 sk1 w4 s4 tma1 |" in md
    assert "| mlp_out | 50 x 1024 x 1024 | 20.0 | – |" in md  # no accurate config: no speed-up claimed
    assert path.with_suffix(".png").stat().st_size > 0


def test_overlap_probe_rows():
    """tools/overlap_probe.py's table: a measured row (the green partition's real SM count, not the one asked for) and
    a variant the driver refused, shown with its error instead of numbers."""
    tool = _tool("overlap_probe")
    measured = {"variant": "split", "expert_sms": 30, "green_sms": {"expert": 32, "prefix": 100}, "expert_rows": 4,
                "prefix_rows": 8, "error": None, "expert_alone_ms": 0.9, "expert_overlapped_ms": 1.25,
                "expert_overlapped_max_ms": 2.0, "steps_during_prefix": 31.0, "prefix_alone_ms": 39.3,
                "prefix_overlapped_ms": 41.0}  # fmt: skip
    assert tool.markdown_row(measured) == "| split | 32 | 4 | 8 | 0.900 | 1.250 (2.000) | 31.0 | 39.300 | 41.000 |"
    refused = {"variant": "split", "expert_sms": 16, "expert_rows": 4, "prefix_rows": 1,
               "error": "cuGreenCtxCreate: CUDA error 801 (operation not supported)"}  # fmt: skip
    assert tool.markdown_row(refused).startswith("| split | 16 | 4 | 1 | cuGreenCtxCreate: CUDA error 801")
    shared = {**measured, "variant": "shared", "expert_sms": None}
    del shared["green_sms"]
    assert tool.markdown_row(shared).startswith("| shared | all |")
