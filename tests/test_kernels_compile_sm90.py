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
from vla_rt.triton_kernels.launch_configs import AttentionConfig, GemmConfig
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
def test_fused_gemms_compile_for_sm90():
    """The fused variants (RMS factor in the K loop, RoPE epilogue into the cache) at their lookup's H200 configs,
    plus their split-K partial and combine kernels: no spills, no shared-memory overflow, wgmma."""
    proc = _sm90(
        "-m",
        "vla_rt.triton_kernels.compile_check",
        "--fused",
        "--only",
        "expert.qkv,expert.gate_up,expert.action_out,vlm.kv",
    )
    fused = [ln for ln in proc.stdout.splitlines() if ln.startswith("gemm_") and ":rms" in ln]
    assert len(fused) == 4, proc.stdout  # expert qkv:rms:rope, gate_up:rms, action_out:rms, vlm.kv:rms:rope
    for line in fused:
        assert "SMEM-OVERFLOW" not in line and "SPILL" not in line and "wgmma y" in line, line
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
    call = lambda: gm.gemm(a, w, out, rms_eps=1e-6, rope=rope, config=cfg)
    print(cc.check(gm, "gemm_epilogue_kernel", call, f"qkv rms rope split4 combine{combine}").line())
    if combine:
        print(cc.check(gm, "gemm_combine_kernel", call, "qkv rms rope combine").line())
"""
    _compile_reports(code, 3)


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_pdl_variants_compile_for_sm90():
    """With programmatic dependent launch every kernel waits on griddepcontrol, and the one-row-tile (expert) GEMMs
    of the pointer kernel prefetch their weight slice into L2 first (inline PTX that only ptxas checks); VLM GEMMs
    (many row tiles) and the TMA kernel (its table entries for expert.o, action_out, ...) don't."""
    proc = _sm90(
        "-m", "vla_rt.triton_kernels.compile_check", "--pdl", "--only", "expert.qkv,expert.gate_up,vlm.gate_up,expert"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("gemm_", "attention_", "rms_", "layernorm_"))]
    assert lines and all("pdl wait" in ln and "SPILL" not in ln for ln in lines), proc.stdout
    for line in lines:
        one_row_tile = line.startswith("gemm_epilogue_kernel") and line.split()[1].startswith("expert")
        assert ("l2-prefetch" in line) == one_row_tile, line


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_rms_partials_gemms_compile_for_sm90():
    """The producer (ssq_out in the epilogue of the split-K partial, combine and single-pass kernels) and consumer
    (ssq_in: the RMS factor from K/16 partial sums) at π0's expert and VLM shapes: no spills, wgmma kept."""
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
gm = cc._submodule("gemm")
f32 = torch.float32
a, w, x = cc._meta(64, 2048), cc._meta(1024, 2048), cc._meta(64, 1024)
for combine in (0, 1):
    cfg = GemmConfig(64, 64, 128, split_k=8, combine=combine)
    call = lambda: gm.gemm(a, w, x, residual=x, ssq_out=cc._meta(64, 64, dtype=f32), config=cfg)
    print(cc.check(gm, "gemm_epilogue_kernel", call, f"o ssq_out combine{combine}").line())
    if combine:
        print(cc.check(gm, "gemm_combine_kernel", call, "o ssq_out combine").line())
vx = cc._meta(816, 2048)
call = lambda: gm.gemm(cc._meta(816, 16384), cc._meta(2048, 16384), vx, residual=vx, ssq_out=cc._meta(128, 816, dtype=f32))
print(cc.check(gm, "gemm_epilogue_kernel", call, "vlm down ssq_out").line())
call = lambda: gm.gemm(x, cc._meta(8192, 1024), cc._meta(64, 4096), gated=True, rms_eps=1e-6,
                       ssq_in=cc._meta(64, 64, dtype=f32))
print(cc.check(gm, "gemm_epilogue_kernel", call, "expert gate_up ssq_in").line())
call = lambda: gm.gemm(vx, cc._meta(32768, 2048), cc._meta(816, 16384), gated=True, rms_eps=1e-6,
                       ssq_in=cc._meta(128, 816, dtype=f32))
