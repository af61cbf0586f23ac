// gemv_rows.cu: the INT4 GEMV over M = 1..16 activation rows with one pass over the weights
// (the multi-token decode step: K + 1 speculative tokens of one sequence, or B sequences).
//
//   out[r, :] = epilogue( dequant(W) @ norm(x[r, :]) )   r < M; fp16 in/out, fp32 accumulation
//
// Structure: gemv_int4.cu's (read its header), with other consumer math. Persistent CTAs own
// contiguous ranges of whole pairs of weight rows (its pairs: kResidual p / p + ceil(N/2),
// kSwiGLU gate p / up p, kRope the RoPE partners), so no CTA waits on another's partial sums;
// a producer warp streams stages of P = 8 pairs (16 rows) with a few 1-D bulk copies into a
// ring of "full"/"empty" mbarriers, and keeps kGvEarlyStages in flight until x has landed.
// Why this shape and not a split over (row blocks, K) with a cross-CTA reduction: at M <= 16
// the launch is still bound by the weight stream plus a fixed cost, and a reduction chain
// through global memory (fence, counter, a last CTA re-reading the slots) made that fixed cost
// ~12 us against gemv_int4's ~3 (docs/EXPERIMENTS.md, Decode GEMV); streaming whole rows keeps
// gemv_int4's cost model (fixed cost + bytes at 4.5 TB/s) as long as the consumers keep up.
//
// x of all M tokens stays in shared memory for the whole K when it fits (S = 1: MT x K fp16):
// 57 KB at K = 3584 and MT = 8, 115 KB at MT = 16. So one CTA an SM (kMrConsumers + 1 warps:
// the SM keeps gemv_int4's warp count), the ring beside x. Every CTA reads all of x from L2
// (M x 7 KB a CTA at the 7B's hidden size) by TMA, one box a group, issued right after the PDL
// wait by lane 0 of each team-0 consumer warp for the groups its warps take: one copy a group,
// not M x 16 copies of 16 bytes from the warp's lanes, ahead of the epilogue's loads (the step
// is faster so: docs/PERFORMANCE.md, the multi-token step).
//
// When it does not (registry.rows_split: down_proj, K = 8960..27648; the 14B/32B hidden 5120 at
// MT = 16; the steps take down_proj through gemv_rows_split below instead, a split of K across the
// CTAs with a second kernel for the sum), each CTA takes K in S slices of at most kMrSliceGroups
// groups, one after the other, over its own pairs: x of slice s + 1 is copied (cp.async, from L2)
// into the other half of a double buffer while the stages of slice s run, the stages hold 8 rows x
// the slice a run (one 2-D TMA box each: 8 rows of GS x 64 contiguous bytes, up to 1 KB), and each
// (pair, token) sum is added slice after slice in shared memory by the one thread that owns it
// (deterministic, no other CTA involved).
// The alternatives weighed, 7B down_proj (K = 18944, N = 3584) at M = 8:
//  - K split over the CTAs of a cluster, x of a rank's slice resident, sums added through
//    DSMEM: one 224 KB CTA an SM and clusters placed inside a GPC (an H200's 132 SMs are GPCs
//    of unequal sizes) leave clusters of 4 or 8 short of a full wave of 128 CTAs, a rank's
//    box of 8 rows x 37 groups is ~300 strided 64-byte pieces, the ring beside a resident
//    slice of x holds 3 stages, and each CTA has 7 stages to run behind a 76 KB x load.
//  - x streamed through the ring beside each stage's weights: a stage of 16 rows x Kc takes
//    8 Kc bytes of weights and M x 2 Kc of x, so L2 would carry 2x (M = 8) to 4x (M = 16) the
//    weights' bytes on top of them.
//  - here x of a slice is reused by every pair of the CTA, so each CTA reads x once, M x K x 2
//    bytes: 303 KB beside its 265 KB of weights (1.5B down, 96 CTAs: 143 KB beside 72 KB); L2
//    carries the weights plus ~1.1x (7B) to 2x (1.5B) more at M = 8, twice that at M = 16.
//    The ratio is set by the CTA's rows (N / CTAs, hence at least 8 pairs a CTA).
//  - a split of K over CTAs reduced through global memory: the fixed cost above (~12 us).
//
// One mma: A = 16 weight rows (row a and row b of the stage's pairs 0..7: lane g holds pair
// g's, in rows g and g + 8, swapped in odd lanes where the runs are padded: warp_stage) x k16,
// B = x of 8 tokens x k16, D = 16 rows x 8 tokens (MT = 16: two n8 tiles). Thread t4 =
// lane % 4 takes the 16-byte chunk t4 of a group (32 nibbles) for A and the same 32 elements
// of x for B (K order inside a group is free as long as A and B agree: gemv_int4.cu's
// mapping); word q of the chunk feeds two mma (pairs 0, 1 and 2, 3). Each group's fresh D is
// scaled by its rows' scales into fp32 accumulators. The consumer warps split a stage's
// groups (warp w takes groups w, w + C, ...: at S = 1 the same in every stage, so that each
// warp copies its own groups of x and starts as they land, a lane keeps x of its first group
// in registers at MT = 8, and the warps with one group fewer, the last ones, reduce; at S > 1
// rotated by the stage), then the stage's 16 rows x MT tokens are reduced over the warps in a
// fixed warp order through a double-buffered shared array: one consumer barrier a stage. With
// whole rows a stage (S = 1) its pairs are then complete, and the reducing threads apply the
// epilogue at once, under the next stage, instead of all of it after the last one, a tail that
// grows with M (docs/PERFORMANCE.md, the verify step).
// Teams (T, registry.rows_teams: gate/up at MT = 8). A barrier a stage holds every warp to the
// slowest, and all of them then dequantize at once (the ALU pipe's busiest phase) and wait at
// once. With T teams of C / T warps, team t takes stages t, t + T, ... (its own barrier, its
// own double-buffered reduction, its last warps reducing), so the teams' phases drift apart
// and overlap. A stage then takes T times as long, so a CTA of few stages (q/k/v, o: 2-3)
// keeps one team; the ring's slots are dealt to the teams, two at least each.
// Per 1 KB of weights (16 rows x one group) at MT = 8 a warp issues ~120 instructions (72 of
// them dequantization, 8 mma, 6 LDS.128 of weights and x; 2, the weights', where x is in
// registers). What sets the launch's pace (its consumers, not the weight stream):
// docs/PERFORMANCE.md, the verify step.
//
// The RMSNorm hand-off (NORM: q/k/v and gate/up). RMSNorm needs each token row's sum of squares
// over all K before any element of it can be scaled. Done in the normalizing kernel, every CTA
// would sum and rescale all of x in shared memory between x's landing and its first stage, no
// weight byte consumed meanwhile (1.6 us of a 7B gate/up launch at M = 8). So the kernel that
// writes the residual h hands the next RMSNorm its input ready: x = fp16(h w c), w the
// RMSNorm's weight and c a scale of each token row that keeps h w in fp16's range (the last
// RMSNorm's 1 / rms, which one layer's update barely moves: the exact 1 / rms is what the
// reference's fp16(h rstd w) takes), and each of its CTAs writes its rows' sums of squares of h
// into a row of ss. The normalizing kernel loads its rows of ss under x's copies, adds them in
// part order (deterministic), and its dot products take the exact factor in fp32: rstd W (h w)
// = (rstd / c) W x. x is used as it lands; CTA 0 writes rstd, the next producer's c. The
// producers: kResidual here (o; down where gemv_rows takes it), gemv_rows_split_sum (down), and
// embed_rows before the first layer (c = the exact rstd: its x is the reference's). The last
// down_proj hands nothing over (next_w null): lm_head_rows normalizes the plain copy itself.
// The host side (the order of the slots, the rows of ss): cuda/decode.py's NormLink.
//
// Epilogues (gemv_epilogue.cuh), per token row r: kRope + bias, RoPE at pos[r], K/V into the
// pages at pos[r] (page table pages + r * page_stride), q to out[r, :]; kResidual res[r, n] +=
// dot (the fp32 residual, in place) and out[r, n] the hand-off (residual_handoff); kSwiGLU
// out[r, n] = silu(dot_gate) * dot_up.
#include "common.cuh"
#include "kv_cache.cuh"
#include "gemv_epilogue.cuh"

