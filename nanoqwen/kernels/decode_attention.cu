// decode_attention.cu: paged GQA decode attention, split along the sequence (flash-decoding).
//
// attn_decode_split: grid (kKVHeads, kAttnSplits), block kAttnWarps warps. The L = pos + 1
//   cached tokens are cut into kAttnSplits ranges of whole pages (the split size follows L at
//   run time, so the grid never changes shape inside the captured graph). A CTA serves the
//   kGroupRatio query heads of one KV head, so each K/V row is read once for all of them.
//   Warp w takes tokens start + w, start + w + kAttnWarps, ...; lane l holds head dims
//   [kDL*l, kDL*l + kDL). Scores: per-lane partial dots + warp_sum; fp32 online softmax (base 2,
//   scale folded into q). The CTA merges its warps in shared memory and writes unnormalized
//   partials (m, l, acc[kHeadDim]) per query head and split.
// attn_decode_combine: grid kHeads, block kHeadDim: merges the splits, writes fp16 out.
//
// Not yet the issue's design (a TMA producer warp feeding cp.async.bulk stages on mbarriers):
// this is the plain-load version, validated first; see the engine notes.
#include "decode_common.cuh"

constexpr int kAttnWarps = 4;
constexpr int kDL = kHeadDim / kWarp;  // head dims per lane
static_assert(kHeadDim % (2 * kWarp) == 0, "a lane loads its dims as half2 pairs");
static_assert(kHeads % kKVHeads == 0, "GQA groups must divide evenly");

// q        fp16 [kHeads, kHeadDim]            RoPE applied
// kc, vc   fp16 [num_pages, kPageTokens, kKVHeads, kHeadDim]   this layer's caches
// pages    int32 [max_pages]                  page table
// pos      int32 *                            position of the current token (L = *pos + 1)
// part_ml  fp32 [kHeads, kAttnSplits, 2]      (running max m in log2 units, sum l)
// part_acc fp32 [kHeads, kAttnSplits, kHeadDim]  unnormalized sum p * v
extern "C" __global__ void __launch_bounds__(kAttnWarps * kWarp)
attn_decode_split(const half* __restrict__ q, const half* __restrict__ kc,
                  const half* __restrict__ vc, const int* __restrict__ pages, const int* pos,
                  float* __restrict__ part_ml, float* __restrict__ part_acc) {
  constexpr int G = kGroupRatio;
  __shared__ float sm_m[kAttnWarps][G], sm_l[kAttnWarps][G];
  __shared__ float sm_acc[kAttnWarps][G][kHeadDim];
  const int kvh = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  pdl_wait();
  pdl_trigger();
  const int L = *pos + 1;
  const int pages_total = (L + kPageTokens - 1) / kPageTokens;
  const int pages_per = (pages_total + kAttnSplits - 1) / kAttnSplits;
  const int t0 = split * pages_per * kPageTokens;
  const int t1 = min(L, t0 + pages_per * kPageTokens);

  const float qscale = rsqrtf((float)kHeadDim) * kLog2e;
  float qf[G][kDL], acc[G][kDL], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const half2* q2 = reinterpret_cast<const half2*>(q + (kvh * G + g) * kHeadDim + lane * kDL);
#pragma unroll
    for (int i = 0; i < kDL / 2; ++i) {
      const float2 f = __half22float2(q2[i]);
      qf[g][2 * i] = f.x * qscale;
      qf[g][2 * i + 1] = f.y * qscale;
    }
#pragma unroll
    for (int i = 0; i < kDL; ++i) acc[g][i] = 0.f;
    m[g] = neg_inf();
    l[g] = 0.f;
  }

  for (int t = t0 + warp; t < t1; t += kAttnWarps) {
    const size_t slot = (size_t)pages[t / kPageTokens] * kPageTokens + t % kPageTokens;
    const size_t off = (slot * kKVHeads + kvh) * kHeadDim + lane * kDL;
    float kf[kDL], vf[kDL];
    const half2* k2 = reinterpret_cast<const half2*>(kc + off);
    const half2* v2 = reinterpret_cast<const half2*>(vc + off);
#pragma unroll
    for (int i = 0; i < kDL / 2; ++i) {
      const float2 a = __half22float2(k2[i]), b = __half22float2(v2[i]);
      kf[2 * i] = a.x;
      kf[2 * i + 1] = a.y;
      vf[2 * i] = b.x;
      vf[2 * i + 1] = b.y;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kDL; ++i) s = fmaf(qf[g][i], kf[i], s);
      s = warp_sum(s);
      const float mn = fmaxf(m[g], s);
      const float corr = exp2f(m[g] - mn), p = exp2f(s - mn);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int i = 0; i < kDL; ++i) acc[g][i] = fmaf(acc[g][i], corr, p * vf[i]);
      m[g] = mn;
    }
  }

  // Merge the warps of this CTA.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kDL; ++i) sm_acc[warp][g][lane * kDL + i] = acc[g][i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * kHeadDim; i += blockDim.x) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float c = sm_m[w][g] == neg_inf() ? 0.f : exp2f(sm_m[w][g] - mx);
      lsum += sm_l[w][g] * c;
      a += sm_acc[w][g][d] * c;
    }
    const int hq = kvh * G + g;
    part_acc[((size_t)hq * kAttnSplits + split) * kHeadDim + d] = a;
    if (d == 0) {
      part_ml[(hq * kAttnSplits + split) * 2] = mx;
      part_ml[(hq * kAttnSplits + split) * 2 + 1] = lsum;
    }
  }
}

// part_ml, part_acc as above; out fp16 [kHeads, kHeadDim] = softmax(q k^T / sqrt(d)) v.
// Grid kHeads, block kHeadDim (thread d owns dim d). Empty splits carry m = -inf, l = 0.
extern "C" __global__ void __launch_bounds__(kHeadDim)
attn_decode_combine(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                    half* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  const int hq = blockIdx.x, d = threadIdx.x;
  const float* ml = part_ml + hq * kAttnSplits * 2;
  float mx = neg_inf();
  for (int s = 0; s < kAttnSplits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float lsum = 0.f, a = 0.f;
  for (int s = 0; s < kAttnSplits; ++s) {
    if (ml[2 * s] == neg_inf()) continue;
    const float c = exp2f(ml[2 * s] - mx);
    lsum += ml[2 * s + 1] * c;
    a += part_acc[((size_t)hq * kAttnSplits + s) * kHeadDim + d] * c;
  }
  out[hq * kHeadDim + d] = __float2half_rn(a / lsum);
}
