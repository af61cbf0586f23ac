// sampler.cuh: the device sampler's rules, one home for the plain sampler (decode_misc.cu's
// sample_finish) and speculative sampling (speculate.cu's sample_rows).
//
// A sampled draw over logits fp32 [V] (temperature > 0, top_k != 1; nanoqwen.sampling states the
// rules) in three block-wide parts, each called by every thread of a kSampleThreads block:
//
//   kept_set     the kept tokens' threshold: logit >= tp keeps a token (top-k, then top-p, both
//                exact selections on the logits' order-preserving keys, so ties at a threshold
//                are kept; "Thresholds" below)
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

// From the generated header (nanoqwen/cuda/registry.py): kSampleThreads (the block every
// function here runs in) and kSampleCandidates (the most logits a threshold sorts in shared
// memory).
constexpr unsigned long long kAcceptCounter = 1ull << 32;  // above any token index

// A counter-based random number in [0, 1): splitmix64 of (seed, counter).
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long counter) {
  unsigned long long z = seed + 0x9E3779B97F4A7C15ull * (counter + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// The order-preserving key of a float: a < b as floats (no NaN) iff key(a) < key(b) as
// unsigned ints; -0.0 sorts just below +0.0. Key 0 is a NaN pattern: below every logit.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The logit of an argmax key (argmax_key's float, decoded).
__device__ __forceinline__ float argmax_key_value(unsigned long long key) {
  return key_value((uint32_t)(key >> 32));
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

// ---- Thresholds ---------------------------------------------------------------------------
// Both thresholds are one selection: the largest key K with W(key >= K) >= target, W a count
// (top-k: target k) or a mass (top-p: target ceil(top_p * Z)). Masses are fixed point, each
// weight exp2f(...) <= 1 times 2^kMassBits truncated to an integer: sums are exact and
// order-free (the same in every route, every run: a seeded draw is reproducible), each weight
// off by < 2^-40 (all of V = 152k together by < 1.4e-7 of the top token's weight 1 <= Z), and
// weights under 2^-40 (logits more than 27.7 T below m) count 0 toward top-p. V < 2^23 keeps
// a sum of V weights under 2^63.
//
// A selection starts from a key range [klo, key(m)] known to hold W >= target (the bound).
// Each level is one pass over V: a 2048-bin histogram (count, and mass for top-p) of the keys
// in the range, bin = (khi - key) >> s, so bin 0 holds the largest keys and a level resolves
// 11 bits. The bin where the cumulative W (plus W above the range) reaches the target holds K.
// When every logit from that bin's lowest key up is at most kSampleCandidates, one more pass
// copies them (key, id) into shared memory and a bitonic sort orders them: K is read off the
// sorted list (top-k: its k-th key; top-p: where the prefix mass reaches the target), and the
// next threshold can work on the same list. Otherwise the range narrows to that bin and the
// next level splits it; at s = 0 a bin is one key: K exactly. So every route is exact, and
// the routes agree bit for bit (tests/test_speculate_sampled.py checks it in emulation).
//
// Bounds from the local maxima (a pass over V: thread t's largest logit among ids t, t +
// kSampleThreads, ..., sorted): top-k with k <= kSampleThreads starts at the k-th largest
// local maximum (k logits lie at or above it), usually ~k logits, so one level and the copy
// decide it; top-p alone starts at the local maximum where their own prefix mass reaches the
// target, or else at m - 32 T (every lower logit has fixed mass 0). top-k > kSampleThreads
// starts at key 0 (every logit).
//
// Costs (V = 152k, one CTA): each pass ~ one read of 600 KB from L2; the common settings
// (top-k <= 1024, a peaked distribution) take 3 passes and 2 small sorts. A flat distribution
// under top-p alone needs levels over a range spanning binades, whose bins crowd (shared
// atomics on few addresses): slower, still exact.
constexpr int kSelectBins = 2048;  // 11-bit digits
constexpr int kDigitBits = 11;
constexpr int kMassBits = 40;
constexpr float kMassScale = 1099511627776.0f;  // 2^kMassBits
// 2^-40 = e^-27.7: logits more than 27.7 T below m weigh 0 in fixed point; 32 leaves room for
// the rounding of m - 32 T (half an ulp of m, under 4 T while |m| < 256 and T >= 1e-5).
constexpr float kMassFloorNats = 32.f;
static_assert((kSampleThreads & (kSampleThreads - 1)) == 0, "bitonic sort of the local maxima");
static_assert((kSampleCandidates & (kSampleCandidates - 1)) == 0, "bitonic sort: a power of 2");
static_assert(kSampleThreads <= kSampleCandidates, "the local maxima use the candidate array");
static_assert(kSampleCandidates <= kSelectBins && kSelectBins == 2 * kSampleThreads,
              "scans take two items a thread; candidate prefix masses reuse the bin array");

struct SelectShared {
  unsigned long long cand[kSampleCandidates];  // (key << 32) | ~id, sorted descending
  unsigned long long mass[kSelectBins];  // a level's bin masses, then the candidates' weights
  unsigned int count[kSelectBins];  // a level's bin counts
  unsigned long long scratch[kSampleThreads / kWarp];
  unsigned long long cross_before;  // W (in the level's unit) before the crossing item
  unsigned int count_before;  // logits in the level's bins before the crossing bin
  int cross;  // the crossing item (bin or candidate), -1: none
  int n;  // compaction count
};

__device__ __forceinline__ unsigned long long mass_weight(float logit, float m, float inv_t) {
  return __float2ull_rz(exp2f((logit - m) * inv_t * kLog2e) * kMassScale);
}

__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v,
                                                            unsigned long long* scratch) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % kWarp == 0) scratch[threadIdx.x / kWarp] = v;
  __syncthreads();
  unsigned long long total = 0;
  for (int w = 0; w < kSampleThreads / kWarp; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// The sum of x over threads 0 .. t - 1 (thread t's exclusive prefix).
__device__ __forceinline__ unsigned long long block_exclusive_u64(unsigned long long x,
                                                                  unsigned long long* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  unsigned long long inc = x;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == kWarp - 1) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    unsigned long long t = lane < kSampleThreads / kWarp ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += y;
    }
    if (lane < kSampleThreads / kWarp) scratch[lane] = t;
  }
  __syncthreads();
  const unsigned long long out = inc - x + (warp ? scratch[warp - 1] : 0);
  __syncthreads();
  return out;
}

