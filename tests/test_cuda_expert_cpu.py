"""The persistent expert kernel's CPU-replayable parts: the schedule, the hand-off protocol (a model run over the
tables the kernel is given: no deadlock, no read before its producers, no overwrite before its readers, counters
that need no reset across launches), the weight pages, and a torch emulator of the kernel's arithmetic against the
per-op step. Each check is shown failing on a deliberately broken input."""

from __future__ import annotations

import copy
import ctypes
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_expert_emulator import emulate_step
from cuda_expert_problem import GPU_CASES, gpu_case_kwargs, paired_problem, problem, reference_step

from vla_rt.cuda_kernels import expert_protocol
from vla_rt.cuda_kernels.expert_dims import TILE, ExpertDims, why_unsupported
from vla_rt.cuda_kernels.expert_pack import (
    image_offset,
    pack_weights,
    swizzle_128b,
    unit_matrix,
    unit_rows,
    unpack_unit,
)
from vla_rt.cuda_kernels.expert_schedule import (
    F_C,
    F_IN_CNT,
    F_IN_T,
    F_OP,
    F_OUT_CNT,
    F_SK_CNT,
    F_SPLIT,
    GEMM_OPS,
    OP_EMBED,
    OP_GATE_UP,
    build_schedule,
)  # fmt: skip
from vla_rt.cuda_kernels.expert_step import Params, expert_dims
from vla_rt.numerics import rel_err

SMALL = dict(width=256, mlp=512, heads=2)  # narrow dims the kernel also takes: quick on a CPU


def _dims(batch=1, chunk=63, prefix=256, depth=2, **kw) -> ExpertDims:
    return ExpertDims(batch=batch, chunk=chunk, prefix=prefix, depth=depth, **kw)


@pytest.mark.parametrize("ctas", [1, 7, 132])
def test_schedule_runs_stages_in_order_and_counts_every_producer(ctas) -> None:
    d = _dims(batch=2, chunk=50, prefix=276, depth=3)
    sched = build_schedule(d, ctas)
    assert sorted(id(u) for units in sched.per_cta for u in units) == sorted(id(u) for u in sched.units)
    for units in sched.per_cta:
        stages = [u.stage for u in units]
        assert stages == sorted(stages)
    adds = Counter()  # every counter is added to exactly T times a launch
    for u in sched.units:
        f = u.row()
        out, sk = int(f[F_OUT_CNT]), int(f[F_SK_CNT])
        if u.op == OP_EMBED:
            adds[int(f[F_C])] += 1
        if sk >= 0 and u.pages:  # split-K: every split adds to the tile's counter, the last one to the output's
            adds[sk] += 1
            adds[out] += int(f[F_SPLIT]) == 0
        elif out >= 0:
            adds[out] += 1
    assert [adds[i] for i in range(sched.counters.count)] == sched.counters.t


def test_schedule_balances_weight_pages_across_ctas() -> None:
    sched = build_schedule(_dims(depth=18), 132)
    pages = np.diff(sched.tables()["cta_page"])
    assert pages.sum() == 18 * (40 + 32 + 128 + 64) * 16 + 16 * 16 + 16  # every weight tile once (+ action pad)
    assert pages.max() <= 1.05 * pages.mean()


@pytest.mark.parametrize("batch,chunk,prefix,ctas", [(1, 63, 256, 9), (2, 50, 276, 33), (3, 20, 532, 5)])
def test_protocol_model_finds_no_deadlock_or_race_over_launches(batch, chunk, prefix, ctas) -> None:
    d = _dims(batch=batch, chunk=chunk, prefix=prefix, depth=2, **SMALL)
    expert_protocol.check(d, build_schedule(d, ctas).tables(), launches=3, seeds=(0, 1))


def test_instruction_rows_are_whole_16_byte_words() -> None:
    """The consumers read a row as four 16-byte loads (`load_instr`): the table must be int32 at a 64-byte stride."""
    tables = build_schedule(_dims(depth=2, **SMALL), 9).tables()
    assert tables["instrs"].dtype == np.int32 and tables["instrs"].strides == (64, 4)


