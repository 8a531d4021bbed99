"""How the tuner measures one shape: inputs laid out as the engine allocates them, each candidate checked against an
fp32 torch reference, then timed in a CUDA Graph (`vla_rt.timing.time_graph`) cycling through enough weight copies
to defeat the L2, as inference sees them. The kernel benchmark (`vla_rt.bench.kernels`) builds its inputs here too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from vla_rt.timing import time_graph

from ..attention import attention, attention_reference
from ..attention_configs import AttentionConfig
from ..cublas_choice import cublas_gemm
from ..gemm import gemm
from ..gemm import workspace_need as gemm_workspace_need
from ..gemm_tma import INTERPRETER_PROGRAMS, num_programs
from ..launch_configs import GemmConfig, tile_columns
from ..shapes import TOKENS_PER_VIEW, AttentionShape, GemmShape
from ..workspace import Workspace
from .candidates import TuneItem

__all__ = [
    "L2_DEFEAT_BYTES",
    "ContextLost",
    "attention_inputs",
    "candidate_workspace",
    "gemm_inputs",
    "gemm_outputs",
    "gemm_reference",
    "graph_timer",
    "launch_attention",
    "launch_gemm",
    "measure_item",
    "poison_gemm",
    "weight_copies",
]

L2_DEFEAT_BYTES = 128 << 20  # weight copies cycled through per timing: more than twice the H200's 50 MB L2


def weight_copies(s: GemmShape, dtype: torch.dtype) -> int:
    """How many copies of the shape's weight a timing cycles through so that each launch reads it from HBM."""
    w_bytes = s.n * (2 if s.gated else 1) * s.k * torch.tensor([], dtype=dtype).element_size()
    return max(1, min(64, math.ceil(L2_DEFEAT_BYTES / w_bytes)))


def gemm_inputs(s: GemmShape, dtype: torch.dtype, device, copies: int = 1) -> dict:
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


def gemm_outputs(x: dict) -> torch.Tensor:
    """What a launch writes, as one (M, ...) fp32 tensor: `out`, or with RoPE the Q columns and the K/V rows."""
    rope = x["kw"].get("rope")
    if rope is None:
        return x["out"].float()
    hq, d, off = rope["num_q_heads"], rope["head_dim"], rope["cache_offset"]
    m = x["out"].shape[0]
    kv = x["cache"][:, 0, off:].permute(1, 0, 2, 3).reshape(m, -1)
    return torch.cat([x["out"][:, : hq * d], kv], dim=1).float()


def poison_gemm(x: dict) -> None:
    x["out"].fill_(float("nan"))
    if "cache" in x:
        x["cache"].fill_(float("nan"))


def launch_gemm(x: dict, cfg: GemmConfig | None, i: int = 0, workspace=None) -> None:
    gemm(x["a"], x["ws"][i], x["out"], config=cfg, workspace=workspace, **x["kw"])


def time_cublas(x: dict, ref: torch.Tensor, timer, copies: int) -> float | None:
    """cuBLAS with this shape's own epilogue (`cublas_choice.cublas_gemm`: the call `gemm` makes when the table says
    cuBLAS is faster; with RoPE, cuBLAS then `rope_qk`), checked against the reference as a candidate is; None where
    cuBLAS does not express the epilogue. `torch_us` times the plain GEMM only, which flattered cuBLAS where the epilogue costs a second
    call (a residual with a bias)."""
    kw, out = x["kw"], x["out"]
    # the engine's residual is its output (x += ...): start `out` as the residual (a periodic one is refused anyway)
    into = out if kw["residual"] is not None and kw["residual_period"] is None else None

    def run(i: int) -> bool:
        return cublas_gemm(x["a"], x["ws"][i], out, **{**kw, "residual": into})

    if into is not None:
        out.copy_(kw["residual"])
    else:
        poison_gemm(x)
    if not run(0):
        return None
    rel = ((gemm_outputs(x) - ref).norm() / ref.norm()).item()  # with RoPE: the Q columns and the cache rows
    if not rel < 2e-2:
        raise RuntimeError(f"cuBLAS with the epilogue: relative error {rel:.2e}")
    return round(timer(run, copies), 3)


