"""tools/fp32_gemm_precision.py's report, built from a run's JSON on the CPU (the timing itself needs a GPU): the
Markdown row of each shape, the speed-up, and a shape with no accurate tf32x3 config reported as such."""

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fp32_gemm_precision.py"


def _tool():
    spec = importlib.util.spec_from_file_location("fp32_gemm_precision", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
