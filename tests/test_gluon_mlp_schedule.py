"""The ring protocol of `triton_kernels.gluon_mlp` replayed in Python: the loader's item order and the consumer's
waits and releases, as the kernel issues them, for every config `expert_mlp_applies` accepts, must let both sides
finish, with and without the O projection's phase 0. A deadlock here is a hung GPU there (two H200 runs hung before this test existed: 2 activation slots with the
pipelined phase 2, and the loader's earlier order, weight items W_STAGES ahead, with a consumer that releases a step
late). Change the kernel's order and this model together."""

import itertools

import pytest

from vla_rt.triton_kernels.gluon_mlp import BLOCK_K, MlpConfig, ring_why

WIDTH, MLP, K_O = 1024, 4096, 2048
SPLITS = MLP // WIDTH
KT1 = WIDTH // BLOCK_K  # phase-1 K steps (x tiles, gate/up weight items)
KT2 = (MLP // SPLITS) // BLOCK_K  # phase-2 K steps of one split (h tiles); two per down weight item
KT0 = (K_O // SPLITS) // BLOCK_K  # phase-0 K steps of one split (attn tiles); two per O weight item


def loader_order(w_stages: int, kt0: int) -> list[tuple[str, int]]:
    """_mlp_loader: W_STAGES weight items before the PDL wait; phase 0 (kt0 > 0): per step i attn tiles 2i, 2i + 1
    and weight item i + W_STAGES - 1 (from step 1), then item WO + W_STAGES - 1 (x's tiles wait for phase 0's
    stores, which the model takes as done); per phase-1 step x tile k and weight item WO + k + W_STAGES - 1 (from
    step 1); then the phase-2 h tiles."""
    wo = kt0 // 2
    w_items = wo + KT1 + KT2 // 2
    order = [("w", n) for n in range(min(w_stages, w_items))]
    for i in range(wo):
        order += [("a", 2 * i), ("a", 2 * i + 1)]
        if i >= 1 and i + w_stages - 1 < w_items:
            order.append(("w", i + w_stages - 1))
    if wo and wo + w_stages - 1 < w_items:
        order.append(("w", wo + w_stages - 1))
    for k in range(KT1):
        order.append(("a", kt0 + k))
        if k >= 1 and wo + k + w_stages - 1 < w_items:
            order.append(("w", wo + k + w_stages - 1))
    order += [("a", kt0 + KT1 + j) for j in range(KT2)]
    return order


def _pair_steps(a0: int, w0: int, steps: int) -> list[tuple[str, str, int]]:
    """_pair_steps: two tiles and one weight item a step, the previous step's released after, the last at the end."""
    order = []
    for i in range(steps):
        n0 = a0 + 2 * i
        order += [("need", "a", n0), ("need", "a", n0 + 1), ("need", "w", w0 + i)]
        if i > 0:
            order += [("release", "a", n0 - 2), ("release", "a", n0 - 1), ("release", "w", w0 + i - 1)]
    last = a0 + 2 * steps - 2
    return order + [("release", "a", last), ("release", "a", last + 1), ("release", "w", w0 + steps - 1)]


def consumer_order(row_scale: bool, kt0: int) -> list[tuple[str, str, int]]:
    """_mlp_consumer: phase 0 as _pair_steps; phase 1 releases each step's slots after its MMAs (in-kernel RMS) or
    a step late (row_scale, pipelined); phase 2 as _pair_steps."""
    wo = kt0 // 2
    order = _pair_steps(0, 0, wo) if wo else []
    for k in range(KT1):
        order += [("need", "a", kt0 + k), ("need", "w", wo + k)]
        if not row_scale:
            order += [("release", "a", kt0 + k), ("release", "w", wo + k)]
        elif k > 0:
            order += [("release", "a", kt0 + k - 1), ("release", "w", wo + k - 1)]
    if row_scale:
        order += [("release", "a", kt0 + KT1 - 1), ("release", "w", wo + KT1 - 1)]
    return order + _pair_steps(kt0 + KT1, wo + KT1, KT2 // 2)


def run(cfg: MlpConfig, row_scale: bool, kt0: int = 0) -> str | None:
    """None if both sides finish, else where they stuck. A slot's n-th item may be issued once item n - stages
    was released; the consumer may take an item once it was issued."""
    loads, steps = loader_order(cfg.w_stages, kt0), consumer_order(row_scale, kt0)
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
    assert issued == {"a": set(range(kt0 + KT1 + KT2)), "w": set(range(kt0 // 2 + KT1 + KT2 // 2))}
    return None


CONFIGS = [MlpConfig(w, a) for w, a in itertools.product(range(1, 40), range(1, KT1 + 1))]


@pytest.mark.parametrize("row_scale,k_o", [(False, 0), (True, 0), (False, K_O)])
def test_every_accepted_ring_config_finishes(row_scale, k_o):
    # what expert_mlp_applies lets through (with the O projection: only the RMS factor summed in-kernel)
    ok = [cfg for cfg in CONFIGS if ring_why(cfg, WIDTH, MLP, k_o=k_o) is None]
    assert MlpConfig() in ok and len(ok) > 50
    kt0 = KT0 if k_o else 0
    stuck = {(c.w_stages, c.a_stages): run(c, row_scale, kt0) for c in ok}
    assert not {k: v for k, v in stuck.items() if v}


def test_the_model_finds_deadlocks_and_the_bounds_refuse_them():
    """The check can fail: 2 activation slots (what hung on the H200) and too few weight slots for every down item
    stick in the model, and ring_why refuses both."""
    for cfg, row_scale in ((MlpConfig(20, 2), False), (MlpConfig(8, 12), True)):
        assert run(cfg, row_scale) is not None
        assert ring_why(cfg, WIDTH, MLP) is not None
    assert run(MlpConfig(12, 3), False, KT0) is not None  # phase 0 holds two steps' two attn tiles