// From the generated header (nanoqwen/cuda/registry.py, Geometry):
//   kMrConsumers    consumer warps; one producer warp more (gemv_rows_split: kMrSplitConsumers,
//                   each with kMrSplitIlp (group, token tile) products in flight; gemv_rows one)
//   kMrMaxStages    the most stages in the ring (the dynamic shared memory sets how many fit)
//   kGvEarlyStages  stages in flight before x has landed (gemv_int4.cu's reason)
constexpr int kMrPairs = 8;                       // pairs a stage: A's 16 rows
constexpr int kMrGroupBytes = kGroupSize / 2;     // 64 bytes of weights a row and group
constexpr int kMrSliceGroups = 16;                // a slice's most groups: a TMA box row of
                                                  // 256 words (the box's largest dimension)
constexpr int kMrThreads = (kMrConsumers + 1) * kWarp;
constexpr int kMrAlign = 128;  // TMA boxes land 128-byte aligned: the ring's base is rounded up
// gemv_rows' x at S = 1 lands in the 128-byte swizzle (lane_xt), whose pattern repeats every
// 1024 bytes: x's base is rounded up to that (registry's ROWS_X_ALIGN).
constexpr int kMrXAlign = 1024;
static_assert(kMrConsumers * kWarp >= 16 * 16, "one consumer thread per (row, token) sum");
static_assert(kMrConsumers * kWarp % 16 == 0, "a thread keeps one token row: MT | C x 32");
static_assert(kMrConsumers >= kVerifyRows, "NORM: a warp a token row's sum of squares");
static_assert(kNormParts % kWarp == 0, "NORM: a warp's loads of the parts");

// The shape of gemv_rows<K, MT, S> (the host's twin: registry.rows_stage_bytes, rows_stages).
template <int K, int MT, int S>
struct MrShape {
  static constexpr int G = K / kGroupSize;         // groups a row
  static constexpr int GS = (G + S - 1) / S;       // groups a slice, at most
  static_assert(S == 1 || GS <= kMrSliceGroups, "a slice's row must fit one TMA box row");
  static_assert(S <= G, "every slice holds a group");
  // A stage row's bytes: whole rows (one bulk copy a run) at S = 1, else the slice's GS
  // groups (one TMA box a run: 8 rows x GS groups x 64 bytes).
  static constexpr int kRow = S == 1 ? K / 2 : GS * kMrGroupBytes;
  static constexpr int kRun = kMrPairs * kRow;     // run a or run b of a stage
  // Run b starts kPad bytes past run a's end, so that rows of run a and run b sit 64 bytes
  // apart modulo 128 (warp_stage's lanes then read 8 distinct bank quads a quarter warp). S > 1
  // keeps kPad = 0: a TMA box lands 128-byte aligned (an odd GS gives the 64 bytes anyway).
  static constexpr int kPad = S == 1 && kRow % 128 == 0 ? 64 : 0;
  static constexpr int kRunB = kRun + kPad;        // run b's offset in the stage
  static constexpr int kSc = 2 * kRun + kPad;      // the scales' offset in the stage
  // A run's scales: S = 1, the 16-byte units around the run's (8 G halves + up to 14 of
  // slack); S > 1, a row's 4-byte units around its slice (at most GS + 2 halves), kScRow
  // bytes a row.
  static constexpr int kScRow = ((GS + 2) * 2 + 15) / 16 * 16;
  static constexpr int kScales =
      S == 1 ? (kMrPairs * G * 2 + 28 + 15) / 16 * 16 : kMrPairs * kScRow;
  static constexpr int kStage = (kSc + 2 * kScales + 127) / 128 * 128;
  static constexpr int kXBuf = MT * GS * kGroupSize * 2;           // x [MT][GS groups]
  static constexpr int kX = (S == 1 ? 1 : 2) * kXBuf;              // S > 1: double-buffered
  static constexpr int kXGroup = MT * kGroupSize * 2;              // S = 1: a group's TMA box
  static constexpr int kRed = 2 * kMrConsumers * 16 * MT * 4;      // [T][2][C/T][16][MT] f32
};

__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// A pair's epilogue inputs (gemv_epilogue.cuh's EpiIn) and, for kResidual's hand-off, the next
// RMSNorm's weight at its rows a and b.
struct RowsEpiIn : EpiIn {
  float wa, wb;
};

// kResidual's epilogue of pair p for one token row, with the RMSNorm hand-off: res += the sums
// (the fp32 residual, in place) and out = fp16(res w c), w the next RMSNorm's weight at the row
// (in.wa, in.wb; 1 without one, and c = 1: out is then the plain fp16 copy) and c the row's
// scale; sq gathers the squares of the new residual.
__device__ __forceinline__ void residual_handoff(int p, float da, float db, const RowsEpiIn& in,
                                                 float c, half* out, float* res, int N,
                                                 int half_n, float& sq) {
  const float a = in.a + da;
  res[p] = a;
  out[p] = __float2half_rn(a * in.wa * c);
  sq += a * a;
  if (p + half_n < N) {
    const float b = in.b + db;
    res[p + half_n] = b;
    out[p + half_n] = __float2half_rn(b * in.wb * c);
    sq += b * b;
  }
}

// The sum over a warp's lanes l, l + R, l + 2R, ... (every lane gets its class's; R a power of
// two dividing 32): a butterfly over the offsets R .. 16, the same order at every launch.
template <int R>
__device__ __forceinline__ float row_sum(float v) {
  static_assert(R >= 1 && R <= kWarp && kWarp % R == 0, "lane classes of a warp");
#pragma unroll
  for (int o = R; o < kWarp; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// x of token row r in shared memory: 16-byte unit u (chunk u % 16 of group u / 16) sits at
// u ^ bit3(u) ^ 2 (r & 1). A quarter warp (tokens 2h, 2h + 1; t4 = 0..3) loads chunk 4 t4 + q
// of one group: 8 distinct bank quads (unswizzled, a row of x is a multiple of 128 bytes and
// the loads would be 2-way conflicts).
__device__ __forceinline__ int xr_unit(int r, int u) { return u ^ ((u >> 3) & 1) ^ ((r & 1) << 1); }

// 4-byte global -> shared copy (cp.async.ca: the 16-byte .cg form does not take 4), and the
// mbarrier arrival that fires once this thread's earlier cp.async have landed (.noinc: the
// barrier's expected count includes it).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

template <int C>
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(C * kWarp) : "memory");
}
// The barrier of consumer team `team` of W warps (gemv_rows' teams: named barriers 4 ..).
template <int W>
__device__ __forceinline__ void team_sync(int team) {
  asm volatile("bar.sync %0, %1;" ::"r"(4 + team), "n"(W * kWarp) : "memory");
}

// The lane's x: its B fragment of group j, token tile tt, word q (tokens 8 tt + g, chunk t4)
// is unit xr_unit(8 tt + g, 16 j + 4 t4 + q) of the slice's x [MT][GS groups], which is
// lane_x(...)[16 j + tt x 8 GS 16 + (q ^ lane_sw(lane))] (xr_unit's two XOR terms touch only
// q's bits).
template <int GS>
__device__ __forceinline__ const uint4* lane_x(const uint4* xs4, int lane) {
  return xs4 + (lane / 4) * GS * 16 + 4 * (lane % 4);
}
__device__ __forceinline__ int lane_sw(int lane) {
  return ((lane % 4) >> 1) ^ ((lane / 4 & 1) << 1);
}

// gemv_rows' x at S = 1, [MT][G groups], lands one TMA box a group (x_map: fp16 (64 elements,
// K / 64 halves, M rows), box (64, 2, MT), the 128-byte swizzle): group j's box at kXGroup j
// bytes holds line l = 2 r + h (token row r, half h of the group) at 128 l, its 16-byte chunk c
// at c ^ (l % 8). The lane's word q of group j, token tile tt (unit 4 t4 + q of row 8 tt + g:
// half t4 / 2, chunk 4 (t4 % 2) + q) is then lane_xt(...)[16 MT j + 128 tt + (q ^ (sw % 4))],
// sw = lane_xt_sw(lane) = l % 8; a quarter warp (rows 2h, 2h + 1; t4 = 0..3) reads lines 4h ..
// 4h + 3 and 8 distinct bank quads.
__device__ __forceinline__ int lane_xt_sw(int lane) { return (2 * (lane / 4) + lane % 4 / 2) & 7; }
__device__ __forceinline__ const uint4* lane_xt(const uint4* xs4, int lane) {
  return xs4 + 8 * (2 * (lane / 4) + lane % 4 / 2) + ((4 * (lane % 2)) ^ (lane_xt_sw(lane) & 4));
}

