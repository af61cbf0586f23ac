// prefill_gemm_wgmma.cu — INT4 (ValueShuffle, g128) x fp16 GEMM for prefill on Hopper wgmma.
//
//   out[M, N] fp16 (or out32 fp32) = A[M, K] fp16 @ dequant(W)^T  (+ bias[N])
//   or, with a residual: residual[M, N] fp32 += A @ dequant(W)^T, out = fp16(residual)
//   or, SWIGLU:  out[M, N/2] = silu(A @ Wgate^T) * (A @ Wup^T)   with W = [Wgate; Wup]
//
// A prefill GEMM is compute bound (at M = 512 an INT4 weight byte feeds 2 x 512 multiply-adds),
// so the weights are dequantized inside the main loop, straight into tensor-core fragments, and
// never touch memory as fp16. (The 16-token tile serves prompts of up to 16 new tokens, a warm
// prefix-cache request's, where a 64-token tile would compute 4x the padded tokens;
// registry.GEMM_TILES.) The kernel computes the transposed product out^T = W x A^T so that the
// dequantized weight is the wgmma A operand *from registers* and the activations are the B
// operand from shared memory:
//
//   wgmma.mma_async m64nBTk16: D[64 weight rows][BT tokens] += Wfrag[64][16] x Atile[BT][16]^T
//
// Arguments (fp16 = IEEE half bits; row-major; all addresses 16-byte aligned; no aliasing; the
// residual is updated in place, each element read and then written by one thread):
//   a_map     CUtensorMap of A fp16 [M, K] (the activations, row stride K): boxes of 64 K x BT
//             tokens in the 128-byte swizzle; rows past M arrive as zeros
//   w_map     CUtensorMap of qweight uint32 [N, K/8] (ValueShuffle words: word j of row n holds
//             K-elements 8j..8j+7, element 8j + 2i at bits 4i, 8j + 2i + 1 at bits 16 + 4i, int4
//             in [-8, 7]): boxes of 64 rows x 8 words (32 B). With SWIGLU rows 0..N/2-1 are the
//             gate, N/2..N-1 the up projection
//   scales    fp16  [N, K/128]    one scale per weight row and 128-group of K: w = q * scale
//   bias      fp16  [N] or null   added in fp32 (not used with SWIGLU)
//   residual  fp32  [M, N] or null  the residual stream, read and written in place (not used
//                                  with SWIGLU)
//   out       fp16  [M, N]        ([M, N/2] with SWIGLU; with a residual, its fp16 copy)
//   out32     fp32  [M, N] or null  the output in fp32 instead of out (not used with SWIGLU
//                                  or a residual): the q/k/v projection's, whose k reaches the
//                                  K cache unrounded (kv_cache.cuh)
//   M, N, K   M >= 1 any; N % 128 == 0; K % 128 == 0 (K/64 k-tiles, an even count)
//   partials  fp32  [gridDim.x, BT/2, 256]  the stream-K hand-over, one part per CTA
//   flags     int32 [gridDim.x]   zero before the first launch; every launch leaves them zero
// K keeps its natural order (no permutation): the register A fragment's k indices are exactly
// ValueShuffle's nibble pairs (below). The launcher (nanoqwen/cuda/prefill.py) makes the tensor
// maps and checks every condition; grid min(tiles x K/128, SMs) x 1 x 1, kThreads threads,
// dynamic shared memory smem_bytes<BT, STAGES, SWIGLU>() (registry.gemm_smem_bytes).
//
// Grid: stream-K, one CTA per SM (gridDim.x <= the SMs, all resident at once), so every SM is
// busy to the end. The launch's output tiles (128 weight rows x BT tokens) times their K/128
// scale groups form one range of iterations, cut into gridDim.x equal parts (Split, Segment
// below): a CTA runs the tiles of its part one segment at a time, from its last to its first,
// and a tile cut between CTAs is finished by the one holding its last group (the owner), which
// adds the others' fp32 sums (handed over through `partials` and `flags` as their first work)
// before the epilogue.
//
// CTA: 3 warpgroups (384 threads).
//   WG 0     producer: setmaxnreg.dec to 40; thread 0 alone fills a STAGES-deep ring of
//            k-tiles (64 K wide) with three TMA copies each, on the stage's "full" mbarrier
//            (arrive.expect_tx): the activations (a box of a_map) and two boxes of 64 weight
//            rows (w_map). TMA for both: one thread issues a stage, with one arrival (producer
//            warps loading 16-byte cp.async copies make the ring the bound). The ring runs on
//            across the CTA's segments; after an owner's segment the producer waits for the
//            epilogue (which stages its tile in the ring) on the "epi" mbarrier.
//   WG 1, 2  consumers: setmaxnreg.inc to 232; consumer c owns CTA weight rows 64c..64c+63
//            and all BT tokens: fp32 accumulators m64nBT = BT/2 registers per thread.
//            Per k-tile: wait "full", read its 64 rows x 32 bytes of INT4 from shared memory,
//            dequantize straight into the wgmma A fragments (times the group scale, rounded
//            once to fp16 like the reference), 4 wgmma k-steps, commit; wait_group 1 then
//            release the *previous* stage on its "empty" mbarrier (count 8: lane 0 of each
//            consumer warp; a segment's last stage once its wgmma are done). A fragments are
//            double-buffered (the k-loop is unrolled by two: one scale group) so the next
//            tile's dequantization overlaps the in-flight wgmma.

