"""GEMM kernel vs a float64 torch reference: every epilogue, split-K, aliasing, odd shapes; launch-config lookup;
the TMA kernel (gemm_tma.py) in its four modes, its fallbacks and its place in the tuner's candidates.

Runs in Triton's interpreter on the CPU (fp32 and fp16: the interpreter computes bf16 dots wrongly).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vla_rt.numerics import rel_err
from vla_rt.triton_kernels import GemmConfig, Workspace, gemm  # noqa: E402
from vla_rt.triton_kernels import gemm_stream_k as gemm_stream_k_module  # noqa: E402
from vla_rt.triton_kernels import gemm_tma as gemm_tma_module  # noqa: E402
from vla_rt.triton_kernels import launch_configs as lc  # noqa: E402
from vla_rt.triton_kernels.gemm import workspace_need  # noqa: E402
from vla_rt.triton_kernels.shapes import pi0_gemm_shapes  # noqa: E402
from vla_rt.triton_kernels.tuning.candidates import gemm_candidates  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
SPLIT3 = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=3, group_m=2, num_stages=1)
SPLIT3_COMBINE = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=3, group_m=2, num_stages=1, combine=1)


def reference(a, w, *, bias=None, row_scale=None, activation=None, gated=False, alpha=1.0, residual=None, period=None):
    """The documented epilogue order, in float64."""
    y = a.double() @ w.double().T
    if row_scale is not None:
        y = y * row_scale.double()[:, None]
    if bias is not None:
        y = y + bias.double()
    act = {None: lambda x: x, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = act[activation or "gelu_tanh"](gate) * up
    else:
        y = act[activation](y)
    y = alpha * y
    if residual is not None:
        r = residual.double()
        y = y + (r[torch.arange(a.shape[0]) % period] if period else r)
    return y


def gemm_kwargs(t: dict, opts: dict) -> dict:
    """`gemm` keyword arguments for a case's options (bias, row_scale, activation, gated, alpha, residual, period),
    with the tensors `make` made."""
    period = opts.get("period")
    return dict(
        bias=t["bias"] if opts.get("bias") else None,
        row_scale=t["row_scale"] if opts.get("row_scale") else None,
        activation=opts.get("activation"),
        gated=opts.get("gated", False),
        alpha=opts.get("alpha", 1.0),
        residual=(t["residual"][:period] if period else t["residual"]) if opts.get("residual") else None,
        residual_period=period,
    )


def make(m, n, k, dtype, *, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_w = 2 * n if gated else n
    a = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n_w, k, generator=g) * k**-0.5).to(dtype)
    bias = torch.randn(n_w, generator=g).to(dtype)
    row_scale = torch.rand(m, generator=g) + 0.5
    residual = torch.randn(m, n, generator=g).to(dtype)
    return {k_: v.to(DEVICE) for k_, v in dict(a=a, w=w, bias=bias, row_scale=row_scale, residual=residual).items()}


CASES = {
    # name: (M, N, K, kernel kwargs using the made tensors, config)
    "plain": (37, 45, 70, dict(), None),
    "bias_gelu": (37, 45, 70, dict(bias=True, activation="gelu_tanh"), None),
    "bias_silu_rowscale": (20, 33, 48, dict(bias=True, row_scale=True, activation="silu"), None),
    "gated_bias_rowscale": (19, 24, 40, dict(gated=True, bias=True, row_scale=True), None),
    "gated_silu": (19, 24, 40, dict(gated=True, activation="silu"), None),
    "alpha_residual": (37, 45, 70, dict(alpha=-0.1, residual=True), None),
    "periodic_residual": (40, 24, 33, dict(bias=True, residual=True, period=8), None),
    "split_k_everything": (19, 45, 70, dict(gated=True, bias=True, row_scale=True, alpha=0.5, residual=True), SPLIT3),
    "split_k_empty_splits": (21, 40, 20, dict(bias=True), GemmConfig(16, 32, 16, split_k=4, num_stages=1)),
    "combine_kernel_everything": (
        19,
        45,
        70,
        dict(gated=True, bias=True, row_scale=True, alpha=0.5, residual=True),
        SPLIT3_COMBINE,
    ),
    "combine_kernel_periodic_silu": (
        40,
        24,
        33,
        dict(bias=True, activation="silu", residual=True, period=8),
        GemmConfig(16, 16, 16, 2, combine=1),
    ),
    "combine_kernel_empty_splits": (21, 40, 20, dict(bias=True), GemmConfig(16, 32, 16, split_k=4, combine=1)),
    "grouped_tiles": (70, 80, 24, dict(row_scale=True), GemmConfig(16, 16, 16, split_k=1, group_m=3, num_stages=1)),
    "k_below_block": (9, 17, 5, dict(bias=True), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm_matches_reference(case, dtype):
    m, n, k, opts, config = CASES[case]
    t = make(m, n, k, dtype, gated=opts.get("gated", False))
    period = opts.get("period")
    kwargs = gemm_kwargs(t, opts)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poison: every element must be written
    gemm(t["a"], t["w"], out, config=config, **kwargs)
    assert torch.isfinite(out).all()
    ref = reference(t["a"], t["w"], period=period, **{k_: v for k_, v in kwargs.items() if k_ != "residual_period"})
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("config", [None, SPLIT3, SPLIT3_COMBINE], ids=["one_pass", "split_k", "combine_kernel"])
def test_euler_step_in_place(config):
    """x <- x + dt * v with v = a @ w.T + b computed in fp16 and x kept in fp32, `out` aliasing `residual`."""
    t = make(21, 32, 48, torch.float16)
    x = torch.randn(21, 32, dtype=torch.float32, device=DEVICE)
    expected = reference(t["a"], t["w"], bias=t["bias"], alpha=-0.1, residual=x)
    gemm(t["a"], t["w"], x, bias=t["bias"], alpha=-0.1, residual=x, config=config)
    assert rel_err(x, expected) < 1e-5


def test_strided_operands():
    """a and w as column slices of wider buffers (row stride > K), out as a slice of a wider output."""
    big_a = torch.randn(30, 80, device=DEVICE)
    big_w = torch.randn(50, 96, device=DEVICE) * 0.1
    big_out = torch.full((30, 64), float("nan"), device=DEVICE)
    a, w, out = big_a[:, 8:48], big_w[:, :40], big_out[:, 10:60]
    bias = torch.randn(50, device=DEVICE)
    gemm(a, w, out, bias=bias)
    assert torch.isnan(big_out[:, :10]).all() and torch.isnan(big_out[:, 60:]).all()  # nothing outside written
    assert rel_err(out, reference(a, w, bias=bias)) < 1e-5


def test_epilogue_order_is_checked():
    """A kernel applying the bias after the activation (or alpha after the residual) would fail this suite."""
    t = make(24, 32, 40, torch.float32)
    out = torch.empty(24, 32, device=DEVICE)
    gemm(t["a"], t["w"], out, bias=t["bias"], activation="silu", alpha=0.5, residual=t["residual"])
    right = reference(t["a"], t["w"], bias=t["bias"], activation="silu", alpha=0.5, residual=t["residual"])
    acc = t["a"].double() @ t["w"].double().T
    bias_after_act = 0.5 * (F.silu(acc) + t["bias"].double()) + t["residual"].double()
    alpha_after_residual = 0.5 * (F.silu(acc + t["bias"].double()) + t["residual"].double())
    assert rel_err(out, right) < TOL[torch.float32]
    for wrong in (bias_after_act, alpha_after_residual):
        assert rel_err(wrong, right) > 100 * TOL[torch.float32]  # the wrong orders are far outside tolerance
        assert rel_err(out, wrong) > 100 * TOL[torch.float32]


def test_split_k_is_deterministic_and_resets_counters():
    t = make(19, 45, 70, torch.float32, gated=True)
    ws = Workspace(DEVICE)
    outs = []
    for _ in range(2):
        out = torch.empty(19, 45, device=DEVICE)
        gemm(t["a"], t["w"], out, gated=True, bias=t["bias"], config=SPLIT3, workspace=ws)
        outs.append(out)
        assert int(ws.counters(0).abs().sum()) == 0  # ready for the next launch / graph replay
    assert torch.equal(outs[0], outs[1])
    one_pass = torch.empty_like(outs[0])
    gemm(t["a"], t["w"], one_pass, gated=True, bias=t["bias"], workspace=ws)
    assert rel_err(outs[0], one_pass) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_k_reductions_agree_bitwise(dtype):
    """The last-program merge and the combine kernel sum the same partials in the same order: identical bits, and
    the combine path leaves the arrival counters alone."""
    t = make(19, 45, 70, dtype, gated=True)
    outs = []
    for cfg in (SPLIT3, SPLIT3_COMBINE, GemmConfig(16, 64, 16, split_k=3, combine=1)):
        ws = Workspace(DEVICE)
        out = torch.full((19, 45), float("nan"), dtype=dtype, device=DEVICE)
        gemm(t["a"], t["w"], out, gated=True, bias=t["bias"], residual=t["residual"], config=cfg, workspace=ws)
        assert int(ws.counters(0).abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[2], outs[0]) < TOL[dtype]  # other tiles, same split boundaries: same math, any bits


def test_combine_tile_gives_many_programs():
    from vla_rt.triton_kernels.gemm_pointer import combine_tile

    bm, bn, _ = combine_tile(64, 1024)
    assert (64 // bm) * (1024 // bn) >= 128  # the expert's 64x1024 outputs: >= one program per SM
    bm, bn, _ = combine_tile(768, 2048)
    assert bn == 128


def test_meta_tensors_are_a_dry_run():
    """compile_check records launches on meta tensors; a real kernel launch there (e.g. the combine kernel it does
    not record) must be a no-op, not an error."""
    a, w, out = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ((64, 2048), (1024, 2048), (64, 1024)))
    gemm(a, w, out, residual=out, config=GemmConfig(64, 64, 128, split_k=4, combine=1))
    gemm(a, w, out, config=GemmConfig(64, 64, 128, split_k=4, combine=0))


@pytest.mark.parametrize(
    "bad",
    [
        lambda a, w, o: gemm(a, w[:, :-1], o),  # K mismatch
        lambda a, w, o: gemm(a, w, o[:, :-1]),  # N mismatch
        lambda a, w, o: gemm(a, w.half(), o),  # dtype mismatch
        lambda a, w, o: gemm(a, w, o, activation="relu"),
        lambda a, w, o: gemm(a, w, o, row_scale=torch.ones(a.shape[0], dtype=torch.float16, device=a.device)),
        lambda a, w, o: gemm(a, w, o, residual=o, residual_period=3),  # residual rows != period
        lambda a, w, o: gemm(a.t(), w, o),  # last stride not 1
    ],
)
def test_gemm_rejects_bad_inputs(bad):
    a, w, o = torch.randn(8, 16, device=DEVICE), torch.randn(12, 16, device=DEVICE), torch.empty(8, 12, device=DEVICE)
    with pytest.raises(ValueError):
        bad(a, w, o)


# ------------------------------------------------------------------------------------------ launch configs


def test_config_lookup_exact_then_larger_m_then_heuristic(config_dir):
    entry = dict(block_m=64, block_n=32, block_k=128, split_k=4, group_m=1, num_warps=4, num_stages=5, us=3.1)
    table = {"gemm": {"bfloat16": {"64x2560x1024": entry, "128x2560x1024": {**entry, "split_k": 2}}}}
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))
    look = lambda m, n=2560, k=1024, gated=False: lc._gemm_config_cuda(m, n, k, gated, torch.bfloat16, "Test-GPU", 132)  # noqa: E731
    assert look(64).split_k == 4 and look(64).num_stages == 5  # exact
    assert look(51).split_k == 4  # smallest tabled M above 51
    assert look(100).split_k == 2
    assert look(64, gated=True) == lc.gemm_heuristic(64, 2560, 1024, gated=True)  # flags are part of the key
    assert look(300) == lc.gemm_heuristic(300, 2560, 1024, gated=False)  # no tabled M above 300
    assert look(63).split_k == 4 and look(1).split_k == 4  # skinny entries serve any smaller M


def test_config_lookup_keeps_skinny_m_off_far_wider_entries(config_dir):
    """A skinny M (<= 128) takes a wide entry (> 128 rows) only up to 4x its rows: 408 serves 102, not 51."""
    entry = dict(block_m=128, block_n=128, block_k=64, split_k=1, group_m=8, num_warps=8, num_stages=3, tma=1, us=9.0)
    table = {"gemm": {"bfloat16": {"408x1024x4096": entry, "1632x1024x4096": {**entry, "num_stages": 4}}}}
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))
    look = lambda m: lc._gemm_config_cuda(m, 1024, 4096, False, torch.bfloat16, "Test-GPU", 132)  # noqa: E731
    assert look(102).tma == 1 and look(102).num_stages == 3  # 408 <= 4 x 102
    assert look(51) == lc.gemm_heuristic(51, 1024, 4096, gated=False)  # 408 > 4 x 51: the heuristic
    assert look(409).num_stages == 4  # wide M: any larger entry, as before


def test_cpu_lookup_returns_interpreter_defaults():
    cfg = lc.gemm_config(64, 2560, 1024, gated=False, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cfg.split_k == 1 and cfg.block_m <= 64


def test_shipped_h200_table_covers_pi0_with_valid_configs():
    table = json.loads(lc.table_path("NVIDIA-H200").read_text())
    entries = table["gemm"]["bfloat16"]
    for s in pi0_gemm_shapes(chunks=(50, 63)):
        key = lc.gemm_key(s.m, s.n, s.k, s.gated, rope=s.rope)
        assert key in entries, key
        assert entries[key]["src"] in ("seed", "tune"), key  # says whether it was measured
        assert (entries[key]["src"] == "tune") == ("us" in entries[key]), key
        c = lc.GemmConfig.from_dict(entries[key])
        for block in (c.block_m, c.block_n, c.block_k):
            assert block >= 16 and block & (block - 1) == 0
        n_cols, paired = lc.tile_columns(s.n, s.gated, s.rope)
        rows = 2 if paired else 1
        assert (c.block_m + rows * c.block_n) * c.block_k * 2 * c.num_stages <= 227 * 1024
        assert c.combine in (0, 1)
        if s.m <= 128 and s.n * s.k >= 1 << 20:  # the weight-bound expert GEMMs must fill the GPU
            programs = -(-s.m // c.block_m) * -(-n_cols // c.block_n) * c.split_k
            assert programs >= 64, (key, programs)


def test_gemm_space_and_heuristic():
    """Every config of the space fits shared memory and registers; the heuristic picks from it; its cost model
    reproduces the first H200 run's expert GEMMs (untuned table) within 25%."""
    for m, n, k, gated in (
        (64, 2560, 1024, False),
        (64, 4096, 1024, True),
        (51, 32, 1024, False),
        (768, 2048, 16384, False),
    ):
        space = lc.gemm_space(m, n, k, gated=gated)
        assert space and all(lc._gemm_fits(c, 2 if gated else 1, 2) for c in space)
        assert lc.gemm_heuristic(m, n, k, gated=gated) in space
        assert {c.combine for c in space if c.split_k > 1} == {0, 1}
    measured = {  # (M, N, K, gated): (config of the untuned table, in-graph µs on the H200)
        (64, 2560, 1024, False): (lc.GemmConfig(64, 32, 128, 1, 1, 4, 4), 4.99),
        (64, 1024, 2048, False): (lc.GemmConfig(64, 64, 64, 8, 1, 4, 4), 8.92),
        (64, 4096, 1024, True): (lc.GemmConfig(64, 32, 128, 1, 1, 4, 4), 8.04),
        (64, 1024, 4096, False): (lc.GemmConfig(64, 64, 128, 8, 1, 4, 4), 9.94),
        (64, 32, 1024, False): (lc.GemmConfig(64, 32, 64, 8, 1, 4, 4), 6.30),
        (64, 1024, 1024, False): (lc.GemmConfig(64, 32, 64, 4, 1, 4, 4), 5.98),
    }
    for (m, n, k, gated), (cfg, us) in measured.items():
        assert abs(lc.gemm_cost_us(m, n, k, gated, cfg) / us - 1) < 0.25, (m, n, k, cfg)


