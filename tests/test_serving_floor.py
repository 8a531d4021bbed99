"""tools/serving_floor.py: its prefix GEMMs are the keys the tuner writes for the server's shape, and its FLOP count
is the prefix's (so the per-request floor it prints for issue 26 reads real table entries, not stale ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from serving_floor import flops, prefix_gemms  # noqa: E402

from vla_rt.config import Pi0Config  # noqa: E402


def test_prefix_gemms_count_the_prefix_flops() -> None:
    cfg = Pi0Config()
    v, g = cfg.vision, cfg.llm
    images, tokens = 2 * v.num_patches, 2 * v.num_patches + 20
    vision = images * (v.depth * 2 * (4 * v.width * v.width + 2 * v.width * v.mlp_dim) + 2 * v.width * 588)
    vision += images * 2 * v.width * g.width  # the projector
    qkv = (g.num_heads + 2) * g.head_dim * g.width
    layer = qkv + g.num_heads * g.head_dim * g.width + 3 * g.width * g.mlp_dim
    llm = tokens * 2 * ((g.depth - 1) * layer + 2 * g.head_dim * g.width)  # the last layer: K / V only
    total = sum(count * flops(key) for _, count, key in prefix_gemms(cfg, 2, 20, 1))
    assert total == pytest.approx(vision + llm, rel=1e-12)


@pytest.mark.parametrize("gpu", ["NVIDIA-H200", "NVIDIA-H100-80GB-HBM3"])
def test_every_gemm_of_the_fleet_shape_is_in_the_table(gpu) -> None:
    table = json.loads((ROOT / "triton_kernels" / "configs" / f"{gpu}.json").read_text())["gemm"]["bfloat16"]
    missing = [key for _, _, key in prefix_gemms(Pi0Config(), 2, 20, 8) if key not in table]
    assert not missing, missing
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "serving_floor.py"), "--gpu", gpu, "--expert-ms", "3"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "requests/s at 100% busy" in out


def test_unknown_gpu_is_refused_with_the_tables_there() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "serving_floor.py"), "--gpu", "NVIDIA-B200"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "NVIDIA-H200" in proc.stderr
