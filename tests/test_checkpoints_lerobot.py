"""LeRobot π0 checkpoints: key names checked against the transformers modules LeRobot builds, every key layout
LeRobot has written, norm stats from processor files and legacy buffers, and bad files refused."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_rt.checkpoints import lerobot, lerobot_names
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.config import preset
from vla_rt.model.weights import CheckpointError, random_weights

TINY = preset("tiny")
STATS = {
    "state": NormStats(mean=[0.5, -1.0], std=[2.0, 0.25]),
    "actions": NormStats(mean=[1.5], std=[0.5], q01=[0.0], q99=[3.0]),
}
PG = "model.paligemma_with_expert.paligemma."


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _rewrite(src_dir, dst_dir, rename=lambda k: k, drop=(), add=None, config=None):
    """Copies a LeRobot dir with its model.safetensors keys renamed/dropped/added (simulating other writers)."""
    tensors = {rename(k): v for k, v in load_file(src_dir / "model.safetensors").items() if k not in drop}
    tensors.update(add or {})
    dst_dir.mkdir(parents=True)
    save_file(tensors, dst_dir / "model.safetensors")
    conf = json.loads((src_dir / "config.json").read_text()) | (config or {})
    (dst_dir / "config.json").write_text(json.dumps(conf))
    return dst_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    weights = random_weights(TINY, seed=11)
    path = lerobot.save_lerobot(weights, TINY, tmp_path_factory.mktemp("lerobot") / "pi0_tiny", norm_stats=STATS)
    return weights, path


@pytest.mark.parametrize("under_lm_head", [True, False])
def test_round_trip_is_exact(tmp_path, under_lm_head):
    weights = random_weights(TINY, seed=12)
    lerobot.save_lerobot(weights, TINY, tmp_path, embedding_under_lm_head=under_lm_head)
    loaded = lerobot.load_lerobot(tmp_path)
    assert loaded.config == TINY and loaded.format == "lerobot"
    assert _equal(loaded.weights, weights)
    assert "gemma_expert.lm_head.weight" in " ".join(loaded.notes)


def _lerobot_module_shapes() -> dict[str, tuple]:
    """Parameter names and shapes of the modules LeRobot's PI0Pytorch builds, for the tiny dims."""
    transformers = pytest.importorskip("transformers")
    vlm = transformers.PaliGemmaConfig()
    t, v, g, e = vlm.text_config, vlm.vision_config, TINY.llm, TINY.expert
    t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.vocab_size = g.width, g.mlp_dim, g.depth, TINY.vocab_size
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = g.num_heads, g.num_kv_heads, g.head_dim
    v.hidden_size, v.intermediate_size, v.num_hidden_layers = TINY.vision.width, TINY.vision.mlp_dim, TINY.vision.depth
    v.num_attention_heads, v.patch_size, v.image_size, v.projection_dim = TINY.vision.num_heads, 14, 224, g.width
    paligemma = transformers.PaliGemmaForConditionalGeneration(vlm)
    expert = transformers.GemmaForCausalLM(
        transformers.GemmaConfig(
            hidden_size=e.width,
            intermediate_size=e.mlp_dim,
            num_hidden_layers=e.depth,
            num_attention_heads=e.num_heads,
            num_key_value_heads=e.num_kv_heads,
            head_dim=e.head_dim,
            vocab_size=TINY.vocab_size,
        )
    )
    expert.model.embed_tokens = None  # as LeRobot does
    shapes = {PG + k: tuple(p.shape) for k, p in paligemma.state_dict().items()}
    shapes |= {"model.paligemma_with_expert.gemma_expert." + k: tuple(p.shape) for k, p in expert.state_dict().items()}
    we, a = e.width, TINY.action_dim
    heads = {
        "state_proj": (we, a),
        "action_in_proj": (we, a),
        "action_out_proj": (a, we),
        "action_time_mlp_in": (we, 2 * we),
        "action_time_mlp_out": (we, we),
    }
    for name, (out_f, in_f) in heads.items():
        shapes |= {f"model.{name}.weight": (out_f, in_f), f"model.{name}.bias": (out_f,)}
    return {lerobot_names.normalize_key(k): s for k, s in shapes.items()}


def test_keys_and_shapes_are_those_of_lerobots_modules(tmp_path):
    module = _lerobot_module_shapes()
    for under_lm_head, unused in ((True, lerobot_names.LM + "embed_tokens.weight"), (False, lerobot_names.LM_HEAD)):
        out = lerobot.save_lerobot(
            random_weights(TINY, seed=13), TINY, tmp_path / str(under_lm_head), embedding_under_lm_head=under_lm_head
        )
        written = {k: tuple(v.shape) for k, v in load_file(out / "model.safetensors").items()}
        assert written == {k: s for k, s in module.items() if k != unused}


