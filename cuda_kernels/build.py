"""Compiling the kernels at run time: nvcc for the GPU in hand, cubins cached by source hash + arch + shapes.

Why cubin + the driver API (`driver.py`) rather than a torch C++ extension: a kernel variant compiles in seconds
(no torch headers), the same command serves the CPU compile tests in CI (the `nvidia-cuda-nvcc` wheel, no GPU, no
torch ABI), and launching needs nothing but libcuda, which every CUDA machine has.

nvcc is looked up in this order: $VLA_RT_NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin, then the
`nvidia-cuda-nvcc` wheel. The first build of a variant prints one progress line; later runs load the cached cubin.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
ARCH = "sm_90a"
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "-diag-suppress", "177")


class BuildError(RuntimeError):
    pass


def find_nvcc() -> str | None:
    """Path of an nvcc that can target sm_90a, or None."""
    candidates = [os.environ.get("VLA_RT_NVCC")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        candidates += [os.path.join(root, sub, "bin", "nvcc") for sub in ("cu13", "cuda_nvcc", "cu12")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    wgmma_serialized: bool

    @classmethod
    def parse(cls, log: str) -> Resources:
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        stack = re.search(r"(\d+) bytes stack frame", log)
        if not (regs and spill and stack):
            raise BuildError(f"no ptxas resource report in:\n{log}")
        return cls(int(regs.group(1)), int(spill.group(1)), int(spill.group(2)), int(stack.group(1)),
                   "C7512" in log)  # fmt: skip


def cache_dir() -> Path:
    root = os.environ.get("VLA_RT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vla_rt")
    return Path(root) / "cuda_kernels"


def compile_cubin(source: str, defines: dict[str, int], *, arch: str = ARCH, nvcc: str | None = None,
                  quiet: bool = False, use_cache: bool = True) -> tuple[bytes, str]:  # fmt: skip
    """(cubin, ptxas log) of `source` (a file in this folder) built with `-D` defines for `arch`."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("no nvcc found (install the CUDA toolkit or `pip install nvidia-cuda-nvcc`)")
    text = (SOURCE_DIR / source).read_text()
    text += "".join(h.read_text() for h in sorted(SOURCE_DIR.glob("*.cuh")))  # included headers change the cubin too
    flags = [f"-gencode=arch=compute_{arch[3:]},code={arch}", *NVCC_FLAGS, *(f"-D{k}={v}" for k, v in defines.items())]
    key = hashlib.sha256("\n".join([text, nvcc_version(nvcc), *flags]).encode()).hexdigest()[:24]
    out = cache_dir() / f"{Path(source).stem}-{arch}-{key}.cubin"
    log_path = out.with_suffix(".log")
    if use_cache and out.is_file() and log_path.is_file():
        return out.read_bytes(), log_path.read_text()
    if not quiet:
        shape = " ".join(f"{k}={v}" for k, v in defines.items())
        print(f"vla_rt.cuda_kernels: compiling {source} for {arch} ({shape}) with {nvcc} ...", file=sys.stderr,
              flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        proc = subprocess.run([nvcc, *flags, "-o", str(cubin), str(SOURCE_DIR / source)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed for {source} ({arch}):\n{log[-4000:]}")
        data = cubin.read_bytes()
    if use_cache:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(f".tmp{os.getpid()}")
        tmp_out.write_bytes(data)
        log_path.write_text(log)
        os.replace(tmp_out, out)
    return data, log
