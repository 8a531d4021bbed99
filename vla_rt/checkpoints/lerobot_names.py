"""LeRobot π0 / π0.5 state-dict keys <-> canonical names (a pure renaming: every tensor keeps its layout).

LeRobot's `PI0Policy` wraps `PI0Pytorch` (`model.`), whose `paligemma_with_expert` holds a transformers
`PaliGemmaForConditionalGeneration` (SigLIP vision tower, projector, Gemma LM) and a `GemmaForCausalLM` action expert.
The HF modules already use vla-rt's conventions: `nn.Linear` (out, in), separate q/k/v projections with heads
major, a conv patch embedding (OIHW), Gemma RMSNorm as `(1 + weight)` (LeRobot's `PiGemmaRMSNorm`, zeros at init)
and half-split RoPE; so no tensor is transposed or permuted.

Keys are read in every layout LeRobot has written and normalised to the one its hub checkpoints use
(`model.paligemma_with_expert.paligemma.model.vision_tower.vision_model...`):
- with or without the leading `model.` (LeRobot's `from_pretrained` adds it when missing);
- transformers < 4.52 nesting (`paligemma.language_model.model.`, `paligemma.vision_tower.`, ...);
- transformers >= 5 SigLIP without the `vision_model.` level;
- `time_mlp_in/out` for `action_time_mlp_in/out` in π0 files (LeRobot renames these itself).

π0.5 (LeRobot's `pi05` policy, `policies/pi05/modeling_pi05.py` + `policies/pi_gemma.py` in LeRobot 0.6.1): the
action expert is a `PiGemmaForCausalLM` whose `PiGemmaRMSNorm`s have `cond_dim` set, so instead of `weight` each
holds `dense` = `nn.Linear(cond_dim, 3W)`: `...gemma_expert.model.layers.{i}.input_layernorm.dense.{weight,bias}`,
`post_attention_layernorm.dense.*` and `...gemma_expert.model.norm.dense.*`, whose output is chunked into
(scale, shift, gate) as openpi's split; the heads are `model.time_mlp_in/out` (their real names there, W → W) with
no `state_proj` and no `action_time_mlp_*`. The PaliGemma LM's norms stay plain `weight`s.
"""

from __future__ import annotations

import re

from vla_rt.model.weights import param_shapes

PWE = "model.paligemma_with_expert."
PG = PWE + "paligemma."
VISION = PG + "model.vision_tower.vision_model."
LM = PG + "model.language_model."
EXPERT = PWE + "gemma_expert.model."

# The embedding table is tied to PaliGemma's LM head; safetensors drops tied duplicates when LeRobot saves, and the
# hub checkpoints keep only the lm_head name. Either name is accepted as the embedding table.
LM_HEAD = PG + "lm_head.weight"
# The action expert's LM head: LeRobot deletes the expert's embedding but its tied head stays a parameter. π0 never
# computes logits from the expert, so it is ignored (its shape is still checked).
EXPERT_LM_HEAD = PWE + "gemma_expert.lm_head.weight"
# Rotary frequency buffers some transformers versions saved; recomputed from positions, so ignored.
IGNORED_PATTERNS = (re.compile(r".*\.rotary_emb\.inv_freq$"),)
# Pre-processor-era LeRobot kept normalisation buffers in model.safetensors; they become norm stats.
NORM_BUFFER_PREFIXES = ("normalize_inputs.", "normalize_targets.", "unnormalize_outputs.")

_ALIASES = (
    (re.compile(r"^model\.paligemma_with_expert\.paligemma\.language_model\.model\."), LM),
    (re.compile(r"^model\.paligemma_with_expert\.paligemma\.language_model\.lm_head\."), PG + "lm_head."),
    (
        re.compile(r"^model\.paligemma_with_expert\.paligemma\.(vision_tower|multi_modal_projector)\."),
        PG + r"model.\1.",
    ),
    (
        re.compile(r"^(model\.paligemma_with_expert\.paligemma\.model\.vision_tower\.)(?!vision_model\.)"),
        r"\1vision_model.",
    ),
)
# π0 files where LeRobot renamed the action-time MLP; in π0.5 files `time_mlp_in/out` is the time MLP itself.
_PI0_TIME_MLP_ALIAS = (re.compile(r"^model\.time_mlp_(in|out)\."), r"model.action_time_mlp_\1.")


# A π0.5 file: its expert's norms hold a modulation Dense (π0's hold a `weight`).
PI05_NORM_MARKER = ".input_layernorm.dense."


def is_pi05_file(keys) -> bool:
    return any(PI05_NORM_MARKER in k for k in keys)


