"""The static engine's plan (buffers, strides, masks, RoPE rows, KV-cache offsets) against the reference.

The plan runs on two kernel sets with one contract: PyTorch ops (fast, checks the wiring) and the Triton kernels
(in Triton's CPU interpreter here; bf16 on the GPU in tests/test_gpu.py). Both must match the eager reference in
float32 on fresh random inputs with masked views and padded prompts.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from vla_rt import preset
from vla_rt.engine.static_engine import StaticPi0Engine, build_graphed_torch, build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import BuiltShapes, check_model_inputs
from vla_rt.model import random_weights

TOL = 1e-5


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _case(seed: int, b: int, v: int, p: int, h: int):
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(seed)
    x = dict(
        images=torch.rand(b, v, 224, 224, 3, generator=g) * 2 - 1,
        state=torch.randn(b, cfg.action_dim, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (b, p), generator=g),
        noise=torch.randn(b, h, cfg.action_dim, generator=g),
        image_masks=torch.rand(b, v, generator=g) > 0.3,
        token_mask=torch.arange(p)[None].expand(b, -1) < torch.randint(1, p + 1, (b, 1), generator=g),
    )
    x["image_masks"][:, 0] = True  # at least one view present
    return cfg, random_weights(cfg, seed=seed), x


def _reference(cfg, weights, x, steps):
    ref = build_pi0(weights, cfg)
    return ref.sample_actions(x["images"], x["state"], x["tokens"], x["noise"], steps,
                              image_masks=x["image_masks"], token_mask=x["token_mask"])  # fmt: skip


def test_prompt_changes_between_calls_without_rebuild() -> None:
    cfg, weights, x = _case(seed=12, b=1, v=1, p=4, h=5)
    shapes = BuiltShapes(1, 5, 4, 1)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    for tokens, mask in ((x["tokens"], x["token_mask"]), (x["tokens"].flip(1), torch.ones(1, 4, dtype=torch.bool))):
        y = dict(x, tokens=tokens, token_mask=mask)
        inputs = check_model_inputs(cfg, shapes, y["images"], y["state"], tokens, y["noise"], y["image_masks"], mask)
        assert rel_err(engine(inputs, y["noise"], 10), _reference(cfg, weights, y, 10)) <= TOL


def test_step_count_is_part_of_the_plan() -> None:
    cfg, weights, x = _case(seed=13, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"])
    with pytest.raises(ValueError, match="num_steps: expected 10"):
        engine(inputs, x["noise"], 5)


def test_triton_kernel_plan_matches_reference_in_interpreter() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, weights, x = _case(seed=14, b=1, v=2, p=3, h=5)
    x["image_masks"] = torch.tensor([[False, True]])  # first view missing: positions must skip its tokens
    shapes = BuiltShapes(2, 5, 3, 1)
    engine = build_triton(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes, num_steps=2)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 2), _reference(cfg, weights, x, 2)) <= TOL


# ----------------------------------------------------------------------------------- opt-in kernel fusions


class CountingKernels:
    """A kernel set that counts launches per kernel and forwards to another set."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, {}

    def __getattr__(self, kernel):
        fn = getattr(self.inner, kernel)

        def call(*args, **kwargs):
            self.calls[kernel] = self.calls.get(kernel, 0) + 1
            return fn(*args, **kwargs)

        return call


