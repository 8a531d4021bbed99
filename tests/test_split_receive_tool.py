"""tools/split_receive.py's receive-path report (docs/split.md quotes its parts): each part is its own median, so none
can come out negative. It printed `import_prefix -4.18 ms` on a loaded 2-core CPU: import was the median of
to_device + import less the median of another run of to_device, and a slower to_device run made it negative."""

import time

import torch
from tool_modules import load_tool

from vla_rt.split.kv_codec import CompleteKv, KvLayout, encode_kv


def _tool():
    return load_tool("split_receive")


class _Engine:
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self):
        self.imports = 0

    def import_prefix(self, slot, *kv_and_mask):
        self.imports += 1
        time.sleep(0.002)


def test_import_prefix_is_timed_alone_and_never_negative(monkeypatch):
    tool = _tool()
    layout = KvLayout(depth=2, kv_heads=1, head_dim=8, prefix_len=16)
    kv = torch.randn(2, 2, 1, 16, 1, 8).to(torch.bfloat16)
    frames = encode_kv(kv, torch.ones(1, 16, dtype=torch.bool), version=1, t_capture=0.0, fmt="native").frames
    calls, real = [], CompleteKv.to_device

    def first_calls_slow(self, device, dtype):  # the first conversions pay for allocation: noise with a direction
        calls.append(1)
        if len(calls) <= 4:
            time.sleep(0.03)
        return real(self, device, dtype)

    monkeypatch.setattr(CompleteKv, "to_device", first_calls_slow)
    engine = _Engine()
    parts, _ = tool.receive_parts(engine, layout, frames, repeats=3)
    assert parts["to_device"] >= 25.0
    assert 1.5 <= parts["import_prefix"] < parts["to_device"], parts
    assert engine.imports == 3
