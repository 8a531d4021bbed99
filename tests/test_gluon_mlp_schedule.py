"""The ring protocol of `triton_kernels.gluon_mlp` replayed in Python: the loader's item order and the consumer's
waits and releases, as the kernel issues them, for every config `expert_mlp_applies` accepts, must let both sides
finish. A deadlock here is a hung GPU there (two H200 runs hung before this test existed: 2 activation slots with the
pipelined phase 2, and the loader's earlier order, weight items W_STAGES ahead, with a consumer that releases a step
late). Change the kernel's order and this model together."""

import itertools

import pytest

from vla_rt.triton_kernels.gluon_mlp import BLOCK_K, MlpConfig, ring_why

WIDTH, MLP = 1024, 4096
KT1 = WIDTH // BLOCK_K  # phase-1 K steps (x tiles, gate/up weight items)
KT2 = (MLP // (MLP // WIDTH)) // BLOCK_K  # phase-2 K steps of one split (h tiles); two per down weight item
W_ITEMS = KT1 + KT2 // 2


def loader_order(w_stages: int) -> list[tuple[str, int]]:
    """_mlp_loader: W_STAGES weight items before the PDL wait, then per phase-1 step x tile k and weight item
    k + W_STAGES - 1 (from step 1), then the phase-2 h tiles."""
    order = [("w", n) for n in range(min(w_stages, W_ITEMS))]
    for k in range(KT1):
        order.append(("a", k))
        if k >= 1 and k + w_stages - 1 < W_ITEMS:
            order.append(("w", k + w_stages - 1))
    order += [("a", KT1 + j) for j in range(KT2)]
    return order


def consumer_order(row_scale: bool) -> list[tuple[str, str, int]]:
    """_mlp_consumer: phase 1 releases each step's slots after its MMAs (in-kernel RMS) or a step late (row_scale,
    pipelined); phase 2 takes two h tiles and one weight item an iteration and releases the previous iteration's."""
    order = []
    for k in range(KT1):
        order += [("need", "a", k), ("need", "w", k)]
        if not row_scale:
            order += [("release", "a", k), ("release", "w", k)]
        elif k > 0:
            order += [("release", "a", k - 1), ("release", "w", k - 1)]
    if row_scale:
        order += [("release", "a", KT1 - 1), ("release", "w", KT1 - 1)]
    for i in range(KT2 // 2):
        n0 = KT1 + 2 * i
        order += [("need", "a", n0), ("need", "a", n0 + 1), ("need", "w", KT1 + i)]
        if i > 0:
            order += [("release", "a", n0 - 2), ("release", "a", n0 - 1), ("release", "w", KT1 + i - 1)]
    return order


def run(cfg: MlpConfig, row_scale: bool) -> str | None:
    """None if both sides finish, else where they stuck. A slot's n-th item may be issued once item n - stages
    was released; the consumer may take an item once it was issued."""
    loads, steps = loader_order(cfg.w_stages), consumer_order(row_scale)
    stages = {"a": cfg.a_stages, "w": cfg.w_stages}
    issued: dict[str, set[int]] = {"a": set(), "w": set()}
    released: dict[str, set[int]] = {"a": set(), "w": set()}
    li = ci = 0
    while li < len(loads) or ci < len(steps):
        moved = False
        if li < len(loads):
            ring, n = loads[li]
            if n < stages[ring] or n - stages[ring] in released[ring]:
                issued[ring].add(n)
                li, moved = li + 1, True
        if ci < len(steps):
            what, ring, n = steps[ci]
            if what == "release" or n in issued[ring]:
                (released if what == "release" else issued)[ring].add(n)
                ci, moved = ci + 1, True
        if not moved:
            return f"loader waits at {loads[li] if li < len(loads) else 'end'}, consumer at {steps[ci]}"
    assert issued == {"a": set(range(KT1 + KT2)), "w": set(range(W_ITEMS))}
    return None


CONFIGS = [MlpConfig(w, a) for w, a in itertools.product(range(1, W_ITEMS + 1), range(1, KT1 + 1))]


@pytest.mark.parametrize("row_scale", [False, True])
def test_every_accepted_ring_config_finishes(row_scale):
    ok = [cfg for cfg in CONFIGS if ring_why(cfg, WIDTH, MLP) is None]  # what expert_mlp_applies lets through
    assert MlpConfig() in ok and len(ok) > 50
    stuck = {(c.w_stages, c.a_stages): run(c, row_scale) for c in ok}
    assert not {k: v for k, v in stuck.items() if v}


def test_the_model_finds_deadlocks_and_the_bounds_refuse_them():
    """The check can fail: 2 activation slots (what hung on the H200) and too few weight slots for every down item
    stick in the model, and ring_why refuses both."""
    for cfg, row_scale in ((MlpConfig(20, 2), False), (MlpConfig(8, 12), True)):
        assert run(cfg, row_scale) is not None
        assert ring_why(cfg, WIDTH, MLP) is not None
