"""π0.5 checkpoints in every format: openpi orbax trees, LeRobot `pi05` files and native files.

Path and key names were read from openpi (`gemma.py`: the adaptive RMSNorm's unnamed `nn.Dense` is flax's
`Dense_0`; `examples/convert_jax_model_to_pytorch.py` reads `.../pre_attention_norm_1/Dense_0/kernel`) and LeRobot
0.6.1 (`policies/pi_gemma.py`: `PiGemmaRMSNorm.dense`; `policies/pi05/modeling_pi05.py`: `time_mlp_in/out`).
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vla_rt.checkpoints import lerobot, lerobot_names, load_checkpoint, save_lerobot, save_native
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.cli import main
from vla_rt.config import preset
from vla_rt.inference import build_pi0
from vla_rt.model.weights import CheckpointError, random_weights

TINY05 = preset("tiny_pi05")
EXPERT = "model.paligemma_with_expert.gemma_expert.model."
STATS = {
    "state": NormStats(mean=[0.5, -1.0], std=[2.0, 0.25], q01=[-1.0, -2.0], q99=[1.0, 2.0]),
    "actions": NormStats(mean=[1.5], std=[0.5], q01=[0.0], q99=[3.0]),
}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One tiny π0.5 written in all three formats."""
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import save_openpi

    root = tmp_path_factory.mktemp("pi05")
    weights = random_weights(TINY05, seed=21)
    paths = {
        "openpi": root / "openpi",
        "lerobot": root / "lerobot",
        "native": root / "tiny_pi05.safetensors",
    }
    save_openpi(weights, TINY05, paths["openpi"], norm_stats=STATS, asset_id="robot")
    save_lerobot(weights, TINY05, paths["lerobot"], norm_stats=STATS)
    save_native(paths["native"], weights, TINY05, source="random:tiny_pi05:21", norm_stats=STATS)
    return weights, paths


def test_every_format_reads_back_the_same_weights_and_gives_identical_actions(written):
    weights, paths = written
    g = torch.Generator().manual_seed(3)
    images = torch.rand(1, 2, 224, 224, 3, generator=g) * 2 - 1
    state = torch.randn(1, TINY05.action_dim, generator=g)
    tokens = torch.randint(0, TINY05.vocab_size, (1, 9), generator=g)
    noise = torch.randn(1, 10, TINY05.action_dim, generator=g)
    actions = {}
    for kind, path in paths.items():
        ckpt = load_checkpoint(path)
        assert ckpt.format == kind and ckpt.config == TINY05 and ckpt.config.pi05
        assert _equal(ckpt.weights, weights)
        assert ckpt.norm_stats["actions"] == STATS["actions"]
        model = build_pi0(ckpt.weights, ckpt.config)
        actions[kind] = model.sample_actions(images, state, tokens, noise, num_steps=3)
    assert torch.equal(actions["openpi"], actions["lerobot"]) and torch.equal(actions["openpi"], actions["native"])
    assert ckpt.config.max_token_len == 200


def test_openpi_tree_has_openpis_adaptive_norm_paths_and_semantics(written):
    """The Dense_0 leaves exist with openpi's shapes, and openpi's `cond @ kernel + bias` split in thirds (scale,
    shift, gate) is the modulation our reference computes from the canonical weights."""
    import orbax.checkpoint as ocp

    from vla_rt.checkpoints import openpi
    from vla_rt.model import Pi0Model

    weights, paths = written
    with ocp.PyTreeCheckpointer() as c:
        tree = c.restore((paths["openpi"] / "params").absolute())["params"]
    flat = dict(openpi._flatten(tree))
    e, depth = TINY05.expert.width, TINY05.expert.depth
    llm = "PaliGemma/llm/"
    assert flat[llm + "layers/pre_attention_norm_1/Dense_0/kernel"].shape == (depth, e, 3 * e)
    assert flat[llm + "layers/pre_ffw_norm_1/Dense_0/bias"].shape == (depth, 3 * e)
    assert flat[llm + "final_norm_1/Dense_0/kernel"].shape == (e, 3 * e)
    assert flat["time_mlp_in/kernel"].shape == (e, e) and flat["time_mlp_out/bias"].shape == (e,)
    assert llm + "layers/pre_attention_norm/scale" in flat  # the PaliGemma expert keeps plain norms
    absent = ("state_proj/kernel", "action_time_mlp_in/kernel", llm + "layers/pre_attention_norm_1/scale")
    assert not any(a in flat for a in absent)

    model = Pi0Model(TINY05)
    model.load_state_dict(weights)
    cond = torch.randn(2, e)
    kernel, bias = (
        flat[llm + "layers/pre_ffw_norm_1/Dense_0/kernel"][1],
        flat[llm + "layers/pre_ffw_norm_1/Dense_0/bias"][1],
    )
    openpi_mod = cond.double().numpy() @ kernel.astype(np.float64) + bias.astype(np.float64)
    scale, shift, gate = (
        m[:, 0].detach().double().numpy() for m in model.expert.layers[1].ffn_norm.modulation(cond, torch.float32)
    )
    np.testing.assert_allclose(np.concatenate([scale, shift, gate], -1), openpi_mod, rtol=1e-5, atol=1e-5)
    # the time MLP, openpi's nnx.Linear: x @ kernel + bias
    t_in = F.linear(cond, weights["time_mlp_in.weight"], weights["time_mlp_in.bias"])
    np.testing.assert_allclose(
        t_in.numpy(), cond.numpy() @ flat["time_mlp_in/kernel"] + flat["time_mlp_in/bias"], rtol=1e-5, atol=1e-5
    )


