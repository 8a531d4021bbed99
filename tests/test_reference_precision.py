"""Float32 means float32 in the reference: TF32 (and oneDNN's reduced float32) is off inside every reference pass and
the process's switches are back to what they were after it, exception or not, however the process had set them
(PyTorch's defaults, the legacy `set_float32_matmul_precision`, the per-operator API). Inside, the legacy getters
answer (torch.compile's inductor reads them while it compiles a reference pass).

On the CPU the switches change no arithmetic, so these tests observe them instead: a stand-in for the patch-embedding
convolution and a hook on a Linear record the switches at the moment the reference computes. The CUDA accuracy check
(reference float32 vs folded float32 within 1e-5) is tests/test_gpu_reference_precision.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from vla_rt import preset
from vla_rt.model import Pi0Model, precision, random_weights
from vla_rt.model.precision import SCOPE, float32_precisions, float32_switches, ieee_float32

B = torch.backends
USERS = {  # ways a process may have set its float32 switches before it calls the reference
    "pytorch_defaults": lambda: None,  # cuDNN convolutions "tf32": the case that made the reference inexact
    "matmul_high": lambda: torch.set_float32_matmul_precision("high"),  # legacy API: matmuls TF32 too
    "per_operator_tf32": lambda: setattr(B, "fp32_precision", "tf32"),  # new API: everything TF32
}


def legacy_answers() -> dict[str, object]:
    """What the legacy getters say ("raises" where they refuse the current state)."""
    answers: dict[str, object] = {}
    getters = {
        "matmul_precision": torch.get_float32_matmul_precision,
        "matmul_allow_tf32": lambda: B.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": lambda: B.cudnn.allow_tf32,
    }
    for name, getter in getters.items():
        try:
            answers[name] = getter()
        except RuntimeError:
            answers[name] = "raises"
    return answers


def switches_now() -> tuple[dict[str, str], dict[str, object]]:
    return float32_precisions(), legacy_answers()


INSIDE = (SCOPE, {"matmul_precision": "highest", "matmul_allow_tf32": False, "cudnn_allow_tf32": False})


@pytest.fixture(params=list(USERS))
def user_switches(request):
    """The process's switches set one of USERS' ways for the test; everything put back to the session's after."""
    before, legacy = switches_now()
    USERS[request.param]()
    yield switches_now()
    if legacy["matmul_precision"] != "raises":
        torch.set_float32_matmul_precision(legacy["matmul_precision"])
    B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32 = legacy["matmul_allow_tf32"], legacy["cudnn_allow_tf32"]
    for name, backend in float32_switches().items():
        backend.fp32_precision = before[name]
    assert switches_now() == (before, legacy)


@pytest.fixture(scope="module")
def tiny() -> Pi0Model:
    cfg = preset("tiny")
    model = Pi0Model(cfg)
    model.load_state_dict(random_weights(cfg, seed=2))
    return model.eval()


@pytest.fixture
def observed(tiny, monkeypatch):
    """{"conv": [...], "linear": [...]}: the switches at each patch-embedding convolution and action-output Linear."""
    seen: dict[str, list] = {"conv": [], "linear": []}
    real_conv2d = F.conv2d

    def conv2d(*args, **kwargs):
        seen["conv"].append(switches_now())
        return real_conv2d(*args, **kwargs)

    monkeypatch.setattr(F, "conv2d", conv2d)  # SigLIP's patch embedding calls F.conv2d
    hook = tiny.action_out_proj.register_forward_hook(lambda *_: seen["linear"].append(switches_now()))
    yield seen
    hook.remove()


def inputs(cfg, batch=1, views=2, chunk=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(batch, views, s, s, 3, generator=g) * 2 - 1
    state = torch.randn(batch, cfg.action_dim, generator=g)
    noise = torch.randn(batch, chunk, cfg.action_dim, generator=g)
    return images, state, noise


def test_sample_actions_computes_in_ieee_float32_and_restores_the_switches(tiny, observed, user_switches):
    images, state, noise = inputs(tiny.cfg)
    assert switches_now() == user_switches
    tiny.sample_actions(images, state, noise=noise, num_steps=3)
    assert observed["conv"] == [INSIDE] and observed["linear"] == [INSIDE] * 3
    assert switches_now() == user_switches


def test_compute_loss_computes_in_ieee_float32_and_restores_the_switches(tiny, observed, user_switches):
    images, state, noise = inputs(tiny.cfg)
    tiny.compute_loss(images, state, torch.zeros_like(noise), noise=noise, time=torch.full((1,), 0.5))
    assert observed["conv"] == [INSIDE] and observed["linear"] == [INSIDE]
    assert switches_now() == user_switches


def test_prefix_and_velocity_called_alone_are_scoped_too(tiny, observed, user_switches):
    images, state, noise = inputs(tiny.cfg)
    cache, mask = tiny.prefix_kv(images)
    assert switches_now() == user_switches
    tiny.velocity(cache, mask, state, noise, torch.full((1,), 1.0))
    assert observed["conv"] == [INSIDE] and observed["linear"] == [INSIDE]
    assert switches_now() == user_switches


def test_switches_are_restored_when_the_reference_raises(tiny, monkeypatch, user_switches):
    def failing_conv2d(*args, **kwargs):
        raise RuntimeError("planted failure inside the reference")

    monkeypatch.setattr(F, "conv2d", failing_conv2d)
    images, state, noise = inputs(tiny.cfg)
    with pytest.raises(RuntimeError, match="planted failure"):
        tiny.sample_actions(images, state, noise=noise, num_steps=2)
    assert switches_now() == user_switches


def test_the_observation_sees_tf32_when_the_scope_is_missing(tiny, observed, monkeypatch, user_switches):
    """The check can fail: with the scope replaced by a no-op, the same observation records the user's TF32."""
    assert user_switches != INSIDE
    monkeypatch.setattr(precision, "ieee_float32", contextlib.nullcontext)
    images, state, noise = inputs(tiny.cfg)
    tiny.sample_actions(images, state, noise=noise, num_steps=2)
    assert observed["conv"] == [user_switches] and observed["linear"] == [user_switches] * 2


def test_nested_scopes_restore_the_outer_values(user_switches):
    with ieee_float32():
        with ieee_float32():
            assert switches_now() == INSIDE
        assert switches_now() == INSIDE
    assert switches_now() == user_switches


def test_the_scope_stays_out_of_torch_compile_and_the_body_compiles(tiny, user_switches, recwarn):
    """compile_row compiles the reference's methods: the scope runs eagerly around the compiled body (dynamo does not
    try to trace the switches, which it cannot), the body compiles as one graph, runs under IEEE float32 and gives the
    eager result."""
    graphs, runs = [], []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            runs.append(switches_now())
            return gm.forward(*args)

        return run

    images, state, noise = inputs(tiny.cfg, views=1, chunk=2)
    cache, mask = tiny.prefix_kv(images)
    time = torch.full((1,), 1.0)
    compiled = torch.compile(tiny.velocity, backend=recording_backend)
    torch.testing.assert_close(
        compiled(cache, mask, state, noise, time), tiny.velocity(cache, mask, state, noise, time)
    )
    assert len(graphs) == 1 and runs == [INSIDE]
    assert switches_now() == user_switches
    assert not [w for w in recwarn if "fp32_precision" in str(w.message)]  # dynamo never tried to trace the scope
