"""openpi checkpoints: real orbax trees written in openpi's layout, read back exactly, and bad trees refused."""

import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("orbax.checkpoint")

import orbax.checkpoint as ocp  # noqa: E402

from vla_rt.checkpoints import openpi  # noqa: E402
from vla_rt.checkpoints.common import torch_to_numpy  # noqa: E402
from vla_rt.checkpoints.norm_stats import NormStats  # noqa: E402
from vla_rt.checkpoints.openpi_layout import layout  # noqa: E402
from vla_rt.config import GemmaConfig, Pi0Config, VisionConfig, preset  # noqa: E402
from vla_rt.model.weights import CheckpointError, random_weights  # noqa: E402

TINY = preset("tiny")
# q/k/v fused (heads == kv heads), 2 vision heads of 32 (not π0's guess from the width), 56px images, 7 action dims
FUSED = Pi0Config(
    vision=VisionConfig(width=64, depth=1, mlp_dim=96, num_heads=2, patch_size=14, image_size=56),
    llm=GemmaConfig(width=48, depth=2, mlp_dim=80, num_heads=2, num_kv_heads=2, head_dim=8),
    expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=2, head_dim=8),
    vocab_size=100,
    action_dim=7,
)
STATS = {"state": NormStats(mean=[0.5, 1.0], std=[2.0, 3.0]), "actions": NormStats(mean=[0.0], std=[1.0])}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _flat_tree(params_dir):
    with ocp.PyTreeCheckpointer() as c:
        return dict(openpi._flatten(c.metadata(params_dir).item_metadata.tree))


def _save_flat(flat: dict, params_dir) -> None:
    """Saves a hand-edited openpi tree the way openpi's own tests do."""
    with ocp.PyTreeCheckpointer() as c:
        c.save(params_dir.absolute(), {"params": openpi._nest(flat)})


