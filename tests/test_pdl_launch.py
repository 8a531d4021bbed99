"""`triton_kernels.pdl.launch`: the USE_PDL constexpr and the launch option it passes, per mode, and `early` (the
kernel lets the next one launch before its own wait) only where PDL is on. Runs on meta tensors (no GPU)."""

import pytest
import torch

from vla_rt.triton_kernels.pdl import PDL_MODES, launch, pdl_mode


class RecordingKernel:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("mode", ["off", "on", "early"])
@pytest.mark.parametrize("early", [False, True])
def test_launch_flags(monkeypatch, mode, early):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter never uses PDL
    kernel, like = RecordingKernel(), torch.empty(4, device="meta")
    with pdl_mode(mode):
        launch(kernel, (1,), like, early=early)(1, 2)
    (kwargs,) = kernel.calls
    if mode == "off":
        assert kwargs == {"USE_PDL": 0}
    else:
        assert kwargs == {"USE_PDL": PDL_MODES["early"] if early else PDL_MODES[mode], "launch_pdl": True}
