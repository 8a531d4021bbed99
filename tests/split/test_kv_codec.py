"""KV versions on the wire: exact round trips, any chunk order, newest wins, and a version is installed whole or
not at all (reordered, interleaved, duplicated, corrupted or late chunks); fp8's accuracy cost on the actions."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch
from split_cases import engine_case

from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine, expert_subset
from vla_rt.inputs import check_model_inputs
from vla_rt.numerics import rel_err
from vla_rt.split.kv_codec import KvAssembler, KvFrameError, KvLayout, encode_kv, fp8_to_float

CPU, F32 = torch.device("cpu"), torch.float32
LAYOUT = KvLayout(depth=3, kv_heads=1, head_dim=8, prefix_len=20)


def _kv(seed: int, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*LAYOUT.shape(LAYOUT.prefix_len), generator=g).to(dtype)
    mask = torch.ones(1, LAYOUT.prefix_len, dtype=torch.bool)
    mask[0, 13:17] = False  # padding in the middle and a valid tail
    return kv, mask


def _frames(version: int, seed: int, **kw):
    kv, mask = _kv(seed, kw.pop("dtype", F32))
    return kv, mask, [msgpack.unpackb(f) for f in encode_kv(kv, mask, version=version, t_capture=0.5 * version,
                                                              chunk_bytes=kw.pop("chunk_bytes", 200), **kw).frames]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_in_any_order_is_exact(dtype) -> None:
    kv, mask, frames = _frames(3, seed=1, dtype=dtype)
    random.Random(0).shuffle(frames)
    asm, done = KvAssembler(LAYOUT), None
    for f in frames:
        assert done is None
        done = asm.add(f)
    assert done is not None and (done.version, done.t_capture) == (3, 1.5)
    got, got_mask, rows = done.to_device(CPU, dtype)
    assert torch.equal(got_mask, mask) and torch.equal(rows, mask[0].nonzero()[:, 0])
    assert torch.equal(got, kv[:, :, :, mask[0]])  # only the valid keys travel


def test_interleaved_versions_install_whole_newest_wins_late_older_dropped() -> None:
    _, _, old = _frames(1, seed=1)
    kv2, mask2, new = _frames(2, seed=2)
    asm = KvAssembler(LAYOUT)
    assert asm.add(old[0]) is None and asm.add(new[0]) is None  # v2 abandons v1's staging
    results = [asm.add(f) for f in old[1:] + new[1:]]  # the rest of v1 arrives late: dropped
    completed = [r for r in results if r is not None]
    assert [r.version for r in completed] == [2]
    assert torch.equal(completed[0].to_device(CPU, F32)[0], kv2[:, :, :, mask2[0]])
    assert asm.stats["abandoned"] == 1 and asm.stats["stale"] == len(old) - 1
    assert all(asm.add(f) is None for f in old + new)  # an older or an already installed version: never again


def test_a_corrupted_or_foreign_chunk_drops_its_whole_version() -> None:
    for corrupt in ("bit flip", "other manifest", "truncated"):
        _, _, frames = _frames(5, seed=3)
        _, _, other = _frames(5, seed=4)
        bad = dict(frames[2])
        if corrupt == "bit flip":
            bad["data"] = bytes([bad["data"][0] ^ 1]) + bad["data"][1:]
        elif corrupt == "other manifest":  # same version, another cache: a chunk that would mix two halves
            bad = other[2]  # (a valid chunk of the same version and mask: only its CRC in the manifest differs)
        else:
            bad["data"] = bad["data"][:-1]
        asm = KvAssembler(LAYOUT)
        results = [asm.add(f) for f in frames[:2] + [bad] + frames[3:]]
        assert all(r is None for r in results), corrupt
        assert asm.stats["corrupt"] == 1
        _, _, later = _frames(6, seed=5)
        assert [asm.add(f) for f in later][-1].version == 6  # the next version installs normally


def test_a_manifest_that_does_not_fit_the_layout_is_a_protocol_fault() -> None:
    kv, mask = _kv(7)
    frame = msgpack.unpackb(encode_kv(kv[:2], mask, version=1, t_capture=0.0).frames[0])  # 2 layers, not 3
    with pytest.raises(KvFrameError, match="expected shape"):
        KvAssembler(LAYOUT).add(frame)
    with pytest.raises(KvFrameError, match="expected int version"):
        KvAssembler(LAYOUT).add({**frame, "version": "1"})


def test_fp8_decodes_through_the_cpu_table_bit_for_bit() -> None:
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(torch.float8_e4m3fn).view(3, 2, 128)
    assert torch.equal(fp8_to_float(codes).view(torch.int32), codes.float().view(torch.int32))  # NaNs too


def test_fp8_halves_the_bytes_and_its_accuracy_cost_on_actions_is_measured() -> None:
    """fp8 K/V with a scale per layer and K/V against the float32 reference on the tiny π0 (the number the docs
    quote: rel_err of the actions; bf16 transport for comparison)."""
    cfg, weights, x, shapes = engine_case("tiny", seed=41, views=2, prompt=5, chunk=10)
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    prefix = PrefixEngine(weights, cfg, shapes, device=CPU, dtype=F32)
    expert = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=CPU, dtype=F32)
    kv, mask = prefix.run(inputs) and prefix.export()
    layout = KvLayout(cfg.llm.depth, cfg.llm.num_kv_heads, cfg.llm.head_dim, shapes.num_views * 256 + 5)
    errors, sizes = {}, {}
    expert.import_prefix(0, kv, mask)
    reference = expert.run_chunk(0, x["state"], x["noise"])
    for name, fmt, wire in (("fp8", "fp8", kv), ("bf16", "native", kv.bfloat16())):
        encoded = encode_kv(wire, mask, version=1, t_capture=0.0, fmt=fmt)
        asm = KvAssembler(layout)
        done = [asm.add(msgpack.unpackb(f)) for f in encoded.frames][-1]
        expert.import_prefix(0, *done.to_device(CPU, F32))
        errors[name], sizes[name] = (
            rel_err(expert.run_chunk(0, x["state"], x["noise"]), reference),
            encoded.payload_bytes,
        )
    print(f"\nKV transport accuracy vs float32 (tiny π0): {errors}; payload bytes {sizes}")
    assert sizes["fp8"] * 2 == sizes["bf16"]
    assert 0 < errors["bf16"] < 2e-2 and 0 < errors["fp8"] < 1e-1
