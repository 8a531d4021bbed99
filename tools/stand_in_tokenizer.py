"""A stand-in SentencePiece tokenizer, trained here, for serving or load-testing a random π0.5 checkpoint.

Why: a π0.5 reads the robot's state from its text prompt, so `vla-rt serve` refuses a π0.5 checkpoint without
`--tokenizer` (it could answer no request). openpi's checkpoints come with PaliGemma's tokenizer; `random:pi05` and
the GPU machine (no network) have none. This one is trained on robot instructions and the digits the state prompt is
written in, with "\\n" a symbol of its own as in PaliGemma's vocabulary, so a prompt's token count is realistic
(a few tokens a word, one or two a state value). Its ids are not PaliGemma's: use it for timing, never for a real
checkpoint's actions.

    python tools/stand_in_tokenizer.py .tok/tokenizer.model [--vocab 512]
    vla-rt loadtest random:pi05 --tokenizer .tok/tokenizer.model ...
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

INSTRUCTIONS = [
    "pick up the red cup and put it in the sink",
    "fold the towel on the table",
    "open the top drawer",
    "catch the pen",
    "wipe the counter with the sponge",
    "put the apple in the bowl",
    "close the laptop lid",
    "stack the blocks by colour",
    "Task: , State: ; Action: ",
]


def sentences() -> list[str]:
    """Instructions, and state prompts of the shape `vla_rt.prompt` writes (256 bins as integers)."""
    states = [" ".join(str((7 * i + 31 * j) % 256) for j in range(8)) for i in range(64)]
    return [*INSTRUCTIONS * 8, *(f"Task: {t}, State: {s};\nAction: " for t, s in zip(INSTRUCTIONS * 8, states))]


def train(path: Path, vocab: int) -> Path:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences()), model_writer=model, vocab_size=vocab,
                                   user_defined_symbols=["\n"], add_dummy_prefix=False, hard_vocab_limit=False,
                                   minloglevel=2)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .model file to write")
    ap.add_argument("--vocab", type=int, default=512, help="at most this many pieces (fewer if the text has fewer)")
    args = ap.parse_args()
    print(f"wrote {train(args.out, args.vocab)}")


if __name__ == "__main__":
    main()
