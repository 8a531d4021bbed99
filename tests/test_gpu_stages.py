"""The stage engine on the GPU (`pytest -m gpu tests/test_gpu_stages.py` on the device): Triton kernels in bf16,
one CUDA Graph per (stage, bucket), rows joining and leaving at every boundary; every row within 2e-2 of its
request run alone through the float32 reference, for π0 and π0.5; and replays never recapture."""

from __future__ import annotations

import pytest
import torch
from test_engine_stages import CHUNK, PROMPT, ROWS, SHAPES, VIEWS, _case, _row, _serve

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
