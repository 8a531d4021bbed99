"""Streaming loads: tensors read one at a time to their target, so loading never holds a checkpoint twice.

The full-size numbers (π0 and π0.5, 7 GB in bf16) come from `python -m vla_rt.bench.load_memory`, run by hand (see
docs/checkpoints.md); here the same measurement runs on a mid-size checkpoint (~120 MB) in fresh processes.
"""

import json
import struct

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vla_rt.bench.load_memory import measure
from vla_rt.checkpoints.streaming import read_safetensors
from vla_rt.config import Pi0Config
from vla_rt.model.weights import CheckpointError, param_shapes

# ~31M parameters (124 MB in float32), π0.5 structure; the largest tensor (the embedding) is a quarter of it.
MID = {
    "vision": {"width": 256, "depth": 4, "mlp_dim": 1024, "num_heads": 4, "patch_size": 14, "image_size": 224},
    "llm": {"width": 512, "depth": 4, "mlp_dim": 2048, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
    "expert": {"width": 256, "depth": 4, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
    "vocab_size": 16384,
    "action_dim": 32,
    "chunk": 50,
    "max_token_len": 200,
    "rms_eps": 1e-6,
    "layernorm_eps": 1e-6,
    "pi05": True,
}
# orbax reads OCDBT through a tensorstore cache pool capped at 100 MB (`cache_pool#ocdbt` in orbax's
# serialization/tensorstore_utils.py): a fixed cost, 1.4% of a full π0 in bf16, most of a mid-size checkpoint.
ORBAX_CACHE_BYTES = 100_000_000


def test_read_safetensors_matches_safetensors_and_places_each_tensor(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "c": torch.randn(2, 2, 2).half(),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"k": "v"})
    got = dict(read_safetensors(tmp_path / "t.safetensors", ["c", "a", "b", "empty"]))
    ref = load_file(tmp_path / "t.safetensors")
    assert list(got) == ["c", "a", "b", "empty"]
    assert all(got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)
    as_f32 = dict(read_safetensors(tmp_path / "t.safetensors", ["b"], dtype=torch.float32, device="cpu"))
    assert as_f32["b"].dtype == torch.float32 and torch.equal(as_f32["b"], ref["b"].float())


def test_read_safetensors_refuses_a_truncated_file(tmp_path):
    save_file({"a": torch.randn(64, 64)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(
        CheckpointError, match="truncated: the header describes 16384 bytes of tensor data, the file holds 16284"
    ):
        list(read_safetensors(tmp_path / "cut.safetensors", ["a"]))


def _with_offsets(data: bytes, offsets: dict[str, list[int]]) -> bytes:
    """`data` (a safetensors file) with its header's data_offsets replaced by `offsets` (same length)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for name, span in offsets.items():
        header[name]["data_offsets"] = span
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


@pytest.mark.parametrize(
    ("offsets", "words"),
    [
        ({"b": [0, 64]}, "tensors 'a' (data_offsets [0, 64]) and 'b' (data_offsets [0, 64]) overlap"),
        ({"b": [32, 96]}, "tensors 'a' (data_offsets [0, 64]) and 'b' (data_offsets [32, 96]) overlap"),
    ],
    ids=["aliased", "overlapping"],
)
def test_read_safetensors_refuses_tensors_that_share_bytes_as_safetensors_does(tmp_path, offsets, words):
    """The bug: our reader loaded two tensors over the same bytes (a write through one showing in the other) from a
    file `safe_open` refuses; the same rule now holds on both paths, naming the file and both tensors."""
    save_file({"a": torch.randn(16), "b": torch.randn(16)}, tmp_path / "t.safetensors")
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_with_offsets((tmp_path / "t.safetensors").read_bytes(), offsets))
    with pytest.raises(SafetensorError), safe_open(str(path), framework="pt"):
        pass
    with pytest.raises(CheckpointError) as e:
        list(read_safetensors(path, ["a", "b"]))
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("fmt", ["native", "lerobot", "openpi"])
def test_loading_a_mid_size_checkpoint_adds_at_most_1_3x_its_size(tmp_path, fmt):
    """The peak a load adds over the resident size before it, against the model's bytes in float32 (what holding the
    checkpoint twice would double). Not against the bytes on disk: orbax may compress (OCDBT + zstd in recent
    releases stores random float32 in ~8% less), LeRobot adds buffers the model does not keep."""
    if fmt == "openpi":
        pytest.importorskip("orbax.checkpoint")
    expected_bytes = 4 * sum(torch.Size(s).numel() for s in param_shapes(Pi0Config.from_dict(MID)).values())
    r = measure(json.dumps(MID), fmt, "float32", tmp_path)
    allowance = ORBAX_CACHE_BYTES if fmt == "openpi" else 0
    added = r["peak_rss"] - r["baseline_rss"]
    assert r["model_bytes"] == expected_bytes  # all of it loaded, in float32
    assert added <= 1.3 * r["model_bytes"] + allowance, r