def test_workspace_grows_without_freeing_what_a_graph_may_hold():
    ws = Workspace(DEVICE, num_floats=8, num_counters=2)
    first = ws.floats(8)
    ws.reserve(100, 10)
    assert ws.floats(100).numel() == 100 and ws.counters(10).numel() == 10
    assert any(t.data_ptr() == first.data_ptr() for t in ws._retired)  # still referenced, so never reused
    assert int(ws.counters(10).abs().sum()) == 0


# ------------------------------------------------------------------------------------------ the TMA kernel

TMA_MODES = (1, 2, 3)
on_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors, interpreter program counts")
TMA_CASES = {
    # name: (M, N, K, options); 16x16 tiles on 37 rows / 45 columns: 3 x 3 tiles over INTERPRETER_PROGRAMS (3)
    "plain": (37, 45, 70, dict()),
    "bias_gelu_rowscale": (37, 45, 70, dict(bias=True, activation="gelu_tanh", row_scale=True)),
    "gated_bias_rowscale": (19, 24, 40, dict(gated=True, bias=True, row_scale=True)),
    "alpha_periodic_residual": (40, 24, 33, dict(bias=True, alpha=-0.5, residual=True, period=8)),
}


def tma_config(mode: int) -> GemmConfig:
    return GemmConfig(block_m=16, block_n=16, block_k=16, split_k=1, group_m=2, num_warps=4, num_stages=2, tma=mode)


