"""`tools/handoff_probe.py`'s variant arithmetic on a CPU (the kernel itself runs on the device; its build is checked
in tests/test_cuda_kernels_compile.py)."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "handoff_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("handoff_probe", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
