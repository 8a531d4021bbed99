"""`PersistentExpertStep`: one π0 denoising step of the action expert as one launch of `expert_step.cu`.

Built once per engine (dims, SM count): the schedule, the packed weight stream (its own bf16 copy of the expert's
weights, ~0.62 GB for π0), the kernel's activation scratch and hand-off counters, and the compiled cubin. `run`
reads what the per-op path reads (the slot's KV cache prefix rows, key blocks, suffix RoPE rows and state; x_t and
query blocks from the expert activations) and writes what it writes (x_t updated in place, the suffix K/V rows of
the cache), so it is a drop-in `ExpertStep`. Deviation from the per-op path: the suffix embedding's second GEMM
(`action_time_mlp_out`, fp32 there) runs on bf16 tensor cores with bf16-rounded weights and inputs, as openpi's
bf16 serving rounds those weights too.

`why_not(...)` says in one line why this machine or model cannot use it (no CUDA, not sm_90, no nvcc, dims).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from vla_rt.cuda_kernels import build, driver
from vla_rt.cuda_kernels.expert_dims import KEY_ITEM, THREADS, TILE, ExpertDims, why_unsupported
from vla_rt.cuda_kernels.expert_pack import pack_weights
from vla_rt.cuda_kernels.expert_schedule import Schedule, build_schedule

SOURCE = "expert_step.cu"
KERNEL = "expert_step_kernel"
TRACE_STAMPS = 6  # expert_step.cu's Stamp
TIMEOUT_S = 2.0  # a hand-off that waits longer is a broken protocol: error flag set, wrong outputs, no hang


class Params(ctypes.Structure):
    """expert_step.cu's `Params`, field for field (a CPU test compares the two)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "instrs", "cta_instr", "cta_page", "wstream", "counters", "epoch", "exit_count", "error", "x_img", "h_img",
        "attn_img", "emb_img", "q_frag", "ssq", "part_o", "part_d", "o_part", "ml_part", "kv_maps", "k_cache",
        "v_cache", "rope_cos", "rope_sin", "key_block", "query_block", "state", "x_t", "w_state", "b_state",
        "w_action_time", "time_bias", "b_mlp_out", "b_action_out")] + [
        ("dt", ctypes.c_float), ("scale_log2", ctypes.c_float), ("rms_eps", ctypes.c_float), ("pad0", ctypes.c_int),
        ("timeout_ns", ctypes.c_uint64), ("trace", ctypes.c_void_p), ("mod_stride", ctypes.c_int64),
        ("xs_attn_img", ctypes.c_void_p), ("xs_ffn_img", ctypes.c_void_p), ("w_action_in", ctypes.c_void_p),
        ("b_action_in", ctypes.c_void_p)]  # fmt: skip


def expert_dims(cfg, dims, **tiling) -> ExpertDims:
    """The kernel's dims for an engine's `Pi0Config` and `Dims`; `tiling` overrides ExpertDims' tiling fields
    (keys_per_split, a_ring_kb, o_splits, down_splits, mma_depth)."""
    e, g = cfg.expert, cfg.llm
    return ExpertDims(batch=dims.batch, chunk=dims.chunk, prefix=dims.prefix, width=e.width, mlp=e.mlp_dim,
                      heads=g.num_heads, head_dim=g.head_dim, depth=e.depth, action_dim=cfg.action_dim,
                      pi05=bool(cfg.pi05), **tiling)  # fmt: skip


