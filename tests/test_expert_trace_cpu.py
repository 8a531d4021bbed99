"""`vla_rt.cuda_kernels.expert_trace`: a layer's chain split into hand-offs and the work inside the stages, on a
synthetic trace whose answer is known (the kernel's stamps come from the device)."""

from __future__ import annotations

import pytest
import torch

from vla_rt.cuda_kernels.expert_schedule import (
    F_LAYER,
    F_OP,
    FIELDS,
    OP_ATTN,
    OP_DOWN,
    OP_GATE_UP,
    OP_MERGE,
    OP_O,
    OP_QK,
    OP_V,
)
from vla_rt.cuda_kernels.expert_trace import STAGES, stage_path, table

ORDER = [(OP_QK, OP_V), (OP_ATTN,), (OP_MERGE,), (OP_O,), (OP_GATE_UP,), (OP_DOWN,)]


def _trace(depth: int, handoff: float, work: list[float], skew: float):
    """Two units a stage; the second sees its input `skew` later and works as long: each stage's last unit is ready
    `handoff + skew` after the previous stage's last unit is done, and done `work` after that."""
    stamps, instrs, t = [], [], 0.0
    for layer in range(depth):
        for ops, w in zip(ORDER, work, strict=True):
            for k, op in enumerate((ops * 2)[:2]):
                ready = t + handoff + k * skew
                row = [0] * FIELDS
                row[F_OP], row[F_LAYER] = op, layer
                instrs.append(row)
                stamps.append([ready - 0.5, ready, ready + w / 2, ready + w, ready + w, 0.0])
            t = t + handoff + skew + w
    return torch.tensor(stamps, dtype=torch.float64), torch.tensor(instrs, dtype=torch.int32)


def test_a_layer_splits_into_each_stages_hand_off_and_its_units_work() -> None:
    work = [7.0, 6.0, 3.0, 9.0, 8.0, 10.0]
    stamps, instrs = _trace(8, handoff=0.8, work=work, skew=0.3)
    path = stage_path(stamps, instrs)
    assert list(path) == [*STAGES, "layer"]
    for name, w in zip(STAGES, work, strict=True):
        v = path[name]
        assert v["units"] == 2
        assert v["handoff"] == pytest.approx(0.8 + 0.3) and v["tail"] == pytest.approx(w), name
        assert v["work_mean"] == pytest.approx(w) and v["stage"] == pytest.approx(1.1 + w)
    assert path["layer"]["us"] == pytest.approx(sum(work) + 6 * 1.1)
    assert "| down | 2 | 1.10 | 10.00 |" in table(path)


def test_a_slower_hand_off_shows_as_hand_off_not_as_work() -> None:
    fast = stage_path(*_trace(8, handoff=0.8, work=[5.0] * 6, skew=0.0))
    slow = stage_path(*_trace(8, handoff=3.0, work=[5.0] * 6, skew=0.0))
    assert slow["qkv"]["handoff"] - fast["qkv"]["handoff"] == pytest.approx(2.2)
    assert slow["qkv"]["tail"] == pytest.approx(fast["qkv"]["tail"])


def test_a_trace_without_a_middle_layer_is_empty() -> None:
    assert stage_path(*_trace(1, handoff=1.0, work=[1.0] * 6, skew=0.0)) == {}
