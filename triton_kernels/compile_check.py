"""Compile kernels for sm_90 on a machine without a GPU and report shared memory, registers and spills.

The interpreter checks numerics but not what the compiler does with a config: whether it fits in shared memory,
spills registers, or uses wgmma. This module runs each public wrapper against meta tensors with a recording stub
in place of the launch, then hands the recorded arguments to `triton.compile` for GPUTarget("cuda", 90) and reads
the cubin's resource usage with the `cuobjdump` shipped in Triton's wheel.

    python -m vla_rt.triton_kernels.compile_check [--all] [--pdl]   # re-runs itself with TRITON_INTERPRET=0
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention_configs import _attention_config_cuda
from .launch_configs import _gemm_config_cuda
from .pdl import pdl_mode
from .shapes import pi0_attention_shapes, pi0_gemm_shapes

SMEM_LIMIT = 227 * 1024


@dataclass
class CompileReport:
    kernel: str
    label: str
    shared_bytes: int
    registers: int
    stack_bytes: int
    wgmma: bool
    pdl: str = ""  # "wait" (griddepcontrol.wait) or ""

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SMEM_LIMIT

    def line(self) -> str:
        flags = ("" if self.fits else " SMEM-OVERFLOW") + (f" SPILL({self.stack_bytes}B)" if self.stack_bytes else "")
        return (
            f"{self.kernel:<26} {self.label:<44} smem {self.shared_bytes / 1024:6.1f} KiB  regs {self.registers:3d}"
            f"  wgmma {'y' if self.wgmma else 'n'}{flags}" + (f"  pdl {self.pdl}" if self.pdl else "")
        )  # fmt: skip


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}


def _compile(fn, args: tuple, kwargs: dict, arch: int = 90):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    names = fn.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in kwargs:
            signature[name] = "constexpr"
            continue
        value = args[i]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # allocations are 256-byte aligned
        elif type(value).__name__ == "TensorDescriptor":  # a TMA descriptor (gemm_tma), typed by its tile
            signature[name] = f"tensordesc<{_TYPES[value.base.dtype]}[{','.join(map(str, value.block_shape))}]>"
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0 and value != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    src = ASTSource(fn, signature, dict(kwargs), attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vla_rt_compile_check_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        text = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    finally:
        path.unlink(missing_ok=True)
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def check(module, kernel_name: str, call, label: str) -> CompileReport:
    """Run `call()` (a wrapper invocation on meta tensors) with `module.kernel_name` recorded, compile the launch."""
    real = getattr(module, kernel_name)
    recorder = _Recorder(real)
    setattr(module, kernel_name, recorder)
    try:
        call()
    finally:
        setattr(module, kernel_name, real)
    (args, kwargs) = recorder.calls[-1]
    compiled = _compile(real, args, dict(kwargs))
    regs, stack = _resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    pdl = "wait" if "griddepcontrol.wait" in ptx else ""
    return CompileReport(kernel_name, label, compiled.metadata.shared, regs, stack, "wgmma" in ptx, pdl)


def _submodule(name: str):
    # The package re-exports functions under their modules' names (`gemm`, `attention`, `patchify`).
    return importlib.import_module(f"{__package__}.{name}")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def gemm_report(shape, config, dtype=torch.bfloat16) -> CompileReport:
    gemm_module = _submodule("gemm")

    n_w = shape.n * (2 if shape.gated else 1)
    k_alloc = -(-shape.k // 8) * 8  # rows padded to 16 bytes, as the engine allocates them (gemm's fast path)
    a = _meta(shape.m, k_alloc, dtype=dtype)[:, : shape.k]
    w = _meta(n_w, k_alloc, dtype=dtype)[:, : shape.k]
    out = _meta(shape.m, shape.n, dtype=dtype if shape.rope else torch.bfloat16)
    rope = None
    if shape.rope:  # π0's expert suffix: cache rows after a 3-view prefix
        hq, hkv, d = shape.rope_heads
        # per-batch-row tables (B, T, D/2), as the engine's slots hold them
        cache, tab = _meta(1, 768 + shape.m, hkv, d, dtype=dtype), _meta(1, shape.m, d // 2, dtype=torch.float32)
        rope = dict(cos=tab, sin=tab, k_cache=cache, v_cache=cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                    cache_offset=768)  # fmt: skip

    def call():
        gemm_module.gemm(
            a, w, out,
            bias=_meta(n_w) if shape.bias else None,
            row_scale=_meta(shape.m, dtype=torch.float32) if shape.row_scale else None,
            activation=shape.activation, gated=shape.gated,
            residual=_meta(shape.m, shape.n) if shape.residual else None,
            rope=rope,
            config=config,
        )  # fmt: skip

    flags = ":rope" if shape.rope else ""
    label = f"{shape.name}{flags} {shape.m}x{shape.n}x{shape.k} {config.block_m}/{config.block_n}/{config.block_k}"
    label += f" sk{config.split_k} w{config.num_warps} s{config.num_stages}" + (
        f" tma{config.tma}" if config.tma else ""
    )
    tma = _submodule("gemm_tma")
    rope_half = shape.rope_heads[2] // 2 if shape.rope else 0
    if tma.tma_config_applies(config, rope_half=rope_half):  # what gemm launches (rows aligned)
        if config.tma == 4:
            return check(_submodule("gemm_stream_k"), "gemm_stream_k_kernel", call, label)
        return check(tma, "gemm_tma_kernel", call, label)
    return check(gemm_module, "gemm_epilogue_kernel", call, label)


def attention_report(shape, config, dtype=torch.bfloat16) -> CompileReport:
    attn_module = _submodule("attention")

    q = _meta(shape.b, shape.tq, shape.hq, shape.d, dtype=dtype)
    k = _meta(shape.b, shape.tk, shape.hkv, shape.d, dtype=dtype)
    blocks = (_meta(shape.b, shape.tq, dtype=torch.int32), _meta(shape.b, shape.tk, dtype=torch.int32))
    q_block, k_block = blocks if shape.masked else (None, None)

    def call():
        attn_module.attention(q, k, k, torch.empty_like(q), scale=1.0, q_block=q_block, k_block=k_block, config=config)

    label = f"{shape.name} {config.block_m}/{config.block_n} hpp{config.heads_per_program} split{config.num_splits}"
    label += f" w{config.num_warps} s{config.num_stages}" + (" tma" if config.tma else "")
    tma = _submodule("attention_tma")
    if tma.tma_attention_applies(q, k, k, config):  # what `attention` launches
        return check(tma, "attention_tma_kernel", call, label)
    return check(attn_module, "attention_kernel", call, label)


def small_kernel_reports() -> list[CompileReport]:
    norms, patchify, rope = (_submodule(n) for n in ("norms", "patchify", "rope"))

    x, f32 = _meta(816, 2048), torch.float32
    reports = [
        check(norms, "layernorm_kernel", lambda: norms.layernorm(x[:, :1152], x[:, :1152], 1e-6), "siglip 1152"),
        check(norms, "rms_kernel", lambda: norms.rms_factor(x, _meta(816, dtype=f32), 1e-6), "vlm 2048"),
    ]
    qkv, cache, tab = _meta(816, 2560), _meta(1, 900, 1, 256), _meta(816, 128, dtype=f32)
    reports.append(
        check(rope, "rope_qkv_to_cache_kernel", lambda: rope.rope_qk(qkv, tab, tab, cache, cache, num_q_heads=8,
              num_kv_heads=1, head_dim=256, q_scale=0.0625), "vlm 8+1+1 heads x 256")
    )  # fmt: skip
    img = _meta(3, 224, 224, 3, dtype=f32)
    reports.append(
        check(patchify, "patchify_kernel", lambda: patchify.patchify(img, _meta(768, 588), 14), "3 views 224/14")
    )
    return reports


def run_all(
    gpu: str = "NVIDIA-H200", num_sms: int = 132, every_shape: bool = False, only: set[str] | None = None
) -> list[CompileReport]:
    gemms = pi0_gemm_shapes() if every_shape else pi0_gemm_shapes(views=(3,), prompts=(48,))
    attns = pi0_attention_shapes() if every_shape else pi0_attention_shapes(views=(3,), prompts=(20,), chunks=(63,))
    if only:
        gemms = [s for s in gemms if s.name in only]
        attns = [s for s in attns if s.name.split(".")[0] in only or s.name in only]
    reports = []
    for s in gemms:
        cfg = _gemm_config_cuda(s.m, s.n, s.k, s.gated, torch.bfloat16, gpu, num_sms, s.rope)
        reports.append(gemm_report(s, cfg))
        print(reports[-1].line(), flush=True)
    for s in attns:
        cfg = _attention_config_cuda(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, torch.bfloat16, gpu, num_sms)
        reports.append(attention_report(s, cfg))
        print(reports[-1].line(), flush=True)
    for r in small_kernel_reports():
        reports.append(r)
        print(r.line(), flush=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="every π0 shape, not just the 3-view ones")
    parser.add_argument("--gpu", default="NVIDIA-H200", help="which launch table to read")
    parser.add_argument("--only", default="", help="comma-separated shape names (expert.o, siglip, ...) to compile")
    parser.add_argument("--pdl", action="store_true", help="the programmatic-dependent-launch variants (pdl.py)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="0")
        return subprocess.call([sys.executable, "-m", "vla_rt.triton_kernels.compile_check", *sys.argv[1:]], env=env)
    with pdl_mode("on" if args.pdl else "off"):
        reports = run_all(args.gpu, every_shape=args.all, only=set(filter(None, args.only.split(","))))
    bad = [r for r in reports if not r.fits]
    print(f"{len(reports)} kernels compiled for sm_90, {len(bad)} over shared memory, "
          f"{sum(1 for r in reports if r.stack_bytes)} with spills")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
