"""Fixtures of the LeRobot plugin tests: tiny π0 and π0.5 checkpoints written by LeRobot itself.

These tests need LeRobot (Python >= 3.12) and the plugin installed; `.ci/run` runs them in a venv of their own.
Where LeRobot is missing, each module skips itself (`pytest.importorskip`), so nothing here imports it at the top.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"pi0" | "pi05": (LeRobot's in-memory policy, the dir it wrote)}, with the offline tokenizer in place."""
    import lerobot_tiny as lt

    root = tmp_path_factory.mktemp("lerobot_ckpts")
    tokenizer = lt.write_tokenizer(root / "tokenizer")
    with lt.offline_paligemma_tokenizer(tokenizer):
        out = {}
        for name, pi05, seed in (("pi0", False, 1), ("pi05", True, 2)):
            policy = lt.write_lerobot_checkpoint(
                root / name, pi05, chunk=lt.CHUNK, n_action_steps=lt.N_ACTION_STEPS, seed=seed
            )
            out[name] = (policy, root / name)
        yield out
