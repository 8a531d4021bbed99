"""The tuner (`vla_rt.triton_kernels.tuning`) without a GPU: which shapes, in which order, which candidates, the
budget cut-off, the pre-compilation bookkeeping and the table it writes. (The timing itself runs on the device
machine.)"""

import concurrent.futures as cf
import dataclasses
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vla_rt.errors import ArgumentError  # noqa: E402
from vla_rt.triton_kernels import attention_configs as ac  # noqa: E402
from vla_rt.triton_kernels import launch_configs as lc  # noqa: E402
from vla_rt.triton_kernels.shapes import AttentionShape, GemmShape  # noqa: E402
from vla_rt.triton_kernels.tuning import candidates as C  # noqa: E402
from vla_rt.triton_kernels.tuning import measure as M  # noqa: E402
from vla_rt.triton_kernels.tuning import precompile as P  # noqa: E402
from vla_rt.triton_kernels.tuning import run as R  # noqa: E402


def keys(items):
    return [it.key for it in items]


def test_plan_puts_expert_first_then_vlm_siglip_and_the_rest():
    items = C.plan_items(views=(1, 3), prompts=(0, 20), chunks=(63, 50))
    groups = [it.group for it in items]
    assert groups == sorted(groups, key=["expert", "expert_attention", "vlm", "siglip", "prefix_attention",
                                         "siglip_attention"].index)  # fmt: skip
    expert = [it.shape.m for it in items if it.group == "expert"]
    assert expert == [64] * 7 + [51] * 7  # M=64 first (action_in's 8th shape shares no key)... in chunk order
    assert [it.shape.m for it in items if it.group == "vlm"][::4] == [256, 768, 276, 788]
    assert [it.shape.m for it in items if it.group == "siglip"][::6] == [256, 768]
    exp_attn = [it.key for it in items if it.group == "expert_attention"]
    assert exp_attn[:2] == ["b1:64x320:h8/1:d256", "b1:51x307:h8/1:d256"] and len(exp_attn) == 8
    assert len(set(keys(items))) == len(items)
    assert items == sorted(items, key=lambda it: it.priority)


def test_plan_filters():
    only_expert = C.plan_items(groups=("expert",), views=(1,), prompts=(0,), chunks=(63,))
    assert {it.group for it in only_expert} == {"expert"} and len(only_expert) == 7
    attn = C.plan_items(groups=("attention",), views=(2,), prompts=(20,), chunks=(50,))
    assert [it.key for it in attn] == ["b1:51x583:h8/1:d256", "b1:532x532:h8/1:d256", "b2:256x256:h16/16:d72"]
    vlm = C.plan_items(groups=("vlm", "expert_attention"), views=(1,), prompts=(0,), chunks=(63,))
    assert [it.group for it in vlm] == ["expert_attention"] + ["vlm"] * 4
    with pytest.raises(ValueError):
        C.plan_items(groups=("everything",))
    explicit = C.plan_items(shapes=[GemmShape("x", 8, 16, 32)])
    assert [it.key for it in explicit] == ["8x16x32"]


def test_plan_for_batch_buckets_multiplies_rows_and_follows_batch_1():
    """The server's bucket engines run every GEMM at B times the rows and attention at batch B: `--batches` tunes
    those keys (without them a batched expert GEMM finds no tabled entry of its N x K and takes the heuristic)."""
    one = C.plan_items(groups=("expert", "expert_attention", "siglip"), views=(1,), prompts=(0,), chunks=(50,))
    both = C.plan_items(groups=("expert", "expert_attention", "siglip"), views=(1,), prompts=(0,), chunks=(50,),
                        batches=(1, 4))  # fmt: skip
    assert both[: len(one)] == one  # batch 1 first, unchanged
    four = both[len(one) :]
    assert {it.shape.m for it in four if it.group == "expert"} == {4 * 51}
    assert [it.key for it in four if it.group == "expert_attention"] == ["b4:51x307:h8/1:d256"]
    assert {it.shape.m for it in four if it.group == "siglip"} == {4 * 256}
    assert [it.shape.m for it in C.plan_items(groups=("vlm",), views=(2,), prompts=(20,), chunks=(), batches=(2,))] == [
        2 * (2 * 256 + 20)
    ] * 4
    assert len(set(keys(both))) == len(both) and both == sorted(both, key=lambda it: it.priority)


