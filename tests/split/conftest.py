"""Fixtures of the split tests (the helpers are in split_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from split_harness import write_checkpoint


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("split") / "tiny56.safetensors")


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    """A small SentencePiece model trained here, for π0.5's text prompt (its state is written into it)."""
    import io

    import sentencepiece as spm

    prompts = ["pick up the red block", "fold the towel", "open the drawer", "put the cup on the plate",
               "do something", "transfer the cube", "stack the bowls", "wipe the table"]  # fmt: skip
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(prompts * 20), model_writer=model, vocab_size=32,
                                   user_defined_symbols=["\n"], add_dummy_prefix=False, minloglevel=2)  # fmt: skip
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path