@pytest.mark.parametrize(
    "flags",
    [dict(), dict(fuse_rms=True, fuse_rope=True), dict(fuse_rms="expert"), dict(fuse_rope="vlm"),
     dict(fuse_rms="vlm", fuse_rope=("expert",)), dict(rms_partials=True, fuse_rope="expert"),
     dict(rms_partials="vlm", fuse_rms="expert"), dict(combine_rms=True, fuse_rope="expert"),
     dict(combine_rms=True, rms_partials="expert"), dict(l2_prefetch=True, combine_rms=True, fuse_rope="expert"),
     dict(expert_layer=True, combine_rms="vlm"), dict(skinny_gluon=True, fuse_rope="expert"),
     dict(skinny_gluon=True, rms_partials="expert"), dict(fused_mlp=True, fuse_rope="expert"),
     dict(fused_mlp=True, skinny_gluon=True, combine_rms="vlm")],
    ids=["none", "both", "rms_expert", "rope_vlm", "mixed", "partials", "partials_vlm_rms_expert", "combine_rms",
         "combine_rms_vlm_partials_expert", "l2_prefetch", "expert_layer", "skinny_gluon", "skinny_gluon_partials",
         "fused_mlp", "fused_mlp_skinny"],
)  # fmt: skip
def test_torch_kernel_plan_matches_reference_batched(flags) -> None:
    cfg, weights, x = _case(seed=11, b=2, v=3, p=6, h=9)
    shapes = BuiltShapes(3, 9, 6, 2)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                                 **flags)  # fmt: skip
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert rel_err(engine(inputs, x["noise"], 10), _reference(cfg, weights, x, 10)) <= TOL


def _launch_counts(engine) -> tuple[dict[str, int], dict[str, int]]:
    """Kernel calls by name of one expert step and of the VLM prefix, on the composed torch kernels."""
    from vla_rt.engine.kernels import TorchKernels

    plan = engine.plan
    plan.k = CountingKernels(TorchKernels())
    plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
    step = dict(plan.k.calls)
    plan.k.calls.clear()
    plan.prefix(engine.obs, engine.slot, engine.act)
    return step, dict(plan.k.calls)


def test_fusions_remove_the_norm_and_rope_launches() -> None:
    """Per expert step: 2 rms_factor + 1 rope_qk a layer and the final norm go; the GEMM count stays the same."""

    cfg, weights, x = _case(seed=15, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    counts = {}
    for name, flags in (("off", {}), ("on", dict(fuse_rms=True, fuse_rope=True)), ("expert", dict(fuse_rms="expert",
                        fuse_rope="expert"))):  # fmt: skip
        engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                                     **flags)  # fmt: skip
        counts[name] = _launch_counts(engine)
    layers, vlm_layers = cfg.expert.depth, cfg.llm.depth
    off_step, off_vlm = counts["off"]
    assert off_step["rms_factor"] == 2 * layers + 1 and off_step["rope_qk"] == layers
    assert off_vlm["rms_factor"] == 2 * vlm_layers - 1 and off_vlm["rope_qk"] == vlm_layers  # pruned layer: no MLP
    for name in ("on", "expert"):
        step, vlm = counts[name]
        assert "rms_factor" not in step and "rope_qk" not in step and step["gemm"] == off_step["gemm"]
        assert sum(step.values()) == sum(off_step.values()) - 3 * layers - 1
    assert counts["on"][1] == {k: v for k, v in off_vlm.items() if k not in ("rms_factor", "rope_qk")}
    assert counts["expert"][1] == off_vlm


def test_expert_layer_is_one_launch_a_layer() -> None:
    """expert_layer: each expert layer is one `expert_layer` call (no separate GEMM, attention, norm or RoPE), the
    suffix embedding, final norm and action projection stay; the VLM prefix is unchanged."""
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, _ = _case(seed=15, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    counts = {}
    for name, flags in (("off", {}), ("on", dict(expert_layer=True))):
        engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                                     **flags)  # fmt: skip
        assert engine.plan.expert_layer == (name == "on")
        plan = engine.plan
        plan.k = CountingKernels(TorchKernels())
        plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
        counts[name] = dict(plan.k.calls)
    layers = cfg.expert.depth
    assert counts["on"]["expert_layer"] == layers
    assert "attention" not in counts["on"] and "rope_qk" not in counts["on"]
    assert counts["on"]["rms_factor"] == 1  # the action projection's norm
    assert counts["on"]["gemm"] == counts["off"]["gemm"] - 4 * layers


def _tiny_cpu_builder(seed: int):
    """(cfg, weights, build): `build(**flags)` makes a float32 CPU graphed-torch engine of the tiny preset."""
    cfg, weights, _ = _case(seed=seed, b=1, v=1, p=2, h=3)
    build = functools.partial(build_graphed_torch, weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                              shapes=BuiltShapes(1, 3, 2, 1))  # fmt: skip
    return cfg, weights, build


