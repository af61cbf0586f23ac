// gemv_int4.cu: batch-1 decode GEMV over INT4 ValueShuffle weights: whole weight rows stream
// into shared memory through a few large bulk copies, tensor cores take the dot products.
//
//   out = epilogue( dequant(W) @ norm(x) )      fp16 in/out, products exact, fp32 accumulation
//
// Why mma for a GEMV: a matrix-vector product is memory-bound, but a SIMT version spends
// ~2.8 instructions per weight and rounds products to fp16. Here the dequantized half2 pairs go
// straight into mma.sync.m16n8k16 as the A operand: fp32-exact products, fewer instructions.
//
// Pairs. The output rows are taken two at a time: pair p = (row a(p), row b(p)), where a and b
// each run over consecutive rows as p does (kResidual: p and p + ceil(N/2); kSwiGLU: gate row p
// and up row N + p; kRope: rows j and j + D/2 of a head, the RoPE partners). A CTA owns a
// contiguous range of pairs (the pairs split evenly over a persistent grid of two CTAs per SM,
// or one of the wide form: at most one pair of imbalance, no cross-CTA reduction) and streams
// them in stages of up to P consecutive pairs (stage_pairs): all K of rows a(p).. and of rows
// b(p).., two contiguous runs.
//
// One mma (a "diagonal" mapping): A rows 0..7 are row a at 8 consecutive groups 8o..8o+7 (one
// group per A row), A rows 8..15 row b at the same groups, and B column n holds x at group
// 8o + n. D[m][n] then dots group 8o + m of the weights with group 8o + n of x: only the
// diagonal D[m][m] (row a) and D[8+m][m] (row b) are wanted, and they sit in lane 4m + m/2 (c0
// or c1; c2 or c3). K order inside a group does not matter for a dot product, so thread t
// (lane % 4) takes the 16-byte chunk t of its group (32 nibbles) for A and x alike, and the
// fragment's k indices (2t, 2t+1, 2t+8, 2t+9) are mapped onto that chunk's pairs. One "item"
// (pair, octet o) is 8 mma over 2 x 8 groups; a group's scale multiplies its diagonal once.
//
// Pipeline: one producer warp issues, per stage, four 1-D cp.async.bulk copies (run a, run b,
// and their scales: the 16-byte units around them, so a stage row keeps its scales at an
// offset of 0..7 halves and a copy may read up to 14 bytes past the tensor's end, inside the
// slack every Gpu.alloc leaves) that land on the stage's "full" mbarrier. Few, large copies:
// the copy engine pays per copy, and bulk copies take uniform operands, so per-lane copies
// issue one lane at a time. The ring holds as many stages as the launch's dynamic shared
// memory leaves room for (at most kGvMaxStages); the weights do not depend on the previous
// kernel, so the producer starts before anyone waits on it, but keeps only kGvEarlyStages
// stages in flight until x has landed (x queues behind every weight byte requested before it).
// The consumer warps wait (PDL) for x, stage it (RMSNorm-ed if NORM; folded for offset_word
// when K <= kGvFoldMaxK) in shared memory and keep their lanes' x chunks in registers (a warp
// takes the same octets of every pair), then take every stage: C / P warps per pair (C the
// form's consumer warps), each its own octets, and release it on "empty". The diagonal lanes
// store their fp32 sums per pair unreduced; the epilogue adds them in a fixed order
// (deterministic), with its global inputs (residual, bias, RoPE, K/V page) loaded right after
// the wait.
//
// One launch per GEMV, four a layer: a dependency between launches (PDL launch +
// griddepcontrol.wait) costs less than a grid barrier inside one persistent kernel, and neither
// the copies nor the tensor pipe bound a GEMV (its consumers' instruction stream and the wait
// for x do), so a chain of GEMVs in one launch, or gate/up fused with a split-K down, does not
// pay. Alternatives measured: docs/EXPERIMENTS.md. Inside the 7B decode step at 513 tokens
// gate/up takes ~18.8 us a launch (3.7 TB/s; nanoqwen bench FILE --kernels).
//
// Epilogues (gemv_epilogue.cuh): kRope (q/k/v: + bias, RoPE, the K/V write into the pages: the
// decode step's whole attention prologue), kResidual (o, down: + the fp32 residual stream, in
// place, and its fp16 copy), kSwiGLU (gate/up).
#include "common.cuh"
#include "kv_cache.cuh"
#include "gemv_epilogue.cuh"