@pytest.fixture
def tma_launches(spy_launches):
    return spy_launches(gemm_tma_module, "gemm_tma_kernel")


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a [:, :K] view of rows padded to a multiple of 8 elements."""
    buf = torch.zeros(x.shape[0], -(-x.shape[1] // 8) * 8, dtype=x.dtype)
    buf[:, : x.shape[1]] = x
    return buf[:, : x.shape[1]]


def run_case(case: str, dtype, config: GemmConfig):
    """One TMA_CASES case through `gemm`: (output, float64 reference). A and W rows are padded to a multiple of 8
    elements (16 bytes at fp16), as the engine allocates them, so TMA can describe them and K overhangs the tiles."""
    m, n, k, opts = TMA_CASES[case]
    t = make(m, n, k, dtype, gated=opts.get("gated", False))
    t["a"], t["w"] = padded_rows(t["a"]), padded_rows(t["w"])
    period = opts.get("period")
    kwargs = gemm_kwargs(t, opts)
    out = torch.full((m, n), float("nan"), dtype=dtype)  # poison: every element must be written
    gemm(t["a"], t["w"], out, config=config, **kwargs)
    ref = reference(t["a"], t["w"], period=period, **{k_: v for k_, v in kwargs.items() if k_ != "residual_period"})
    return out, ref


@on_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", TMA_MODES)
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_tma_gemm_matches_reference(case, mode, dtype, tma_launches):
    out, ref = run_case(case, dtype, tma_config(mode))
    assert len(tma_launches) == 1, "the TMA kernel did not run"
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


@on_interpreter
@pytest.mark.parametrize("mode", TMA_MODES)
def test_persistent_grid_is_capped_and_every_tile_written(mode, tma_launches):
    """37 x 45 in 16 x 16 tiles = 9 tiles; persistent modes 2, 3 launch INTERPRETER_PROGRAMS programs, which must
    cover all 9 (the NaN poison shows a missed tile), and the K tail (70 = 4 x 16 + 6) arrives zero-filled."""
    out, ref = run_case("plain", torch.float32, tma_config(mode))
    programs = tma_launches[0][0]
    assert programs == (9 if mode == 1 else gemm_tma_module.INTERPRETER_PROGRAMS)
    assert rel_err(out, ref) < TOL[torch.float32]


@on_interpreter
def test_tma_kernel_agrees_with_pointer_kernel():
    """Same tiles, same K order: the two kernels give the same fp32 result up to summation rounding."""
    tma_out, ref = run_case("gated_bias_rowscale", torch.float32, tma_config(2))
    ptr_out, _ = run_case("gated_bias_rowscale", torch.float32, tma_config(0))
    assert rel_err(tma_out, ptr_out) < 1e-6
    assert rel_err(tma_out, ref) < TOL[torch.float32] < rel_err(tma_out, ref * 1.001)  # the check can fail


@on_interpreter
def test_unaligned_operands_fall_back_to_the_pointer_kernel(tma_launches):
    """A row stride of 35 fp32 elements (140 bytes) cannot be TMA-described: same result via pointer loads."""
    g = torch.Generator().manual_seed(3)
    big_a, w = torch.randn(37, 35, generator=g), torch.randn(45, 33, generator=g) * 0.2
    a = big_a[:, :33]
    out = torch.empty(37, 45)
    gemm(a, w, out, config=tma_config(2))
    assert not tma_launches
    assert rel_err(out, reference(a, w)) < TOL[torch.float32]


@on_interpreter
def test_last_program_split_k_keeps_the_pointer_kernel(tma_launches):
    """A TMA config with the last-arriving split-K merge runs the pointer kernel."""
    t = make(37, 45, 70, torch.float32)
    t["a"], t["w"] = padded_rows(t["a"]), padded_rows(t["w"])  # TMA-describable: only the options keep it off
    out = torch.empty(37, 45)
    gemm(t["a"], t["w"], out, config=GemmConfig(16, 16, 16, split_k=2, num_stages=1, combine=0, tma=2))
    assert not tma_launches
    assert rel_err(out, reference(t["a"], t["w"])) < TOL[torch.float32]


@on_interpreter
@pytest.mark.parametrize("mode", TMA_MODES)
@pytest.mark.parametrize("case", ["gated_bias_rowscale", "alpha_periodic_residual"])
def test_tma_split_k_partials_through_the_combine_kernel(case, mode, tma_launches):
    """Split-K 3 over K = 33..70 in 16-wide steps (the last split short or empty): the TMA kernel writes partials,
    the pointer kernel's combine kernel sums them in split order and runs the epilogue."""
    cfg = GemmConfig(16, 16, 16, split_k=3, group_m=2, num_warps=4, num_stages=2, combine=1, tma=mode)
    out, ref = run_case(case, torch.float32, cfg)
    assert len(tma_launches) == 1 and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float32]