def test_expert_layer_flag_is_checked() -> None:
    _, _, build = _tiny_cpu_builder(seed=17)
    with pytest.raises(ValueError, match="expert_layer is a bool"):
        build(expert_layer="expert")
    with pytest.raises(ValueError, match="drop l2_prefetch"):
        build(expert_layer=True, l2_prefetch=True)
    with pytest.raises(ValueError, match="drop rms_partials"):
        build(expert_layer=True, rms_partials=True)


def test_skinny_gluon_takes_the_expert_qkv_and_gate_up_with_their_norms() -> None:
    """skinny_gluon: per expert layer the QKV (RoPE epilogue) and gate/up GEMMs are `skinny_gemm` calls that take
    their RMS factor themselves: no rms_factor or rope_qk launch but the final norm's, O and down stay `gemm`."""
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, _ = _case(seed=15, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    counts = {}
    for name, flags in (("off", {}), ("on", dict(skinny_gluon=True))):
        engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                                     **flags)  # fmt: skip
        assert engine.plan.skinny == (name == "on")
        assert engine.plan.skinny_why == (None if name == "on" else "not asked for")
        plan = engine.plan
        plan.k = CountingKernels(TorchKernels())
        plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
        counts[name] = dict(plan.k.calls)
    layers = cfg.expert.depth
    assert counts["on"]["skinny_gemm"] == 2 * layers
    assert counts["on"]["rms_factor"] == 1 and "rope_qk" not in counts["on"]
    assert counts["on"]["gemm"] == counts["off"]["gemm"] - 2 * layers
    assert counts["on"]["attention"] == counts["off"]["attention"] == layers


def _triton_plan_on_cpu(weights, cfg, **flags):
    """The plan of the Triton kernel set built on a CPU (the interpreter) with `flags`, or None on a CUDA machine:
    there the Gluon kernels' own checks say whether they run."""
    if torch.cuda.is_available():
        return None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    engine = build_triton(weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                          shapes=BuiltShapes(1, 3, 2, 1), num_steps=2, **flags)  # fmt: skip
    return engine.plan


def test_skinny_gluon_flag_is_checked_and_says_why_it_does_not_apply() -> None:
    cfg, weights, build = _tiny_cpu_builder(seed=17)
    with pytest.raises(ValueError, match="skinny_gluon is a bool"):
        build(skinny_gluon="expert")
    with pytest.raises(ValueError, match="pick one"):
        build(skinny_gluon=True, expert_layer=True)
    plan = _triton_plan_on_cpu(weights, cfg, skinny_gluon=True)
    if plan is not None:
        assert not plan.skinny and "sm_90" in plan.skinny_why


def test_fused_mlp_is_one_launch_a_layer_with_its_norm() -> None:
    """fused_mlp: per expert layer one `expert_mlp` call replaces the gate/up and down GEMMs and the gate/up's
    rms_factor; QKV, attention, O, the final norm and the VLM prefix stay as they were."""
    _, _, build = _tiny_cpu_builder(seed=21)
    counts = {}
    for name, flags in (("off", {}), ("on", dict(fused_mlp=True)), ("skinny", dict(fused_mlp=True, skinny_gluon=True))):
        engine = build(**flags)
        assert engine.plan.fused_mlp == (name != "off")
        assert engine.plan.mlp_why == (None if name != "off" else "not asked for")
        counts[name] = _launch_counts(engine)
    layers = engine.cfg.expert.depth
    off, on, skinny = (counts[n][0] for n in ("off", "on", "skinny"))
    assert on["expert_mlp"] == skinny["expert_mlp"] == layers
    assert on["gemm"] == off["gemm"] - 2 * layers and on["rms_factor"] == off["rms_factor"] - layers
    assert skinny["skinny_gemm"] == layers and skinny["rms_factor"] == 1  # QKV on Gluon, the final norm
    assert counts["on"][1] == counts["off"][1] == counts["skinny"][1]


