"""Tiny π0 / π0.5 checkpoints written by LeRobot itself (its `PI0Policy` / `PI05Policy`, `save_pretrained` and
processor factories), for the plugin's tests.

LeRobot builds its model from fixed sizes: the Gemma variants `gemma_2b` / `gemma_300m`, PaliGemma's 257,152-token
vocabulary, SigLIP So400m and a 2,048-wide projector. A checkpoint that small enough to run on a CPU in a test needs
those sizes shrunk, and nothing else changed: `tiny_lerobot_modules()` swaps, inside LeRobot's π0 and π0.5 modeling
modules only, the variant table and the two transformers model classes for subclasses that shrink the config they
are handed to vla-rt's `tiny` preset dims before building. Every module, forward pass, sampler, queue and processor
is LeRobot's own.

No hub either: PaliGemma's tokenizer name resolves to a small word-level tokenizer written here (every id < the tiny
vocabulary), for both LeRobot's pipelines and the plugin's, which load the same processor files.
"""

from __future__ import annotations

import contextlib
import string
from pathlib import Path

import torch
from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
from lerobot.policies.pi0 import modeling_pi0
from lerobot.policies.pi0.configuration_pi0 import PI0Config
from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors
from lerobot.policies.pi05 import modeling_pi05
from lerobot.policies.pi05.configuration_pi05 import PI05Config
from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
from lerobot.processor import tokenizer_processor

import vla_rt

TINY = vla_rt.preset("tiny")
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
CAMERA = "observation.images.top"
STATE_DIM = ACTION_DIM = 14  # ALOHA's, so LeRobot's own `aloha` env config describes the same robot
IMAGE_HW = (480, 640)  # ALOHA's camera: every frame goes through resize-with-pad to 224
CHUNK, N_ACTION_STEPS = 10, 4  # 9 select_action calls span 3 chunks


def _gemma(module, variant: str):
    g = TINY.llm if variant == "gemma_2b" else TINY.expert
    return module.GemmaConfig(g.width, g.depth, g.mlp_dim, g.num_heads, g.num_kv_heads, g.head_dim)


def _shrink_vlm(config) -> None:
    v, text = TINY.vision, config.text_config
    text.vocab_size = TINY.vocab_size
    if hasattr(config, "_vocab_size"):
        config._vocab_size = TINY.vocab_size
    vision = config.vision_config
    vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads = v.width, v.depth, v.num_heads
    vision.intermediate_size, vision.projection_dim = v.mlp_dim, text.hidden_size


@contextlib.contextmanager
def tiny_lerobot_modules():
    """Within: LeRobot's PI0Policy / PI05Policy build with the tiny dims (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        for module in (modeling_pi0, modeling_pi05):
            vlm_cls, expert_cls = module.PaliGemmaForConditionalGenerationWithPiGemma, module.PiGemmaForCausalLM

            class TinyVlm(vlm_cls):
                def __init__(self, config):
                    _shrink_vlm(config)
                    super().__init__(config)

            class TinyExpert(expert_cls):
                def __init__(self, config, **kwargs):
                    config.vocab_size = TINY.vocab_size
                    super().__init__(config, **kwargs)

            stack.enter_context(_patched(module, "PaliGemmaForConditionalGenerationWithPiGemma", TinyVlm))
            stack.enter_context(_patched(module, "PiGemmaForCausalLM", TinyExpert))
            stack.enter_context(_patched(module, "get_gemma_config", lambda variant, m=module: _gemma(m, variant)))
        yield


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield value
    finally:
        setattr(owner, name, old)


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (BOS first, pad id 0) covering the prompts the tests use, as an HF tokenizer dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", *string.punctuation, *map(str, range(256))]
    words += "pick up the pen place cube in box Task State Action".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    assert len(vocab) < TINY.vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def offline_paligemma_tokenizer(folder: Path):
    """LeRobot's tokenizer step asks transformers for PaliGemma's tokenizer by hub name: answer with `folder`'s."""
    real = tokenizer_processor.AutoTokenizer

    class LocalTokenizers:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            if name != PALIGEMMA_TOKENIZER:
                raise OSError(f"tests know only {PALIGEMMA_TOKENIZER!r} (asked for {name!r})")
            return real.from_pretrained(str(folder), *args, **kwargs)

    with _patched(tokenizer_processor, "AutoTokenizer", LocalTokenizers):
        yield


ALOHA = {"camera": CAMERA, "image_hw": IMAGE_HW, "state_dim": STATE_DIM, "action_dim": ACTION_DIM}
PUSHT = {"camera": "observation.image", "image_hw": (384, 384), "state_dim": 2, "action_dim": 2}  # LeRobot's pusht env


