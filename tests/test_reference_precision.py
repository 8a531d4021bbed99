"""Float32 means float32 in the reference: TF32 (and oneDNN's reduced float32) is off inside every reference pass and
the process's switches are back to what they were after it, exception or not.

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
from vla_rt.model.precision import float32_precisions, float32_switches, ieee_float32

IEEE = dict.fromkeys(float32_switches(), "ieee")
# What a user may have set before calling the reference (set_float32_matmul_precision("high") sets the first three).
USER = {"cuda.matmul": "tf32", "cudnn.conv": "tf32", "mkldnn.matmul": "tf32", "mkldnn.conv": "none"}


@pytest.fixture
def user_switches():
    """The process's switches set to USER for the test, and put back to their values before it afterwards."""
    before = float32_precisions()
    for name, backend in float32_switches().items():
        backend.fp32_precision = USER[name]
    yield
    for name, backend in float32_switches().items():
        backend.fp32_precision = before[name]


@pytest.fixture(scope="module")
def tiny() -> Pi0Model:
    cfg = preset("tiny")
    model = Pi0Model(cfg)
    model.load_state_dict(random_weights(cfg, seed=2))
    return model.eval()


@pytest.fixture
def observed(tiny, monkeypatch):
    """{"conv": [...], "linear": [...]}: the switches at each patch-embedding convolution and action-output Linear."""
    seen: dict[str, list[dict[str, str]]] = {"conv": [], "linear": []}
    real_conv2d = F.conv2d

    def conv2d(*args, **kwargs):
        seen["conv"].append(float32_precisions())
        return real_conv2d(*args, **kwargs)

    monkeypatch.setattr(F, "conv2d", conv2d)  # SigLIP's patch embedding calls F.conv2d
    hook = tiny.action_out_proj.register_forward_hook(lambda *_: seen["linear"].append(float32_precisions()))
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
    assert float32_precisions() == USER
    tiny.sample_actions(images, state, noise=noise, num_steps=3)
    assert observed["conv"] == [IEEE] and observed["linear"] == [IEEE] * 3
    assert float32_precisions() == USER


def test_compute_loss_computes_in_ieee_float32_and_restores_the_switches(tiny, observed, user_switches):
    images, state, noise = inputs(tiny.cfg)
    tiny.compute_loss(images, state, torch.zeros_like(noise), noise=noise, time=torch.full((1,), 0.5))
    assert observed["conv"] == [IEEE] and observed["linear"] == [IEEE]
    assert float32_precisions() == USER


def test_prefix_and_velocity_called_alone_are_scoped_too(tiny, observed, user_switches):
    images, state, noise = inputs(tiny.cfg)
    cache, mask = tiny.prefix_kv(images)
    assert float32_precisions() == USER
    tiny.velocity(cache, mask, state, noise, torch.full((1,), 1.0))
    assert observed["conv"] == [IEEE] and observed["linear"] == [IEEE]
    assert float32_precisions() == USER


def test_switches_are_restored_when_the_reference_raises(tiny, monkeypatch, user_switches):
    def failing_conv2d(*args, **kwargs):
        raise RuntimeError("planted failure inside the reference")

    monkeypatch.setattr(F, "conv2d", failing_conv2d)
    images, state, noise = inputs(tiny.cfg)
    with pytest.raises(RuntimeError, match="planted failure"):
        tiny.sample_actions(images, state, noise=noise, num_steps=2)
    assert float32_precisions() == USER


def test_the_observation_sees_tf32_when_the_scope_is_missing(tiny, observed, monkeypatch, user_switches):
    """The check can fail: with the scope replaced by a no-op, the same observation records the user's TF32."""
    monkeypatch.setattr(precision, "ieee_float32", contextlib.nullcontext)
    images, state, noise = inputs(tiny.cfg)
    tiny.sample_actions(images, state, noise=noise, num_steps=2)
    assert observed["conv"] == [USER] and observed["linear"] == [USER] * 2


def test_nested_scopes_restore_the_outer_values(user_switches):
    with ieee_float32():
        with ieee_float32():
            assert float32_precisions() == IEEE
        assert float32_precisions() == IEEE
    assert float32_precisions() == USER


def test_the_scope_stays_out_of_torch_compile_and_the_body_compiles(tiny, user_switches, recwarn):
    """compile_row compiles the reference's methods: the scope runs eagerly around the compiled body (dynamo does not
    try to trace the switches, which it cannot), the body compiles as one graph, runs under IEEE float32 and gives the
    eager result."""
    graphs, runs = [], []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            runs.append(float32_precisions())
            return gm.forward(*args)

        return run

    images, state, noise = inputs(tiny.cfg, views=1, chunk=2)
    cache, mask = tiny.prefix_kv(images)
    time = torch.full((1,), 1.0)
    compiled = torch.compile(tiny.velocity, backend=recording_backend)
    torch.testing.assert_close(
        compiled(cache, mask, state, noise, time), tiny.velocity(cache, mask, state, noise, time)
    )
    assert len(graphs) == 1 and runs == [IEEE]
    assert float32_precisions() == USER
    assert not [w for w in recwarn if "fp32_precision" in str(w.message)]  # dynamo never tried to trace the scope