def test_protocol_model_catches_a_missing_increment() -> None:
    d = _dims(depth=2, **SMALL)
    tables = build_schedule(d, 5).tables()
    bad = {k: v.copy() for k, v in tables.items()}
    row = next(i for i, r in enumerate(bad["instrs"]) if r[F_OP] == OP_GATE_UP)
    bad["instrs"][row, F_IN_T] += 1  # waits for one more producer than exists: the hand-off never completes
    with pytest.raises(expert_protocol.ProtocolError, match="deadlock"):
        expert_protocol.check(d, bad, launches=1)


def test_protocol_model_catches_a_wait_on_the_wrong_counter() -> None:
    d = _dims(depth=2, **SMALL)
    sched = build_schedule(d, 5)
    tables = sched.tables()
    bad = {k: v.copy() for k, v in tables.items()}
    rows = [i for i, r in enumerate(bad["instrs"]) if r[F_OP] == OP_GATE_UP and r[1] == 1]
    # gate/up of layer 1 must wait for x after layer 1's O (version 3); waiting for an earlier version (after layer
    # 0's down, or after layer 0's O) lets it read x before layer 1's O wrote it: both must be caught
    for target in (sched.counters.x[2][0], sched.counters.x[1][0]):
        bad["instrs"][rows, F_IN_CNT] = target
        with pytest.raises(expert_protocol.ProtocolError):
            expert_protocol.check(d, bad, launches=1)


def test_mma_window_is_capped_so_the_rings_can_always_take_the_next(monkeypatch) -> None:
    d = _dims(batch=4, chunk=50, prefix=276, depth=1, **SMALL)  # 4 row tiles: 3 activation slots of one chunk
    assert d.a_slots == 3 and d.wgmma_depth == 2
    tables = build_schedule(d, 3).tables()
    expert_protocol.check(d, tables, launches=1)
    monkeypatch.setattr(ExpertDims, "wgmma_depth", property(lambda self: 3))  # holding 3 items of 3: stuck
    with pytest.raises(expert_protocol.ProtocolError, match="deadlock"):
        expert_protocol.check(d, tables, launches=1)


def test_unsupported_dims_say_why() -> None:
    assert why_unsupported(_dims()) is None
    assert "chunk" in why_unsupported(_dims(chunk=64))
    assert "head_dim" in why_unsupported(_dims(head_dim=128))
    assert "KV head" in why_unsupported(_dims(), num_kv_heads=2)
    assert why_unsupported(_dims(pi05=True, chunk=64)) is None  # no state token: 64 actions fit one tile


