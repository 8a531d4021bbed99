"""The public API: load_pi0 on every backend, built shapes, and clear errors for bad model inputs."""

from __future__ import annotations

import pytest
import torch

import vla_rt
from vla_rt import load_pi0


@pytest.fixture(scope="module")
def built():
    """A reference model built for 2 views, chunk 8, prompt 4."""
    return load_pi0("random:tiny:1", num_views=2, chunk=8, prompt_len=4)


def _inputs(b=1, v=2, p=4, h=8, a=32):
    g = torch.Generator().manual_seed(5)
    return (
        torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        torch.randn(b, a, generator=g),
        torch.randint(0, 1024, (b, p), generator=g),
        torch.randn(b, h, a, generator=g),
    )


def test_public_api_is_small() -> None:
    assert set(vla_rt.__all__) == {"Pi0Config", "Pi0Inference", "Pi0Policy", "build_pi0", "load_pi0", "preset"}


def test_backends_agree_on_random_weights() -> None:
    images, state, tokens, noise = _inputs()
    ref = load_pi0("random:tiny:2").sample_actions(images, state, tokens, noise)
    folded = load_pi0("random:tiny:2", backend="folded").sample_actions(images, state, tokens, noise)
    assert ref.shape == (1, 8, 32) and ref.dtype == torch.float32
    assert float((folded - ref).norm() / ref.norm()) <= 1e-5


def test_same_seed_same_weights_other_seed_other_actions() -> None:
    images, state, tokens, noise = _inputs()
    a = load_pi0("random:tiny:4").sample_actions(images, state, tokens, noise)
    b = load_pi0("random:tiny:4").sample_actions(images, state, tokens, noise)
    c = load_pi0("random:tiny:5").sample_actions(images, state, tokens, noise)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_noise_is_drawn_with_the_built_chunk(built) -> None:
    images, state, tokens, _ = _inputs()
    gen = torch.Generator().manual_seed(0)
    out = built.sample_actions(images, state, tokens, generator=gen)
    assert out.shape == (1, 8, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("change", "field", "expected"),
    [
        (lambda x: x.update(images=x["images"][..., :2]), "images", "shape (B, V, 224, 224, 3)"),
        (lambda x: x.update(images=(x["images"] * 127).to(torch.uint8)), "images", "floating-point"),
        (lambda x: x.update(images=x["images"] * 3), "images", "values in [-1, 1]"),
        (lambda x: x.update(images=x["images"][:, :1]), "images", "2 views"),
        (
            lambda x: x.__setitem__(
                "state", x["state"].index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(float("nan")))
            ),
            "state",
            "finite values",
        ),
        (lambda x: x.update(state=x["state"].clone().fill_(float("inf"))), "state", "finite values"),
        (lambda x: x.update(state=x["state"][:, :7]), "state", "shape (1, 32)"),
        (lambda x: x.update(noise=x["noise"][:, :5]), "noise", "chunk length 8"),
        (lambda x: x.update(tokens=torch.randint(0, 1024, (1, 6))), "tokens", "at most 4 tokens"),
        (lambda x: x.update(tokens=x["tokens"].float()), "tokens", "integer dtype"),
        (lambda x: x.update(tokens=x["tokens"] + 5000), "tokens", "ids in [0, 1024)"),
    ],
    ids=[
        "shape",
        "dtype",
        "range",
        "views",
        "nan-state",
        "inf-state",
        "state-dim",
        "chunk",
        "prompt-long",
        "token-dtype",
        "token-range",
    ],
)
def test_bad_inputs_raise_clear_errors(built, change, field, expected) -> None:
    images, state, tokens, noise = _inputs()
    x = dict(images=images, state=state, tokens=tokens, noise=noise)
    change(x)
    with pytest.raises(ValueError) as info:
        built.sample_actions(x["images"], x["state"], x["tokens"], x["noise"])
    msg = str(info.value)
    assert msg.startswith(f"{field}:") and expected in msg and "found" in msg, msg


def test_unknown_backend_and_triton_without_cuda(monkeypatch) -> None:
    with pytest.raises(ValueError, match="backend: expected one of"):
        load_pi0("random:tiny", backend="tensorrt")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel tests turn the interpreter on process-wide
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="expected a CUDA device"):
            load_pi0("random:tiny", backend="triton", num_views=1)


def test_more_views_than_openpi_slots_work() -> None:
    model = load_pi0("random:tiny:1")
    images, state, tokens, noise = _inputs(v=4)
    assert model.sample_actions(images, state, tokens, noise).shape == (1, 8, 32)
