"""A CPU model of the kernel's hand-off protocol, run over the very tables the kernel is given.

Each CTA is three agents, as in `expert_step.cu`: the weight loader (pages in order into a ring of `w_pages`), the
activation loader (items in order into a ring of `a_slots`, each after waiting for the counters the instruction
names) and the consumer (instructions in order; a GEMM holds the pages and items of its last `wgmma_depth` chunks,
whose MMAs may still be running); the model tracks which item each ring slot holds, so an item fetched over one
its consumer has not released is caught. Agents are stepped in a random order until every consumer is done; if none can move, the
schedule deadlocks and `ProtocolError` says who waits for what.

Independently of the counters, the model knows from each instruction's op and indices what it reads and writes
(which chunk of x, h, attention output, partial sums, of which version), and checks every read sees the complete
current version (no consumer reads before its producers) and every write comes after all reads of the version it
replaces. Several launches run back to back on the same counters, which only grow: at the end of launch e every
counter must be exactly (e + 1) x T, so graph replays need no reset.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from vla_rt.cuda_kernels.expert_dims import KEY_ITEM, ROW_GROUP, TILE, ExpertDims
from vla_rt.cuda_kernels.expert_schedule import (
    F_A,
    F_B,
    F_C,
    F_D,
    F_IN_CNT,
    F_IN_DIV,
    F_IN_T,
    F_K0,
    F_LAYER,
    F_N,
    F_NK,
    F_OP,
    F_OUT_CNT,
    F_SK_CNT,
    F_SK_T,
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

NORMED_OPS = (OP_QK, OP_V, OP_GATE_UP, OP_ACTION)  # GEMMs whose epilogue applies the RMS factor of x


class ProtocolError(AssertionError):
    pass


def _gemm_input(op: int, r, d: ExpertDims) -> tuple[str, int]:
    """The activation buffer a GEMM unit's A items read, and its x version (or -1)."""
    li = int(r[F_LAYER])
    if op == OP_MLP_OUT:
        return "emb", -1
    if op in (OP_QK, OP_V):
        return "x", 2 * li
    if op == OP_O:
        return "attn", -1
    if op == OP_GATE_UP:
        return "x", 2 * li + 1
    if op == OP_DOWN:
        return "h", -1
    return "x", 2 * d.depth  # the action projection