@pytest.mark.parametrize("layout", ["transformers<4.52", "transformers>=5", "time_mlp"])
def test_older_key_layouts_load_identically(tiny, tmp_path, layout):
    weights, src = tiny
    if layout == "transformers<4.52":

        def rename(k):
            k = k.removeprefix("model.")
            for new, old in (
                ("paligemma.model.language_model.", "paligemma.language_model.model."),
                ("paligemma.model.vision_tower.", "paligemma.vision_tower."),
                ("paligemma.model.multi_modal_projector.", "paligemma.multi_modal_projector."),
                ("paligemma.lm_head.", "paligemma.language_model.lm_head."),
            ):
                k = k.replace(new, old)
            return k
    elif layout == "transformers>=5":

        def rename(k):
            return k.replace("vision_tower.vision_model.", "vision_tower.")
    else:

        def rename(k):
            return k.replace("model.action_time_mlp_", "time_mlp_")

    loaded = lerobot.load_lerobot(_rewrite(src, tmp_path / "old", rename))
    assert loaded.config == TINY
    assert _equal(loaded.weights, weights)


def test_norm_stats_from_processor_files(tiny):
    _, path = tiny
    loaded = lerobot.load_lerobot(path)
    assert loaded.norm_stats.keys() == STATS.keys()
    for key in STATS:
        for field in ("mean", "std", "q01", "q99"):
            a, b = getattr(loaded.norm_stats[key], field), getattr(STATS[key], field)
            assert (a is None and b is None) or np.allclose(a, b, rtol=1e-7)
    assert loaded.use_quantile_norm is False
    assert lerobot.load_lerobot(path, shapes_only=True).norm_stats.keys() == STATS.keys()  # what `vla-rt info` shows


def test_norm_stats_from_legacy_buffers(tiny, tmp_path):
    _, src = tiny
    buffers = {
        "normalize_inputs.buffer_observation_state.mean": torch.tensor([0.5, -1.0]),
        "normalize_inputs.buffer_observation_state.std": torch.tensor([2.0, 0.25]),
        "unnormalize_outputs.buffer_action.mean": torch.tensor([1.5]),
        "unnormalize_outputs.buffer_action.std": torch.tensor([0.5]),
    }
    loaded = lerobot.load_lerobot(_rewrite(src, tmp_path / "old", add=buffers))
    assert loaded.norm_stats == {"state": STATS["state"], "actions": NormStats(mean=[1.5], std=[0.5])}


def test_config_json_supplies_only_non_shape_settings(tiny, tmp_path):
    _, src = tiny
    path = _rewrite(
        src,
        tmp_path / "a",
        config={
            "chunk_size": 10,
            "tokenizer_max_length": 20,
            "normalization_mapping": {"STATE": "QUANTILES", "ACTION": "QUANTILES"},
        },
    )
    loaded = lerobot.load_lerobot(path)
    assert (loaded.config.chunk, loaded.config.max_token_len, loaded.use_quantile_norm) == (10, 20, True)
    with pytest.raises(CheckpointError, match="policy type 'act'"):
        lerobot.load_lerobot(_rewrite(src, tmp_path / "b", config={"type": "act"}))
    with pytest.raises(CheckpointError, match="says type 'pi05' but the tensors are π0 "):
        lerobot.load_lerobot(_rewrite(src, tmp_path / "c", config={"type": "pi05"}))


@pytest.mark.parametrize(
    ("mapping", "field"),
    [(1, "normalization_mapping is 1"), ([], "normalization_mapping is \\[\\]"),
     ({"STATE": ["QUANTILES"]}, "normalization_mapping.STATE is \\['QUANTILES'\\]")],
)  # fmt: skip
def test_a_malformed_normalization_mapping_names_the_field_and_the_file(tiny, tmp_path, mapping, field):
    """Property-test finds (HYPOTHESIS_PROFILE=explore): these ended in a TypeError inside the loader."""
    _, src = tiny
    path = _rewrite(src, tmp_path / "a", config={"normalization_mapping": mapping})
    with pytest.raises(CheckpointError, match=field) as err:
        lerobot.load_lerobot(path)
    assert str(path) in str(err.value)


def test_stored_dtypes_kept_when_asked(tmp_path):
    weights = {
        k: v if k.startswith("vision") else v.to(torch.bfloat16) for k, v in random_weights(TINY, seed=14).items()
    }
    lerobot.save_lerobot(weights, TINY, tmp_path)
    assert _equal(lerobot.load_lerobot(tmp_path, dtype=None).weights, weights)
    assert lerobot.load_lerobot(tmp_path).weights["llm.layers.0.q_proj.weight"].dtype == torch.float32


EXPERT = "model.paligemma_with_expert.gemma_expert."


