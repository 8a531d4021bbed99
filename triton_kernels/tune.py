"""Measure candidate launch configs on the current GPU and write the winners to `configs/<gpu-name>.json`.

`tune()` works in two phases so that it fits a 10-minute GPU call:

1. **Pre-compilation** in a pool of worker processes (spawn; `workers`, default one per core but one): each worker
   launches every candidate once on inputs with exactly the shapes, dtypes, strides and alignment the timing phase
   uses, so Triton's on-disk cache holds every binary the timing phase will ask for. A candidate that fails to
   compile or launch there is never launched by the timing process.
2. **Timing** in this one process, never concurrently: each candidate is checked against torch once, then timed
   inside a CUDA Graph of back-to-back launches that cycle through enough weight copies to defeat L2 (as
   `bench_kernels` times kernels, and as the engine runs them), or with `triton.testing.do_bench`.

Shapes go in priority order (expert GEMMs at M = 64 then 51, expert attention, VLM GEMMs, SigLIP GEMMs, then
the rest) and in waves of that order; `budget_s` stops gracefully, and the table is rewritten after every shape, so
whatever was measured is kept. Each measured entry keeps its time (`us`), cuBLAS's or SDPA's (`torch_us`), the time
of the config it replaced (`seed_us`) and `"src": "tune"`; entries seeded from the heuristics say `"src": "seed"`.

    python -m vla_rt.triton_kernels.tune --quick --budget-s 480 --log tune_log.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention_configs import (
    AttentionConfig,
    _attention_config_cuda,
    attention_cost_us,
    attention_heuristic,
    attention_key,
    attention_space,
)
from .gemm_tma import tma_config_applies
from .launch_configs import (
    GemmConfig,
    _gemm_config_cuda,
    dump_table,
    gemm_cost_us,
    gemm_heuristic,
    gemm_key,
    gemm_space,
    load_table,
    table_path,
    tile_columns,
)
from .shapes import (
    TOKENS_PER_VIEW,
    AttentionShape,
    GemmShape,
    pi0_attention_shapes,
    pi0_gemm_shapes,
)

__all__ = [
    "GROUPS",
    "TuneItem",
    "attention_candidates",
    "estimate_seconds",
    "gemm_candidates",
    "plan_items",
    "seed_table",
    "tune",
]

GROUPS = ("expert", "vlm", "siglip", "attention")
ATTENTION_GROUPS = ("expert_attention", "prefix_attention", "siglip_attention")  # "attention" = all three
QUICK_CANDIDATES = 20
FULL_CANDIDATES = 100
# Estimates for the H200 box (16 cores): one Triton compile on one core, timing one candidate, one shape's setup.
COMPILE_S = 2.0
TIME_S = 0.05
SHAPE_S = 0.6
STARTUP_S = 15.0
# No pre-compile finished for this long: the rest are abandoned. On the H200 with Triton 3.6 two TMA kernels never
# returned (the tune of the wide GEMMs stalled at 321/323 until its budget ran out); a normal compile takes < 10 s
STALL_S = 60.0


# ------------------------------------------------------------------------------------------------ the plan


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
    shapes: Iterable[GemmShape] | None = None,
    attention_shapes: Iterable[AttentionShape] | None = None,
) -> list[TuneItem]:
    """The shapes to tune, most important first, one item per table key.

    Order: expert GEMMs (M = chunk + 1 in `chunks` order: 64, then 51), expert attention, VLM GEMMs (prompts in
    order, then views: 256, 768, then 276, 788), SigLIP GEMMs, then prefix and SigLIP attention.
    `shapes` / `attention_shapes` replace the π0 lists (and are not filtered by group)."""
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

    for chunk in chunks:
        add(
            "expert", (s for s in pi0_gemm_shapes(views=(), prompts=(), chunks=(chunk,)) if s.name.startswith("expert"))
        )
    for v in views:
        for p in prompts:
            for h in chunks:
                add(
                    "expert_attention",
                    (s for s in pi0_attention_shapes((v,), (p,), (h,)) if s.name.startswith("expert")),
                )
    for p in prompts:
        for v in views:
            add("vlm", (s for s in pi0_gemm_shapes(views=(v,), prompts=(p,), chunks=()) if s.name.startswith("vlm")))
    for v in views:
        add("siglip", (s for s in pi0_gemm_shapes(views=(v,), prompts=(), chunks=()) if s.name.startswith("siglip")))
    for v in views:
        for p in prompts:
            add("prefix_attention", (s for s in pi0_attention_shapes((v,), (p,), ()) if s.name.startswith("prefix")))
    for v in views:
        add("siglip_attention", (s for s in pi0_attention_shapes((v,), (), ()) if s.name.startswith("siglip")))
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


# ------------------------------------------------------------------------------------------ the candidates


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
        (lambda c: (c.block_m, c.num_splits, c.combine), 0.35),
        (lambda c: (c.heads_per_program, c.block_n), 0.2),
    ]
    return _diverse_top(space, cost, limit or (QUICK_CANDIDATES if quick else FULL_CANDIDATES), structures, must)


def _candidates(item: TuneItem, quick: bool, limit: int | None, current, num_sms: int) -> list:
    s = item.shape
    must = [current] if current is not None else []
    if item.kind == "gemm":  # a RoPE GEMM tiles (head, i) pairs: the candidates of a gated GEMM with N/2 columns
        if current is not None and not current.tma and (current.split_k == 1 or current.combine == 1):
            # the incumbent's tiles with TMA loads: the ranking may not reach them, and they are the likeliest win
            must += [dataclasses.replace(current, tma=mode) for mode in (1, 2)]
        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        # not the TMA configs `gemm` would run on the pointer kernel (RoPE tiles straddling a half head):
        # they would time the pointer kernel again under another name
        rope_half = s.rope_heads[2] // 2 if s.rope else 0
        cands = gemm_candidates(s.m, n_cols, s.k, paired, 2, quick, limit=limit, must=must, num_sms=num_sms,
                                admit=lambda c: not c.tma or tma_config_applies(c, rope_half=rope_half))  # fmt: skip
        return cands[:limit] if limit else cands
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


# ---------------------------------------------------------------------------------------- inputs & launches


def _gemm_setup(s: GemmShape, dtype: torch.dtype, device, copies: int = 1) -> dict:
    """Inputs as the engine allocates them: rows padded to 16 bytes (SigLIP's K = 588 in a 592-wide buffer), the
    patch GEMM's position embedding as a 256-row periodic residual. `copies` weight copies defeat L2. RoPE shapes:
    the expert's layout (RoPE angles, a KV cache with 816 prefix rows before the written ones)."""
    n_w = s.n * (2 if s.gated else 1)
    k_row = -(-s.k // 8) * 8
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dt=dtype, std=1.0):
        return (torch.randn(*shape, device=device, generator=g) * std).to(dt)

    period = TOKENS_PER_VIEW if s.name == "siglip.patch" and s.residual else None
    ws = [rand(n_w, k_row, std=s.k**-0.5)[:, : s.k] for _ in range(copies)]
    a = rand(s.m, k_row)
    x = dict(
        a=a[:, : s.k],
        ws=ws,
        out=torch.empty(s.m, s.n, device=device, dtype=dtype),
        mm_out=torch.empty(s.m, n_w, device=device, dtype=dtype),
        kw=dict(
            bias=rand(n_w) if s.bias else None,
            row_scale=rand(s.m, dt=torch.float32).abs() + 0.5 if s.row_scale else None,
            residual=rand(period or s.m, s.n) if s.residual else None,
            residual_period=period,
            activation=s.activation,
            gated=s.gated,
        ),
    )
    if s.rope:
        hq, hkv, d = s.rope_heads
        offset = 816
        ang = (torch.arange(s.m, device=device)[:, None] + offset) * 10_000 ** (
            -torch.arange(d // 2, device=device) * 2 / d
        )
        cache = torch.empty(2, 1, offset + s.m, hkv, d, device=device, dtype=dtype)
        x["kw"]["rope"] = dict(cos=ang.cos().float(), sin=ang.sin().float(), k_cache=cache[0], v_cache=cache[1],
                               num_q_heads=hq, num_kv_heads=hkv, head_dim=d, cache_offset=offset)  # fmt: skip
        x["cache"] = cache
    return x


def _gemm_outputs(x: dict) -> torch.Tensor:
    """What a launch writes, as one (M, ...) fp32 tensor: `out`, or with RoPE the Q columns and the K/V rows."""
    rope = x["kw"].get("rope")
    if rope is None:
        return x["out"].float()
    hq, d, off = rope["num_q_heads"], rope["head_dim"], rope["cache_offset"]
    m = x["out"].shape[0]
    kv = x["cache"][:, 0, off:].permute(1, 0, 2, 3).reshape(m, -1)
    return torch.cat([x["out"][:, : hq * d], kv], dim=1).float()


def _gemm_poison(x: dict) -> None:
    x["out"].fill_(float("nan"))
    if "cache" in x:
        x["cache"].fill_(float("nan"))


def _gemm_launch(x: dict, cfg: GemmConfig, i: int = 0, workspace=None) -> None:
    from .gemm import gemm

    gemm(x["a"], x["ws"][i], x["out"], config=cfg, workspace=workspace, **x["kw"])


def _gemm_reference(x: dict) -> torch.Tensor:
    """fp32 torch of what `_gemm_outputs` collects."""
    kw = x["kw"]
    y = x["a"].float() @ x["ws"][0].float().T
    y = y * kw["row_scale"][:, None] if kw["row_scale"] is not None else y
    if kw.get("rope") is not None:
        r = kw["rope"]
        hq, hkv, d = r["num_q_heads"], r["num_kv_heads"], r["head_dim"]
        h = y.view(y.shape[0], hq + 2 * hkv, d)
        h1, h2 = h[..., : d // 2], h[..., d // 2 :]
        c, s = r["cos"][:, None], r["sin"][:, None]
        rot = torch.cat([h1 * c - h2 * s, h2 * c + h1 * s], dim=-1)
        return torch.cat([rot[:, :hq] * r.get("q_scale", 1.0), rot[:, hq : hq + hkv], h[:, hq + hkv :]], 1).flatten(1)
    y = y + kw["bias"].float() if kw["bias"] is not None else y
    if kw["gated"]:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.gelu(gate, approximate="tanh") * up
    elif kw["activation"] == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif kw["activation"] == "silu":
        y = torch.nn.functional.silu(y)
    if kw["residual"] is not None:
        res = kw["residual"].float()
        y = y + (res.repeat(y.shape[0] // res.shape[0] + 1, 1)[: y.shape[0]] if kw["residual_period"] else res)
    return y


def _attention_setup(s: AttentionShape, dtype: torch.dtype, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(s.b, s.tq, s.hq, s.d, device=device, generator=g).to(dtype)
    k = torch.randn(s.b, s.tk, s.hkv, s.d, device=device, generator=g).to(dtype)
    v = torch.randn(s.b, s.tk, s.hkv, s.d, device=device, generator=g).to(dtype)
    blocks = {}
    if s.masked:  # prefix keys block 0; the last tq keys (the suffix in the expert case) one more block
        k_block = torch.zeros(s.b, s.tk, dtype=torch.int32, device=device)
        k_block[:, s.tk - s.tq :] = 1 if s.tq < s.tk else 0
        blocks = dict(q_block=torch.ones(s.b, s.tq, dtype=torch.int32, device=device), k_block=k_block)
    return dict(q=q, k=k, v=v, out=torch.empty_like(q), blocks=blocks, scale=s.d**-0.5)


def _attention_launch(x: dict, cfg: AttentionConfig, i: int = 0, workspace=None) -> None:
    from .attention import attention

    attention(x["q"], x["k"], x["v"], x["out"], scale=x["scale"], config=cfg, workspace=workspace, **x["blocks"])


def _workspace_need(item: TuneItem, cfg) -> tuple[int, int]:
    """(floats, counters) a candidate asks of its workspace, so the timing phase reserves them before capture."""
    s = item.shape
    if isinstance(s, GemmShape):
        from .gemm import workspace_need

        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        floats, counters = workspace_need(s.m, n_cols, cfg, paired=paired)
        tiles = -(-s.m // cfg.block_m) * -(-n_cols // cfg.block_n) if cfg.split_k > 1 else 0
        return floats, max(counters, tiles)
    if cfg.num_splits == 1:
        return 0, 0
    block_d = max(16, 1 << math.ceil(math.log2(s.d)))
    tiles = -(-s.tq // (cfg.block_m // cfg.heads_per_program)) * s.b * s.hkv * (s.hq // s.hkv // cfg.heads_per_program)
    return tiles * cfg.num_splits * cfg.block_m * (block_d + 2), tiles


# --------------------------------------------------------------------------------------- pre-compilation pool

_WORKER: dict = {"dead": False, "cache": {}, "device": "cuda"}


def _worker_init(device: str) -> None:
    _WORKER["device"] = device
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


def _precompile(item: TuneItem, cfg, dtype_name: str) -> tuple[bool | None, str, float]:
    """Worker: launch `cfg` once on the timing phase's inputs (so Triton compiles and caches it). Returns (ok, error,
    seconds); ok None when this worker's CUDA context is gone and nothing was tried."""
    if _WORKER["dead"]:
        return None, "worker CUDA context lost", 0.0
    start = time.perf_counter()
    dtype = getattr(torch, dtype_name)
    device = torch.device(_WORKER["device"])
    from .workspace import Workspace

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        cache = _WORKER["cache"]
        key = (item.kind, item.shape, dtype_name)
        if key not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            setup = _gemm_setup if item.kind == "gemm" else _attention_setup
            cache[key] = (setup(item.shape, dtype, device), Workspace(device))
        x, ws = cache[key]
        (_gemm_launch if item.kind == "gemm" else _attention_launch)(x, cfg, 0, ws)
        sync()
        return True, "", time.perf_counter() - start
    except Exception as e:  # a config that fails to compile or run is reported, not fatal
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            sync()
        except Exception:
            _WORKER["dead"] = True
        return False, msg, time.perf_counter() - start


class _Precompiler:
    """A spawn pool that pre-compiles (item, config) pairs, once per `compile_key`, in submission order."""

    def __init__(self, workers: int, device: str, dtype_name: str):
        ctx = multiprocessing.get_context("spawn")
        self.pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(device,))
        self.dtype_name = dtype_name
        self.futures: dict[tuple, cf.Future] = {}
        self.seconds: list[float] = []
        self.abandoned: set[int] = set()  # ids of futures given up on (a compile or launch that hangs)

    def submit(self, item: TuneItem, configs: Sequence) -> None:
        for cfg in configs:
            key = compile_key(item, cfg)
            if key not in self.futures:
                fut = self.pool.submit(_precompile, item, cfg, self.dtype_name)
                fut.add_done_callback(self._done)
                self.futures[key] = fut

    def _done(self, f: cf.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            self.seconds.append(f.result()[2])

    def pending(self, item: TuneItem, configs: Sequence) -> list[cf.Future]:
        return [f for c in configs if (f := self.futures.get(compile_key(item, c))) is not None and not f.done()
                and id(f) not in self.abandoned]  # fmt: skip

    def abandon(self, futures: Iterable[cf.Future]) -> None:
        """Stop waiting for `futures`: their candidates count as failed, so the timing process never launches a
        kernel that hung in a worker (it would hang there too)."""
        self.abandoned.update(id(f) for f in futures)

    def status(self, item: TuneItem, cfg) -> tuple[bool | None, str]:
        """(True, "") compiled and ran; (False, error) failed in a worker or was abandoned; (None, why) unknown."""
        f = self.futures.get(compile_key(item, cfg))
        if f is not None and id(f) in self.abandoned and not f.done():
            return False, f"pre-compile abandoned: no progress for {STALL_S:.0f} s (a compile or launch that hangs)"
        if f is None or not f.done() or f.cancelled():
            return None, "not pre-compiled"
        try:
            ok, err, _ = f.result()
        except Exception as e:  # the worker process died
            return None, f"pre-compile worker failed: {type(e).__name__}"
        return ok, err

    def progress(self) -> tuple[int, int]:
        return sum(f.done() for f in self.futures.values()), len(self.futures)

    def shutdown(self) -> None:
        procs = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:  # our own workers: end what still compiles
            if proc.is_alive():
                proc.terminate()


# ---------------------------------------------------------------------------------------------- the timing


class _ContextLost(RuntimeError):
    pass


def _time_graph(launch: Callable[[int], None], copies: int) -> float:
    from .bench_kernels import time_in_graph

    return time_in_graph(launch, copies, launches=20, replays=15)


def _time_do_bench(launch: Callable[[int], None], copies: int) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: launch(0), warmup=10, rep=40) * 1e3


def _measure(
    item: TuneItem,
    configs: Sequence,
    dtype: torch.dtype,
    timer: Callable[[Callable[[int], None], int], float],
    deadline: float,
    status: Callable[[TuneItem, object], tuple[bool | None, str]],
    device: torch.device,
) -> dict:
    """Time every candidate of `item` (in this process); returns the log record with every candidate's fate."""
    from .bench_kernels import L2_DEFEAT_BYTES
    from .workspace import Workspace

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    s = item.shape
    if item.kind == "gemm":
        w_bytes = s.n * (2 if s.gated else 1) * s.k * torch.tensor([], dtype=dtype).element_size()
        copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / w_bytes)))
        x = _gemm_setup(s, dtype, device, copies)
        ref, launch_fn = _gemm_reference(x), _gemm_launch
    else:
        copies = 1
        x = _attention_setup(s, dtype, device)
        from .attention import attention_reference

        ref, launch_fn = (
            attention_reference(x["q"], x["k"], x["v"], scale=x["scale"], **x["blocks"]),
            _attention_launch,
        )
    ws = Workspace(device)
    needs = [_workspace_need(item, c) for c in configs]
    ws.reserve(max((f for f, _ in needs), default=0), max((c for _, c in needs), default=0))
    record = {"key": item.key, "name": s.name, "kind": item.kind, "candidates": [], "compiled_here": 0}
    for cfg in configs:
        if time.monotonic() > deadline:
            record["cut_by_budget"] = True
            break
        entry = {**cfg.to_dict()}
        record["candidates"].append(entry)
        ok, err = status(item, cfg)
        if ok is False:
            entry["error"] = err
            continue
        start = time.perf_counter()
        try:
            if item.kind == "gemm":
                _gemm_poison(x)
            else:
                x["out"].fill_(float("nan"))
            launch_fn(x, cfg, 0, ws)
            sync()
            if time.perf_counter() - start > 0.5:
                record["compiled_here"] += 1
            got = _gemm_outputs(x) if item.kind == "gemm" else x["out"].float()
            rel = ((got - ref).norm() / ref.norm()).item()
            if not rel < 2e-2:
                raise RuntimeError(f"relative error {rel:.2e}")
            entry["us"] = round(timer(lambda i, cfg=cfg: launch_fn(x, cfg, i, ws), copies), 3)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            try:
                sync()
            except Exception as lost:
                raise _ContextLost(f"CUDA context lost while timing {item.label} {cfg}: {lost}") from e
    try:
        if item.kind == "gemm":
            a, wl, mm_out = x["a"], x["ws"], x["mm_out"]
            record["torch_us"] = round(timer(lambda i: torch.mm(a, wl[i].T, out=mm_out), copies), 3)
        else:
            qt, kt, vt = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
            b = x["blocks"]
            mask = (b["k_block"][:, None, :] <= b["q_block"][:, :, None])[:, None] if b else None

            def sdpa(i):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mask, enable_gqa=s.hq != s.hkv
                )
                x["out"].copy_(o.transpose(1, 2))

            record["torch_us"] = round(timer(sdpa, 1), 3)
    except Exception as e:  # the reference timing is informative only
        record["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return record


def best_entry(record: dict, seed: dict | None = None) -> dict | None:
    """The table entry for a measured record: the fastest candidate's config with `us`, `torch_us`, `seed_us` (the
    time of `seed`, the config it replaces, when that was timed) and how many candidates were timed."""
    timed = [c for c in record["candidates"] if "us" in c]
    if not timed:
        return None
    best = min(timed, key=lambda c: c["us"])
    entry = {k: v for k, v in best.items() if k != "us"}
    entry["us"] = best["us"]
    if "torch_us" in record:
        entry["torch_us"] = record["torch_us"]
    if seed is not None:
        seed_times = [c["us"] for c in timed if {k: c[k] for k in seed if k in c} == seed]
        if seed_times:
            entry["seed_us"] = seed_times[0]
    entry["candidates"] = len(timed)
    entry["src"] = "tune"
    return entry


def merge_entry(table: dict, kind: str, dtype_name: str, key: str, entry: dict) -> dict:
    """Put a measured entry into a table (in place): it replaces whatever was there."""
    table.setdefault(kind, {}).setdefault(dtype_name, {})[key] = entry
    return table


# ---------------------------------------------------------------------------------------------- estimates


def estimate_seconds(
    items: Sequence[TuneItem],
    configs: dict[TuneItem, list],
    workers: int,
    *,
    overlap: bool = False,
    compile_s: float = COMPILE_S,
    time_s: float = TIME_S,
    shape_s: float = SHAPE_S,
    startup_s: float = STARTUP_S,
) -> dict:
    """Rough wall-clock of `tune` for these items: unique compiles spread over the workers, plus timing."""
    keys = {compile_key(it, c) for it in items for c in configs[it]}
    compile_total = len(keys) * compile_s / max(1, workers)
    timing = sum(shape_s + len(configs[it]) * time_s for it in items)
    total = startup_s + (
        max(compile_total, timing) + min(compile_total, timing) * 0.1 if overlap else compile_total + timing
    )
    return {"compiles": len(keys), "candidates": sum(len(v) for v in configs.values()), "compile_s": compile_total,
            "timing_s": timing, "total_s": total}  # fmt: skip


# ------------------------------------------------------------------------------------------------- driver


def run_plan(
    items: Sequence[TuneItem],
    configs: dict[TuneItem, list],
    measure: Callable[[TuneItem, list, float], dict],
    on_record: Callable[[TuneItem, dict], None],
    *,
    budget_s: float | None = None,
    precompiler=None,
    overlap: bool = False,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    start: float | None = None,
    stall_s: float = STALL_S,
) -> dict:
    """The orchestration, free of CUDA (tests drive it with fakes): for each wave, pre-compile its candidates (all
    waves at once with `overlap`), wait for them, then `measure` each item in priority order and hand the record to
    `on_record`. Stops when `budget_s` is spent (also while waiting for compiles). Pre-compiles that make no
    progress for `stall_s` are abandoned (`precompiler.abandon`) and their candidates skipped. Returns a summary."""
    start = clock() if start is None else start
    deadline = start + budget_s if budget_s is not None else math.inf
    done, stopped = [], None

    def elapsed() -> str:
        return f"[{clock() - start:7.1f}s]"

    def wait(futures) -> bool:
        last = progressed = clock()
        while futures:
            left = deadline - clock()
            if left <= 0:
                return False
            poll = min(10.0, left, max(0.05, stall_s))
            finished, futures = cf.wait(futures, timeout=poll, return_when=cf.ALL_COMPLETED)
            futures = list(futures)
            if finished:
                progressed = clock()
            elif futures and clock() - progressed >= stall_s:
                log(f"{elapsed()} pre-compile: {len(futures)} kernels made no progress for {stall_s:.0f} s; "
                    "abandoned (their candidates count as failed)")  # fmt: skip
                precompiler.abandon(futures)
                return True
            if futures and clock() - last >= 9.5:
                last = clock()
                n_done, n_all = precompiler.progress()
                secs = precompiler.seconds
                avg = f", {sum(secs) / len(secs):.1f} s a launch+compile" if secs else ""
                log(f"{elapsed()} pre-compile {n_done}/{n_all} done{avg}")
        return True

    plan = waves(items)
    try:
        if precompiler is not None and overlap:
            for wave in plan:
                for it in wave:
                    precompiler.submit(it, configs[it])
        for w, wave in enumerate(plan):
            if precompiler is not None:
                if not overlap:
                    for it in wave:
                        precompiler.submit(it, configs[it])
                    pending = [f for it in wave for f in precompiler.pending(it, configs[it])]
                    if pending:
                        log(f"{elapsed()} wave {w + 1}/{len(plan)}: pre-compiling {len(pending)} kernels")
                    if not wait(pending):
                        stopped = f"budget reached while pre-compiling wave {w + 1}"
                        break
                    n_done, n_all = precompiler.progress()
                    log(f"{elapsed()} wave {w + 1}/{len(plan)}: pre-compiled ({n_done}/{n_all} in all), timing")
            for it in wave:
                if clock() >= deadline:
                    stopped = "budget reached"
                    break
                if precompiler is not None and overlap and not wait(precompiler.pending(it, configs[it])):
                    stopped = f"budget reached while pre-compiling {it.label}"
                    break
                record = measure(it, configs[it], deadline)
                done.append(it)
                on_record(it, record)
            if stopped:
                break
    except _ContextLost as e:
        stopped = str(e)
    finally:
        if precompiler is not None:
            precompiler.shutdown()
    if stopped:
        log(f"{elapsed()} stopped: {stopped}; {len(done)}/{len(items)} shapes measured")
    return {"done": done, "stopped": stopped, "elapsed_s": clock() - start}


def _fmt_cfg(c: dict) -> str:
    if "block_k" in c:
        out = f"{c['block_m']}/{c['block_n']}/{c['block_k']} sk{c['split_k']}"
    else:
        out = f"{c['block_m']}/{c['block_n']} hpp{c['heads_per_program']} split{c['num_splits']}"
    comb = f" comb{c.get('combine', 0)}" if c.get("split_k", c.get("num_splits", 1)) > 1 else ""
    return out + comb + f" w{c['num_warps']} s{c['num_stages']}" + (f" tma{c['tma']}" if c.get("tma") else "")


def tune(
    shapes: Iterable[GemmShape] | None = None,
    gpu_name: str | None = None,
    *,
    attention_shapes: Iterable[AttentionShape] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    path=None,
    quick: bool = False,
    verbose: bool = True,
    groups: Sequence[str] = GROUPS,
    views: Sequence[int] = (1, 2, 3),
    prompts: Sequence[int] = (0, 20),
    chunks: Sequence[int] = (63, 50),
    budget_s: float | None = None,
    workers: int | None = None,
    overlap: bool = False,
    timer: str = "graph",
    max_candidates: int | None = None,
    log_path=None,
    tma_modes: Sequence[int] | None = None,
) -> dict:
    """Time candidates for the π0 GEMM / attention shapes selected by `groups` ("expert", "vlm", "siglip",
    "attention", or "expert_attention" / "prefix_attention" / "siglip_attention"), `views`, `prompts` and
    `chunks` on this GPU, and write the winners into the table (`path`, default the GPU's table in configs/;
    starting from it). Returns the table.

    quick: about 20 candidates a shape (cost-model ranked, structurally spread) instead of about 100;
    max_candidates overrides either. budget_s: wall-clock limit; tuning stops gracefully and keeps what was
    measured (the table is rewritten after every shape). workers: pre-compilation processes (default: cores - 1;
    0 compiles in this process while timing). overlap: time a wave while later waves compile (faster, slightly
    noisier). timer: "graph" (CUDA Graph replays, L2 defeated by weight copies) or "do_bench". log_path: every
    candidate's time as JSON. `shapes` / `attention_shapes` replace the π0 lists. tma_modes: only GEMM candidates
    with these `GemmConfig.tma` values (0 = the pointer kernel; e.g. leave out a mode this Triton hangs on)."""
    start = time.monotonic()
    if not torch.cuda.is_available():
        raise RuntimeError("tune needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    return _tune(
        device, torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count,
        {"graph": _time_graph, "do_bench": _time_do_bench}[timer], start=start, shapes=shapes, gpu_name=gpu_name,
        attention_shapes=attention_shapes, dtype=dtype, path=path, quick=quick, verbose=verbose, groups=groups,
        views=views, prompts=prompts, chunks=chunks, budget_s=budget_s, workers=workers, overlap=overlap,
        timer_name=timer, max_candidates=max_candidates, log_path=log_path, tma_modes=tma_modes,
    )  # fmt: skip


def _tune(device, device_name: str, num_sms: int, time_fn, *, start: float, shapes, gpu_name, attention_shapes, dtype,
          path, quick, verbose, groups, views, prompts, chunks, budget_s, workers, overlap, timer_name,
          max_candidates, log_path, tma_modes=None) -> dict:  # fmt: skip
    """`tune` on a given device with a given timer (a CPU test drives it in the interpreter with a fake timer)."""
    gpu = (gpu_name or device_name).strip().replace(" ", "-")
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    dname = str(dtype).removeprefix("torch.")
    path = Path(path) if path is not None else table_path(gpu)
    base = path if path.exists() else table_path(gpu)
    table = json.loads(base.read_text()) if base.exists() else {}
    table["gpu"] = device_name
    table["source"] = (
        f"tune() on {table['gpu']}, {datetime.date.today().isoformat()}, {timer_name} timing; entries without "
        '"src": "tune" are seeded from the launch_configs heuristics'
    )
    items = plan_items(groups, views, prompts, chunks, shapes=shapes, attention_shapes=attention_shapes)
    configs, seeds = {}, {}
    for it in items:
        s = it.shape
        if it.kind == "gemm":
            cur = _gemm_config_cuda(s.m, s.n, s.k, s.gated, dtype, gpu, num_sms, s.rope)
        else:
            cur = _attention_config_cuda(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, dtype, gpu, num_sms)
        seeds[it] = cur.to_dict()
        configs[it] = _candidates(it, quick, max_candidates, cur, num_sms)
        if tma_modes is not None and it.kind == "gemm":
            configs[it] = [c for c in configs[it] if c.tma in tma_modes or c == cur]  # the incumbent stays
    cores = os.cpu_count() or 2
    workers = max(0, min(16, cores - 1)) if workers is None else workers
    est = estimate_seconds(items, configs, workers, overlap=overlap)
    say = print if verbose else (lambda *_, **__: None)
    say(
        f"tune: {len(items)} shapes, {est['candidates']} candidates, {est['compiles']} distinct kernels on "
        f"{workers} workers; estimated {est['total_s']:.0f} s ({est['compile_s']:.0f} s compiling"
        f"{' alongside' if overlap else ' +'} {est['timing_s']:.0f} s timing)"
        + (f", budget {budget_s:.0f} s" if budget_s is not None else ""),
        flush=True,
    )
    precompiler = _Precompiler(workers, str(device), dname) if workers else None
    log_records: list[dict] = []
    summary_rows: list[tuple] = []

    def status(item, cfg):
        return precompiler.status(item, cfg) if precompiler is not None else (None, "")

    def measure(item, cands, deadline):
        return _measure(item, cands, dtype, time_fn, deadline, status, device)

    def on_record(item, record):
        entry = best_entry(record, seeds[item])
        log_records.append(record)
        if entry is not None:
            merge_entry(table, item.kind, dname, item.key, entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump_table(table))
        if log_path is not None:
            Path(log_path).write_text(json.dumps({"gpu": table["gpu"], "records": log_records}, indent=1) + "\n")
        n_err = sum("error" in c for c in record["candidates"])
        t_str = f"{entry['us']:7.2f} us ({_fmt_cfg(entry)})" if entry else "no candidate ran"
        seed_str = f"seed {entry['seed_us']:.2f}" if entry and "seed_us" in entry else "seed n/a"
        summary_rows.append((item, entry))
        say(
            f"[{time.monotonic() - start:7.1f}s] {len(log_records)}/{len(items)} {item.label:<40} {t_str} | "
            f"{seed_str} | torch {record.get('torch_us', float('nan')):.2f} | {len(record['candidates'])} cand, "
            f"{n_err} failed, {record['compiled_here']} compiled here" + (" | CUT BY BUDGET" if record.get("cut_by_budget") else ""),
            flush=True,
        )  # fmt: skip

    result = run_plan(items, configs, measure, on_record, budget_s=budget_s, precompiler=precompiler,
                      overlap=overlap, log=lambda m: say(m, flush=True), start=start)  # fmt: skip
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    if verbose:
        _print_summary(summary_rows)
        say(f"tune: {len(result['done'])}/{len(items)} shapes in {result['elapsed_s']:.0f} s; wrote {path}")
    return table


def _print_summary(rows: list[tuple]) -> None:
    by_group: dict[str, list[float]] = {}
    for item, entry in rows:
        if entry is None:
            continue
        g = by_group.setdefault(item.group, [0.0, 0.0, 0.0, 0])
        g[0] += entry["us"]
        g[1] += entry.get("seed_us", float("nan"))
        g[2] += entry.get("torch_us", float("nan"))
        g[3] += 1
    print(f"{'group':<18} {'shapes':>6} {'tuned us':>10} {'seed us':>10} {'torch us':>10}")
    for g, (t, sd, tt, n) in by_group.items():
        print(f"{g:<18} {n:>6} {t:10.1f} {sd:10.1f} {tt:10.1f}")


# ------------------------------------------------------------------------------------------------ seeding


def seed_table(
    gpu: str = "NVIDIA-H200", num_sms: int = 132, dtype: torch.dtype = torch.bfloat16, *, reseed: bool = False
) -> dict:
    """Fill a table's π0 entries from the heuristics (no GPU needed; `tune` later replaces them), marked
    `"src": "seed"`. `reseed` also replaces earlier seeds; measured entries (`"src": "tune"`) are always kept."""
    path = table_path(gpu)
    table = json.loads(path.read_text()) if path.exists() else {"gpu": gpu.replace("-", " ")}
    table["source"] = (
        "seeded from the launch_configs heuristics (cost models calibrated on the first H200 run), "
        '"src": "seed"; entries with "src": "tune" are measured by tune()'
    )
    dname, elem = str(dtype).removeprefix("torch."), torch.tensor([], dtype=dtype).element_size()

    def put(entries: dict, key: str, cfg) -> None:
        old = entries.get(key)
        if old is None or (reseed and old.get("src") != "tune" and "us" not in old):
            entries[key] = {**cfg.to_dict(), "src": "seed"}

    gemms = table.setdefault("gemm", {}).setdefault(dname, {})
    for s in pi0_gemm_shapes(chunks=(50, 63)):
        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        put(gemms, gemm_key(s.m, s.n, s.k, s.gated, rope=s.rope),
            gemm_heuristic(s.m, n_cols, s.k, gated=paired, elem_bytes=elem, num_sms=num_sms))  # fmt: skip
    attns = table.setdefault("attention", {}).setdefault(dname, {})
    for s in pi0_attention_shapes():
        put(attns, attention_key(s.b, s.tq, s.tk, s.hq, s.hkv, s.d),
            attention_heuristic(s.b, s.tq, s.tk, s.hq, s.hkv, s.d, num_sms=num_sms))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(table))
    load_table.cache_clear()
    _gemm_config_cuda.cache_clear()
    _attention_config_cuda.cache_clear()
    return table


# -------------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Autotune the Triton launch configs of the π0 kernels on this GPU.")
    p.add_argument("--quick", action="store_true", help="about 20 candidates a shape instead of about 100")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help="expert,vlm,siglip,attention (or expert_attention, ...)")  # fmt: skip
    p.add_argument("--views", default="1,2,3")
    p.add_argument("--prompts", default="0,20")
    p.add_argument("--chunks", default="63,50")
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock limit; keeps what was measured")
    p.add_argument("--workers", type=int, default=None, help="pre-compilation processes (default cores - 1)")
    p.add_argument("--overlap", action="store_true", help="time while later waves compile")
    p.add_argument("--timer", choices=("graph", "do_bench"), default="graph")
    p.add_argument("--max-candidates", type=int, default=None)
    p.add_argument("--gpu-name", default=None, help="table to write (default: this GPU's name)")
    p.add_argument("--out", default=None, help="table path (default: configs/<gpu>.json); starts from the shipped one")
    p.add_argument("--log", default=None, help="write every candidate's time here (JSON)")
    p.add_argument(
        "--tma-modes",
        default=None,
        help="GEMM candidates only with these config.tma values (and the incumbent), e.g. 0,1,2",
    )
    a = p.parse_args(argv)
    tune(gpu_name=a.gpu_name, quick=a.quick, groups=tuple(filter(None, a.groups.split(","))), views=_ints(a.views),
         prompts=_ints(a.prompts), chunks=_ints(a.chunks), budget_s=a.budget_s, workers=a.workers, overlap=a.overlap,
         timer=a.timer, max_candidates=a.max_candidates, path=a.out, log_path=a.log,
         tma_modes=_ints(a.tma_modes) if a.tma_modes else None)  # fmt: skip
    return 0


if __name__ == "__main__":  # run as the package module, so worker processes unpickle its functions by name
    from vla_rt.triton_kernels.tune import main as _main

    sys.exit(_main())
