"""Attention launch configs: the per-GPU table's `attention` entries, with a cost-model heuristic for keys not in
it (the table format and the GEMM side: `launch_configs`).

Attention keys are exact: `b{B}:{Tq}x{Tk}:h{Hq}/{Hkv}:d{D}`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .launch_configs import (
    KERNEL_FLOOR_US,
    LOAD_LATENCY_S,
    PEAK_FLOPS,
    SM_PEAK_BYTES_PER_S,
    SMEM_BYTES,
    _dtype_name,
    _next_pow2,
    _num_sms,
    _resident_programs,
    _split_cost_us,
    gpu_name,
    load_table,
)

__all__ = [
    "AttentionConfig",
    "attention_config",
    "attention_cost_us",
    "attention_heuristic",
    "attention_key",
    "attention_space",
    "heads_per_program",
]


@dataclass(frozen=True)
class AttentionConfig:
    """`block_m` rows of (query position, head) pairs: `heads_per_program` heads sharing one KV head."""

    block_m: int
    block_n: int
    heads_per_program: int = 1
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    combine: int = 0  # split-KV merge: 0 = the last program of a row block merges, 1 = a separate combine kernel
    tma: int = 0  # 1: Q / K / V by TMA in 64-wide head-dim chunks, Q kept in shared memory (`attention_tma`)

    @classmethod
    def from_dict(cls, d: dict) -> AttentionConfig:
        return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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


NEIGHBOUR_QUERIES = 16  # a tabled shape this close in queries (and with as many key tiles) serves an untabled one


@functools.lru_cache(maxsize=1024)
def _attention_config_cuda(b, tq, tk, hq, hkv, d, dtype, gpu, num_sms) -> AttentionConfig:
    entries = load_table(gpu).get("attention", {}).get(_dtype_name(dtype), {})
    entry = entries.get(attention_key(b, tq, tk, hq, hkv, d)) or _neighbour_entry(entries, b, tq, tk, hq, hkv, d)
    if entry is not None:
        return AttentionConfig.from_dict(entry)
    return attention_heuristic(b, tq, tk, hq, hkv, d, num_sms=num_sms)


def _neighbour_entry(entries: dict, b: int, tq: int, tk: int, hq: int, hkv: int, d: int) -> dict | None:
    """The tabled entry of the same batch, heads and head size nearest to (tq, tk), within NEIGHBOUR_QUERIES queries
    and over the same number of its key tiles (so its key splits divide the keys as they were tuned), else None.

    Why: π0.5's suffix has no state token, so its expert attention is one query and one key short of π0's tuned
    shapes (63 x 319 against 64 x 320 at 1 view, 50 x 582 against 51 x 583 in the server) and fell to the
    heuristic, whose configs for those shapes are up to 2x slower on the H200 (docs/kernels.md, 32 rows)."""
    best, best_distance = None, None
    for key, entry in entries.items():
        parts = _parse_key(key)
        if parts is None or (parts[0], *parts[3:]) != (b, hq, hkv, d):
            continue
        tq_e, tk_e = parts[1], parts[2]
        block_n = entry.get("block_n", 0)
        if abs(tq_e - tq) > NEIGHBOUR_QUERIES or block_n <= 0 or -(-tk // block_n) != -(-tk_e // block_n):
            continue
        distance = (abs(tq_e - tq), abs(tk_e - tk), key)
        if best_distance is None or distance < best_distance:
            best, best_distance = entry, distance
    return best


def _parse_key(key: str) -> tuple[int, int, int, int, int, int] | None:
    """`attention_key`'s fields (b, tq, tk, hq, hkv, d), or None for another key."""
    try:
        b, shape, heads, d = key.split(":")
        tq, tk = shape.split("x")
        hq, hkv = heads.removeprefix("h").split("/")
        return int(b.removeprefix("b")), int(tq), int(tk), int(hq), int(hkv), int(d.removeprefix("d"))
    except ValueError:
        return None