def test_waves_compile_expert_first():
    items = C.plan_items(views=(1,), prompts=(0,), chunks=(63,))
    w = C.waves(items)
    assert [{it.group for it in wave} for wave in w] == [
        {"expert", "expert_attention"}, {"vlm"}, {"siglip"}, {"prefix_attention", "siglip_attention"}
    ]  # fmt: skip


def test_quick_candidates_cover_the_likely_winners():
    seed = lc.GemmConfig(64, 64, 64, 8, 1, 4, 4)
    for m, n, k, gated in ((64, 1024, 2048, False), (64, 4096, 1024, True), (51, 1024, 4096, False)):
        cands = C.gemm_candidates(m, n, k, gated, quick=True, must=[seed])
        assert 15 <= len(cands) <= 20 and len(set(cands)) == len(cands)
        assert cands[0] == seed and lc.gemm_heuristic(m, n, k, gated=gated) in cands
        assert {c.split_k for c in cands} >= {1, 2, 4}
        assert {c.combine for c in cands if c.split_k > 1} == {0, 1}
        assert len({c.block_n for c in cands}) >= 3
        full = C.gemm_candidates(m, n, k, gated, must=[seed])
        assert set(cands) <= set(full) | {seed} and 60 <= len(full) <= 100
    wide = C.gemm_candidates(768, 16384, 2048, True, quick=True)
    assert len({(c.block_m, c.block_n) for c in wide}) >= 3 and all(c.group_m == 8 for c in wide)

    s = AttentionShape("expert", 1, 64, 832, 8, 1, 256, masked=True)
    cands = C.attention_candidates(s, quick=True)
    assert len(cands) == 20
    assert {c.heads_per_program for c in cands} == {1, 2, 4, 8}
    splits = {c.num_splits for c in cands}
    # 832 keys = 13 tiles of 64: the whole-tile split counts (13, 7) beside the powers of two
    assert splits >= {2, 4} and splits & {7, 13} and {c.combine for c in cands if c.num_splits > 1} == {0, 1}
    assert {c.block_n for c in cands} >= {64, 128}


def test_compile_keys_share_binaries_across_m_divisible_by_16():
    cfg = lc.GemmConfig(128, 128, 64, 1, 8, 8, 4)
    vlm = {it.shape.m: it for it in C.plan_items(groups=("vlm",), views=(1, 3), prompts=(0, 20), chunks=())
           if it.shape.name == "vlm.o"}  # fmt: skip
    assert C.compile_key(vlm[256], cfg) == C.compile_key(vlm[768], cfg)
    assert C.compile_key(vlm[276], cfg) == C.compile_key(vlm[788], cfg) != C.compile_key(vlm[256], cfg)
    expert = {it.shape.m: it for it in C.plan_items(groups=("expert",)) if it.shape.name == "expert.o"}
    assert C.compile_key(expert[64], cfg) != C.compile_key(expert[51], cfg)