def why_not(cfg, dims, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None if the persistent kernel can run this model here, else one line saying why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA device"
    if dtype != torch.bfloat16:
        return f"needs bfloat16 weights, found {dtype}"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"needs an sm_90 GPU (Hopper), found sm_{cap[0]}{cap[1]}"
    why = why_unsupported(expert_dims(cfg, dims), num_kv_heads=cfg.llm.num_kv_heads)
    if why:
        return why
    if build.find_nvcc() is None:
        return "no nvcc (CUDA toolkit or the nvidia-cuda-nvcc wheel) to build the kernel"
    return None


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class PersistentExpertStep:
    """`run(slot, xa, step, num_steps, time_bias=None)`: one Euler step of x_t, one kernel launch. π0 and π0.5;
    `time_bias` may hold a row per batch element (B, W) / (B, R): rows at different Euler steps (the stage engine)."""

    name = "cuda-persistent"
    per_row_steps = True

    def __init__(self, weights, cfg, dims, *, sm_count: int | None = None, timeout_s: float = TIMEOUT_S,
                 schedule: Schedule | None = None, tiling: dict | None = None):  # fmt: skip
        device = weights.expert[0].qkv.device
        why = why_not(cfg, dims, device, weights.expert[0].qkv.dtype)
        if why:
            raise RuntimeError(f"persistent expert kernel: {why}")
        self.cfg, self.dims, self.device = cfg, dims, device
        self.d = d = expert_dims(cfg, dims, **(tiling or {}))
        why = why_unsupported(d)
        if why:
            raise RuntimeError(f"persistent expert kernel: {why}")
        cubin, self.ptxas_log = build.compile_cubin(SOURCE, d.template_args())
        self.resources = build.Resources.parse(self.ptxas_log)
        self.kernel = driver.Kernel(cubin, KERNEL, d.smem_bytes)
        props = torch.cuda.get_device_properties(device)
        self.ctas = min(sm_count or props.multi_processor_count, props.multi_processor_count)
        self.schedule = schedule or build_schedule(d, self.ctas)
        if self.schedule.ctas != self.ctas:
            raise ValueError(f"schedule built for {self.schedule.ctas} CTAs, launching {self.ctas}")
        tables = self.schedule.tables()
        self.timeout_ns = int(timeout_s * 1e9)
        i32 = dict(dtype=torch.int32, device=device)
        self.instrs = torch.from_numpy(tables["instrs"]).to(device)
        self.cta_instr = torch.from_numpy(tables["cta_instr"]).to(device)
        self.cta_page = torch.from_numpy(tables["cta_page"]).to(device)
        self.wstream = pack_weights(self.schedule, weights, device)
        self.counters = torch.zeros(len(tables["counter_t"]), **i32)
        self.sync_words = torch.zeros(4, **i32)  # epoch, exit count, error
        bf16 = dict(dtype=torch.bfloat16, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        n_splits = len(d.key_splits())
        self.x_img = torch.zeros(d.width * d.m_pad, **bf16)
        # π0.5: x scaled by the next norm's (1 + s), the QKV and gate/up GEMMs' inputs
        self.xs_attn_img = torch.zeros(d.width * d.m_pad, **bf16) if d.pi05 else None
        self.xs_ffn_img = torch.zeros(d.width * d.m_pad, **bf16) if d.pi05 else None
        self.h_img = torch.zeros(d.mlp * d.m_pad, **bf16)
        self.attn_img = torch.zeros(d.q_width * d.m_pad, **bf16)
        self.emb_img = torch.zeros(d.width * d.m_pad, **bf16)
        self.q_frag = torch.zeros(d.batch * d.heads * TILE * d.head_dim, **bf16)
        self.ssq = torch.zeros(d.width // TILE * d.m_pad, **f32)
        self.part_o = torch.zeros(d.o_splits * d.m_pad * d.width, **f32)
        self.part_d = torch.zeros(d.down_splits * d.m_pad * d.width, **f32)
        self.o_part = torch.zeros(d.batch * d.heads * n_splits * TILE * d.head_dim, **f32)
        self.ml_part = torch.zeros(d.batch * d.heads * n_splits * TILE * 2, **f32)
        if d.pi05:  # the action tokens' input projection; everything else comes from the step's row
            p05 = weights.pi05
            self.w_action_in, self.b_action_in = p05.action_in.float().contiguous(), p05.action_in_bias.float()
            self.time_bias_table = p05.tables.float().contiguous()
            self.w_state = self.b_state = self.w_action_time = self.b_mlp_out = self.b_action_out = None
        else:
            s = weights.suffix
            self.w_state, self.b_state = s.state.float().contiguous(), s.state_bias.float().contiguous()
            self.w_action_time = s.action_time.float().contiguous()
            self.time_bias_table = s.time_bias.float().contiguous()
            self.b_mlp_out = s.mlp_out_bias.float().contiguous()
            self.b_action_out = s.action_out_bias.float().contiguous()
            self.w_action_in = self.b_action_in = None
        self.row_width = self.time_bias_table.shape[1]  # π0: the width; π0.5: the packed modulation row
        self.scale_log2 = float(weights.gemma_attn_scale) * float(np.log2(np.e))
        self.rms_eps = float(cfg.rms_eps)
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.trace: torch.Tensor | None = None  # (instructions, 3) int64 global-timer stamps, when tracing

    # ----- per slot: TMA maps of its K/V caches and the per-layer pointer tables -----------------------------------
    def _slot_tables(self, slot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (slot.k_cache[0].data_ptr(), slot.v_cache[0].data_ptr())
        if key not in self._slots:
            d = self.d
            maps = bytearray()
            for k, v in zip(slot.k_cache, slot.v_cache):
                for cache in (k, v):
                    if cache.shape != (d.batch, d.keys, 1, d.head_dim) or not cache.is_contiguous():
                        raise ValueError(f"KV cache: expected contiguous {(d.batch, d.keys, 1, d.head_dim)}, "
                                         f"found {tuple(cache.shape)}")  # fmt: skip
                    maps += driver.tensor_map_3d_bf16(cache.data_ptr(), (d.head_dim, d.keys, d.batch),
                                                      (d.head_dim * 2, d.keys * d.head_dim * 2),
                                                      (TILE, KEY_ITEM, 1))  # fmt: skip
            maps_t = torch.frombuffer(maps, dtype=torch.uint8).to(self.device)
            k_ptrs = torch.tensor([t.data_ptr() for t in slot.k_cache], dtype=torch.int64, device=self.device)
            v_ptrs = torch.tensor([t.data_ptr() for t in slot.v_cache], dtype=torch.int64, device=self.device)
            self._slots[key] = (maps_t, k_ptrs, v_ptrs)
        return self._slots[key]

    def params(self, slot, xa, step: int, num_steps: int, time_bias: torch.Tensor | None = None) -> Params:
        maps, k_ptrs, v_ptrs = self._slot_tables(slot)
        tb = self.time_bias_table[step] if time_bias is None else time_bias
        rows_ok = tb.dim() == 1 or (tb.dim() == 2 and tb.shape[0] == self.d.batch)
        if tb.dtype != torch.float32 or not rows_ok or tb.shape[-1] != self.row_width or not tb.is_contiguous():
            raise ValueError(f"time_bias: expected contiguous float32 ({self.row_width},) or ({self.d.batch}, "
                             f"{self.row_width}) (a row per batch element), found {tuple(tb.shape)} {tb.dtype}")  # fmt: skip
        w = self.sync_words
        p = Params(
            instrs=_ptr(self.instrs), cta_instr=_ptr(self.cta_instr), cta_page=_ptr(self.cta_page),
            wstream=_ptr(self.wstream), counters=_ptr(self.counters), epoch=w.data_ptr(),
            exit_count=w.data_ptr() + 4, error=w.data_ptr() + 8, x_img=_ptr(self.x_img), h_img=_ptr(self.h_img),
            attn_img=_ptr(self.attn_img), emb_img=_ptr(self.emb_img), q_frag=_ptr(self.q_frag), ssq=_ptr(self.ssq),
            part_o=_ptr(self.part_o), part_d=_ptr(self.part_d), o_part=_ptr(self.o_part),
            ml_part=_ptr(self.ml_part), kv_maps=_ptr(maps), k_cache=_ptr(k_ptrs), v_cache=_ptr(v_ptrs),
            rope_cos=_ptr(slot.suffix_cos), rope_sin=_ptr(slot.suffix_sin), key_block=_ptr(slot.key_block),
            query_block=_ptr(xa.query_block), state=_ptr(slot.state), x_t=_ptr(xa.x_t),
            w_state=_ptr(self.w_state), b_state=_ptr(self.b_state), w_action_time=_ptr(self.w_action_time),
            time_bias=_ptr(tb), b_mlp_out=_ptr(self.b_mlp_out), b_action_out=_ptr(self.b_action_out),
            dt=-1.0 / num_steps, scale_log2=self.scale_log2, rms_eps=self.rms_eps, pad0=0,
            timeout_ns=self.timeout_ns, trace=_ptr(self.trace), mod_stride=self.row_width if tb.dim() == 2 else 0,
            xs_attn_img=_ptr(self.xs_attn_img), xs_ffn_img=_ptr(self.xs_ffn_img), w_action_in=_ptr(self.w_action_in),
            b_action_in=_ptr(self.b_action_in),
        )  # fmt: skip
        return p

    def run(self, slot, xa, step: int, num_steps: int, time_bias: torch.Tensor | None = None) -> None:
        """x_t += dt * v(x_t, t_step), launched on the current stream (capturable in a CUDA Graph)."""
        for t, name in ((slot.suffix_cos, "suffix_cos"), (slot.key_block, "key_block"), (xa.x_t, "x_t")):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        self._last_params = self.params(slot, xa, step, num_steps, time_bias)  # kept alive until the launch is queued
        self.kernel.launch(self.ctas, THREADS, self._last_params, torch.cuda.current_stream(self.device).cuda_stream)

    def enable_trace(self) -> torch.Tensor:
        """Every later launch stamps each instruction (ns, `%globaltimer`) into the returned (instructions, 6) int64
        tensor, rows in the order of `schedule.tables()["instrs"]`: consumer start, first input in shared memory,
        MMAs done, outputs stored, signalled, and when the loader saw its last input complete (profiling)."""
        self.trace = torch.zeros(len(self.instrs), TRACE_STAMPS, dtype=torch.int64, device=self.device)
        return self.trace

    def error_code(self) -> int:
        """The kernel's error word (0: every hand-off completed in time); synchronises."""
        return int(self.sync_words[2].item())

    def reset(self) -> None:
        """Zeroes the counters and the epoch (after an error, whose launch left them short of their targets)."""
        self.counters.zero_()
        self.sync_words.zero_()