@on_interpreter
def test_gemm_tma_rejects_configs_it_cannot_run():
    t = make(37, 45, 72, torch.float32)
    out = torch.empty(37, 45)
    rope_off = (out, out, out, out, 1, 0, 1.0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="config.tma must be one of"):
        gemm(t["a"], t["w"], out, config=tma_config(5))  # (a removed mode, or a typo in a table)
    for cfg in (tma_config(0), tma_config(4), GemmConfig(16, 16, 16, split_k=2, combine=0, tma=1)):
        with pytest.raises(ValueError, match="gemm_tma needs"):
            gemm_tma_module.gemm_tma(t["a"], t["w"], out, cfg, 45, (out, out, out), out, rope_off, 1.0, None, 0, {},
                                     {})  # fmt: skip
    assert gemm_tma_module.tma_applies(t["a"], t["w"], tma_config(1))
    assert not gemm_tma_module.tma_applies(t["a"], t["w"], tma_config(1), rope_half=12)  # 16 columns straddle heads
    assert gemm_tma_module.tma_applies(t["a"], t["w"], tma_config(1), rope_half=32)


@on_interpreter
def test_tuner_offers_tma_but_the_heuristic_does_not():
    """TMA configs are candidates (the tuner times them), never the untimed heuristic's default."""
    wide = lc.gemm_space(768, 16384, 2048, gated=True)
    assert {c.tma for c in wide} == {0, 1, 2, 3, 4}
    assert all(c.split_k == 1 or c.combine == 1 for c in wide if c.tma)
    assert all(c.split_k == 1 for c in wide if c.tma == 4)
    assert {c.tma for c in lc.gemm_space(64, 4096, 1024, gated=True)} == {0, 1, 2}
    cands = gemm_candidates(768, 16384, 2048, True, 2, quick=True)
    assert {1, 2, 3} <= {c.tma for c in cands}
    assert lc.gemm_heuristic(768, 16384, 2048, gated=True).tma == 0