def fake_measure(clock, cost_s=1.0):
    def measure(item, configs, deadline):
        clock.t += cost_s
        return {"key": item.key, "candidates": [{**c.to_dict(), "us": 1.0 + i} for i, c in enumerate(configs)],
                "compiled_here": 0, "torch_us": 2.0}  # fmt: skip

    return measure


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_run_plan_budget_cut_keeps_priority_order():
    items = C.plan_items(views=(1,), prompts=(0,), chunks=(63,))
    configs = {
        it: [lc.GemmConfig(64, 32, 64)] if it.kind == "gemm" else [ac.AttentionConfig(16, 64, 8)] for it in items
    }
    clock, seen, logs = Clock(), [], []
    result = R.run_plan(items, configs, fake_measure(clock), lambda it, rec: seen.append(it), budget_s=10.5,
                        clock=clock, log=logs.append)  # fmt: skip
    assert seen == items[:11] and result["done"] == seen
    assert result["stopped"] == "budget reached" and "11/" in logs[-1]
    everything = R.run_plan(items, configs, fake_measure(Clock()), lambda it, rec: None, clock=Clock(), log=logs.append)
    assert everything["done"] == items and everything["stopped"] is None


class FakePrecompiler:
    """Records what was submitted when; every future completes at once."""

    def __init__(self, events):
        self.events, self.futures, self.seconds = events, {}, []

    def submit(self, item, configs):
        self.events.append(("submit", item.key))
        for c in configs:
            f = cf.Future()
            f.set_result((True, "", 0.1))
            self.futures[(item.key, c)] = f

    def pending(self, item, configs):
        return [self.futures[(item.key, c)] for c in configs if not self.futures[(item.key, c)].done()]

    def progress(self):
        return len(self.futures), len(self.futures)

    def shutdown(self):
        self.events.append(("shutdown", None))


@pytest.mark.parametrize("overlap", [False, True])
def test_run_plan_compiles_a_wave_before_timing_it(overlap):
    items = C.plan_items(views=(1,), prompts=(0,), chunks=(63,))
    configs = {
        it: [lc.GemmConfig(64, 32, 64)] if it.kind == "gemm" else [ac.AttentionConfig(16, 64, 8)] for it in items
    }
    events = []
    clock = Clock()

    def measure(item, cfgs, deadline):
        events.append(("measure", item.key))
        return fake_measure(clock)(item, cfgs, deadline)

    R.run_plan(items, configs, measure, lambda it, rec: None, precompiler=FakePrecompiler(events), overlap=overlap,
               clock=clock, log=lambda m: None)  # fmt: skip
    kinds = [e[0] for e in events]
    assert kinds[-1] == "shutdown" and kinds.count("measure") == len(items) == kinds.count("submit")
    first_measure = kinds.index("measure")
    wave1 = len(C.waves(items)[0])
    assert first_measure == (len(items) if overlap else wave1)  # everything / the first wave submitted before timing
    if not overlap:
        assert kinds[wave1 : 2 * wave1] == ["measure"] * wave1 and kinds[2 * wave1] == "submit"


def test_budget_also_cuts_a_compile_wait():
    items = C.plan_items(groups=("expert",), views=(1,), prompts=(0,), chunks=(63,))
    configs = {it: [lc.GemmConfig(64, 32, 64)] for it in items}

    class Stuck(FakePrecompiler):
        def submit(self, item, configs):
            for c in configs:
                self.futures[(item.key, c)] = cf.Future()  # never completes

    logs = []
    result = R.run_plan(items, configs, fake_measure(Clock()), lambda it, rec: None, budget_s=0.3,
                        precompiler=Stuck([]), log=logs.append)  # fmt: skip
    assert result["done"] == [] and "pre-compiling wave 1" in result["stopped"]


