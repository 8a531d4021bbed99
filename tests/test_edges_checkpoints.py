"""Checkpoint files at their edges (issue 22): every broken file is one CheckpointError naming it, through the
Python API and the CLI alike, and weights with NaN / inf never load."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile

import pytest
import torch
from safetensors.torch import save_file

import vla_rt
from vla_rt.checkpoints import load_checkpoint, save_lerobot, save_native
from vla_rt.checkpoints.files import check_finite, check_safetensors
from vla_rt.cli import main
from vla_rt.config import preset
from vla_rt.errors import CheckpointError
from vla_rt.model.weights import random_weights

TINY = preset("tiny")


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=3)


@pytest.fixture(scope="module")
def native_bytes(tmp_path_factory, weights) -> bytes:
    path = save_native(tmp_path_factory.mktemp("good") / "good.safetensors", weights, TINY, source="test")
    return path.read_bytes()


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _zip_bytes(tmp_path) -> bytes:
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    return (tmp_path / "a.zip").read_bytes()


# name -> (bytes of the file from the good native file, words the message must hold)
BROKEN = {
    "zero-byte": (lambda good, tmp: b"", "empty file (0 bytes)"),
    "three-bytes": (lambda good, tmp: b"abc", "3 bytes: too short for a safetensors file (a text file"),
    "truncated-header": (lambda good, tmp: good[: 8 + _header_len(good) // 2], "truncated: its header says"),
    "truncated-data": (lambda good, tmp: good[: len(good) // 2], "truncated: the header describes"),
    "bad-header-json": (lambda good, tmp: struct.pack("<Q", 9) + b"{not json", "header is not valid UTF-8 JSON"),
    "header-a-list": (lambda good, tmp: struct.pack("<Q", 6) + b"[1, 2]", "not a safetensors file"),
    "header-bad-entry": (lambda good, tmp: _entry_file({"w": {"dtype": "F32"}}, 0), "lacks dtype/shape/data_offsets"),
    "header-bad-offsets": (
        lambda good, tmp: _entry_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, 16),
        "do not hold [4] x F32",
    ),
    "header-unknown-dtype": (
        lambda good, tmp: _entry_file({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, 4),
        "unknown dtype 'Q9'",
    ),
    "offsets-overlap": (
        lambda good, tmp: _entry_file({"a": _f32(0, 16), "b": _f32(8, 24)}, 24),
        "tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [8, 24]) overlap: expected 'b' to start at byte "
        "16, found 8",
    ),
    "offsets-gap": (
        lambda good, tmp: _entry_file({"a": _f32(0, 16), "b": _f32(20, 36)}, 36),
        "tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [20, 36]) leave a gap of 4 bytes no tensor holds",
    ),
    "offsets-not-from-zero": (
        lambda good, tmp: _entry_file({"a": _f32(4, 20)}, 20),
        "tensor 'a' (data_offsets [4, 20]) is the first in the data: expected it to start at byte 0, found 4",
    ),
    "offsets-short-of-the-end": (
        lambda good, tmp: _entry_file({"a": _f32(0, 16)}, 20),
        "the tensors' data_offsets end at byte 16, expected 20 (the end of the file's data): 4 trailing bytes",
    ),
    "pickle": (lambda good, tmp: pickle.dumps({"weights": [1.0, 2.0]}), "a Python pickle"),
    "torch-save-zip": (lambda good, tmp: _zip_bytes(tmp), "a zip archive"),
    "text": (lambda good, tmp: b"these are not weights\n" * 20, "a text file (it starts 'these are not"),
    "git-lfs-pointer": (
        lambda good, tmp: b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n",
        "Git LFS pointer",
    ),
    "numpy": (lambda good, tmp: b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}" + b" " * 100, "NumPy .npy"),
    "binary-noise": (lambda good, tmp: bytes(range(200, 256)) * 10, "unrecognised binary data"),
}


def _f32(begin: int, end: int) -> dict:
    """A header entry for (end - begin) / 4 float32 values at `data_offsets` [begin, end]."""
    return {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}


def _entry_file(header: dict, data_len: int) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data_len


def _write(tmp_path, case: str, native_bytes: bytes):
    make, words = BROKEN[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(make(native_bytes, tmp_path))
    return path, words


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_safetensors_file_is_one_error_naming_it(tmp_path, native_bytes, case):
    path, words = _write(tmp_path, case, native_bytes)
    for call in (lambda: load_checkpoint(path), lambda: vla_rt.load_pi0(str(path)), lambda: check_safetensors(path)):
        with pytest.raises(CheckpointError) as info:
            call()
        assert info.value.path == str(path), info.value
        assert str(info.value).startswith(f"{path}: ") and words in str(info.value), str(info.value)


@pytest.mark.parametrize("case", ["zero-byte", "truncated-data", "pickle", "text", "bad-header-json"])
@pytest.mark.parametrize("command", ["info", "convert"])
def test_cli_prints_the_message_alone_and_exits_2(tmp_path, native_bytes, capsys, case, command):
    path, words = _write(tmp_path, case, native_bytes)
    argv = [command, str(path)] + ([str(tmp_path / "out.safetensors")] if command == "convert" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vla-rt {command}: error: {path}: ") and words in err and "Traceback" not in err, err
    assert not (tmp_path / "out.safetensors").exists()


def test_broken_model_file_inside_a_lerobot_dir_names_that_file(tmp_path, weights, native_bytes):
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot")
    (folder / "model.safetensors").write_bytes(native_bytes[:100])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert info.value.path == str(folder / "model.safetensors") and "truncated" in str(info.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [("{not json", "not valid UTF-8 JSON"), ("[1, 2]", "expected a JSON object"), (b"\xff\xfe", "UTF-8")],
    ids=["text", "list", "binary"],
)
def test_broken_lerobot_config_json_names_it(tmp_path, weights, content, words):
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot")
    config = folder / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert info.value.path == str(config) and words in str(info.value), info.value


@pytest.mark.parametrize(
    ("key", "value"),
    [("chunk_size", 0), ("chunk_size", -5), ("tokenizer_max_length", "48"), ("chunk_size", 500_000),
     ("tokenizer_max_length", 10**9)],
)  # fmt: skip
def test_lerobot_config_settings_out_of_range(tmp_path, weights, key, value):
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError, match=f"config.json {key} is {value!r}, expected a positive integer"):
        load_checkpoint(folder)


def test_broken_lerobot_norm_stats_files_name_them(tmp_path, weights):
    from vla_rt.checkpoints.norm_stats import NormStats

    stats = {"state": NormStats(mean=[0.0], std=[1.0]), "actions": NormStats(mean=[0.0], std=[1.0])}
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot", norm_stats=stats)
    state_file = folder / "policy_preprocessor_step_0_normalizer_processor.safetensors"
    state_file.write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert info.value.path == str(state_file) and "empty file" in str(info.value)
    (folder / "policy_preprocessor.json").write_text('{"steps": 3}')
    with pytest.raises(CheckpointError, match="'steps' is a list of objects") as info:
        load_checkpoint(folder)
    assert info.value.path == str(folder / "policy_preprocessor.json")


@pytest.mark.parametrize(
    ("state_file", "words"),
    [(None, "found 'policy_preprocessor_step_0_normalizer_processor.safetensors', which does not exist"),
     (5, "found 5"), ("..", "found '..', which is not a file")],
    ids=["missing", "not-a-string", "a-directory"],
)  # fmt: skip
def test_a_processor_state_file_that_is_not_there_is_named(tmp_path, weights, state_file, words):
    """The bugs: a missing state file (an incomplete download) loaded with no norm stats at all, so the policy ran
    unnormalised without a word; a non-string one ended in an internal TypeError."""
    from vla_rt.checkpoints.norm_stats import NormStats

    stats = {"state": NormStats(mean=[0.0], std=[1.0]), "actions": NormStats(mean=[0.0], std=[1.0])}
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot", norm_stats=stats)
    pipeline = folder / "policy_preprocessor.json"
    if state_file is None:
        (folder / "policy_preprocessor_step_0_normalizer_processor.safetensors").unlink()
    else:
        data = json.loads(pipeline.read_text())
        data["steps"][0]["state_file"] = state_file
        pipeline.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, shapes_only=True)
    assert info.value.path == str(pipeline) and "steps[0].state_file: expected the name of a safetensors" in str(
        info.value
    )
    assert words in str(info.value), info.value


@pytest.mark.parametrize("pipeline", ["policy_preprocessor.json", "policy_postprocessor.json", "both"])
def test_a_missing_processor_json_beside_its_state_file_is_named(tmp_path, weights, pipeline):
    """The bug: without the JSONs the dir loaded with no norm stats at all, though their state files were there, so
    the policy took raw state and gave actions in normalised units without a word."""
    from vla_rt.checkpoints.norm_stats import NormStats

    stats = {"state": NormStats(mean=[0.0], std=[2.0]), "actions": NormStats(mean=[1.0], std=[3.0])}
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot", norm_stats=stats)
    gone = ["policy_preprocessor.json", "policy_postprocessor.json"] if pipeline == "both" else [pipeline]
    for name in gone:
        (folder / name).unlink()
    with pytest.raises(CheckpointError) as info:
        vla_rt.Pi0Policy.from_pretrained(str(folder))
    assert info.value.path == str(folder / gone[-1]), info.value
    prefix = gone[-1].removesuffix(".json")
    assert f"missing, but ['{prefix}_step_0_" in str(info.value) and "hold norm stats" in str(info.value)


@pytest.mark.parametrize("missing", ["model.safetensors", "config.json"])
def test_a_lerobot_dir_missing_one_of_its_two_files_names_it(tmp_path, weights, missing):
    """The bug: 'not a checkpoint vla-rt can read (is a directory). Looked for: ...' and five formats to guess from."""
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot")
    (folder / missing).unlink()
    with pytest.raises(CheckpointError) as info:
        vla_rt.Pi0Policy.from_pretrained(str(folder))
    assert info.value.path == str(folder) and f"a LeRobot π0 / π0.5 dir without its {missing}" in str(info.value)


def test_native_file_without_header_is_not_taken_for_lerobot(tmp_path, weights):
    path = tmp_path / "headerless.safetensors"
    save_file(weights, str(path))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    msg = str(info.value)
    assert info.value.path == str(path) and "canonical names" in msg and "no vla-rt header" in msg
    assert "model.paligemma" not in msg  # not a list of LeRobot tensor names


def test_unrelated_safetensors_file_says_what_it_holds(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2), "decoder.bias": torch.zeros(2)}, str(path))
    with pytest.raises(
        CheckpointError, match=r"neither vla-rt native .* holds 2 tensors \['decoder.bias', 'encoder.weight'\]"
    ):
        load_checkpoint(path)
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    with pytest.raises(CheckpointError, match="holds 0 tensors"):
        load_checkpoint(empty)


def test_path_that_is_not_a_path(tmp_path):
    with pytest.raises(CheckpointError, match="expected a path"):
        load_checkpoint(42)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", ["native", "lerobot"])
def test_non_finite_weights_never_load(tmp_path, weights, fmt, bad):
    """The bug: NaN weights loaded silently; reference then returned NaN actions and folded finite wrong ones."""
    broken = dict(weights)
    name = "expert.layers.1.down_proj.weight"
    broken[name] = weights[name].clone()
    broken[name][3, 5] = bad
    if fmt == "native":
        path = save_native(tmp_path / "nan.safetensors", broken, TINY, source="test")
        shown = name
    else:
        path = save_lerobot(broken, TINY, tmp_path / "lerobot")
        shown = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    for backend in ("reference", "folded"):
        with pytest.raises(CheckpointError) as info:
            vla_rt.load_pi0(str(path), backend=backend)
        msg = str(info.value)
        assert shown in msg and "1 non-finite value" in msg and "(3, 5)" in msg and str(bad) in msg, msg
    assert load_checkpoint(path, shapes_only=True).config == TINY  # `vla-rt info` still describes it


def test_non_finite_openpi_weights_name_the_openpi_array(tmp_path, weights):
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_openpi

    broken = dict(weights)
    broken["action_out_proj.bias"] = weights["action_out_proj.bias"].clone()
    broken["action_out_proj.bias"][2] = float("nan")
    save_openpi(broken, TINY, tmp_path / "openpi")
    with pytest.raises(CheckpointError, match=r"'action_out_proj/bias \(action_out_proj.bias\)' holds 1 non-finite"):
        load_checkpoint(tmp_path / "openpi")


def test_damaged_orbax_dir_is_a_checkpoint_error(tmp_path, weights):
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_openpi

    params = save_openpi(weights, TINY, tmp_path / "openpi")
    for f in params.rglob("*"):
        if f.is_file() and f.name != "_METADATA":
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "openpi")
    assert info.value.path == str(params), info.value


@pytest.mark.parametrize(
    ("remove", "words"),
    [("_METADATA", "expected the orbax tree metadata file _METADATA, found none"),
     ("manifest.ocdbt", "_METADATA says the arrays are in an OCDBT database, but there is no manifest.ocdbt")],
)  # fmt: skip
def test_an_orbax_dir_missing_a_file_names_that_file(tmp_path, weights, remove, words):
    """The bug: orbax returns no tree (only a log warning) for these, and the error said 'the orbax tree is a
    NoneType, expected a dict of arrays', naming nothing the user could check."""
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_openpi

    params = save_openpi(weights, TINY, tmp_path / "openpi")
    (params / remove).unlink()
    for shapes_only in (True, False):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(tmp_path / "openpi", shapes_only=shapes_only)
        assert info.value.path == str(params) and words in str(info.value), info.value


