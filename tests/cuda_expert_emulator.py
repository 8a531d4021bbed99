"""A torch emulator of `expert_step.cu`'s arithmetic: the same units from the same schedule, weights read back
from the packed page stream, activations through the same image / Q-fragment index maps, split-K merged in split
order, attention split over keys with the kernel's exp2-domain online softmax and merged like `merge`, bf16
rounding where the kernel rounds. π0.5: the action tokens from action_in_proj, x (1 + s) images as the normed GEMMs'
inputs, the modulation row's biases and gates in the epilogues, and the float32 action table. Compared with the
per-op step it catches layout and decomposition bugs on the CPU.
Within a stage, units run in a random order (as CTAs would finish), so split-K's last arriver varies."""

from __future__ import annotations

import math
import random

import torch

from vla_rt.cuda_kernels.expert_dims import KEY_ITEM, ROW_GROUP, TILE
from vla_rt.cuda_kernels.expert_pack import image_offset, unpack_unit
from vla_rt.cuda_kernels.expert_schedule import (
    F_A,
    F_B,
    F_C,
    F_K0,
    F_N,
    F_NK,
    F_SPLIT,
    GEMM_OPS,
    OP_ACTION,
    OP_ACTION_ROWS,
    OP_ATTN,
    OP_DOWN,
    OP_EMBED,
    OP_GATE_UP,
    OP_MERGE,
    OP_MLP_OUT,
    OP_O,
    OP_QK,
    OP_V,
)  # fmt: skip
from vla_rt.engine.weights import PI05_LAYER_TABLES  # noqa: F401  (the row's layout, for the tests)


def q_frag_index(b, h, t, d, heads):
    """expert_step.cu's q_frag_offset (elementwise on tensors)."""
    w, r16, kk, d16 = t // 16, t % 16, d // 16, d % 16
    lane = (r16 % 8) * 4 + (d16 % 8) // 2
    reg = r16 // 8 + 2 * (d16 // 8)
    return ((((b * heads + h) * 4 + w) * 16 + kk) * 32 + lane) * 8 + reg * 2 + d % 2


class Image:
    """A (rows, cols) activation held in the kernel's swizzled tile image."""

    def __init__(self, rows: int, cols: int, m_tiles: int):
        r = torch.arange(rows)[:, None]
        c = torch.arange(cols)[None, :]
        self.idx = image_offset(r, c, m_tiles)
        self.flat = torch.zeros(rows * cols)

    def read(self, rows=slice(None), cols=slice(None)) -> torch.Tensor:
        return self.flat[self.idx[rows, cols]]

    def write(self, rows, cols, v: torch.Tensor) -> None:
        self.flat[self.idx[rows, cols]] = v


