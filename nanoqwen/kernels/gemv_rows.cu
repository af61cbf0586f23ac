// gemv_rows.cu: the INT4 GEMV over M = 1..16 activation rows with one pass over the weights
// (the multi-token decode step: K + 1 speculative tokens of one sequence, or B sequences).
//
//   out[r, :] = epilogue( dequant(W) @ norm(x[r, :]) )   r < M; fp16 in/out, fp32 accumulation
//
// The mma mapping: the columns of B are the tokens. A = 16 weight rows x k16 dequantized from
// ValueShuffle words, B = x of 8 tokens x k16, D = 16 rows x 8 tokens. Thread t4 (lane % 4)
// takes the 16-byte chunk t4 of a group row for A and the same 32 elements of x for B, exactly
// as gemv_int4.cu does (K order inside a group is free as long as A and B agree): word q of the
// chunk feeds two mma (its pairs 0, 1 and 2, 3). M is a runtime argument; MT = 8 or 16 (one or
// two n8 token tiles) is the compile-time bucket, tokens r >= M are zero and never written.
// Every group's fp32 partial (fresh D) is multiplied by its row's scale into the accumulators.
//
// Decomposition (why): x of M rows does not fit in shared memory whole (down at K = 18944:
// 303 KB for M = 8), and a CTA that owns whole weight rows must read all of x: 264 CTAs x M x
// 2K bytes is 80 MB of L2 reads for down's 34 MB of weights at M = 8. So both N and K are cut:
//   - a row block is kMrPairs = 64 pairs (128 rows: run a(p..p+63) and run b(p..p+63), the
//     pairs of gemv_int4.cu, so that SwiGLU's gate/up and RoPE's partners meet in one block;
//     rows are copied one by one, so a block may span heads: head_dim 64 at 0.5B);
//   - the work is (row block, group) units, nb x G, split evenly over a persistent grid of
//     kMrCtasPerSm CTAs an SM (stream-K: a CTA's range crosses block boundaries, so there is
//     no wave tail: gate/up's 296 blocks do not fit 264 CTAs, but 8288 units do to within one);
//   - a CTA streams its range in stages of kMrStageGroups groups of its current block: 32 KB
//     of weights and x of MT tokens over the same 512 k (8 / 16 KB) staged beside them by
//     cp.async (every thread: a single producer warp cannot issue 16-byte copies fast enough,
//     and a K slice of 128 rows is 128 runs of 256 bytes, too short for bulk copies).
//   L2 traffic at M = 16 (7B): x is read once per row block, M x K x 2 x nb: down 14 MB for
//   34 MB of weights, gate/up 34 MB for 68 MB, q/k/v 4 MB for 8 MB; per 8 rows it halves. A
//   piece (one CTA's part of a block) writes MT x 128 fp32 partials: down ~10 pieces a block,
//   4 MB written and read at M = 16; gate/up ~2 a block, 9 MB.
//   Warps: 8 = 2 row halves (64 rows, four m16 tiles each) x 4 k lanes (group kl of a stage):
//   a warp keeps its group's x in registers (16 per token tile) across its four row tiles, so
//   shared memory serves M / 16 bytes of x per byte of weights. Registers at MT = 16: 32
//   accumulators, 32 of x, 8 of D: beside the rest they need ~170, so MT = 16 runs one CTA an
//   SM (mr_ctas_per_sm); MT = 8 fits two CTAs of 256 threads (128 registers; ptxas -v).
//   Shared memory: kMrStages = 2 stages of 42 / 50 KB (MT = 8 / 16): one stage in flight while
//   the other is consumed, ~64 KB of weight copies in flight an SM at MT = 8, half at MT = 16.
// Reduction (deterministic): at a piece's end the four k lanes' sums are added in lane order
// in shared memory (aliasing the stage just consumed), written to the piece's slot of the
// workspace (slot = this CTA's index - the first CTA of the block), and the CTA adds its
// groups to the block's counter (acq_rel). The CTA that completes the count adds every slot in
// slot order, runs the epilogue and zeroes the counter (so a captured graph replays).
// RMSNorm (NORM): a CTA never sees a whole row of x. Each stage is normalized by its own RMS
// (c = rsqrt(mean(x^2 over the stage's groups) + eps), B = fp16(x c w), so B stays in fp16's
// range) and its groups' partials are multiplied by 1 / c; the stages' sums of squares travel
// with the partials, and the last CTA multiplies the block's sums by the row's rstd. The
// products differ from the reference's fp16(x rstd w) by one fp16 rounding of x c w.
//
// Epilogues (per token row r; the ids of gemv_int4.cu):
//   kRope     + bias, RoPE at pos[r], K/V into the pages at pos[r] (page table pages +
//             r * page_stride), q to out[r, :]
//   kResidual out[r, n] += dot (in place)
//   kSwiGLU   out[r, n] = silu(dot_gate) * dot_up
#include "common.cuh"
#include "kv_cache.cuh"