// NG groups (slice-local j, j + step, ...) of a stage against the lane's two A rows, g (w1: its
// chunk t4 of the group's first, scales s1) and g + 8 (w2, s2), and MT / 8 token tiles, scaled
// into acc[tt] in group order (c0, c1: A row g, tokens 8 tt + 2 t4, + 1; c2, c3: A row g + 8).
// xv_of(j, tt, q): the lane's x of group j, token tile tt, word q (lane_x: from shared memory,
// or registers that hold it). NG > 1 puts that many groups' loads, dequantization and mma
// chains in flight at once.
template <int MT, int NG, typename XV>
__device__ __forceinline__ void group_mma(const unsigned char* w1, const unsigned char* w2,
                                          const half* s1, const half* s2, XV xv_of, int j,
                                          int step, float (&acc)[MT / 8][4]) {
  uint4 wa[NG], wb[NG];
  half sa[NG], sb[NG];
#pragma unroll
  for (int n = 0; n < NG; ++n) {
    const int jn = j + n * step;
    wa[n] = *reinterpret_cast<const uint4*>(w1 + jn * kMrGroupBytes);
    wb[n] = *reinterpret_cast<const uint4*>(w2 + jn * kMrGroupBytes);
    sa[n] = s1[jn];
    sb[n] = s2[jn];
  }
  float d[NG][MT / 8][2][4] = {};  // two chains a group and tile (pairs 0, 1 and 2, 3)
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q of the chunk: elements 8q..8q+7
#pragma unroll
    for (int n = 0; n < NG; ++n) {
      half2 ha[4], hb[4];
      dequant_word((&wa[n].x)[q], ha);
      dequant_word((&wb[n].x)[q], hb);
      const uint32_t a0[4] = {h2u(ha[0]), h2u(hb[0]), h2u(ha[1]), h2u(hb[1])};
      const uint32_t a1[4] = {h2u(ha[2]), h2u(hb[2]), h2u(ha[3]), h2u(hb[3])};
#pragma unroll
      for (int tt = 0; tt < MT / 8; ++tt) {
        const uint4 xv = xv_of(j + n * step, tt, q);
        mma_16816(d[n][tt][0], a0, xv.x, xv.y);
        mma_16816(d[n][tt][1], a1, xv.z, xv.w);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NG; ++n) {
    const float f1 = __half2float(sa[n]), f2 = __half2float(sb[n]);
#pragma unroll
    for (int tt = 0; tt < MT / 8; ++tt) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        acc[tt][c] = fmaf(c < 2 ? f1 : f2, d[n][tt][0][c] + d[n][tt][1][c], acc[tt][c]);
    }
  }
}

// A consumer warp's share of a stage: groups first, first + step, ... < gs against its lane's
// rows and every token tile (the first XR with x from registers, xr[n] that of group first + n
// step; then ILP (group, token tile) products in flight: ILP / (MT / 8) groups at a time, then
// 2 and 1 for what is left), then its arrival on the stage's "empty" barrier
// (it has read the slot) and its sums [16 rows][MT] into `sums` (its part of the stage
// reduction; rows 0..7 of run a, then of run b). sa, sb: the scales of the lane's row g of run a
// and of run b. The mma's A rows g and g + 8 are row g of run a and of run b, swapped in odd
// lanes where the runs are padded (MrShape::kPad): a quarter warp's lanes (g = 2h, 2h + 1; t4)
// then read rows of both runs at once, 64 bytes apart modulo 128, 8 distinct bank quads; rows
// 2h and 2h + 1 of one run sit a multiple of 128 bytes apart when K / 2 is, and every weight
// load would be a 2-way bank conflict.
template <int K, int MT, int S, int ILP, int XR = 0>
__device__ __forceinline__ void warp_stage(const unsigned char* st, const half* sa,
                                           const half* sb, const uint4* xs4, int first, int step,
                                           int gs, int lane, uint32_t empty, float* sums,
                                           const uint4 (*xr)[MT / 8][4] = nullptr) {
  using Sh = MrShape<K, MT, S>;
  const int g = lane / 4, t4 = lane % 4, odd = Sh::kPad ? g & 1 : 0;
  const unsigned char* w1 = st + odd * Sh::kRunB + g * Sh::kRow + t4 * 16;
  const unsigned char* w2 = st + (odd ^ 1) * Sh::kRunB + g * Sh::kRow + t4 * 16;
  const uint4* xl = S == 1 ? lane_xt(xs4, lane) : lane_x<Sh::GS>(xs4, lane);
  const int sw = S == 1 ? lane_xt_sw(lane) & 3 : lane_sw(lane);
  auto x_smem = [xl, sw](int j, int tt, int q) {
    return S == 1 ? xl[16 * MT * j + 128 * tt + (q ^ sw)]
                  : xl[16 * j + tt * 8 * Sh::GS * 16 + (q ^ sw)];
  };
  float acc[MT / 8][4] = {};
  const half* s1 = odd ? sb : sa;
  const half* s2 = odd ? sa : sb;
  constexpr int NG = ILP > MT / 8 ? ILP / (MT / 8) : 1;
  static_assert(NG == 1 || NG == 2 || NG == 4, "groups at a time: 1, 2 or 4");
  int j = first;
#pragma unroll
  for (int n = 0; n < XR; ++n, j += step) {
    if (j < gs)
      group_mma<MT, 1>(w1, w2, s1, s2, [xr, n](int, int tt, int q) { return xr[n][tt][q]; }, j,
                       step, acc);
  }
  if constexpr (NG >= 4) {
    for (; j + 3 * step < gs; j += 4 * step)
      group_mma<MT, 4>(w1, w2, s1, s2, x_smem, j, step, acc);
  }
  if constexpr (NG >= 2) {
    for (; j + step < gs; j += 2 * step)
      group_mma<MT, 2>(w1, w2, s1, s2, x_smem, j, step, acc);
  }
  for (; j < gs; j += step) group_mma<MT, 1>(w1, w2, s1, s2, x_smem, j, step, acc);
  __syncwarp();
  if (lane == 0) mbar_arrive(empty);
#pragma unroll
  for (int tt = 0; tt < MT / 8; ++tt) {
    float* d = sums + g * MT + tt * 8 + 2 * t4;
    const float2 a = make_float2(acc[tt][0], acc[tt][1]), b = make_float2(acc[tt][2], acc[tt][3]);
    *reinterpret_cast<float2*>(d) = odd ? b : a;
    *reinterpret_cast<float2*>(d + 8 * MT) = odd ? a : b;
  }
}