def _openpi_flat(weights, cfg) -> dict:
    return {leaf.path: torch_to_numpy(leaf.write(weights)) for leaf in layout(cfg)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = random_weights(TINY, seed=1)
    root = tmp_path_factory.mktemp("openpi") / "pi0_tiny"
    openpi.save_openpi(weights, TINY, root, norm_stats=STATS, asset_id="robot")
    return weights, root


@pytest.mark.parametrize("cfg", [TINY, FUSED], ids=["tiny", "fused-qkv"])
def test_round_trip_is_exact(tmp_path, cfg):
    weights = random_weights(cfg, seed=2)
    openpi.save_openpi(weights, cfg, tmp_path)
    loaded = openpi.load_openpi(tmp_path)
    assert loaded.config == cfg and loaded.format == "openpi"
    assert _equal(loaded.weights, weights)


def test_written_tree_is_openpi_layout(tiny):
    _, root = tiny
    flat = _flat_tree(root / "params")
    shapes = {k: tuple(v.shape) for k, v in flat.items()}
    assert all(k.startswith("params/") for k in shapes)
    expect = {
        "params/PaliGemma/img/embedding/kernel": (14, 14, 3, 64),
        "params/PaliGemma/img/pos_embedding": (1, 256, 64),
        "params/PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel": (2, 64, 4, 16),
        "params/PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/out/kernel": (2, 4, 16, 64),
        "params/PaliGemma/img/Transformer/encoderblock/MlpBlock_0/Dense_0/kernel": (2, 64, 128),
        "params/PaliGemma/img/head/kernel": (64, 64),
        "params/PaliGemma/llm/embedder/input_embedding": (1024, 64),
        "params/PaliGemma/llm/layers/attn/q_einsum/w": (2, 8, 64, 16),
        "params/PaliGemma/llm/layers/attn/kv_einsum/w": (2, 2, 1, 64, 16),
        "params/PaliGemma/llm/layers/attn/attn_vec_einsum_1/w": (2, 8, 16, 32),
        "params/PaliGemma/llm/layers/mlp_1/gating_einsum": (2, 2, 32, 64),
        "params/PaliGemma/llm/layers/mlp/linear": (2, 128, 64),
        "params/PaliGemma/llm/layers/pre_ffw_norm_1/scale": (2, 32),
        "params/PaliGemma/llm/final_norm_1/scale": (32,),
        "params/state_proj/kernel": (32, 32),
        "params/action_time_mlp_in/kernel": (64, 32),
        "params/action_out_proj/bias": (32,),
    }
    assert {k: shapes[k] for k in expect} == expect
    assert (root / "assets" / "robot" / "norm_stats.json").is_file()


def test_layout_matches_openpi_einsum_semantics():
    """The openpi arrays, used with openpi's own einsums, compute what the canonical Linear weights compute."""
    w = random_weights(TINY, seed=3)
    o = {k: torch.from_numpy(v).double() for k, v in _openpi_flat(w, TINY).items()}
    w = {k: v.double() for k, v in w.items()}
    g, v = TINY.llm, TINY.vision
    x = torch.randn(5, g.width, dtype=torch.float64)
    lay, attn, mlp = "llm.layers.1.", "PaliGemma/llm/layers/attn/", "PaliGemma/llm/layers/mlp/"
    lin = F.linear

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    close(
        torch.einsum("td,ndh->tnh", x, o[attn + "q_einsum/w"][1]),
        lin(x, w[lay + "q_proj.weight"]).reshape(5, g.num_heads, g.head_dim),
    )
    k, val = torch.einsum("td,ckdh->ctkh", x, o[attn + "kv_einsum/w"][1])
    close(k, lin(x, w[lay + "k_proj.weight"]).reshape(5, 1, g.head_dim))
    close(val, lin(x, w[lay + "v_proj.weight"]).reshape(5, 1, g.head_dim))
    enc = torch.randn(5, g.num_heads, g.head_dim, dtype=torch.float64)
    close(
        torch.einsum("tnh,nhd->td", enc, o[attn + "attn_vec_einsum/w"][1]),
        lin(enc.reshape(5, -1), w[lay + "o_proj.weight"]),
    )
    close(x @ o[mlp + "gating_einsum"][1, 0], lin(x, w[lay + "gate_proj.weight"]))
    close(x @ o[mlp + "gating_einsum"][1, 1], lin(x, w[lay + "up_proj.weight"]))
    hid = torch.randn(5, g.mlp_dim, dtype=torch.float64)
    close(hid @ o[mlp + "linear"][1], lin(hid, w[lay + "down_proj.weight"]))

    mha, blk = "PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/", "vision.blocks.0.attn."
    xv = torch.randn(5, v.width, dtype=torch.float64)
    q = torch.einsum("tw,whk->thk", xv, o[mha + "query/kernel"][0]) + o[mha + "query/bias"][0]
    close(q, lin(xv, w[blk + "q_proj.weight"], w[blk + "q_proj.bias"]).reshape(5, v.num_heads, v.head_dim))
    encv = torch.randn(5, v.num_heads, v.head_dim, dtype=torch.float64)
    out = torch.einsum("thk,hkw->tw", encv, o[mha + "out/kernel"][0]) + o[mha + "out/bias"][0]
    close(out, lin(encv.reshape(5, -1), w[blk + "out_proj.weight"], w[blk + "out_proj.bias"]))

    img = torch.randn(1, 28, 28, 3, dtype=torch.float64)  # NHWC, 2x2 patches
    patches = img.reshape(1, 2, 14, 2, 14, 3).permute(0, 1, 3, 2, 4, 5)
    flax_conv = torch.einsum("bijhwc,hwco->bijo", patches, o["PaliGemma/img/embedding/kernel"])
    torch_conv = F.conv2d(img.permute(0, 3, 1, 2), w["vision.patch_embed.weight"], stride=14).permute(0, 2, 3, 1)
    close(flax_conv, torch_conv)
    xs = torch.randn(5, TINY.action_dim, dtype=torch.float64)
    close(xs @ o["state_proj/kernel"] + o["state_proj/bias"], lin(xs, w["state_proj.weight"], w["state_proj.bias"]))


def test_accepted_path_forms_and_value_suffix(tiny, tmp_path):
    weights, root = tiny
    step = tmp_path / "run" / "1000"
    openpi.save_openpi(weights, TINY, step, value_suffix=True)
    (step / "train_state").mkdir()
    assert all(k.endswith("/value") for k in _flat_tree(step / "params"))
    for path in (root, root / "params", step, step / "params"):
        loaded = openpi.load_openpi(path)
        assert loaded.config == TINY
        assert _equal(loaded.weights, weights), path


def test_norm_stats_found_beside_params(tiny, tmp_path):
    weights, root = tiny
    assert openpi.load_openpi(root / "params").norm_stats == STATS
    openpi.save_openpi(weights, TINY, tmp_path, norm_stats=STATS, asset_id="a")
    openpi.save_norm_stats(tmp_path / "assets" / "b", {"state": NormStats(mean=[1.0], std=[1.0])})
    ambiguous = openpi.load_openpi(tmp_path)
    assert ambiguous.norm_stats is None and "['a', 'b']" in " ".join(ambiguous.notes)
    assert openpi.load_openpi(tmp_path, asset_id="a").norm_stats == STATS
    with pytest.raises(CheckpointError, match="no norm stats for asset 'c'; found assets \\['a', 'b'\\]"):
        openpi.load_openpi(tmp_path, asset_id="c")


def test_bfloat16_stored_dtype_kept_or_converted(tmp_path):
    weights = {k: v.to(torch.bfloat16) for k, v in random_weights(TINY, seed=4).items()}
    openpi.save_openpi(weights, TINY, tmp_path)
    assert _equal(openpi.load_openpi(tmp_path, dtype=None).weights, weights)
    assert _equal(openpi.load_openpi(tmp_path).weights, {k: v.float() for k, v in weights.items()})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("missing", r"missing tensor 'PaliGemma/llm/layers/pre_ffw_norm_1/scale' \(expected shape \(2, 32\)\)"),
        ("extra", r"unexpected tensor 'PaliGemma/llm/layers/attn/q_einsum/lora_a' with shape \(2, 8, 64, 4\)"),
        ("misshaped", r"tensor 'action_out_proj/bias' has shape \(33,\), expected \(32,\)"),
    ],
)
def test_bad_trees_are_refused_naming_tensor_and_shapes(tmp_path, edit, message):
    flat = _openpi_flat(random_weights(TINY, seed=5), TINY)
    if edit == "missing":
        del flat["PaliGemma/llm/layers/pre_ffw_norm_1/scale"]
    elif edit == "extra":
        flat["PaliGemma/llm/layers/attn/q_einsum/lora_a"] = np.zeros((2, 8, 64, 4), np.float32)
    else:
        flat["action_out_proj/bias"] = np.zeros(33, np.float32)
    _save_flat(flat, tmp_path / "params")
    with pytest.raises(CheckpointError, match=message):
        openpi.load_openpi(tmp_path)


