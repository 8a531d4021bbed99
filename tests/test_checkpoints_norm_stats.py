"""Norm stats: openpi's norm_stats.json round trip and both normalisation modes against hand-computed values."""

import json

import numpy as np
import pytest
import torch

from vla_rt.checkpoints.norm_stats import (
    NormStats,
    NormStatsError,
    load_norm_stats,
    norm_stats_from_json,
    require_keys,
    save_norm_stats,
)
from vla_rt.errors import CheckpointError

STATS = NormStats(mean=[1.0, -2.0, 0.5], std=[2.0, 0.5, 1.0], q01=[-1.0, -3.0, 0.0], q99=[3.0, -1.0, 4.0])


def test_json_round_trip_in_openpi_layout(tmp_path):
    stats = {"state": STATS, "actions": NormStats(mean=[0.0, 1.0], std=[1.0, 3.0])}
    file = save_norm_stats(tmp_path / "assets" / "robot", stats)
    assert file == tmp_path / "assets" / "robot" / "norm_stats.json"
    raw = json.loads(file.read_text())
    assert raw["norm_stats"]["state"] == {
        "mean": [1.0, -2.0, 0.5],
        "std": [2.0, 0.5, 1.0],
        "q01": [-1.0, -3.0, 0.0],
        "q99": [3.0, -1.0, 4.0],
    }
    assert "q01" not in raw["norm_stats"]["actions"]
    assert load_norm_stats(file.parent) == stats
    assert load_norm_stats(file) == stats


def test_zscore_matches_hand_computed_values():
    x = np.array([3.0, -1.0, 0.5], dtype=np.float64)
    expected = np.array([2.0 / (2.0 + 1e-6), 1.0 / (0.5 + 1e-6), 0.0])
    np.testing.assert_allclose(STATS.normalize(x), expected, rtol=1e-12)
    np.testing.assert_allclose(STATS.unnormalize(expected), x, rtol=1e-12)


def test_quantile_matches_hand_computed_values():
    x = np.array([1.0, -1.0, 0.0])
    # (x - q01) / (q99 - q01 + 1e-6) * 2 - 1
    expected = np.array([2.0 / (4.0 + 1e-6) * 2 - 1, 2.0 / (2.0 + 1e-6) * 2 - 1, -1.0])
    np.testing.assert_allclose(STATS.normalize(x, use_quantiles=True), expected, rtol=1e-12)
    np.testing.assert_allclose(STATS.unnormalize(expected, use_quantiles=True), x, rtol=1e-12, atol=1e-12)


def test_torch_inputs_keep_dtype_and_match_numpy():
    x = torch.tensor([[3.0, -1.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float32)
    for q in (False, True):
        y = STATS.normalize(x, use_quantiles=q)
        assert y.dtype == torch.float32 and y.shape == x.shape
        np.testing.assert_allclose(y.numpy(), STATS.normalize(x.double().numpy(), use_quantiles=q), rtol=1e-6)


def test_dims_beyond_the_stats_follow_openpi():
    # normalize: a raw robot vector shorter than the stats uses the first dims
    np.testing.assert_allclose(STATS.normalize(np.array([3.0, -1.0])), [2.0 / (2.0 + 1e-6), 1.0 / (0.5 + 1e-6)])
    # unnormalize z-score: stats padded with mean 0, std 1 (extra dims scaled by 1 + 1e-6, as openpi does)
    out = STATS.unnormalize(np.array([0.0, 0.0, 0.0, 2.0, -4.0]))
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 2.0 * (1 + 1e-6), -4.0 * (1 + 1e-6)], rtol=1e-12)
    # unnormalize quantile: extra dims pass through unchanged
    out = STATS.unnormalize(np.array([-1.0, -1.0, -1.0, 2.0, -4.0]), use_quantiles=True)
    np.testing.assert_allclose(out, [-1.0, -3.0, 0.0, 2.0, -4.0], rtol=1e-12)


def test_wrong_lengths_raise_clear_errors():
    with pytest.raises(
        ValueError, match=r"^x: expected at most 3 dims to normalise \(the norm stats' width\), found 4"
    ):
        STATS.normalize(np.zeros(4))
    with pytest.raises(ValueError, match=r"^x: expected at least 3 dims to un-normalise .*, found 2"):
        STATS.unnormalize(np.zeros(2))
    with pytest.raises(NormStatsError, match="^std: expected 3 entries like 'mean', found 2 entries"):
        NormStats(mean=[0.0, 0.0, 0.0], std=[1.0, 1.0])


def test_quantile_mode_needs_quantiles():
    with pytest.raises(NormStatsError, match="needs 'q01' and 'q99'"):
        NormStats(mean=[0.0], std=[1.0]).normalize(np.zeros(1), use_quantiles=True)
    with pytest.raises(NormStatsError, match=r"^q01/q99: expected both or neither .*, found only one"):
        NormStats(mean=[0.0], std=[1.0], q01=[0.0])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"state": {}}, "top-level 'norm_stats' key"),
        (
            {"norm_stats": {"state": {"mean": [0.0]}}},
            r"norm_stats\['state'\]: expected 'mean' and 'std', found it lacks \['std'\]",
        ),
        ({"norm_stats": {"state": {"mean": [0.0], "std": ["a"]}}}, "non-numeric"),
        (
            {"norm_stats": {"state": {"mean": [0.0, 1.0], "std": [1.0]}}},
            r"norm_stats\['state'\].std: expected 2 entries like 'mean', found 1 entries",
        ),
        ({"norm_stats": {}}, "non-empty"),
    ],
)
def test_malformed_files_name_the_problem(data, message):
    with pytest.raises(NormStatsError, match=message):
        norm_stats_from_json(data, "file.json")


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(CheckpointError, match="norm_stats.json: no such file"):
        load_norm_stats(tmp_path)
    (tmp_path / "norm_stats.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        load_norm_stats(tmp_path)


def test_require_keys_names_what_is_missing():
    with pytest.raises(NormStatsError, match=r"found \['state'\] \(they lack \['actions'\]\)"):
        require_keys({"state": STATS})
