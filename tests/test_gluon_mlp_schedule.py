"""The ring protocol of `triton_kernels.gluon_mlp` replayed in Python: the loader's item order and the consumer's
waits and releases, as the kernel issues them, for every config `expert_mlp_applies` accepts, must let both sides
finish, with and without the O projection's phase 0, for one layer and for several in one launch. A deadlock here is a hung GPU there (two H200 runs hung before this test existed: 2 activation slots with the
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


def loader_order(w_stages: int, kt0: int, layers: int = 1) -> list[tuple[str, int]]:
    """_mlp_loader: W_STAGES weight items before the PDL wait; then per layer (items numbered on across layers),
    for each consumer step that takes weight item w, item w + W_STAGES - 1 (none past the last): after the step's
    activation tiles, or for a phase's first step before the phase's wait for other programs (which the model takes
    as met). Phase 0 (kt0 > 0): per step i attn tiles 2i, 2i + 1; phase 1: x tile k; phase 2: h tiles 2i, 2i + 1."""
    wo = kt0 // 2
    w_items, a_items = wo + KT1 + KT2 // 2, kt0 + KT1 + KT2
    total = layers * w_items
    order = [("w", n) for n in range(min(w_stages, total))]

    def successor(w: int) -> None:
        if w + w_stages - 1 < total:
            order.append(("w", w + w_stages - 1))

    for layer in range(layers):
        bw, ba = layer * w_items, layer * a_items
        if layer:
            successor(bw)
        for i in range(wo):
            order += [("a", ba + 2 * i), ("a", ba + 2 * i + 1)]
            if i >= 1:
                successor(bw + i)
        if wo:
            successor(bw + wo)
        for k in range(KT1):
            order.append(("a", ba + kt0 + k))
            if k >= 1:
                successor(bw + wo + k)
        successor(bw + wo + KT1)
        for j in range(KT2):
            order.append(("a", ba + kt0 + KT1 + j))
            if j % 2 and j >= 3:
                successor(bw + wo + KT1 + j // 2)
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


def consumer_order(row_scale: bool, kt0: int, layers: int = 1) -> list[tuple[str, str, int]]:
    """_mlp_consumer, per layer: phase 0 as _pair_steps; phase 1 releases each step's slots after its MMAs
    (in-kernel RMS) or a step late (row_scale, pipelined); phase 2 as _pair_steps."""
    wo = kt0 // 2
    w_items, a_items = wo + KT1 + KT2 // 2, kt0 + KT1 + KT2
    order = []
    for layer in range(layers):
        bw, ba = layer * w_items, layer * a_items
        order += _pair_steps(ba, bw, wo) if wo else []
        a1, w1 = ba + kt0, bw + wo
        for k in range(KT1):
            order += [("need", "a", a1 + k), ("need", "w", w1 + k)]
            if not row_scale:
                order += [("release", "a", a1 + k), ("release", "w", w1 + k)]
            elif k > 0:
                order += [("release", "a", a1 + k - 1), ("release", "w", w1 + k - 1)]
        if row_scale:
            order += [("release", "a", a1 + KT1 - 1), ("release", "w", w1 + KT1 - 1)]
        order += _pair_steps(a1 + KT1, w1 + KT1, KT2 // 2)
    return order


def run(cfg: MlpConfig, row_scale: bool, kt0: int = 0, layers: int = 1) -> str | None:
    """None if both sides finish, else where they stuck. A slot's n-th item may be issued once item n - stages
    was released; the consumer may take an item once it was issued."""
    loads, steps = loader_order(cfg.w_stages, kt0, layers), consumer_order(row_scale, kt0, layers)
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
    assert issued == {
        "a": set(range(layers * (kt0 + KT1 + KT2))),
        "w": set(range(layers * (kt0 // 2 + KT1 + KT2 // 2))),
    }
    return None


CONFIGS = [MlpConfig(w, a) for w, a in itertools.product(range(1, 40), range(1, KT1 + 1))]


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("row_scale,k_o", [(False, 0), (True, 0), (False, K_O)])
def test_every_accepted_ring_config_finishes(row_scale, k_o, layers):
    # what expert_mlp_applies lets through (with the O projection: only the RMS factor summed in-kernel)
    ok = [cfg for cfg in CONFIGS if ring_why(cfg, WIDTH, MLP, k_o=k_o) is None]
    assert MlpConfig() in ok and len(ok) > 50
    kt0 = KT0 if k_o else 0
    stuck = {(c.w_stages, c.a_stages): run(c, row_scale, kt0, layers) for c in ok}
    assert not {k: v for k, v in stuck.items() if v}


def test_the_model_finds_deadlocks_and_the_bounds_refuse_them():
    """The check can fail: 2 activation slots (what hung on the H200) and a 1-slot weight ring stick in the model,
    and ring_why refuses both."""
    for cfg, row_scale in ((MlpConfig(20, 2), False), (MlpConfig(1, 12), True)):
        assert run(cfg, row_scale) is not None
        assert ring_why(cfg, WIDTH, MLP) is not None
    assert run(MlpConfig(12, 3), False, KT0) is not None  # phase 0 holds two steps' two attn tiles
    assert run(MlpConfig(12, 3), False, KT0, layers=3) is not None
