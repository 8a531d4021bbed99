"""The stage engine on the GPU (`pytest -m gpu tests/test_gpu_stages.py` on the device): Triton kernels in bf16,
one CUDA Graph per (stage, bucket), rows joining and leaving at every boundary; every row within 2e-2 of its
request run alone through the float32 reference, for π0 and π0.5; and replays never recapture."""

from __future__ import annotations

import pytest
import torch
from test_engine_stages import CHUNK, PROMPT, ROWS, SHAPES, VIEWS, _case, _count_direct_loads, _row, _rows, _serve

from vla_rt.engine.kernels import triton_kernels
from vla_rt.engine.stages import StageEngine
from vla_rt.inference import build_pi0
from vla_rt.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 2e-2


@pytest.mark.parametrize("preset, overlap", [("tiny", False), ("tiny_pi05", False), ("tiny", True)])
def test_mixed_rows_on_triton_graphs_match_the_float32_reference(preset, overlap) -> None:
    """overlap: every prefix stage through begin_admit on its own stream while the expert steps run, joined one or
    two stages later (or at once when nothing else is in flight)."""
    cfg, weights, x = _case(preset)
    engine = StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2, 4), prefix_buckets=(1, 2),
                         kernels=triton_kernels(), device=torch.device("cuda"), dtype=torch.bfloat16)  # fmt: skip
    assert sorted(engine.prefix_graphs) == [1, 2] and sorted(engine.expert_graphs) == [1, 2, 4]
    graphs = {id(g) for g in [*engine.prefix_graphs.values(), *engine.expert_graphs.values()]}
    out, mixes = _serve(engine, x, seed=0, overlap=overlap)
    assert any(len(set(m)) > 1 for m in mixes)
    assert {id(g) for g in [*engine.prefix_graphs.values(), *engine.expert_graphs.values()]} == graphs
    reference = build_pi0(weights, cfg, num_views=VIEWS, chunk=CHUNK, prompt_len=PROMPT)  # the eager fp32 spec
    for i in range(ROWS):
        r = _row(x, i)
        ref = reference.sample_actions(r.images, r.state, r.tokens, r.noise, image_masks=r.image_masks,
                                       token_mask=r.token_mask)[0]  # fmt: skip
        assert rel_err(out[i], ref) <= BF16_TOL, (i, rel_err(out[i], ref))


def test_stage_timing_events_time_the_kernels_of_each_stage() -> None:
    """`time_stages`: the GPU time of a prefix and an expert stage is positive and within the host's wall clock around
    the stage and its wait; off, no stale number from an earlier stage."""
    import time

    cfg, weights, x = _case("tiny")
    engine = StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2), prefix_buckets=(1,), kernels=triton_kernels(),
                         device=torch.device("cuda"), dtype=torch.bfloat16)  # fmt: skip
    engine.time_stages = True
    for stage in ("prefix", "expert"):
        t0 = time.perf_counter()
        if stage == "prefix":
            engine.admit([0], _rows(x, [0], pixels=True))
        else:
            engine.step()
        engine.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        gpu_ms = engine.last_stage_gpu_ms()
        assert gpu_ms is not None and 0 < gpu_ms <= wall_ms, (stage, gpu_ms, wall_ms)
    engine.time_stages = False
    engine.step()
    assert engine.last_stage_gpu_ms() is None


def test_a_prefix_on_an_sm_partition_gives_the_same_actions() -> None:
    """`expert_sms`: the prefix graphs captured on a green context of the other SMs (the expert steps keep the rest
    free). The same kernels on fewer SMs: every row's actions bit-identical to the shared engine's, through the
    overlap path (begin_admit on the partition's stream, join) and the synchronous one."""
    cfg, weights, x = _case("tiny")
    outs = {}
    for sms in (0, 16):
        engine = StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2, 4), prefix_buckets=(1, 2),
                             kernels=triton_kernels(), device=torch.device("cuda"), dtype=torch.bfloat16,
                             expert_sms=sms)  # fmt: skip
        if sms:
            total = torch.cuda.get_device_properties(0).multi_processor_count
            parts = engine.sm_partition.sms
            assert parts["expert"] >= sms and parts["expert"] + parts["prefix"] <= total, parts
            assert engine.prefix_stream is engine.sm_partition.streams["prefix"]
        for overlap in (False, True):
            outs[sms, overlap] = _serve(engine, x, seed=0, overlap=overlap)[0]
    for overlap in (False, True):
        for i in range(ROWS):
            a, b = outs[0, overlap][i], outs[16, overlap][i]
            assert torch.equal(a, b), (overlap, i, rel_err(b, a))


def test_pinned_input_rows_load_straight_into_the_graph_inputs_with_the_same_actions(monkeypatch) -> None:
    """`input_rows`' pinned buffers: one asynchronous copy per field into the prefix graph's inputs, the pixels
    scaled on the device; stacked pageable rows take the upload path (temporaries, then `load`). Same schedule on
    the same graphs' shapes: bit-identical actions, through admit and through begin_admit / join."""
    cfg, weights, x = _case("tiny")
    for overlap in (False, True):
        outs, direct = {}, {}
        for feed in ("input_rows", "pixels"):
            engine = StageEngine(weights, cfg, SHAPES, expert_buckets=(1, 2, 4), prefix_buckets=(1, 2),
                                 kernels=triton_kernels(), device=torch.device("cuda"), dtype=torch.bfloat16)  # fmt: skip
            calls = _count_direct_loads(monkeypatch)
            outs[feed], _ = _serve(engine, x, seed=0, overlap=overlap, feed=feed)
            direct[feed] = calls[0]
        assert direct["input_rows"] > 0 and direct["pixels"] == 0, (overlap, direct)
        for i in range(ROWS):
            assert torch.equal(outs["input_rows"][i], outs["pixels"][i]), (overlap, i)