// From the generated header (nanoqwen/cuda/registry.py, Geometry):
//   kGvConsumers    consumer warps; one producer warp more (kGvThreads in all)
//   kGvCtasPerSm    CTAs per SM asked of the register allocator: 2 x 9 warps leave 96
//                   registers a thread
//   kGvWideMinK     the smallest K that takes the wide form (GvForm)
//   kGvStageTarget  weight bytes a stage aims at (gate/up: twice): small launches want their
//                   first stage early, the long ones fewer, larger copies
//   kGvMaxStages    the most stages in the ring (the launch's dynamic shared memory sets how
//                   many fit)
//   kGvEarlyStages  stages the producer keeps in flight until x has landed: x (an L2 hit)
//                   queues behind every weight byte already requested on the chip, so a full
//                   ring ahead of it delays the consumers' start (landed stages do not count);
//                   with none in flight the stream restarts one HBM latency late
//   kGvFoldMaxK     the largest K that takes offset_word's form (x folded): down's K = 18944
//                   stays on dequant_word, where folding its x costs more than its stages save
//   kGvXRegItems    items whose x a consumer lane keeps in registers (16 registers each);
//                   later items read it from shared memory (gate/up has 2 items a warp, down 3,
//                   q/k/v and o 1)
//   kRope, kResidual, kSwiGLU   the epilogue ids (enum Epilogue)
constexpr int kGroupBytes = kGroupSize / 2;
constexpr bool gv_fold(int K) { return K <= kGvFoldMaxK; }

// The launch's shape for a K (the host's twin: registry.gemv_form). Below kGvWideMinK,
// kGvCtasPerSm CTAs an SM of kGvConsumers consumer warps, each with kGvSmem bytes of dynamic
// shared memory. From it on, the wide form: one CTA an SM that takes all of theirs (consumer
// warps and shared memory), since a CTA's share cannot hold x (2K bytes) beside two whole-row
// stages (about K bytes each): the 32B's down at K = 27648 needs 54 KB + 2 x 28 KB against
// 110 KB. One x an SM then leaves room for five stages, and the SM keeps its warp count.
template <int K>
struct GvForm {
  static constexpr bool kWide = K >= kGvWideMinK;
  static constexpr int kConsumers = kWide ? kGvCtasPerSm * kGvConsumers : kGvConsumers;
  static constexpr int kThreads = (kConsumers + 1) * kWarp;
  static constexpr int kCtasPerSm = kWide ? 1 : kGvCtasPerSm;
};

__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// x in shared memory, 16-byte units swizzled within each group: chunk c (0..15) of group grp
// sits at unit grp * 16 + (c ^ 2 bit3(c) ^ (grp & 1)). A quarter warp's lanes (g = 2h, 2h + 1;
// t4 = 0..3) load chunk 4 t4 + q of groups 8o + g: 8 distinct bank quads (unswizzled, the
// x register fill and the loads of the items past KR would be 4-way bank conflicts).
__device__ __forceinline__ int x_unit(int grp, int c) {
  static_assert(kGroupSize / 8 == 16, "16 chunks of 16 bytes per group");
  return grp * 16 + (c ^ (((c >> 3) & 1) << 1) ^ (grp & 1));
}

