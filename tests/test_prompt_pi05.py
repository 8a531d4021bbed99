"""π0.5's prompt: the state written into the text exactly as openpi's `PaligemmaTokenizer.tokenize`, with a tiny
SentencePiece model trained here (nothing is downloaded), and the policy running a π0.5 checkpoint end to end."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from vla_rt import Pi0Policy, build_pi0, preset, prompt
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.model import random_weights

spm = pytest.importorskip("sentencepiece")

CFG = preset("tiny_pi05").replace(chunk=6)
STATS = {
    "state": NormStats(mean=[0.0, 0.0, 0.0], std=[1.0, 1.0, 1.0], q01=[-2.0, 0.0, 10.0], q99=[2.0, 1.0, 30.0]),
    "actions": NormStats(mean=[0.0] * 4, std=[1.0] * 4, q01=[-1.0] * 4, q99=[3.0] * 4),
}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    """A tiny SentencePiece model over prompt-like text (digits, 'Task:', 'State:', 'Action:')."""
    rng = np.random.default_rng(0)
    tasks = ["pick up the pen", "open the drawer", "catch the falling pen", "put the cup on the plate"]
    lines = [
        f"Task: {tasks[i % 4]}, State: {' '.join(map(str, rng.integers(-1, 256, 8)))};\nAction: " for i in range(400)
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=200, hard_vocab_limit=False,
        character_coverage=1.0, model_type="unigram", bos_id=1, eos_id=2, pad_id=0, unk_id=3,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("sp") / "tiny.model"
    path.write_bytes(model.getvalue())
    return str(path)


def test_state_bins_follow_np_digitize_semantics() -> None:
    state = np.array([-1.5, -1.0, -0.99, 0.0, 0.5, 0.999, 1.0, 2.0])
    assert prompt.discretize_state(state).tolist() == [-1, 0, 1, 128, 192, 255, 255, 255]


def test_text_format_is_openpis() -> None:
    text = prompt.pi05_text("  pick_up the\npen ", np.array([0.0, 0.5, -1.2]))
    assert text == "Task: pick up the pen, State: 128 192 -1;\nAction: "


def test_tokenize_bos_no_newline_token_padding_and_truncation(sp_model) -> None:
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    state = np.array([0.1, -0.4])
    tokens, mask = prompt.pad_tokens(prompt.prompt_token_ids(sp, "open_the drawer", state), 200)
    expected = [sp.bos_id()] + sp.encode("Task: open the drawer, State: 140 76;\nAction: ")
    assert tokens.shape == mask.shape == (200,) and tokens.dtype == np.int64
    assert tokens[: len(expected)].tolist() == expected and mask.sum() == len(expected)
    assert not tokens[len(expected) :].any() and not mask[len(expected) :].any()
    short, short_mask = prompt.pad_tokens(prompt.prompt_token_ids(sp, "open_the drawer", state), 5)
    assert short.tolist() == expected[:5] and short_mask.all()
    # without a state (π0, or discrete_state_input=False): BOS + cleaned text, then "\n" encoded on its own
    plain, _ = prompt.pad_tokens(prompt.prompt_token_ids(sp, "open_the drawer", None), 50)
    ids = [sp.bos_id()] + sp.encode("open the drawer") + sp.encode("\n")
    assert plain[: len(ids)].tolist() == ids


@pytest.fixture(scope="module")
def model():
    weights = random_weights(CFG, seed=7)
    return build_pi0(weights, CFG, norm_stats=STATS)


def _obs(state, noise, prompt_text="pick up the pen"):
    rng = np.random.default_rng(1)
    return {
        "images": {"base_0_rgb": rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)},
        "state": state,
        "prompt": prompt_text,
        "noise": noise,
    }


def test_policy_builds_the_prompt_from_the_quantile_normalised_state(model, sp_model) -> None:
    policy = Pi0Policy(model, camera_names=["base_0_rgb"], tokenizer=sp_model, action_dim=4, num_steps=2)
    assert policy.discrete_state_input and policy._use_quantiles  # π0.5 defaults: openpi's
    noise = np.random.default_rng(2).standard_normal((CFG.chunk, CFG.action_dim)).astype(np.float32)
    raw = np.array([1.0, 0.25, 40.0])
    out = policy.infer(_obs(raw, noise))["actions"]

    # the same by hand: quantile-normalise, digitise, openpi's text, BOS, pad to 200 (the model's prompt length)
    q01, q99 = np.array([-2.0, 0.0, 10.0]), np.array([2.0, 1.0, 30.0])
    normalized = (raw - q01) / (q99 - q01 + 1e-6) * 2 - 1  # [0.5, -0.5, 2.0]
    bins = np.digitize(normalized, np.linspace(-1, 1, 257)[:-1]) - 1
    assert bins.tolist() == [191, 63, 255]  # the +1e-6 puts 0.5 and -0.5 just below their bin edges
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    ids = [sp.bos_id()] + sp.encode(f"Task: pick up the pen, State: {' '.join(map(str, bins))};\nAction: ")
    tokens = torch.zeros(1, 200, dtype=torch.long)
    tokens[0, : len(ids)] = torch.tensor(ids)
    mask = torch.arange(200)[None] < len(ids)
    x = policy.prepare(_obs(raw, noise))
    assert torch.equal(x.tokens, tokens) and torch.equal(x.token_mask, mask)
    images = x.images
    state = torch.zeros(1, CFG.action_dim)
    state[0, :3] = torch.tensor(normalized, dtype=torch.float32)
    direct = model.sample_actions(images, state, tokens, torch.from_numpy(noise)[None], 2, token_mask=mask)
    expected = STATS["actions"].unnormalize(direct[0].numpy(), use_quantiles=True)[:, :4]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_the_state_reaches_the_model_only_through_the_prompt(model, sp_model) -> None:
    noise = np.random.default_rng(3).standard_normal((CFG.chunk, CFG.action_dim)).astype(np.float32)
    a, b = np.array([0.0, 0.5, 20.0]), np.array([1.5, 0.9, 12.0])
    with_state = Pi0Policy(model, camera_names=["base_0_rgb"], tokenizer=sp_model)
    assert not np.allclose(with_state.infer(_obs(a, noise))["actions"], with_state.infer(_obs(b, noise))["actions"])
    without = Pi0Policy(model, camera_names=["base_0_rgb"], tokenizer=sp_model, discrete_state_input=False)
    np.testing.assert_array_equal(without.infer(_obs(a, noise))["actions"], without.infer(_obs(b, noise))["actions"])


def test_bad_prompts_are_named(model, sp_model) -> None:
    policy = Pi0Policy(model, camera_names=["base_0_rgb"], tokenizer=sp_model)
    obs = _obs(np.zeros(3), None)
    del obs["prompt"]
    with pytest.raises(ValueError, match="π0.5 needs a text prompt"):
        policy.infer(obs)
    with pytest.raises(ValueError, match="needs a SentencePiece tokenizer"):
        Pi0Policy(model, camera_names=["base_0_rgb"]).infer(_obs(np.zeros(3), None))
    pi0 = build_pi0(random_weights(preset("tiny"), seed=1), preset("tiny"))
    with pytest.raises(
        ValueError, match=r"discrete_state_input: expected None or False for π0 \(it takes the state as"
    ):
        Pi0Policy(pi0, discrete_state_input=True)


def test_fixed_prompt_tokens_are_refused_when_the_state_goes_into_the_prompt(model, sp_model) -> None:
    obs = _obs(np.zeros(3), None)
    obs["prompt_tokens"] = np.array([1, 5, 6])
    with pytest.raises(ValueError, match=r"prompt_tokens: expected none \(a π0.5 policy with discrete_state_input"):
        Pi0Policy(model, camera_names=["base_0_rgb"], tokenizer=sp_model).prepare(obs)
    with pytest.raises(ValueError, match="obs: expected one of 'prompt' and 'prompt_tokens'"):  # one would be ignored
        Pi0Policy(model, camera_names=["base_0_rgb"], discrete_state_input=False).prepare(obs)
    del obs["prompt"]
    x = Pi0Policy(model, camera_names=["base_0_rgb"], discrete_state_input=False).prepare(obs)
    assert x.tokens[0, :3].tolist() == [1, 5, 6] and int(x.token_mask.sum()) == 3


def test_the_runtime_passes_a_text_prompt_to_the_policy() -> None:
    """The runtime's inference loop hands the policy the text, so a π0.5 policy re-tokenizes it with each state."""
    import threading

    from vla_rt.clock import SimClock
    from vla_rt.runtime.events import EventLog
    from vla_rt.runtime.inference_thread import InferenceLoop
    from vla_rt.runtime.ring import TimestampedRing

    clock = SimClock()
    ring = TimestampedRing(4, clock, "frames/cam")
    loop = InferenceLoop(
        None, {"cam": ring}, TimestampedRing(4, clock, "actions"), [("cam", 0)], lambda: np.zeros(1), EventLog(None, clock),
        clock, threading.Event(), dt_action_s=0.02, time_origin="inference_done", time_offset_s=0.0,
        frame_wait_timeout_s=1.0, prompt="catch the pen",
    )  # fmt: skip

    class Frame:
        image = np.zeros((4, 4, 3), np.uint8)

    class Item:
        value, seq = Frame(), 0

    obs = loop._observation(Item())
    assert obs["prompt"] == "catch the pen" and "prompt_tokens" not in obs
