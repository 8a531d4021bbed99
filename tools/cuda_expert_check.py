"""GPU checks and timing of the persistent expert kernel (issue 19), one stage per invocation so a crash in one
does not take the others down (tools/cuda_expert_check.sh runs them all, each under `timeout`).

    python tools/cuda_expert_check.py diag        # depth 1 / 2: every internal buffer vs the per-op fp32 step
    python tools/cuda_expert_check.py accuracy    # full depth, 10 steps, many draws, the issue's cases
    python tools/cuda_expert_check.py replay      # CUDA Graph replays bit-identical, counters need no reset
    python tools/cuda_expert_check.py broken      # one hand-off short: caught by the timeout flag, not a hang
    python tools/cuda_expert_check.py bench       # step time (graph replays) vs the Triton per-op step, bandwidth
    python tools/cuda_expert_check.py once        # one small step (for compute-sanitizer)
    python tools/cuda_expert_check.py precompile  # (no GPU) every variant the stages use into $VLA_RT_CACHE

Each stage prints its rows and appends them as JSON lines to $OUT/cuda_expert.jsonl (or ./).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cuda_expert_emulator import Image, q_frag_index  # noqa: E402
from cuda_expert_problem import paired_problem, reference_step  # noqa: E402

from vla_rt.cuda_kernels.expert_schedule import F_IN_T, F_OP, OP_QK, build_schedule  # noqa: E402
from vla_rt.cuda_kernels.expert_step import PersistentExpertStep, expert_dims  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEV = torch.device("cuda")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def log(stage: str, **row) -> None:
    with open(OUT / "cuda_expert.jsonl", "a") as f:
        f.write(json.dumps({"stage": stage, **row}) + "\n")
    print(stage, " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


PI05 = False  # --pi05: every stage on π0.5's action expert


def make(depth, batch=1, views=1, prompt=0, chunk=63, seed=0):
    """(cfg, dims, fp32 problem on the GPU, bf16 problem on the GPU): the same values (weights and KV prefix are
    bf16-representable)."""
    return paired_problem(depth, DEV, batch=batch, views=views, prompt=prompt, chunk=chunk, seed=seed, pi05=PI05)


def new_draw(ref, low, seed):
    """Fresh x_t, state and prefix K/V (same weights) in both problems."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    (_, rs, rx), (_, ls, lx) = ref, low
    rx.x_t.copy_(torch.randn(rx.x_t.shape, generator=g, device=DEV))
    lx.x_t.copy_(rx.x_t)
    rs.state.copy_(torch.randn(rs.state.shape, generator=g, device=DEV))
    ls.state.copy_(rs.state)
    p = rs.key_block.shape[1] - rs.suffix_cos.shape[1]
    for rk, rv, lk, lv in zip(rs.k_cache, rs.v_cache, ls.k_cache, ls.v_cache):
        rk[:, :p].copy_(torch.randn(rk[:, :p].shape, generator=g, device=DEV).bfloat16().float())
        rv[:, :p].copy_(torch.randn(rv[:, :p].shape, generator=g, device=DEV).bfloat16().float())
        lk[:, :p].copy_(rk[:, :p])
        lv[:, :p].copy_(rv[:, :p])


def poison(slot, xa, dims):
    for k, v in zip(slot.k_cache, slot.v_cache):
        k[:, dims.prefix :].fill_(float("nan"))
        v[:, dims.prefix :].fill_(float("nan"))


def _image(t: torch.Tensor, cols: int, d) -> torch.Tensor:
    """The (rows, cols) matrix held in one of the kernel's activation images."""
    return t.float().cpu()[Image(d.m_pad, cols, d.m_tiles).idx][: d.rows]


def _chunk(run, slot, xa, steps: int):
    """One whole chunk of `steps` Euler steps through `run(slot, xa, step, steps)`."""
    return lambda: [run(slot, xa, s, steps) for s in range(steps)]