def test_a_hung_precompile_is_abandoned_and_its_candidates_fail():
    """A worker that never returns (a kernel that hangs in compile or launch) must not stall the tune: after
    `stall_s` without progress its futures are abandoned, timing goes on, and the statuses say 'failed' so the
    timing process never launches that kernel itself."""
    items = C.plan_items(groups=("expert",), views=(1,), prompts=(0,), chunks=(63,))[:2]
    good, hung = lc.GemmConfig(64, 32, 64), lc.GemmConfig(64, 64, 64)
    configs = {it: [good, hung] for it in items}
    pre = P.Precompiler.__new__(P.Precompiler)  # the bookkeeping only, no process pool
    pre.futures, pre.seconds, pre.abandoned = {}, [], set()
    for it in items:
        done, stuck = cf.Future(), cf.Future()
        done.set_result((True, "", 0.1))
        pre.futures[C.compile_key(it, good)], pre.futures[C.compile_key(it, hung)] = done, stuck
    pre.submit = lambda item, cfgs: None
    pre.shutdown = lambda: None
    statuses, logs = [], []

    def measure(item, cfgs, deadline):
        statuses.append([pre.status(item, c) for c in cfgs])
        return fake_measure(Clock())(item, cfgs, deadline)

    result = R.run_plan(items, configs, measure, lambda it, rec: None, precompiler=pre, overlap=True,
                        log=logs.append, stall_s=0.2)  # fmt: skip
    assert result["done"] == items and result["stopped"] is None
    assert any("abandoned" in m for m in logs)
    for (ok_good, _), (ok_hung, why) in statuses:
        assert ok_good is True and ok_hung is False and "abandoned" in why
    assert pre.pending(items[0], [good, hung]) == []


def test_precompile_pool_runs_each_distinct_kernel_once_and_reports_failures():
    """A real spawn pool (workers run the interpreter here): statuses per candidate, one task per compile key,
    a failing config reported as such, progress and shutdown."""
    shape = GemmShape("expert.o", 24, 32, 64, residual=True)
    item = C.TuneItem(0, "expert", shape)
    twin = C.TuneItem(1, "expert", GemmShape("expert.o", 40, 32, 64, residual=True))  # 24 % 16 == 40 % 16
    good, bad = lc.GemmConfig(32, 32, 32, 2, combine=1), lc.GemmConfig(32, 24, 32)  # BLOCK_N 24: not a power of 2
    pre = P.Precompiler(2, "cpu", "float32")
    try:
        pre.submit(item, [good, bad])
        pre.submit(twin, [good])  # same compile key: no second task
        assert len(pre.futures) == 2
        cf.wait(pre.pending(item, [good, bad]), timeout=300)
        assert pre.status(item, good) == (True, "")
        ok, err = pre.status(item, bad)
        assert ok is False and err
        assert pre.status(twin, good) == (True, "") and pre.progress() == (2, 2)
        assert pre.status(item, lc.GemmConfig(32, 32, 64)) == (None, "not pre-compiled")
    finally:
        pre.shutdown()


def test_precompile_worker_function_in_process(monkeypatch):
    monkeypatch.setitem(P._WORKER, "device", "cpu")
    monkeypatch.setitem(P._WORKER, "cache", {})
    item = C.TuneItem(0, "expert_attention", AttentionShape("expert", 1, 8, 40, 8, 1, 16, masked=True))
    ok, err, secs = P.precompile_one(item, ac.AttentionConfig(16, 16, 8, 3, combine=1), "float32")
    assert ok and err == "" and secs > 0 and len(P._WORKER["cache"]) == 1
    ok, err, _ = P.precompile_one(item, ac.AttentionConfig(16, 16, 3), "float32")  # 3 heads do not divide 8
    assert ok is False and "heads_per_program" in err and not P._WORKER["dead"]


def test_broken_worker_pool_falls_back_to_compiling_while_timing():
    """Workers that cannot start (here: no CUDA) break the pool; the statuses say 'unknown', nothing is lost."""
    items = C.plan_items(groups=("expert",), views=(1,), prompts=(0,), chunks=(63,))[:2]
    configs = {it: [lc.GemmConfig(64, 32, 64)] for it in items}
    pre = P.Precompiler(1, "cuda:0", "bfloat16")
    statuses = []

    def measure(item, cfgs, deadline):
        statuses.append(pre.status(item, cfgs[0]))
        return fake_measure(Clock())(item, cfgs, deadline)

    # (no stall cut-off: on a loaded machine spawning a worker that imports torch can take longer than STALL_S)
    result = R.run_plan(items, configs, measure, lambda it, rec: None, precompiler=pre, log=lambda m: None,
                        stall_s=3600)  # fmt: skip
    assert result["done"] == items
    assert all(ok is None for ok, _ in statuses), statuses


