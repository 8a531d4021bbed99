"""The kernel benchmark (`vla_rt.bench.kernels`) without a GPU: its rows run our kernels on the tuner's engine-like
inputs and put the right numbers in the right columns (timing stubbed; the real timing runs on the device)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vla_rt.bench import kernels as K  # noqa: E402
from vla_rt.triton_kernels.gemm import gemm as real_gemm  # noqa: E402
from vla_rt.triton_kernels.shapes import GemmShape  # noqa: E402
from vla_rt.triton_kernels.tuning import measure as M  # noqa: E402


def test_gemm_row_uses_the_engines_layout(monkeypatch):
    """Padded rows and the periodic position embedding for the patch GEMM (the fast path the engine runs)."""
    calls = []

    def spy(a, w, out, **kw):
        calls.append((a, w, kw))
        return real_gemm(a, w, out, **kw)

    monkeypatch.setattr(K, "_us", lambda launch, copies=1: (launch(0), 1.0)[1])
    monkeypatch.setattr(M, "gemm", spy)
    row = K.gemm_row(GemmShape("siglip.patch", 512, 16, 44, bias=True, residual=True), torch.float32, "cpu")
    a, w, kw = calls[0]
    assert a.stride(0) == 48 and w.stride(0) == 48 and kw["residual_period"] == 256 and kw["residual"].shape[0] == 256
    assert row["shape"] == "512x16x44" and row["us"] == 1.0 and row["kernel"] == "gemm"


def test_rope_row_times_the_rope_gemm_and_what_it_replaces(monkeypatch, capsys):
    launched = []

    def fake_us(launch, copies=1):
        launch(0)
        launched.append(launch)
        return 2.0 * len(launched)

    monkeypatch.setattr(K, "_us", fake_us)
    row = K.gemm_row(GemmShape("expert.qkv", 12, 768, 40, row_scale=True, rope=True), torch.float32, "cpu")
    assert row["name"] == "expert.qkv:rope" and row["us"] == 2.0 and row["unfused_us"] == 6.0  # ours, cuBLAS, unfused
    K.print_row(row, header=True)
    assert "3.00x" in capsys.readouterr().out  # unfused / fused