// From the generated header (nanoqwen/cuda/registry.py, Geometry):
//   kMrWarps        warps a CTA: 2 row halves x kMrStageGroups k lanes
//   kMrCtasPerSm    CTAs an SM (the persistent grid; 128 registers a thread)
//   kMrPairs        pairs a row block (128 rows)
//   kMrStageGroups  groups a stage (one per k lane)
//   kMrStages       stages in the ring
constexpr int kMrGroupBytes = kGroupSize / 2;
constexpr int kMrRows = 2 * kMrPairs;  // weight rows a block
__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
static_assert(kMrWarps == 2 * kMrStageGroups, "warps = 2 row halves x one k lane a group");
static_assert(kMrPairs % 16 == 0 && kMrPairs / 16 == 4, "a warp takes four m16 row tiles");

// A stage's layout (bytes): weights [SG][128 rows][64] (rows 64 bytes apart: a quarter warp's
// two rows x four chunks are 128 contiguous bytes, no bank conflict), x [MT][SG x 128] fp16,
// norm weights [SG x 128] fp16, scales [128 rows][SG] fp16. The host's twin:
// registry.rows_stage_bytes.
template <int MT>
struct MrStage {
  static constexpr int kW = 0;
  static constexpr int kX = kMrStageGroups * kMrRows * kMrGroupBytes;
  static constexpr int kNw = kX + MT * kMrStageGroups * kGroupSize * 2;
  static constexpr int kSc = kNw + kMrStageGroups * kGroupSize * 2;
  static constexpr int kBytes = kSc + kMrRows * kMrStageGroups * 2;
  // The piece's reduction aliases the consumed stage: [kMrStageGroups][128 rows][MT] fp32.
  static_assert(kMrStageGroups * kMrRows * MT * 4 <= kBytes, "reduction fits in a stage");
};

// A stage: `ng` groups from group g0 of row block b.
struct MrSpan {
  int b, g0, ng;
};

// The workspace slot of one piece: [MT][128] fp32 sums (rows a then b of the block), then
// [MT] fp32 sums of squares of x over the piece's groups (NORM).
template <int MT>
__host__ __device__ constexpr int mr_slot_floats() {
  return MT * kMrRows + MT;
}

// x        fp16   [M, K]         activations, row-major, 16-byte aligned
// norm_w   fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight  uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N, [gate; up])
// scales   fp16   [R, K/128]
// bias     fp16   [N]            kRope only (q | k | v biases)
// out      fp16   [M, N]         kResidual: read and written in place; kSwiGLU: [M, N];
//                                kRope: q fp16 [M, kQSize] (rotated)
// N        int                   output features (kRope: kQKVSize)
// M        int                   token rows, 1..MT
// kRope only: pos int32 [M] (device; each row's position), rope float2 [max_pos, kHeadDim/2]
//   (cos, sin), pages int32 page tables (row r's at pages + r * page_stride; page_stride 0:
//   one sequence), kc/vc this layer's caches (kv_cache.cuh). Other epilogues ignore them.
// work     fp32   [nb, slots, mr_slot_floats<MT>()]  the pieces' partial sums (scratch)
// counters int32  [nb]           zero before the first launch; every launch leaves them zero
// slots    int                   the workspace's slots a block (>= the pieces of any block)
// Grid: at most kMrCtasPerSm CTAs an SM, at most nb x G; block kMrWarps x 32; dynamic shared
// memory kMrStages x MrStage<MT>::kBytes.
// CTAs an SM asked of the register allocator: at MT = 16 the 32 accumulators and 32 registers
// of x do not fit 128 registers beside the rest (ptxas spills), so one CTA an SM takes it.
constexpr int mr_ctas_per_sm(int MT) { return MT == 8 ? kMrCtasPerSm : 1; }