// A ValueShuffle word as the mma's A operand without the dequantization's subtractions: pairs 0
// and 2 (mask 0x000F000F and XOR 0x0008 under exponent 0x6400: common.cuh's dequant_word) are
// the halves 1032 + v, pairs 1 and 3 (taken in place, 16 x larger) 1152 + 16 v. Their x halves
// are stored divided by 16 (fold_x), so a group's dot product comes out as
// sum(v x) + 1032 sum(x of pairs 0, 2) + 1152 sum(x / 16 of pairs 1, 3); the second part, one
// number per group shared by every row, is subtracted once per group (xc). 5 instructions per
// word instead of 9. The products stay exact; the fp32 sums carry the offsets' magnitude
// (~100 x the dot product's), which costs ~7 of their 24 bits.
__device__ __forceinline__ void offset_word(uint32_t w, uint32_t (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t x = i ? w >> 8 : w;  // 0x6a = (a & b) ^ c
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(out[2 * i]) : "r"(x), "r"(0x000F000Fu),
        "r"(0x64086408u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(out[2 * i + 1]) : "r"(x), "r"(0x00F000F0u),
        "r"(0x64806480u));
  }
}
// One 16-byte x vector into offset_word's form: halves 2, 3 and 6, 7 (the B registers facing
// pairs 1 and 3) divided by 16 (exact unless subnormal); c = its share of the group's offsets.
__device__ __forceinline__ uint4 fold_x(uint4 xv, float& c) {
  half2* h = reinterpret_cast<half2*>(&xv);
  h[1] = __hmul2(h[1], __float2half2_rn(0.0625f));
  h[3] = __hmul2(h[3], __float2half2_rn(0.0625f));
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  const float2 e = __half22float2(h[2]), f = __half22float2(h[3]);
  c = 1032.f * (a.x + a.y + e.x + e.y) + 1152.f * (b.x + b.y + f.x + f.y);
  return xv;
}

template <int C>
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(C * kWarp) : "memory");
}

// Pairs per stage, a power of two dividing the consumer warps: about `target` bytes of
// weights, and (kGvBalance) at least the fewest pairs that keep every consumer warp busy. A
// stage of P pairs gives each pair C / P warps, which share its O octets: with fewer octets
// than warps some warps idle (K = 5120: 5 octets over 8 warps at P = 1), and when the octets
// do not divide evenly the busiest warp sets the stage's pace unless the extra items rotate
// (items past kGvXRegItems do: o0r). A stage's rate is P pairs over its busiest warp's items:
// P / ceil(O / WP), or P WP / O once the extras rotate; the smallest P with the best rate wins.
// Not in the wide form: its one-pair stages are already ~K bytes, and two pairs would leave
// room for two stages beside x (the 32B's down). The host's twin: registry.gemv_stage_pairs.
template <int K>
constexpr int stage_pairs(int target) {
  constexpr int C = GvForm<K>::kConsumers, O = (K / kGroupSize + 7) / 8;
  int p = 1;
  while (p < C && 2 * p * K <= target) p *= 2;
  int best = 1;
  long long best_num = 0, best_den = 1;  // the best rate so far, best_num / best_den
  for (int q = 1; kGvBalance && !GvForm<K>::kWide && q <= C; q *= 2) {
    const int wp = C / q, kx = (O + wp - 1) / wp;
    const bool rotates = kx > kGvXRegItems;
    const long long num = (long long)q * (rotates ? wp : 1), den = rotates ? O : kx;
    if (num * best_den > best_num * den) {
      best = q;
      best_num = num;
      best_den = den;
    }
  }
  return p > best ? p : best;
}