def test_cast_overflow_is_named_as_such(tmp_path, weights):
    big = dict(weights)
    big["action_in_proj.weight"] = weights["action_in_proj.weight"].clone()
    big["action_in_proj.weight"][0, 1] = 1e6  # finite in float32, inf in float16
    path = save_native(tmp_path / "big.safetensors", big, TINY, source="test")
    assert load_checkpoint(path).weights["action_in_proj.weight"][0, 1] == 1e6
    with pytest.raises(CheckpointError, match=r"stored torch.float32 value 1e\+06 overflows torch.float16"):
        load_checkpoint(path, dtype=torch.float16)


def test_check_finite_takes_huge_finite_values_and_finds_the_bad_one():
    huge = torch.full((64,), 3e38)  # the float32 sum overflows; every value is finite
    check_finite(huge, "huge", "x")
    huge[17] = float("nan")
    with pytest.raises(CheckpointError, match=r"'huge' holds 1 non-finite value\(s\) \(first: nan at index \(17,\)\)"):
        check_finite(huge, "huge", "x")
    check_finite(torch.empty(3, device="meta"), "meta", "x")  # shapes only: nothing to check


def test_an_interrupted_save_leaves_no_truncated_file(tmp_path, weights, monkeypatch):
    import vla_rt.checkpoints.native as native

    path = save_native(tmp_path / "m.safetensors", weights, TINY, source="old")

    def dies_halfway(tensors, filename, metadata=None):
        open(filename, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(native, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_native(path, weights, TINY, source="new")
    assert load_checkpoint(path).origin == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_broken_norm_stats_file_fails_before_any_weight_is_read(tmp_path, weights, monkeypatch):
    """The bug: a bad norm-stats file (openpi's assets/<id>/norm_stats.json, LeRobot's processor state file) was only
    reported after every weight had been read: minutes on a full π0, for a file of a few KB."""
    from vla_rt.checkpoints import lerobot, openpi
    from vla_rt.checkpoints.norm_stats import NormStats

    def no_weights(*_args, **_kw):
        raise AssertionError("weights read before the norm stats were checked")

    stats = {"state": NormStats(mean=[0.0], std=[1.0]), "actions": NormStats(mean=[0.0], std=[1.0])}
    folder = save_lerobot(weights, TINY, tmp_path / "lerobot", norm_stats=stats)
    state_file = folder / "policy_preprocessor_step_0_normalizer_processor.safetensors"
    state_file.write_bytes(b"")
    monkeypatch.setattr(lerobot, "read_safetensors", no_weights)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert info.value.path == str(state_file) and "empty file" in str(info.value)

    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_openpi

    save_openpi(weights, TINY, tmp_path / "openpi", norm_stats=stats, asset_id="droid")
    stats_file = tmp_path / "openpi" / "assets" / "droid" / "norm_stats.json"
    stats_file.write_text("{not json")
    monkeypatch.setattr(openpi, "_restore_groups", no_weights)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "openpi")
    assert str(stats_file) in (info.value.path or "") + str(info.value), info.value