def test_best_entry_merge_and_lookup(config_dir):
    seed = lc.GemmConfig(64, 64, 64, 8, 1, 4, 4)
    win = lc.GemmConfig(64, 32, 128, 4, 1, 4, 5, combine=1)
    record = {"key": "64x1024x2048", "compiled_here": 0, "torch_us": 6.0, "cublas_us": 6.4, "candidates": [
        {**seed.to_dict(), "us": 8.9}, {**win.to_dict(), "us": 4.1}, {**lc.GemmConfig(64, 128, 256).to_dict(), "error": "x"}
    ]}  # fmt: skip
    entry = R.best_entry(record, seed.to_dict())
    assert lc.GemmConfig.from_dict(entry) == win
    assert entry["us"] == 4.1 and entry["seed_us"] == 8.9 and entry["torch_us"] == 6.0 and entry["src"] == "tune"
    assert entry["cublas_us"] == 6.4  # cuBLAS with the shape's epilogue, what `gemm`'s cuBLAS choice reads first
    assert entry["candidates"] == 2
    assert R.best_entry({"candidates": [{"error": "x"}]}) is None
    table = {"gemm": {"bfloat16": {"64x1024x2048": {**seed.to_dict(), "src": "seed"}}}}
    R.merge_entry(table, "gemm", "bfloat16", "64x1024x2048", entry)
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))
    assert lc._gemm_config_cuda(51, 1024, 2048, False, torch.bfloat16, "Test-GPU", 132) == win


def test_seed_table_marks_seeds_and_keeps_measurements(config_dir):
    measured = {**lc.GemmConfig(64, 32, 128, 4).to_dict(), "us": 3.0, "src": "tune"}
    stale = {**lc.GemmConfig(64, 64, 64, 8).to_dict(), "src": "seed"}
    table = {"gpu": "Test GPU", "gemm": {"bfloat16": {"64x1024x2048": measured, "64x1024x4096": stale}}}
    (config_dir / "Test-GPU.json").write_text(lc.dump_table(table))
    out = R.seed_table("Test-GPU", reseed=True)
    gemms = out["gemm"]["bfloat16"]
    assert gemms["64x1024x2048"] == measured
    assert gemms["64x1024x4096"]["src"] == "seed"
    assert lc.GemmConfig.from_dict(gemms["64x1024x4096"]) == lc.gemm_heuristic(64, 1024, 4096, gated=False)
    assert all(e["src"] in ("seed", "tune") for e in gemms.values())
    assert json.loads((config_dir / "Test-GPU.json").read_text()) == out


def test_estimate_scales_with_workers_and_overlap():
    items = C.plan_items(views=(1, 3), prompts=(0, 20), chunks=(63, 50))
    configs = {it: C.candidates_for(it, True, None, None, 132) for it in items}
    one = R.estimate_seconds(items, configs, 1)
    fifteen = R.estimate_seconds(items, configs, 15)
    both = R.estimate_seconds(items, configs, 15, overlap=True)
    assert one["compiles"] == fifteen["compiles"] < one["candidates"]  # shared binaries compile once
    assert one["total_s"] > fifteen["total_s"] > both["total_s"]
    assert fifteen["total_s"] < 400  # the quick run of the brief fits a 10-minute call