@pytest.mark.parametrize("knob", ["MLP_RMS_IN_KERNEL", "MLP_WITH_O"])
def test_fused_mlp_variants_match_reference(monkeypatch, knob) -> None:
    """MLP_RMS_IN_KERNEL off: an rms_factor launch before each expert_mlp gives it the row scale; MLP_WITH_O on:
    expert_mlp also does the layer's O projection (no O gemm). Same actions as the reference."""
    from vla_rt.engine import plan as plan_module

    monkeypatch.setattr(plan_module, knob, not getattr(plan_module, knob))
    cfg, weights, x = _case(seed=25, b=2, v=2, p=4, h=5)
    shapes = BuiltShapes(2, 5, 4, 2)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                                 fused_mlp=True)  # fmt: skip
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    assert engine.plan.fused_mlp
    assert rel_err(engine(inputs, x["noise"], 10), _reference(cfg, weights, x, 10)) <= TOL
    step, _ = _launch_counts(engine)
    layers = cfg.expert.depth
    assert step["expert_mlp"] == layers
    # state, action+time, per batch row the suffix MLP out and the action projection; per layer QKV and O (MLP_WITH_O:
    # QKV only)
    assert step["gemm"] == 2 + 2 * engine.dims.batch + (1 if knob == "MLP_WITH_O" else 2) * layers


def test_fused_mlp_flag_is_checked_and_says_why_it_does_not_apply() -> None:
    cfg, weights, build = _tiny_cpu_builder(seed=23)
    with pytest.raises(ValueError, match="fused_mlp is a bool"):
        build(fused_mlp="expert")
    with pytest.raises(ValueError, match="pick one"):
        build(fused_mlp=True, expert_layer=True)
    with pytest.raises(ValueError, match="drop rms_partials"):
        build(fused_mlp=True, rms_partials="expert")
    plan = _triton_plan_on_cpu(weights, cfg, fused_mlp=True)
    if plan is not None:
        assert not plan.fused_mlp and "sm_90" in plan.mlp_why


def test_rms_partials_keep_one_norm_launch_a_stage() -> None:
    """rms_partials: only each stage's first layer still launches rms_factor (its input comes from embeddings); the
    O and down GEMMs write the partial sums (ssq_out) that the QKV, gate/up and action-projection GEMMs read."""
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, x = _case(seed=19, b=1, v=1, p=2, h=3)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                                 shapes=BuiltShapes(1, 3, 2, 1), rms_partials=True)  # fmt: skip
    seen = []

    class Recording(TorchKernels):
        @staticmethod
        def gemm(a, w, out, **kw):
            seen.append(
                ("in" if kw.get("ssq_in") is not None else "") + ("out" if kw.get("ssq_out") is not None else "")
            )
            return TorchKernels.gemm(a, w, out, **kw)

    plan = engine.plan
    plan.k = CountingKernels(Recording())
    plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
    layers = cfg.expert.depth
    assert plan.k.calls["rms_factor"] == 1
    assert seen.count("out") == 2 * layers and seen.count("in") == 2 * layers - 1 + 1  # - layer 0's QKV + action_out
    plan.k.calls.clear()
    seen.clear()
    plan.prefix(engine.obs, engine.slot, engine.act)
    assert plan.k.calls["rms_factor"] == 1 and seen.count("out") == 2 * (cfg.llm.depth - 1)