class Model:
    """One schedule's protocol; `run(launches, seed)` raises ProtocolError on a deadlock or a data race."""

    def __init__(self, d: ExpertDims, tables: dict[str, np.ndarray]):
        self.d = d
        self.instrs = tables["instrs"]
        self.cta_instr = tables["cta_instr"]
        self.t = [int(x) for x in tables["counter_t"]]
        self.ctas = len(self.cta_instr) - 1
        self.n_rg = -(-d.suffix // ROW_GROUP)
        self.n_splits = len(d.key_splits())
        self.expected_reads = self._count_reads()

    # ----- ground truth: what each instruction reads and writes, from its op and indices alone -------------------
    def _version(self, buf: str, xv: int, layer: int, epoch: int) -> int:
        d = self.d
        if buf in ("x", "ssq"):
            return epoch * (2 * d.depth + 1) + xv
        if buf in ("emb",) or buf.startswith("kv"):
            return epoch
        return epoch * d.depth + layer

    def _writers(self, buf: str, xv: int) -> int:
        d = self.d
        first = 2 if xv == 0 and not d.pi05 else 1  # π0's x starts from the embed and mlp_out
        return {"x": first, "ssq": first, "emb": 1, "q": d.head_dim // 64,
                "attp": 1, "attn": d.batch * self.n_rg, "h": 2, "po": 1, "pd": 1}.get(buf, 8)  # fmt: skip

    def a_items(self, r) -> list[tuple[list[tuple[int, int]], list[tuple[str, int, int]]]]:
        """The activation-loader items of an instruction: (counter waits, reads) per item."""
        d, op = self.d, int(r[F_OP])
        items = []
        if op in GEMM_OPS:
            buf, xv = _gemm_input(op, r, d)
            k0, nk = int(r[F_K0]), int(r[F_NK])
            for i in range(0, nk, d.a_item_chunks):
                chunks = range(k0 + i, k0 + i + d.a_item_chunks)
                waits = [(int(r[F_IN_CNT]) + kc // int(r[F_IN_DIV]), int(r[F_IN_T])) for kc in chunks]
                items.append((waits, [(buf, kc, xv) for kc in chunks]))
        elif op == OP_ATTN:
            li = int(r[F_LAYER])
            for ii in range(int(r[F_NK])):
                touches = int(r[F_K0]) + (ii + 1) * KEY_ITEM > d.prefix
                waits = [(int(r[F_C]), int(r[F_D]))] if touches else []
                reads = [(f"kv{li}", 0, -1)] if touches else []
                items += [(waits, reads), (waits, reads)]  # K then V
        return items

    def _count_reads(self) -> Counter:
        """How many reads each (buffer, chunk, version) gets in one launch (epoch 0)."""
        reads: Counter = Counter()
        for r in self.instrs:
            for _, rs in self.a_items(r):
                for buf, ch, xv in rs:
                    reads[(buf, ch, self._version(buf, xv, int(r[F_LAYER]), 0))] += 1
            merges = int(r[F_OP]) not in (OP_O, OP_DOWN) or int(r[F_SPLIT]) == 0  # one split of a tile merges
            for buf, ch, xv in self._start_reads(r) + (self._end_reads(r, last=True) if merges else []):
                reads[(buf, ch, self._version(buf, xv, int(r[F_LAYER]), 0))] += 1
        return reads

    def _start_reads(self, r) -> list[tuple[str, int, int]]:
        op, d = int(r[F_OP]), self.d
        if op == OP_ACTION_ROWS:  # π0.5's output: every chunk of the last x and its sums of squares
            n_kc, xv = d.width // TILE, 2 * d.depth
            return [(buf, kc, xv) for kc in range(n_kc) for buf in ("x", "ssq")]
        if op == OP_ATTN:
            return [("q", int(r[F_N]), -1)]
        if op == OP_MERGE:
            b, h = int(r[F_A]), int(r[F_N])
            return [("attp", (b * d.heads + h) * self.n_splits + s, -1) for s in range(self.n_splits)]
        return []

    def _end_reads(self, r, last: bool) -> list[tuple[str, int, int]]:
        """Epilogue reads; `last`: this split-K unit arrived last and merges."""
        op, d, li = int(r[F_OP]), self.d, int(r[F_LAYER])
        n_kc = d.width // TILE
        if op in (OP_QK, OP_V, OP_GATE_UP, OP_ACTION):
            _, xv = _gemm_input(op, r, d)
            return [("ssq", kc, xv) for kc in range(n_kc)]
        if op in (OP_O, OP_DOWN) and last:
            n, part = int(r[F_N]), "po" if op == OP_O else "pd"
            splits = d.o_splits if op == OP_O else d.down_splits
            xv = 2 * li if op == OP_O else 2 * li + 1
            return [(part, s * n_kc + n, -1) for s in range(splits)] + [("x", n, xv)]
        return []

    def _writes(self, r, last: bool) -> list[tuple[str, int, int]]:
        op, d, li = int(r[F_OP]), self.d, int(r[F_LAYER])
        n_kc = d.width // TILE
        n = int(r[F_N])
        if op == OP_EMBED:
            return [("x", n, 0), ("ssq", n, 0)] if d.pi05 else [("emb", n, -1), ("x", n, 0), ("ssq", n, 0)]
        if op == OP_MLP_OUT:
            return [("x", n, 0), ("ssq", n, 0)]
        if op == OP_QK:
            return [("q", n, -1)] if int(r[F_B]) == 0 else [(f"kv{li}", 0, -1)]
        if op == OP_V:
            return [(f"kv{li}", 0, -1)]
        if op == OP_ATTN:
            return [("attp", (int(r[F_A]) * d.heads + n) * self.n_splits + int(r[F_SPLIT]), -1)]
        if op == OP_MERGE:
            per_head = d.head_dim // TILE
            return [("attn", n * per_head + i, -1) for i in range(per_head)]
        if op in (OP_O, OP_DOWN):
            part = "po" if op == OP_O else "pd"
            out = [(part, int(r[F_SPLIT]) * n_kc + n, -1)]
            xv = 2 * li + 1 if op == OP_O else 2 * li + 2
            return out + ([("x", n, xv), ("ssq", n, xv)] if last else [])
        if op == OP_GATE_UP:
            return [("h", n // 2, -1)]
        return []

    # ----- the agents -----------------------------------------------------------------------------------------
    def run(self, launches: int = 2, seed: int = 0, *, max_steps: int = 50_000_000) -> None:
        rng = random.Random(seed)
        self.counters = [0] * len(self.t)
        self.state: dict = {}  # (buf, chunk) -> [version, writers done]
        self.reads_done: Counter = Counter()
        for epoch in range(launches):
            self._launch(epoch, rng, max_steps)
            bad = [
                (i, c, (epoch + 1) * t) for i, (c, t) in enumerate(zip(self.counters, self.t)) if c != (epoch + 1) * t
            ]
            if bad:
                raise ProtocolError(f"after launch {epoch}: counters not at (epoch + 1) x T: {bad[:5]}")

    def _launch(self, epoch: int, rng: random.Random, max_steps: int) -> None:
        agents = []
        self.rings = [dict(w_issued=0, w_released=0, a_issued=0, a_released=0, rms_issued=0, rms_released=0)
                      for _ in range(self.ctas)]  # fmt: skip
        self.slots = [[-1] * self.d.a_slots for _ in range(self.ctas)]  # which item each CTA's slots hold
        for c in range(self.ctas):
            rows = self.instrs[self.cta_instr[c] : self.cta_instr[c + 1]]
            ring = self.rings[c]
            for name, gen in (("w", self._w_loader(rows, ring)), ("a", self._a_loader(rows, c, epoch)),
                              ("c", self._consumer(rows, c, epoch))):  # fmt: skip
                agents.append((c, name, gen))
        live = {i: next(gen, None) for i, (_, _, gen) in enumerate(agents)}
        live = {i: w for i, w in live.items() if w is not None}
        # each agent moves at its own speed (some CTAs, loaders or consumers lag far behind others), so orders that
        # lockstep stepping never produces get tried
        speed = [rng.uniform(0.05, 1.0) for _ in agents]
        steps = 0
        while live:
            ready = [i for i, cond in live.items() if cond()]
            if not ready:
                blocked = [(agents[i][0], agents[i][1], getattr(live[i], "what", "?")) for i in list(live)[:8]]
                raise ProtocolError(f"deadlock in launch {epoch}: {len(live)} agents blocked, e.g. {blocked}")
            moving = [i for i in ready if rng.random() < speed[i]] or [max(ready, key=lambda i: speed[i])]
            for i in rng.sample(moving, len(moving)):
                if i not in live or not live[i]():
                    continue
                nxt = next(agents[i][2], None)
                if nxt is None:
                    del live[i]
                else:
                    live[i] = nxt
                steps += 1
            if steps > max_steps:
                raise ProtocolError("model ran too long")

    @staticmethod
    def _cond(fn, what: str):
        fn.what = what
        return fn

    def _wait_counter(self, cnt: int, t: int, epoch: int):
        target = (epoch + 1) * t
        return self._cond(lambda: self.counters[cnt] >= target, f"counter {cnt} >= {target}")

    def _w_loader(self, rows, ring):
        total = sum(int(r[F_NK]) for r in rows if int(r[F_OP]) in GEMM_OPS)  # (skip units have no pages)
        for i in range(total):
            yield self._cond(lambda: ring["w_issued"] - ring["w_released"] < self.d.w_pages, "w slot")
            ring["w_issued"] = i + 1

    def _a_loader(self, rows, cta, epoch):
        ring = self.rings[cta]
        for r in rows:
            for waits, reads in self.a_items(r):
                i = ring["a_issued"]
                yield self._cond(lambda i=i: i - ring["a_released"] < self.d.a_slots, "a slot")
                for cnt, t in waits:
                    yield self._wait_counter(cnt, t, epoch)
                for buf, ch, xv in reads:  # the bulk copy reads global memory as it is issued
                    self._read(buf, ch, xv, int(r[F_LAYER]), epoch)
                self._fill_slot(cta, i)
                ring["a_issued"] += 1
            if int(r[F_OP]) in NORMED_OPS:  # then the unit's RMS factors, into a ring of two
                yield self._cond(lambda: ring["rms_issued"] - ring["rms_released"] < 2, "rms slot")
                for buf, ch, xv in self._end_reads(r, last=True):  # the sums of squares of x, read by the loader
                    self._read(buf, ch, xv, int(r[F_LAYER]), epoch)
                ring["rms_issued"] += 1

    def _fill_slot(self, cta: int, i: int) -> None:
        """Item i lands in slot i % a_slots: the consumer must have released the item it held."""
        s = i % self.d.a_slots
        held = self.slots[cta][s]
        if held >= 0 and self.rings[cta]["a_released"] <= held:
            raise ProtocolError(f"item {i} overwrites item {held} in slot {s} of CTA {cta} before it was released")
        self.slots[cta][s] = i

    def _take(self, cta: int, i: int) -> None:
        if self.slots[cta][i % self.d.a_slots] != i:
            raise ProtocolError(f"CTA {cta} takes item {i}, its slot holds item {self.slots[cta][i % self.d.a_slots]}")

    def _consumer(self, rows, cta, epoch):
        d, ring = self.d, self.rings[cta]
        page = item = normed = 0
        for r in rows:
            op = int(r[F_OP])
            if op == OP_ATTN:
                yield self._wait_counter(int(r[F_IN_CNT]), int(r[F_IN_T]), epoch)
            if op == OP_MERGE:
                yield self._wait_counter(int(r[F_IN_CNT]), int(r[F_IN_T]), epoch)
            if op == OP_ACTION_ROWS:
                for kc in range(d.width // TILE):
                    yield self._wait_counter(int(r[F_IN_CNT]) + kc, int(r[F_IN_T]), epoch)
            for buf, ch, xv in self._start_reads(r):
                self._read(buf, ch, xv, int(r[F_LAYER]), epoch)
            if op in GEMM_OPS:  # pages and items stay held until the MMAs `wgmma_depth` chunks later are issued
                pending = []
                for kc in range(int(r[F_NK])):
                    if kc % d.a_item_chunks == 0:
                        i = item
                        yield self._cond(lambda i=i: ring["a_issued"] > i, "a item")
                        self._take(cta, i)
                        item += 1
                    p = page
                    yield self._cond(lambda p=p: ring["w_issued"] > p, "w page")
                    page += 1
                    pending.append(kc % d.a_item_chunks == d.a_item_chunks - 1)
                    if len(pending) > d.wgmma_depth:
                        ring["w_released"] += 1
                        ring["a_released"] += pending.pop(0)
                ring["w_released"] += len(pending)
                ring["a_released"] += sum(pending)
            elif op == OP_ATTN:
                for _ in range(2 * int(r[F_NK])):
                    i = item
                    yield self._cond(lambda i=i: ring["a_issued"] > i, "kv item")
                    self._take(cta, i)
                    item += 1
                    ring["a_released"] += 1
            last = True
            if op in (OP_O, OP_DOWN):
                for buf, ch, xv in self._writes(r, last=False):
                    self._write(buf, ch, xv, int(r[F_LAYER]), epoch)
                self.counters[int(r[F_SK_CNT])] += 1
                last = self.counters[int(r[F_SK_CNT])] == (epoch + 1) * int(r[F_SK_T])
                if not last:
                    continue
                for buf, ch, xv in self._end_reads(r, last=True):
                    self._read(buf, ch, xv, int(r[F_LAYER]), epoch)
                for buf, ch, xv in self._writes(r, last=True)[1:]:
                    self._write(buf, ch, xv, int(r[F_LAYER]), epoch)
            else:
                if op in NORMED_OPS:  # the epilogue takes the RMS factors the loader computed
                    k = normed
                    yield self._cond(lambda k=k: ring["rms_issued"] > k, "rms")
                    normed += 1
                for buf, ch, xv in self._writes(r, last=True):
                    self._write(buf, ch, xv, int(r[F_LAYER]), epoch)
            if int(r[F_OUT_CNT]) >= 0:
                self.counters[int(r[F_OUT_CNT])] += 1
            if op in NORMED_OPS:
                ring["rms_released"] += 1
            if op == OP_EMBED and not d.pi05:  # π0's embed also completes x's state rows
                self.counters[int(r[F_C])] += 1

    # ----- data checks ------------------------------------------------------------------------------------------
    def _read(self, buf, ch, xv, layer, epoch):
        v = self._version(buf, xv, layer, epoch)
        cur = self.state.get((buf, ch))
        need = self._writers(buf, xv)
        if cur is None or cur[0] != v or cur[1] != need:
            raise ProtocolError(f"read of {buf}[{ch}] version {v} (layer {layer}) before its {need} writers: "
                                f"state {cur}")  # fmt: skip
        self.reads_done[(buf, ch, v)] += 1

    def _write(self, buf, ch, xv, layer, epoch):
        v = self._version(buf, xv, layer, epoch)
        cur = self.state.get((buf, ch))
        if cur is None or cur[0] != v:
            if cur is not None:
                prev = cur[0]
                if v < prev:
                    raise ProtocolError(f"write of {buf}[{ch}] version {v} after version {prev}")
                want = self.expected_reads[(buf, ch, self._base_version(buf, prev))]
                if self.reads_done[(buf, ch, prev)] != want:
                    raise ProtocolError(f"write of {buf}[{ch}] version {v} while version {prev} has "
                                        f"{self.reads_done[(buf, ch, prev)]} of {want} reads done")  # fmt: skip
            self.state[(buf, ch)] = [v, 0]
        self.state[(buf, ch)][1] += 1

    def _base_version(self, buf, v):
        """The epoch-0 version with the same role as version v (every launch reads the same)."""
        d = self.d
        per = 2 * d.depth + 1 if buf in ("x", "ssq") else (1 if buf == "emb" or buf.startswith("kv") else d.depth)
        return v % per


def check(d: ExpertDims, tables: dict[str, np.ndarray], launches: int = 2, seeds: tuple[int, ...] = (0,)) -> None:
    """Replays the protocol of `tables` (from `Schedule.tables()`); raises ProtocolError if it can deadlock or race."""
    model = Model(d, tables)
    for seed in seeds:
        model.run(launches, seed)