print(cc.check(gm, "gemm_epilogue_kernel", call, "vlm gate_up ssq_in").line())
"""
    lines = _compile_reports(code, 6)
    assert all("wgmma y" in ln for ln in lines if not ln.startswith("gemm_combine")), lines


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_rms_out_combine_compiles_for_sm90():
    """The combine kernel with RMS_OUT (one program a whole row: 1024 columns for the expert's O / down, 2048 for the
    VLM's) at π0's split-K shapes: no spills."""
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
gm = cc._submodule("gemm")
f32 = torch.float32
for m, n, k, split in ((64, 1024, 2048, 8), (64, 1024, 4096, 4), (256, 2048, 16384, 4)):
    a, w, x = cc._meta(m, k), cc._meta(n, k), cc._meta(m, n)
    cfg = GemmConfig(64, 64, 128, split_k=split, combine=1)
    call = lambda: gm.gemm(a, w, x, residual=x, rms_out=cc._meta(m, dtype=f32), rms_out_eps=1e-6, config=cfg)
    print(cc.check(gm, "gemm_combine_kernel", call, f"{m}x{n}x{k} rms_out").line())
"""
    _compile_reports(code, 3)


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_l2_prefetch_kernel_compiles_for_sm90():
    """The bulk-prefetch inline PTX (per-lane addresses and sizes) is accepted by ptxas, and the prefetch kernel
    launches without PDL even where the other kernels use it (it runs on a side stream, ordered by nothing)."""
    code = """
import torch
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.pdl import pdl_mode
pm = cc._submodule("prefetch")
ts = [cc._meta(1024, 2048), cc._meta(8192, 1024), cc._meta(1024, 4096), cc._meta(2560, 1024)]
for mode in ("off", "on"):
    with pdl_mode(mode):
        print(cc.check(pm, "prefetch_l2_kernel", lambda: pm.prefetch_l2(ts), f"expert layer pdl {mode}").line())
"""
    lines = _compile_reports(code, 2)
    assert all("l2-prefetch" in ln and "pdl" not in ln.split("regs")[1] for ln in lines), lines


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_tma_gemm_modes_compile_for_sm90():
    """The TMA kernel in each mode (Stream-K included) on the VLM's gated gate/up (prompt-20 rows, a partial row tile) and SigLIP's fc1
    (bias + GELU): TMA descriptors and wgmma in the code, no spills, shared memory that fits."""
    code = """
from vla_rt.triton_kernels import compile_check as cc
from vla_rt.triton_kernels.launch_configs import GemmConfig
from vla_rt.triton_kernels.shapes import pi0_fused_gemm_shapes, pi0_gemm_shapes
gate_up = next(s for s in pi0_gemm_shapes(views=(3,), prompts=(20,), chunks=()) if s.name == "vlm.gate_up")
fc1 = next(s for s in pi0_gemm_shapes(views=(1,), prompts=(20,), chunks=()) if s.name == "siglip.fc1")
for mode in (1, 2, 3, 4):
    for shape in (gate_up, fc1):  # (Stream-K's owner adds partials into its accumulators: gated tiles <= 128 x 64)
        block_n = 64 if mode == 4 and shape.gated else 128
        print(cc.gemm_report(shape, GemmConfig(128, block_n, 64, 1, 8, 8, 3, 0, mode)).line())
# the expert's: RoPE epilogue into the cache (32 pair columns in a 128-wide half head), split-K partials
qkv = next(s for s in pi0_fused_gemm_shapes(views=(3,), prompts=(20,), chunks=(63,)) if s.rope and not s.rms)
down = next(s for s in pi0_gemm_shapes(views=(), prompts=(), chunks=(63,)) if s.name == "expert.down")
print(cc.gemm_report(qkv, GemmConfig(64, 32, 128, 1, 1, 4, 5, 0, 2)).line())
print(cc.gemm_report(down, GemmConfig(64, 64, 128, 4, 1, 4, 4, 1, 1)).line())
print(cc.gemm_report(qkv, GemmConfig(64, 32, 128, 1, 1, 4, 5, 0, 4)).line())  # Stream-K with the RoPE epilogue
"""
    lines = _compile_reports(code, 11)
    for line in lines:
        assert line.startswith("gemm_tma_kernel") and "wgmma y" in line, line


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_gluon_skinny_gemm_compiles_for_sm90():
    """The Gluon GEMM in every mode the engine launches (and plain with a residual and a given row scale): fits
    shared memory, no spill, TMA loads, wgmma, the PDL wait, and a warp-specialized register split."""
    code = """
import re
from vla_rt.triton_kernels import compile_check as cc, gluon_gemm as gg
for mode, scale, res in (("rope", gg.SCALE_RMS, False), ("gated", gg.SCALE_RMS, False), ("plain", gg.SCALE_ROWS, True),
                         ("gated", gg.SCALE_ROWS, False)):
    c = gg.compile_sm90(mode, scale=scale, has_res=res)
    regs, stack = cc._resource_usage(c.asm["cubin"])
    ptx = c.asm["ptx"]
    print(mode, scale, res, c.metadata.shared, stack, "cp.async.bulk.tensor" in ptx, "wgmma" in ptx,
          "griddepcontrol.wait" in ptx, "setmaxnreg" in ptx)
"""
    lines = _sm90("-c", code).stdout.strip().splitlines()
    assert len(lines) == 4, lines
    for line in lines:
        mode, scale, res, smem, stack, tma, wgmma, wait, ws = line.split()
        assert int(smem) <= 227 * 1024 and stack == "0", line
        assert tma == wgmma == wait == ws == "True", line


@pytest.mark.skipif(not _has_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_gluon_expert_mlp_compiles_for_sm90():
    """The one-launch expert MLP with the RMS factor in-kernel and given, with the O projection's phase 0, with and
    without timing stamps, one layer or several a launch: fits shared memory, no spill, TMA loads, wgmma, the PDL wait, the acquire poll of the
    slice counter, a warp-specialized register split."""
    code = """
from vla_rt.triton_kernels import compile_check as cc, gluon_mlp as gm
variants = [(False, False, 0, 1), (False, True, 0, 1), (True, False, 0, 1), (True, True, 0, 1),
            (False, False, 2048, 1), (False, True, 2048, 1), (False, True, 2048, 18), (True, False, 0, 3)]
for rows, timing, k_o, layers in variants:
    c = gm.compile_sm90(row_scale=rows, timing=timing, k_o=k_o, layers=layers)
    regs, stack = cc._resource_usage(c.asm["cubin"])
    ptx = c.asm["ptx"]
    print(rows, timing, c.metadata.shared, stack, "cp.async.bulk.tensor" in ptx, "wgmma" in ptx,
          "griddepcontrol.wait" in ptx, "ld.acquire.gpu" in ptx, "setmaxnreg" in ptx, "globaltimer" in ptx)
"""
    lines = _sm90("-c", code).stdout.strip().splitlines()
    assert len(lines) == 8, lines
    for line in lines:
        rows, timing, smem, stack, tma, wgmma, wait, poll, ws, stamps = line.split()
        assert int(smem) <= 227 * 1024 and stack == "0", line
        assert tma == wgmma == wait == poll == ws == "True" and stamps == timing, line
