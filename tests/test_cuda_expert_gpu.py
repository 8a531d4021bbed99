"""The persistent expert kernel on an sm_90 GPU (`pytest -m gpu tests/test_cuda_expert_gpu.py`): bf16 against the
per-op step in float32 on fresh random inputs, every suffix K/V row written (poisoned before), CUDA Graph replays
bit-identical with counters that need no reset, and a broken hand-off caught by the timeout flag, not a hang.
Timing lives in tools/cuda_expert_check.py, not here."""

from __future__ import annotations

import copy

import pytest
import torch
from cuda_expert_problem import GPU_CASES, gpu_case_kwargs, paired_problem, reference_step

from vla_rt.cuda_kernels.expert_schedule import F_IN_T, OP_QK, build_schedule
from vla_rt.cuda_kernels.expert_step import PersistentExpertStep, expert_dims, why_not
from vla_rt.numerics import rel_err as rel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
DEV = torch.device("cuda")


def _problem(depth, **kw):
    return paired_problem(depth, DEV, **kw)


@pytest.mark.parametrize("depth,batch,views,prompt,chunk", GPU_CASES)
def test_bf16_steps_match_the_fp32_per_op_step(depth, batch, views, prompt, chunk) -> None:
    cfg, dims, ref, low = _problem(depth, **gpu_case_kwargs(depth, batch, views, prompt, chunk))
    step = PersistentExpertStep(low[0], cfg, dims)
    for k, v in zip(low[1].k_cache, low[1].v_cache):  # suffix rows: the kernel must write every one
        k[:, dims.prefix :].fill_(float("nan"))
        v[:, dims.prefix :].fill_(float("nan"))
    noise = low[2].x_t.clone()
    for s in range(10):
        step.run(low[1], low[2], s, 10)
        reference_step(cfg, dims, *ref, s)
    assert step.error_code() == 0
    assert not torch.isnan(low[2].x_t).any()
    assert all(not torch.isnan(k[:, dims.prefix :]).any() for k in low[1].k_cache)
    assert rel(low[2].x_t - noise, ref[2].x_t - noise) <= 2e-2
    assert rel(low[2].x_t, ref[2].x_t) <= 2e-2


def test_graph_replays_are_bit_identical_without_resetting_counters() -> None:
    cfg, dims, _, (w, slot, xa) = _problem(18, seed=7)
    step = PersistentExpertStep(w, cfg, dims)
    noise = xa.x_t.clone()
    for s in range(10):
        step.run(slot, xa, s, 10)
    eager = xa.x_t.clone()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for s in range(10):
            step.run(slot, xa, s, 10)
    outs = []
    for _ in range(3):
        xa.x_t.copy_(noise)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(xa.x_t.clone())
    assert all(torch.equal(eager, o) for o in outs)
    assert step.error_code() == 0 and int(step.sync_words[0]) == 40  # one epoch a launch, never reset


def test_a_missing_hand_off_is_caught_not_a_hang() -> None:
    cfg, dims, _, (w, slot, xa) = _problem(2, seed=5)
    good = PersistentExpertStep(w, cfg, dims)
    x0 = xa.x_t.clone()
    good.run(slot, xa, 0, 10)
    want = xa.x_t.clone()
    sched = build_schedule(expert_dims(cfg, dims), good.ctas)
    next(u for u in sched.units if u.op == OP_QK and u.layer == 1).fields[F_IN_T] += 1  # waits for T + 1 producers
    bad = PersistentExpertStep(w, cfg, dims, schedule=sched, timeout_s=0.05)
    xa.x_t.copy_(x0)
    bad.run(slot, xa, 0, 10)
    torch.cuda.synchronize()
    # a bounded wait timed out (whichever came first: the unit's counter, or a ring its stalled consumer never drains)
    assert bad.error_code() >> 16 in (1, 2, 3, 4, 5)
    assert not torch.equal(xa.x_t, want)
    assert good.error_code() == 0


def test_sm_count_is_a_launch_parameter() -> None:
    cfg, dims, ref, low = _problem(2, seed=3)
    r_slot, r_xa = copy.deepcopy(low[1]), copy.deepcopy(low[2])
    PersistentExpertStep(low[0], cfg, dims, sm_count=64).run(low[1], low[2], 0, 10)
    PersistentExpertStep(low[0], cfg, dims).run(r_slot, r_xa, 0, 10)
    assert torch.equal(low[2].x_t, r_xa.x_t)  # the schedule changes, the arithmetic does not


def test_unsupported_models_say_why() -> None:
    cfg, dims, _, _ = _problem(1)
    assert why_not(cfg, dims, DEV) is None
    assert "bfloat16" in why_not(cfg, dims, DEV, torch.float16)


@pytest.mark.parametrize("pi05", [False, True], ids=["pi0", "pi05"])
def test_rows_at_their_own_steps_match_the_fp32_per_op_step(pi05) -> None:
    """π0 and π0.5 (adaptive norms from the step's row), 2 views, prompt 20, chunk 50, B = 2 with a row per batch
    element at different steps (the stage engine's mix)."""
    cfg, dims, ref, low = _problem(18, batch=2, views=2, prompt=20, chunk=50, seed=21, pi05=pi05)
    step = PersistentExpertStep(low[0], cfg, dims)
    table = (low[0].pi05.tables if pi05 else low[0].suffix.time_bias).float()
    rows = torch.stack([table[3], table[7]]).contiguous()  # batch element 0 at step 3, element 1 at step 7
    noise = low[2].x_t.clone()
    step.run(low[1], low[2], 0, 10, time_bias=rows)
    for b, s in enumerate((3, 7)):  # the reference: each element alone at its own step
        one = copy.deepcopy(ref)
        reference_step(cfg, dims, *one, s)
        got, want = low[2].x_t[b] - noise[b], one[2].x_t[b] - noise[b]
        assert rel(got, want) <= 2e-2, (b, s)
    assert step.error_code() == 0
