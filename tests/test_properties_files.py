"""Property: any file handed to the checkpoint readers ends in a loaded, finite checkpoint or one CheckpointError
(or NormStatsError) naming it, never in another exception, a crash or a hang.

Files come from three sources: random bytes; a valid native checkpoint cut at a random length or with random bytes
overwritten (in the length prefix, the JSON header or the tensor data: a flipped data byte may make a NaN, which must
be refused); safetensors files with random JSON headers. Plus random JSON as norm_stats.json and as a LeRobot
config.json.

Budget (CI, 2 cores): 150 examples a test, derandomized, no example database; HYPOTHESIS_PROFILE=explore: 2000.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_budget import TINY_PI0, budget

from vla_rt.checkpoints import load_checkpoint, save_lerobot, save_native
from vla_rt.checkpoints.norm_stats import NormStats, load_norm_stats
from vla_rt.errors import CheckpointError, NormStatsError, VlaRtError
from vla_rt.model.weights import random_weights

BUDGET = budget(150)
SMALL = TINY_PI0
STATS = {"state": NormStats(mean=[0.0, 1.0], std=[1.0, 2.0]), "actions": NormStats(mean=[0.5], std=[3.0])}


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("native") / "small.safetensors"
    save_native(path, random_weights(SMALL, seed=0), SMALL, source="test", norm_stats=STATS)
    return path.read_bytes()


def _loads_or_names_the_file(path) -> None:
    try:
        ckpt = load_checkpoint(path)
    except VlaRtError as err:
        assert isinstance(err, CheckpointError | NormStatsError), repr(err)
        assert str(path) in str(err), str(err)
        return
    assert ckpt.config == SMALL and all(torch.isfinite(t).all() for t in ckpt.weights.values())


@BUDGET
@given(data=st.binary(max_size=4096))
def test_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("random") / "model.safetensors"
    path.write_bytes(data)
    _loads_or_names_the_file(path)


@BUDGET
@given(data=st.data())
def test_a_damaged_native_file(tmp_path_factory, native, data):
    header_end = 8 + struct.unpack("<Q", native[:8])[0]
    blob = bytearray(native)
    how = data.draw(st.sampled_from(["cut", "overwrite-prefix", "overwrite-header", "overwrite-data"]))
    if how == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        lo, hi = {
            "overwrite-prefix": (0, 8),
            "overwrite-header": (8, header_end),
            "overwrite-data": (header_end, len(blob)),
        }[how]
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(lo, hi - 1))
            blob[at] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("damaged") / "small.safetensors"
    path.write_bytes(bytes(blob))
    _loads_or_names_the_file(path)


def test_a_layer_index_that_is_not_a_number_names_the_tensor_and_the_file(tmp_path, native):
    """The example hypothesis found on a fresh CI clone: one header byte turned a layer index into ':' and the loader
    died in int() with a bare ValueError."""
    good, bad = b'"llm.layers.0.q_proj.weight"', b'"llm.layers.:.q_proj.weight"'
    assert native.count(good) == 1
    path = tmp_path / "small.safetensors"
    path.write_bytes(native.replace(good, bad))
    with pytest.raises(CheckpointError, match=r"llm\.layers\.:\.q_proj\.weight.*expected a layer index") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12,
)


@BUDGET
@given(header=st.dictionaries(st.text(max_size=8), _json, max_size=4), tail=st.binary(max_size=64))
def test_random_safetensors_headers(tmp_path_factory, header, tail):
    raw = json.dumps(header).encode()
    path = tmp_path_factory.mktemp("header") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + tail)
    _loads_or_names_the_file(path)


@BUDGET
@given(
    content=st.one_of(
        _json, st.fixed_dictionaries({"norm_stats": st.dictionaries(st.sampled_from(["state", "actions"]), _json)})
    )
)
def test_random_norm_stats_json(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("stats") / "norm_stats.json"
    path.write_text(json.dumps(content))
    try:
        stats = load_norm_stats(path)
    except VlaRtError as err:
        assert isinstance(err, CheckpointError | NormStatsError) and str(path) in str(err), repr(err)
        return
    assert all(isinstance(s, NormStats) and s.dim >= 1 for s in stats.values())


@pytest.fixture(scope="module")
def lerobot_dir(tmp_path_factory):
    return save_lerobot(random_weights(SMALL, seed=0), SMALL, tmp_path_factory.mktemp("lerobot") / "ckpt")


@BUDGET
@given(
    config=st.one_of(
        _json,
        st.dictionaries(
            st.sampled_from(["type", "chunk_size", "tokenizer_max_length", "normalization_mapping"]), _json
        ),
    )
)
def test_random_lerobot_config_json(lerobot_dir, config):
    (lerobot_dir / "config.json").write_text(json.dumps(config))
    try:
        ckpt = load_checkpoint(lerobot_dir)
    except VlaRtError as err:
        assert isinstance(err, CheckpointError | NormStatsError) and str(lerobot_dir) in str(err), repr(err)
        return
    assert ckpt.config.chunk >= 1 and ckpt.config.max_token_len >= 1
