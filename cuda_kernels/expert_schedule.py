"""The expert step as data: which CTA runs which unit of which op, in which order, and the counters between them.

A *unit* is one piece of work a CTA does alone: a 64-column GEMM tile over a K range (its weights are a run of
8 KB pages), an attention block (one batch, one head, one key range), an attention merge (16 query rows of one
head), or the suffix embedding of 64 columns. Units are grouped in *stages* (embed, mlp_out, then per layer QKV,
attention, merge, O, gate/up, down; the action projection last). Every CTA runs its units in stage order and a unit
only waits for units of earlier stages, so with every CTA resident the step cannot deadlock (the protocol model in
`expert_protocol.py` replays this). Hand-offs are counters in global memory: a producer adds 1 after its stores, a
consumer waits until a counter reaches (epoch + 1) x T, T being how many producers add to it in one launch.

The kernel reads the schedule as an int32 table of instructions (`FIELDS` per row) plus, per CTA, where its rows
and its weight pages start. `build_schedule` is deterministic: the same dims and CTA count give the same tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vla_rt.cuda_kernels.expert_dims import KEY_ITEM, ROW_GROUP, TILE, ExpertDims

# op codes (expert_step.cu's `Op`)
OP_EMBED, OP_MLP_OUT, OP_QK, OP_V, OP_ATTN, OP_MERGE, OP_O, OP_GATE_UP, OP_DOWN, OP_ACTION, OP_ACTION_ROWS = range(
    1, 12
)
OP_NAMES = {OP_EMBED: "embed", OP_MLP_OUT: "mlp_out", OP_QK: "qk", OP_V: "v", OP_ATTN: "attn", OP_MERGE: "merge",
            OP_O: "o", OP_GATE_UP: "gate_up", OP_DOWN: "down", OP_ACTION: "action",
            OP_ACTION_ROWS: "action_rows"}  # fmt: skip
GEMM_OPS = (OP_MLP_OUT, OP_QK, OP_V, OP_O, OP_GATE_UP, OP_DOWN, OP_ACTION)
# instruction fields (expert_step.cu's `F_*`); unused fields are 0
FIELDS = 16
(F_OP, F_LAYER, F_N, F_SPLIT, F_K0, F_NK, F_IN_CNT, F_IN_DIV, F_IN_T, F_OUT_CNT, F_SK_CNT, F_SK_T,
 F_A, F_B, F_C, F_D) = range(FIELDS)  # fmt: skip
STAGES_PER_LAYER = 6  # qkv, attention, merge, o, gate_up, down


def stage_of(op: int, layer: int, depth: int) -> int:
    """The global stage index of an op: 0 embed, 1 mlp_out, 2 + 6 layer + (0..5) per layer, 2 + 6 depth the action."""
    if op == OP_EMBED:
        return 0
    if op == OP_MLP_OUT:
        return 1
    if op in (OP_ACTION, OP_ACTION_ROWS):
        return 2 + STAGES_PER_LAYER * depth
    local = {OP_QK: 0, OP_V: 0, OP_ATTN: 1, OP_MERGE: 2, OP_O: 3, OP_GATE_UP: 4, OP_DOWN: 5}[op]
    return 2 + STAGES_PER_LAYER * layer + local


class Counters:
    """Index of every hand-off counter and how many producers add to it per launch (T)."""

    def __init__(self, d: ExpertDims):
        self.d = d
        self.t: list[int] = []
        self.names: list[str] = []
        n_kc = d.width // TILE
        self.emb = self._block("emb", 0 if d.pi05 else n_kc, 1)  # π0's action-time embedding
        # x versions: 0 after the embedding (π0: the embed's state rows + mlp_out's action rows; π0.5: the embed),
        # 2l+1 after layer l's O, 2l+2 after its down projection
        self.x = [self._block(f"x{v}", n_kc, 2 if v == 0 and not d.pi05 else 1) for v in range(2 * d.depth + 1)]
        half_units = d.head_dim // 2 // 32
        n_splits = len(d.key_splits())
        n_rg = -(-d.suffix // ROW_GROUP)
        self.q = [self._block(f"q{li}", d.heads, half_units) for li in range(d.depth)]
        self.kv = [self._block(f"kv{li}", 1, half_units + d.head_dim // TILE)[0] for li in range(d.depth)]
        self.attp = [self._block(f"attp{li}", d.batch * d.heads, n_splits) for li in range(d.depth)]
        self.attn = [self._block(f"attn{li}", d.heads, d.batch * n_rg) for li in range(d.depth)]
        self.h = [self._block(f"h{li}", d.mlp // TILE, 2) for li in range(d.depth)]
        self.sk_o = [self._block(f"sko{li}", n_kc, d.o_splits) for li in range(d.depth)]
        self.sk_down = [self._block(f"skd{li}", n_kc, d.down_splits) for li in range(d.depth)]
        self.count = len(self.t)

    def _block(self, name: str, n: int, t: int) -> list[int]:
        base = len(self.t)
        self.t += [t] * n
        self.names += [f"{name}[{i}]" for i in range(n)]
        return list(range(base, base + n))


@dataclass
class Unit:
    op: int
    layer: int
    fields: dict[int, int]
    pages: int = 0  # weight pages it consumes
    a_items: int = 0  # activation-ring items it consumes
    stage: int = 0
    cta: int = -1
    cost_us: float = 0.0

    def row(self) -> np.ndarray:
        r = np.zeros(FIELDS, dtype=np.int32)
        r[F_OP], r[F_LAYER] = self.op, self.layer
        for k, v in self.fields.items():
            r[k] = v
        return r


def _gemm(op, layer, n, split, k0, nk, in_cnt, in_div, in_t, out_cnt, d: ExpertDims, extra=None) -> Unit:
    f = {F_N: n, F_SPLIT: split, F_K0: k0, F_NK: nk, F_IN_CNT: in_cnt, F_IN_DIV: in_div, F_IN_T: in_t,
         F_OUT_CNT: out_cnt, F_SK_CNT: -1, F_SK_T: 0, **(extra or {})}  # fmt: skip
    return Unit(op, layer, f, pages=nk, a_items=nk // d.a_item_chunks)


def build_units(d: ExpertDims, c: Counters) -> list[Unit]:
    """Every unit of one step, in stage order."""
    n_kc = d.width // TILE
    units: list[Unit] = []
    for j in range(n_kc):  # π0: the time MLP's first half and the state token; π0.5: the action tokens (x itself)
        f = {F_N: j, F_OUT_CNT: c.x[0][j]} if d.pi05 else {F_N: j, F_OUT_CNT: c.emb[j], F_C: c.x[0][j]}
        units.append(Unit(OP_EMBED, 0, f))
    if not d.pi05:
        for n in range(n_kc):
            units.append(_gemm(OP_MLP_OUT, 0, n, 0, 0, n_kc, c.emb[0], 1, c.t[c.emb[0]], c.x[0][n], d))
    half = d.head_dim // 2
    splits = d.key_splits()
    n_rg = -(-d.suffix // ROW_GROUP)
    for li in range(d.depth):
        x_in, x_mid, x_out = c.x[2 * li], c.x[2 * li + 1], c.x[2 * li + 2]
        for h in range(d.heads + 1):  # the last "head" is K
            for i0 in range(0, half, 32):
                out = c.q[li][h] if h < d.heads else c.kv[li]
                units.append(
                    _gemm(OP_QK, li, h, 0, 0, n_kc, x_in[0], 1, c.t[x_in[0]], out, d, {F_A: i0, F_B: int(h == d.heads)})
                )
        for u in range(d.head_dim // TILE):
            units.append(_gemm(OP_V, li, u, 0, 0, n_kc, x_in[0], 1, c.t[x_in[0]], c.kv[li], d))
        for b in range(d.batch):
            for h in range(d.heads):
                for s, (k0, k1) in enumerate(splits):
                    n_items = -(-(k1 - k0) // KEY_ITEM)
                    touches_suffix = k0 + n_items * KEY_ITEM > d.prefix
                    f = {F_N: h, F_A: b, F_SPLIT: s, F_K0: k0, F_B: k1, F_NK: n_items, F_IN_CNT: c.q[li][h],
                         F_IN_T: c.t[c.q[li][h]], F_C: c.kv[li] if touches_suffix else -1,
                         F_D: c.t[c.kv[li]] if touches_suffix else 0, F_OUT_CNT: c.attp[li][b * d.heads + h]}  # fmt: skip
                    units.append(Unit(OP_ATTN, li, f, a_items=2 * n_items))
        for b in range(d.batch):
            for h in range(d.heads):
                attp = c.attp[li][b * d.heads + h]
                for rg in range(n_rg):
                    f = {F_N: h, F_A: b, F_B: rg, F_C: len(splits), F_IN_CNT: attp, F_IN_T: c.t[attp],
                         F_OUT_CNT: c.attn[li][h]}  # fmt: skip
                    units.append(Unit(OP_MERGE, li, f))
        o_nk = d.q_width // d.o_splits // TILE
        for n in range(n_kc):
            for s in range(d.o_splits):  # attention chunk kc belongs to head kc // (head_dim / 64)
                u = _gemm(OP_O, li, n, s, s * o_nk, o_nk, c.attn[li][0], d.head_dim // TILE, c.t[c.attn[li][0]],
                          x_mid[n], d)  # fmt: skip
                u.fields[F_SK_CNT], u.fields[F_SK_T] = c.sk_o[li][n], d.o_splits
                units.append(u)
        for j in range(d.mlp // 32):
            units.append(_gemm(OP_GATE_UP, li, j, 0, 0, n_kc, x_mid[0], 1, c.t[x_mid[0]], c.h[li][j // 2], d))
        d_nk = d.mlp // d.down_splits // TILE
        for n in range(n_kc):
            for s in range(d.down_splits):
                u = _gemm(OP_DOWN, li, n, s, s * d_nk, d_nk, c.h[li][0], 1, c.t[c.h[li][0]], x_out[n], d)
                u.fields[F_SK_CNT], u.fields[F_SK_T] = c.sk_down[li][n], d.down_splits
                units.append(u)
    x_last = c.x[2 * d.depth][0]
    if d.pi05:  # the step's float32 action table, ROW_GROUP rows a unit (no weight pages)
        for rg in range(-(-d.rows // ROW_GROUP)):
            units.append(Unit(OP_ACTION_ROWS, 0, {F_N: rg, F_IN_CNT: x_last, F_IN_T: c.t[x_last], F_OUT_CNT: -1}))
    else:
        units.append(_gemm(OP_ACTION, 0, 0, 0, 0, n_kc, x_last, 1, c.t[x_last], -1, d))
    for u in units:
        u.stage = stage_of(u.op, u.layer, d.depth)
    return units


@dataclass(frozen=True)
class CostModel:
    """Rough µs costs the assignment balances (calibrate on the GPU); they change performance, never results."""

    hbm_bytes_per_us: float = 4.2e6  # the measured copy bandwidth, shared by all CTAs
    page_mma_us: float = 0.07  # 64 x 64 x 64 wgmma per m-tile
    unit_us: float = 0.6  # epilogue, first loads
    attn_item_us: float = 0.25
    merge_us: float = 0.5
    handoff_us: float = 0.8


@dataclass
class Schedule:
    dims: ExpertDims
    ctas: int
    counters: Counters
    units: list[Unit]
    per_cta: list[list[Unit]] = field(default_factory=list)

    def tables(self) -> dict[str, np.ndarray]:
        """What the kernel reads: `instrs` (n, FIELDS) int32 in CTA order, `cta_instr` (ctas + 1) row offsets,
        `cta_page` (ctas + 1) page offsets into the packed weight stream, `counter_t` (T per counter)."""
        rows, instr_off, page_off = [], [0], [0]
        for units in self.per_cta:
            rows += [u.row() for u in units]
            instr_off.append(instr_off[-1] + len(units))
            page_off.append(page_off[-1] + sum(u.pages for u in units))
        return dict(
            instrs=np.stack(rows).astype(np.int32),
            cta_instr=np.array(instr_off, dtype=np.int32),
            cta_page=np.array(page_off, dtype=np.int64),
            counter_t=np.array(self.counters.t, dtype=np.int64),
        )


def build_schedule(d: ExpertDims, ctas: int, cost: CostModel | None = None) -> Schedule:
    """Assigns every unit to one of `ctas` CTAs by list scheduling over the cost model: stage by stage, the longest
    units first, each to the CTA that would finish it earliest (a CTA's weights stream at its share of HBM, so
    weight-heavy CTAs fall behind and get less); ties go to the CTA with fewer weight pages, then the lower index."""
    if ctas < 1:
        raise ValueError(f"ctas: expected >= 1, found {ctas}")
    cost = cost or CostModel()
    counters = Counters(d)
    units = build_units(d, counters)
    share = cost.hbm_bytes_per_us / ctas
    free = np.zeros(ctas)  # when each CTA's consumer is free
    pages = np.zeros(ctas)  # weight pages assigned so far
    by_stage: dict[int, list[Unit]] = {}
    for u in units:
        by_stage.setdefault(u.stage, []).append(u)
    stage_done = 0.0
    for stage in sorted(by_stage):
        ready = stage_done + (cost.handoff_us if stage else 0.0)
        finish = ready
        for u in sorted(by_stage[stage], key=lambda u: -(u.pages + u.a_items)):
            if u.pages:
                dur = cost.unit_us + u.pages * cost.page_mma_us * d.m_tiles
            elif u.op == OP_ATTN:
                dur = cost.unit_us + u.a_items * cost.attn_item_us
            else:
                dur = cost.merge_us
            weights_in = (pages + u.pages) * 8192 / share - u.pages * cost.page_mma_us
            done = np.round(np.maximum(np.maximum(free, ready), weights_in) + dur, 3)
            best = int(np.lexsort((np.arange(ctas), pages, done))[0])
            u.cta, u.cost_us = best, float(done[best])
            free[best], pages[best] = u.cost_us, pages[best] + u.pages
            finish = max(finish, u.cost_us)
        stage_done = finish
    per_cta: list[list[Unit]] = [[] for _ in range(ctas)]
    for u in units:  # units are in stage order already; keep that order per CTA
        per_cta[u.cta].append(u)
    return Schedule(d, ctas, counters, units, per_cta)
