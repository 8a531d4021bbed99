"""The native format: safetensors + a JSON header; exact round trip, dims re-checked against shapes, bad files refused."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vla_rt.checkpoints.native import FORMAT_VERSION, HEADER_KEY, load_native, read_header, save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import preset
from vla_rt.model.weights import CheckpointError, random_weights

TINY = preset("tiny").replace(chunk=10, max_token_len=16)
STATS = {"state": NormStats(mean=[0.5], std=[2.0], q01=[-1.0], q99=[1.0]), "actions": NormStats(mean=[1.0], std=[3.0])}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    weights = random_weights(TINY, seed=21)
    path = save_native(
        tmp_path_factory.mktemp("native") / "pi0.safetensors",
        weights,
        TINY,
        source="/ckpt/pi0_base",
        norm_stats=STATS,
        use_quantile_norm=True,
    )
    return weights, path


def test_round_trip_is_exact_with_header(native):
    weights, path = native
    loaded = load_native(path)
    assert loaded.config == TINY and loaded.format == "native"
    assert _equal(loaded.weights, weights)
    assert (loaded.origin, loaded.norm_stats, loaded.use_quantile_norm) == ("/ckpt/pi0_base", STATS, True)
    header = read_header(path)
    assert header["format_version"] == FORMAT_VERSION and header["config"] == TINY.to_dict()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_file_has_the_mode_open_would_give(native, tmp_path, umask):
    """The bug: `vla-rt convert` wrote 0o600 (safetensors' own temp-file mode), whatever the umask, so another user
    of the machine (a robot's service account) could not read the converted checkpoint."""
    import os
    import stat

    weights, _ = native
    before = os.umask(umask)
    try:
        path = save_native(tmp_path / "out.safetensors", weights, TINY, source="t")
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_dtype_on_save_and_load(native, tmp_path):
    weights, _ = native
    path = save_native(tmp_path / "bf16.safetensors", weights, TINY, source="x", dtype=torch.bfloat16)
    bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    assert _equal(load_native(path, dtype=None).weights, bf16)
    assert _equal(load_native(path).weights, {k: v.float() for k, v in bf16.items()})


def _resave(src, dst, edit, header_edit=None):
    tensors = load_file(src)
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
    edit(tensors)
    if header_edit:
        header = json.loads(metadata[HEADER_KEY])
        header_edit(header)
        metadata[HEADER_KEY] = json.dumps(header)
    save_file(tensors, dst, metadata=metadata)
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("expert.layers.1.ffn_norm.scale"),
            r"missing tensor 'expert\.layers\.1\.ffn_norm\.scale' \(expected shape \(32,\)\)",
        ),
        (
            lambda t: t.update({"lm_head.weight": torch.zeros(2, 2)}),
            r"unexpected tensor 'lm_head\.weight' with shape \(2, 2\)",
        ),
        (
            lambda t: t.update({"state_proj.bias": torch.zeros(31)}),
            r"tensor 'state_proj\.bias' has shape \(31,\), expected \(32,\)",
        ),
    ],
    ids=["missing", "extra", "misshaped"],
)
def test_bad_tensors_are_refused_naming_tensor_and_shapes(native, tmp_path, edit, message):
    _, path = native
    with pytest.raises(CheckpointError, match=message):
        load_native(_resave(path, tmp_path / "bad.safetensors", edit))


def test_header_must_agree_with_shapes(native, tmp_path):
    _, path = native

    def wrong_depth(h):
        h["config"]["llm"]["mlp_dim"] = 256

    with pytest.raises(CheckpointError, match="disagrees with the tensor shapes"):
        load_native(_resave(path, tmp_path / "a.safetensors", lambda t: None, wrong_depth))

    def future(h):
        h["format_version"] = FORMAT_VERSION + 1

    with pytest.raises(CheckpointError, match="native format version 2; this vla-rt reads up to 1"):
        load_native(_resave(path, tmp_path / "b.safetensors", lambda t: None, future))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("chunk", 0, r"an integer in \[1, 1024\]"),  # loaded, and sampled (1, 0, 32) actions
        ("chunk", 3.0, r"an integer in \[1, 1024\]"),  # TypeError inside torch.randn
        ("max_token_len", 0, r"an integer in \[1, 2048\]"),
        ("rms_eps", -1.0, "a finite number > 0"),  # NaN actions
        ("layernorm_eps", float("nan"), "a finite number > 0"),
        ("rms_eps", "1e-6", "a finite number > 0"),  # TypeError in the first RMSNorm
    ],
)
def test_header_settings_no_shape_confirms_are_checked(native, tmp_path, field, value, expected):
    _, path = native

    def edit(h):
        h["config"][field] = value

    bad = _resave(path, tmp_path / "bad.safetensors", lambda t: None, edit)
    with pytest.raises(
        CheckpointError, match=rf"bad\.safetensors: the header's config\.{field} is .*, expected {expected}"
    ):
        load_native(bad)
    with pytest.raises(CheckpointError, match=rf"config\.{field} is"):  # nor is such a file written
        save_native(tmp_path / "out.safetensors", native[0], TINY.replace(**{field: value}), source="x")
    assert not (tmp_path / "out.safetensors").exists()


def test_file_without_header_is_refused(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "plain.safetensors")
    assert read_header(tmp_path / "plain.safetensors") is None
    with pytest.raises(CheckpointError, match="without a vla-rt header"):
        load_native(tmp_path / "plain.safetensors")
