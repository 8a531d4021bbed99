"""Launch configurations as data: per-GPU JSON tables, with heuristics for shapes not in a table.

A table lives at `configs/<gpu-name>.json` (the name from `torch.cuda.get_device_name`, spaces as '-') and looks
like::

    {"gpu": "NVIDIA H200", "source": "...",
     "gemm":      {"bfloat16": {"64x2560x1024": {"block_m": 64, ...}, "64x4096x1024:gated": {...}}},
     "attention": {"bfloat16": {"b1:64x880:h8/1:d256": {"block_m": 64, ...}}}}

GEMM keys are `MxNxK` (N = output columns, K = reduction length) plus `:gated`; a lookup takes the exact M, else
the smallest tabled M above it with the same N, K and flags (a config for 64 rows serves 51), else the heuristic.
Attention keys are exact. `tune.py` measures candidates and writes these tables; on a machine without CUDA the
lookup returns interpreter-friendly defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "AttentionConfig",
    "GemmConfig",
    "attention_config",
    "attention_key",
    "dump_table",
    "gemm_config",
    "gemm_key",
    "gpu_name",
    "load_table",
    "table_path",
]

CONFIG_DIR = Path(__file__).parent / "configs"
HBM_BYTES_PER_S = 4.23e12  # measured copy bandwidth of the H200 (ANCHORS.md)
L2_BYTES_PER_S = 10e12  # rough: what partial sums and re-read activations cost when they stay in L2
PEAK_FLOPS = 800e12  # measured bf16 dense matmul on the H200 (ANCHORS.md)
SMEM_BYTES = 200 * 1024  # what we let the pipeline use of sm_90's 227 KiB per block


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AttentionConfig:
    """`block_m` rows of (query position, head) pairs: `heads_per_program` heads sharing one KV head."""

    block_m: int
    block_n: int
    heads_per_program: int = 1
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def from_dict(cls, d: dict) -> AttentionConfig:
        return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gpu_name(device: torch.device | str | None = None) -> str:
    """File-name form of the GPU's name ('NVIDIA-H200'), or 'cpu' without CUDA."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return "cpu"
    return torch.cuda.get_device_name(device).strip().replace(" ", "-")


def table_path(gpu: str) -> Path:
    return CONFIG_DIR / f"{gpu.replace(' ', '-')}.json"


@functools.cache
def load_table(gpu: str) -> dict:
    """The JSON table for `gpu` ({} when there is none). Call `load_table.cache_clear()` after rewriting one."""
    path = table_path(gpu)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def dump_table(table: dict) -> str:
    """JSON text of a table with one line per entry, so diffs of retuned tables stay readable."""
    lines = ["{"]
    top = list(table.items())
    for i, (key, value) in enumerate(top):
        end = "," if i < len(top) - 1 else ""
        if key in ("gemm", "attention") and isinstance(value, dict):
            lines.append(f"  {json.dumps(key)}: {{")
            dtypes = list(value.items())
            for j, (dname, entries) in enumerate(dtypes):
                lines.append(f"    {json.dumps(dname)}: {{")
                items = sorted(entries.items())
                for e, (k, v) in enumerate(items):
                    lines.append(f"      {json.dumps(k)}: {json.dumps(v)}" + ("," if e < len(items) - 1 else ""))
                lines.append("    }" + ("," if j < len(dtypes) - 1 else ""))
            lines.append("  }" + end)
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
    return "\n".join(lines + ["}"]) + "\n"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


# ---------------------------------------------------------------------------------------------------- GEMM


def gemm_key(m: int, n: int, k: int, gated: bool) -> str:
    return f"{m}x{n}x{k}" + (":gated" if gated else "")


