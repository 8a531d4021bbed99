"""Property: any build argument ends in a built model or one ArgumentError naming it (raised before the weights are
touched); any `vla-rt bench` command line ends in a usage error, one error line, or a run, never a traceback.

Budget (CI, 2 cores): 150 examples a test, derandomized, no example database; HYPOTHESIS_PROFILE=explore: 2000.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_budget import TINY_PI0, budget

from vla_rt import Pi0Policy, build_pi0
from vla_rt.cli import main
from vla_rt.errors import ArgumentError, VlaRtError
from vla_rt.model.weights import random_weights

BUDGET = budget(150)
SMALL = TINY_PI0
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 3000), st.floats(allow_nan=True), st.text(max_size=6),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.float64, "cpu", "cuda", "cuda:3", "meta"]),
)  # fmt: skip


@pytest.fixture(scope="module")
def weights():
    weights = random_weights(SMALL, seed=0)
    build_pi0(weights, SMALL)  # the first reference build pays torch's one-time meta-init imports (seconds)
    return weights


@BUDGET
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "backend": st.one_of(st.sampled_from(["reference", "folded", "triton", "nope"]), ODD),
            "device": st.one_of(st.sampled_from(["cpu", "cuda", "gpu", "cpu:0"]), ODD),
            "dtype": ODD,
            "num_views": ODD,
            "chunk": ODD,
            "prompt_len": ODD,
            "batch_size": ODD,
        },
    )
)
def test_any_build_arguments(weights, kwargs):
    try:
        model = build_pi0(weights, SMALL, **kwargs)
    except VlaRtError as err:
        assert isinstance(err, ArgumentError) and err.field in kwargs | {"num_views": 0, "device": 0}, repr(err)
        assert str(err).startswith(f"{err.field}: expected "), str(err)
        return
    assert model.backend in ("reference", "folded", "triton")


@BUDGET
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "action_dim": ODD,
            "num_steps": ODD,
            "seed": ODD,
            "norm_mode": ODD,
            "camera_names": st.one_of(ODD, st.lists(st.text(max_size=3), max_size=3)),
        },
    )
)
def test_any_policy_arguments(weights, kwargs):
    model = build_pi0(weights, SMALL, backend="folded", num_views=2)
    try:
        Pi0Policy(model, **kwargs)
    except VlaRtError as err:
        assert isinstance(err, ArgumentError) and err.field in kwargs, repr(err)


_option = st.one_of(
    st.tuples(st.just("--iters"), st.one_of(st.integers(-3, 3).map(str), st.text(max_size=3))),
    st.tuples(st.just("--warmup"), st.one_of(st.integers(-3, 3).map(str), st.text(max_size=3))),
    st.tuples(st.just("--compile-budget"), st.one_of(st.floats(allow_nan=True).map(str), st.text(max_size=3))),
    st.tuples(st.just("--cases"), st.one_of(st.text(alphabet="0123456789,;-", max_size=12), st.text(max_size=5))),
    st.tuples(st.just("--backends"), st.text(alphabet="abcdefghijklmnopqrstuvwxyz,-", max_size=20)),
    st.tuples(st.just("--preset"), st.one_of(st.sampled_from(["tiny", "pi0", "nope"]), st.text(max_size=4))),
)


@BUDGET
@given(options=st.lists(_option, max_size=4))
def test_any_bench_command_line(monkeypatch, capsys, options):
    import vla_rt.bench.latency as latency

    monkeypatch.setattr(latency, "run_benchmark", lambda cfg, device: {"rows": []})
    argv = ["bench", "--no-write"] + [x for pair in options for x in pair]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage error
        assert stop.code == 2
        err = capsys.readouterr().err
        assert "usage: vla-rt" in err and "Traceback" not in err
        return
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err and "internal error" not in err, err
