"""`tools/unit_probe.py`'s variant arithmetic on a CPU (the kernel runs on the device; every variant's build is
checked here, its defines in tests/test_cuda_kernels_compile.py)."""

import json
from pathlib import Path

import pytest
from tool_modules import load_tool

from vla_rt.cuda_kernels import build

RUN = Path(__file__).resolve().parents[1] / "docs" / "runs" / "unit_probe_2026-12-07_585f12f_NVIDIA-H100.json"


def _probe():
    return load_tool("unit_probe")


def test_a_cluster_lands_its_k_slice_and_room_for_its_peers_partials() -> None:
    probe = _probe()
    c1, c2, c4 = probe.Variant(1), probe.Variant(2), probe.Variant(4)
    assert (c1.slice_kb, c2.slice_kb, c4.slice_kb) == (128, 64, 32)
    assert c1.smem_bytes == 64 * 1024 + 128 * 1024 + 1024
    assert c4.smem_bytes == 64 * 1024 + 32 * 1024 + 3 * 16 * 1024 + 1024
    assert max(v.smem_bytes for v in probe.VARIANTS) <= 227 * 1024  # the H100's / H200's shared memory a CTA
    assert c4.label == "c4: 256 columns x K 256 a CTA, 32 KB landed"
    assert probe.Variant(2, mma=False, read=False).defines == {"CLUSTER": 2, "ACC_CHAINS": 1, "ONE_BAR": 0, "MMA": 0,
                                                               "READ": 0, "BULK_STORE": 0, "N64": 0, "ATTN": 0}  # fmt: skip
    assert probe.Variant(1, bulk_store=True).smem_bytes == c1.smem_bytes + 8192  # the staged output tile
    assert probe.Variant(1, n64=2).smem_bytes == c1.smem_bytes + 16384  # warpgroup 1's partial for warpgroup 0
    assert probe.Variant(1, n64=1).smem_bytes == c1.smem_bytes
    attn = probe.Variant(attn=True)  # no weights: K and V of 64 keys landed, the fp32 partial staged to bulk-store
    assert (attn.slice_kb, attn.smem_bytes) == (64, 64 * 1024 + 1024)
    assert probe.Variant(attn=True, bulk_store=True).smem_bytes == 64 * 1024 + 64 * 1024 + 1024
    assert attn.label == "attention: 64 queries of a head x 64 keys, 64 KB of K / V landed"
    assert probe.Variant(attn=2, mma=False, read=False).defines["ATTN"] == 2


def test_every_variant_runs_on_one_grid_at_which_the_largest_cluster_is_resident() -> None:
    probe = _probe()
    assert probe.common_grid(132, {1: 132, 2: 66, 4: 30}) == 120  # 30 clusters of 4 fit (the H200, 2026-12-03)
    assert probe.common_grid(132, {1: 132, 2: 66, 4: 33}) == 132
    assert probe.common_grid(132, {1: 132, 2: 65, 4: 33}) == 128
    assert probe.common_grid(132, {1: 132}) == 132


@pytest.mark.skipif(build.find_nvcc() is None, reason="no nvcc")
def test_every_variant_builds_without_spills_or_serialized_mmas() -> None:
    probe = _probe()
    for v in probe.VARIANTS:
        _, log = build.compile_cubin(str(probe.SOURCE), v.defines, quiet=True)
        r = build.Resources.parse(log)
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.wgmma_serialized, (v, log)


def test_the_c1_stage_is_read_in_parts_from_the_rows_of_one_grid() -> None:
    """The H100 rows of 2026-12-07 (docs/runs/unit_probe_2026-12-07_585f12f_NVIDIA-H100.json) give the parts the docs
    quote; a lever's line appears only once its rows exist, and rows of another grid are not mixed in."""
    probe = _probe()
    rows = json.loads(RUN.read_text())["rows"]
    lines = probe.parts(rows, 120)
    assert lines == ["c1 in parts: the bare stage (hand-off, output store, release) 2.71 µs; landing 128 KB adds 1.04; "
                     "the MMAs add 2.29; together 5.78 µs, 0.27 µs of overlap"]  # fmt: skip
    assert probe.parts(rows, 132) == []  # only the full unit ran on every SM
    bulk = dict(rows[5], BULK_STORE=1, us_a_stage=1.5)  # a bare stage with one bulk store
    wide = dict(rows[0], N64=1, us_a_stage=4.0)
    lines = probe.parts(rows + [bulk, wide], 120)
    assert lines[1] == "one bulk store instead of the threads' stores: bare stage 1.50 against 2.71 µs"
    assert lines[2] == "m64n64k16 on one warpgroup: the unit 4.00 against 5.78 µs"
    attn = [dict(rows[0], ATTN=1, MMA=m, READ=r, BULK_STORE=b, us_a_stage=us)
            for m, r, b, us in ((1, 1, 0, 4.0), (0, 0, 0, 1.6), (0, 1, 0, 2.4), (1, 0, 0, 3.1), (1, 1, 1, 3.3))]
    lines = probe.parts(rows + attn, 120)
    assert lines[1] == ("an attention unit: 4.00 µs a stage; bare 1.60, landing 64 KB adds 0.80, the MMAs and softmax "
                        "add 1.50; its partial by one bulk store 3.30")  # fmt: skip
    assert lines[0].startswith("c1 in parts: the bare stage (hand-off, output store, release) 2.71 µs")  # not ATTN's
    merge = dict(rows[0], ATTN=2, MMA=0, READ=0, us_a_stage=2.5)
    assert probe.parts(rows + attn + [merge], 120)[2] == ("a merge unit (five key splits, 16 rows): 2.50 µs a stage; "
                                                          "attention + merge 6.50")  # fmt: skip


def test_the_levers_rows_of_2026_12_08_read_as_the_docs_quote_them() -> None:
    """The H100 run with both levers (docs/runs/unit_probe_2026-12-08_2070681_NVIDIA-H100.json): the bulk store cuts
    the bare stage and the unit, the m64n64k16 variants lose; docs/cuda_expert.md (session 28) quotes these lines."""
    probe = _probe()
    run = json.loads((RUN.parent / "unit_probe_2026-12-08_2070681_NVIDIA-H100.json").read_text())
    lines = probe.parts(run["rows"], 120)
    assert lines == [
        "c1 in parts: the bare stage (hand-off, output store, release) 2.45 µs; landing 128 KB adds 1.31; "
        "the MMAs add 2.47; together 5.85 µs, 0.39 µs of overlap",
        "one bulk store instead of the threads' stores: bare stage 1.53 against 2.45 µs, the unit 4.37 against 5.85",
        "two chains and one bulk store (the lean unit): 4.07 µs a stage against 5.20 with two chains alone; "
        "108 such stages 0.44 ms",
        "m64n64k16 on one warpgroup: the unit 8.28 against 5.85 µs; its MMAs alone add 4.65 against 2.47",
        "m64n64k16 on two warpgroups: the unit 6.38 against 5.85 µs",
    ]
