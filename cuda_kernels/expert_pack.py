"""Weights as the kernel streams them: per CTA, its GEMM units' tiles in the order it runs them, in 8 KB pages.

A page is 64 weight rows x 64 k of bf16 laid out exactly as wgmma reads a K-major operand with the 128-byte
swizzle: row r's 16-byte unit u sits at unit u ^ (r % 8) of its 128-byte row. Copied unchanged into a 1024-byte
aligned shared-memory slot, it is a valid wgmma B operand, so the weight loader is one bulk copy per page and
never touches a tensor map. Which 64 rows a unit's page holds:

- QK (RoPE) units pair rotation partners: rows [i0, i0+16) of a head's first half, the same of its second half,
  then [i0+16, i0+32) of each; so each consumer warpgroup's 32 columns hold both partners of 16 dims.
- gate/up units interleave the same way: gate rows [32j, 32j+16), up rows, gate [32j+16, 32j+32), up.
- everything else: 64 consecutive output rows (the action projection's 32 rows padded with zeros).

The activation images (x, h, attention output, the embedding) use the same per-tile swizzle: `image_offset`.
"""

from __future__ import annotations

import torch

from vla_rt.cuda_kernels.expert_dims import TILE, ExpertDims
from vla_rt.cuda_kernels.expert_schedule import (
    F_A,
    F_K0,
    F_LAYER,
    F_N,
    F_NK,
    GEMM_OPS,
    OP_ACTION,
    OP_DOWN,
    OP_GATE_UP,
    OP_MLP_OUT,
    OP_O,
    OP_QK,
    OP_V,
    Schedule,
)  # fmt: skip


def swizzle_128b(tiles: torch.Tensor) -> torch.Tensor:
    """(..., 64, 64) -> the same tiles with each row's eight 16-byte units permuted u -> u ^ (row % 8). Its own
    inverse."""
    *lead, rows, cols = tiles.shape
    units = tiles.reshape(*lead, rows, cols // 8, 8)
    r = torch.arange(rows, device=tiles.device)[:, None]
    src = torch.arange(cols // 8, device=tiles.device)[None, :] ^ (r % 8)
    return units[..., r, src, :].reshape(tiles.shape)


def image_offset(row, col, m_tiles: int):
    """Element offset of (row, col) in an activation image: tiles [col // 64][row // 64] of 64 x 64, swizzled."""
    r, u = row % TILE, (col % TILE) // 8
    return ((col // TILE) * m_tiles + row // TILE) * TILE * TILE + r * TILE + ((u ^ (r % 8)) * 8) + col % 8


def unit_rows(op: int, fields, d: ExpertDims) -> tuple[list[int], int]:
    """The 64 weight rows a GEMM unit's pages hold (-1: a zero row) and the first k of its K range."""
    n, k0 = int(fields[F_N]), int(fields[F_K0]) * TILE
    r16 = list(range(16))
    if op == OP_QK:
        base = n * d.head_dim
        half, i0 = d.head_dim // 2, int(fields[F_A])
        rows = [base + i0 + r for r in r16] + [base + half + i0 + r for r in r16]
        return rows + [base + i0 + 16 + r for r in r16] + [base + half + i0 + 16 + r for r in r16], k0
    if op == OP_V:
        return [d.q_width + d.head_dim + n * TILE + r for r in range(TILE)], k0
    if op == OP_GATE_UP:
        g = 32 * n
        rows = [g + r for r in r16] + [d.mlp + g + r for r in r16]
        return rows + [g + 16 + r for r in r16] + [d.mlp + g + 16 + r for r in r16], k0
    if op in (OP_O, OP_DOWN, OP_MLP_OUT):
        return [n * TILE + r for r in range(TILE)], k0
    if op == OP_ACTION:
        return [r if r < d.action_dim else -1 for r in range(TILE)], k0
    raise ValueError(f"op {op} has no weights")


def unit_matrix(op: int, fields, weights) -> torch.Tensor:
    """The (N, K) weight a GEMM unit reads, from `EngineWeights`."""
    if op == OP_MLP_OUT:
        return weights.suffix.mlp_out
    if op == OP_ACTION:
        return weights.suffix.action_out
    layer = weights.expert[int(fields[F_LAYER])]
    return {OP_QK: layer.qkv, OP_V: layer.qkv, OP_O: layer.o, OP_GATE_UP: layer.gate_up, OP_DOWN: layer.down}[op]


def pack_weights(schedule: Schedule, weights, device=None) -> torch.Tensor:
    """Every CTA's weight pages, CTA after CTA, as one (pages, 64, 64) bf16 tensor (the kernel's weight stream)."""
    d = schedule.dims
    tables = schedule.tables()
    total = int(tables["cta_page"][-1])
    device = device or weights.expert[0].qkv.device
    out = torch.empty(total, TILE, TILE, dtype=torch.bfloat16, device=device)
    groups: dict[tuple[int, int], list[tuple[int, list[int], int, int]]] = {}
    page = 0
    for units in schedule.per_cta:
        for u in units:
            if u.op not in GEMM_OPS:
                continue
            f = u.row()
            rows, k0 = unit_rows(u.op, f, d)
            key = (u.op, int(f[F_LAYER]) if u.op not in (OP_MLP_OUT, OP_ACTION) else 0)
            groups.setdefault(key, []).append((page, rows, k0, int(f[F_NK])))
            page += int(f[F_NK])
    for (op, layer), items in groups.items():
        f = torch.zeros(16, dtype=torch.int32)
        f[F_LAYER] = layer
        w = unit_matrix(op, f, weights).to(device=device, dtype=torch.bfloat16)
        w = torch.cat([w, torch.zeros(1, w.shape[1], dtype=w.dtype, device=device)])  # row -1: zeros
        nk = items[0][3]
        rows = torch.tensor([it[1] for it in items], device=device)  # (units, 64)
        k0s = torch.tensor([it[2] for it in items], device=device)
        k_idx = k0s[:, None] + torch.arange(nk * TILE, device=device)[None, :]  # (units, nk * 64)
        tiles = w[rows[:, :, None], k_idx[:, None, :]]  # (units, 64, nk * 64)
        tiles = tiles.reshape(len(items), TILE, nk, TILE).permute(0, 2, 1, 3)  # (units, nk, 64, 64)
        pages = torch.tensor([it[0] for it in items], device=device)[:, None] + torch.arange(nk, device=device)
        out[pages.reshape(-1)] = swizzle_128b(tiles.reshape(-1, TILE, TILE))
    return out


def unpack_unit(stream: torch.Tensor, page: int, nk: int) -> torch.Tensor:
    """The (64, nk * 64) weight tile of a unit whose pages start at `page` (what the kernel's MMAs see)."""
    tiles = swizzle_128b(stream[page : page + nk].float())
    return tiles.permute(1, 0, 2).reshape(TILE, nk * TILE)
