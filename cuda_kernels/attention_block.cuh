// One attention block's arithmetic: 64 query rows of one head against one item of keys, as the expert kernel
// (expert_step.cu's `attention`) runs it and the stage probe (tools/unit_probe.cu's ATTN unit) times it. One copy, so
// the probe times the kernel's own instructions. Needs ptx.cuh (wgmma wrappers, sw128_desc, pack_bf16).
//
// A thread's m64n32 score fragment sc[16] holds rows 16 warp + g (hh = 0) and + 8 (hh = 1) of the warpgroup, element
// 4 j + 2 hh + e (j < 4, e < 2) at key column 8 j + 2 (lane % 4) + e. o[c] is the m64n64 output fragment of the
// warpgroup's head dims (2 wg + c) x 64 .. + 63.

// S += Q K^T over head_dim 256: Q as 16 k16 register quads, K an item of `item_rows` keys landed at `kaddr` in four
// 64-dim chunks of 128-byte swizzled rows (between the caller's wgmma fence and commit)
__device__ __forceinline__ void attn_scores(float (&sc)[16], const uint32_t (&q)[16][4], uint32_t kaddr,
                                            int item_rows) {
#pragma unroll
  for (int kk = 0; kk < 16; ++kk)
    wgmma_n32_rs(sc, q[kk], sw128_desc(kaddr + (kk / 4) * item_rows * 128 + (kk % 4) * 32, 16, 1024), kk != 0);
}

// The online softmax over one item: sc already in the log2 domain and masked (-inf), into p; the running max m and
// sum l of each row pair updated and the output o rescaled. A row that has seen no key keeps m = -inf, p = 0.
__device__ __forceinline__ void attn_softmax(const float (&sc)[16], float (&p)[16], float (&m)[2], float (&l)[2],
                                             float (&o)[2][32]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx = fmaxf(mx, sc[4 * j + 2 * hh + e]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m[hh], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m[hh] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * hh + e;
        p[i] = exp2f(sc[i] - m_use);
        sum += p[i];
      }
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    l[hh] = l[hh] * alpha + sum;
    m[hh] = m_new;
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[c][4 * j + 2 * hh] *= alpha;
        o[c][4 * j + 2 * hh + 1] *= alpha;
      }
  }
}

// P as two k16 register quads of bf16 pairs (the m64n32 accumulator layout is the A-fragment layout of k16 slices)
__device__ __forceinline__ void attn_pack_p(const float (&p)[16], uint32_t (&pa)[2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    pa[kk][0] = pack_bf16(p[8 * kk + 0], p[8 * kk + 1]);
    pa[kk][1] = pack_bf16(p[8 * kk + 2], p[8 * kk + 3]);
    pa[kk][2] = pack_bf16(p[8 * kk + 4], p[8 * kk + 5]);
    pa[kk][3] = pack_bf16(p[8 * kk + 6], p[8 * kk + 7]);
  }
}

// O += P V for warpgroup `wg`'s 128 head dims: V an item of `item_rows` keys landed at `vaddr`, N-major (between the
// caller's wgmma fence and commit)
__device__ __forceinline__ void attn_pv(float (&o)[2][32], const uint32_t (&pa)[2][4], uint32_t vaddr, int wg,
                                        int item_rows) {
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      wgmma_n64_rs_tn(o[c], pa[kk],
                      sw128_desc(vaddr + (2 * wg + c) * item_rows * 128 + kk * 16 * 128, item_rows * 128, 1024));
}