def test_missing_dimension_anchor_and_other_models(tmp_path):
    flat = _openpi_flat(random_weights(TINY, seed=6), TINY)
    del flat["PaliGemma/llm/layers/attn/q_einsum/w"]
    _save_flat(flat, tmp_path / "a" / "params")
    with pytest.raises(
        CheckpointError, match="cannot infer model dimensions: tensor 'PaliGemma/llm/layers/attn/q_einsum/w'"
    ):
        openpi.load_openpi(tmp_path / "a")
    flat = _openpi_flat(random_weights(TINY, seed=6), TINY)
    flat["time_mlp_in/kernel"] = flat.pop("state_proj/kernel")  # half π0, half π0.5: read as π0.5, refused
    _save_flat(flat, tmp_path / "b" / "params")
    with pytest.raises(CheckpointError, match="missing tensor 'time_mlp_out/kernel'"):
        openpi.load_openpi(tmp_path / "b")


def test_unrecognised_dirs_say_what_was_looked_for(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="looked for an orbax params dir"):
        openpi.find_params_dir(tmp_path)
    _, root = tiny
    with pytest.raises(CheckpointError, match=r"training steps \['pi0_tiny'\]: pass one of those step dirs"):
        openpi.find_params_dir(root.parent)


def test_missing_orbax_tells_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(ImportError, match=r"pip install vla-rt\[openpi\]"):
        openpi._orbax()


def test_norm_stats_file_is_openpi_json(tiny):
    _, root = tiny
    data = json.loads((root / "assets" / "robot" / "norm_stats.json").read_text())
    assert data == {
        "norm_stats": {"state": {"mean": [0.5, 1.0], "std": [2.0, 3.0]}, "actions": {"mean": [0.0], "std": [1.0]}}
    }


def test_a_relative_path_reads_as_the_absolute_one(tiny, monkeypatch):
    """The bug: orbax finds no tree metadata under a relative path, so `vla-rt info pi0_droid` run beside the
    checkpoint failed with 'the orbax tree is a NoneType'."""
    weights, root = tiny
    monkeypatch.chdir(root.parent)
    for path in (root.name, f"{root.name}/params"):
        assert _equal(openpi.load_openpi(path).weights, weights), path
        assert openpi.load_openpi(path, shapes_only=True).config == TINY