def normalize_key(key: str, pi05: bool = False) -> str:
    """A raw LeRobot key in the hub layout (see module docstring); π0.5 keeps `time_mlp_in/out` as they are."""
    if not key.startswith("model."):
        key = "model." + key
    for pattern, repl in _ALIASES if pi05 else (*_ALIASES, _PI0_TIME_MLP_ALIAS):
        key = pattern.sub(repl, key)
    return key


def _gemma_pairs(canon: str, hf: str) -> list[tuple[str, str]]:
    layer = [
        ("attn_norm.scale", "input_layernorm.weight"),
        ("q_proj.weight", "self_attn.q_proj.weight"),
        ("k_proj.weight", "self_attn.k_proj.weight"),
        ("v_proj.weight", "self_attn.v_proj.weight"),
        ("o_proj.weight", "self_attn.o_proj.weight"),
        ("ffn_norm.scale", "post_attention_layernorm.weight"),
        ("gate_proj.weight", "mlp.gate_proj.weight"),
        ("up_proj.weight", "mlp.up_proj.weight"),
        ("down_proj.weight", "mlp.down_proj.weight"),
    ]
    for part in ("weight", "bias"):  # π0.5's adaptive norms (only the action expert has them)
        layer += [
            (f"attn_norm.dense.{part}", f"input_layernorm.dense.{part}"),
            (f"ffn_norm.dense.{part}", f"post_attention_layernorm.dense.{part}"),
        ]
    pairs = [(f"{canon}.layers.{{i}}.{c}", f"{hf}layers.{{i}}.{h}") for c, h in layer]
    pairs += [(f"{canon}.final_norm.dense.{p}", f"{hf}norm.dense.{p}") for p in ("weight", "bias")]
    return pairs + [(f"{canon}.final_norm.scale", f"{hf}norm.weight")]


def _pairs() -> list[tuple[str, str]]:
    """(canonical, LeRobot) name templates; `{i}` is a layer index."""
    enc = VISION + "encoder.layers.{i}."
    pairs = [
        ("vision.patch_embed.weight", VISION + "embeddings.patch_embedding.weight"),
        ("vision.patch_embed.bias", VISION + "embeddings.patch_embedding.bias"),
        ("vision.pos_embed", VISION + "embeddings.position_embedding.weight"),
    ]
    block = [("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]
    block += [(f"attn.{p}", f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    for canon, hf in block:
        for part in ("weight", "bias"):
            pairs.append((f"vision.blocks.{{i}}.{canon}.{part}", f"{enc}{hf}.{part}"))
    pairs += [
        ("vision.final_norm.weight", VISION + "post_layernorm.weight"),
        ("vision.final_norm.bias", VISION + "post_layernorm.bias"),
        ("projector.weight", PG + "model.multi_modal_projector.linear.weight"),
        ("projector.bias", PG + "model.multi_modal_projector.linear.bias"),
        ("llm.embed_tokens.weight", LM + "embed_tokens.weight"),
    ]
    pairs += _gemma_pairs("llm", LM) + _gemma_pairs("expert", EXPERT)
    heads = ("state_proj", "action_in_proj", "action_time_mlp_in", "action_time_mlp_out", "action_out_proj")
    for head in heads + ("time_mlp_in", "time_mlp_out"):
        pairs += [(f"{head}.weight", f"model.{head}.weight"), (f"{head}.bias", f"model.{head}.bias")]
    return pairs


def _regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_PAIRS = _pairs()
_TO_CANONICAL = [(_regex(lr), canon) for canon, lr in _PAIRS]
_TO_LEROBOT = [(_regex(canon), lr) for canon, lr in _PAIRS]


def _translate(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.format(i=m.group(1)) if m.groups() else template
    return None


def to_canonical(key: str) -> str | None:
    """Canonical name of a normalised LeRobot key, or None when it is not a π0 / π0.5 weight."""
    return _translate(key, _TO_CANONICAL)


def to_lerobot(name: str) -> str:
    lr = _translate(name, _TO_LEROBOT)
    if lr is None:
        raise KeyError(f"no LeRobot name for canonical tensor {name!r}")
    return lr


def lerobot_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every π0 / π0.5 weight LeRobot stores, by its LeRobot key (the embedding under its `embed_tokens` name)."""
    return {to_lerobot(name): shape for name, shape in param_shapes(cfg).items()}


def is_ignored(key: str) -> bool:
    return key == EXPERT_LM_HEAD or any(p.match(key) for p in IGNORED_PATTERNS)
