"""Launch configurations as data: per-GPU JSON tables, with heuristics for shapes not in a table.

A table lives at `configs/<gpu-name>.json` (the name from `torch.cuda.get_device_name`, spaces as '-') and looks
like::

    {"gpu": "NVIDIA H200", "source": "...",
     "gemm":      {"bfloat16": {"64x2560x1024:rope": {"block_m": 64, ...}, "64x4096x1024:gated": {...}}},
     "attention": {"bfloat16": {"b1:64x880:h8/1:d256": {"block_m": 64, ...}}}}

GEMM keys are `MxNxK` (N = output columns, K = reduction length) plus `:gated` / `:rope`; a lookup takes the exact
M, else the smallest tabled M above it with the same N, K and flags (a config for 64 rows serves 51; a skinny M takes a wide entry only up to 4M), else the
cost-model heuristic here. Attention entries and their heuristic are `attention_configs`. The tuner
(`vla_rt.triton_kernels.tuning`) measures candidates and writes these tables; on a machine without CUDA the lookup
returns interpreter-friendly defaults.
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
    "GemmConfig",
    "dump_table",
    "gemm_config",
    "gemm_key",
    "gpu_name",
    "load_table",
    "table_path",
    "tile_columns",
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
    combine: int = 0  # split-K reduction: 0 = the last program of a tile sums, 1 = a separate combine kernel
    tma: int = 0  # 0 = pointer loads (gemm_pointer.py); 1..3 = TMA descriptors, 4 = stream-K, gemm_tma.TMA_MODES

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.tma:  # tables written before the TMA kernel stay as they were
            del d["tma"]
        return d


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


def gemm_key(m: int, n: int, k: int, gated: bool, *, rope: bool = False) -> str:
    """`MxNxK` plus `:gated`, and `:rope` for the RoPE epilogue into the KV cache (N is still the output columns, a
    tile's block_n counts (head, i) pairs)."""
    return f"{m}x{n}x{k}" + (":gated" if gated else "") + (":rope" if rope else "")


def tile_columns(n: int, gated: bool = False, rope: bool = False) -> tuple[int, bool]:
    """(columns a launch tiles, paired): a gated GEMM tiles its N outputs with two weight rows a column, a RoPE
    GEMM its N/2 (head, i) pairs with two weight rows (h*D + i, h*D + D/2 + i) a column; configs, cost models and
    candidate spaces of a paired GEMM are those of a gated one with that many columns."""
    return (n // 2 if rope else n), gated or rope


def gemm_config(
    m: int, n: int, k: int, *, gated: bool, dtype: torch.dtype, device: torch.device, rope: bool = False
) -> GemmConfig:
    """Launch config for an (M, K) x (K, N) GEMM (N output columns; a gated GEMM reads 2N weight rows; `rope`: the
    RoPE epilogue, see `gemm_key`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _interpreter_gemm_config(m, tile_columns(n, gated, rope)[0], k)
    return _gemm_config_cuda(m, n, k, gated, dtype, gpu_name(device), _num_sms(device), rope)


SKINNY_M = 128  # gemm_space's boundary: up to this many rows a GEMM streams weights, above it is compute-bound


def _table_lookup(entries: dict, m: int, suffix: str) -> dict | None:
    """The entry with the smallest tabled M >= m and this `xNxK[:flags]` suffix, except that a skinny M (<= 128,
    the weight-streaming configs of `gemm_space`) takes a wide entry (> 128 rows, compute-bound tiles) only up to
    4m: the H100 table, tuned at the server's 408 and 1632 expert rows only, made the 51-row step 0.89 -> 1.12 ms
    through 408's entries. (No lookup of the H200 table's π0 shapes changes: it has skinny entries.)"""
    best_m = None
    for key in entries:
        head, _, rest = key.partition("x")
        if "x" + rest != suffix or not head.isdigit() or int(head) < m:
            continue
        if m <= SKINNY_M < int(head) and int(head) > 4 * m:
            continue
        if best_m is None or int(head) < best_m:
            best_m = int(head)
    return None if best_m is None else entries[f"{best_m}{suffix}"]


@functools.lru_cache(maxsize=4096)
def _gemm_config_cuda(m, n, k, gated, dtype, gpu, num_sms, rope=False) -> GemmConfig:
    entries = load_table(gpu).get("gemm", {}).get(_dtype_name(dtype), {})
    elem = torch.tensor([], dtype=dtype).element_size()

    def suffix(rope_: bool) -> str:
        return gemm_key(m, n, k, gated, rope=rope_).removeprefix(str(m))

    found = _table_lookup(entries, m, suffix(rope))
    if found is not None:
        return GemmConfig.from_dict(found)
    n_cols, paired = tile_columns(n, gated, rope)
    if rope and (plain := _table_lookup(entries, m, suffix(False))) is not None:
        # A RoPE tile of block_n pairs reads 2 * block_n weight rows: halve the plain entry's tile width, so each
        # program streams the same weight rows it was tuned for.
        c = GemmConfig.from_dict(plain)
        block_n = max(16, c.block_n // 2)
        stages = _stages_that_fit(c.block_m, block_n, c.block_k, True, elem, c.num_stages)
        return dataclasses.replace(c, block_n=block_n, num_stages=stages)
    return gemm_heuristic(m, n_cols, k, gated=paired, elem_bytes=elem, num_sms=num_sms)


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


# Cost-model constants, calibrated on the first H200 run (untuned table, µs per kernel inside a CUDA Graph;
# benchmarks/results/kernels_untuned_NVIDIA-H200.json). The skinny GEMM model reproduces its seven expert GEMMs
# within ~15%: a kernel costs a floor, then its busiest SM streams its bytes at (bytes in flight) / latency, and a
# split reduction costs either a serial merge on one SM or a second kernel.
KERNEL_FLOOR_US = 2.0  # an in-graph kernel that does almost nothing (action_in 64x1024x32: 2.06 µs)
LOAD_LATENCY_S = 1.5e-6  # loaded global-memory latency: an SM streams (bytes in flight) / latency (qkv: 64 GB/s)
SM_PEAK_BYTES_PER_S = 150e9  # what one SM pulls from L2 at most
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 65536
MERGE_FIXED_US = 1.5  # last-program merge: barrier, acq_rel atomic, epilogue after a dependent wait
MERGE_SPLIT_US = 0.25  # ... plus one dependent L2 round trip per split (the loop is not pipelined)
COMBINE_FIXED_US = 2.0  # a second kernel: the in-graph launch gap plus its own latency
WIDE_CODEGEN_EFFICIENCY = 0.75  # measured: our wide tiles reach ~0.75 of the FLOP model (no TMA / warp spec.)
# Wide GEMMs: how much faster each TMA mode's best candidate was than the best pointer-kernel candidate, median over
# the 256..788-row shapes of the TMA tune log (benchmarks/results/tune_log_tma_NVIDIA-H200.json at commit 7a07014;
# ranges 0.5-2.2x: it ranks, the tuner decides). Skinny GEMMs are modelled by bytes in flight, where TMA made no median difference (0.94x)
# 4: stream-K, calibrated on its first tune (H100, docs/runs/tune_2026-12-06_d4f527a_NVIDIA-H100.json): it won the two
# long-K shapes and ran 1.3-2x the best mode elsewhere; at 1.05 it filled half of the quick candidates everywhere
TMA_EFFICIENCY = {0: 1.0, 1: 1.155, 2: 1.127, 3: 1.15, 4: 0.9}


def gemm_space(m: int, n: int, k: int, *, gated: bool, elem_bytes: int = 2) -> list[GemmConfig]:
    """Every launch config worth considering for this GEMM (valid: fits shared memory and registers).
    Skinny (M <= 128): BLOCK_N 16..128, BLOCK_K 64..256, split-K 1..16 with either reduction, 3..6 stages, 2..8
    warps, also with TMA loads (modes 1, 2: split-K through the combine kernel). Wide: 64/128/256-row tiles up to
    128x256, BLOCK_K 64/128, split-K 1..4, 3..5 stages, also in the TMA modes 1..3 (split-K through the combine
    kernel)."""
    rows = 2 if gated else 1
    out = []
    if m <= 128:
        block_m = 64 if m > 32 else max(16, _next_pow2(m))
        for block_n in (16, 32, 64, 128):
            if block_n > max(16, _next_pow2(n)):
                continue
            for block_k in (64, 128, 256) if k >= 64 else (max(16, _next_pow2(k)),):
                if block_k > max(64, _next_pow2(k)):
                    continue
                for split_k in (1, 2, 4, 8, 16):
                    if split_k > 1 and k // split_k < block_k:
                        break
                    for combine in (0, 1) if split_k > 1 else (0,):
                        for warps in (2, 4, 8):
                            for stages in (3, 4, 5, 6):
                                out.append(GemmConfig(block_m, block_n, block_k, split_k, 1, warps, stages, combine))
                                if split_k == 1 or combine == 1:  # TMA loads: one tile a program, or persistent
                                    out += [GemmConfig(block_m, block_n, block_k, split_k, 1, warps, stages, combine,
                                                       tma) for tma in (1, 2)]  # fmt: skip
    else:
        tiles = (
            (128, 256, 8),
            (128, 128, 8),
            (128, 128, 4),
            (64, 256, 8),
            (128, 64, 4),
            (64, 128, 4),
            (64, 128, 8),
            (256, 128, 8),
        )
        for block_m, block_n, warps in tiles:
            for block_k in (64, 128):
                for split_k in (1, 2, 4):
                    if split_k > 1 and k // split_k < 512:
                        break
                    for combine in (0, 1) if split_k > 1 else (0,):
                        for stages in (3, 4, 5):
                            out.append(GemmConfig(block_m, block_n, block_k, split_k, 8, warps, stages, combine))
                            if split_k == 1 or combine == 1:  # the TMA kernel's modes (gemm_tma.TMA_MODES)
                                modes = (1, 2, 3, 4) if split_k == 1 else (1, 2, 3)  # 4: stream-K, no split-K
                                out += [GemmConfig(block_m, block_n, block_k, split_k, 8, warps, stages, combine, tma)
                                        for tma in modes]  # fmt: skip
    return [c for c in out if _gemm_fits(c, rows, elem_bytes)]


def _gemm_fits(c: GemmConfig, rows: int, elem_bytes: int) -> bool:
    acc = c.block_m * c.block_n * rows  # fp32 accumulators, held in registers
    if (c.block_m + c.block_n * rows) * c.block_k * elem_bytes * c.num_stages > SMEM_BYTES or acc > 128 * 256:
        return False
    if acc / (32 * c.num_warps) > 128:  # more than 128 accumulator registers a thread spills
        return False
    if c.split_k > 1 and c.combine == 0 and acc > 128 * 128:  # the last program's in-kernel merge holds a partial
        return False  # beside the accumulators: spills (compile_check)
    return c.block_m * c.block_n >= 32 * 32 * c.num_warps // 4  # at least a 16x16 MMA tile per warp


def _resident_programs(smem: int, acc_regs_per_thread: float, num_warps: int) -> int:
    regs = min(255, acc_regs_per_thread + 40) * 32 * num_warps
    return max(1, min(SMEM_PER_SM // max(1, smem), REGS_PER_SM // regs, 16))


def _split_cost_us(split: int, combine: int, tile_bytes: int, total_partial_bytes: int) -> float:
    """The reduction of `split` fp32 partials: a serial merge of `tile_bytes` a split on one SM, or a kernel."""
    if split == 1:
        return 0.0
    if combine:
        return COMBINE_FIXED_US + total_partial_bytes / L2_BYTES_PER_S * 1e6
    per_split = max(MERGE_SPLIT_US, tile_bytes / SM_PEAK_BYTES_PER_S * 1e6)
    return MERGE_FIXED_US + split * per_split


def gemm_cost_us(
    m: int, n: int, k: int, gated: bool, c: GemmConfig, *, elem_bytes: int = 2, num_sms: int = 132
) -> float:
    """Modelled in-graph µs of `gemm` with config `c` (what `gemm_heuristic` minimises and `tune` ranks by)."""
    rows = 2 if gated else 1
    tiles = math.ceil(m / c.block_m) * math.ceil(n / c.block_n)
    programs = tiles * c.split_k
    acc = c.block_m * c.block_n * rows
    split = c.split_k
    partial_bytes = split * m * n * rows * 4 if split > 1 else 0
    split_us = _split_cost_us(split, c.combine, acc * 4, partial_bytes)
    stage_bytes = (c.block_m + c.block_n * rows) * c.block_k * elem_bytes
    resident = _resident_programs(stage_bytes * c.num_stages, acc / (32 * c.num_warps), c.num_warps)
    if m <= 128:
        # Weight streaming: the busiest SM's bytes at its in-flight rate, or the whole GPU's HBM / L2 traffic.
        k_split = math.ceil(k / (split * c.block_k)) * c.block_k
        prog_bytes = (c.block_m + c.block_n * rows) * min(k_split, k) * elem_bytes + (acc * 4 if split > 1 else 0)
        per_sm = math.ceil(programs / num_sms)
        inflight = min(per_sm, resident) * stage_bytes * (c.num_stages - 1)
        rate = min(SM_PEAK_BYTES_PER_S, inflight / LOAD_LATENCY_S)
        w_bytes = n * rows * k * elem_bytes
        l2_bytes = m * k * elem_bytes * math.ceil(n / c.block_n) + 2 * partial_bytes
        body = max(per_sm * prog_bytes / rate, w_bytes / HBM_BYTES_PER_S + l2_bytes / L2_BYTES_PER_S)
        tie = 0.02 * abs(math.log2(c.num_warps / 4)) + 0.01 * abs(c.num_stages - 4)  # unmodelled: prefer defaults
        return KERNEL_FLOOR_US + body * 1e6 + split_us + tie
    # Compute-bound: FLOPs at the wgmma tile's efficiency and the grid's wave efficiency.
    tile_efficiency = {(128, 256): 1.0, (256, 128): 1.0, (128, 128): 0.92, (64, 256): 0.85, (128, 64): 0.78,
                       (64, 128): 0.72, (64, 64): 0.6}  # fmt: skip
    eff = tile_efficiency.get((c.block_m, c.block_n * rows), 1.0 if acc >= 128 * 256 else 0.6)
    if c.tma == 4:  # stream-K: the last round's K spread over every SM, its shared tiles' partials through L2
        waves = 1.0
        sk_tiles = programs % num_sms if programs >= num_sms else programs
        partial_bytes = (num_sms + sk_tiles) * acc * 4 if sk_tiles else 0
    elif c.tma >= 2:  # persistent, one program an SM: the last round can be partly empty
        waves = _wave_efficiency(programs, num_sms)
    else:
        waves = _wave_efficiency(programs, num_sms * min(resident, 2))
    eff *= waves * WIDE_CODEGEN_EFFICIENCY * TMA_EFFICIENCY.get(c.tma, 1.0)
    eff *= {3: 0.95, 4: 1.0}.get(c.num_stages, 0.97) * (1.0 if c.block_k == 64 else 0.97)
    if acc >= 128 * 128 and c.num_warps < 8:
        eff *= 0.8
    flops = 2 * m * n * rows * k
    return KERNEL_FLOOR_US + flops / (PEAK_FLOPS * eff) * 1e6 + split_us + 2 * partial_bytes / L2_BYTES_PER_S * 1e6


def gemm_heuristic(m: int, n: int, k: int, *, gated: bool, elem_bytes: int = 2, num_sms: int = 132) -> GemmConfig:
    """The cheapest config of `gemm_space` under `gemm_cost_us`, among conservative ones (pointer loads, 4 or 8
    warps, at most 4 stages, BLOCK_K 64 and at most 128-row tiles when wide, the in-kernel reduction unless a second
    kernel is clearly cheaper); `tune` replaces it with measurements."""
    return _gemm_heuristic(m, n, k, gated, elem_bytes, num_sms)


@functools.lru_cache(maxsize=1024)
def _gemm_heuristic(m, n, k, gated, elem_bytes, num_sms) -> GemmConfig:
    best = None
    for c in gemm_space(m, n, k, gated=gated, elem_bytes=elem_bytes):
        if c.tma or c.num_warps == 2 or c.num_stages > 4 or (m > 128 and (c.block_k != 64 or c.block_m > 128)):
            continue
        t = gemm_cost_us(m, n, k, gated, c, elem_bytes=elem_bytes, num_sms=num_sms)
        t *= 1.0 if c.combine == 0 else 1.05  # prefer one launch on near ties
        if best is None or t < best[0] - 1e-9:
            best = (t, c)
    if best is None:  # tiny K or N: the one config the interpreter uses, with stages that fit
        return _interpreter_gemm_config(m, n, k)
    return best[1]
