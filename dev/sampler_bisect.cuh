// sampler_bisect.cuh: the bisection sampler that nanoqwen/kernels/sampler.cuh replaced (its
// thresholds by 32 + 32 block-wide passes over V), kept whole as dev/sampler_check.py's timing
// baseline: that script compiles decode_misc.cu with this file in place of sampler.cuh. Not
// product code: nothing in nanoqwen/ includes it.
//
// A sampled draw over logits fp32 [V] (temperature > 0, top_k != 1; nanoqwen.sampling states the
// rules) in three block-wide parts, each called by every thread of a kSampleThreads block:
//
//   kept_set     the kept tokens' threshold: logit >= tp keeps a token (top-k, then top-p, both
//                found by bisection on the logit value, so ties at a threshold are kept)
//   kept_parts   each thread's share of the kept weights exp((l - m) / T) over its contiguous
//                range of ids (thread t owns [t * per, (t + 1) * per)), one id left out on
//                request: speculative sampling's residual draws from p without the draft
//   draw_parts   (one thread) one inverse-CDF draw over those parts in id order
//
// Randoms are counter-based (uniform01): the same (seed, counter) gives the same draw, so a
// seeded generation is reproducible on the device. Counters: the draw of generated token t uses
// counter t (the plain sampler's, so a speculative step without drafts draws exactly as the
// plain step); the acceptance test of a draft proposed as token t uses kAcceptCounter + t.
#pragma once
constexpr int kSearchIters = 32;  // bisection steps (was a registry tunable)

// From the generated header (nanoqwen/cuda/registry.py): kSampleThreads (the block every
// function here runs in) and kSearchIters (bisection steps for the top-k / top-p thresholds).
constexpr unsigned long long kAcceptCounter = 1ull << 32;  // above any token index