def features(robot: dict = ALOHA) -> tuple[dict, dict]:
    inputs = {
        robot["camera"]: PolicyFeature(type=FeatureType.VISUAL, shape=(3, *robot["image_hw"])),
        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(robot["state_dim"],)),
    }
    return inputs, {"action": PolicyFeature(type=FeatureType.ACTION, shape=(robot["action_dim"],))}


def dataset_stats(seed: int, robot: dict = ALOHA) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, dim in (("observation.state", robot["state_dim"]), ("action", robot["action_dim"])):
        mean, std = torch.randn(dim, generator=g), torch.rand(dim, generator=g) + 0.5
        out[key] = {"mean": mean, "std": std, "min": mean - 3 * std, "max": mean + 3 * std}
        out[key] |= {"q01": mean - 2 * std, "q99": mean + 2 * std, "q10": mean - std, "q90": mean + std}
    return out


def lerobot_policy(pi05: bool, *, chunk: int, n_action_steps: int, seed: int, robot: dict = ALOHA):
    """LeRobot's own PI0Policy / PI05Policy with the tiny dims, every weight perturbed (no zero gate, no unit norm)."""
    cls_config = PI05Config if pi05 else PI0Config
    inputs, outputs = features(robot)
    config = cls_config(
        device="cpu",
        dtype="float32",
        chunk_size=chunk,
        n_action_steps=n_action_steps,
        input_features=inputs,
        output_features=outputs,
        normalization_mapping={
            "VISUAL": NormalizationMode.IDENTITY,
            "STATE": NormalizationMode.QUANTILES if pi05 else NormalizationMode.MEAN_STD,
            "ACTION": NormalizationMode.QUANTILES if pi05 else NormalizationMode.MEAN_STD,
        },
    )
    policy_cls = modeling_pi05.PI05Policy if pi05 else modeling_pi0.PI0Policy
    with tiny_lerobot_modules():
        policy = policy_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # LeRobot zero-initialises norms, gates and biases
    return policy.eval()


def write_lerobot_checkpoint(
    folder: Path, pi05: bool, *, chunk: int, n_action_steps: int, seed: int, robot: dict = ALOHA
):
    """LeRobot's `save_pretrained` of a tiny policy plus its processors (as lerobot-train saves them).

    Must run inside `offline_paligemma_tokenizer`. Returns the in-memory LeRobot policy that wrote the files.
    """
    policy = lerobot_policy(pi05, chunk=chunk, n_action_steps=n_action_steps, seed=seed, robot=robot)
    policy.save_pretrained(folder)
    make = make_pi05_pre_post_processors if pi05 else make_pi0_pre_post_processors
    pre, post = make(policy.config, dataset_stats=dataset_stats(seed, robot))
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    return policy


def parse_eval_cli(args: list[str]):
    """`lerobot-eval ARGS` up to its parsed config: LeRobot's own parser (draccus, `--policy.path` handling)."""
    import sys

    from lerobot.configs import parser
    from lerobot.configs.eval import EvalPipelineConfig

    def parsed(cfg):
        return cfg

    parsed.__annotations__ = {"cfg": EvalPipelineConfig}  # the parser reads the type here (no string annotations)
    parsed = parser.wrap()(parsed)
    argv = sys.argv
    sys.argv = ["lerobot-eval", *args]
    try:
        return parsed()
    finally:
        sys.argv = argv


def observations(n: int, seed: int) -> list[dict]:
    """`n` raw ALOHA-like observations, as lerobot-eval hands them to the pre-processor (batch of 1)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            CAMERA: torch.rand(1, 3, *IMAGE_HW, generator=g),
            "observation.state": torch.randn(1, STATE_DIM, generator=g),
            "task": ["pick up the pen"],
        }
        for _ in range(n)
    ]


def rollout(policy, pre, post, obs: list[dict], seed: int) -> torch.Tensor:
    """select_action over `obs` from a fresh queue, torch seeded first (the noise of every chunk comes from it)."""
    torch.manual_seed(seed)
    policy.reset()
    return torch.stack([post(policy.select_action(pre(dict(o)))) for o in obs])


def use_local_tokenizer(folder: Path, tokenizer: Path) -> None:
    """Points the saved pre-processor's tokenizer step at a local tokenizer dir (what a user without the hub does),
    so a separate process (the real `lerobot-eval`) loads it with no patching."""
    import json

    file = folder / "policy_preprocessor.json"
    pipeline = json.loads(file.read_text())
    steps = [s for s in pipeline["steps"] if s.get("registry_name") == "tokenizer_processor"]
    assert len(steps) == 1, pipeline["steps"]
    steps[0]["config"]["tokenizer_name"] = str(tokenizer)
    file.write_text(json.dumps(pipeline, indent=2))