@pytest.mark.parametrize(
    ("drop", "add", "message"),
    [
        (
            [EXPERT + "model.layers.1.post_attention_layernorm.weight"],
            {},
            rf"missing tensor '{EXPERT}model\.layers\.1\.post_attention_layernorm\.weight' \(expected shape \(32,\)\)",
        ),
        (
            [],
            {"model.paligemma_with_expert.extra.weight": torch.zeros(3, 4)},
            r"unexpected tensor 'model\.paligemma_with_expert\.extra\.weight' with shape \(3, 4\)",
        ),
        (
            ["model.action_out_proj.bias"],
            {"model.action_out_proj.bias": torch.zeros(33)},
            r"tensor 'model\.action_out_proj\.bias' has shape \(33,\), expected \(32,\)",
        ),
        (
            [EXPERT + "lm_head.weight"],
            {EXPERT + "lm_head.weight": torch.zeros(1024, 31)},
            rf"tensor '{EXPERT}lm_head\.weight' has shape \(1024, 31\), expected \(1024, 32\)",
        ),
        (
            [PG + "model.language_model.layers.0.self_attn.q_proj.weight"],
            {},
            r"cannot infer model dimensions: missing tensors \['model\.paligemma_with_expert\.paligemma\.model\.language_model\.layers\.0\.self_attn\.q_proj\.weight'\]",
        ),
    ],
    ids=["missing", "extra", "misshaped", "misshaped-ignored", "missing-anchor"],
)
def test_bad_files_are_refused_naming_tensor_and_shapes(tiny, tmp_path, drop, add, message):
    _, src = tiny
    with pytest.raises(CheckpointError, match=message):
        lerobot.load_lerobot(_rewrite(src, tmp_path / "bad", drop=drop, add=add))


def test_a_pi0_file_with_one_adaptive_norm_is_refused_as_a_mixture(tiny, tmp_path):
    _, src = tiny
    adarms = {EXPERT + "model.layers.0.input_layernorm.dense.weight": torch.zeros(96, 32)}
    with pytest.raises(CheckpointError, match="says type 'pi0' but the tensors are π0.5"):
        lerobot.load_lerobot(_rewrite(src, tmp_path / "p", add=adarms))
    with pytest.raises(CheckpointError, match="missing tensor 'model.time_mlp_in.weight'"):
        lerobot.load_lerobot(_rewrite(src, tmp_path / "q", add=adarms, config={"type": None}))


def test_relative_actions_are_read_and_a_bad_value_names_the_field(tiny, tmp_path):
    """LeRobot's use_relative_actions travels with the weights (vla-rt's own policy must not send offsets to a robot
    as positions); absent or false it is off, a non-boolean is refused naming the field and the file."""
    _, src = tiny
    assert lerobot.load_lerobot(src).relative_actions is False
    assert (
        lerobot.load_lerobot(_rewrite(src, tmp_path / "off", config={"use_relative_actions": False})).relative_actions
        is False
    )
    loaded = lerobot.load_lerobot(_rewrite(src, tmp_path / "on", config={"use_relative_actions": True}))
    assert loaded.relative_actions is True and any("use_relative_actions" in n for n in loaded.notes)
    bad = _rewrite(src, tmp_path / "bad", config={"use_relative_actions": "yes"})
    with pytest.raises(CheckpointError, match="use_relative_actions is 'yes', expected true or false") as err:
        lerobot.load_lerobot(bad)
    assert str(bad) in str(err.value)


def test_a_relative_action_checkpoint_is_refused_by_the_policy_server_converter_and_split(tiny, tmp_path, capsys):
    """Each vla-rt path that turns the model's output into a robot's actions refuses it, naming the field and the
    LeRobot plugin (which applies LeRobot's relative-action steps); the model itself (`load_pi0`, which the plugin
    builds on) still loads, and says so."""
    from vla_rt import Pi0Policy, load_pi0
    from vla_rt.cli import main
    from vla_rt.serve.app import read_model_config
    from vla_rt.split.expert_file import read_expert_config, save_expert_file

    _, src = tiny
    path = _rewrite(src, tmp_path / "relative", config={"use_relative_actions": True})
    model = load_pi0(str(path), backend="folded", device="cpu", dtype=torch.float32, num_views=1)
    assert model.relative_actions is True
    with pytest.raises(CheckpointError, match="use_relative_actions is true.*vla-rt's policy does not.*LeRobot plugin"):
        Pi0Policy(model)
    with pytest.raises(CheckpointError, match="use_relative_actions is true.*vla-rt's server does not"):
        read_model_config(str(path))
    with pytest.raises(CheckpointError, match="use_relative_actions is true.*vla-rt's split expert does not"):
        read_expert_config(str(path))
    with pytest.raises(CheckpointError, match="use_relative_actions is true.*a split-expert file does not"):
        save_expert_file(tmp_path / "expert.safetensors", str(path))
    assert not (tmp_path / "expert.safetensors").exists()
    assert main(["convert", str(path), str(tmp_path / "native.safetensors")]) == 2
    assert "use_relative_actions is true" in capsys.readouterr().err
    assert not (tmp_path / "native.safetensors").exists()
    Pi0Policy(
        load_pi0(str(src), backend="folded", device="cpu", dtype=torch.float32, num_views=1)
    )  # the same, absolute