template <int K, int MT, bool NORM, int EPI>
__global__ void __launch_bounds__(kMrWarps* kWarp, mr_ctas_per_sm(MT))
gemv_rows(const half* __restrict__ x, const half* __restrict__ norm_w,
          const unsigned char* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, int N, int M, const int* __restrict__ pos,
          const float2* __restrict__ rope, const int* __restrict__ pages, int page_stride,
          half* kc, half* vc, float* work, int* counters, int slots) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  static_assert(MT == 8 || MT == 16, "token buckets of one or two n8 tiles");
  constexpr int G = K / kGroupSize, SG = kMrStageGroups, TT = MT / 8;
  constexpr int kThreads = kMrWarps * kWarp;
  using S = MrStage<MT>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float inv_c[kMrStages][MT];  // NORM: 1 / the stage's scale of each token
  __shared__ float piece_ss[MT];          // NORM: the piece's sums of squares
  __shared__ int last;

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int g = lane / 4, t4 = lane % 4;
  const int rh = warp / SG, kl = warp % SG;  // row half, k lane
  const int pairs = EPI == kSwiGLU ? N : (N + 1) / 2;
  const int half_n = (N + 1) / 2;
  const int rows_total = EPI == kSwiGLU ? 2 * N : N;
  const int nb = (pairs + kMrPairs - 1) / kMrPairs;
  const int units = nb * G;
  const int u0 = (int)((long long)blockIdx.x * units / gridDim.x);
  const int u1 = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);
  pdl_trigger();

  auto row_of = [&](int p, bool b) -> int {  // weight row of pair p, run a or b
    if (EPI == kRope) {
      const int ra = p / (kHeadDim / 2) * kHeadDim + p % (kHeadDim / 2);
      return b ? ra + kHeadDim / 2 : ra;
    }
    return b ? p + (EPI == kSwiGLU ? N : half_n) : p;
  };
  auto span_at = [&](int u) -> MrSpan {
    const int b = u / G, g0 = u % G;
    return {b, g0, min(SG, min(G - g0, u1 - u))};
  };
  // The first CTA whose range holds unit u (the slot order of a block's pieces).
  auto cta_of = [&](int u) -> int {
    int c = (int)((long long)u * gridDim.x / units);
    while (c + 1 < (int)gridDim.x && (long long)(c + 1) * units / gridDim.x <= u) ++c;
    while ((long long)c * units / gridDim.x > u) --c;
    return c;
  };

  // Copies of a stage's weights (and, with_x, x and norm weights); scales through registers
  // (a row's 2-byte scales of a span are not 4-byte aligned): loaded here, stored next
  // iteration (store_scales) so that their latency hides behind a stage.
  half sreg[kMrRows * SG / kThreads];
  auto issue = [&](MrSpan sp, int buf, bool with_w, bool with_x) {
    unsigned char* st = smem + buf * S::kBytes;
    if (with_w) {
#pragma unroll 1
      for (int i = tid; i < SG * kMrRows * 4; i += kThreads) {
        const int c = i % 4, gi = i / 4 % SG, lr = i / (4 * SG);
        const int p = sp.b * kMrPairs + lr % kMrPairs, row = row_of(p, lr >= kMrPairs);
        const bool ok = gi < sp.ng && p < pairs && row < rows_total;
        const unsigned char* src =
            qweight + (ok ? (size_t)row * (K / 2) + (sp.g0 + gi) * kMrGroupBytes + c * 16 : 0);
        cp_async16(st + S::kW + ((gi * kMrRows + lr) * 4 + c) * 16, src, ok ? 16 : 0);
      }
#pragma unroll
      for (int j = 0; j < kMrRows * SG / kThreads; ++j) {
        const int i = tid + j * kThreads, gi = i % SG, lr = i / SG;
        const int p = sp.b * kMrPairs + lr % kMrPairs, row = row_of(p, lr >= kMrPairs);
        const bool ok = gi < sp.ng && p < pairs && row < rows_total;
        sreg[j] = ok ? scales[(size_t)row * G + sp.g0 + gi] : __float2half(0.f);
      }
    }
    if (with_x) {
#pragma unroll 1
      for (int i = tid; i < MT * SG * 16; i += kThreads) {
        const int v = i % (SG * 16), r = i / (SG * 16);
        const bool ok = r < M && v < sp.ng * 16;
        const half* src = x + (ok ? (size_t)r * K + sp.g0 * kGroupSize + v * 8 : 0);
        cp_async16(st + S::kX + i * 16, src, ok ? 16 : 0);
      }
      if (NORM && tid < SG * 16) {
        const bool ok = tid < sp.ng * 16;
        cp_async16(st + S::kNw + tid * 16, norm_w + (ok ? sp.g0 * kGroupSize + tid * 8 : 0),
                   ok ? 16 : 0);
      }
    }
  };
  auto store_scales = [&](int buf) {
    half* sc = reinterpret_cast<half*>(smem + buf * S::kBytes + S::kSc);
#pragma unroll
    for (int j = 0; j < kMrRows * SG / kThreads; ++j) sc[tid + j * kThreads] = sreg[j];
  };

  // NORM: each token's x over the stage scaled by c = rsqrt(mean(x^2) + eps) and the norm
  // weight, in place; 1/c kept for the partials, x^2 summed into the piece's totals.
  auto normalize = [&](int buf, int ng) {
    constexpr int TPR = kThreads / MT, VPT = SG * 16 / TPR;  // threads a token, vectors each
    static_assert(TPR <= kWarp && kWarp % TPR == 0, "a token's threads inside one warp");
    unsigned char* st = smem + buf * S::kBytes;
    uint4* xs = reinterpret_cast<uint4*>(st + S::kX);
    const uint4* nw = reinterpret_cast<const uint4*>(st + S::kNw);
    const int r = tid / TPR;
    float ss = 0.f;  // two passes over shared memory: x held in registers would spill
#pragma unroll
    for (int j = 0; j < VPT; ++j) add_squares(ss, xs[r * SG * 16 + tid % TPR + j * TPR]);
#pragma unroll
    for (int m = TPR / 2; m > 0; m /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float c = rsqrtf(ss / (ng * kGroupSize) + kRmsEps);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      uint4& v = xs[r * SG * 16 + tid % TPR + j * TPR];
      v = rmsnorm_vec(v, nw[tid % TPR + j * TPR], c);
    }
    if (tid % TPR == 0) {
      inv_c[buf][r] = 1.f / c;
      piece_ss[r] += ss;
    }
  };

  float acc[4][TT][4] = {};
  // One stage: warp (rh, kl) takes group kl against its four row tiles.
  auto compute = [&](int buf, int ng) {
    if (kl >= ng) return;
    const unsigned char* st = smem + buf * S::kBytes;
    const uint4* xs = reinterpret_cast<const uint4*>(st + S::kX);
    const half* sc = reinterpret_cast<const half*>(st + S::kSc);
    uint4 xr[TT][4];  // x of tokens 8 tt + g, chunk t4 of group kl
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int q = 0; q < 4; ++q) xr[tt][q] = xs[(tt * 8 + g) * SG * 16 + kl * 16 + t4 * 4 + q];
    float ic[TT][2];  // 1/c of this lane's D columns 8 tt + 2 t4, + 1
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 2; ++e) ic[tt][e] = NORM ? inv_c[buf][tt * 8 + 2 * t4 + e] : 1.f;
#pragma unroll
    for (int rt = 0; rt < 4; ++rt) {
      const int lr = rh * kMrPairs + rt * 16 + g;  // rows lr, lr + 8 of the block
      const uint4 wa = *reinterpret_cast<const uint4*>(
          st + S::kW + ((kl * kMrRows + lr) * 4 + t4) * 16);
      const uint4 wb = *reinterpret_cast<const uint4*>(
          st + S::kW + ((kl * kMrRows + lr + 8) * 4 + t4) * 16);
      float d[TT][4] = {};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        half2 ha[4], hb[4];
        dequant_word((&wa.x)[q], ha);
        dequant_word((&wb.x)[q], hb);
        const uint32_t a0[4] = {h2u(ha[0]), h2u(hb[0]), h2u(ha[1]),
                                h2u(hb[1])};
        const uint32_t a1[4] = {h2u(ha[2]), h2u(hb[2]), h2u(ha[3]),
                                h2u(hb[3])};
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
          mma_16816(d[tt], a0, xr[tt][q].x, xr[tt][q].y);
          mma_16816(d[tt], a1, xr[tt][q].z, xr[tt][q].w);
        }
      }
      const float sa = __half2float(sc[lr * SG + kl]), sb = __half2float(sc[(lr + 8) * SG + kl]);
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) {
        acc[rt][tt][0] = fmaf(sa * ic[tt][0], d[tt][0], acc[rt][tt][0]);
        acc[rt][tt][1] = fmaf(sa * ic[tt][1], d[tt][1], acc[rt][tt][1]);
        acc[rt][tt][2] = fmaf(sb * ic[tt][0], d[tt][2], acc[rt][tt][2]);
        acc[rt][tt][3] = fmaf(sb * ic[tt][1], d[tt][3], acc[rt][tt][3]);
      }
    }
  };

  // The epilogue of one (token r, pair p) with the block's sums da (row a), db (row b).
  auto epilogue = [&](int r, int p, float da, float db) {
    if (EPI == kRope) {
      const int ra = row_of(p, false), rb = row_of(p, true), ps = pos[r];
      half ha = __float2half_rn(da + __half2float(bias[ra]));
      half hb = __float2half_rn(db + __half2float(bias[rb]));
      if (ra < kQSize + kKVSize) {  // q and k heads: rotate (x1, x2) = (row j, row j + D/2)
        const float2 cs = rope[(size_t)ps * (kHeadDim / 2) + ra % kHeadDim];
        const float x1 = __half2float(ha), x2 = __half2float(hb);
        ha = __float2half_rn(x1 * cs.x - x2 * cs.y);
        hb = __float2half_rn(x2 * cs.x + x1 * cs.y);
      }
      if (ra < kQSize) {
        out[(size_t)r * kQSize + ra] = ha;
        out[(size_t)r * kQSize + rb] = hb;
      } else {  // k or v: rows ra, rb are dims d, d + D/2 of one kv head
        const bool is_k = ra < kQSize + kKVSize;
        const int f = ra - kQSize - (is_k ? 0 : kKVSize), kh = f / kHeadDim, d = f % kHeadDim;
        const int page = pages[(size_t)r * page_stride + ps / kPageTokens], t = ps % kPageTokens;
        half* cache = is_k ? kc : vc;
        cache[kv_offset(page, kh, t, d)] = ha;
        cache[kv_offset(page, kh, t, d + kHeadDim / 2)] = hb;
      }
    } else if (EPI == kSwiGLU) {
      out[(size_t)r * N + p] = __float2half_rn(da / (1.f + __expf(-da)) * db);
    } else {
      half* o = out + (size_t)r * N;
      o[p] = __float2half_rn(__half2float(o[p]) + da);
      if (p + half_n < N) o[p + half_n] = __float2half_rn(__half2float(o[p + half_n]) + db);
    }
  };

  // A piece's end: the k lanes' sums in lane order into the workspace slot, the block's
  // counter, and the last CTA's reduction over the slots in slot order + the epilogue.
  auto finish_piece = [&](MrSpan sp, int buf, int pg0) {
    float* red = reinterpret_cast<float*>(smem + buf * S::kBytes);  // [SG][128 rows][MT]
    __syncthreads();  // every warp is done with the stage
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int lr = rh * kMrPairs + rt * 16 + g + (e / 2) * 8;
          const int col = tt * 8 + 2 * t4 + e % 2;
          red[(kl * kMrRows + lr) * MT + col] = acc[rt][tt][e];
          acc[rt][tt][e] = 0.f;
        }
    __syncthreads();
    const int slot = blockIdx.x - cta_of(sp.b * G);
    float* ws = work + ((size_t)sp.b * slots + slot) * mr_slot_floats<MT>();
    for (int i = tid; i < MT * kMrRows; i += kThreads) {  // ws[r][lr]
      const int r = i / kMrRows, lr = i % kMrRows;
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < SG; ++k) s += red[(k * kMrRows + lr) * MT + r];
      ws[i] = s;
    }
    if (tid < MT) {
      ws[MT * kMrRows + tid] = NORM ? piece_ss[tid] : 0.f;
      if (NORM) piece_ss[tid] = 0.f;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const int n = sp.g0 + sp.ng - pg0;  // the piece's groups
      last = atom_add_acq_rel(counters + sp.b, n) + n == G;
      if (last) counters[sp.b] = 0;  // every piece has arrived: nobody else touches it now
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int nslots = cta_of(min(units, (sp.b + 1) * G) - 1) - cta_of(sp.b * G) + 1;
    const float* wb = work + (size_t)sp.b * slots * mr_slot_floats<MT>();
    for (int i = tid; i < MT * kMrPairs; i += kThreads) {
      const int r = i / kMrPairs, j = i % kMrPairs, p = sp.b * kMrPairs + j;
      if (r >= M || p >= pairs) continue;
      float da = 0.f, db = 0.f, ss = 0.f;
      for (int s = 0; s < nslots; ++s) {
        const float* w = wb + (size_t)s * mr_slot_floats<MT>();
        da += __ldcg(w + r * kMrRows + j);
        db += __ldcg(w + r * kMrRows + kMrPairs + j);
        if (NORM) ss += __ldcg(w + MT * kMrRows + r);
      }
      if (NORM) {
        const float rstd = rsqrtf(ss / K + kRmsEps);
        da *= rstd;
        db *= rstd;
      }
      epilogue(r, p, da, db);
    }
  };

  if (NORM && tid < MT) piece_ss[tid] = 0.f;
  // Prologue: stage 0's weights (constant) before the wait for x, its x after it.
  int nst = 0;  // stages of this CTA
  for (int u = u0; u < u1; u += span_at(u).ng) ++nst;
  MrSpan cur = span_at(u0);
  if (u0 < u1) issue(cur, 0, true, false);
  pdl_wait();
  if (u0 < u1) issue(cur, 0, false, true);
  cp_async_commit();
  int pg0 = cur.g0;  // the current piece's first group
  for (int i = 0, u = u0; i < nst; ++i) {
    const int buf = i % kMrStages;
    store_scales(buf);
    const MrSpan nxt = span_at(u + cur.ng);
    if (i + 1 < nst) issue(nxt, (i + 1) % kMrStages, true, true);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (NORM) {
      normalize(buf, cur.ng);
      __syncthreads();
    }
    compute(buf, cur.ng);
    const bool piece_end = cur.g0 + cur.ng == G || i + 1 == nst;
    if (piece_end) finish_piece(cur, buf, pg0);
    __syncthreads();  // buf is free for stage i + kMrStages
    u += cur.ng;
    if (piece_end) pg0 = nxt.g0;
    cur = nxt;
  }
}
