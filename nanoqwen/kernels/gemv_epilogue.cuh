// gemv_epilogue.cuh: the pairs of weight rows the INT4 GEMVs take together (gemv_int4.cu,
// gemv_rows.cu) and what they do with a pair's two dot products for one token (their
// epilogues, the Epilogue ids of the generated header). Needs the model header and
// kv_cache.cuh.
//
//   kRope     (q/k/v projection) + bias, then RoPE on q and k (the pair is (x1, x2) of one
//             rotation) in fp32 and the K/V write into the paged cache (kv_cache.cuh)
//   kResidual (o_proj, down_proj)  res[n] += dot (in place: the fp32 residual stream), and
//             out[n] = fp16(res[n]), the copy the next RMSNorm reads
//   kSwiGLU   (fused gate/up)      out[n] = silu(dot_gate) * dot_up
#pragma once

// Weight row a(p) of pair p: kRope the first of a head's RoPE partners j, j + D/2; else p.
template <int EPI>
__device__ __forceinline__ int pair_row_a(int p) {
  if (EPI == kRope) return p / (kHeadDim / 2) * kHeadDim + p % (kHeadDim / 2);
  return p;
}

// Weight row b(p): kRope the partner j + D/2; kSwiGLU the up row N + p of [gate; up];
// kResidual p + half_n, half_n = ceil(N/2) (past the matrix for the last pair of an odd N:
// never copied, never stored).
template <int EPI>
__device__ __forceinline__ int pair_row_b(int p, int N, int half_n) {
  if (EPI == kRope) return pair_row_a<EPI>(p) + kHeadDim / 2;
  return p + (EPI == kSwiGLU ? N : half_n);
}

// What a pair's epilogue reads from global memory. A kernel loads it well before the sums are
// ready: under the weight stream an L2 round trip takes ~1 us, and waited for at the end it
// would add that to the launch. kResidual: the fp32 residual at rows a, b; kRope: the biases,
// (cos, sin), the K/V page and the token's slot in it.
struct EpiIn {
  float a, b;
  float2 cs;
  int page, t;
};

// EpiIn of pair p for one token: res its row of the fp32 residual stream (kResidual), pos its
// position and pages its page table (kRope); half_n = ceil(N/2) (pair_row_b).
template <int EPI>
__device__ __forceinline__ EpiIn epi_inputs(int p, const float* res, int N, int half_n,
                                            const half* bias, const int* pos, const float2* rope,
                                            const int* pages) {
  EpiIn in{};
  if (EPI == kResidual) {
    in.a = res[p];
    if (p + half_n < N) in.b = res[p + half_n];
  } else if (EPI == kRope) {
    const int ra = pair_row_a<EPI>(p), ps = *pos;
    in.a = __half2float(bias[ra]);
    in.b = __half2float(bias[pair_row_b<EPI>(p, N, half_n)]);
    if (ra < kQSize + kKVSize) in.cs = rope[(size_t)ps * (kHeadDim / 2) + ra % kHeadDim];
    if (ra >= kQSize) in.page = pages[ps / kPageTokens];
    in.t = ps % kPageTokens;
  }
  return in;
}

// The epilogue of pair p for one token from its rows' sums da (row a) and db (row b): out its
// row of the output (kRope: of q; kResidual: the fp16 copy of the residual), res its row of
// the fp32 residual stream (kResidual), kc / vc the layer's K / V caches (kRope).
template <int EPI>
__device__ __forceinline__ void epi_finish(int p, float da, float db, const EpiIn& in, half* out,
                                           float* res, int N, int half_n, half* kc, half* vc) {
  if (EPI == kRope) {
    // q and k heads rotate (x1, x2) = (row j, row j + D/2) in fp32, then round once (q, v) or
    // go into the K cache whole (store_k).
    const int ra = pair_row_a<EPI>(p), rb = pair_row_b<EPI>(p, N, half_n);
    float a = da + in.a, b = db + in.b;
    if (ra < kQSize + kKVSize) {
      const float x1 = a, x2 = b;
      a = x1 * in.cs.x - x2 * in.cs.y;
      b = x2 * in.cs.x + x1 * in.cs.y;
    }
    if (ra < kQSize) {
      out[ra] = __float2half_rn(a);
      out[rb] = __float2half_rn(b);
    } else if (ra < kQSize + kKVSize) {  // rows ra, rb are dims d, d + D/2 of one kv head
      const int f = ra - kQSize, kh = f / kHeadDim, d = f % kHeadDim;
      store_k(kc, k_offset(in.page, kh, in.t, d), a);
      store_k(kc, k_offset(in.page, kh, in.t, d + kHeadDim / 2), b);
    } else {
      const int f = ra - kQSize - kKVSize, kh = f / kHeadDim, d = f % kHeadDim;
      vc[v_offset(in.page, kh, in.t, d)] = __float2half_rn(a);
      vc[v_offset(in.page, kh, in.t, d + kHeadDim / 2)] = __float2half_rn(b);
    }
  } else if (EPI == kSwiGLU) {
    out[p] = __float2half_rn(da / (1.f + __expf(-da)) * db);
  } else {
    const float a = in.a + da, b = in.b + db;
    res[p] = a;
    out[p] = __float2half_rn(a);
    if (p + half_n < N) {
      res[p + half_n] = b;
      out[p + half_n] = __float2half_rn(b);
    }
  }
}