#include "common.cuh"
#include "wgmma.cuh"

namespace nanoqwen_wgmma {

constexpr int kBK = kPrefillKTile;  // K per k-tile: one 128-byte swizzle row of fp16
constexpr int kGroup = 128;         // INT4 group along K: two k-tiles share a scale
constexpr int kRows = kPrefillRows;  // weight rows per CTA (two consumer warpgroups x 64)
constexpr int kThreads = kPrefillThreads;  // producer warpgroup + 2 consumer warpgroups
static_assert(kBK == 64 && kRows == 128 && kThreads == 384, "the layout below is built for these");
constexpr int kProducerRegs = 40;   // setmaxnreg budgets: 40 * 128 + 232 * 256 <= 65536
constexpr int kConsumerRegs = 232;
constexpr int kEpilogueBarrier = 1; // named barrier id of the 256 consumer threads
static_assert(kGroup == 2 * kBK, "the k-loop is unrolled by two: one scale per pair");

constexpr unsigned kLoMask = 0x000F000Fu;   // nibble pair (after the lane's shift by 4t)
constexpr unsigned kMagic = 0x64086408u;    // fp16 1032 | nibble: XOR with the nibble's sign bit
                                            // gives 1024 + (v + 8); minus 1032 = v, exact

// CTA tile: 128 weight rows (= 128 output columns, or 64 SwiGLU outputs) x BT tokens x 64 K.
// Shared memory per stage: activations BT rows x 128 B in the 128-byte swizzle that the TMA
// writes and the wgmma descriptor names (16-byte chunk c of row r sits at chunk c ^ (r & 7);
// each stage is 1024-byte aligned) + weights 128 rows x 32 B (plain, in the order of the two
// boxes: weight_slot; consumers read them with 16-byte loads). Any BT a multiple of 8 (whole
// 8-row swizzle atoms) keeps a stage a multiple of 1024 bytes: BT = 16 is 2 KB + 4 KB.
template <int BT, int STAGES>
struct Layout {
  static constexpr int kActBytes = BT * kBK * 2;   // BT rows x 128 B
  static constexpr int kWBytes = kRows * kBK / 2;  // 128 rows x 32 B
  static constexpr int kStageBytes = kActBytes + kWBytes;
  static constexpr int kRingBytes = STAGES * kStageBytes;
  static_assert(kStageBytes % 1024 == 0, "stages must stay 1024-byte aligned (128B swizzle)");
};

template <int BT, bool SWIGLU>
struct Staging {
  static constexpr int kCols = SWIGLU ? kRows / 2 : kRows;  // output columns per CTA
  static constexpr int kStride = kCols + 4;                 // floats; +4 spreads the banks
  static constexpr int kBytes = BT * kStride * 4;
};

// Dynamic shared memory the launcher must pass (its host side: nanoqwen/cuda/registry.py
// gemm_smem_bytes): 1024 bytes of alignment slack + max(ring, epilogue staging) + 2 * STAGES + 1
// mbarriers. The staging reuses the ring (the producer waits on "epi" before refilling it): a
// space of its own, letting the producer refill during an owner's epilogue, saves nothing
// measurable (docs/EXPERIMENTS.md).
template <int BT, int STAGES, bool SWIGLU>
constexpr int smem_bytes() {
  return 1024 +
         (Layout<BT, STAGES>::kRingBytes > Staging<BT, SWIGLU>::kBytes
              ? Layout<BT, STAGES>::kRingBytes
              : Staging<BT, SWIGLU>::kBytes) +
         (2 * STAGES + 1) * 8;
}

// Register A fragment (PTX ISA "wgmma .m64nNk16 register fragment layout for matrix A": per
// warp the same as mma.m16n8k16's A; warp w of the warpgroup holds rows 16w..16w+15). Lane
// (g = lane/4, t = lane%4) holds, per k-step s (16 K), K = 16s + {2t, 2t+1} (+8) of rows g and
// g+8: a0 = (g, 2t..), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). In ValueShuffle,
// K = 8j + 2i, 8j + 2i + 1 is nibble pair i of word j, read as (w >> 4i) & 0x000F000F: so a0 is
// pair t of word 2s of row g, a2 pair t of word 2s+1, a1/a3 the same for row g+8. Each word
// is read by the 4 lanes of a quad, each extracting its own pair: no dequantization is done
// twice, only the (cheap, broadcast) shared loads repeat.
// Accumulator D (same section): d[4j + e] = (row g, token 8j + 2t + e), d[4j + 2 + e] =
// (row g + 8, same token), j = 0..BT/8-1, e = 0..1.

// Nibble pair (shift = 4i) of a ValueShuffle word -> fp16x2 (v(2i), v(2i+1)) * scale, one
// rounding (the subtraction is exact), as the reference rounds.
__device__ __forceinline__ unsigned dequant_pair(unsigned w, unsigned shift, unsigned scale2) {
  const unsigned p = ((w >> shift) & kLoMask) ^ kMagic;
  return hmul2(hsub2(p, kMagic), scale2);
}

// -- setmaxnreg (TMA, mbarriers, named barriers: common.cuh; wgmma: wgmma.cuh) ------------
// SWIGLU: CTA-local weight row r = 16 b + 8 h + g (b = r/16, h = 0/1, g = r%8) holds
// gate (h = 0) or up (h = 1) row of output column 64 * tile_n + 8 b + g, so the thread
// holding accumulator row g (gate) also holds row g + 8 (up) of the same column and token.
// CTA-local weight row r -> global weight row.
template <bool SWIGLU>
__device__ __forceinline__ int weight_row(int tile_n, int r, int N) {
  if (!SWIGLU) return tile_n * kRows + r;
  const int col = tile_n * (kRows / 2) + 8 * (r >> 4) + (r & 7);
  return (r & 8) ? N / 2 + col : col;
}
// First global weight row of box b (0, 1) of 64 rows; box b lands in stage rows 64b..64b+63.
template <bool SWIGLU>
__device__ __forceinline__ int weight_box_row(int tile_n, int b, int N) {
  return SWIGLU ? b * (N / 2) + tile_n * (kRows / 2) : tile_n * kRows + 64 * b;
}
// The stage row holding CTA-local weight row r: SWIGLU's gate rows sit in box 0, up in box 1.
template <bool SWIGLU>
__device__ __forceinline__ int weight_slot(int r) {
  return SWIGLU ? ((r & 8) << 3) + 8 * (r >> 4) + (r & 7) : r;
}

// Stream-K: the launch's work is units = tiles_m x tiles_n output tiles (unit u: token tile
// u % tiles_m of weight tile u / tiles_m, so the token tiles of one weight tile run side by
// side) times `groups` scale groups of K (two k-tiles each), one range of units x groups
// iterations cut into gridDim.x equal parts, one per CTA. A CTA takes its part in segments
// (the groups of one tile in it), from the last to the first: its first segment may be the
// head or a middle part of a tile whose last group another CTA has, and only there does it
// hand its sums over (partials, flags); every later segment ends a tile, which makes it the
// tile's owner: it adds the parts of the CTAs before it (each handed over as their first
// work, so an owner waits only on lower CTAs, all of them launched before it) and runs the
// epilogue.
struct Segment {
  int unit, tile_m, tile_n, g0, g1;  // groups [g0, g1) of tile `unit`; unit < 0: none
  long long lo;                      // its first iteration, unit * groups + g0
  __device__ bool valid() const { return unit >= 0; }
  __device__ bool owner(int groups) const { return g1 == groups; }
};
struct Split {
  int tiles_m, groups, parts;
  long long total;
  __device__ Split(int M, int N, int K, int BT)
      : tiles_m((M + BT - 1) / BT), groups(K / kGroup), parts(gridDim.x),
        total((long long)((M + BT - 1) / BT) * (N / kRows) * (K / kGroup)) {}
  // The first iteration of CTA c's part.
  __device__ long long first(int c) const { return total * c / parts; }
  // The segment of iterations [lo_bound, hi) that ends at hi.
  __device__ Segment ending(long long lo_bound, long long hi) const {
    if (hi <= lo_bound) return Segment{-1, 0, 0, 0, 0, 0};
    const int u = static_cast<int>((hi - 1) / groups);
    const long long ulo = (long long)u * groups;
    const long long lo = lo_bound > ulo ? lo_bound : ulo;
    return Segment{u, u % tiles_m, u / tiles_m, static_cast<int>(lo - ulo),
                   static_cast<int>(hi - ulo), lo};
  }
  __device__ Segment last(int c) const { return ending(first(c), first(c + 1)); }
  __device__ Segment before(const Segment& s, int c) const { return ending(first(c), s.lo); }
};

__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace nanoqwen_wgmma

// BT tokens per CTA (the wgmma N: 16, 64, 128, 192 or 256), STAGES-deep ring, SWIGLU epilogue.
template <int BT, int STAGES, bool SWIGLU>
__global__ void __launch_bounds__(nanoqwen_wgmma::kThreads, 1)
    prefill_gemm_wgmma(const __grid_constant__ TensorMap a_map,
                       const __grid_constant__ TensorMap w_map,
                       const unsigned short* __restrict__ scales,
                       const unsigned short* __restrict__ bias, float* residual,
                       unsigned short* __restrict__ out, float* __restrict__ out32, int M,
                       int N, int K, float* partials, int* flags) {
  using namespace nanoqwen_wgmma;
  using L = Layout<BT, STAGES>;
  using St = Staging<BT, SWIGLU>;
  constexpr int kAcc = BT / 2;
  static_assert(BT == 16 || BT == 64 || BT == 128 || BT == 192 || BT == 256,
                "BT: 16, 64, 128, 192 or 256 tokens (the timed and checked tiles)");
  static_assert(STAGES >= 2, "the ring needs two stages");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Align the ring to 1024 bytes (the 128-byte swizzle repeats every 8 rows of 128 bytes).
  const unsigned raw = smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;
  unsigned char* const base_ptr = smem_raw + (base - raw);
  constexpr int kMain = L::kRingBytes > St::kBytes ? L::kRingBytes : St::kBytes;
  const unsigned full_bar = base + kMain;             // STAGES x 8 bytes
  const unsigned empty_bar = full_bar + 8 * STAGES;   // STAGES x 8 bytes
  const unsigned epi_bar = empty_bar + 8 * STAGES;    // the staging is read: the ring is free

  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const Split sp(M, N, K, BT);

  if (tid == 0) {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < static_cast<unsigned>(smem_bytes<BT, STAGES, SWIGLU>())) __trap();
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 1);   // the producer's arrive.expect_tx
      mbar_init(empty_bar + 8 * s, 8);  // lane 0 of each of the 8 consumer warps
    }
    mbar_init(epi_bar, 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(&a_map) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(&w_map) : "memory");
  }
  __syncthreads();
  // PDL: the next kernel may be scheduled as SMs free up (it waits for this whole grid);
  // nothing global is read or written before the previous kernel has finished.
  pdl_trigger();
  pdl_wait();

  if (wg == 0) {
    // ---------------------------------------------------------------- producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (tid != 0) return;
    int q = 0, epilogues = 0;  // k-tiles issued so far (the ring position), owner segments
    for (Segment seg = sp.last(blockIdx.x); seg.valid(); seg = sp.before(seg, blockIdx.x)) {
      const int w_row0 = weight_box_row<SWIGLU>(seg.tile_n, 0, N);
      const int w_row1 = weight_box_row<SWIGLU>(seg.tile_n, 1, N);
      for (int kt = 2 * seg.g0; kt < 2 * seg.g1; ++kt, ++q) {
        const int st = q % STAGES;
        if (q >= STAGES) mbar_wait(empty_bar + 8 * st, ((q / STAGES) - 1) & 1);
        const unsigned act_s = base + st * L::kStageBytes;
        const unsigned w_s = act_s + L::kActBytes;
        // The boxes count whole, the activations' zero rows past M included.
        mbar_arrive_expect_tx(full_bar + 8 * st, L::kStageBytes);
        tma_load_2d(act_s, a_map, kt * kBK, seg.tile_m * BT, full_bar + 8 * st);
        // Weights: 8 ValueShuffle words (64 K) of 64 rows per box.
        tma_load_2d(w_s, w_map, kt * 8, w_row0, full_bar + 8 * st);
        tma_load_2d(w_s + 64 * 32, w_map, kt * 8, w_row1, full_bar + 8 * st);
      }
      // An owner's epilogue stages its tile in the ring: no copies until it has been read.
      if (seg.owner(sp.groups)) mbar_wait(epi_bar, epilogues++ & 1);
    }
    return;  // the copies complete on the mbarriers, which the consumers wait on
  }

  // ------------------------------------------------------------------ consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
  const int cw = wg - 1;                // consumer warpgroup 0/1: CTA weight rows 64cw..
  const int ctid = tid - 128;           // 0..255
  const int wtid = tid & 127;
  const int warp = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = 64 * cw + 16 * warp + g, r1 = r0 + 8;  // this thread's two weight rows
  const int slot0 = weight_slot<SWIGLU>(r0), slot1 = weight_slot<SWIGLU>(r1);
  const unsigned shift = 4 * t;                          // its nibble pair in every word
  float* stg = reinterpret_cast<float*>(base_ptr);

  float acc[kAcc];
  int q = 0;  // k-tiles consumed so far (the ring position)
  int q0 = 0;  // the first k-tile of the current segment

  // One k-tile: wait for its stage, dequantize 4 k-steps of A fragments into `a`, issue the
  // 4 wgmma, then retire the previous tile of the segment (its A buffer and its stage).
  auto tile = [&](unsigned (&a)[4][4], unsigned sc0, unsigned sc1) {
    const int st = q % STAGES;
    mbar_wait(full_bar + 8 * st, (q / STAGES) & 1);
    const unsigned act_s = base + st * L::kStageBytes;
    const unsigned char* w_s = base_ptr + st * L::kStageBytes + L::kActBytes;
    const uint4 x0 = *reinterpret_cast<const uint4*>(w_s + slot0 * 32);
    const uint4 x1 = *reinterpret_cast<const uint4*>(w_s + slot0 * 32 + 16);
    const uint4 y0 = *reinterpret_cast<const uint4*>(w_s + slot1 * 32);
    const uint4 y1 = *reinterpret_cast<const uint4*>(w_s + slot1 * 32 + 16);
    const unsigned wr0[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};  // row g
    const unsigned wr1[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};  // row g + 8
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a[s][0] = dequant_pair(wr0[2 * s], shift, sc0);
      a[s][1] = dequant_pair(wr1[2 * s], shift, sc1);
      a[s][2] = dequant_pair(wr0[2 * s + 1], shift, sc0);
      a[s][3] = dequant_pair(wr1[2 * s + 1], shift, sc1);
    }
    fence_acc(acc);
    wgmma_fence();
    const unsigned long long desc = make_desc_sw128(act_s);
