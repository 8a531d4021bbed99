"""`tools/handoff_probe.py`'s variant arithmetic on a CPU (the kernel itself runs on the device; its build is checked
in tests/test_cuda_kernels_compile.py)."""

import pytest
from tool_modules import load_tool


def _probe():
    return load_tool("handoff_probe")


def test_fan_ins_divide_the_grid_from_point_to_point_to_a_grid_barrier() -> None:
    probe = _probe()
    assert probe.fan_ins(132) == [1, 4, 12, 33, 132]
    for ctas in (132, 128, 114, 7):
        fans = probe.fan_ins(ctas)
        assert fans[0] == 1 and fans[-1] == ctas and all(ctas % f == 0 for f in fans), (ctas, fans)


def test_a_consumer_reads_what_the_variant_says_whatever_its_fan_in() -> None:
    probe = _probe()
    for fan_in in (1, 4, 12, 33, 132):
        words = probe.words_for(128, fan_in)
        assert 128 * 1024 - 16 * fan_in < words * 16 * fan_in <= 128 * 1024, fan_in
    assert probe.words_for(0, 12) == 0


def test_bulk_reads_land_in_shared_memory_sized_for_the_largest_read() -> None:
    probe = _probe()
    assert probe.landing_bytes("bulk", 128) == 128 * 1024 and probe.landing_bytes("ld", 128) == 0
    assert set(probe.READS) == {"ld", "bulk"}


def test_ring_variants_follow_the_bulk_read_at_the_grid_barrier_with_a_loader_warp() -> None:
    probe = _probe()
    chosen = probe.variants(["ld", "bulk"], ["16", "16bare"])
    assert [(v.read, v.pages) for v in chosen] == [("ld", 0), ("bulk", 0), ("bulk", 16), ("bulk", 16)]
    plain, bulk, ring, bare = chosen
    assert plain.block == bulk.block == 128 and ring.block == bare.block == 160
    assert ring.defines == {"BULK": 1, "RING_PAGES": 16, "RING_CHECKS": 3} and bare.defines["RING_CHECKS"] == 0
    halves = probe.variants(["bulk"], ["16loaderbare", "16consumersbare"])[1:]
    assert [v.defines["RING_CHECKS"] for v in halves] == [1, 2]  # bit 1: the consumers check, bit 2: the loader
    assert [v.label for v in halves] == ["bulk, ring of 16 pages (the loader's polls bare)",
                                         "bulk, ring of 16 pages (the consumers' polls bare)"]  # fmt: skip
    assert plain.cases(132, [0, 128]) == [(f, kb) for f in probe.fan_ins(132) for kb in (0, 128)]
    assert bulk.cases(132, [0, 128]) == [(f, 128) for f in probe.fan_ins(132)]  # a bulk read of nothing is ld's
    assert ring.cases(132, [0, 128]) == [(132, 0), (132, 128)]  # the ring alone, and after the read
    with pytest.raises(ValueError, match="--rings"):
        probe.variants(["bulk"], ["8"])