// A counter-based random number in [0, 1): splitmix64 of (seed, counter).
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long counter) {
  unsigned long long z = seed + 0x9E3779B97F4A7C15ull * (counter + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// The logit of an argmax key (argmax_key's float, decoded).
__device__ __forceinline__ float argmax_key_value(unsigned long long key) {
  uint32_t b = (uint32_t)(key >> 32);
  b = (b & 0x80000000u) ? (b & 0x7FFFFFFFu) : ~b;
  return __uint_as_float(b);
}

// The id of an argmax key (the lowest id among the maximal logits).
__device__ __forceinline__ int argmax_key_id(unsigned long long key) {
  return (int)(0xFFFFFFFFu - (uint32_t)(key & 0xFFFFFFFFull));
}

// The kept set of one distribution: a token is kept when its logit >= tp; its weight is
// exp2((logit - m) * inv_t * log2 e), m the row's largest logit.
struct KeptSet {
  float m, inv_t, tp;
};

__device__ __forceinline__ float kept_weight(float logit, const KeptSet& s) {
  return logit >= s.tp ? exp2f((logit - s.m) * s.inv_t * kLog2e) : 0.f;
}

// The thresholds of logits fp32 [V] (m its largest value) under temperature temp > 0, top_k
// (0 = off) and top_p (1 = off): top-k keeps logits >= tk, the largest value with
// count(l >= tk) >= top_k; top-p then keeps logits >= tp, the largest value >= tk with
// mass(l >= tp) >= top_p * mass(l >= tk). Every thread of the block gets the same KeptSet.
__device__ KeptSet kept_set(const float* logits, int V, float m, float temp, int top_k,
                            float top_p) {
  __shared__ float red[kSampleThreads / kWarp];
  const float inv_t = 1.f / temp;
  float lo = -3.0e38f, hi = m;  // count(l >= hi) >= 1 always
  if (top_k > 0 && top_k < V) {
    float a = m - 1.f;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) a = fminf(a, logits[i]);
    // bisection on [min, m]
    __shared__ float mn_s[kSampleThreads / kWarp];
    float mn = warp_max(-a);
    if (threadIdx.x % kWarp == 0) mn_s[threadIdx.x / kWarp] = mn;
    __syncthreads();
    mn = mn_s[0];
    for (int i = 1; i < kSampleThreads / kWarp; ++i) mn = fmaxf(mn, mn_s[i]);
    __syncthreads();
    lo = -mn;
    for (int it = 0; it < kSearchIters; ++it) {
      const float mid = 0.5f * (lo + hi);
      float c = 0.f;
      for (int i = threadIdx.x; i < V; i += kSampleThreads) c += logits[i] >= mid ? 1.f : 0.f;
      c = block_sum<kSampleThreads / kWarp>(c, red);
      if (c >= top_k) lo = mid; else hi = mid;
    }
  }
  const float tk = lo;  // keep l >= tk
  float tp = tk;
  if (top_p < 1.f) {
    float z = 0.f;
    for (int i = threadIdx.x; i < V; i += kSampleThreads)
      if (logits[i] >= tk) z += exp2f((logits[i] - m) * inv_t * kLog2e);
    z = block_sum<kSampleThreads / kWarp>(z, red);
    // Largest thr >= tk with mass(l >= thr) >= top_p * z.
    float plo = tk < -1e37f ? m - 200.f * temp : tk, phi = m;
    for (int it = 0; it < kSearchIters; ++it) {
      const float mid = 0.5f * (plo + phi);
      float s = 0.f;
      for (int i = threadIdx.x; i < V; i += kSampleThreads)
        if (logits[i] >= mid && logits[i] >= tk) s += exp2f((logits[i] - m) * inv_t * kLog2e);
      s = block_sum<kSampleThreads / kWarp>(s, red);
      if (s >= top_p * z) plo = mid; else phi = mid;
    }
    tp = fmaxf(plo, tk);
  }
  return {m, inv_t, tp};
}

// Ids a thread owns in kept_parts and draw_parts: [t * per, min(V, (t + 1) * per)).
__device__ __forceinline__ int ids_per_thread(int V) {
  return (V + kSampleThreads - 1) / kSampleThreads;
}

// part[t] = thread t's sum of kept weights over its ids, `exclude` left out (-1: none);
// part: shared float [kSampleThreads], complete for every thread on return.
__device__ __forceinline__ void kept_parts(const float* logits, int V, const KeptSet& s,
                                           int exclude, float* part) {
  const int per = ids_per_thread(V);
  const int b = threadIdx.x * per, e = min(V, b + per);
  float mine = 0.f;
  for (int i = b; i < e; ++i)
    if (i != exclude) mine += kept_weight(logits[i], s);
  part[threadIdx.x] = mine;
  __syncthreads();
}

// The sum of part[] in thread order (the normaliser draw_parts scales its uniform by).
__device__ __forceinline__ float parts_total(const float* part) {
  float total = 0.f;
  for (int i = 0; i < kSampleThreads; ++i) total += part[i];
  return total;
}

// One inverse-CDF draw (one thread): the first kept id, in id order, whose cumulative weight
// passes u01 * total, `exclude` skipped as kept_parts skipped it. -1 when no kept id is found
// (total 0: the caller falls back to the argmax).
__device__ int draw_parts(const float* logits, int V, const KeptSet& s, int exclude,
                          const float* part, float total, float u01) {
  const int per = ids_per_thread(V);
  const float u = u01 * total;
  float run = 0.f;
  int owner = kSampleThreads - 1;
  for (int i = 0; i < kSampleThreads; ++i) {
    if (run + part[i] > u && part[i] > 0.f) { owner = i; break; }
    run += part[i];
  }
  const int ob = owner * per, oe = min(V, ob + per);
  int last = -1;
  for (int i = ob; i < oe; ++i) {
    if (logits[i] < s.tp || i == exclude) continue;
    last = i;
    run += kept_weight(logits[i], s);
    if (run > u) break;
  }
  return last;
}