#pragma unroll
    for (int s = 0; s < 4; ++s) WgmmaRS<BT, 0>::mma(acc, a[s], desc + 2 * s, 1);  // +32 B per k16
    wgmma_commit();
    fence_acc(acc);
    wgmma_wait<1>();  // tile q - 1 is done: its A buffer and its stage are free
    fence_acc(acc);
    if (q > q0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar + 8 * ((q - 1) % STAGES));
    }
    ++q;
  };

  for (Segment seg = sp.last(blockIdx.x); seg.valid(); seg = sp.before(seg, blockIdx.x)) {
    const int groups = sp.groups;
    const unsigned short* s0_ptr =
        scales + (long)weight_row<SWIGLU>(seg.tile_n, r0, N) * groups;
    const unsigned short* s1_ptr =
        scales + (long)weight_row<SWIGLU>(seg.tile_n, r1, N) * groups;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
    q0 = q;
    unsigned a0[4][4], a1[4][4];
    unsigned short s0_next = __ldg(s0_ptr + seg.g0), s1_next = __ldg(s1_ptr + seg.g0);
    for (int grp = seg.g0; grp < seg.g1; ++grp) {  // one scale group: two k-tiles
      const unsigned sc0 = s0_next | (static_cast<unsigned>(s0_next) << 16);
      const unsigned sc1 = s1_next | (static_cast<unsigned>(s1_next) << 16);
      const int next_group = grp + 1 < seg.g1 ? grp + 1 : grp;
      s0_next = __ldg(s0_ptr + next_group);
      s1_next = __ldg(s1_ptr + next_group);
      tile(a0, sc0, sc1);
      tile(a1, sc0, sc1);
    }
    wgmma_wait<0>();
    fence_acc(acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar + 8 * ((q - 1) % STAGES));  // the segment's last

    if (!seg.owner(sp.groups)) {
      // A head or middle part of a tile (this CTA's first segment): hand the sums to the
      // owner through `partials` (coalesced: [kAcc][256] fp32 at partials + CTA x kAcc x 256,
      // __stcg), then raise the flag with st.release.gpu.
      float* part = partials + (long)blockIdx.x * kAcc * 256;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) __stcg(part + i * 256 + ctid, acc[i]);
      named_barrier_sync(kEpilogueBarrier, 256);
      if (ctid == 0) {
        __threadfence();
        st_release_gpu(flags + blockIdx.x, 1);
      }
      continue;
    }
    // The owner (this segment ends the tile): add the parts of the CTAs before it that the
    // tile began in (when this segment does not begin it), nearest first: acquire the flag,
    // reset it to 0 (each part is read once: every launch finds them zero), read with __ldcg.
    for (int c = blockIdx.x - 1; seg.g0 > 0; --c) {
      if (ctid == 0) {
        while (ld_acquire_gpu(flags + c) == 0) {
        }
        flags[c] = 0;  // every part is read once, by this CTA: ready for the next launch
      }
      named_barrier_sync(kEpilogueBarrier, 256);
      const float* part = partials + (long)c * kAcc * 256;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] += __ldcg(part + i * 256 + ctid);
      if (sp.first(c) <= seg.lo - seg.g0) break;  // c's part began the tile
    }

    // ---------------------------------------------------------------------------- epilogue
    // (owners) Bias / SwiGLU in registers, then the tile goes through shared memory (fp32,
    // [BT][cols + 4], reusing the ring) so that each thread stores 16 contiguous bytes of one
    // token row and adds the fp32 residual there (32 bytes, read and then written by this
    // thread alone).
    // Both consumer warpgroups must be done reading the ring before it becomes staging.
    named_barrier_sync(kEpilogueBarrier, 256);
    if (SWIGLU) {
      const int col = 32 * cw + 8 * warp + g;  // output column (CTA-local) of rows r0 / r1
#pragma unroll
      for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float gate = acc[4 * j + e], up = acc[4 * j + 2 + e];
          stg[(8 * j + 2 * t + e) * St::kStride + col] = gate / (1.f + __expf(-gate)) * up;
        }
      }
    } else {
      float b0 = 0.f, b1 = 0.f;
      if (bias) {
        b0 = half_to_float(bias[seg.tile_n * kRows + r0]);
        b1 = half_to_float(bias[seg.tile_n * kRows + r1]);
      }
#pragma unroll
      for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = 8 * j + 2 * t + e;
          stg[row * St::kStride + r0] = acc[4 * j + e] + b0;
          stg[row * St::kStride + r1] = acc[4 * j + 2 + e] + b1;
        }
      }
    }
    named_barrier_sync(kEpilogueBarrier, 256);

    // Each thread stores 8 consecutive columns (16 bytes) of one token row per pass (BT = 16
    // with SWIGLU: one pass of 32 rows, the threads of rows 16..31 store nothing).
    constexpr int kThrPerRow = St::kCols / 8;
    constexpr int kRowsPerPass = 256 / kThrPerRow;
    const int c8 = (ctid % kThrPerRow) * 8, rsub = ctid / kThrPerRow;
    const int ld_out = SWIGLU ? N / 2 : N;
    const int col0 = seg.tile_n * St::kCols + c8;