@on_interpreter
def test_config_tma_field_round_trips_and_old_entries_read_as_pointer_kernel():
    cfg = tma_config(3)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    plain = tma_config(0).to_dict()
    assert "tma" not in plain  # tables written before TMA keep their form
    assert GemmConfig.from_dict(plain).tma == 0


# ------------------------------------------------------------------------------------------ stream-K (tma = 4)


@pytest.fixture
def stream_k_launches(spy_launches):
    return spy_launches(gemm_stream_k_module, "gemm_stream_k_kernel")


@on_interpreter
@pytest.mark.parametrize("programs", [2, 4, 5, 7, 20])
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_stream_k_matches_reference(case, programs, monkeypatch, stream_k_launches):
    """Every epilogue through stream-K on `programs` SMs: 37 x 45 in 16 x 16 tiles is 9 tiles, so 2 / 4 / 5 programs
    share the last 1 / 1 / 4 tiles' K iterations (5 of them: 70 = 4 x 16 + 6) and 20 programs share all 9 (fewer
    tiles than SMs); NaN poison shows a tile nobody wrote, and the check can fail."""
    monkeypatch.setattr(gemm_tma_module, "INTERPRETER_PROGRAMS", programs)
    out, ref = run_case(case, torch.float32, tma_config(4))
    assert len(stream_k_launches) == 1, "the stream-K kernel did not run"
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float32] < rel_err(out, ref * 1.001)