// w_map    TMA descriptor of qweight as uint32 [R][K/8] (row-major), box [8 rows][GS * 16
//          words], no swizzle (S > 1 only; S = 1 ignores it)
// x_map    TMA descriptor of x as fp16 (64, K / 64, M) (C order), box (64, 2, MT), the 128-byte
//          swizzle (S = 1 only: lane_xt; S > 1 copies x by cp.async)
// x        fp16   [M, K]         activations, row-major, 16-byte aligned (NORM: the hand-off,
//                                x = fp16(h w c) of the residual h; see "The RMSNorm hand-off")
// qweight  uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N, [gate; up])
// scales   fp16   [R, K/128]
// bias     fp16   [N]            kRope only (q | k | v biases)
// out      fp16   [M, N]         kResidual: the fp16 copy of the new residual; kSwiGLU:
//                                [M, N]; kRope: q fp16 [M, kQSize] (rotated)
// res      fp32   [M, N]         kResidual only: the residual stream, read and written in place
// N        int                   output features (kRope: kQKVSize)
// M        int                   token rows, 1..MT
// kRope only: pos int32 [M] (device; each row's position), rope float2 [max_pos, kHeadDim/2]
//   (cos, sin), pages int32 page tables (row r's at pages + r * page_stride; page_stride 0:
//   one sequence), kc/vc this layer's caches (kv_cache.cuh). Other epilogues ignore them.
// The hand-off (NORM and kResidual; the others ignore them):
//   ss     fp32 [kNormParts][kVerifyRows]  sums of squares of the residual, a row a producing
//                                CTA: NORM reads rows 0 .. nparts - 1, kResidual writes row
//                                blockIdx.x
//   scale  fp32 [M]              c of each token row: NORM, the one x carries; kResidual, the one
//                                its out takes (ignored when next_w is null)
//   rstd   fp32 [M]              NORM: CTA 0 writes each token row's 1 / rms (the next
//                                producer's c)
//   next_w fp16 [N]              kResidual: the next RMSNorm's weight; null: out = fp16(res)
// Grid: at most one CTA per pair (registry.rows_grid: one an SM, fewer where a CTA would
// get less than a stage's 8 pairs: the 1.5B's down_proj on 96); block kMrThreads. Dynamic
// shared memory: the ring, x [MT][GS groups] (S = 1: 1024-byte aligned, lane_xt's layout;
// S > 1: xr_unit's, two of them), the stage reduction [T][2][C / T][16][MT] fp32 and, at S > 1,
// the per-pair sums; at least two stages a team must fit (the host checks:
// registry.rows_stages). T: the consumer teams (rows_teams).
template <int K, int MT, bool NORM, int EPI, int S, int T>
__global__ void __launch_bounds__(kMrThreads, 1)
gemv_rows(const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap x_map,
          const half* __restrict__ x,
          const unsigned char* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, float* res, int N, int M,
          const int* __restrict__ pos, const float2* __restrict__ rope,
          const int* __restrict__ pages, int page_stride, half* kc, half* vc, float* ss,
          int nparts, const float* __restrict__ scale, float* __restrict__ rstd,
          const half* __restrict__ next_w) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  static_assert(MT == 8 || MT == 16, "token buckets of one or two n8 tiles");
  static_assert(EPI != kRope || (kHeadDim / 2) % kMrPairs == 0, "a stage within one head");
  using Sh = MrShape<K, MT, S>;
  constexpr int C = kMrConsumers, G = Sh::G, GS = Sh::GS;
  constexpr int CT = C / T;  // a team's warps
  static_assert(T == 1 || (S == 1 && C % T == 0 && CT * kWarp >= kMrPairs * MT),
                "teams at S = 1: whole warps, a thread for each (pair, token) of a stage");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full_bar[kMrMaxStages], empty_bar[kMrMaxStages];
  __shared__ __align__(8) unsigned long long x_bar;  // x staged: the producer may fill the ring
  // S = 1: xg_bar[w] fires once the groups of x that warps w, w + CT, ... take (w, w + CT, ...)
  // have landed; T > 1: norm_bar once the NORM warps have written norm_f.
  __shared__ __align__(8) unsigned long long xg_bar[S == 1 ? CT : 1], norm_bar;
  __shared__ float norm_f[MT];  // NORM: rstd / c of each token row, the factor of its sums
  __shared__ float sq_s[EPI == kResidual ? C : 1][MT];  // kResidual: warps' squares by row

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int team = warp / CT, tw = warp % CT;  // consumer warps: team, warp in the team
  // The stage reduction's threads, rt = tid - kRt0 in 0 .. 16 MT (S = 1: tid counted in its
  // team, tw kWarp + lane): at S = 1 thread j MT + r finishes (pair j, token r), the team's
  // last kMrPairs MT / 32 warps (where a stage's groups do not split evenly over the warps,
  // they take one fewer); at S > 1 thread row MT + r adds its (row, token) sum, the first warps.
  // Token row rt % MT = tid % MT (kRt0 % MT = 0).
  constexpr int kRt0 = S == 1 ? (CT * kWarp - kMrPairs * MT) : 0;
  const int rt = (S == 1 ? tw * kWarp + lane : tid) - kRt0;
  const int pairs = EPI == kSwiGLU ? N : (N + 1) / 2;
  const int half_n = (N + 1) / 2;  // kResidual: row b(p) = p + half_n
  const int p0 = (int)((long long)blockIdx.x * pairs / gridDim.x);
  const int p1 = (int)((long long)(blockIdx.x + 1) * pairs / gridDim.x);
  const int npairs = p1 - p0;

  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int sum_bytes = S == 1 ? 0 : npairs * 2 * MT * 4;
  // T > 1: a whole number of slots a team (slot k is team k mod T's), so that a team's wait
  // for its stage's round r finds the slot's barrier in phase r (it consumed round r - 1).
  constexpr int kXSlack = S == 1 ? kMrXAlign : 0;  // S = 1: x's base rounded up (lane_xt)
  const int stages = min(kMrMaxStages, ((int)dyn - kMrAlign - kXSlack - Sh::kX - Sh::kRed -
                                        sum_bytes) / Sh::kStage) / T * T;
  if (stages < 2 * T) __trap();  // a launch the host must not make
  // The ring, x, the stage reduction [T][2][CT][16][MT], the sums (S > 1).
  unsigned char* base = smem + ((kMrAlign - smem_addr(smem) % kMrAlign) % kMrAlign);
  unsigned char* xb0 = base + stages * Sh::kStage;
  if constexpr (S == 1) xb0 += (kMrXAlign - smem_addr(xb0) % kMrXAlign) % kMrXAlign;
  uint4* xs4 = reinterpret_cast<uint4*>(xb0);  // slice s: xs4 + (s & 1) kXBuf / 16
  float* red = reinterpret_cast<float*>(xb0 + Sh::kX);
  float* sums = red + Sh::kRed / 4;  // S > 1: [npairs][2 (row a, b)][MT], slice after slice
  const uint32_t ring = smem_addr(base);

  auto row_a = [](int p) { return pair_row_a<EPI>(p); };
  auto row_b = [&](int p) { return pair_row_b<EPI>(p, N, half_n); };
  auto stage_len = [&](int p) -> int {
    const int n = min(kMrPairs, p1 - p);
    return EPI == kRope ? min(n, kHeadDim / 2 - p % (kHeadDim / 2)) : n;
  };
  auto slice0 = [](int s) { return s * G / S; };  // slice s: groups slice0(s) .. slice0(s + 1)
  // Token r's row of the output (kRope: of q) and of the residual (kResidual), and what its
  // epilogue of pair p reads.
  auto out_row = [&](int r) { return out + (size_t)r * (EPI == kRope ? kQSize : N); };
  auto res_row = [&](int r) { return res + (size_t)r * N; };
  // kResidual: the next RMSNorm's weight at pair p's rows (1 without one).
  auto load_w = [&](RowsEpiIn& in, int p) {
    in.wa = next_w ? __half2float(next_w[p]) : 1.f;
    in.wb = next_w && p + half_n < N ? __half2float(next_w[p + half_n]) : 1.f;
  };
  auto epi_load = [&](int p, int r) {
    RowsEpiIn in{};
    static_cast<EpiIn&>(in) = epi_inputs<EPI>(p, res_row(r), N, half_n, bias, pos + r, rope,
                                              pages + (size_t)r * page_stride);
    if (EPI == kResidual && S == 1) load_w(in, p);  // S > 1: at the epilogue (registers)
    return in;
  };
  // kResidual: a consumer thread finishes token row tid % MT only (every mapping below), so it
  // keeps that row's c and the squares of the new residual it writes.
  float hc = 1.f, sq = 0.f;
  auto finish = [&](int p, int r, float da, float db, const RowsEpiIn& in) {
    if (NORM) {
      da *= norm_f[r];
      db *= norm_f[r];
    }
    if (EPI == kResidual)
      residual_handoff(p, da, db, in, hc, out_row(r), res_row(r), N, half_n, sq);
    else
      epi_finish<EPI>(p, da, db, in, out_row(r), res_row(r), N, half_n, kc, vc);
  };
  // A consumer thread's next epilogue inputs, loaded early (gemv_epilogue.cuh: why): at S = 1
  // those of (pair j, token r) of its next stage (thread tid = j MT + r < 8 MT), a stage ahead;
  // at S > 1 its first item's, before the stages.
  RowsEpiIn epi_next{};

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      // the producer's arrive.expect_tx (S > 1: and its lanes' scale copies)
      mbar_init(smem_addr(&full_bar[s]), S == 1 ? 1 : 1 + kWarp);
      mbar_init(smem_addr(&empty_bar[s]), CT);  // the warps of the slot's team
    }
    mbar_init(smem_addr(&x_bar), S == 1 ? C : 1);  // S = 1: each consumer warp's own groups
    // S = 1: set w's boxes (groups w, w + CT, ...: kXGroup bytes each, rows past M zero-filled
    // and counted).
    for (int w = 0; w < (S == 1 ? CT : 0); ++w) {
      mbar_init(smem_addr(&xg_bar[w]), 1);
      mbar_arrive_expect_tx(smem_addr(&xg_bar[w]), max(0, (G - w + CT - 1) / CT) * Sh::kXGroup);
    }
    if constexpr (T > 1) mbar_init(smem_addr(&norm_bar), C);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();  // the whole grid is resident: the next kernel may launch (and wait)

  if (warp == C) {
    // ---- producer warp: the slices in turn, each over the CTA's pairs. S = 1: lanes 0, 1
    // copy run a and run b whole, lanes 2, 3 their scales (the 16-byte units around them: a
    // stage row keeps its scales at an offset of 0..7 halves, and a copy may read up to 14
    // bytes past the tensor's end, inside the slack every Gpu.alloc leaves). S > 1: lanes 0, 1
    // copy run a's and run b's slice as one TMA box each (w_map: 8 rows of up to 1 KB; one
    // 1-D bulk copy per row would make the copy engine, which pays per copy, the bound); the
    // box reads GS groups, one past a shorter slice (unused) and zeros past the matrix. A
    // row's scales of the slice (2-byte aligned, up to 36 bytes: no bulk copy) go by 4-byte
    // cp.async, the warp's lanes along one row, whose completion each lane then counts on
    // "full" (cp.async.mbarrier.arrive.noinc).
    int slot = 0, phase = 0, i = 0;
    bool x_in = false;
    for (int s = 0; s < S; ++s) {
      const int g0 = slice0(s), gs = slice0(s + 1) - g0;
      for (int p = p0; p < p1; ++i) {
        const int np = stage_len(p);
        const int run = lane & 1;  // S = 1: lanes 0, 2 take run a, lanes 1, 3 run b
        const int r0 = run ? row_b(p) : row_a(p);
        const int rows = max(0, min(np, (EPI == kSwiGLU ? 2 * N : N) - r0));  // copied rows
        const uint32_t st = ring + slot * Sh::kStage;
        const void* src = nullptr;
        uint32_t dst = 0, bytes = 0;
        if (S == 1 && lane < 2) {
          src = qweight + (size_t)r0 * (K / 2);
          dst = st + run * Sh::kRunB;
          bytes = rows * (K / 2);
        } else if (S == 1 && lane < 4) {
          const size_t e0 = ((size_t)r0 * G) & ~(size_t)7;  // 16-byte units
          src = scales + e0;
          dst = st + Sh::kSc + run * Sh::kScales;
          bytes = rows ? (uint32_t)((((size_t)(r0 + rows) * G + 7) & ~(size_t)7) - e0) * 2 : 0;
        }
        const uint32_t total = S == 1 ? __reduce_add_sync(0xffffffffu, bytes) : 2 * Sh::kRun;
        if (!x_in && i >= kGvEarlyStages) {  // until x is in: stage i - kGvEarlyStages landed
          const int j = i - kGvEarlyStages;
          const uint32_t jb = smem_addr(&full_bar[j % stages]), jp = (j / stages) & 1;
          while (!(x_in = mbar_test(smem_addr(&x_bar), 0)) && !mbar_test(jb, jp)) {
          }
        }
        if (i >= stages) mbar_wait(smem_addr(&empty_bar[slot]), phase ^ 1);
        const uint32_t full = smem_addr(&full_bar[slot]);
        if (lane == 0) mbar_arrive_expect_tx(full, total);
        __syncwarp();
        if (bytes) bulk_g2s(dst, src, bytes, full);
        if constexpr (S > 1) {
          if (lane < 2)
            tma_load_2d(st + run * Sh::kRunB, w_map, g0 * (kMrGroupBytes / 4), r0, full);
          for (int rr = 0; rr < 2 * kMrPairs; ++rr) {  // stage row rr: run rr / 8, row rr % 8
            const int ra = rr < kMrPairs ? row_a(p) : row_b(p);
            const int n_ok = max(0, min(np, (EPI == kSwiGLU ? 2 * N : N) - ra));
            if (rr % kMrPairs >= n_ok) continue;
            const size_t first = (size_t)(ra + rr % kMrPairs) * G + g0;  // in halves
            const size_t e0 = first & ~(size_t)1;
            const int units = (int)((first + gs + 1 - e0) / 2);
            for (int u = lane; u < units; u += kWarp)
              cp_async4(base + slot * Sh::kStage + Sh::kSc + rr * Sh::kScRow + 4 * u,
                        scales + e0 + 2 * u);
          }
          cp_async_arrive_noinc(full);
        }
        if (++slot == stages) {
          slot = 0;
          phase ^= 1;
        }
        p += np;
      }
    }
  } else {
    // ---- consumer warps. S = 1: x by TMA (lane_xt), S > 1: x of slice s -> xs4 + (s & 1)
    // slice buffers (cp.async, swizzled: xr_unit).
    auto stage_x = [&](int s) {
      const int g0 = slice0(s), gs = slice0(s + 1) - g0;
      uint4* xb = xs4 + (s & 1) * (Sh::kXBuf / 16);
      for (int v = tid; v < M * gs * 16; v += C * kWarp) {
        const int r = v / (gs * 16), u = v % (gs * 16);
        cp_async16(xb + r * GS * 16 + xr_unit(r, u), x + (size_t)r * K + g0 * kGroupSize + u * 8);
      }
    };
    pdl_wait();
    // S = 1: a warp reads only its own groups of x (tw, tw + CT, ...), so it starts on them as
    // they land, with no wait for the rest of x. Their boxes are issued first thing (x is what
    // the first stage waits for) by lane 0 of team 0's warp tw. S > 1: every thread copies a
    // part of the slice (below), and the consumers meet before its first stage.
    if constexpr (S == 1) {
      if (team == 0 && lane == 0) {
        asm volatile("fence.proxy.async.global;" ::: "memory");  // x: the previous grid's stores
        const uint32_t bar = smem_addr(&xg_bar[tw]);
        for (int j = tw; j < G; j += CT)
          tma_load_3d(smem_addr(xs4 + j * (Sh::kXGroup / 16)), x_map, 0, 2 * j, 0, bar);
      }
    }
    // The pair where stage i + n starts, for stage i's p (p1: past the CTA's last).
    auto stage_after = [&](int p, int n) {
      for (int k = 0; k < n && p < p1; ++k) p += stage_len(p);
      return p;
    };
    const int pt = stage_after(p0, S == 1 ? team : 0);  // the team's first stage
    if (S == 1 && rt >= 0 && pt < p1 && rt / MT < stage_len(pt) && tid % MT < M)
      epi_next = epi_load(pt + rt / MT, tid % MT);
    else if (S > 1 && EPI != kResidual && tid < npairs * MT && tid % MT < M)
      epi_next = epi_load(p0 + tid / MT, tid % MT);
    if (EPI == kResidual && S == 1 && next_w && tid % MT < M) hc = scale[tid % MT];
    if constexpr (S > 1) stage_x(0);
    // NORM: warp r's token row r, the producers' sums of squares loaded under x's copies and
    // added once x is in (lane-strided in part order, then the warp's butterfly: the same sum
    // at every launch); 1 / rms and the factor its sums take (first read after stage 0).
    float part[kNormParts / kWarp] = {}, xc = 1.f;
    if (NORM && warp < M) {
#pragma unroll
      for (int k = 0; k < kNormParts / kWarp; ++k) {
        const int i = lane + k * kWarp;
        if (i < nparts) part[k] = ss[i * kVerifyRows + warp];
      }
      xc = scale[warp];
    }
    if constexpr (S == 1) {
      mbar_wait(smem_addr(&xg_bar[tw]), 0);
      if (lane == 0) mbar_arrive(smem_addr(&x_bar));
    } else {
      cp_async_wait_all();
      consumer_sync<C>();
      if (tid == 0) mbar_arrive(smem_addr(&x_bar));
    }
    if (NORM && warp < M) {
      float t = 0.f;
#pragma unroll
      for (int k = 0; k < kNormParts / kWarp; ++k) t += part[k];
      const float rs = rsqrtf(warp_sum(t) / K + kRmsEps);
      if (lane == 0) {
        norm_f[warp] = rs / xc;
        if (blockIdx.x == 0) rstd[warp] = rs;
      }
    }
    // T > 1: a team's barrier does not order the other team's NORM warps before its finish.
    if constexpr (T > 1) {
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&norm_bar));
    }

    // ---- the slices, each over the stages of this CTA's pairs. S = 1: warp takes groups tw,
    // tw + CT, ... of every stage of its team (one team: tw = warp, CT = C), and at MT = 8
    // keeps x of the first kMrXRegs of them in registers (16 a group: its lane's B fragments;
    // MT = 16's 32 a group do not fit beside the rest), so that its stages read only weights
    // from shared memory. S > 1: groups
    // (warp - i) mod C, + C, ... of stage i (i counts on across slices), rotated so that
    // uneven counts even out over the slices' stages, x from shared memory.
    constexpr int XR = S == 1 && MT == 8 ? kMrXRegs : 0;
    uint4 xr[XR > 0 ? XR : 1][MT / 8][4];
    if constexpr (XR > 0) {
      const uint4* xl = lane_xt(xs4, lane);
      const int sw = lane_xt_sw(lane) & 3;
#pragma unroll
      for (int n = 0; n < XR; ++n) {
        const int j = min(tw + n * CT, G - 1);  // past G: never used
#pragma unroll
        for (int q = 0; q < 4; ++q) xr[n][0][q] = xl[16 * MT * j + (q ^ sw)];
      }
    }
    const int g = lane / 4;
    int slot = 0, phase = 0, i = 0;
    bool normed = !NORM || T == 1;  // T > 1: norm_f seen (norm_bar) by this thread
    for (int s = 0; s < S; ++s) {
      const int g0 = slice0(s), gs = slice0(s + 1) - g0;
      uint4* xb = xs4 + (s & 1) * (Sh::kXBuf / 16);
      if (s > 0) {  // slice s landed (copied under slice s - 1's stages), for every thread
        cp_async_wait_all();
        consumer_sync<C>();
      }
      // The other buffer held slice s - 1, whose last stage ended on a consumer barrier.
      if (s + 1 < S) stage_x(s + 1);
      for (int p = p0; p < p1; ++i) {
        const int np = stage_len(p);
        if (T > 1 && i % T != team) {  // the other team's stage
          if (++slot == stages) {
            slot = 0;
            phase ^= 1;
          }
          p += np;
          continue;
        }
        mbar_wait(smem_addr(&full_bar[slot]), phase);
        const unsigned char* st = base + slot * Sh::kStage;
        // The scales of the lane's rows a(p + g), b(p + g) at the slice's first group.
        const half* sc = reinterpret_cast<const half*>(st + Sh::kSc);
        const half* sa = S == 1 ? sc + (((size_t)row_a(p) * G) & 7) + g * G
                                : sc + g * Sh::kScRow / 2 + (((size_t)(row_a(p) + g) * G + g0) & 1);
        const half* sb = S == 1 ? sc + Sh::kScales / 2 + (((size_t)row_b(p) * G) & 7) + g * G
                                : sc + (8 + g) * Sh::kScRow / 2 +
                                      (((size_t)(row_b(p) + g) * G + g0) & 1);
        // The warps' sums, [CT][16 rows][MT] in the team's buffer i / T % 2, added over its
        // warps in warp order. S = 1: the stage's pairs are whole, so thread j MT + r finishes
        // (pair j, token r) right here (rows j and 8 + j), under the other warps' next stage,
        // and loads its team's next stage's epilogue inputs; no epilogue is left after the
        // last stage. S > 1: one
        // thread per (row, token) adds its sum to the slices before (the same thread at every
        // slice), and the epilogue runs after the last slice.
        float* rb = red + (team * 2 + (i / T & 1)) * (CT * 16 * MT);
        // One group at a time: 16 warps' registers (~96 a thread) hold no more; 8 warps with
        // 4 groups in flight measured the same in the step (docs/EXPERIMENTS.md, Decode GEMV).
        warp_stage<K, MT, S, 1, XR>(st, sa, sb, xb, S == 1 ? tw : (warp + C - i % C) % C, CT,
                                    gs, lane, smem_addr(&empty_bar[slot]), rb + tw * 16 * MT,
                                    xr);
        // The team's buffer i / T % 2 is next written at its stage i + 2 T, after this barrier.
        if constexpr (T > 1)
          team_sync<CT>(team);
        else
          consumer_sync<C>();
        if (S == 1 && rt >= 0) {
          const int j = rt / MT, r = rt % MT;
          float da = 0.f, db = 0.f;
#pragma unroll
          for (int w = 0; w < CT; ++w) {
            da += rb[w * 16 * MT + rt];
            db += rb[w * 16 * MT + kMrPairs * MT + rt];
          }
          if (!normed) {
            mbar_wait(smem_addr(&norm_bar), 0);
            normed = true;
          }
          if (j < np && r < M) finish(p + j, r, da, db, epi_next);
          const int pn = stage_after(p, T);  // the team's next stage
          if (pn < p1 && j < stage_len(pn) && r < M) epi_next = epi_load(pn + j, r);
        } else if (S > 1 && tid < 16 * MT) {
          const int row = tid / MT, r = tid % MT;
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < C; ++w) v += rb[w * 16 * MT + tid];
          if (row % 8 < np && r < M) {
            float& sum = sums[((p - p0 + row % 8) * 2 + row / 8) * MT + r];
            sum = s == 0 ? v : sum + v;
          }
        }
        if (++slot == stages) {
          slot = 0;
          phase ^= 1;
        }
        p += np;
      }
    }
  }
  if (warp == C) return;  // the producer

  // ---- S > 1: the epilogue after the last slice, on the consumer threads (they waited for the
  // previous kernel): (pair, token) items, token row e % MT = tid % MT (C x 32 is a multiple of
  // MT). A thread's first item has its inputs loaded before the stages, but kResidual's: held
  // over the stages with its c and sums of squares, they spill at MT = 16 (the 1.5B's down).
  if constexpr (S > 1) {
    if (EPI == kResidual && next_w && tid % MT < M) hc = scale[tid % MT];
    consumer_sync<C>();
    for (int e = tid; e < npairs * MT; e += C * kWarp) {
      const int i = e / MT, r = e % MT;
      RowsEpiIn in = e == tid && EPI != kResidual ? epi_next : epi_load(p0 + i, r);
      if (EPI == kResidual) load_w(in, p0 + i);
      if (r < M) finish(p0 + i, r, sums[(i * 2) * MT + r], sums[(i * 2 + 1) * MT + r], in);
    }
  }
  // kResidual: the CTA's sums of squares by token row, its row of ss: each warp's lanes of one
  // token row (lane % MT) added by a butterfly, then the warps' sums in warp order (a fixed
  // order; one dependent load a step would make this tail ~1 us). At S = 1 only the W warps
  // that finished pairs (threads rt = j MT + r of each team) hold squares: they alone meet,
  // the others are done.
  if constexpr (EPI == kResidual) {
    constexpr int WT = S == 1 ? kMrPairs * MT / kWarp : C;  // a team's
    constexpr int W = T * WT;
    if (rt < 0) return;
    sq = row_sum<MT>(sq);
    if (lane < MT) sq_s[team * WT + rt / kWarp][lane] = sq;
    asm volatile("bar.sync 2, %0;" ::"n"(W * kWarp) : "memory");
    if (team == 0 && rt < M) {
      float w[W];
#pragma unroll
      for (int i = 0; i < W; ++i) w[i] = sq_s[i][rt];
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < W; ++i) v += w[i];
      ss[blockIdx.x * kVerifyRows + rt] = v;
    }
  }
}

