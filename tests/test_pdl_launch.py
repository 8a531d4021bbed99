"""`triton_kernels.pdl.launch`: the USE_PDL constexpr and the launch option it passes, per mode. Runs on meta tensors
(no GPU)."""

import pytest
import torch

from vla_rt.triton_kernels.pdl import PDL_MODES, launch, pdl_mode


class RecordingKernel:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_launch_flags(monkeypatch, mode):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter never uses PDL
    kernel, like = RecordingKernel(), torch.empty(4, device="meta")
    with pdl_mode(mode):
        launch(kernel, (1,), like)(1, 2)
    (kwargs,) = kernel.calls
    if mode == "off":
        assert kwargs == {"USE_PDL": 0}
    else:
        assert kwargs == {"USE_PDL": PDL_MODES[mode], "launch_pdl": True}


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="PDL mode must be one of"):
        with pdl_mode("early"):
            pass
