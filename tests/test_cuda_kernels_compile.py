"""Every persistent-expert kernel variant the engine can build compiles for sm_90a on a CPU machine (nvcc from the
CUDA toolkit or the `nvidia-cuda-nvcc` wheel the test extra installs), within the budget it was designed to:

- 384 threads a CTA, so ptxas gives 168 registers at entry (setmaxnreg then moves 224 to each consumer thread);
- at most 32 bytes of spill while a batch's rows fit one 64-row tile (B = 1 at any chunk: none at 1 view, 16 bytes at
  3 views / prompt 20 / chunk 50 since the early loads became the default); at 2-4 tiles at most 256 bytes, at 5-8
  tiles at most 2 KB (known: at 2 tiles mostly the QK unit's RoPE tables, 32 floats a thread loaded before the
  mainloop and parked in local memory until the epilogue; at 8 the accumulators beside the epilogue's loads;
  B = 2 / 4 / 8 measured on an H100 in session 17: 1.4x / 3.3x / 6.5x the B = 1 step, docs/cuda_expert.md);
- no wgmma serialisation for 1-2 tiles; dynamic shared memory within Hopper's 227 KB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vla_rt.cuda_kernels import build
from vla_rt.cuda_kernels.expert_dims import SMEM_LIMIT, ExpertDims, why_unsupported

VARIANTS = {  # π0: (batch, chunk, prefix keys, tiling)
    "1 view, chunk 63": (1, 63, 256, {}),
    "π0.5, 1 view, chunk 63": (1, 63, 256, {"pi05": True}),
    "π0.5, B=4, 2 views, prompt 20, chunk 50": (4, 50, 532, {"pi05": True}),
    "3 views, prompt 20, chunk 50": (1, 50, 788, {}),
    "B=2, 2 views, prompt 20, chunk 50": (2, 50, 532, {}),
    "B=4, 2 views, prompt 20, chunk 50": (4, 50, 532, {}),
    "B=8, 2 views, prompt 20, chunk 50": (8, 50, 532, {}),
}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the nvcc wheels are Linux-only")


def _spill_budget(m_tiles: int) -> int:
    return 32 if m_tiles <= 1 else 256 if m_tiles <= 4 else 2048


@pytest.mark.parametrize("name", list(VARIANTS))
def test_expert_kernel_variant_compiles_within_budget(name) -> None:
    nvcc = build.find_nvcc()
    assert nvcc, "no nvcc: `pip install -e .[test]` installs the nvidia-cuda-nvcc wheel"
    batch, chunk, prefix, tiling = VARIANTS[name]
    d = ExpertDims(batch=batch, chunk=chunk, prefix=prefix, **tiling)
    assert why_unsupported(d) is None
    assert d.smem_bytes <= SMEM_LIMIT
    _, log = build.compile_cubin("expert_step.cu", d.template_args(), nvcc=nvcc, quiet=True, use_cache=False)
    r = build.Resources.parse(log)
    assert r.registers == 168, log
    assert r.spill_stores <= _spill_budget(d.m_tiles) and r.spill_loads <= 2 * _spill_budget(d.m_tiles), log
    assert not r.wgmma_serialized or d.m_tiles > 2, log


MEASURED_VARIANTS = {  # what docs/cuda_expert.md's tables time (B = 1, 1 view, chunk 63): kept building, not shipped
    "the protocol alone (diag 3)": {"diag": 3},
    "the protocol without its output stores (diag 7)": {"diag": 7},
    "two accumulator chains": {"acc_chains": 2},
}


@pytest.mark.parametrize("name", list(MEASURED_VARIANTS))
def test_measured_variants_still_build(name) -> None:
    """The bench's attribution variants are compile-time switches the default never takes: without this they would
    rot unseen. Two chains spill a little at B = 1 (56 / 72 bytes stored / loaded), bounded here so growth shows."""
    nvcc = build.find_nvcc()
    assert nvcc
    d = ExpertDims(batch=1, chunk=63, prefix=256, **MEASURED_VARIANTS[name])
    _, log = build.compile_cubin("expert_step.cu", d.template_args(), nvcc=nvcc, quiet=True, use_cache=False)
    r = build.Resources.parse(log)
    assert r.registers == 168 and not r.wgmma_serialized, log
    assert r.spill_stores <= 64 and r.spill_loads <= 96, log


TOOLS = Path(__file__).resolve().parent.parent / "tools"
PROBES = {  # the measurement kernels under tools/ (docs/cuda_expert.md): source, defines
    "handoff_probe, thread loads": ("handoff_probe.cu", {"BULK": 0}),
    "handoff_probe, bulk copies": ("handoff_probe.cu", {"BULK": 1}),
    "handoff_probe, bulk copies and a ring of 16 pages": ("handoff_probe.cu", {"BULK": 1, "RING_PAGES": 16}),
    "unit_probe, today's tiling": ("unit_probe.cu", {"CLUSTER": 1}),
    "unit_probe, two chains": ("unit_probe.cu", {"CLUSTER": 1, "ACC_CHAINS": 2}),
    "unit_probe, K split over clusters of 4": ("unit_probe.cu", {"CLUSTER": 4, "ACC_CHAINS": 2}),
    "unit_probe, clusters of 2, no MMAs": ("unit_probe.cu", {"CLUSTER": 2, "MMA": 0}),
    "unit_probe, an attention unit, its partial by one bulk store": ("unit_probe.cu", {"ATTN": 1, "BULK_STORE": 1}),
    "bandwidth_probe, unicast": ("bandwidth_probe.cu", {"CLUSTER": 1, "MULTICAST": 0, "CHUNK_KB": 8, "RING_KB": 192}),
    "bandwidth_probe, multicast in clusters of 4": ("bandwidth_probe.cu", {"CLUSTER": 4, "MULTICAST": 1, "CHUNK_KB": 16,
                                                                          "RING_KB": 96}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PROBES))
def test_measurement_probes_build_without_spills(name) -> None:
    """The probes run only on a GPU: compiled here so they do not rot between device sessions."""
    nvcc = build.find_nvcc()
    assert nvcc
    source, defines = PROBES[name]
    _, log = build.compile_cubin(str(TOOLS / source), defines, nvcc=nvcc, quiet=True, use_cache=False)
    r = build.Resources.parse(log)
    assert r.spill_stores == 0 and r.spill_loads == 0, log


def test_compile_errors_are_reported_with_the_log(tmp_path, monkeypatch) -> None:
    nvcc = build.find_nvcc()
    assert nvcc
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    (tmp_path / "broken.cu").write_text("__global__ void k() { this is not cuda; }\n")
    with pytest.raises(build.BuildError, match="nvcc failed for broken.cu"):
        build.compile_cubin("broken.cu", {}, nvcc=nvcc, quiet=True, use_cache=False)


def test_missing_nvcc_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.BuildError, match="no nvcc found"):
        build.compile_cubin("expert_step.cu", {}, quiet=True)