def test_openpi_training_layout_with_value_suffix(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from vla_rt.checkpoints import load_openpi, save_openpi

    weights = random_weights(TINY05, seed=22)
    save_openpi(weights, TINY05, tmp_path, value_suffix=True)
    loaded = load_openpi(tmp_path)
    assert loaded.config == TINY05 and _equal(loaded.weights, weights)


def _lerobot_pi05_module_shapes() -> dict[str, tuple]:
    """The state dict LeRobot's PI05Pytorch has for the tiny dims: transformers' PaliGemma + Gemma modules with
    LeRobot's PiGemmaRMSNorm in the expert (`dense` = Linear(cond_dim, 3W) instead of `weight`)."""
    transformers = pytest.importorskip("transformers")
    cfg = TINY05
    vlm = transformers.PaliGemmaConfig()
    t, v, g, e = vlm.text_config, vlm.vision_config, cfg.llm, cfg.expert
    t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.vocab_size = g.width, g.mlp_dim, g.depth, cfg.vocab_size
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = g.num_heads, g.num_kv_heads, g.head_dim
    v.hidden_size, v.intermediate_size, v.num_hidden_layers = cfg.vision.width, cfg.vision.mlp_dim, cfg.vision.depth
    v.num_attention_heads, v.patch_size, v.image_size, v.projection_dim = cfg.vision.num_heads, 14, 224, g.width
    paligemma = transformers.PaliGemmaForConditionalGeneration(vlm)
    expert_cfg = transformers.GemmaConfig(
        hidden_size=e.width,
        intermediate_size=e.mlp_dim,
        num_hidden_layers=e.depth,
        num_attention_heads=e.num_heads,
        num_key_value_heads=e.num_kv_heads,
        head_dim=e.head_dim,
        vocab_size=cfg.vocab_size,
    )
    expert = transformers.GemmaForCausalLM(expert_cfg)
    expert.model.embed_tokens = None  # as LeRobot does
    for module in [*(layer for layer in expert.model.layers), expert.model]:
        for name in ("input_layernorm", "post_attention_layernorm", "norm"):
            if hasattr(module, name):
                norm = torch.nn.Module()
                norm.dense = torch.nn.Linear(e.width, 3 * e.width)  # PiGemmaRMSNorm(cond_dim=W)
                setattr(module, name, norm)
    shapes = {"model.paligemma_with_expert.paligemma." + k: tuple(p.shape) for k, p in paligemma.state_dict().items()}
    shapes |= {"model.paligemma_with_expert.gemma_expert." + k: tuple(p.shape) for k, p in expert.state_dict().items()}
    we, a = e.width, cfg.action_dim
    for name, (out_f, in_f) in {
        "action_in_proj": (we, a),
        "action_out_proj": (a, we),
        "time_mlp_in": (we, we),
        "time_mlp_out": (we, we),
    }.items():
        shapes |= {f"model.{name}.weight": (out_f, in_f), f"model.{name}.bias": (out_f,)}
    return {lerobot_names.normalize_key(k, pi05=True): s for k, s in shapes.items()}


def test_lerobot_keys_and_shapes_are_those_of_lerobots_pi05_modules(tmp_path):
    module = _lerobot_pi05_module_shapes()
    out = save_lerobot(random_weights(TINY05, seed=23), TINY05, tmp_path)
    written = {k: tuple(v.shape) for k, v in load_file(out / "model.safetensors").items()}
    assert written == {k: s for k, s in module.items() if k != lerobot_names.LM + "embed_tokens.weight"}
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "pi05" and config["tokenizer_max_length"] == 200
    loaded = lerobot.load_lerobot(out)
    assert loaded.use_quantile_norm is True and loaded.config == TINY05


def test_lerobot_pi05_time_mlp_is_not_renamed_and_keys_without_model_prefix_load(tmp_path):
    weights = random_weights(TINY05, seed=24)
    out = save_lerobot(weights, TINY05, tmp_path / "a")
    from safetensors.torch import save_file

    tensors = {k.removeprefix("model."): v for k, v in load_file(out / "model.safetensors").items()}
    (tmp_path / "b").mkdir()
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text((out / "config.json").read_text())
    assert _equal(lerobot.load_lerobot(tmp_path / "b").weights, weights)


def test_lerobot_pi05_file_with_a_pi0_head_is_refused_by_name(tmp_path):
    weights = random_weights(TINY05, seed=25)
    out = save_lerobot(weights, TINY05, tmp_path / "a")
    from safetensors.torch import save_file

    tensors = load_file(out / "model.safetensors")
    tensors["model.state_proj.weight"] = torch.zeros(TINY05.expert.width, TINY05.action_dim)
    del tensors[EXPERT + "norm.dense.bias"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        lerobot.load_lerobot(out)
    assert "unexpected tensor 'model.state_proj.weight'" in str(err.value)
    assert f"missing tensor '{EXPERT}norm.dense.bias'" in str(err.value)


def test_info_names_the_model(tmp_path, capsys):
    dst = tmp_path / "tiny_pi05.safetensors"
    assert main(["convert", "random:tiny_pi05:2", str(dst)]) == 0
    capsys.readouterr()
    assert main(["info", str(dst), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "π0.5" and summary["config"]["pi05"] is True
    assert main(["info", "random:tiny"]) == 0
    assert "model:      π0\n" in capsys.readouterr().out