def gemm_reference(x: dict) -> torch.Tensor:
    """fp32 torch of what `gemm_outputs` collects."""
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


def attention_inputs(s: AttentionShape, dtype: torch.dtype, device) -> dict:
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


def launch_attention(x: dict, cfg: AttentionConfig, i: int = 0, workspace=None) -> None:
    attention(x["q"], x["k"], x["v"], x["out"], scale=x["scale"], config=cfg, workspace=workspace, **x["blocks"])


def candidate_workspace(item: TuneItem, cfg) -> tuple[int, int]:
    """(floats, counters) a candidate asks of its workspace, so the timing phase reserves them before capture."""
    s = item.shape
    if isinstance(s, GemmShape):
        n_cols, paired = tile_columns(s.n, s.gated, s.rope)
        programs = num_programs(torch.device("cuda")) if torch.cuda.is_available() else INTERPRETER_PROGRAMS
        floats, counters = gemm_workspace_need(s.m, n_cols, cfg, paired=paired, k=s.k, programs=programs)
        tiles = -(-s.m // cfg.block_m) * -(-n_cols // cfg.block_n) if cfg.split_k > 1 else 0
        return floats, max(counters, tiles)
    if cfg.num_splits == 1:
        return 0, 0
    block_d = max(16, 1 << math.ceil(math.log2(s.d)))
    tiles = -(-s.tq // (cfg.block_m // cfg.heads_per_program)) * s.b * s.hkv * (s.hq // s.hkv // cfg.heads_per_program)
    return tiles * cfg.num_splits * cfg.block_m * (block_d + 2), tiles


class ContextLost(RuntimeError):
    """The CUDA context is gone (a candidate crashed the device): nothing more can be timed in this process."""


def graph_timer(launch: Callable[[int], None], copies: int) -> float:
    """µs a launch: the median of 15 replays of a CUDA Graph of max(copies, 20) back-to-back launches."""
    return time_graph(launch, copies=copies, calls=20, replays=15).median_us


def measure_item(
    item: TuneItem,
    configs: Sequence,
    dtype: torch.dtype,
    timer: Callable[[Callable[[int], None], int], float],
    deadline: float,
    status: Callable[[TuneItem, object], tuple[bool | None, str]],
    device: torch.device,
) -> dict:
    """Time every candidate of `item` (in this process); returns the log record with every candidate's fate.
    `status(item, cfg)` says whether its pre-compile failed (then it is skipped), `timer(launch, copies)` gives µs."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    s = item.shape
    if item.kind == "gemm":
        copies = weight_copies(s, dtype)
        x = gemm_inputs(s, dtype, device, copies)
        ref, launch_fn = gemm_reference(x), launch_gemm
    else:
        copies = 1
        x = attention_inputs(s, dtype, device)
        ref, launch_fn = (
            attention_reference(x["q"], x["k"], x["v"], scale=x["scale"], **x["blocks"]),
            launch_attention,
        )
    ws = Workspace(device)
    needs = [candidate_workspace(item, c) for c in configs]
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
                poison_gemm(x)
            else:
                x["out"].fill_(float("nan"))
            launch_fn(x, cfg, 0, ws)
            sync()
            if time.perf_counter() - start > 0.5:
                record["compiled_here"] += 1
            got = gemm_outputs(x) if item.kind == "gemm" else x["out"].float()
            rel = ((got - ref).norm() / ref.norm()).item()
            if not rel < 2e-2:
                raise RuntimeError(f"relative error {rel:.2e}")
            entry["us"] = round(timer(lambda i, cfg=cfg: launch_fn(x, cfg, i, ws), copies), 3)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            try:
                sync()
            except Exception as lost:
                raise ContextLost(f"CUDA context lost while timing {item.label} {cfg}: {lost}") from e
    try:
        if item.kind == "gemm":
            a, wl, mm_out = x["a"], x["ws"], x["mm_out"]
            record["torch_us"] = round(timer(lambda i: torch.mm(a, wl[i].T, out=mm_out), copies), 3)
            cublas_us = time_cublas(x, ref, timer, copies)
            if cublas_us is not None:
                record["cublas_us"] = cublas_us
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
