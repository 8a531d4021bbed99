"""`load_checkpoint`: format detection, random specs, clear errors, no pickle, and the same weights giving the same
actions whichever format they were stored in."""

import pytest
import torch

from vla_rt.checkpoints import detect_format, load_checkpoint, save_lerobot, save_native, save_openpi
from vla_rt.config import preset
from vla_rt.model.weights import CheckpointError, random_weights

TINY = preset("tiny")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The same tiny weights in all three formats."""
    pytest.importorskip("orbax.checkpoint")
    root = tmp_path_factory.mktemp("formats")
    weights = random_weights(TINY, seed=31)
    save_openpi(weights, TINY, root / "openpi")
    save_lerobot(weights, TINY, root / "lerobot")
    save_native(root / "native.safetensors", weights, TINY, source="test")
    paths = {"openpi": root / "openpi", "lerobot": root / "lerobot", "native": root / "native.safetensors"}
    return weights, paths


def test_formats_are_detected(stored):
    _, paths = stored
    for fmt, path in paths.items():
        assert detect_format(path) == fmt
    assert detect_format(paths["openpi"] / "params") == "openpi"
    assert detect_format(paths["lerobot"] / "model.safetensors") == "lerobot"
    assert detect_format("random:tiny") == "random"


def test_every_format_loads_the_same_weights_without_pickle(stored, monkeypatch):
    weights, paths = stored

    def no_pickle(*args, **kwargs):
        raise AssertionError("a checkpoint reader called torch.load (pickle)")

    monkeypatch.setattr(torch, "load", no_pickle)
    for fmt, path in paths.items():
        loaded = load_checkpoint(path)
        assert loaded.format == fmt and loaded.config == TINY
        assert (
            all(torch.equal(loaded.weights[k], weights[k]) for k in weights) and loaded.weights.keys() == weights.keys()
        )


def test_shapes_only_gives_meta_tensors_of_the_right_shapes(stored):
    weights, paths = stored
    for path in [*paths.values(), "random:tiny"]:
        loaded = load_checkpoint(path, shapes_only=True)
        assert loaded.config == TINY
        assert {k: (t.shape, t.device.type) for k, t in loaded.weights.items()} == {
            k: (t.shape, "meta") for k, t in weights.items()
        }


def test_random_specs_are_seeded_presets():
    a, b = load_checkpoint("random:tiny:3"), load_checkpoint("random:tiny:3")
    assert a.config == TINY and a.format == "random" and a.source == "random:tiny:3"
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    default = load_checkpoint("random:tiny")
    assert all(torch.equal(default.weights[k], v) for k, v in random_weights(TINY, seed=0).items())
    assert load_checkpoint("random:tiny:3", torch.bfloat16).weights["projector.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("random:huge", r"unknown preset 'huge'; known presets: \['dummy', 'pi0', 'pi05', 'tiny', 'tiny_pi05'\]"),
        ("random:tiny:x", "seed 'x' is not an integer"),
        ("random:", "expected random:<preset>"),
    ],
)
def test_bad_random_specs(spec, message):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(spec)


def test_unknown_paths_say_what_was_looked_for(tmp_path):
    for path in (tmp_path / "nope", tmp_path):
        with pytest.raises(
            CheckpointError,
            match="Looked for: a native .safetensors file .* LeRobot π0 / π0.5 dir .* openpi checkpoint .* random:<preset>",
        ):
            load_checkpoint(path)


def test_same_checkpoint_in_every_format_gives_identical_actions(stored):
    model_module = pytest.importorskip("vla_rt.model.pi0")
    _, paths = stored
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(1, 2, 224, 224, 3, generator=gen) * 2 - 1
    state = torch.randn(1, TINY.action_dim, generator=gen)
    tokens = torch.randint(0, TINY.vocab_size, (1, 5), generator=gen)
    noise = torch.randn(1, 4, TINY.action_dim, generator=gen)
    actions = {}
    for fmt, path in paths.items():
        loaded = load_checkpoint(path)
        model = model_module.Pi0Model(loaded.config)
        model.load_state_dict(loaded.weights)
        actions[fmt] = model.sample_actions(images, state, tokens, noise, num_steps=3)
    assert actions["openpi"].shape == (1, 4, TINY.action_dim) and torch.isfinite(actions["openpi"]).all()
    assert torch.equal(actions["openpi"], actions["lerobot"]) and torch.equal(actions["openpi"], actions["native"])