def stage_diag(args) -> None:
    for depth in (1, 2):
        cfg, dims, ref, low = make(depth, seed=depth)
        step = PersistentExpertStep(*low[:1], cfg, dims, sm_count=args.sms, tiling=args.tiling)
        w, slot, xa = low
        rw, rslot, rxa = ref
        poison(slot, xa, dims)
        x0 = xa.x_t.clone()
        t0 = time.perf_counter()
        step.run(slot, xa, 3, 10)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        reference_step(cfg, dims, rw, rslot, rxa, 3)
        d = step.d
        row = dict(depth=depth, error=step.error_code(), first_s=first, x_t_update=rel(xa.x_t - x0, rxa.x_t - x0),
                   nan_x_t=int(torch.isnan(xa.x_t).sum()))  # fmt: skip
        p = dims.prefix
        row["k_suffix"] = max(rel(slot.k_cache[i][:, p:].float(), rslot.k_cache[i][:, p:]) for i in range(depth))
        row["v_suffix"] = max(rel(slot.v_cache[i][:, p:].float(), rslot.v_cache[i][:, p:]) for i in range(depth))
        row["x_last"] = rel(_image(step.x_img, d.width, d), rxa.x.float().cpu())
        row["h_last"] = rel(_image(step.h_img, d.mlp, d), rxa.mlp.float().cpu())
        row["attn_last"] = rel(_image(step.attn_img, d.q_width, d), rxa.attn.float().cpu())
        if not cfg.pi05:  # π0's action-time embedding (π0.5 has none)
            row["emb"] = rel(_image(step.emb_img, d.width, d)[: d.act_rows], rxa.action_emb.float().cpu())
        t = torch.arange(dims.suffix)
        q = step.q_frag.float().cpu()[q_frag_index(0, torch.arange(d.heads)[:, None, None], t[None, :, None],
                                                   torch.arange(d.head_dim)[None, None], d.heads)]  # fmt: skip
        rq = rxa.qkv.float().cpu()[: dims.suffix, : d.q_width].reshape(dims.suffix, d.heads, d.head_dim)
        row["q_last"] = rel(q.permute(1, 0, 2), rq)
        log("diag", **row)


CASES = [  # (views, prompt, chunk, batch)
    (1, 0, 63, 1), (2, 0, 63, 1), (3, 0, 63, 1), (1, 20, 50, 1), (3, 20, 50, 1), (2, 20, 50, 4), (1, 0, 63, 4),
]  # fmt: skip


def _shapes(spec: str) -> list[tuple[int, int, int, int]]:
    """'views,prompt,chunk,batch;...' (e.g. the server's buckets: '2,20,50,1;2,20,50,4;2,20,50,8')."""
    shapes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields = part.split(",")
        if len(fields) != 4 or not all(f.strip().isdigit() for f in fields):
            raise argparse.ArgumentTypeError(f"--shapes: expected views,prompt,chunk,batch; found {part!r}")
        shapes.append(tuple(int(f) for f in fields))
    return shapes


def cases(args) -> list[tuple[int, int, int, int]]:
    """The shapes a stage runs: --shapes if given, else the first --cases of CASES."""
    return args.shapes or CASES[: args.cases]


def stage_accuracy(args) -> None:
    for views, prompt, chunk, batch in cases(args):
        cfg, dims, ref, low = make(18, batch, views, prompt, chunk, seed=views * 7 + prompt)
        step = PersistentExpertStep(low[0], cfg, dims, sm_count=args.sms, tiling=args.tiling)
        errs = []
        for draw in range(args.draws):
            new_draw(ref, low, 1000 + draw)
            for s in range(10):
                step.run(low[1], low[2], s, 10)
                reference_step(cfg, dims, *ref, s)
            errs.append(rel(low[2].x_t, ref[2].x_t))
        log("accuracy", views=views, prompt=prompt, chunk=chunk, batch=batch, draws=args.draws,
            median=statistics.median(errs), max=max(errs), error=step.error_code(),
            nan=int(torch.isnan(low[2].x_t).sum()))  # fmt: skip


def stage_replay(args) -> None:
    cfg, dims, ref, low = make(18, 1, 1, 0, 63, seed=11)
    step = PersistentExpertStep(low[0], cfg, dims, sm_count=args.sms, tiling=args.tiling)
    w, slot, xa = low
    noise = xa.x_t.clone()
    for s in range(10):  # eager warm-up
        step.run(slot, xa, s, 10)
    eager = xa.x_t.clone()
    xa.x_t.copy_(noise)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for s in range(10):
            step.run(slot, xa, s, 10)
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        xa.x_t.copy_(noise)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(xa.x_t.clone())
    epoch = int(step.sync_words[0])
    log("replay", eager_vs_graph_equal=bool(torch.equal(eager, outs[0])),
        replays_equal=all(torch.equal(outs[0], o) for o in outs[1:]), epoch=epoch, error=step.error_code())  # fmt: skip


