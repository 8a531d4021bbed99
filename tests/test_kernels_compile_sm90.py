"""Compile representative kernels at their H200 launch configs for sm_90 without a GPU (Triton's own toolchain):
catches what the interpreter cannot — compile errors, shared-memory overflow, no wgmma."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _has_nvidia_toolchain() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_representative_kernels_compile_for_sm90():
    only = "expert.o,expert.gate_up,vlm.gate_up,siglip.fc2,expert,siglip"
    proc = subprocess.run(
        [sys.executable, "-m", "vla_rt.triton_kernels.compile_check", "--only", only],
        env=dict(os.environ, TRITON_INTERPRET="0"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("gemm_", "attention_"))]
    assert len(lines) >= 6, proc.stdout
    for line in lines:
        assert "SMEM-OVERFLOW" not in line and "wgmma y" in line, line
