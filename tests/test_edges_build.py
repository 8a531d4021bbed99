"""`load_pi0` / `build_pi0` arguments at their edges (issue 22): each bad argument is an ArgumentError naming it,
raised before the checkpoint is read (so `device="cuda"` without CUDA fails at once, not after 12 GB of weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vla_rt
import vla_rt.checkpoints
from vla_rt import build_pi0, load_pi0
from vla_rt.config import preset
from vla_rt.errors import ArgumentError, CheckpointError, InputError
from vla_rt.model.weights import random_weights

TINY = preset("tiny")
NO_CUDA = not torch.cuda.is_available()

BAD_ARGS = [
    ({"device": "gpu"}, "device", "'cpu', 'cuda' or 'cuda:<index>'"),
    ({"device": "mps"}, "device", "the backends run on those"),
    ({"device": 3}, "device", "a str or torch.device"),
    (
        {"dtype": "bfloat16"},
        "dtype",
        "a torch.dtype, one of ['torch.float32', 'torch.bfloat16', 'torch.float16'] (torch.bfloat16)",
    ),
    ({"dtype": torch.int32}, "dtype", "a floating-point dtype"),
    ({"dtype": torch.float64}, "dtype", "a floating-point dtype the backends run"),
    ({"dtype": None}, "dtype", "a torch.dtype"),
    ({"chunk": 0}, "chunk", "an integer in [1, 1024]"),
    ({"chunk": -3}, "chunk", "an integer in [1, 1024]"),
    ({"chunk": 2.5}, "chunk", "an integer"),
    ({"chunk": 16.0}, "chunk", "an integer"),
    ({"chunk": True}, "chunk", "an integer"),
    ({"chunk": "16"}, "chunk", "an integer"),
    ({"chunk": 10**9}, "chunk", "an integer in [1, 1024]"),
    ({"batch_size": 0}, "batch_size", "an integer in [1, 1024]"),
    ({"num_views": 0}, "num_views", "an integer in [1, 16]"),
    ({"num_views": 2.0}, "num_views", "an integer"),
    ({"prompt_len": -1}, "prompt_len", "an integer in [0, 2048]"),
    ({"backend": "nope"}, "backend", "one of ('reference', 'folded', 'triton')"),
    ({"backend": None}, "backend", "one of"),
    ({"backend": "triton", "device": "cpu"}, "num_views", "an integer for backend 'triton'"),
]
if NO_CUDA:
    BAD_ARGS += [
        ({"device": "cuda"}, "device", "'cpu' on this machine (torch sees no CUDA device)"),
        ({"device": torch.device("cuda", 1)}, "device", "torch sees no CUDA device"),
    ]


@pytest.fixture
def no_checkpoint_reads(monkeypatch):
    """Fails the test if the checkpoint is read: argument errors must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the arguments were checked")

    monkeypatch.setattr(vla_rt.checkpoints, "load_checkpoint", refuse)


@pytest.mark.parametrize(("kwargs", "field", "expected"), BAD_ARGS, ids=[f"{a}" for a, _, _ in BAD_ARGS])
def test_bad_build_arguments_fail_before_loading(no_checkpoint_reads, kwargs, field, expected):
    with pytest.raises(ArgumentError) as info:
        load_pi0("random:pi0", **kwargs)  # the full model: reading it first would take a minute and 14 GB
    err = info.value
    assert err.field == field and expected in str(err) and str(err).startswith(f"{field}: expected "), str(err)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(("kwargs", "field", "expected"), BAD_ARGS[:12], ids=[f"{a}" for a, _, _ in BAD_ARGS[:12]])
def test_build_pi0_checks_the_same_arguments(kwargs, field, expected):
    with pytest.raises(ArgumentError, match=f"^{field}: expected "):
        build_pi0({}, TINY, **kwargs)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_policy_defaults_to_the_cpu_without_cuda_and_refuses_cuda(no_checkpoint_reads):
    with pytest.raises(ArgumentError, match="torch sees no CUDA device"):
        vla_rt.Pi0Policy.from_pretrained("random:pi0", device="cuda")
    with pytest.raises(ArgumentError, match="dtype: expected a floating-point dtype"):
        vla_rt.Pi0Policy.from_pretrained("random:pi0", dtype=torch.int64)


def test_build_pi0_checks_the_weights_before_building():
    weights = random_weights(TINY, seed=0)
    missing = {k: v for k, v in weights.items() if k != "action_out_proj.bias"}
    with pytest.raises(CheckpointError, match=r"missing tensor 'action_out_proj.bias' \(expected shape \(32,\)\)"):
        build_pi0(missing, TINY)
    nan = {**weights, "projector.weight": weights["projector.weight"].clone().fill_(float("nan"))}
    with pytest.raises(CheckpointError, match="tensor 'projector.weight' holds 4096 non-finite value"):
        build_pi0(nan, TINY, backend="folded")
    with pytest.raises(ArgumentError, match="^cfg: expected a Pi0Config, found dict"):
        build_pi0(weights, TINY.to_dict())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="^weights: expected a dict of canonical tensors"):
        build_pi0(list(weights.values()), TINY)  # type: ignore[arg-type]


def test_float16_build_refuses_weights_beyond_its_range():
    weights = random_weights(TINY, seed=0)
    weights["action_in_proj.weight"] = weights["action_in_proj.weight"].clone()
    weights["action_in_proj.weight"][1, 2] = 7e4
    with pytest.raises(CheckpointError, match=r"'action_in_proj.weight' holds values in .*beyond float16's range"):
        build_pi0(weights, TINY, dtype=torch.float16)
    assert build_pi0(weights, TINY, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("spec", ["random:tiny:-1", "random:tiny:1.5", "random:tiny:99999999999999999999"])
def test_random_spec_seed_out_of_range(spec):
    with pytest.raises(CheckpointError, match="seed"):
        load_pi0(spec)


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (lambda x: x.update(num_steps=0), "num_steps", "an integer number of denoising steps in [1, 1000]"),
        (lambda x: x.update(num_steps=2.5), "num_steps", "an integer"),
        (lambda x: x.update(num_steps=True), "num_steps", "an integer"),
        (lambda x: x.update(tokens=[[1, 2]]), "tokens", "a torch.Tensor or None"),
        (lambda x: x.update(noise=np.zeros((1, 4, 32))), "noise", "a torch.Tensor or None"),
        (lambda x: x.update(noise=torch.zeros(1, 4, 32, dtype=torch.int64)), "noise", "a floating-point dtype"),
        (lambda x: x.update(images=np.zeros((1, 1, 224, 224, 3))), "images", "a torch.Tensor"),
        (lambda x: x.update(state=[0.0] * 32), "state", "shape (1, 32)"),
    ],
    ids=[
        "steps-0",
        "steps-float",
        "steps-bool",
        "tokens-list",
        "noise-numpy",
        "noise-int",
        "images-numpy",
        "state-list",
    ],
)
def test_bad_model_inputs_are_input_errors(change, field, expected):
    model = load_pi0("random:tiny:1", chunk=4)
    x = {"images": torch.zeros(1, 1, 224, 224, 3), "state": torch.zeros(1, 32), "tokens": None, "noise": None}
    x["num_steps"] = 2
    change(x)
    with pytest.raises(InputError) as info:
        model.sample_actions(x["images"], x["state"], x["tokens"], x["noise"], x["num_steps"])
    assert info.value.field == field and expected in str(info.value), str(info.value)