def stage_broken(args) -> None:
    cfg, dims, ref, low = make(2, seed=5)
    d = expert_dims(cfg, dims, **args.tiling)
    good = PersistentExpertStep(low[0], cfg, dims, sm_count=args.sms, tiling=args.tiling)
    w, slot, xa = low
    x0 = xa.x_t.clone()
    good.run(slot, xa, 0, 10)
    want = xa.x_t.clone()
    sched = build_schedule(d, good.ctas)
    qk = next(u for u in sched.units if u.op == OP_QK and u.layer == 1)
    qk.fields[F_IN_T] += 1  # one hand-off short: this unit waits for an increment nobody makes
    bad = PersistentExpertStep(low[0], cfg, dims, sm_count=args.sms, schedule=sched, timeout_s=0.05, tiling=args.tiling)
    assert int(bad.instrs[:, F_OP].eq(OP_QK).sum()) > 0
    xa.x_t.copy_(x0)
    t0 = time.perf_counter()
    bad.run(slot, xa, 0, 10)
    torch.cuda.synchronize()
    log("broken", seconds=time.perf_counter() - t0, error=hex(bad.error_code()), good_error=good.error_code(),
        output_changed=not torch.equal(xa.x_t, want))  # fmt: skip


def _graph_time(fn, steps: int, reps: int) -> list[float]:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / steps)
    return sorted(times)