// ---- Split-K down_proj: gemv_rows_split (partial sums) + gemv_rows_split_sum (residual) ----
//
//   part[j, n, r] = sum over K slice j of dequant(W)[n, k] x[r, k]       (gemv_rows_split)
//   res[r, n]    += part[0, n, r] + part[1, n, r] + ... + part[S-1, n, r] (gemv_rows_split_sum)
//
// gemv_rows with S > 1 gives each CTA all K of its ~14 pairs, slice after slice: ~2 stages a
// slice, and every CTA reads all of x (132 x M x K x 2 bytes, 80 MB of L2 reads at the 7B's
// M = 16). Here the grid is (row ranges R) x (K slices S): CTA (b, j) streams the rows of range
// b over slice j only, so x of one slice (MT x GS groups, 61 KB at GS = 15, MT = 16) stays
// resident for all its stages (no per-slice double buffer or drain) and L2 carries R x M x K x
// 2 bytes of x (13 ranges at the 7B: 8 MB at M = 16 beside 35 MB of weights). The slices'
// sums meet in a workspace, added in a fixed order by a second, small kernel (deterministic;
// PDL launches it while the first runs, so it waits resident and costs its pass over the
// workspace, an L2 read). A last-CTA reduction through a counter (fence, atomic, a re-read of
// the slots) cost ~12 us a launch in gemv_rows' first design (docs/EXPERIMENTS.md, Decode
// GEMV).
// A stage is kMrSplitSub sub-stages, each gemv_rows' S > 1 stage layout for 16 consecutive rows
// (run a: rows 0..7, run b: rows 8..15, one 8-row TMA box each; then the 16 rows' scales): the
// consumer warps split into kMrSplitSub teams, one a sub-stage, so a stage carries
// kMrSplitSub x 15 KB (GS = 15) of weights against one consumer barrier and a reduction over
// C / kMrSplitSub warps. C = kMrSplitConsumers = 8 (teams of 4), each warp with up to 4 of its
// sub-stage's ~15 groups in flight at once (2 at MT = 16): with 16 warps each took ~2 groups
// in turn and its stage reduction added 8 warps' sums (7B, M = 16: 22.2 -> 19.9 us a launch).
// MT = 32 is a template value away as long as x of a slice and the ring fit
// (registry.rows_split_slices takes more, shorter slices when they do not).

