"""The shapes the persistent expert kernel is built for, and the shared-memory plan that follows from them.

Everything here is a compile-time constant of one kernel variant (`expert_step.cu`'s template/constexpr
parameters): the engine's dims (batch, suffix rows, prefix keys, model widths) and the ring sizes chosen from the
shared-memory budget. `why_unsupported` says, in one line, why a model cannot use the kernel (the chooser prints it).
"""

from __future__ import annotations

from dataclasses import dataclass

TILE = 64  # weight rows of one GEMM unit, and the K width of one page (64 bf16 = one 128-byte swizzle row)
PAGE_BYTES = TILE * TILE * 2  # one pre-swizzled weight page: 64 rows x 64 k, bf16
KEY_ITEM = 32  # keys per K or V item of attention (one TMA box height)
ROW_GROUP = 16  # query rows per attention merge unit
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a Hopper CTA may use
SMEM_MISC = 8 * 1024  # barriers, RMS factors, reduction scratch (the tail of expert_step.cu's `Smem`)
SMEM_ALIGN = 1024  # the kernel rounds the dynamic shared memory base up to 1024 bytes (the swizzle atom)
THREADS = 384  # two consumer warpgroups + one producer warpgroup (weight loader, activation loader, two idle warps)


@dataclass(frozen=True)
class ExpertDims:
    """One kernel variant: model dims, engine dims, tiling. All sizes in elements unless named `_bytes`."""

    batch: int
    chunk: int  # action rows H per batch (π0's suffix is 1 + H rows: the state token and the actions)
    prefix: int  # prefix keys in the KV cache (views x 256 + prompt)
    width: int = 1024
    mlp: int = 4096
    heads: int = 8
    head_dim: int = 256
    depth: int = 18
    action_dim: int = 32
    o_splits: int = 2  # K splits of the O projection (K = heads x head_dim)
    down_splits: int = 4  # K splits of the down projection (K = mlp)
    keys_per_split: int = 64  # prefix keys per attention unit (a multiple of KEY_ITEM)
    a_ring_kb: int = 96  # shared memory for the activation ring; the weight ring gets the rest
    mma_depth: int = 2  # k-chunks of MMAs a GEMM keeps in flight (capped by what the rings hold; 2 measured best)
    pi05: bool = False  # π0.5: no state token, action_in_proj, adaptive norms from the step's modulation row
    acc_chains: int = 1  # 2: even / odd k-chunks into two accumulators (independent MMA chains), summed at the end
    diag: int = 0  # timing only, wrong outputs; bits: 1 skips the GEMMs' MMAs, 2 their weight / activation copies,
    # 4 the outputs' global stores (images, split-K partials, sums of squares)

    @property
    def suffix(self) -> int:
        return self.chunk + (0 if self.pi05 else 1)

    @property
    def rows(self) -> int:
        return self.batch * self.suffix

    @property
    def act_rows(self) -> int:
        return self.batch * self.chunk

    @property
    def m_tiles(self) -> int:
        return -(-self.rows // TILE)

    @property
    def m_pad(self) -> int:
        return self.m_tiles * TILE

    @property
    def keys(self) -> int:
        return self.prefix + self.suffix

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return self.q_width + 2 * self.head_dim

    # ----- shared memory ------------------------------------------------------------------------------------------
    @property
    def a_slot_bytes(self) -> int:
        """One activation-ring slot: a K or V item of attention (32 keys x 256 dims) or one k-chunk of all rows."""
        return max(KEY_ITEM * self.head_dim * 2, self.m_tiles * PAGE_BYTES)

    @property
    def a_item_chunks(self) -> int:
        """k-chunks of 64 per GEMM activation item (two when one chunk of all rows fills only half a slot)."""
        return self.a_slot_bytes // (self.m_tiles * PAGE_BYTES)

    @property
    def a_slots(self) -> int:
        """Activation slots: `a_ring_kb` of them (at least two), what is left goes to the weight ring."""
        return max(2, (self.a_ring_kb * 1024) // self.a_slot_bytes)

    @property
    def w_pages(self) -> int:
        return (SMEM_LIMIT - SMEM_MISC - SMEM_ALIGN - self.a_slots * self.a_slot_bytes) // PAGE_BYTES

    @property
    def wgmma_depth(self) -> int:
        """MMA groups in flight: the consumer then holds that many pages and items, so the rings need one more."""
        return max(1, min(self.mma_depth, self.w_pages - 1, self.a_item_chunks * (self.a_slots - 1)))

    @property
    def smem_bytes(self) -> int:
        return self.w_pages * PAGE_BYTES + self.a_slots * self.a_slot_bytes + SMEM_MISC + SMEM_ALIGN

    def key_splits(self) -> list[tuple[int, int]]:
        """Attention key ranges [start, end): the prefix in `keys_per_split` pieces, then the suffix as one."""
        out = [(k, min(k + self.keys_per_split, self.prefix)) for k in range(0, self.prefix, self.keys_per_split)]
        return out + [(self.prefix, self.keys)]

    def template_args(self) -> dict[str, int]:
        """The constexpr parameters of `expert_step.cu` (one compiled variant per distinct set)."""
        return dict(
            BATCH=self.batch, SUFFIX=self.suffix, PREFIX=self.prefix, WIDTH=self.width, MLP=self.mlp,
            HEADS=self.heads, HEAD_DIM=self.head_dim, DEPTH=self.depth, ACTION_DIM=self.action_dim,
            M_TILES=self.m_tiles, W_PAGES=self.w_pages, A_SLOTS=self.a_slots, A_SLOT_BYTES=self.a_slot_bytes,
            A_ITEM_CHUNKS=self.a_item_chunks, KEYS_PER_SPLIT=self.keys_per_split, O_SPLITS=self.o_splits,
            DOWN_SPLITS=self.down_splits, WGMMA_DEPTH=self.wgmma_depth, PI05=int(self.pi05), DIAG=self.diag,
            ACC_CHAINS=self.acc_chains,
        )  # fmt: skip


def why_unsupported(d: ExpertDims, *, num_kv_heads: int = 1) -> str | None:
    """None if the kernel computes this model, else one line saying why not."""
    checks = [
        (num_kv_heads == 1, f"needs 1 KV head, found {num_kv_heads}"),
        (d.head_dim == 256, f"needs head_dim 256, found {d.head_dim}"),
        (d.width % TILE == 0 and d.width >= TILE, f"needs a width that is a multiple of {TILE}, found {d.width}"),
        (d.mlp % (2 * TILE) == 0, f"needs an MLP width that is a multiple of {2 * TILE}, found {d.mlp}"),
        (d.action_dim <= 32, f"needs at most 32 action dims, found {d.action_dim}"),
        (d.suffix <= TILE, f"needs a chunk of at most {TILE - (0 if d.pi05 else 1)} actions, found {d.chunk}"),
        (1 <= d.m_tiles <= 8, f"needs 1..{8 * TILE} rows (batch x (1 + chunk)), found {d.rows}"),
        ((d.q_width // d.o_splits) % TILE == 0, f"O's K ({d.q_width}) must split {d.o_splits} ways in 64s"),
        ((d.mlp // d.down_splits) % TILE == 0, f"down's K ({d.mlp}) must split {d.down_splits} ways in 64s"),
        (d.keys_per_split % KEY_ITEM == 0, f"keys_per_split must be a multiple of {KEY_ITEM}"),
        (d.w_pages >= 4, f"shared memory leaves {d.w_pages} weight pages for {d.rows} rows (needs 4)"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    for k in (d.width, d.q_width // d.o_splits, d.mlp // d.down_splits):
        if (k // TILE) % d.a_item_chunks:
            return f"a GEMM K of {k} is not a whole number of {d.a_item_chunks}-chunk activation items"
    return None