def test_cli_maps_flags_and_tune_needs_cuda(monkeypatch):
    got = {}
    monkeypatch.setattr(R, "tune", lambda **kw: got.update(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # main looks for the GPU after the options
    R.main(["--quick", "--groups", "expert,attention", "--views", "1,3", "--prompts", "0", "--chunks", "63",
            "--budget-s", "480", "--workers", "12", "--overlap", "--log", "x.json"])  # fmt: skip
    assert got["quick"] and got["groups"] == ("expert", "attention") and got["views"] == (1, 3)
    assert got["prompts"] == (0,) and got["chunks"] == (63,) and got["budget_s"] == 480 and got["workers"] == 12
    assert got["overlap"] and got["log_path"] == "x.json"
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="device: expected a CUDA GPU for vla-rt tune"):
            R.main(["--quick"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            R.tune(quick=True)


@pytest.mark.parametrize(
    "shape",
    [
        GemmShape("siglip.patch", 48, 40, 44, bias=True, residual=True),  # K = 44: rows padded to 48, period 256
        GemmShape("expert.gate_up", 19, 24, 40, gated=True, row_scale=True),
        GemmShape("expert.o", 21, 32, 64, residual=True),
    ],
    ids=lambda s: s.name,
)
def test_tune_inputs_reference_and_workspace_need(shape, monkeypatch):
    """What the timing phase launches (in the interpreter here): the engine's padded layout, a periodic residual for
    the patch GEMM, a reference that agrees, and a workspace need that covers the launch (so capture never grows)."""
    from vla_rt.triton_kernels.workspace import Workspace

    monkeypatch.setattr(M, "TOKENS_PER_VIEW", 16)  # the period, scaled down with the shape
    item = C.TuneItem(0, "expert", shape)
    x = M.gemm_inputs(shape, torch.float32, torch.device("cpu"), copies=2)
    assert x["a"].stride(0) % 8 == 0 and x["ws"][1].stride(0) % 8 == 0
    assert (x["kw"]["residual_period"] == 16) == (shape.name == "siglip.patch")
    for cfg in (lc.GemmConfig(16, 16, 16, 1), lc.GemmConfig(16, 16, 16, 2, combine=1), lc.GemmConfig(16, 32, 16, 4)):
        ws = Workspace("cpu")
        x["out"].fill_(float("nan"))
        M.launch_gemm(x, cfg, 0, ws)
        ref = M.gemm_reference(x)
        assert ((x["out"] - ref).norm() / ref.norm()).item() < 1e-5
        floats, counters = M.candidate_workspace(item, cfg)
        assert ws._floats.numel() <= floats and ws._counters.numel() <= counters


def test_tune_attention_inputs_and_workspace_need():
    from vla_rt.triton_kernels.attention import attention_reference
    from vla_rt.triton_kernels.workspace import Workspace

    shape = AttentionShape("expert", 1, 8, 40, 8, 1, 16, masked=True)
    item = C.TuneItem(0, "expert_attention", shape)
    x = M.attention_inputs(shape, torch.float32, torch.device("cpu"))
    ref = attention_reference(x["q"], x["k"], x["v"], scale=x["scale"], **x["blocks"])
    for cfg in (ac.AttentionConfig(16, 16, 8, 3, combine=1), ac.AttentionConfig(16, 16, 2, 2)):
        ws = Workspace("cpu")
        M.launch_attention(x, cfg, 0, ws)
        assert ((x["out"] - ref).norm() / ref.norm()).item() < 1e-5
        floats, counters = M.candidate_workspace(item, cfg)
        assert ws._floats.numel() == floats and ws._counters.numel() == (0 if cfg.combine else counters)


def test_tune_driver_end_to_end_in_the_interpreter(config_dir, tmp_path, monkeypatch):
    """The whole driver on the CPU: candidates, correctness checks, a fake timer, the table and the log it writes,
    with a candidate that fails (its error is logged, the shape still gets a winner)."""
    calls = []

    def fake_timer(launch, copies):
        launch(0)
        calls.append(1)
        return 10.0 - len(calls) * 0.1  # later candidates look faster

    shapes = [GemmShape("expert.o", 24, 32, 64, residual=True)]
    attn = [AttentionShape("expert.v1", 1, 8, 40, 8, 1, 16, masked=True)]
    bad = lc.GemmConfig(32, 32, 64, 1, 1, 4, 1)
    real = C.candidates_for
    monkeypatch.setattr(R, "candidates_for", lambda it, *a: real(it, *a) + ([bad] if it.kind == "gemm" else []))
    real_launch = M.launch_gemm

    def launch(x, cfg, i=0, workspace=None):
        if cfg == bad:
            raise RuntimeError("boom")
        real_launch(x, cfg, i, workspace)

    monkeypatch.setattr(M, "launch_gemm", launch)
    out, log = tmp_path / "out.json", tmp_path / "log.json"
    table = R.tune_on(torch.device("cpu"), "Test GPU", 132, fake_timer, start=0.0, shapes=shapes, gpu_name=None,
                    attention_shapes=attn, dtype=torch.float32, path=out, quick=True, verbose=False, groups=C.GROUPS,
                    views=(1,), prompts=(0,), chunks=(63,), budget_s=None, workers=0, overlap=False,
                    timer_name="fake", max_candidates=3, log_path=log)  # fmt: skip
    entry = table["gemm"]["float32"]["24x32x64"]
    assert entry["src"] == "tune" and entry["candidates"] == 3 and "seed_us" in entry and "torch_us" in entry
    assert "cublas_us" in entry  # the residual epilogue is one cuBLAS call (x += a @ w.T), checked and timed
    assert table["attention"]["float32"]["b1:8x40:h8/1:d16"]["src"] == "tune"
    assert json.loads(out.read_text()) == table
    records = json.loads(log.read_text())["records"]
    assert [r["key"] for r in records] == ["24x32x64", "b1:8x40:h8/1:d16"]
    assert "boom" in records[0]["candidates"][-1]["error"]


# ------------------------------------------------------------------------------------------- the RoPE epilogue


def test_the_expert_qkv_is_tuned_with_its_rope_epilogue():
    """The engine runs the expert's QKV with the RoPE epilogue, so that is what the expert group tunes: pair columns,
    two weight rows each, a compile key of its own."""
    items = C.plan_items(groups=("expert",), views=(1,), prompts=(0,), chunks=(63,))
    assert keys(items)[0] == "64x2560x1024:rope" and "64x2560x1024" not in keys(items)
    cands = C.candidates_for(items[0], True, None, None, 132)
    assert cands and all(lc._gemm_fits(c, 2, 2) for c in cands)
    assert lc.gemm_heuristic(64, 1280, 1024, gated=True) in cands
    plain = C.TuneItem(0, "expert", GemmShape("expert.qkv", 64, 2560, 1024, row_scale=True))
    assert C.compile_key(items[0], cands[0]) != C.compile_key(plain, cands[0])


@pytest.mark.parametrize(
    "shape",
    # 768 = (1 + 2) x 256 columns: one Q head beside K and V (π0's head dim), enough for every path of the epilogue
    [GemmShape("expert.qkv", 12, 768, 40, row_scale=True, rope=True), GemmShape("vlm.kv", 12, 512, 40, rope=True)],
    ids=lambda s: s.name,
)
def test_tune_rope_inputs_reference_and_workspace_need(shape):
    """A RoPE candidate's launch matches the reference (Q columns and the cache rows it wrote), and the workspace
    need covers its split-K partials."""
    from vla_rt.triton_kernels.workspace import Workspace

    item = C.TuneItem(0, "expert", shape)
    x = M.gemm_inputs(shape, torch.float32, torch.device("cpu"), copies=2)
    ref = M.gemm_reference(x)
    for cfg in (lc.GemmConfig(16, 16, 16, 1), lc.GemmConfig(16, 16, 16, 2, combine=1), lc.GemmConfig(16, 32, 16, 3)):
        ws = Workspace("cpu")
        M.poison_gemm(x)
        M.launch_gemm(x, cfg, 0, ws)
        got = M.gemm_outputs(x)
        assert torch.isfinite(got).all() and ((got - ref).norm() / ref.norm()).item() < 1e-5
        floats, counters = M.candidate_workspace(item, cfg)
        assert ws._floats.numel() <= floats and ws._counters.numel() <= counters


def test_candidates_include_the_incumbents_tma_twins():
    """The table's pointer-kernel entry is timed beside the same tiles with TMA loads (modes 1, 2): the cost
    model's ranking did not always reach them (the H200 expert gate/up's 64/32/64 s6). Not for a last-program
    split-K entry, which TMA cannot run, nor for an entry that already uses TMA."""
    item = C.TuneItem(0, "expert", GemmShape("expert.gate_up", 64, 4096, 1024, gated=True, row_scale=True))
    cur = lc.GemmConfig(64, 32, 64, 1, 1, 4, 6, 0)
    cands = C.candidates_for(item, True, None, cur, 132)
    assert cands[:3] == [cur, dataclasses.replace(cur, tma=1), dataclasses.replace(cur, tma=2)]
    merge = lc.GemmConfig(64, 64, 64, 8, 1, 4, 6, combine=0)
    assert not any(c.tma and c.split_k == 8 and c.combine == 0 for c in C.candidates_for(item, True, None, merge, 132))
    tma = dataclasses.replace(cur, tma=3)
    assert C.candidates_for(item, True, None, tma, 132)[0] == tma


def test_candidates_leave_out_tma_configs_gemm_would_not_run_on_tma():
    """A RoPE GEMM runs the TMA kernel only with BLOCK_N dividing the half head: other TMA configs would time the
    pointer kernel again, so they are not candidates (the incumbent's twins neither)."""
    cur = lc.GemmConfig(64, 32, 64, 1, 1, 4, 6, 0)
    rope = C.TuneItem(0, "expert", GemmShape("expert.qkv", 64, 2560, 1024, rope=True, row_scale=True))
    # π0's half head is 128, which every skinny BLOCK_N divides: the RoPE GEMM keeps its TMA candidates and twins
    assert [c.tma for c in C.candidates_for(rope, False, None, cur, 132)[:3]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--quick", "--budget-s", "120"], "device: expected a CUDA GPU"),  # was 'unrecognized arguments: --quick'
        (["--budget-s", "nan"], "argument --budget-s: expected a number of seconds > 0, found 'nan'"),
        (["--budget-s", "-5"], "argument --budget-s: expected a number of seconds > 0, found '-5'"),
        (["--budget-s", "0"], "argument --budget-s: expected a number of seconds > 0, found '0'"),
        (["--groups", "expert,mlp"], "argument --groups: expected comma-separated names from ['expert', 'vlm'"),
        (["--views", "0"], "argument --views: expected comma-separated integers in [1, 16], found '0'"),
        (["--prompts", "-1"], "argument --prompts: expected comma-separated integers in [0, 2048], found '-1'"),
        (["--chunks", "2000"], "argument --chunks: expected comma-separated integers in [1, 1024], found '2000'"),
        (["--batches", "x"], "argument --batches: expected comma-separated integers in [1, 1024], found 'x'"),
        (["--workers", "-1"], "argument --workers: expected an integer >= 0, found '-1'"),
        (["--max-candidates", "0"], "argument --max-candidates: expected an integer >= 1, found '0'"),
    ],
)
def test_vla_rt_tune_hands_its_options_to_the_tuner_which_checks_them_first(argv, words, monkeypatch, capsys):
    """The bugs: `vla-rt tune --quick ...` (the documented command) ended in 'vla-rt: error: unrecognized arguments'
    (argparse's REMAINDER takes no leading option), and a NaN / negative budget, an unknown group or views 0 reached
    the tuner unchecked (on the CPU every option got 'expected a CUDA GPU' instead of its own error)."""
    from vla_rt.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        rc = main(["tune", *argv])
    except SystemExit as e:  # argparse's usage error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert f"vla-rt tune: error: {words}" in err and "Traceback" not in err, err