#pragma unroll 4
    for (int row = rsub; row < BT; row += kRowsPerPass) {
      const int tok = seg.tile_m * BT + row;
      if (tok >= M) break;
      const float4 u = *reinterpret_cast<const float4*>(stg + row * St::kStride + c8);
      const float4 w = *reinterpret_cast<const float4*>(stg + row * St::kStride + c8 + 4);
      float v[8] = {u.x, u.y, u.z, u.w, w.x, w.y, w.z, w.w};
      const long idx = (long)tok * ld_out + col0;
      if (!SWIGLU && residual) {
        float4* rp = reinterpret_cast<float4*>(residual + idx);
        const float4 r0 = rp[0], r1 = rp[1];
        const float r[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] += r[i];
        rp[0] = make_float4(v[0], v[1], v[2], v[3]);
        rp[1] = make_float4(v[4], v[5], v[6], v[7]);
      } else if (!SWIGLU && out32) {
        float4* op = reinterpret_cast<float4*>(out32 + idx);
        op[0] = u;
        op[1] = w;
        continue;
      }
      uint4 o;
      o.x = pack_half2(v[0], v[1]);
      o.y = pack_half2(v[2], v[3]);
      o.z = pack_half2(v[4], v[5]);
      o.w = pack_half2(v[6], v[7]);
      *reinterpret_cast<uint4*>(out + idx) = o;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(epi_bar);  // this warp has read the staging
  }
}