// The dot product of item KS (octet o) of one pair, scaled and summed into accA (row a) / accB
// (row b) in the diagonal lanes. wa/wb: the pair's rows in the stage; sa/sb: their scales; xr:
// this lane's x chunk of the group of the warp's first KR items (registers: a warp takes the
// same octets of every pair), later items read xs4; xc: the groups' offset terms (offset_word,
// K <= kGvFoldMaxK). 8 mma in two independent chains.
template <int KS, int G, int KR>
__device__ __forceinline__ void pair_item(const unsigned char* wa, const unsigned char* wb,
                                          const half* sa, const half* sb,
                                          const uint4 (&xr)[KR][4], const uint4* xs4,
                                          const float* xc, int o, int g, int t4, float& accA,
                                          float& accB) {
  const int grp = min(8 * o + g, G - 1);  // past the row's end: any group, unused
  const uint4 a = *reinterpret_cast<const uint4*>(wa + grp * kGroupBytes + t4 * 16);
  const uint4 b = *reinterpret_cast<const uint4*>(wb + grp * kGroupBytes + t4 * 16);
  float d[2][4] = {};
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q of the chunk: elements 8q..8q+7
    const uint4 xv = KS < KR ? xr[min(KS, KR - 1)][q] : xs4[x_unit(grp, t4 * 4 + q)];
    uint32_t pa[4], pb[4];
    if constexpr (gv_fold(G * kGroupSize)) {
      offset_word((&a.x)[q], pa);
      offset_word((&b.x)[q], pb);
    } else {
      half2 ha[4], hb[4];
      dequant_word((&a.x)[q], ha);
      dequant_word((&b.x)[q], hb);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[i] = h2u(ha[i]);
        pb[i] = h2u(hb[i]);
      }
    }
    // pairs 0, 1 (k 2t.., 2t+8..) -> chain 0; pairs 2, 3 -> chain 1
    const uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]};
    const uint32_t a1[4] = {pa[2], pb[2], pa[3], pb[3]};
    mma_16816(d[0], a0, xv.x, xv.y);
    mma_16816(d[1], a1, xv.z, xv.w);
  }
  if (t4 == g / 2 && 8 * o + g < G) {  // the diagonal lane of group 8o + g: c0 / c2 (g even),
    const bool odd = g & 1;            // c1 / c3 (odd)
    const float c = gv_fold(G * kGroupSize) ? xc[grp] : 0.f;
    const float va = (odd ? d[0][1] + d[1][1] : d[0][0] + d[1][0]) - c;
    const float vb = (odd ? d[0][3] + d[1][3] : d[0][2] + d[1][2]) - c;
    accA = fmaf(__half2float(sa[grp]), va, accA);
    accB = fmaf(__half2float(sb[grp]), vb, accB);
  }
}

// Items KS.. of the warp, one at a time: its octets o0 + k * dO for k < KR (x in registers),
// then o0r + k * dO (x from shared memory). One at a time leaves the registers for KR = 2
// (two at a time, the items' chains interleaved, gate/up spills at KR = 2 under the 96-register
// budget). o0r rotates with the stage, so when the octets do not divide evenly over the warps
// (down: 19 over 8) every warp takes its share of the extra ones: the warps run up to a ring's
// length apart.
template <int KS, int G, int KX, int KR>
__device__ __forceinline__ void warp_items(const unsigned char* wa, const unsigned char* wb,
                                           const half* sa, const half* sb,
                                           const uint4 (&xr)[KR][4], const uint4* xs4,
                                           const float* xc, int o0, int o0r, int dO, int g,
                                           int t4, float& accA, float& accB) {
  if constexpr (KS < KX) {
    constexpr int O = (G + 7) / 8;
    const int o = (KS < KR ? o0 : o0r) + KS * dO;
    if (o < O) pair_item<KS, G, KR>(wa, wb, sa, sb, xr, xs4, xc, o, g, t4, accA, accB);
    warp_items<KS + 1, G, KX, KR>(wa, wb, sa, sb, xr, xs4, xc, o0, o0r, dO, g, t4, accA, accB);
  }
}

