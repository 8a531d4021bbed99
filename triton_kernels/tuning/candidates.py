"""What the tuner measures: the π0 shapes in priority order (`plan_items`, `waves`) and, per shape, the launch configs
worth timing (`candidates_for`), ranked by the cost models of `launch_configs` / `attention_configs` and spread over
the structural choices the models are least sure about.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..attention_configs import AttentionConfig, attention_cost_us, attention_heuristic, attention_key, attention_space
from ..gemm_tma import tma_config_applies
from ..launch_configs import GemmConfig, gemm_cost_us, gemm_heuristic, gemm_key, gemm_space, tile_columns
from ..shapes import AttentionShape, GemmShape, pi0_attention_shapes, pi0_gemm_shapes

__all__ = [
    "ATTENTION_GROUPS",
    "GROUPS",
    "TuneItem",
    "attention_candidates",
    "candidates_for",
    "compile_key",
    "gemm_candidates",
    "plan_items",
    "waves",
]

GROUPS = ("expert", "vlm", "siglip", "attention")
ATTENTION_GROUPS = ("expert_attention", "prefix_attention", "siglip_attention")  # "attention" = all three
QUICK_CANDIDATES = 20
FULL_CANDIDATES = 100


@dataclass(frozen=True)
class TuneItem:
    """One shape to tune: `priority` orders the work (lower first), `group` is what the filters select on."""

    priority: int
    group: str  # expert / vlm / siglip / expert_attention / prefix_attention / siglip_attention
    shape: GemmShape | AttentionShape

    @property
    def kind(self) -> str:
        return "gemm" if isinstance(self.shape, GemmShape) else "attention"

    @property
    def key(self) -> str:
        s = self.shape
        if isinstance(s, GemmShape):
            return gemm_key(s.m, s.n, s.k, s.gated, rope=s.rope)
        return attention_key(s.b, s.tq, s.tk, s.hq, s.hkv, s.d)

    @property
    def label(self) -> str:
        return f"{self.shape.name} {self.key}"


def _expand_groups(groups: Iterable[str]) -> set[str]:
    out = set()
    for g in groups:
        if g == "attention":
            out.update(ATTENTION_GROUPS)
        elif g in GROUPS or g in ATTENTION_GROUPS:
            out.add(g)
        else:
            raise ValueError(f"unknown group {g!r}: use {', '.join(GROUPS + ATTENTION_GROUPS)}")
    return out


def _group_of(shape: GemmShape | AttentionShape) -> str:
    prefix = shape.name.split(".")[0]
    if isinstance(shape, AttentionShape):
        return f"{prefix}_attention" if f"{prefix}_attention" in ATTENTION_GROUPS else "expert_attention"
    return prefix if prefix in GROUPS else "vlm"


def plan_items(
    groups: Iterable[str] = GROUPS,
    views: Sequence[int] = (1, 2, 3),
    prompts: Sequence[int] = (0, 20),
    chunks: Sequence[int] = (63, 50),
    *,
    batches: Sequence[int] = (1,),
    shapes: Iterable[GemmShape] | None = None,
    attention_shapes: Iterable[AttentionShape] | None = None,
) -> list[TuneItem]:
    """The shapes to tune, most important first, one item per table key.

    Order: expert GEMMs (M = chunk + 1 in `chunks` order: 64, then 51), expert attention, VLM GEMMs (prompts in
    order, then views: 256, 768, then 276, 788), SigLIP GEMMs, then prefix and SigLIP attention.
    `batches`: the batch sizes the engines are built for (the server's buckets: every GEMM's M times B, attention's
    B); each batch's items follow the previous batch's in that order. `shapes` / `attention_shapes` replace the π0
    lists (and are not filtered by group)."""
    wanted = _expand_groups(groups)
    items: list[TuneItem] = []
    if shapes is not None or attention_shapes is not None:
        for i, s in enumerate(list(shapes or []) + list(attention_shapes or [])):
            items.append(TuneItem(i, _group_of(s), s))
        return _unique(items)
    rank = {"expert": 0, "expert_attention": 1, "vlm": 2, "siglip": 3, "prefix_attention": 4, "siglip_attention": 5}
    order = 0

    def add(group: str, found: Iterable) -> None:
        nonlocal order
        if group in wanted:
            for s in found:
                items.append(TuneItem(rank[group] * 10_000 + order, group, s))
                order += 1

    for bi, b in enumerate(batches):
        order = bi * 1_000_000  # batch-major: every shape of batch 1 before any of batch 2
        bs = (b,)
        for chunk in chunks:
            expert = pi0_gemm_shapes(views=(), prompts=(), chunks=(chunk,), batches=bs)
            add("expert", (s for s in expert if s.name.startswith("expert")))
        for v in views:
            for p in prompts:
                for h in chunks:
                    found = pi0_attention_shapes((v,), (p,), (h,), batches=bs)
                    add("expert_attention", (s for s in found if s.name.startswith("expert")))
        for p in prompts:
            for v in views:
                vlm = pi0_gemm_shapes(views=(v,), prompts=(p,), chunks=(), batches=bs)
                add("vlm", (s for s in vlm if s.name.startswith("vlm")))
        for v in views:
            siglip = pi0_gemm_shapes(views=(v,), prompts=(), chunks=(), batches=bs)
            add("siglip", (s for s in siglip if s.name.startswith("siglip")))
        for v in views:
            for p in prompts:
                found = pi0_attention_shapes((v,), (p,), (), batches=bs)
                add("prefix_attention", (s for s in found if s.name.startswith("prefix")))
        for v in views:
            found = pi0_attention_shapes((v,), (), (), batches=bs)
            add("siglip_attention", (s for s in found if s.name.startswith("siglip")))
    return _unique(sorted(items, key=lambda it: it.priority))


def _unique(items: list[TuneItem]) -> list[TuneItem]:
    seen, out = set(), []
    for it in items:
        if (it.kind, it.key) not in seen:
            seen.add((it.kind, it.key))
            out.append(it)
    return out


def waves(items: Sequence[TuneItem]) -> list[list[TuneItem]]:
    """Items cut into the waves that are compiled, then timed, one after another: expert GEMMs and expert
    attention; VLM; SigLIP; the rest."""
    wave_of = {"expert": 0, "expert_attention": 0, "vlm": 1, "siglip": 2}
    out: list[list[TuneItem]] = [[], [], [], []]
    for it in items:
        out[wave_of.get(it.group, 3)].append(it)
    return [w for w in out if w]


def _diverse_top(
    configs: Sequence,
    cost: Callable[[object], float],
    n: int,
    structures: Sequence[tuple[Callable[[object], tuple], float]],
    must: Sequence = (),
) -> list:
    """`must` first, then, for each (structure, share): the cheapest config of every structure not yet present, in
    cost order, up to `share` of `n`; then the cheapest of the rest up to `n`. So a few dozen candidates cover the
    structurally different choices (tile width, split count, reduction) the cost model is least sure about."""
    ranked = sorted(configs, key=cost)
    out = list(dict.fromkeys(must))
    for structure, share in structures:
        seen = {structure(c) for c in out}
        cap = len(out) + max(1, round(share * n))
        for c in ranked:
            if len(out) >= min(cap, n):
                break
            if structure(c) not in seen and c not in out:
                seen.add(structure(c))
                out.append(c)
    for c in ranked:
        if len(out) >= n:
            break
        if c not in out:
            out.append(c)
    return out


def gemm_candidates(
    m: int,
    n: int,
    k: int,
    gated: bool,
    elem_bytes: int = 2,
    quick: bool = False,
    *,
    limit: int | None = None,
    must: Sequence[GemmConfig] = (),
    num_sms: int = 132,
    admit: Callable[[GemmConfig], bool] | None = None,
) -> list[GemmConfig]:
    """Configs worth timing for this GEMM: `must` (e.g. the current table entry), the heuristic's pick, then a
    cost-model ranking of `gemm_space` spread over tile widths, split counts and both reductions (about 20 with
    `quick`, 100 without). `admit`: a filter on every config, `must` included (e.g. what this shape can run)."""
    space = gemm_space(m, n, k, gated=gated, elem_bytes=elem_bytes)
    must = [*must, gemm_heuristic(m, n, k, gated=gated, elem_bytes=elem_bytes, num_sms=num_sms)]
    if admit is not None:  # the configs this shape can run as configured (the caller knows its epilogue)
        space, must = [c for c in space if admit(c)], [c for c in must if admit(c)]

    def cost(c):
        return gemm_cost_us(m, n, k, gated, c, elem_bytes=elem_bytes, num_sms=num_sms)

    if m <= 128:
        structures = [
            (lambda c: (c.split_k,), 0.25),
            (lambda c: (c.block_n, c.split_k, c.combine), 0.35),
            (lambda c: (c.block_k, c.num_warps), 0.2),
            (lambda c: (c.tma, c.block_n), 0.1),
        ]
    else:
        structures = [
            (lambda c: (c.split_k,), 0.1),
            (lambda c: (c.tma, c.block_m, c.block_n), 0.4),
            (lambda c: (c.block_m, c.block_n, c.split_k, c.combine), 0.2),
            (lambda c: (c.block_k, c.num_stages, c.num_warps), 0.1),
        ]
    return _diverse_top(space, cost, limit or (QUICK_CANDIDATES if quick else FULL_CANDIDATES), structures, must)


def attention_candidates(
    s: AttentionShape,
    quick: bool = False,
    *,
    limit: int | None = None,
    must: Sequence[AttentionConfig] = (),
    num_sms: int = 132,
) -> list[AttentionConfig]:
    """Configs worth timing for this attention: `must`, the heuristic's pick, then a cost-model ranking of
    `attention_space` spread over row blocks, split counts, both merges, GQA packing and key tiles."""
    space = attention_space(s.b, s.tq, s.tk, s.hq, s.hkv, s.d)
    must = [*must, attention_heuristic(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, num_sms=num_sms)]

    def cost(c):
        return attention_cost_us(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, c, num_sms=num_sms)

    structures = [
        (lambda c: (c.num_splits,), 0.25),
        (lambda c: (c.tma, c.block_m, c.num_warps), 0.2),
        (lambda c: (c.block_m, c.num_splits, c.combine), 0.3),
        (lambda c: (c.heads_per_program, c.block_n), 0.15),
    ]
    return _diverse_top(space, cost, limit or (QUICK_CANDIDATES if quick else FULL_CANDIDATES), structures, must)


def candidates_for(item: TuneItem, quick: bool, limit: int | None, current, num_sms: int) -> list:
    """The configs to time for `item`: `current` (the table's entry) first, with its TMA twins for a GEMM, then
    `gemm_candidates` / `attention_candidates` (`limit`: at most that many)."""
    s = item.shape
    must = [current] if current is not None else []
    if item.kind == "gemm":  # a RoPE GEMM tiles (head, i) pairs: the candidates of a gated GEMM with N/2 columns
        if current is not None and not current.tma and (current.split_k == 1 or current.combine == 1):
            # the incumbent's tiles with TMA loads: the ranking may not reach them, and they are the likeliest win
            must += [dataclasses.replace(current, tma=mode) for mode in (1, 2)]
        if current is not None and current.split_k == 1 and current.tma != 4:
            must.append(dataclasses.replace(current, tma=4))  # its tiles in stream-K: the last wave's K spread out
        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        # not the TMA configs `gemm` would run on the pointer kernel (RoPE tiles straddling a half head):
        # they would time the pointer kernel again under another name
        rope_half = s.rope_heads[2] // 2 if s.rope else 0
        cands = gemm_candidates(s.m, n_cols, s.k, paired, 2, quick, limit=limit, must=must, num_sms=num_sms,
                                admit=lambda c: not c.tma or tma_config_applies(c, rope_half=rope_half))  # fmt: skip
        return cands[:limit] if limit else cands
    if current is not None and not current.tma:  # the incumbent's tiles on the TMA kernel, where they fit it
        twin = dataclasses.replace(current, tma=1, combine=int(current.num_splits > 1))
        if twin in attention_space(s.b, s.tq, s.tk, s.hq, s.hkv, s.d):
            must.append(twin)
    return attention_candidates(s, quick, limit=limit, must=must, num_sms=num_sms)


def compile_key(item: TuneItem, cfg) -> tuple:
    """What Triton specialises a launch on, approximately: flags, ints divisible by 16, the config. Two
    candidates with one key compile once (a wrong guess only costs a compile in the timing process)."""
    s = item.shape
    if isinstance(s, GemmShape):
        k_row = -(-s.k // 8) * 8
        ints = (s.m, s.n, s.k, k_row, 256 if s.name == "siglip.patch" else s.m)
        flags = (s.gated, s.bias, s.row_scale, s.activation, s.residual, s.name == "siglip.patch", s.rope)
        even_k = s.k % (cfg.block_k * cfg.split_k) == 0
        return ("gemm", flags, tuple(x % 16 == 0 for x in ints), even_k, cfg)
    ints = (s.tq, s.tk, s.tq * s.hq * s.d, s.tk * s.hkv * s.d)
    return ("attention", s.masked, s.d, s.hq // s.hkv, s.hkv, s.b > 1, tuple(x % 16 == 0 for x in ints), cfg)