@on_interpreter
def test_stream_k_shares_tiles_and_replays_bit_identically(monkeypatch, stream_k_launches):
    """With 4 programs over 9 tiles one tile's K is shared by all four: the counters the last arrival resets let a
    second launch (a graph replay) merge again, in program order, so the two results are bit-identical."""
    monkeypatch.setattr(gemm_tma_module, "INTERPRETER_PROGRAMS", 4)
    m, n, k = 37, 45, 70
    sk_tiles, iters, sk_programs = gemm_stream_k_module.stream_k_plan(m, n, k, 16, 16, 16, 4)
    assert (sk_tiles, iters, sk_programs) == (1, 5, 4)  # the shared path runs, not only the whole-tile one
    ws = Workspace(torch.device("cpu"))
    first, ref = run_case("bias_gelu_rowscale", torch.float32, tma_config(4))
    t = make(m, n, k, torch.float32)
    t["a"], t["w"] = padded_rows(t["a"]), padded_rows(t["w"])
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"))
        gemm(t["a"], t["w"], out, config=tma_config(4), workspace=ws)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert int(ws.counters(sk_tiles).abs().sum()) == 0  # left at zero for the next launch
    assert rel_err(outs[0], reference(t["a"], t["w"])) < TOL[torch.float32]
    assert rel_err(first, ref) < TOL[torch.float32]