def gemm_config(m: int, n: int, k: int, *, gated: bool, dtype: torch.dtype, device: torch.device) -> GemmConfig:
    """Launch config for an (M, K) x (K, N) GEMM (N output columns; a gated GEMM reads 2N weight rows)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _interpreter_gemm_config(m, n, k)
    return _gemm_config_cuda(m, n, k, gated, dtype, gpu_name(device), _num_sms(device))


@functools.lru_cache(maxsize=4096)
def _gemm_config_cuda(m, n, k, gated, dtype, gpu, num_sms) -> GemmConfig:
    entries = load_table(gpu).get("gemm", {}).get(_dtype_name(dtype), {})
    suffix = f"x{n}x{k}" + (":gated" if gated else "")
    best_m = None
    for key in entries:
        head, _, rest = key.partition("x")
        if "x" + rest == suffix and head.isdigit() and int(head) >= m and (best_m is None or int(head) < best_m):
            best_m = int(head)
    if best_m is not None:
        return GemmConfig.from_dict(entries[f"{best_m}{suffix}"])
    return gemm_heuristic(
        m, n, k, gated=gated, elem_bytes=torch.tensor([], dtype=dtype).element_size(), num_sms=num_sms
    )


def _interpreter_gemm_config(m: int, n: int, k: int) -> GemmConfig:
    # The interpreter pays per program and per op, not per FLOP: few, large tiles run fastest.
    return GemmConfig(
        block_m=min(64, max(16, _next_pow2(m))),
        block_n=min(64, max(16, _next_pow2(n))),
        block_k=min(64, max(16, _next_pow2(k))),
        split_k=1,
        group_m=8,
        num_warps=4,
        num_stages=1,
    )


def _stages_that_fit(block_m: int, block_n: int, block_k: int, gated: bool, elem_bytes: int, most: int) -> int:
    per_stage = (block_m + block_n * (2 if gated else 1)) * block_k * elem_bytes
    return max(1, min(most, SMEM_BYTES // per_stage))


def _wave_efficiency(programs: int, num_sms: int) -> float:
    """Fraction of the SMs' time doing work when `programs` equal programs run in waves (one per SM at a time)."""
    return programs / (math.ceil(programs / num_sms) * num_sms)


def gemm_heuristic(m: int, n: int, k: int, *, gated: bool, elem_bytes: int = 2, num_sms: int = 132) -> GemmConfig:
    """A config from a small cost model (docs/kernels.md explains it); `tune` replaces it with measurements."""
    if m <= 128:
        return _skinny_gemm_heuristic(m, n, k, gated, elem_bytes, num_sms)
    return _wide_gemm_heuristic(m, n, k, gated, elem_bytes, num_sms)


def _skinny_gemm_heuristic(m, n, k, gated, elem_bytes, num_sms) -> GemmConfig:
    # Weight-bandwidth-bound: pick (BLOCK_N, SPLIT_K) to minimise modelled time = weights over the HBM bandwidth
    # the grid can draw (a program per SM at most) + L2 traffic (A re-read per column tile, fp32 partials).
    block_m = 64 if m > 32 else max(16, _next_pow2(m))
    rows = n * (2 if gated else 1)
    w_bytes = rows * k * elem_bytes
    best = None
    for block_n in (32, 64, 128):
        if block_n > max(32, _next_pow2(n)):
            continue
        tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
        for split_k in (1, 2, 4, 8, 16):
            k_split = math.ceil(k / split_k)
            if split_k > 1 and k_split < 128:
                break
            programs = tiles * split_k
            util = min(1.0, programs / num_sms) * (_wave_efficiency(programs, num_sms) if programs > num_sms else 1)
            a_bytes = m * k * elem_bytes * math.ceil(n / block_n)
            partial_bytes = 0 if split_k == 1 else 2 * split_k * m * rows * 4
            t = w_bytes / (HBM_BYTES_PER_S * util) + (a_bytes + partial_bytes) / L2_BYTES_PER_S
            t += 0 if split_k == 1 else 0.3e-6  # the last program's serial reduction
            if best is None or t < best[0] * 0.97:
                best = (t, block_n, split_k)
    _, block_n, split_k = best
    k_split = math.ceil(k / split_k)
    block_k = 128 if k_split >= 512 and elem_bytes <= 2 else (64 if k_split >= 64 else max(16, _next_pow2(k_split)))
    block_k = min(block_k, 64) if elem_bytes > 2 else block_k
    stages = _stages_that_fit(block_m, block_n, block_k, gated, elem_bytes, most=4)
    return GemmConfig(block_m, block_n, block_k, split_k, group_m=1, num_warps=4, num_stages=stages)