// x of the slice: [MT][GS groups] swizzled (xr_unit), then the stage reduction [2][C][16][MT],
// then the ring (host twin: registry.rows_split_stages).
template <int K, int MT, int S>
struct SplitShape {
  using Sh = MrShape<K, MT, S>;
  static constexpr int kStage = kMrSplitSub * Sh::kStage;  // kMrSplitSub sub-stages
  static constexpr int kRows = 16 * kMrSplitSub;           // weight rows a stage
  static constexpr int kRed = 2 * kMrSplitConsumers * 16 * MT * 4;  // [2][C][16][MT] f32
};
constexpr int kMrSplitThreads = (kMrSplitConsumers + 1) * kWarp;

// w_map    TMA descriptor of the weight as uint32 [N][K/8], box [8 rows][GS * 16 words]
// x        fp16   [M, K]   activations (down_proj: the SwiGLU output), row-major
// scales   fp16   [N, K/128]
// part     fp32   [S][Npad][MT] the slices' sums, Npad = ceil(N / kRows) x kRows (every
//                 element written, padding rows and tokens past M with junk the sum skips)
// N, M     output features; token rows 1..MT
// Grid (R, S): CTA (b, j) takes stages b x B / R .. (b + 1) x B / R (B = Npad / kRows) over
// K slice j (groups j G / S .. (j + 1) G / S). Block kMrSplitThreads, dynamic shared memory
// registry's mr_smem (at least two stages: the kernel traps otherwise).
template <int K, int MT, int S>
__global__ void __launch_bounds__(kMrSplitThreads, 1)
gemv_rows_split(const __grid_constant__ TensorMap w_map, const half* __restrict__ x,
                const half* __restrict__ scales, float* __restrict__ part, int N, int M) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  static_assert(S > 1, "a split over K (one slice is gemv_rows' S = 1)");
  static_assert(MT % 8 == 0, "n8 token tiles");
  static_assert(kMrSplitConsumers % kMrSplitSub == 0, "whole consumer teams");
  using Sh = MrShape<K, MT, S>;
  using Sp = SplitShape<K, MT, S>;
  constexpr int C = kMrSplitConsumers, G = Sh::G, CW = C / kMrSplitSub;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full_bar[kMrMaxStages], empty_bar[kMrMaxStages];
  __shared__ __align__(8) unsigned long long x_bar;  // x staged: the producer may fill the ring

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int blocks = (N + Sp::kRows - 1) / Sp::kRows;
  const int b0 = blockIdx.x * blocks / gridDim.x, b1 = (blockIdx.x + 1) * blocks / gridDim.x;
  const int split = blockIdx.y;
  const int g0 = split * G / S, gs = (split + 1) * G / S - g0;

  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int stages =
      min(kMrMaxStages, ((int)dyn - kMrAlign - Sh::kXBuf - Sp::kRed) / Sp::kStage);
  if (stages < 2 || gridDim.y != S) __trap();  // a launch the host must not make
  unsigned char* base = smem + ((kMrAlign - smem_addr(smem) % kMrAlign) % kMrAlign);
  uint4* xs4 = reinterpret_cast<uint4*>(base);                       // [MT][GS groups]
  float* red = reinterpret_cast<float*>(base + Sh::kXBuf);           // [2][C][16][MT]
  unsigned char* ring = base + Sh::kXBuf + Sp::kRed;                 // kStage-aligned: 128
  static_assert(Sh::kXBuf % kMrAlign == 0 && Sp::kRed % kMrAlign == 0, "TMA boxes: 128 B");

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1 + kWarp);  // expect_tx + the lanes' scale copies
      mbar_init(smem_addr(&empty_bar[s]), C);
    }
    mbar_init(smem_addr(&x_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();  // the whole grid is resident: the sum kernel may launch (and wait)

  if (warp == C) {
    // ---- producer warp: lanes 0 .. 2 kMrSplitSub - 1 copy the stage's 8-row boxes of the
    // slice (box u / 2 of sub-stage u / 2: run u % 2), which read GS groups (one past a shorter
    // slice, unused) and zeros past row N; the rows' scales of the slice go by 4-byte cp.async
    // (gemv_rows' S > 1 producer: why), a lane a row (~9 copies a lane, where a warp along
    // each row in turn would issue kRows rounds of them), whose completion each lane counts
    // on "full".
    int slot = 0, phase = 0;
    bool x_in = false;
    for (int i = 0; i < b1 - b0; ++i) {
      const int r0 = (b0 + i) * Sp::kRows;
      if (!x_in && i >= kGvEarlyStages) {  // until x is in: stage i - kGvEarlyStages landed
        const int j = i - kGvEarlyStages;
        const uint32_t jb = smem_addr(&full_bar[j % stages]), jp = (j / stages) & 1;
        while (!(x_in = mbar_test(smem_addr(&x_bar), 0)) && !mbar_test(jb, jp)) {
        }
      }
      if (i >= stages) mbar_wait(smem_addr(&empty_bar[slot]), phase ^ 1);
      const uint32_t full = smem_addr(&full_bar[slot]);
      unsigned char* st = ring + slot * Sp::kStage;
      if (lane == 0) mbar_arrive_expect_tx(full, kMrSplitSub * 2 * Sh::kRun);
      __syncwarp();
      if (lane < 2 * kMrSplitSub)
        tma_load_2d(smem_addr(st + (lane / 2) * Sh::kStage + (lane % 2) * Sh::kRunB), w_map,
                    g0 * (kMrGroupBytes / 4), r0 + 8 * lane, full);
      for (int rr = lane; rr < Sp::kRows; rr += kWarp) {  // stage row rr: its units in turn
        if (r0 + rr >= N) continue;
        const size_t first = (size_t)(r0 + rr) * G + g0;  // in halves
        const half* src = scales + (first & ~(size_t)1);
        const int units = (int)((first + gs + 1 - (first & ~(size_t)1)) / 2);
        unsigned char* dst = st + (rr / 16) * Sh::kStage + Sh::kSc + (rr % 16) * Sh::kScRow;
        for (int u = 0; u < units; ++u) cp_async4(dst + 4 * u, src + 2 * u);
      }
      cp_async_arrive_noinc(full);
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
    }
  } else {
    // ---- consumer warps: x of the slice (cp.async, swizzled; rows past M stay unset: they
    // feed token columns nobody reads), then team u = warp / CW takes sub-stage u, its warp
    // w = warp % CW groups (w - i) mod CW, + CW, ... of stage i.
    pdl_wait();
    for (int v = tid; v < M * gs * 16; v += C * kWarp) {
      const int r = v / (gs * 16), u = v % (gs * 16);
      cp_async16(xs4 + r * Sh::GS * 16 + xr_unit(r, u),
                 x + (size_t)r * K + g0 * kGroupSize + u * 8);
    }
    cp_async_wait_all();
    consumer_sync<C>();
    if (tid == 0) mbar_arrive(smem_addr(&x_bar));
    const int g = lane / 4, team = warp / CW, w = warp % CW;
    float* dst = part + ((size_t)split * blocks + b0) * Sp::kRows * MT;  // stage 0's sums
    int slot = 0, phase = 0;
    for (int i = 0; i < b1 - b0; ++i) {
      const int r0 = (b0 + i) * Sp::kRows + team * 16;  // the team's sub-stage's first row
      mbar_wait(smem_addr(&full_bar[slot]), phase);
      const unsigned char* st = ring + slot * Sp::kStage + team * Sh::kStage;
      // The scales of the lane's rows r0 + g, r0 + 8 + g at the slice's first group.
      const half* sc = reinterpret_cast<const half*>(st + Sh::kSc);
      const half* sa = sc + g * Sh::kScRow / 2 + (((size_t)(r0 + g) * G + g0) & 1);
      const half* sb = sc + (8 + g) * Sh::kScRow / 2 + (((size_t)(r0 + 8 + g) * G + g0) & 1);
      // The warps' sums, [C][16 rows][MT] in buffer i % 2 (gemv_rows' stage reduction), then
      // each (sub-stage, row, token) summed over its team in warp order and stored: a stage's
      // kRows x MT floats are contiguous in part (coalesced).
      float* rb = red + (i & 1) * (C * 16 * MT);
      warp_stage<K, MT, S, kMrSplitIlp>(st, sa, sb, xs4, (w + CW - i % CW) % CW, CW, gs, lane,
                                        smem_addr(&empty_bar[slot]), rb + warp * 16 * MT);
      consumer_sync<C>();  // buffer i % 2 is next written at stage i + 2, after this barrier
      for (int e = tid; e < Sp::kRows * MT; e += C * kWarp) {
        const float* src = rb + (e / (16 * MT)) * CW * 16 * MT + e % (16 * MT);
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < CW; ++ww) v += src[ww * 16 * MT];
        dst[(size_t)i * Sp::kRows * MT + e] = v;
      }
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
    }
  }
}