def attention_space(
    b: int, tq: int, tk: int, hq: int, hkv: int, d: int, *, elem_bytes: int = 2
) -> list[AttentionConfig]:
    """Launch configs worth considering: GQA packing 1..max, 16..128-row blocks, 32..128-key tiles, 1..16 key splits
    (powers of two and one or two key tiles a split; each split at least one key tile) with either merge, 4 or 8 warps,
    1..3 stages within shared memory (the TMA kernel 1..4: at the server's 8 robots its 2-stage loop issues the next
    key tile's loads only after the current tile's P·V, so each tile waits out an L2 round trip; a deeper ring keeps
    loads in flight, and 128 rows x 32 keys x 4 stages fits, 239 registers, compile_check with Triton 3.9)."""
    block_d = max(16, _next_pow2(d))
    hpp_max = heads_per_program(hq, hkv)
    out = []
    for hpp in (1, 2, 4, 8, 16):
        if hpp > hpp_max:
            break
        for block_m in (16, 32, 64, 128):
            if block_m % hpp or block_m > max(16, _next_pow2(tq * hpp)):
                continue
            for block_n in (32, 64, 128):
                tiles = math.ceil(tk / block_n)
                # powers of two, and the counts that give every split the same whole number of key tiles (with a
                # power of two, 320 keys in 64-key tiles split 4 ways leave one split empty, two with two tiles)
                for splits in sorted({1, 2, 4, 8, 16, tiles, math.ceil(tiles / 2)}):
                    if splits > min(tiles, 16):
                        break
                    for combine in (0, 1) if splits > 1 else (0,):
                        for warps in (4, 8):
                            for stages in (1, 2, 3, 4):
                                c = AttentionConfig(block_m, block_n, hpp, splits, warps, stages, combine)
                                if stages <= 3 and _attention_fits(c, block_d, elem_bytes):
                                    out.append(c)
                                t = dataclasses.replace(c, tma=1)
                                if (
                                    -(-d // 64) * 64 == block_d
                                    and block_d <= 256
                                    and combine == int(splits > 1)
                                    and _tma_fits(t, block_d, elem_bytes)
                                ):
                                    out.append(t)
    return out


def _tma_fits(c: AttentionConfig, d: int, elem_bytes: int) -> bool:
    """The TMA kernel keeps Q in shared memory beside `num_stages` K and V tiles; its registers hold O and the
    logits. Rows come 64 a warpgroup (wgmma's M)."""
    smem = (c.block_m * d + 2 * c.block_n * d * max(1, c.num_stages)) * elem_bytes
    regs = (c.block_m * d + c.block_m * c.block_n) / (32 * c.num_warps)
    return smem <= SMEM_BYTES and regs <= 160 and c.block_m >= 64 and c.block_m // 64 * 4 <= c.num_warps


def _attention_fits(c: AttentionConfig, block_d: int, elem_bytes: int) -> bool:
    smem = (c.block_m * block_d + 2 * c.block_n * block_d * max(1, c.num_stages)) * elem_bytes
    acc_regs = (c.block_m * block_d + c.block_m * c.block_n) / (32 * c.num_warps)  # O and the logits, fp32
    if smem > SMEM_BYTES or acc_regs > 128:
        return False
    if c.num_splits > 1 and c.combine == 0 and acc_regs > (80 if c.num_warps >= 8 else 64):
        return False  # the in-kernel merge reloads a tile: 128-row / 4-warp 32x64 blocks spilled in compile_check
    return c.block_m * c.block_n >= 16 * 16 * c.num_warps


def attention_cost_us(b: int, tq: int, tk: int, hq: int, hkv: int, d: int, c: AttentionConfig, *, elem_bytes: int = 2,
                      num_sms: int = 132) -> float:  # fmt: skip
    """Modelled in-graph µs of `attention` with config `c`: the busiest SM streams its Q, K/V (and partials) at its
    in-flight rate, pays a dependent latency per key tile, computes at an MMA rate; then the split merge."""
    block_d = max(16, _next_pow2(d))
    group = hq // hkv
    q_tiles = math.ceil(tq / (c.block_m // c.heads_per_program))
    tiles = q_tiles * b * hkv * (group // c.heads_per_program)
    programs = tiles * c.num_splits
    keys = math.ceil(math.ceil(tk / c.num_splits) / c.block_n) * c.block_n  # keys of one split
    iters = keys // c.block_n
    prog_bytes = (c.block_m * d + 2 * min(keys, tk) * d) * elem_bytes
    prog_bytes += c.block_m * block_d * 4 if c.num_splits > 1 else 0
    smem = (c.block_m * block_d + 2 * c.block_n * block_d * max(1, c.num_stages)) * elem_bytes
    resident = _resident_programs(smem, (c.block_m * block_d + c.block_m * c.block_n) / (32 * c.num_warps), c.num_warps)
    per_sm = math.ceil(programs / num_sms)
    inflight = (
        min(per_sm, resident) * 2 * c.block_n * d * elem_bytes * max(1, c.num_stages - 1 if c.num_stages > 1 else 1)
    )
    rate = min(SM_PEAK_BYTES_PER_S, inflight / LOAD_LATENCY_S)
    mma_rate = PEAK_FLOPS / num_sms * (0.5 if c.block_m >= 64 else 0.25)  # wgmma needs 64-row tiles
    flops = 4 * c.block_m * keys * block_d
    latency = iters * 0.3e-6 * (1.0 if c.num_stages > 1 else 1.5)  # softmax chain per key tile
    body = per_sm * max(prog_bytes / rate, flops / mma_rate) + math.ceil(per_sm / resident) * latency
    tile_bytes = c.block_m * block_d * 4
    split_us = _split_cost_us(c.num_splits, c.combine, tile_bytes, programs * tile_bytes)
    # Unmodelled, as tie-breaks: packed GQA heads share K/V tiles in L1; two stages are the tested default.
    tie = 0.02 * (math.log2(heads_per_program(hq, hkv)) - math.log2(c.heads_per_program)) + 0.01 * abs(c.num_stages - 2)
    return KERNEL_FLOOR_US + body * 1e6 + split_us + tie


def attention_heuristic(b: int, tq: int, tk: int, hq: int, hkv: int, d: int, *, num_sms: int = 132) -> AttentionConfig:
    """The cheapest config of `attention_space` under `attention_cost_us` (2 stages; GQA heads packed as far as the
    model is indifferent, so K/V tiles load once for all of them); `tune` replaces it with measurements.
    The first H200 run taught it: few splits on short key ranges, small row blocks for the action expert (a merge
    of 8 splits x 64 rows x 256 fp32 on one SM cost more than the attention itself)."""
    return _attention_heuristic(b, tq, tk, hq, hkv, d, num_sms)


@functools.lru_cache(maxsize=1024)
def _attention_heuristic(b, tq, tk, hq, hkv, d, num_sms) -> AttentionConfig:
    best = None
    block_d = max(16, _next_pow2(d))
    for c in attention_space(b, tq, tk, hq, hkv, d):
        if c.num_stages != 2 or (c.block_m * block_d + c.block_m * c.block_n) / (32 * c.num_warps) > 80:
            continue  # (more accumulator registers a thread than that spilled or hit 255 in compile_check)
        if c.num_splits & (c.num_splits - 1) or c.tma:
            continue  # whole-tile split counts and the TMA kernel are for `tune` to measure; the model has not been
            # checked on them
        t = attention_cost_us(b, tq, tk, hq, hkv, d, c, num_sms=num_sms)
        t *= 1.0 if c.combine == 0 else 1.05  # prefer one launch on near ties
        if best is None or t < best[0] - 1e-9:
            best = (t, c)
    return best[1]