def trace_summary(step) -> dict:
    """Per op over the middle layers: the stage's span (first start to last end across CTAs), the mean wait of a
    unit for its inputs, its mean work after they arrived (of which: until its last activation item's inputs were
    ready and issued by the loader, then until its MMAs were done); and the mean layer time (µs)."""
    from vla_rt.cuda_kernels.expert_schedule import F_LAYER, OP_NAMES
    from vla_rt.cuda_kernels.expert_trace import stage_path

    raw = step.trace.cpu()
    d = step.d
    if d.prefix == 256:  # one case's raw stamps per variant (few files come back from the device)
        name = f"trace_{step.ctas}_a{d.a_ring_kb}_k{d.keys_per_split}_d{d.wgmma_depth}.pt"
        torch.save({"trace": raw, "instrs": step.instrs.cpu(), "cta_instr": step.cta_instr.cpu()}, OUT / name)
    tr = raw.double() / 1e3  # µs
    ins = step.instrs.cpu()
    t0 = tr[:, 0].min()
    tr = tr - t0
    depth = step.d.depth
    mid = range(depth // 4, depth - depth // 4)
    out = {"step_us": float(tr[:, 4].max())}
    for op, name in OP_NAMES.items():
        rows = ins[:, F_OP] == op
        if not rows.any():
            continue
        if op not in (1, 2, 10, 11):  # per-layer ops: middle layers only
            rows &= torch.isin(ins[:, F_LAYER], torch.tensor(list(mid)))
        spans = []
        for layer in sorted(set(ins[rows, F_LAYER].tolist())):
            sel = rows & (ins[:, F_LAYER] == layer)
            spans.append(float(tr[sel, 4].max() - tr[sel, 0].min()))
        out[f"{name}_span"] = statistics.mean(spans)
        out[f"{name}_wait"] = float((tr[rows, 1] - tr[rows, 0]).mean())
        out[f"{name}_mma"] = float((tr[rows, 2] - tr[rows, 1]).mean())
        out[f"{name}_epi"] = float((tr[rows, 4] - tr[rows, 2]).mean())
        # of which: MMAs done -> outputs stored (RMS wait, epilogue math, its loads), then -> signalled (barrier,
        # release fence, the counter's add)
        out[f"{name}_epi_store"] = float((tr[rows, 3] - tr[rows, 2]).mean())
        out[f"{name}_epi_release"] = float((tr[rows, 4] - tr[rows, 3]).mean())
        loaded = rows & (raw[:, 5] > 0)  # units whose loader stamped its last activation item (GEMMs, attention)
        if loaded.any():  # first input ready -> last item's inputs ready and issued -> MMAs done
            out[f"{name}_last_in"] = float((tr[loaded, 5] - tr[loaded, 1]).mean())
            out[f"{name}_after_in"] = float((tr[loaded, 2] - tr[loaded, 5]).mean())
    path = stage_path(tr, ins)  # the chain: hand-off to each stage vs the work inside it, and the layer's time
    for name, v in path.items():
        if name != "layer":
            out[f"{name}_handoff"], out[f"{name}_tail"] = v["handoff"], v["tail"]
    out["layer_us"] = path["layer"]["us"]  # the down projection's end, layer to layer, over the middle layers
    return out


def stage_bench(args) -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    copy_bw = 2 * 10 * src.numel() / (a.elapsed_time(b) * 1e-3)  # bytes read + written per second
    del src, dst
    from vla_rt.engine.expert_step import PerOpExpertStep
    from vla_rt.engine.expert_step_pi05 import Pi05ExpertStep
    from vla_rt.engine.kernels import triton_kernels
    from vla_rt.engine.plan import Pi0Plan

    choice = []
    for views, prompt, chunk, batch in cases(args):
        cfg, dims, _, low = make(18, batch, views, prompt, chunk, seed=3)
        w, slot, xa = low
        steps = 10
        row = dict(views=views, prompt=prompt, chunk=chunk, batch=batch)
        noise = xa.x_t.clone()
        first_out = None
        timed = []  # (ms, tiling) of the variants on every SM
        for sms, tiling in [(sms, {}) for sms in args.sm_list] + [(args.sm_list[0], t) for t in args.tilings]:
            step = PersistentExpertStep(w, cfg, dims, sm_count=sms, tiling=tiling)
            sms = f"{sms}" + "".join(f"_{k}{v}" for k, v in tiling.items())
            xa.x_t.copy_(noise)
            _chunk(step.run, slot, xa, steps)()
            first_out = xa.x_t.clone() if first_out is None else first_out
            row[f"cuda{sms}_same_as_first"] = bool(torch.equal(xa.x_t, first_out))
            t = _graph_time(_chunk(step.run, slot, xa, steps), steps, args.reps)
            med, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
            if (
                step.error_code() == 0
                and not tiling.get("diag")  # a diag variant skips work: timing only
                and step.ctas >= torch.cuda.get_device_properties(DEV).multi_processor_count - 8
            ):
                timed.append((med, tiling))
            wbytes = step.wstream.numel() * 2 + dims.batch * dims.prefix * 2 * 512 * cfg.expert.depth
            row.update({f"cuda{sms}_ms": med, f"cuda{sms}_p90": p90, f"cuda{sms}_bw_frac": wbytes / (med * 1e-3) / copy_bw,
                        f"cuda{sms}_error": step.error_code()})  # fmt: skip
            if sms == str(args.sm_list[0]) or args.trace_all:
                step.enable_trace()
                for s in range(steps):
                    step.run(slot, xa, s, steps)
                torch.cuda.synchronize()
                log("trace", views=views, sms=sms, **trace_summary(step))
            del step
            torch.cuda.empty_cache()
        kernels = triton_kernels()
        per_op = (Pi05ExpertStep if cfg.pi05 else PerOpExpertStep)(kernels, w, cfg, dims)
        plan = Pi0Plan(kernels, w, cfg, dims, expert_step=per_op)
        t = _graph_time(_chunk(plan.expert_step, slot, xa, steps), steps, args.reps)
        row.update(triton_ms=statistics.median(t), copy_tb_s=copy_bw / 1e12)
        log("bench", **row)
        if timed:
            best_ms, best = min(timed, key=lambda x: x[0])
            choice.append(dict(model="pi05" if cfg.pi05 else "pi0", batch=batch, prefix=dims.prefix, chunk=chunk,
                               tiling=best, persistent_ms=best_ms, per_op_ms=row["triton_ms"]))  # fmt: skip
    if args.write_choice and choice:
        print(f"wrote {write_choice(OUT, torch.cuda.get_device_name(DEV), choice)}")


def write_choice(out: Path, gpu: str, choice: list[dict]) -> Path:
    """The measured rows into `out`/cuda_expert_choice_<GPU>.json, in the committed table's format, for
    cuda_kernels/configs/<GPU>.json. Its own name because a `tune` part of the same device call writes the Triton
    launch table into $OUT as <GPU>.json. Rows of other shapes come from this call's earlier file, else from the
    committed table, so a run that measures one shape keeps the others."""
    from vla_rt.cuda_kernels.choice import table_path

    committed = table_path(gpu)
    path = out / f"cuda_expert_choice_{committed.name}"
    source = path if path.is_file() else committed
    old = json.loads(source.read_text())["steps"] if source.is_file() else []
    key = lambda r: (r.get("model", "pi0"), r["batch"], r["prefix"], r["chunk"])  # noqa: E731
    keys = {key(c) for c in choice}
    rows = [r for r in old if key(r) not in keys] + choice
    path.write_text(json.dumps({"gpu": gpu, "source": "tools/cuda_expert_check.py bench --write-choice",
                                "steps": rows}, indent=1) + "\n")  # fmt: skip
    return path


def stage_once(args) -> None:
    cfg, dims, _, low = make(args.depth, seed=9)
    step = PersistentExpertStep(low[0], cfg, dims, sm_count=args.sms, tiling=args.tiling)
    step.run(low[1], low[2], 0, 10)
    step.run(low[1], low[2], 1, 10)
    torch.cuda.synchronize()
    log("once", depth=args.depth, error=step.error_code(), nan=int(torch.isnan(low[2].x_t).sum()))


def stage_precompile(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from cuda_expert_problem import config

    from vla_rt.cuda_kernels import build
    from vla_rt.engine.buffers import Dims

    variants = [(1, 1, 1, 0, 63), (2, 1, 1, 0, 63)] + [(18, b, v, p, c) for v, p, c, b in cases(args)]
    dims = [expert_dims(config(depth), Dims(b, v, p, c, 256)) for depth, b, v, p, c in variants]
    tiled = [(b, v, p, c) for v, p, c, b in args.shapes] or [(1, v, 0, 63) for v in (1, 2)]
    dims += [expert_dims(config(18), Dims(b, v, p, c, 256), **t) for t in args.tilings for b, v, p, c in tiled]
    with ThreadPoolExecutor(args.jobs) as pool:
        logs = list(pool.map(lambda d: build.compile_cubin("expert_step.cu", d.template_args())[1], dims))
    for d, lg in zip(dims, logs):
        r = build.Resources.parse(lg)
        print(f"B={d.batch} chunk={d.chunk} prefix={d.prefix} depth={d.depth} m_tiles={d.m_tiles}: {r}")


def _tilings(text: str) -> list[dict]:
    return [{k: int(v) for k, v in (kv.split("=") for kv in part.split(","))} for part in text.split(";") if part]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["diag", "accuracy", "replay", "broken", "bench", "once", "precompile"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sms", type=int, default=None)
    ap.add_argument("--sm-list", type=lambda s: [int(x) for x in s.split(",")], default=[132])
    ap.add_argument("--cases", type=int, default=len(CASES))
    ap.add_argument("--shapes", type=_shapes, default=[], help="views,prompt,chunk,batch;... instead of --cases")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--tilings", type=_tilings, default=[], help="extra bench variants: k=v,k=v;k=v (ExpertDims)")
    ap.add_argument(
        "--tiling",
        type=lambda t: _tilings(t)[0] if t else {},
        default={},
        help="the variant the correctness stages check: k=v,k=v (ExpertDims, e.g. a_ring_kb=64)",
    )
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument(
        "--write-choice",
        action="store_true",
        help="bench: the fastest tiling per shape vs the per-op step, as cuda_kernels/configs/<GPU>.json (in $OUT)",
    )
    ap.add_argument("--pi05", action="store_true", help="π0.5's action expert (adaptive norms) instead of π0's")
    args = ap.parse_args()
    global PI05
    PI05 = args.pi05
    OUT.mkdir(parents=True, exist_ok=True)
    globals()[f"stage_{args.stage}"](args)


if __name__ == "__main__":
    main()