// part   fp32 [S][Npad][MT] gemv_rows_split's sums (Npad = ceil(N / kRows) x kRows)
// res    fp32 [M, N]        the residual stream, read and written in place:
//                           res[r, n] += part[0, n, r] + part[1, n, r] + ... + part[S-1, n, r]
// out    fp16 [M, N]        out[r, n] = fp16(res[r, n] next_w[n] scale[r]), the hand-off the
//                           next RMSNorm reads (next_w null: fp16(res[r, n]))
// next_w fp16 [N], scale fp32 [M], ss fp32 [kNormParts][kVerifyRows]: gemv_rows' kResidual's
//                           (the CTA's sums of squares by token row into row blockIdx.x)
// Thread t: feature n = t / (MT / 4), tokens 4 (t % (MT / 4)) .. + 3 (one float4 a slice;
// a warp's loads are contiguous). Grid: ceil(Npad x MT / 4 / kMrSumThreads) CTAs.
template <int MT, int S>
__global__ void __launch_bounds__(kMrSumThreads)
gemv_rows_split_sum(const float* __restrict__ part, float* res, half* __restrict__ out, int N,
                    int M, const half* __restrict__ next_w, const float* __restrict__ scale,
                    float* __restrict__ ss) {
  static_assert(MT % 4 == 0, "token quads");
  constexpr int Q = MT / 4;
  static_assert(kMrSumThreads % kWarp == 0, "whole warps: a thread's token quad, lane % Q");
  constexpr int kRows = 16 * kMrSplitSub;
  constexpr int W = kMrSumThreads / kWarp;
  __shared__ float sq[W][MT];  // the warps' squares by token row
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int n = t / Q, r0 = 4 * (t % Q);
  const size_t npad = (size_t)(N + kRows - 1) / kRows * kRows;
  pdl_trigger();  // the next kernel's prologue (its weights) may start
  pdl_wait();     // every thread: ss is written below
  float acc[4] = {};
  if (n < N && r0 < M) {
    // Every load first (the residual, the hand-off's weight and scales, the slices), then the
    // stores: loads after a store to res would wait for it (res may alias them).
    float h[4] = {}, c4[4] = {1.f, 1.f, 1.f, 1.f};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (r0 + c < M) {
        h[c] = res[(size_t)(r0 + c) * N + n];
        if (next_w) c4[c] = scale[r0 + c];
      }
    }
    const float w = next_w ? __half2float(next_w[n]) : 1.f;
    const float4* p = reinterpret_cast<const float4*>(part) + t;
    float4 v[S];
#pragma unroll
    for (int s = 0; s < S; ++s) v[s] = p[s * npad * Q];  // all loads in flight, then the sum
#pragma unroll
    for (int s = 0; s < S; ++s) {  // slice order: the same sum at every launch
      acc[0] += v[s].x;
      acc[1] += v[s].y;
      acc[2] += v[s].z;
      acc[3] += v[s].w;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (r0 + c < M) {
        const size_t i = (size_t)(r0 + c) * N + n;
        h[c] += acc[c];
        res[i] = h[c];
        out[i] = __float2half_rn(h[c] * w * c4[c]);
      }
      acc[c] = h[c] * h[c];  // 0 past M
    }
  }
  // The CTA's sums of squares by token row: a warp's lanes of one quad (lane % Q) by a
  // butterfly, then the warps in order (gemv_rows' kResidual tail: why).
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    acc[c] = row_sum<Q>(acc[c]);
    if (lane < Q) sq[warp][4 * lane + c] = acc[c];
  }
  __syncthreads();
  if ((int)threadIdx.x < M) {
    float w[W];
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = sq[i][threadIdx.x];
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < W; ++i) v += w[i];
    ss[blockIdx.x * kVerifyRows + threadIdx.x] = v;
  }
}