@on_interpreter
def test_stream_k_plan_and_workspace():
    """The plan: T mod P tiles shared (all T when T < P), each program at least one K iteration; the workspace a
    partial slot per (program + tile) and a counter a shared tile; none when the tiles fill whole waves."""
    plan = gemm_stream_k_module.stream_k_plan
    assert plan(4096, 1152, 4304, 128, 128, 64, 132) == (288 % 132, 68, 132)  # SigLIP fc2 at 16 images
    assert plan(1632, 1024, 4096, 128, 128, 64, 132) == (104, 64, 132)  # the expert's down at 32 rows: 104 < 132
    assert plan(64, 64, 32, 64, 64, 64, 132) == (1, 1, 1)  # one iteration: one program
    assert plan(264, 128, 256, 128, 64, 64, 132)[0] == 6  # 3 x 2 tiles < 132: all shared
    floats, counters = workspace_need(4096, 1152, GemmConfig(128, 128, 64, tma=4), k=4304, programs=132)
    assert (floats, counters) == ((132 + 24) * 128 * 128, 24)
    assert workspace_need(128 * 132, 128, GemmConfig(128, 128, 64, tma=4), k=256, programs=132) == (0, 0)
    paired = workspace_need(4096, 1152, GemmConfig(128, 128, 64, tma=4), k=4304, programs=132, paired=True)
    assert paired == (2 * floats, counters)
    with pytest.raises(ValueError, match="needs k"):
        workspace_need(64, 64, GemmConfig(64, 64, 64, tma=4))
    assert not gemm_tma_module.tma_config_applies(GemmConfig(16, 16, 16, split_k=2, combine=1, tma=4))


@on_interpreter
def test_tuner_times_the_incumbents_stream_k_twin():
    """The table's entry is timed beside the same tiles in stream-K, whatever the ranking picks."""
    from vla_rt.triton_kernels.shapes import GemmShape
    from vla_rt.triton_kernels.tuning.candidates import TuneItem, candidates_for

    item = TuneItem(0, "siglip", GemmShape("siglip.fc2", 4096, 1152, 4304, bias=True, residual=True))
    current = GemmConfig(128, 128, 64, 1, 8, 8, 4, 0, 1)
    cands = candidates_for(item, True, None, current, 132)
    assert cands[0] == current and dataclasses.replace(current, tma=4) in cands