def _wide_gemm_heuristic(m, n, k, gated, elem_bytes, num_sms) -> GemmConfig:
    # Compute-bound: modelled time = FLOPs at the tile's wgmma efficiency and the grid's wave efficiency on 132 SMs,
    # plus (split-K) the fp32 partials' round trip through L2 and the serial reduction.
    tile_efficiency = {(128, 256): 1.0, (128, 128): 0.92, (64, 256): 0.85, (128, 64): 0.78, (64, 128): 0.72,
                       (64, 64): 0.6}  # fmt: skip
    flop_time = 2 * m * n * k * (2 if gated else 1) / PEAK_FLOPS
    best = None
    for block_m, block_n in tile_efficiency:
        if gated and block_n > 128:
            continue
        cols = block_n * (2 if gated else 1)  # a gated tile holds two accumulators
        tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
        for split_k in (1, 2, 4):
            if split_k > 1 and (k // split_k < 512 or block_m * cols > 128 * 128):
                break  # (the split reduction on a 128x256 accumulator spills registers: compile_check)
            eff = tile_efficiency.get((block_m, cols), 1.0) * _wave_efficiency(tiles * split_k, num_sms)
            t = flop_time / eff
            if split_k > 1:
                t += 2 * split_k * m * n * (2 if gated else 1) * 4 / L2_BYTES_PER_S + 0.3e-6
            if best is None or t < best[0] * 0.97:
                best = (t, block_m, block_n, split_k)
    _, block_m, block_n, split_k = best
    block_k = 64 if elem_bytes <= 2 else 32
    acc_cols = block_n * (2 if gated else 1)
    num_warps = 8 if block_m * acc_cols >= 128 * 128 else 4
    stages = _stages_that_fit(block_m, block_n, block_k, gated, elem_bytes, most=4)
    return GemmConfig(block_m, block_n, block_k, split_k, group_m=8, num_warps=num_warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------- attention


def attention_key(b: int, tq: int, tk: int, hq: int, hkv: int, d: int) -> str:
    return f"b{b}:{tq}x{tk}:h{hq}/{hkv}:d{d}"


def heads_per_program(hq: int, hkv: int, most: int = 16) -> int:
    """Largest power of two that divides the GQA group size (query heads per KV head), at most `most`."""
    group = hq // hkv
    hpp = 1
    while hpp * 2 <= most and group % (hpp * 2) == 0:
        hpp *= 2
    return hpp


def attention_config(
    b: int, tq: int, tk: int, hq: int, hkv: int, d: int, *, dtype: torch.dtype, device: torch.device
) -> AttentionConfig:
    device = torch.device(device)
    if device.type != "cuda":
        hpp = heads_per_program(hq, hkv, most=4)
        return AttentionConfig(block_m=max(16, min(64, _next_pow2(tq * hpp))), block_n=32, heads_per_program=hpp)
    return _attention_config_cuda(b, tq, tk, hq, hkv, d, dtype, gpu_name(device), _num_sms(device))


@functools.lru_cache(maxsize=1024)
def _attention_config_cuda(b, tq, tk, hq, hkv, d, dtype, gpu, num_sms) -> AttentionConfig:
    entries = load_table(gpu).get("attention", {}).get(_dtype_name(dtype), {})
    entry = entries.get(attention_key(b, tq, tk, hq, hkv, d))
    if entry is not None:
        return AttentionConfig.from_dict(entry)
    return attention_heuristic(b, tq, tk, hq, hkv, d, num_sms=num_sms)


def attention_heuristic(b: int, tq: int, tk: int, hq: int, hkv: int, d: int, *, num_sms: int = 132) -> AttentionConfig:
    """GQA heads packed into the row block so K/V tiles load once per program; split the keys until the grid
    roughly fills the SMs (flash-decoding), which matters for the action expert's 64-query blocks."""
    block_d = max(16, _next_pow2(d))
    hpp = heads_per_program(hq, hkv)
    block_m = max(16, min(64, _next_pow2(tq * hpp)))  # 128 rows spill registers in the split merge (compile_check)
    block_m = max(block_m, hpp)
    programs = math.ceil(tq * hpp / block_m) * b * (hq // hpp)
    for block_n in (64, 32):  # narrower key tiles only to allow more splits
        key_tiles = math.ceil(tk / block_n)
        splits = 1
        while splits * 2 <= key_tiles and programs * splits * 2 <= num_sms * 1.25:
            splits *= 2
        if programs * splits >= num_sms // 2:
            break
    num_warps = 8 if block_m * block_d >= 64 * 128 else 4
    return AttentionConfig(block_m, block_n, hpp, splits, num_warps=num_warps, num_stages=2)