// x        fp16   [K]            activations (one token), 16-byte aligned
// norm_w   fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight  uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N, [gate; up])
// scales   fp16   [R, K/128]
// bias     fp16   [N]            kRope only (q | k | v biases)
// out      fp16   [N]            kResidual: the fp16 copy of the new residual (what the next
//                                RMSNorm reads); kRope: q fp16 [kHeads, kHeadDim] (rotated;
//                                only kQSize used)
// res      fp32   [N]            kResidual only: the residual stream, read and written in place
// N        int                   output features (kRope: kQKVSize)
// kRope only: pos int32* (the token's position; device memory), rope float2 [max_pos,
//   kHeadDim/2] (cos, sin), pages int32 [max_pages], kc/vc this layer's caches
//   (kv_cache.cuh). Other epilogues ignore them (pass 0).
// Grid: at most one CTA per pair (ceil(N/2) pairs; kSwiGLU: N); block GvForm<K>::kThreads.
// Dynamic shared memory: the ring, x (K halves) and the per-pair sums; at least two stages
// must fit (the host checks: registry.gemv_stages).
template <int K, bool NORM, int EPI>
__global__ void __launch_bounds__(GvForm<K>::kThreads, GvForm<K>::kCtasPerSm)
gemv_int4(const half* __restrict__ x, const half* __restrict__ norm_w,
          const unsigned char* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, float* res, int N, const int* pos,
          const float2* __restrict__ rope, const int* __restrict__ pages, half* kc, half* vc) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  constexpr int C = GvForm<K>::kConsumers;   // consumer warps; warp C produces
  constexpr int G = K / kGroupSize;          // groups per row
  constexpr int O = (G + 7) / 8;             // octets per row
  constexpr int P = stage_pairs<K>(EPI == kSwiGLU ? 2 * kGvStageTarget : kGvStageTarget);
  constexpr int WP = C / P;                  // warps per pair
  constexpr int kRunBytes = P * K / 2;       // one run of P rows
  constexpr int kScaleBytes = (P * G * 2 + 28 + 15) / 16 * 16;  // + 16-byte alignment
  constexpr int kStageBytes = (2 * kRunBytes + 2 * kScaleBytes + 127) / 128 * 128;
  static_assert(EPI != kRope || (kHeadDim / 2) % P == 0, "a stage must not straddle two heads");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full_bar[kGvMaxStages], empty_bar[kGvMaxStages];
  __shared__ __align__(8) unsigned long long x_bar;  // x staged: the producer may fill the ring
  __shared__ float nred[C];

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int pairs = EPI == kSwiGLU ? N : (N + 1) / 2;
  const int half_n = (N + 1) / 2;  // kResidual: row b(p) = p + half_n
  const int p0 = (int)(blockIdx.x * (unsigned)pairs / gridDim.x);
  const int p1 = (int)((blockIdx.x + 1) * (unsigned)pairs / gridDim.x);
  const int npairs = p1 - p0;

  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  constexpr int kXcFloats = (G + 1) / 2 * 2;  // xc, padded for red's 8-byte alignment
  const int red_bytes = npairs * WP * 8 * 2 * 4;
  const int stages =
      min(kGvMaxStages, ((int)dyn - K * 2 - kXcFloats * 4 - red_bytes) / kStageBytes);
  if (stages < 2) __trap();  // a launch the host must not make
  half* xs = reinterpret_cast<half*>(smem + stages * kStageBytes);
  // The diagonal lanes' sums, [WP * 8][npairs] float2: the epilogue's thread per pair reads
  // consecutive pairs across a warp (pair-major, it would read 32-way bank conflicts).
  float* xc = reinterpret_cast<float*>(xs + K);  // [G] the groups' offset terms (offset_word)
  float2* red = reinterpret_cast<float2*>(xc + kXcFloats);
  const uint32_t ring = smem_addr(smem);

  auto row_a = [](int p) { return pair_row_a<EPI>(p); };
  auto row_b = [&](int p) { return pair_row_b<EPI>(p, N, half_n); };
  // Pairs in the stage starting at pair p.
  auto stage_len = [&](int p) -> int {
    const int n = min(P, p1 - p);
    return EPI == kRope ? min(n, kHeadDim / 2 - p % (kHeadDim / 2)) : n;
  };
  // The epilogue's global inputs, loaded before the stage loop (gemv_epilogue.cuh: why).
  auto epi_load = [&](int p) {
    return epi_inputs<EPI>(p, res, N, half_n, bias, pos, rope, pages);
  };

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);  // the producer's arrive.expect_tx
      mbar_init(smem_addr(&empty_bar[s]), C);
    }
    mbar_init(smem_addr(&x_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();  // the whole grid is resident: the next kernel may launch (and wait)
  EpiIn epi_in{};  // consumers: the epilogue inputs of pair p0 + tid

  if (warp == C) {
    // ---- producer warp: weights and scales are constant, nothing to wait for. Lanes 0, 1
    // copy run a and run b, lanes 2, 3 their scales.
    int slot = 0, phase = 0;
    bool x_in = false;
    for (int p = p0, i = 0; p < p1; ++i) {
      const int np = stage_len(p);
      const int r0 = lane & 1 ? row_b(p) : row_a(p);
      const int rows = max(0, min(np, (EPI == kSwiGLU ? 2 * N : N) - r0));
      const uint32_t st = ring + slot * kStageBytes;
      const void* src = nullptr;
      uint32_t dst = 0, bytes = 0;
      if (lane < 2) {
        src = qweight + (size_t)r0 * (K / 2);
        dst = st + lane * kRunBytes;
        bytes = rows * (K / 2);
      } else if (lane < 4) {
        const size_t e0 = ((size_t)r0 * G) & ~(size_t)7;  // 16-byte units
        src = scales + e0;
        dst = st + 2 * kRunBytes + (lane - 2) * kScaleBytes;
        bytes = rows ? (uint32_t)((((size_t)(r0 + rows) * G + 7) & ~(size_t)7) - e0) * 2 : 0;
      }
      const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
      if (!x_in && i >= kGvEarlyStages) {  // until x is in: stage i - kGvEarlyStages landed
        const int j = i - kGvEarlyStages;     // (j < stages: nothing is consumed before x)
        const uint32_t jb = smem_addr(&full_bar[j % stages]), jp = (j / stages) & 1;
        while (!(x_in = mbar_test(smem_addr(&x_bar), 0)) && !mbar_test(jb, jp)) {
        }
      }
      if (i >= stages) mbar_wait(smem_addr(&empty_bar[slot]), phase ^ 1);
      const uint32_t full = smem_addr(&full_bar[slot]);
      if (lane == 0) mbar_arrive_expect_tx(full, total);
      __syncwarp();
      if (bytes) bulk_g2s(dst, src, bytes, full);
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
      p += np;
    }
  } else {
    // ---- consumer warps: x -> shared memory (x_unit order; RMSNorm-ed in place if NORM).
    constexpr int kXVecs = K / 8, kCThreads = C * kWarp;
    constexpr int kNV = (kXVecs + kCThreads - 1) / kCThreads;  // x vectors per thread
    uint4* xs4 = reinterpret_cast<uint4*>(xs);
    uint4 nw[kNV];  // NORM: this thread's norm weights, loaded before the wait (constant)
    if (NORM) {
#pragma unroll
      for (int u = 0; u < kNV; ++u)
        if (tid + u * kCThreads < kXVecs)
          nw[u] = reinterpret_cast<const uint4*>(norm_w)[tid + u * kCThreads];
    }
    pdl_wait();
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int v = tid; v < kXVecs; v += kCThreads)
      cp_async16(xs4 + x_unit(v / 16, v % 16), x4 + v);
    if (tid < npairs) epi_in = epi_load(p0 + tid);
    cp_async_wait_all();
    consumer_sync<C>();
    if (tid == 0) mbar_arrive(smem_addr(&x_bar));
    float rstd = 1.f;
    if (NORM) {
      const float ss = warp_sum(sum_squares(xs4, kXVecs, tid, kCThreads));
      if (lane == 0) nred[warp] = ss;
      consumer_sync<C>();
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < C; ++w) total += nred[w];
      rstd = rsqrtf(total / K + kRmsEps);
    }
    // x into offset_word's form (RMSNorm-ed first if NORM) and each group's offset term: the
    // 16 vectors of a group sit in 16 consecutive lanes.
#pragma unroll
    for (int u = 0; u < kNV; ++u) {
      const int v = tid + u * kCThreads;
      if constexpr (gv_fold(K)) {
        float c = 0.f;
        if (v < kXVecs) {
          uint4& xv = xs4[x_unit(v / 16, v % 16)];
          xv = fold_x(NORM ? rmsnorm_vec(xv, nw[u], rstd) : xv, c);
        }
#pragma unroll
        for (int m = 1; m < 16; m *= 2) c += __shfl_xor_sync(0xffffffffu, c, m);
        if (v < kXVecs && v % 16 == 0) xc[v / 16] = c;
      } else if (NORM && v < kXVecs) {
        uint4& xv = xs4[x_unit(v / 16, v % 16)];
        xv = rmsnorm_vec(xv, nw[u], rstd);
      }
    }
    if constexpr (NORM || gv_fold(K)) consumer_sync<C>();

    const int g = lane / 4, t4 = lane % 4;
    const int pp = warp / WP, o0 = warp % WP;  // this warp's pair in a stage, first octet
    // x of this lane's group in the warp's first KR octets o0, o0 + WP, ... (of KX at most):
    // 16 registers each; with two CTAs of 9 warps per SM a thread has 96 (five warps on an SM
    // quarter's 16K registers; the wide form's 17 warps too).
    constexpr int KX = (O + WP - 1) / WP, KR = KX < kGvXRegItems ? KX : kGvXRegItems;
    uint4 xr[KR][4];
#pragma unroll
    for (int k = 0; k < KR; ++k) {
      const int grp = min(8 * (o0 + k * WP) + g, G - 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) xr[k][q] = xs4[x_unit(grp, t4 * 4 + q)];
    }
    int slot = 0, phase = 0;
    for (int p = p0; p < p1;) {
      const int np = stage_len(p);
      mbar_wait(smem_addr(&full_bar[slot]), phase);
      if (pp < np) {
        const unsigned char* st = smem + slot * kStageBytes;
        const half* sc = reinterpret_cast<const half*>(st + 2 * kRunBytes);
        const half* sa = sc + (((size_t)row_a(p) * G) & 7) + pp * G;
        const half* sb = sc + kScaleBytes / 2 + (((size_t)row_b(p) * G) & 7) + pp * G;
        const unsigned char* wa = st + pp * (K / 2);
        const unsigned char* wb = st + kRunBytes + pp * (K / 2);
        float accA = 0.f, accB = 0.f;
        warp_items<0, G, KX, KR>(wa, wb, sa, sb, xr, xs4, xc, o0, (o0 + p) % WP, WP, g, t4,
                                 accA, accB);
        if (t4 == g / 2)  // the diagonal lanes' sums, unreduced (no shuffles on the way)
          red[(o0 * 8 + g) * npairs + p + pp - p0] = make_float2(accA, accB);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[slot]));
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
      p += np;
    }
  }
  __syncthreads();

  // ---- epilogue, one thread per pair: the warps' sums in a fixed order.
  for (int i = tid; i < npairs; i += GvForm<K>::kThreads) {
    const int p = p0 + i;
    // The consumer threads loaded their first pair's inputs before the stages.
    const EpiIn e = i == tid && warp < C ? epi_in : epi_load(p);
    float da = 0.f, db = 0.f;
#pragma unroll 8
    for (int j = 0; j < WP * 8; ++j) {
      const float2 v = red[j * npairs + i];
      da += v.x;
      db += v.y;
    }
    epi_finish<EPI>(p, da, db, e, out, res, N, half_n, kc, vc);
  }
}
