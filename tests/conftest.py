"""Test-session setup shared by every test module.

Without CUDA, Triton kernels run in Triton's interpreter, and Triton fixes interpreter-vs-compiler mode when it is
first imported; torch itself may import Triton early (e.g. for its own bmm kernels), so the switch must be set
before any test imports torch.
"""

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """An empty launch-config directory (per-GPU tables written by the test), the lookup caches cleared around it."""
    from vla_rt.triton_kernels import launch_configs as lc

    monkeypatch.setattr(lc, "CONFIG_DIR", tmp_path)
    lc.load_table.cache_clear()
    lc._gemm_config_cuda.cache_clear()
    yield tmp_path
    lc.load_table.cache_clear()
    lc._gemm_config_cuda.cache_clear()


class _LaunchSpy:
    """Stands in for a Triton kernel: records the grid of each `kernel[grid]`, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def spy_launches(monkeypatch):
    """`spy_launches(module, "kernel_name")` -> the list of grids that kernel is launched with during the test (it
    still runs): shows which kernel a wrapper really chose."""

    def install(module, name: str) -> list:
        spy = _LaunchSpy(getattr(module, name))
        monkeypatch.setattr(module, name, spy)
        return spy.grids

    return install