// ---- The head of the hand-off: the multi-row steps' embedding ----
//
// ids int32 [M]; embed fp16 [V, kHidden]; norm_w fp16 [kHidden], the first layer's input
// RMSNorm. res fp32 [M, kHidden] = embed[ids] (the residual stream); x fp16 [M, kHidden] =
// fp16(res norm_w rstd), the hand-off normalized in full (c = rstd, one rounding as the
// reference's); ss row t: token t's sum of squares in column t, zeros elsewhere (the first
// kernel reads rows 0 .. M - 1); scale [M] = rstd. Grid M (a CTA a token row), block
// kMiscThreads: the row stays in registers between its sum of squares and its scaling.
extern "C" __global__ void __launch_bounds__(kMiscThreads)
embed_rows(const int* __restrict__ ids, const uint4* __restrict__ embed,
           const uint4* __restrict__ norm_w, uint4* __restrict__ x, float4* __restrict__ res,
           float* __restrict__ ss, float* __restrict__ scale) {
  static_assert(kHidden % 8 == 0, "rows are copied as 16-byte vectors");
  constexpr int kVecs = kHidden / 8, kPer = (kVecs + kMiscThreads - 1) / kMiscThreads;
  __shared__ float scratch[kMiscThreads / kWarp];
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const size_t id = (size_t)ids[t];
  uint4 e[kPer];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int v = threadIdx.x + k * kMiscThreads;
    if (v < kVecs) {
      e[k] = embed[id * kVecs + v];
      const half2* h = reinterpret_cast<const half2*>(&e[k]);
      const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]);
      const float2 f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
      const size_t i = (size_t)t * kVecs + v;
      res[2 * i] = make_float4(f0.x, f0.y, f1.x, f1.y);
      res[2 * i + 1] = make_float4(f2.x, f2.y, f3.x, f3.y);
      add_squares(sum, e[k]);
    }
  }
  sum = block_sum<kMiscThreads / kWarp>(sum, scratch);
  const float rs = rsqrtf(sum / kHidden + kRmsEps);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int v = threadIdx.x + k * kMiscThreads;
    if (v < kVecs) x[(size_t)t * kVecs + v] = rmsnorm_vec(e[k], norm_w[v], rs);
  }
  if (threadIdx.x < kVerifyRows)
    ss[t * kVerifyRows + threadIdx.x] = (int)threadIdx.x == t ? sum : 0.f;
  if (threadIdx.x == 0) scale[t] = rs;
}
