"""Property: any value put at any key of an experiment config ends in a ConfigError naming a dotted field, or in a
config whose every checked value is in range (so the devices build from it), never in another exception.

Budget (CI, 2 cores): 200 examples a test, derandomized, no example database (a few seconds);
HYPOTHESIS_PROFILE=explore runs 3000 fresh random ones.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf
from property_budget import budget

from vla_rt.errors import ConfigError, VlaRtError
from vla_rt.pen_catch.config import validate_collect, validate_pen_catch, validate_train
from vla_rt.robot.factory import build_config
from vla_rt.robot.pen_drop import PenDropConfig
from vla_rt.robot.sim_camera import SimCameraConfig

BUDGET = budget(200, 3000)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _composed(name: str):
    with initialize_config_dir(str(CONFIGS), version_base=None):
        return compose(config_name=name)


@pytest.fixture(scope="module")
def configs():
    return {
        name: _composed(f"experiment/{name}")
        for name in ("pen_catch", "pen_catch_hardware", "collect_pen_catch", "train_pen_catch")
    }


def _leaves(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if OmegaConf.is_dict(value):
            yield from _leaves(value, path)
        else:
            yield path


VALUES = st.one_of(
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 0.0, -0.5, 1e-9, 1e9, "no", "yes", "true", "off", "", "abc", "-30", "1e3"]),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=3),
)
VALIDATORS = {
    "pen_catch": validate_pen_catch,
    "pen_catch_hardware": validate_pen_catch,
    "collect_pen_catch": validate_collect,
    "train_pen_catch": validate_train,
}


def _assert_usable(name: str, cfg) -> None:
    """What the validated ranges promise: the simulated devices build and time runs forward."""
    if name in ("pen_catch", "collect_pen_catch"):
        robot = OmegaConf.to_container(cfg.robot, resolve=True)
        camera = build_config(SimCameraConfig, robot["camera"])
        pen = build_config(PenDropConfig, robot["pen"])
        assert camera.fps > 0 and math.isfinite(1 / camera.fps) and camera.latency_frames >= 0
        assert pen.gravity_m_s2 > 0 and pen.physics_dt_s > 0
    if name.startswith("pen_catch"):
        assert isinstance(cfg.realtime, bool) and cfg.trials >= 1 and cfg.trial_s > 0 and cfg.runtime.control_hz > 0


@BUDGET
@given(data=st.data())
def test_any_value_at_any_key(configs, data):
    name = data.draw(st.sampled_from(sorted(configs)))
    cfg = copy.deepcopy(configs[name])
    changes = data.draw(st.lists(st.tuples(st.sampled_from(sorted(_leaves(cfg))), VALUES), min_size=1, max_size=3))
    for key, value in changes:
        OmegaConf.update(cfg, key, value, force_add=True)
    try:
        checked = VALIDATORS[name](cfg)
    except VlaRtError as err:
        assert isinstance(err, ConfigError), repr(err)
        assert str(err).startswith(f"{err.field}: expected ") and len(str(err)) < 600, str(err)
        assert err.field.split("[")[0].split(".")[0] in cfg, err.field  # names a key of the config
        return
    _assert_usable(name, checked)


@BUDGET
@given(data=st.data())
def test_unknown_keys_are_named(configs, data):
    name = data.draw(st.sampled_from(sorted(configs)))
    cfg = copy.deepcopy(configs[name])
    parent = data.draw(st.sampled_from(["", *sorted({p.rsplit(".", 1)[0] for p in _leaves(cfg) if "." in p})]))
    key = data.draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8))
    full = f"{parent}.{key}" if parent else key
    known = OmegaConf.select(cfg, parent) if parent else cfg
    if key in known:
        return
    OmegaConf.update(cfg, full, 1, force_add=True)
    with pytest.raises(ConfigError) as info:
        VALIDATORS[name](cfg)
    assert info.value.field == full and "found an unknown key" in str(info.value), str(info.value)
