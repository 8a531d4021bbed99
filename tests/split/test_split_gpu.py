"""The split engines on the GPU (bf16, Triton kernels, CUDA Graphs): the robot-side expert's actions on a fresh KV
equal the monolithic engine's bit for bit, for π0 and π0.5, through the wire in the native format too; fp8's cost
against the float32 reference is bounded. Skipped without CUDA (run with `pytest -m gpu` on the device)."""

from __future__ import annotations

import msgpack
import pytest
import torch
from split_cases import engine_case

from vla_rt.engine.split_engines import ExpertEngine, PrefixEngine, expert_subset
from vla_rt.engine.static_engine import build_triton
from vla_rt.inference import build_pi0
from vla_rt.inputs import check_model_inputs
from vla_rt.numerics import rel_err
from vla_rt.split.kv_codec import KvAssembler, KvLayout, encode_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset_name", ["tiny", "tiny_pi05"])
def test_split_on_the_gpu_is_bit_identical_to_the_monolithic_engine(preset_name: str) -> None:
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    cfg, weights, x, shapes = engine_case(preset_name, seed=51, views=2, prompt=6, chunk=10)
    x = {k: v.to(cuda) for k, v in x.items()}
    inputs = check_model_inputs(cfg, shapes, x["images"], x["state"], x["tokens"], x["noise"], x["image_masks"],
                                x["token_mask"])  # fmt: skip
    monolithic = build_triton(weights, cfg, device=cuda, dtype=bf16, shapes=shapes)(inputs, x["noise"], 10)
    prefix = PrefixEngine(weights, cfg, shapes, device=cuda, dtype=bf16)
    expert = ExpertEngine.from_expert_weights(expert_subset(weights, cfg), cfg, shapes, device=cuda, dtype=bf16,
                                              num_slots=3)  # fmt: skip
    prefix.run(inputs)
    kv, mask = prefix.export()
    state = None if cfg.pi05 else x["state"]
    expert.import_prefix(0, kv, mask)
    assert torch.equal(expert.run_chunk(0, state, x["noise"]), monolithic)
    layout = KvLayout(cfg.llm.depth, cfg.llm.num_kv_heads, cfg.llm.head_dim, expert.dims.prefix)
    reference = build_pi0(weights, cfg, backend="reference", device=cuda).sample_actions(
        x["images"], x["state"], x["tokens"], x["noise"], image_masks=x["image_masks"], token_mask=x["token_mask"]
    )
    for fmt in ("native", "fp8"):
        asm, done = KvAssembler(layout), None
        for frame in encode_kv(kv, mask, version=1, t_capture=0.0, fmt=fmt, chunk_bytes=4096).frames:
            done = asm.add(msgpack.unpackb(frame))
        expert.import_prefix(1, *done.to_device(cuda, bf16))
        actions = expert.run_chunk(1, state, x["noise"])
        if fmt == "native":
            assert torch.equal(actions, monolithic)
        else:
            assert rel_err(actions, reference) < 5e-2