// Over items 2t, 2t + 1 with weights w0, w1 (and counts c0, c1), every thread calling: the
// first item where base + the inclusive prefix of w reaches target -> sh.cross (-1: none),
// with the weight and count before it -> sh.cross_before, sh.count_before.
__device__ __forceinline__ void find_crossing(unsigned long long w0, unsigned long long w1,
                                              unsigned c0, unsigned c1, unsigned long long base,
                                              unsigned long long target, SelectShared& sh) {
  if (threadIdx.x == 0) sh.cross = -1;
  const unsigned long long before = base + block_exclusive_u64(w0 + w1, sh.scratch);
  const unsigned cbefore = (unsigned)block_exclusive_u64(c0 + c1, sh.scratch);
  if (before < target && before + w0 >= target) {
    sh.cross = 2 * threadIdx.x;
    sh.cross_before = before;
    sh.count_before = cbefore;
  } else if (before + w0 < target && before + w0 + w1 >= target) {
    sh.cross = 2 * threadIdx.x + 1;
    sh.cross_before = before + w0;
    sh.count_before = cbefore + c0;
  }
  __syncthreads();
}

// Sorts a[0, P) descending (P a power of 2, <= kSampleCandidates).
__device__ __forceinline__ void sort_desc(unsigned long long* a, int P) {
  for (int k = 2; k <= P; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P; i += kSampleThreads) {
        const int p = i ^ j;
        if (p > i) {
          const unsigned long long x = a[i], y = a[p];
          if ((i & k) == 0 ? x < y : x > y) {
            a[i] = y;
            a[p] = x;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Copies every logit with key >= klow into sh.cand as (key << 32) | ~id and sorts them
// descending (the caller knows there are at most kSampleCandidates). Returns their number.
__device__ __forceinline__ int gather_candidates(const float* logits, int V, uint32_t klow,
                                                 SelectShared& sh) {
  const int lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) sh.n = 0;
  __syncthreads();
  for (int base = 0; base < V; base += kSampleThreads) {  // a uniform trip count: full ballots
    const int i = base + threadIdx.x;
    const uint32_t k = i < V ? order_key(logits[i]) : 0u;
    const bool take = i < V && k >= klow;
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask) {
      const int leader = __ffs(mask) - 1;
      int pos = 0;
      if (lane == leader) pos = atomicAdd(&sh.n, __popc(mask));
      pos = __shfl_sync(0xffffffffu, pos, leader) + __popc(mask & ((1u << lane) - 1u));
      if (take) sh.cand[pos] = ((unsigned long long)k << 32) | (0xFFFFFFFFu - (uint32_t)i);
    }
  }
  __syncthreads();
  const int n = sh.n;
  int P = 2;
  while (P < n) P <<= 1;
  for (int i = n + threadIdx.x; i < P; i += kSampleThreads) sh.cand[i] = 0ull;  // sort last
  __syncthreads();
  sort_desc(sh.cand, P);
  return n;
}

__device__ __forceinline__ uint32_t cand_key(const SelectShared& sh, int i) {
  return (uint32_t)(sh.cand[i] >> 32);
}

// The first of the sorted candidates [0, n) where the prefix mass reaches target (there is
// one: the caller's bound), every thread getting it.
__device__ __forceinline__ int mass_crossing(int n, float m, float inv_t,
                                             unsigned long long target, SelectShared& sh) {
  const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
  const unsigned long long w0 = i0 < n ? mass_weight(key_value(cand_key(sh, i0)), m, inv_t) : 0;
  const unsigned long long w1 = i1 < n ? mass_weight(key_value(cand_key(sh, i1)), m, inv_t) : 0;
  find_crossing(w0, w1, 0, 0, 0, target, sh);
  return sh.cross;
}

// target = ceil(top_p * Z) in fixed-point mass units: mass >= target iff mass >= top_p * Z.
__device__ __forceinline__ unsigned long long mass_target(float top_p, unsigned long long z) {
  return (unsigned long long)ceil((double)top_p * (double)z);
}

// A selection's result: n > 0, the candidates sh.cand[0, n) (every logit from the top down
// to past K, sorted) for the caller to read K off; n = 0, K = key. target: the one used (a
// top-p selection with target 0 takes ceil(top_p * Z), Z the first level's whole mass: klo is
// then the floor, so the level sees every logit the mass counts).
struct Selection {
  uint32_t key;
  int n;
  unsigned long long target;
};

// The largest key K in [klo, key(m)] with W(key >= K) >= target (see "Thresholds"): W counts
// logits (mass false) or sums mass_weight. W(key >= klo) >= target must hold.
__device__ __forceinline__ Selection select_key(const float* logits, int V, float m, float inv_t,
                                                bool mass, unsigned long long target,
                                                float top_p, uint32_t klo, SelectShared& sh) {
  uint32_t khi = order_key(m);
  const uint32_t span = khi - klo;
  int s = max(0, (span ? 32 - __clz((int)span) : 0) - kDigitBits);
  unsigned long long above_w = 0;  // W of the logits above khi (earlier levels' bins)
  unsigned above_n = 0;
  for (;;) {
    for (int b = threadIdx.x; b < kSelectBins; b += kSampleThreads) {
      sh.count[b] = 0;
      sh.mass[b] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += kSampleThreads) {
      const float l = logits[i];
      const uint32_t k = order_key(l);
      if (k >= klo && k <= khi) {
        const uint32_t b = (khi - k) >> s;
        atomicAdd(&sh.count[b], 1u);
        if (mass) atomicAdd(&sh.mass[b], mass_weight(l, m, inv_t));
      }
    }
    __syncthreads();
    const int b0 = 2 * threadIdx.x, b1 = b0 + 1;
    const unsigned c0 = sh.count[b0], c1 = sh.count[b1];
    const unsigned long long w0 = mass ? sh.mass[b0] : c0, w1 = mass ? sh.mass[b1] : c1;
    if (target == 0) target = mass_target(top_p, block_sum_u64(w0 + w1, sh.scratch));
    find_crossing(w0, w1, c0, c1, above_w, target, sh);
    const int b = sh.cross;
    const unsigned n_upto = above_n + sh.count_before + sh.count[b];
    if (n_upto <= (unsigned)kSampleCandidates) {
      const long long low = (long long)khi - ((long long)(b + 1) << s) + 1;
      const uint32_t klow = max(klo, (uint32_t)max(low, 0ll));
      return {0u, gather_candidates(logits, V, klow, sh), target};
    }
    if (s == 0) return {khi - (uint32_t)b, 0, target};
    above_w = sh.cross_before;
    above_n += sh.count_before;
    khi -= (uint32_t)b << s;
    const uint32_t width = (1u << s) - 1u;
    klo = max(klo, khi >= width ? khi - width : 0u);
    s = max(0, s - kDigitBits);
    __syncthreads();  // sh.cross and the bins are read above before the next level resets them
  }
}

// One pass over V: thread t's largest key among ids t, t + kSampleThreads, ... into
// sh.cand[t] (sorted descending, every thread), and the whole mass Z (with_mass).
__device__ __forceinline__ unsigned long long local_maxima(const float* logits, int V, float m,
                                                           float inv_t, bool with_mass,
                                                           SelectShared& sh) {
  uint32_t mx = 0;
  unsigned long long z = 0;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const float l = logits[i];
    mx = max(mx, order_key(l));
    if (with_mass) z += mass_weight(l, m, inv_t);
  }
  sh.cand[threadIdx.x] = (unsigned long long)mx << 32;
  z = with_mass ? block_sum_u64(z, sh.scratch) : 0;
  __syncthreads();
  sort_desc(sh.cand, kSampleThreads);
  return z;
}

// The thresholds of logits fp32 [V] (m its largest value) under temperature temp > 0, top_k
// (0 = off) and top_p (1 = off): top-k keeps logits >= tk, the largest value with
// count(l >= tk) >= top_k; top-p then keeps logits >= tp, the largest value >= tk with
// mass(l >= tp) >= top_p * mass(l >= tk) (fixed-point masses: "Thresholds"). Every thread of
// the block gets the same KeptSet.
__device__ __forceinline__ KeptSet kept_set(const float* logits, int V, float m, float temp,
                                            int top_k, float top_p) {
  __shared__ SelectShared sh;
  const float inv_t = 1.f / temp;
  const bool by_k = top_k > 0 && top_k < V, by_p = top_p < 1.f;
  if (!by_k && !by_p) return {m, inv_t, -3.0e38f};  // temperature only: every logit kept
  uint32_t tk = 0u, tp = 0u;  // keys; 0 keeps every logit
  int resident = 0;  // candidates in sh.cand holding every logit >= tk
  if (by_k) {
    uint32_t klo = 0u;
    if (top_k <= kSampleThreads) {
      local_maxima(logits, V, m, inv_t, false, sh);
      klo = cand_key(sh, top_k - 1);
    }
    const Selection r = select_key(logits, V, m, inv_t, false, top_k, 1.f, klo, sh);
    if (r.n > 0) {
      tk = cand_key(sh, top_k - 1);
      resident = r.n;
    } else {
      tk = r.key;
    }
  }
  tp = tk;
  if (by_p) {
    if (resident > 0) {
      // The candidates at or above tk: a prefix of the sorted list (ties at tk included).
      if (threadIdx.x == 0) sh.n = 0;
      __syncthreads();
      for (int i = threadIdx.x; i < resident; i += kSampleThreads)
        if (cand_key(sh, i) >= tk && (i + 1 == resident || cand_key(sh, i + 1) < tk))
          sh.n = i + 1;
      __syncthreads();
      const int nk = sh.n;
      unsigned long long z = 0;
      for (int i = threadIdx.x; i < nk; i += kSampleThreads)
        z += mass_weight(key_value(cand_key(sh, i)), m, inv_t);
      z = block_sum_u64(z, sh.scratch);
      tp = cand_key(sh, mass_crossing(nk, m, inv_t, mass_target(top_p, z), sh));
    } else {
      uint32_t klo = tk;
      unsigned long long target = 0;  // by_k: from the first level's mass over l >= tk
      if (!by_k) {
        target = mass_target(top_p, local_maxima(logits, V, m, inv_t, true, sh));
        const int j = mass_crossing(kSampleThreads, m, inv_t, target, sh);
        klo = j >= 0 ? cand_key(sh, j) : order_key(m - kMassFloorNats * temp);
      }
      const Selection r = select_key(logits, V, m, inv_t, true, target, top_p, klo, sh);
      tp = r.n > 0 ? cand_key(sh, mass_crossing(r.n, m, inv_t, r.target, sh)) : r.key;
    }
  }
  return {m, inv_t, key_value(max(tk, tp))};
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
__device__ __forceinline__ int draw_parts(const float* logits, int V, const KeptSet& s,
                                          int exclude, const float* part, float total,
                                          float u01) {
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
