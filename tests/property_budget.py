"""What the Hypothesis property suites (tests/test_properties_*.py) share: their budget and the smallest π0 they build.

CI: a fixed number of examples, derandomized (the same examples every run: no flaky CI) and no example database (a
clean clone writes no `.hypothesis/`); the deadline (5 s an example, ~1-30 ms is typical) only catches a hang.
`HYPOTHESIS_PROFILE=explore` draws thousands of fresh examples instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import HealthCheck, settings

from vla_rt.config import GemmaConfig, Pi0Config, VisionConfig

EXPLORE = os.environ.get("HYPOTHESIS_PROFILE") == "explore"


def budget(
    examples: int,
    explore_examples: int = 2000,
    suppress: Sequence[HealthCheck] = (HealthCheck.too_slow, HealthCheck.function_scoped_fixture),
) -> settings:
    return settings(
        max_examples=explore_examples if EXPLORE else examples,
        deadline=5000,
        derandomize=not EXPLORE,
        database=None,
        suppress_health_check=list(suppress),
    )


# One layer everywhere, 28-px views (2 x 2 patches): builds in milliseconds, every code path of the full model.
TINY_PI0 = Pi0Config(
    vision=VisionConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=14, image_size=28),
    llm=GemmaConfig(width=16, depth=1, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=8),
    expert=GemmaConfig(width=16, depth=1, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=8),
    vocab_size=32,
    action_dim=4,
    chunk=4,
    max_token_len=4,
)