def test_swizzle_is_the_128_byte_pattern_and_its_own_inverse() -> None:
    t = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    s = swizzle_128b(t)
    for r, c in [(0, 0), (3, 17), (9, 63), (63, 40)]:
        byte = r * 128 + c * 2
        swz = byte ^ (((byte >> 7) & 7) << 4)  # TMA / wgmma 128B swizzle of a 1024-byte-aligned tile
        assert s.flatten()[swz // 2] == t[r, c]
    assert torch.equal(swizzle_128b(s), t)
    # the activation image uses the same pattern per 64 x 64 tile
    assert image_offset(9, 64 + 17, m_tiles=2) == (1 * 2 + 0) * 4096 + ((9 * 128 + 17 * 2) ^ (1 << 4)) // 2


def test_packed_pages_hold_every_units_rows() -> None:
    cfg, dims, w, _, _ = problem(depth=1, **SMALL)
    d = expert_dims(cfg, dims)
    sched = build_schedule(d, 3)
    stream = pack_weights(sched, w)
    page = 0
    for units in sched.per_cta:
        for u in units:
            if u.op not in GEMM_OPS:
                continue
            rows, k0 = unit_rows(u.op, u.row(), d)
            m = unit_matrix(u.op, u.row(), w).float()
            m = torch.cat([m, torch.zeros(1, m.shape[1])])
            want = m[torch.tensor(rows), k0 : k0 + u.pages * TILE]
            assert torch.equal(unpack_unit(stream, page, u.pages), want.to(torch.bfloat16).float())
            page += u.pages
    assert page == len(stream)


def _emulate(cfg, dims, w, slot, xa, step, round_bf16, seed=0, ctas=11):
    sched = build_schedule(expert_dims(cfg, dims), ctas)
    slot, xa = copy.deepcopy(slot), copy.deepcopy(xa)
    emulate_step(sched, pack_weights(sched, w), w, cfg, slot, xa, step, 10, round_bf16=round_bf16, seed=seed)
    return slot, xa


@pytest.mark.parametrize("batch,views,prompt,chunk,kw", [
    (1, 1, 0, 63, SMALL), (2, 1, 20, 50, SMALL), (3, 2, 5, 17, SMALL), (1, 1, 0, 63, {})])  # fmt: skip
def test_emulated_kernel_arithmetic_matches_the_per_op_step(batch, views, prompt, chunk, kw) -> None:
    cfg, dims, w, slot, xa = problem(depth=1 if kw == {} else 2, batch=batch, views=views, prompt=prompt,
                                     chunk=chunk, seed=batch + views, **kw)  # fmt: skip
    ref_slot, ref_xa = copy.deepcopy(slot), copy.deepcopy(xa)
    reference_step(cfg, dims, w, ref_slot, ref_xa, step=4)
    emu_slot, emu_xa = _emulate(cfg, dims, w, slot, xa, 4, round_bf16=False)
    update = ref_xa.x_t - xa.x_t
    assert rel_err(emu_xa.x_t - xa.x_t, update) <= 1e-4  # fp32: layouts and decomposition exact
    for li in range(cfg.expert.depth):
        p = dims.prefix
        assert rel_err(emu_slot.k_cache[li][:, p:], ref_slot.k_cache[li][:, p:]) <= 1e-5
        assert rel_err(emu_slot.v_cache[li][:, p:], ref_slot.v_cache[li][:, p:]) <= 1e-5
    _, bf16_xa = _emulate(cfg, dims, w, slot, xa, 4, round_bf16=True)
    assert rel_err(bf16_xa.x_t - xa.x_t, update) <= 2e-2  # with the kernel's bf16 rounding points


@pytest.mark.parametrize("ctas", [7, 12])
def test_emulated_pi05_kernel_arithmetic_matches_the_pi05_per_op_step(ctas) -> None:
    """π0.5: action tokens from action_in_proj, the x (1 + s) inputs, the row's biases and gates, the float32
    action table."""
    cfg, dims, w, slot, xa = problem(depth=2, batch=2, views=1, prompt=20, chunk=50, seed=9, pi05=True,
                                     **{**SMALL, "heads": 8})  # fmt: skip
    ref_slot, ref_xa = copy.deepcopy(slot), copy.deepcopy(xa)
    reference_step(cfg, dims, w, ref_slot, ref_xa, step=6)
    update = ref_xa.x_t - xa.x_t
    emu_slot, emu_xa = _emulate(cfg, dims, w, slot, xa, 6, round_bf16=False, ctas=ctas)
    assert rel_err(emu_xa.x_t - xa.x_t, update) <= 1e-5
    for li in range(cfg.expert.depth):
        assert rel_err(emu_slot.k_cache[li][:, dims.prefix :], ref_slot.k_cache[li][:, dims.prefix :]) <= 1e-5
    _, bf16_xa = _emulate(cfg, dims, w, slot, xa, 6, round_bf16=True, ctas=ctas)
    assert rel_err(bf16_xa.x_t - xa.x_t, update) <= 2e-2


def test_pi05_emulation_needs_every_modulation_term() -> None:
    """Each π0.5 term the kernel applies is needed: with one left out the emulation misses the per-op step."""
    import cuda_expert_emulator as emu

    cfg, dims, w, slot, xa = problem(depth=1, batch=1, chunk=50, seed=4, pi05=True, **{**SMALL, "heads": 8})
    ref_slot, ref_xa = copy.deepcopy(slot), copy.deepcopy(xa)
    reference_step(cfg, dims, w, ref_slot, ref_xa, step=2)
    tables = w.pi05.tables
    for name in ("attn_scale", "qkv_bias", "attn_gate", "ffn_scale", "gate_up_bias", "ffn_gate"):
        off, shape = w.pi05.segments[list(emu.PI05_LAYER_TABLES).index(name)]
        saved = tables[:, off : off + shape[0]].clone()
        tables[:, off : off + shape[0]] = 0.0 if not name.endswith("gate") else 1.0  # the term switched off
        _, bad = _emulate(cfg, dims, w, slot, xa, 2, round_bf16=False)
        tables[:, off : off + shape[0]] = saved
        assert rel_err(bad.x_t - xa.x_t, ref_xa.x_t - xa.x_t) > 1e-3, name


def test_emulator_is_sensitive_to_a_layout_bug(monkeypatch) -> None:
    import cuda_expert_emulator as emu

    cfg, dims, w, slot, xa = problem(depth=1, seed=3, **SMALL)
    ref_slot, ref_xa = copy.deepcopy(slot), copy.deepcopy(xa)
    reference_step(cfg, dims, w, ref_slot, ref_xa, step=0)
    monkeypatch.setattr(emu, "unpack_unit", lambda s, page, nk: unpack_unit(s, page, nk).roll(1, 0))  # rows off by one
    _, bad_xa = _emulate(cfg, dims, w, slot, xa, 0, round_bf16=False)
    assert rel_err(bad_xa.x_t - xa.x_t, ref_xa.x_t - xa.x_t) > 1e-2


def test_split_k_merge_is_independent_of_arrival_order() -> None:
    cfg, dims, w, slot, xa = problem(depth=2, seed=5, **SMALL)
    _, a = _emulate(cfg, dims, w, slot, xa, 2, round_bf16=True, seed=1)
    _, b = _emulate(cfg, dims, w, slot, xa, 2, round_bf16=True, seed=2)
    assert torch.equal(a.x_t, b.x_t)


def test_params_struct_matches_the_kernel_source() -> None:
    src = (Path(__file__).parents[1] / "cuda_kernels" / "expert_step.cu").read_text()
    body = re.search(r"struct Params \{(.*?)\};", src, re.S).group(1)
    fields = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            ctype, name = decl.rsplit(None, 1)
            fields.append((ctype, name))
    assert [n for _, n in fields] == [n for n, _ in Params._fields_]
    scalar = {
        "float": ctypes.c_float,
        "int": ctypes.c_int,
        "unsigned long long": ctypes.c_uint64,
        "long long": ctypes.c_int64,
    }
    for (ctype, name), (_, pytype) in zip(fields, Params._fields_):
        assert pytype is (ctypes.c_void_p if "*" in ctype else scalar[ctype]), (name, ctype)


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "depth{}_b{}_v{}_p{}_h{}".format(*c))
def test_gpu_checks_setup_builds_on_the_cpu(case) -> None:
    """The GPU test's exact problem, through its own setup code (`paired_problem`), on the CPU: a change to the
    engine's dataclasses that breaks the GPU checks' setup fails here, in CI, not first on the device. Then what
    `PersistentExpertStep` builds before it needs the driver: dims, schedule and the packed weight stream."""
    depth = case[0]
    cfg, dims, ref, low = paired_problem(depth, torch.device("cpu"), **gpu_case_kwargs(*case))
    (rw, rslot, rxa), (lw, lslot, lxa) = ref, low
    assert lw.expert[0].qkv.dtype == torch.bfloat16 and rw.expert[0].qkv.dtype == torch.float32
    for name, r in rxa.__dict__.items():  # the same values in both problems, in the dtypes the engine keeps
        lo = getattr(lxa, name)
        assert (r is None) == (lo is None), name
        if r is not None and name != "x_t":
            assert lo.dtype == (r.dtype if name in ("action_emb", "rms") or not r.is_floating_point()
                                else torch.bfloat16), name  # fmt: skip
    assert torch.equal(lxa.x_t, rxa.x_t) and lxa.x_t.dtype == torch.float32
    for rk, lk in zip(rslot.k_cache, lslot.k_cache):
        assert torch.equal(lk[:, : dims.prefix].float(), rk[:, : dims.prefix])
    d = expert_dims(cfg, dims)
    assert why_unsupported(d) is None
    sched = build_schedule(d, 132)
    stream = pack_weights(sched, lw)
    assert len(stream) == int(sched.tables()["cta_page"][-1])
