"""The warp-specialized GEMM's launcher without a GPU: argument checks (one error naming the argument, expected vs
found), the tile schedule the kernel walks (`tile_order`, the same formula as gemm_ws.cu's `tile_at`), the launch
parameter layout against the kernel's, and the shared-memory limits of the variants."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from vla_rt.cuda_kernels import gemm_ws as ws

BF16 = torch.bfloat16


def _mats(m=77, n=64, k=128, gated=False):
    return torch.zeros(m, k, dtype=BF16), torch.zeros(2 * n if gated else n, k, dtype=BF16)


def test_params_match_the_kernels_struct() -> None:
    src = (ws.build.SOURCE_DIR / ws.SOURCE).read_text()
    m = re.search(r"sizeof\(Params\) == (\d+) && offsetof\(Params, out\) == (\d+) && offsetof\(Params, m\) == (\d+)",
                  src)  # fmt: skip
    assert m, "gemm_ws.cu's Params static_assert changed form"
    assert (ctypes.sizeof(ws.Params), ws.Params.out.offset, ws.Params.m.offset) == tuple(int(g) for g in m.groups())
    assert ws.Params.w_map.offset == 128 and ws.Params.bias.offset == 264 and ws.Params.group_m.offset == 284


@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(34, 8, 8), (5, 64, 8), (1, 1, 8), (34, 128, 4), (7, 3, 1)])
def test_tile_order_covers_every_tile_once_in_groups(tiles_m, tiles_n, group_m) -> None:
    order = ws.tile_order(tiles_m, tiles_n, group_m)
    assert sorted(order) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]
    per_group = group_m * tiles_n
    for t, (i, _) in enumerate(order):  # a group's tiles stay within its group_m row tiles
        assert t // per_group * group_m <= i < min(tiles_m, (t // per_group + 1) * group_m)
    first = order[: min(group_m, tiles_m)]  # the raster walks down a group's rows before the next column
    assert first == [(i, 0) for i in range(len(first))]


def test_a_persistent_grid_splits_the_tiles_round_robin() -> None:
    order, grid = ws.tile_order(34, 8, 8), 132
    per_cta = [order[b::grid] for b in range(grid)]
    assert sum(len(c) for c in per_cta) == 272 and {len(c) for c in per_cta} == {2, 3}


@pytest.mark.parametrize(
    "bn,stages,ok", [(128, 6, True), (256, 4, True), (256, 5, False), (64, 4, False), (128, 1, False)]
)
def test_variants_that_do_not_fit_are_refused(bn, stages, ok) -> None:
    why = ws.Variant(bn, stages).why_unsupported()
    assert (why is None) == ok, why
    assert ws.Variant(bn, stages, gated=True).out_n == bn // 2


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a, w: (a.float(), w, {}), r"a: expected torch.bfloat16, found torch.float32"),
        (lambda a, w: (a, w[:, :64], {}), r"w: expected shape \(\*, 128\), found \(64, 64\)"),
        (lambda a, w: (a[:, :120], w[:, :120], {}), r"a: expected a contiguous tensor"),
        (lambda a, w: (a[:, :4].contiguous(), w[:, :4].contiguous(), {}), r"K \(a.shape\[1\]\): expected a positive multiple of 8"),
        (lambda a, w: (a, w[:60], {}), r"N \(output columns\): expected a positive multiple of 8, found 60"),
        (lambda a, w: (a, w, {"residual": True}), r"out: expected the residual tensor"),
        (lambda a, w: (a, w, {"out": torch.zeros(77, 32, dtype=BF16)}), r"out: expected shape \(77, 64\), found \(77, 32\)"),
        (lambda a, w: (a, w, {"bias": torch.zeros(64)}), r"bias: expected contiguous torch.bfloat16 of shape \(64,\)"),
        (lambda a, w: (a, w[:63], {"gated": True}), r"w.shape\[0\]: expected an even number of rows"),
        (lambda a, w: (a, w, {"gated": True, "bias": torch.zeros(32, dtype=BF16)}), r"bias: .* shape \(64,\), found .* \(32,\)"),
        (lambda a, w: (a.view(torch.int16), w, {}), r"a: expected torch.bfloat16, found torch.int16"),
        (lambda a, w: (a[0], w, {}), r"a: expected a 2-D tensor"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(change, match) -> None:
    a, w = _mats()
    a, w, kw = change(a, w)
    with pytest.raises(ValueError, match=match):
        ws.gemm_ws(a, w, **kw)


def test_non_tensors_and_unaligned_pointers_are_named() -> None:
    a, w = _mats()
    with pytest.raises(TypeError, match="w: expected a torch.Tensor, found list"):
        ws.gemm_ws(a, [[1.0]])
    a2 = torch.zeros(77 * 128 + 8, dtype=BF16)[8:].view(77, 128)  # 16-byte aligned
    assert ws.check_args(a2, w, None, None, False, False) == (77, 64, 128)
    a3 = torch.zeros(77 * 128 + 4, dtype=BF16)[4:].view(77, 128)
    with pytest.raises(ValueError, match=r"a.data_ptr\(\): expected 16-byte alignment"):
        ws.gemm_ws(a3, w)


def test_valid_cpu_call_says_it_needs_cuda() -> None:
    a, w = _mats(gated=True)
    assert ws.check_args(a, w, None, torch.zeros(128, dtype=BF16), False, True) == (77, 64, 128)
    with pytest.raises(ValueError, match="gemm_ws: needs CUDA tensors"):
        ws.gemm_ws(a, w, gated=True)
    with pytest.raises(ValueError, match="stages=5 needs"):
        ws.gemm_ws(a, w, gated=True, stages=5)