def test_combine_rms_keeps_one_norm_launch_a_stage() -> None:
    """combine_rms: the O and down GEMMs write the next norm's factor (rms_out), so only each stage's first layer
    still launches rms_factor; the GEMM count stays the same, and rms_partials (here on the expert) takes over its
    stage."""
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, x = _case(seed=21, b=1, v=1, p=2, h=3)
    calls, seen = {}, []

    class Recording(TorchKernels):
        @staticmethod
        def gemm(a, w, out, **kw):
            seen.append(("rms_out" if kw.get("rms_out") is not None else "")
                        + ("ssq_out" if kw.get("ssq_out") is not None else ""))  # fmt: skip
            return TorchKernels.gemm(a, w, out, **kw)

    for name, flags in (("off", {}), ("on", dict(combine_rms=True)),
                        ("partials_expert", dict(combine_rms=True, rms_partials="expert"))):  # fmt: skip
        engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                                     shapes=BuiltShapes(1, 3, 2, 1), **flags)  # fmt: skip
        seen.clear()
        plan = engine.plan
        plan.k = CountingKernels(Recording())
        plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
        step = (dict(plan.k.calls), list(seen))
        plan.k.calls.clear()
        seen.clear()
        plan.prefix(engine.obs, engine.slot, engine.act)
        calls[name] = (step, (dict(plan.k.calls), list(seen)))
    layers, vlm_layers = cfg.expert.depth, cfg.llm.depth
    (off_step, _), (off_vlm, _) = calls["off"]
    (step, step_gemms), (vlm, vlm_gemms) = calls["on"]
    assert step["rms_factor"] == 1 and step["gemm"] == off_step["gemm"] and step_gemms.count("rms_out") == 2 * layers
    assert vlm["rms_factor"] == 1 and vlm["gemm"] == off_vlm["gemm"]
    assert vlm_gemms.count("rms_out") == 2 * (vlm_layers - 1)  # the pruned last layer has no O / MLP
    (step, step_gemms), (vlm, vlm_gemms) = calls["partials_expert"]
    assert "rms_out" not in step_gemms and step_gemms.count("ssq_out") == 2 * layers
    assert vlm_gemms.count("rms_out") == 2 * (vlm_layers - 1)


def test_l2_prefetch_asks_for_each_expert_layers_next_weights() -> None:
    """l2_prefetch: one prefetch per expert layer, launched before its QKV GEMM, for its O, gate/up and down weights
    and the next layer's QKV (the action projection after the last); none in the VLM; the launch count otherwise
    unchanged. A wrong argument is refused."""
    from vla_rt.engine import plan as plan_module
    from vla_rt.engine.kernels import TorchKernels

    cfg, weights, x = _case(seed=23, b=1, v=1, p=2, h=3)
    engine = build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                                 shapes=BuiltShapes(1, 3, 2, 1), l2_prefetch=True)  # fmt: skip
    order, asked = [], []

    class Recording(TorchKernels):
        @staticmethod
        def gemm(a, w, out, **kw):
            order.append(("gemm", w.data_ptr()))
            return TorchKernels.gemm(a, w, out, **kw)

        @staticmethod
        def prefetch_l2(tensors):
            order.append(("prefetch", None))
            asked.append([t.data_ptr() for t in tensors])

        @staticmethod
        def prefetch_join(like):
            order.append(("join", None))

    plan = engine.plan
    plan.k = Recording()
    plan.expert_step(engine.slot, engine.xa, 0, engine.num_steps)
    layers, s = engine.weights.expert, engine.weights.suffix
    assert len(asked) == len(layers) and order[-1] == ("join", None)  # the side stream joined as the step ends
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].qkv if i + 1 < len(layers) else s.action_out
        assert asked[i] == [t.data_ptr() for t in (layer.o, layer.gate_up, layer.down, nxt)]
        at = order.index(("gemm", layer.qkv.data_ptr()))
        assert order[at - 1] == ("prefetch", None)  # forked as the layer starts
    order.clear()
    plan.prefix(engine.obs, engine.slot, engine.act)
    assert ("prefetch", None) not in order
    with pytest.raises(ValueError, match="l2_prefetch is a bool"):
        plan_module.Pi0Plan(TorchKernels(), engine.weights, cfg, engine.dims, l2_prefetch="vlm")