def emulate_step(schedule, stream, weights, cfg, slot, xa, step: int, num_steps: int, round_bf16: bool = True,
                 seed: int = 0, time_bias=None) -> None:  # fmt: skip
    """One step in place on slot / xa; `time_bias`: (W,) / (R,) or a row per batch element, as the kernel's."""
    d = schedule.dims
    rnd = random.Random(seed)
    r = (lambda t: t.to(torch.bfloat16).float()) if round_bf16 else (lambda t: t)
    mp, w_, S, H, A, B = d.m_pad, d.width, d.suffix, d.chunk, d.action_dim, d.batch
    n_kc, half = w_ // TILE, d.head_dim // 2
    x, h_img = Image(mp, w_, d.m_tiles), Image(mp, d.mlp, d.m_tiles)
    attn, emb = Image(mp, d.q_width, d.m_tiles), Image(mp, w_, d.m_tiles)
    q_frag = torch.zeros(B * d.heads * TILE * d.head_dim)
    ssq = torch.zeros(n_kc, mp)
    parts: dict[tuple[int, int, int], torch.Tensor] = {}
    n_splits = len(d.key_splits())
    o_part = torch.zeros(B, d.heads, n_splits, TILE, d.head_dim)
    ml_part = torch.zeros(B, d.heads, n_splits, TILE, 2)
    s, p05 = weights.suffix, weights.pi05
    table = (p05.tables if d.pi05 else s.time_bias).float()
    rows_of_b = table[step].expand(B, -1) if time_bias is None else time_bias.float().expand(B, -1)
    x_t = xa.x_t.float()
    xs_attn, xs_ffn = Image(mp, w_, d.m_tiles), Image(mp, w_, d.m_tiles)  # π0.5: x (1 + s), the normed inputs
    mods = [p05.row(rows_of_b[b]) for b in range(B)] if d.pi05 else None

    def mod(field: str, layer: int, cols) -> torch.Tensor:
        """(mp, len(cols)) the named modulation vector of each row's batch element (π0.5)."""
        return torch.stack([getattr(mods[b].layers[layer], field)[cols] for b in range(B)])[b_of]

    scale_log2 = weights.gemma_attn_scale * math.log2(math.e)
    rows_all = torch.arange(mp)
    real = rows_all < d.rows
    b_of, t_of = (rows_all // S).clamp(max=B - 1), rows_all % S

    def rms(rows=slice(None)):
        return torch.rsqrt(ssq.sum(0)[rows] / w_ + cfg.rms_eps)

    # page offset of every GEMM unit in the stream
    page_of, page = {}, 0
    for units in schedule.per_cta:
        for u in units:
            if u.op in GEMM_OPS:
                page_of[id(u)] = page
                page += u.pages
    by_stage: dict[int, list] = {}
    for u in schedule.units:
        by_stage.setdefault(u.stage, []).append(u)
    arrived: dict[tuple, int] = {}
    for stage in sorted(by_stage):
        units = by_stage[stage][:]
        rnd.shuffle(units)
        for u in units:
            f, op, li = u.row(), u.op, u.layer
            n = int(f[F_N])
            if op == OP_EMBED and d.pi05:
                cols = torch.arange(n * TILE, (n + 1) * TILE)
                y = r(x_t.reshape(B * H, A) @ p05.action_in[cols].float().T + p05.action_in_bias[cols].float())
                ar = torch.arange(B * H)
                x.write(ar[:, None], cols[None], y)
                xs_attn.write(ar[:, None], cols[None], r(y * (1 + mod("attn_scale", 0, cols)[: B * H])))
                ssq[n, ar] = (y * y).sum(-1)
                continue
            if op == OP_ACTION_ROWS:
                R = torch.arange(n * ROW_GROUP, min((n + 1) * ROW_GROUP, d.rows))
                xr, xf = x.read(R, slice(None)), x_t.view(B * H, A)
                for row, xv in zip(R.tolist(), xr):
                    b, t = row // S, row % S
                    v = (xv @ mods[b].action_out.float().T) * rms(row) + mods[b].action_out_bias.float()
                    xf[b * H + t] = v * (-1.0 / num_steps) + xf[b * H + t]
                continue
            if op == OP_EMBED:
                cols = slice(n * TILE, (n + 1) * TILE)
                a = x_t.reshape(B * H, A) @ s.action_time[cols].float().T + rows_of_b[torch.arange(B * H) // H][:, cols]
                ar = torch.arange(B * H)
                emb.write(ar[:, None], torch.arange(n * TILE, (n + 1) * TILE)[None], r(torch.nn.functional.silu(a)))
                y = r(slot.state.float() @ s.state[cols].float().T + s.state_bias[cols].float())
                sr = torch.arange(B) * S
                x.write(sr[:, None], torch.arange(n * TILE, (n + 1) * TILE)[None], y)
                ssq[n, sr] = (y * y).sum(-1)
                continue
            if op in GEMM_OPS:
                nk, k0 = int(f[F_NK]), int(f[F_K0])
                wt = unpack_unit(stream, page_of[id(u)], nk)
                src = {OP_MLP_OUT: emb, OP_O: attn, OP_DOWN: h_img}.get(op, x)
                if d.pi05 and op in (OP_QK, OP_V, OP_GATE_UP):
                    src = xs_ffn if op == OP_GATE_UP else xs_attn
                acc = src.read(slice(None), slice(k0 * TILE, (k0 + nk) * TILE)) @ wt.T  # (mp, 64)
                cols = torch.arange(n * TILE, (n + 1) * TILE)
                if op == OP_MLP_OUT:
                    act = rows_all < B * H
                    R = (rows_all // H) * S + 1 + rows_all % H
                    y = r(acc + s.mlp_out_bias[cols].float())
                    x.write(R[act][:, None], cols[None], y[act])
                    ssq[n, R[act]] = (y[act] * y[act]).sum(-1)
                elif op in (OP_QK, OP_V, OP_GATE_UP):
                    f_r = rms()[:, None]
                    for c in range(2):
                        if op == OP_V:
                            dims = n * TILE + 32 * c + torch.arange(32)
                            v = acc[:, 32 * c : 32 * c + 32] * f_r
                            if d.pi05:
                                v = v + mod("qkv_bias", li, d.q_width + d.head_dim + dims)
                            v = r(v)
                            cache = slot.v_cache[li]
                            cache[b_of[real], d.prefix + t_of[real], 0, dims[:, None]] = v[real].T.to(cache.dtype)
                            continue
                        x1, x2 = acc[:, 32 * c : 32 * c + 16] * f_r, acc[:, 32 * c + 16 : 32 * c + 32] * f_r
                        if op == OP_GATE_UP:
                            hc = 32 * n + 16 * c + torch.arange(16)
                            if d.pi05:
                                x1 = x1 + mod("gate_up_bias", li, hc)
                                x2 = x2 + mod("gate_up_bias", li, d.mlp + hc)
                            h_img.write(
                                rows_all[:, None], hc[None], r(torch.nn.functional.gelu(x1, approximate="tanh") * x2)
                            )
                            continue
                        dims = int(f[F_A]) + 16 * c + torch.arange(16)
                        if d.pi05:
                            x1 = x1 + mod("qkv_bias", li, n * d.head_dim + dims)
                            x2 = x2 + mod("qkv_bias", li, n * d.head_dim + half + dims)
                        cs = slot.suffix_cos.float()[b_of, t_of][:, dims]
                        sn = slot.suffix_sin.float()[b_of, t_of][:, dims]
                        y1, y2 = r(x1 * cs - x2 * sn), r(x2 * cs + x1 * sn)
                        bb, tt = b_of[real][:, None], t_of[real][:, None]
                        if int(f[F_B]):
                            cache = slot.k_cache[li]
                            cache[bb, d.prefix + tt, 0, dims[None]] = y1[real].to(cache.dtype)
                            cache[bb, d.prefix + tt, 0, half + dims[None]] = y2[real].to(cache.dtype)
                        else:
                            q_frag[q_frag_index(bb, n, tt, dims[None], d.heads)] = y1[real]
                            q_frag[q_frag_index(bb, n, tt, half + dims[None], d.heads)] = y2[real]
                elif op == OP_ACTION:
                    v = acc[:, : d.action_dim] * rms()[:, None] + s.action_out_bias.float()
                    act = real & (t_of >= 1)
                    bt = (b_of * H + t_of - 1)[act]
                    xf = x_t.reshape(B * H, A)
                    xf[bt] = v[act] * (-1.0 / num_steps) + xf[bt]
                else:  # O / down: the last split merges in split order
                    key = (op, li, n)
                    parts[(op, li, n, int(f[F_SPLIT]))] = acc
                    arrived[key] = arrived.get(key, 0) + 1
                    splits = d.o_splits if op == OP_O else d.down_splits
                    if arrived[key] < splits:
                        continue
                    tot = torch.zeros_like(acc)
                    for sp in range(splits):
                        tot = tot + parts[(op, li, n, sp)]
                    if d.pi05:
                        tot = tot * mod("attn_gate" if op == OP_O else "ffn_gate", li, cols)
                    y = r(tot + x.read(slice(None), cols))
                    x.write(rows_all[:, None], cols[None], y)
                    ssq[n] = (y * y).sum(-1)
                    if d.pi05 and op == OP_O:
                        xs_ffn.write(rows_all[:, None], cols[None], r(y * (1 + mod("ffn_scale", li, cols))))
                    elif d.pi05 and li + 1 < d.depth:
                        xs_attn.write(rows_all[:, None], cols[None], r(y * (1 + mod("attn_scale", li + 1, cols))))
                continue
            if op == OP_ATTN:
                b, sp, key0, key1 = int(f[F_A]), int(f[F_SPLIT]), int(f[F_K0]), int(f[F_B])
                t = torch.arange(TILE)
                q = q_frag[q_frag_index(b, n, t[:, None], torch.arange(d.head_dim)[None], d.heads)]
                qblk = torch.where(t < S, xa.query_block[b].long().cpu()[t.clamp(max=S - 1)], -1)
                m = torch.full((TILE,), -math.inf)
                lsum = torch.zeros(TILE)
                o = torch.zeros(TILE, d.head_dim)
                for ii in range(int(f[F_NK])):
                    keys = key0 + ii * KEY_ITEM + torch.arange(KEY_ITEM)
                    inb = keys < d.keys
                    kc = torch.zeros(KEY_ITEM, d.head_dim)
                    vc = torch.zeros(KEY_ITEM, d.head_dim)
                    kc[inb] = slot.k_cache[li][b, keys[inb], 0].float()
                    vc[inb] = slot.v_cache[li][b, keys[inb], 0].float()
                    kb = torch.full((KEY_ITEM,), 2**31 - 1, dtype=torch.long)
                    kb[inb] = slot.key_block[b, keys[inb]].long()
                    ok = (keys < key1)[None] & inb[None] & (kb[None] <= qblk[:, None])
                    sc = torch.where(ok, (q @ kc.T) * scale_log2, -math.inf)
                    m_new = torch.maximum(m, sc.max(-1).values)
                    m_use = torch.where(m_new == -math.inf, 0.0, m_new)
                    alpha = torch.exp2(m - m_use)
                    p = torch.exp2(sc - m_use[:, None])
                    lsum = lsum * alpha + p.sum(-1)
                    m = m_new
                    o = o * alpha[:, None] + r(p) @ vc
                o_part[b, n, sp], ml_part[b, n, sp, :, 0], ml_part[b, n, sp, :, 1] = o, m, lsum
                continue
            if op == OP_MERGE:
                b, rg = int(f[F_A]), int(f[F_B])
                t = torch.arange(rg * ROW_GROUP, min((rg + 1) * ROW_GROUP, S))
                ms, ls = ml_part[b, n, : int(f[F_C]), t, 0], ml_part[b, n, : int(f[F_C]), t, 1]
                mx = ms.max(0).values
                wgt = torch.where(mx == -math.inf, 0.0, torch.exp2(ms - mx))
                total = (ls * wgt).sum(0)
                out = (o_part[b, n, : int(f[F_C])][:, t] * wgt[..., None]).sum(0)
                out = torch.where(total[:, None] > 0, out / total[:, None], 0.0)
                attn.write((b * S + t)[:, None], (n * d.head_dim + torch.arange(d.head_dim))[None], r(out))
    xa.x_t.copy_(x_t.to(xa.x_t.dtype))
