"""π0.5's prompt: the task text and the normalised state as PaliGemma tokens, exactly as openpi's tokenizer builds it.

openpi (`models/tokenizer.py`, `PaligemmaTokenizer.tokenize`, reached through `transforms.TokenizePrompt` after
`Normalize` and before `PadStatesAndActions`):
- the text is cleaned: `prompt.strip().replace("_", " ").replace("\\n", " ")`;
- with a state (π0.5, `discrete_state_input=True`, the default for π0.5 configs): the normalised, unpadded state is
  digitised into 256 bins, `np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1` (below -1 gives -1, above 1 gives
  255), the bins joined by spaces, and the text becomes `f"Task: {cleaned}, State: {bins};\\nAction: "`, encoded with
  BOS and nothing after;
- without (π0, or π0.5 configs with `discrete_state_input=False` such as `pi05_libero`): BOS + cleaned text, then
  `"\\n"` encoded on its own;
- padded with id 0 and mask False to `max_len` (200 for π0.5), or truncated to it (openpi logs a warning).

`prompt_token_ids` then `pad_tokens` is openpi's `tokenize(prompt, state)`; `Pi0Policy` checks the length between
them and refuses a prompt that would be cut (the cut drops the state and `Action: `).
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

STATE_BINS = 256
logger = logging.getLogger(__name__)


class SentencePieceLike(Protocol):
    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...


def clean_prompt(prompt: str) -> str:
    return prompt.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: np.ndarray) -> np.ndarray:
    """(s,) normalised state -> (s,) int bins in [-1, 255] with np.digitize's semantics, as openpi."""
    return np.digitize(np.asarray(state), bins=np.linspace(-1, 1, STATE_BINS + 1)[:-1]) - 1


def pi05_text(prompt: str, state: np.ndarray) -> str:
    """The text openpi tokenizes for π0.5 with a discrete state."""
    bins = " ".join(map(str, discretize_state(state)))
    return f"Task: {clean_prompt(prompt)}, State: {bins};\nAction: "


def prompt_token_ids(sp: SentencePieceLike, prompt: str, state: np.ndarray | None) -> list[int]:
    """Token ids before padding: the π0.5 text with the state, or openpi's π0 format without one."""
    if state is not None:
        return list(sp.encode(pi05_text(prompt, state), add_bos=True))
    return list(sp.encode(clean_prompt(prompt), add_bos=True)) + list(sp.encode("\n"))


def pad_tokens(ids: list[int], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (max_len,) int64 padded with 0, mask (max_len,) bool); longer prompts are cut to max_len, as openpi."""
    if len(ids) > max_len:
        logger.warning(
            "prompt: %d tokens exceed the model's %d; truncating (as openpi does). Build the model with a longer "
            "prompt_len if this happens often.",
            len(ids),
            max_len,
        )
        ids = ids[:max_len]
    tokens = np.zeros(max_len, np.int64)
    tokens[: len(ids)] = ids
    return tokens, np.arange(max_len) < len(ids)
