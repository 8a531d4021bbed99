"""Compile representative kernels at their H200 launch configs for sm_90 without a GPU (Triton's own toolchain):
catches what the interpreter cannot — compile errors, shared-memory overflow, register spills, no wgmma — plus the
split-K / split-KV combine kernels, which compile_check does not record."""

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


def _sm90(*args: str) -> subprocess.CompletedProcess:
    """Run python with `args` (e.g. "-m", "vla_rt.triton_kernels.compile_check", ...) with the real compiler."""
    proc = subprocess.run([sys.executable, *args], env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _compile_reports(code: str, count: int) -> list[str]:
    """Run `code`, which prints one compile_check report line per kernel it compiles, with the real compiler; its
    `count` lines, checked for spills and shared-memory overflow."""
    proc = _sm90("-c", code)
    lines = proc.stdout.strip().splitlines()
    bad = [ln for ln in lines if "SPILL" in ln or "SMEM-OVERFLOW" in ln]
    assert len(lines) == count and not bad, proc.stdout + proc.stderr
    return lines


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_representative_kernels_compile_for_sm90():
    only = "expert.o,expert.gate_up,vlm.gate_up,siglip.fc2,expert,siglip"
    proc = _sm90("-m", "vla_rt.triton_kernels.compile_check", "--only", only)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("gemm_", "attention_"))]
    assert len(lines) >= 6, proc.stdout
    for line in lines:
        assert "SMEM-OVERFLOW" not in line and "SPILL" not in line, line
        # wgmma needs 64-row tiles; the action expert's attention uses 16/32-row blocks on purpose (mma.sync)
        small_attention = line.startswith("attention_") and int(line.split("/")[0].split()[-1]) < 64
        assert "wgmma y" in line or small_attention, line


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_combine_kernels_compile_for_sm90():
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.attention_configs import AttentionConfig
from vla_rt.triton_kernels.launch_configs import GemmConfig
gm, am = cc._submodule("gemm"), cc._submodule("attention")
a, w, out = cc._meta(64, 2048), cc._meta(8192, 2048), cc._meta(64, 4096)
cfg = GemmConfig(64, 64, 128, split_k=4, combine=1)
call = lambda: gm.gemm(a, w, out, gated=True, row_scale=cc._meta(64, dtype=torch.float32), residual=out, config=cfg)
print(cc.check(gm, "gemm_combine_kernel", call, "gated").line())
print(cc.check(gm, "gemm_epilogue_kernel", call, "gated partials").line())
q, k = cc._meta(1, 64, 8, 256), cc._meta(1, 832, 1, 256)
acfg = AttentionConfig(32, 64, 8, num_splits=8, num_warps=4, combine=1)
call = lambda: am.attention(q, k, k, torch.empty_like(q), scale=1.0, config=acfg)
print(cc.check(am, "attention_combine_kernel", call, "expert").line())
print(cc.check(am, "attention_kernel", call, "expert partials").line())
"""
    _compile_reports(code, 4)


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_rope_gemm_compiles_for_sm90():
    """The action expert's QKV GEMM with the RoPE epilogue into the cache at its H200 table configs, plus its split-K
    partial and combine kernels: no spills, no shared-memory overflow, wgmma."""
    proc = _sm90("-m", "vla_rt.triton_kernels.compile_check", "--only", "expert.qkv")
    rope = [ln for ln in proc.stdout.splitlines() if ln.startswith("gemm_") and ":rope" in ln]
    assert len(rope) == 1, proc.stdout
    assert "SMEM-OVERFLOW" not in rope[0] and "SPILL" not in rope[0] and "wgmma y" in rope[0], rope[0]
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
gm = cc._submodule("gemm")
a, w, out = cc._meta(64, 1024), cc._meta(2560, 1024), cc._meta(64, 2560)
cache, tab = cc._meta(1, 832, 1, 256), cc._meta(64, 128, dtype=torch.float32)
rope = dict(cos=tab, sin=tab, k_cache=cache, v_cache=cache, num_q_heads=8, num_kv_heads=1, head_dim=256,
            cache_offset=768)
for combine in (0, 1):
    cfg = GemmConfig(64, 32, 128, split_k=4, combine=combine)
    call = lambda: gm.gemm(a, w, out, row_scale=cc._meta(64, dtype=torch.float32), rope=rope, config=cfg)
    print(cc.check(gm, "gemm_epilogue_kernel", call, f"qkv rope split4 combine{combine}").line())
    if combine:
        print(cc.check(gm, "gemm_combine_kernel", call, "qkv rope combine").line())
"""
    _compile_reports(code, 3)


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_pdl_variants_compile_for_sm90():
    """With programmatic dependent launch every kernel waits on griddepcontrol (pointer and TMA GEMMs, attention,
    norms), and nothing spills."""
    proc = _sm90(
        "-m", "vla_rt.triton_kernels.compile_check", "--pdl", "--only", "expert.qkv,expert.gate_up,vlm.gate_up,expert"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("gemm_", "attention_", "rms_", "layernorm_"))]
    assert lines and all("pdl wait" in ln and "SPILL" not in ln for ln in lines), proc.stdout


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_tma_gemm_modes_compile_for_sm90():
    """The TMA kernel in each mode (stream-K's own kernel for mode 4) on the VLM's gated gate/up (prompt-20 rows, a partial row tile) and SigLIP's fc1
    (bias + GELU), the expert's RoPE QKV and split-K down: wgmma in the code, no spills, shared memory that fits."""
    code = """
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
from vla_rt.triton_kernels.shapes import pi0_gemm_shapes
gate_up = next(s for s in pi0_gemm_shapes(views=(3,), prompts=(20,), chunks=()) if s.name == "vlm.gate_up")
fc1 = next(s for s in pi0_gemm_shapes(views=(1,), prompts=(20,), chunks=()) if s.name == "siglip.fc1")
for mode in (1, 2, 3, 4):  # 4: stream-K (gemm_stream_k_kernel)
    for shape in (gate_up, fc1):
        print(cc.gemm_report(shape, GemmConfig(128, 128, 64, 1, 8, 8, 3, 0, mode)).line())
# the expert's: RoPE epilogue into the cache (32 pair columns in a 128-wide half head), split-K partials
qkv = next(s for s in pi0_gemm_shapes(views=(), prompts=(), chunks=(63,)) if s.rope)
down = next(s for s in pi0_gemm_shapes(views=(), prompts=(), chunks=(63,)) if s.name == "expert.down")
print(cc.gemm_report(qkv, GemmConfig(64, 32, 128, 1, 1, 4, 5, 0, 2)).line())
print(cc.gemm_report(down, GemmConfig(64, 64, 128, 4, 1, 4, 4, 1, 1)).line())
"""
    lines = _compile_reports(code, 10)
    for line in lines:
        kernel = "gemm_stream_k_kernel" if " tma4 " in line else "gemm_tma_kernel"
        assert line.startswith(kernel) and "wgmma y" in line, line


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_modulation_rows_compile_for_sm90():
    """π0.5's per-batch-element modulation rows (the stage engine's B = 8 rows of 51, bf16): the gate rows of O and
    down (split-K + combine, and the TMA kernel), the bias rows of gate/up (gated) and of the RoPE QKV, and the RMSNorm
    scale rows: each compiles for sm_90 without spills, within shared memory."""
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
gm, norms = cc._submodule("gemm"), cc._submodule("norms")
m, b, f32 = 408, 8, torch.float32
packed = cc._meta(b, 20000, dtype=f32)  # one step's packed row per batch element: (B, ·) views of stride 20000
x, attn, h = cc._meta(m, 1024), cc._meta(m, 2048), cc._meta(m, 4096)
gate = packed[:, :1024]
for cfg, label in ((GemmConfig(64, 64, 128, split_k=4, combine=1), "o gate rows split4"),
                   (GemmConfig(64, 16, 256, 1, 1, 4, 4, 0, 2), "o gate rows tma2")):
    call = lambda: gm.gemm(attn, cc._meta(1024, 2048), x, residual=x, out_scale=gate, config=cfg)
    kernel = "gemm_tma_kernel" if cfg.tma else "gemm_epilogue_kernel"
    print(cc.check(cc._submodule("gemm_tma") if cfg.tma else gm, kernel, call, label).line())
    if cfg.combine:
        print(cc.check(gm, "gemm_combine_kernel", call, label + " combine").line())
cfg = GemmConfig(64, 64, 64, num_warps=4, num_stages=4)
call = lambda: gm.gemm(x, cc._meta(8192, 1024), h, gated=True, bias=packed[:, 1024:9216], config=cfg)
print(cc.check(gm, "gemm_epilogue_kernel", call, "gate_up bias rows").line())
cache, tab = cc._meta(b, 832, 1, 256), cc._meta(b, 51, 128, dtype=f32)
rope = dict(cos=tab, sin=tab, k_cache=cache, v_cache=cache, num_q_heads=8, num_kv_heads=1, head_dim=256,
            cache_offset=781)
cfg = GemmConfig(64, 32, 128, num_warps=4, num_stages=4)
call = lambda: gm.gemm(x, cc._meta(2560, 1024), cc._meta(m, 2560), bias=packed[:, 9216:11776], rope=rope, config=cfg)
print(cc.check(gm, "gemm_epilogue_kernel", call, "qkv rope bias rows").line())
call = lambda: norms.rmsnorm(x, x, 1e-6, scale=packed[:, 11776:12800])
print(cc.check(norms, "rms_kernel", call, "rmsnorm scale rows").line())
"""
    _compile_reports(code, 6)