def test_a_broken_rope_fusion_fails_the_plan_test() -> None:
    """The plan test above must catch a RoPE epilogue that rotates the wrong pairs (adjacent (2j, 2j+1), the
    interleaved convention): the same engine with such a kernel set misses the reference by far."""
    from vla_rt.engine.kernels import TorchKernels

    class AdjacentPairsRope(TorchKernels):
        """The fused GEMM with the rotation on pairs (2j, 2j+1) of each head: what a permuted-weight scheme does when
        the weight permutation is forgotten (Q and K both rotated the same wrong way; V untouched)."""

        @staticmethod
        def gemm(a, w, out, *, rope=None, **kw):
            TorchKernels.gemm(a, w, out, **kw)
            if rope is None:
                return out
            hq, hkv, d, off = rope["num_q_heads"], rope["num_kv_heads"], rope["head_dim"], rope["cache_offset"]
            b = rope["k_cache"].shape[0]
            t = out.shape[0] // b
            y = out.view(b, t, hq + 2 * hkv, d).float()
            c, s = (tab.expand(b, t, -1)[:, :, None] for tab in (rope["cos"], rope["sin"]))
            ev, od = y[..., 0::2], y[..., 1::2]
            rot = torch.stack([ev * c - od * s, od * c + ev * s], dim=-1).flatten(-2)
            out.view(b, t, -1, d)[:, :, :hq] = rot[:, :, :hq] * rope.get("q_scale", 1.0)
            rope["k_cache"][:, off : off + t] = rot[:, :, hq : hq + hkv]
            rope["v_cache"][:, off : off + t] = y[:, :, hq + hkv :]
            return out

    cfg, weights, x = _case(seed=16, b=1, v=1, p=2, h=3)
    shapes = BuiltShapes(1, 3, 2, 1)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    ref = _reference(cfg, weights, x, 10)
    for kernels, ok in ((TorchKernels(), True), (AdjacentPairsRope(), False)):
        engine = StaticPi0Engine(weights, cfg, shapes, kernels=kernels, device=torch.device("cpu"),
                                 dtype=torch.float32, fuse_rope=True)  # fmt: skip
        err = rel_err(engine(inputs, x["noise"], 10), ref)
        assert (err <= TOL) == ok, err


def test_fusion_flags_are_checked() -> None:
    cfg, weights, _ = _case(seed=17, b=1, v=1, p=2, h=3)
    with pytest.raises(ValueError, match="fuse_rms"):
        build_graphed_torch(weights, cfg, device=torch.device("cpu"), dtype=torch.float32,
                            shapes=BuiltShapes(1, 3, 2, 1), fuse_rms="siglip")  # fmt: skip


def test_triton_kernel_plan_with_fusions_matches_reference_in_interpreter() -> None:
    """Fused RMS factor and RoPE epilogue on every layer of both stages (incl. the pruned K/V-only layer), batch 2
    with per-row positions (a padded prompt), in the interpreter; flags off is the test above."""
    if torch.cuda.is_available():
        pytest.skip("covered in bf16 on the GPU by tests/test_gpu_engine.py")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg, weights, x = _case(seed=18, b=2, v=1, p=3, h=4)
    shapes = BuiltShapes(1, 4, 3, 2)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    ref = _reference(cfg, weights, x, 2)
    for flags in (dict(fuse_rms=True, fuse_rope=True), dict(rms_partials=True, fuse_rope=True),
                  dict(combine_rms=True, fuse_rope=True, l2_prefetch=True), dict(expert_layer=True, fuse_rope=True)):  # fmt: skip
        engine = build_triton(weights, cfg, device=torch.device("cpu"), dtype=torch.float32, shapes=shapes,
                              num_steps=2, **flags)  # fmt: skip
        assert rel_err(engine(inputs, x["noise"], 2), ref) <= TOL, flags


def test_fusion_ab_tool_runs_every_combination(monkeypatch, tmp_path) -> None:
    """tools/bench_fused.py (the GPU A/B of the fusions) on the CPU: every combination builds, runs and agrees with
    the unfused engine; timing stubbed to one call."""
    import importlib.util
    from pathlib import Path

    from vla_rt.bench.timing import Timing

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_fused.py"
    spec = importlib.util.spec_from_file_location("bench_fused", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(tool, "time_calls", lambda fn, **kw: (fn(), Timing.of([1.0]))[1])
    result = tool.run([(1, 2, 3)], list(tool.COMBOS), preset_name="tiny", iters=1, num_steps=2, log=lambda m: None)
    assert [r["combo"] for r in result["rows"]] == list(tool.COMBOS)
    assert all(r["finite"] and r["rel_err_vs_off"] <= TOL for r in result["rows"])
    assert "| 1v p2 h3 | both |" in tool.table(result)
