"""The split's last benchmark phase, with the whole model in this process: the monolithic engine's call time, the
refresh path part by part, bit-identity of split and monolithic actions on a fresh KV, and each KV format's accuracy
against the float32 reference (`vla_rt.numerics.rel_err` of the actions, same inputs and noise)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import torch

from vla_rt.bench.latency import random_inputs
from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.numerics import rel_err
from vla_rt.split.kv_codec import KvAssembler, KvLayout, encode_kv, host_kv
from vla_rt.timing import time_calls


def _monolithic(weights, cfg, shapes: BuiltShapes, device: torch.device, dtype: torch.dtype):
    from vla_rt.engine.static_engine import build_graphed_torch, build_triton

    build = build_triton if device.type == "cuda" else build_graphed_torch
    return build(weights, cfg, device=device, dtype=dtype, shapes=shapes)


def _wall_ms(fn, device: torch.device, repeats: int = 5) -> float:
    """Median wall time of fn() including a device sync (host work and copies, not only kernels)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def _through_the_wire(kv, mask, fmt: str, layout: KvLayout, engine: ExpertEngine, slot: int) -> None:
    """Encode, chunk, assemble, decode and import one prefix, as the link does it."""
    asm = KvAssembler(layout)
    done = None
    for frame in encode_kv(kv, mask, version=1, t_capture=0.0, fmt=fmt).frames:
        done = asm.add(msgpack.unpackb(frame))
    engine.import_prefix(slot, *done.to_device(engine.device, engine.dtype))


def monolithic_and_accuracy(weights, cfg, shapes: BuiltShapes, expert: ExpertEngine, device: torch.device,
                            dtype: torch.dtype, *, draws: int) -> dict:  # fmt: skip
    mono = _monolithic(weights, cfg, shapes, device, dtype)
    prefix = PrefixEngine(mono.weights, cfg, shapes, device=device, dtype=dtype, num_steps=expert.num_steps)
    reference = build_pi0(weights, cfg, backend="reference", device=device, dtype=torch.float32)
    layout = KvLayout(cfg.llm.depth, cfg.llm.num_kv_heads, cfg.llm.head_dim, expert.dims.prefix)
    case = (shapes.num_views, shapes.prompt_len, shapes.chunk)
    rows, out, first = [], {}, None
    for draw in range(draws):
        images, state, tokens, noise = random_inputs(cfg, case, device, seed=100 + draw)
        x = check_model_inputs(cfg, shapes, images, state, tokens, noise)
        a_mono = mono(x, noise, expert.num_steps)
        prefix.run(x)
        kv, mask = prefix.export()
        expert.import_prefix(0, kv, mask)
        a_split = expert.run_chunk(0, state, noise)
        errors = {"identical_to_monolithic": bool(torch.equal(a_split, a_mono))}
        a_ref = reference.sample_actions(images, state, tokens, noise)
        errors["monolithic_vs_fp32"] = rel_err(a_mono, a_ref)
        for fmt in ("native", "fp8"):
            _through_the_wire(kv, mask, fmt, layout, expert, 1)
            a = expert.run_chunk(1, state, noise)
            errors[f"{fmt}_kv_vs_fp32"] = rel_err(a, a_ref)
            errors[f"{fmt}_kv_vs_monolithic"] = rel_err(a, a_mono)
        rows.append(errors)
        first = first or (x, noise, kv.clone(), mask.clone())
    out.update(_refresh_parts(mono, prefix, expert, layout, *first))
    out["draws"] = rows
    out["all_identical"] = all(r["identical_to_monolithic"] for r in rows)
    for key in rows[0]:
        if key != "identical_to_monolithic":
            out[f"max_{key}"] = max(r[key] for r in rows)
    return out


def _refresh_parts(mono, prefix: PrefixEngine, expert: ExpertEngine, layout: KvLayout, x, noise, kv, mask) -> dict:
    """The refresh path part by part on one observation: the monolithic call beside it."""
    device, out = expert.device, {}
    out["monolithic_call"] = time_calls(lambda: mono(x, noise, expert.num_steps), warmup=3, iters=100, device=device,
                                        max_seconds=20).to_dict()  # fmt: skip
    out["prefix_run"] = time_calls(lambda: prefix.run(x), warmup=3, iters=50, device=device, max_seconds=20).to_dict()
    for fmt in ("native", "fp8"):
        out[f"copy_out_{fmt}_ms"] = _wall_ms(lambda f=fmt: host_kv(kv, mask, f), device)
        host = host_kv(kv, mask, fmt)
        out[f"encode_{fmt}_ms"] = _wall_ms(lambda h=host: encode_kv(h, version=1, t_capture=0.0), device)
        out[f"wire_to_slot_{fmt}_ms"] = _wall_ms(lambda f=fmt: _through_the_wire(kv, mask, f, layout, expert, 1),
                                                 device)  # fmt: skip
    return out
