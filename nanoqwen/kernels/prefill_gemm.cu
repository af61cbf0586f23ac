// prefill_gemm.cu — INT4 (ValueShuffle, g128) x fp16 tensor-core GEMM for prefill.
//
//   out[M, N] fp16 = A[M, K] fp16 @ dequant(W)^T  (+ bias[N]) (+ residual[M, N])
//   or, SWIGLU:  out[M, N/2] = silu(A @ Wgate^T) * (A @ Wup^T)   with W = [Wgate; Wup]
//
// Why this shape. A prefill GEMM at M = 512 is compute bound (an INT4 weight byte feeds 2 * 512
// multiply-adds), so the weights are dequantized inside the main loop, straight into the
// tensor-core B fragments, and never touch memory as fp16. The path is mma.sync m16n8k16
// (fp16 in, fp32 accumulate): simple, exact to reason about, and fast enough for the 40 ms
// TTFT target; wgmma is the next step.
//
// The trick that makes register dequantization cheap is a permutation of K. The dot product
// over K does not care in which order the products are summed, so A and B may use any common
// order. One 16-byte chunk of a weight row (4 ValueShuffle words = 32 K-elements) goes to ONE
// thread (lane % 4 = t picks chunk t of the 128-wide k-tile): its 16 nibble pairs are exactly
// the B fragments that thread needs for 8 consecutive mma k-steps, with no shuffles. The A
// operand then needs, for the same thread, 8 contiguous fp16 of each row per word: one 16-byte
// shared load. Precisely, word w (0..3) of thread t's chunk holds real K-elements
// 32t + 8w + 0..7; its nibble pair i covers 32t + 8w + 2i + {0,1}; mma k-step q (0..1) of word w
// uses pairs 2q (b0) and 2q+1 (b1), and A registers {lo[2q], hi[2q], lo[2q+1], hi[2q+1]}
// where lo/hi are the 16-byte loads of rows g and g+8 at that word.
//
// Tiles: a CTA computes BM x BN outputs with (BM/WM) x (BN/WN) warps, each warp a WM x WN tile
// (WM/16 m16 x WN/8 n8 mma tiles). Each dequantized B fragment feeds WM/16 mma and each 16-byte
// A load 2 * WN/8. Measured on an H200 (tools/prefill_check.py, 2026-11-30): 64 x 32 warp
// tiles in 64 x 128 CTAs (two per SM) are fastest; 32 x 64 halves the A traffic but doubles
// the dequantization per mma and ran 10% slower, so shared memory is not the limit; 64 x 64
// spills (128 accumulators + fragments > 255 registers). BK = 128 = one quantization
// group, so a k-tile has exactly one scale per weight row. Tiles flow through a STAGES-deep
// cp.async ring; blockIdx.x walks M fastest so the CTAs that share a weight tile run together
// and the weights come from DRAM about once.
//
// Arguments (all device pointers, 16-byte aligned; row-major; no aliasing except that
// `residual` may equal `out`, since each element is read and then written by one thread):
//   A        fp16   [M, K]        activations, row stride K
//   qweight  uint32 [N, K/8]      ValueShuffle words: word j of row n = K-elements 8j..8j+7,
//                                 lane 2i at bits 4i, lane 2i+1 at bits 16+4i, int4 in [-8, 7]
//   scales   fp16   [N, K/128]    one scale per row and 128-group; w = q * scale
//   bias     fp16   [N] or null   added in fp32 (not used with SWIGLU)
//   residual fp16   [M, N] or null  added in fp32 (not used with SWIGLU)
//   out      fp16   [M, N]        or [M, N/2] with SWIGLU
//   M >= 1 any; N % BN == 0 (N/2 % (BN/2) with SWIGLU); K % 128 == 0.
// The launcher (nanoqwen/prefill.py) checks every condition before the launch.

#ifndef NANOQWEN_PREFILL_GEMM_CU
#define NANOQWEN_PREFILL_GEMM_CU
#include "common.cuh"

namespace nanoqwen_prefill_gemm {

constexpr int kGroup = 128;          // INT4 group along K = the k-tile (one scale per tile)
constexpr int kBK = kGroup;          // K elements per k-tile
constexpr int kMmaM = 16, kMmaN = 8;
constexpr int kAUnitsPerRow = kBK * 2 / 16;  // 16-byte units per A row of a k-tile: 16
constexpr int kBUnitsPerRow = kBK / 2 / 16;  // 16-byte units per weight row of a k-tile: 4
static_assert(kBUnitsPerRow == 4, "one 16-byte weight chunk per lane%4: BK must be 128");

// fp16x2 constants for the dequantization (two halves carry the same value).
constexpr unsigned kLoMask = 0x000F000Fu;   // nibble pair 2i   (after a shift by 8i)
constexpr unsigned kHiMask = 0x00F000F0u;   // nibble pair 2i+1 (sits 4 bits higher)
constexpr unsigned kLoMagic = 0x64086408u;  // fp16 1024 with bit 3 set: XOR flips the sign bit
                                            // of the nibble, so the half reads 1024 + (v + 8)
constexpr unsigned kHiMagic = 0x64806480u;  // same for a nibble 4 bits up: 1024 + 16 (v + 8)
constexpr unsigned kLoBias = 0x64086408u;   // fp16 1032: (1024 + v + 8) - 1032 = v, exact
constexpr unsigned kSixteenth = 0x2C002C00u;  // fp16 1/16
constexpr unsigned kHiBias = 0xD480D480u;     // fp16 -72: (1024 + 16 (v + 8)) / 16 - 72 = v


// One ValueShuffle word (8 int4 lanes) times its row's scale -> 4 fp16x2 B-fragment registers:
// out[i] = (v(2i), v(2i+1)) * scale, rounded once to fp16 (the reference rounds the same way).
__device__ __forceinline__ void dequant_word(unsigned w, unsigned scale2, unsigned out[4]) {
  const unsigned p0 = (w & kLoMask) ^ kLoMagic;
  const unsigned p1 = (w & kHiMask) ^ kHiMagic;
  w >>= 8;
  const unsigned p2 = (w & kLoMask) ^ kLoMagic;
  const unsigned p3 = (w & kHiMask) ^ kHiMagic;
  out[0] = hmul2(hsub2(p0, kLoBias), scale2);
  out[1] = hmul2(hfma2(p1, kSixteenth, kHiBias), scale2);
  out[2] = hmul2(hsub2(p2, kLoBias), scale2);
  out[3] = hmul2(hfma2(p3, kSixteenth, kHiBias), scale2);
}


// 16-byte async copy; src_bytes = 0 zero-fills the destination (rows past M).

// A tiles are stored as BM rows x 16 units of 16 bytes. A warp's 16-byte fragment load reads,
// per 8-lane phase, rows r and r+1 (r even) at units 4t + w, t = 0..3: without a swizzle units
// u and u + 8 share banks (a row is 256 bytes) and rows r, r+1 collide. XOR-ing bit 1 with
// unit bit 3 and bit 0 with the row parity spreads each phase over all 32 banks; within a row
// it permutes each aligned group of 8 units, so the cp.async writes stay conflict-free too.
__device__ __forceinline__ int a_swizzle(int row, int unit) {
  return unit ^ (((unit >> 3) & 1) << 1) ^ (row & 1);
}

// Weight row held in CTA-local B row n. Plain: n0 + n. SWIGLU: each warp's WN rows are
// WN/2 gate rows then the WN/2 matching up rows, so one thread ends up holding gate and up for
// the same output element (n8 tiles j and j + WN/16) and the epilogue needs no data exchange.
template <int WN, bool SWIGLU>
__device__ __forceinline__ int weight_row(int n_tile0, int n, int N) {
  if (!SWIGLU) return n_tile0 + n;
  constexpr int kHalf = WN / 2;
  const int warp_n = n / WN, r = n % WN;
  const int col = n_tile0 / 2 + warp_n * kHalf + r % kHalf;
  return r >= kHalf ? N / 2 + col : col;
}

template <int BM, int BN, int STAGES>
struct Smem {
  static constexpr int kABytes = BM * kAUnitsPerRow * 16;
  static constexpr int kBBytes = BN * kBUnitsPerRow * 16;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBytes = STAGES * kStageBytes;
};

}  // namespace nanoqwen_prefill_gemm

// BM x BN CTA tile of WM x WN warp tiles, STAGES-deep cp.async pipeline, MIN_CTAS resident
// per SM asked of the register allocator; SWIGLU selects the fused gate/up epilogue.
template <int BM, int BN, int WM, int WN, int STAGES, int MIN_CTAS, bool SWIGLU>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MIN_CTAS)
    prefill_gemm_int4(const unsigned short* __restrict__ A, const unsigned* __restrict__ qweight,
                      const unsigned short* __restrict__ scales,
                      const unsigned short* __restrict__ bias, const unsigned short* residual,
                      unsigned short* out, int M, int N, int K) {
  using namespace nanoqwen_prefill_gemm;
  constexpr int kWarpM = WM, kMTiles = WM / kMmaM;
  constexpr int kWarpN = WN, kNTiles = WN / kMmaN;
  static_assert(WM == 32 || WM == 64, "warp tiles are 32 or 64 rows");
  constexpr int kWarpsM = BM / kWarpM, kWarpsN = BN / kWarpN;
  constexpr int kThreads = kWarpsM * kWarpsN * 32;
  constexpr int kAUnits = BM * kAUnitsPerRow, kBUnits = BN * kBUnitsPerRow;
  static_assert(BM % kWarpM == 0, "BM must be a multiple of the warp tile height");
  static_assert(WN == 32 || WN == 64, "warp tiles are 32 or 64 columns");
  static_assert(BN % kWarpN == 0, "BN must be a multiple of the warp tile width");
  static_assert(kAUnits % kThreads == 0, "A tile copy must divide evenly among threads");
  static_assert(kBUnits % kThreads == 0 || kThreads % kBUnits == 0, "B tile copy split");
  static_assert(STAGES >= 2, "the pipeline needs at least two stages");
  using S = Smem<BM, BN, STAGES>;

  extern __shared__ __align__(128) unsigned char smem[];
  pdl_trigger();
  pdl_wait();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma groupID / thread-in-group
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const int m_tile0 = blockIdx.x * BM, n_tile0 = blockIdx.y * BN;
  const int k_tiles = K / kBK, words_per_row = K / 8, groups_per_row = K / kGroup;

  // Copy k-tile kt into ring stage `stage`: A rows past M are zero-filled (their outputs are
  // never stored); the address is clamped to row 0 so it stays valid.
  auto load_tile = [&](int kt, int stage) {
    unsigned char* a_s = smem + stage * S::kStageBytes;
    unsigned char* b_s = a_s + S::kABytes;
#pragma unroll
    for (int i = 0; i < kAUnits / kThreads; ++i) {
      const int q = tid + i * kThreads, row = q / kAUnitsPerRow, unit = q % kAUnitsPerRow;
      const int grow = m_tile0 + row;
      const unsigned short* src = A + (long)(grow < M ? grow : 0) * K + kt * kBK + unit * 8;
      cp_async16(a_s + (row * kAUnitsPerRow + a_swizzle(row, unit)) * 16, src,
                 grow < M ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < (kBUnits + kThreads - 1) / kThreads; ++i) {
      const int q = tid + i * kThreads;
      if (kBUnits % kThreads == 0 || q < kBUnits) {
        const int row = q / kBUnitsPerRow, chunk = q % kBUnitsPerRow;
        const long wrow = weight_row<WN, SWIGLU>(n_tile0, row, N);
        const unsigned* src = qweight + wrow * words_per_row + kt * (kBK / 8) + chunk * 4;
        cp_async16(b_s + (row * kBUnitsPerRow + chunk) * 16, src, 16);
      }
    }
  };

  // This thread's weight rows (one per n8 tile; CTA-local row = warp_n * WN + 8 j + g).
  // Scales are 2 bytes per (row, group): too small for cp.async, so they go through registers,
  // fetched one k-tile ahead (a whole k-tile of mma hides the L2 latency). Their addresses
  // are recomputed per fetch: 64-bit pointers per n8 tile would cost 2 registers each.
  const int b_row0 = warp_n * kWarpN + g;
  unsigned scale_next[kNTiles];
  auto fetch_scales = [&](int kt) {
    const int group = kt < k_tiles ? kt : 0;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int wrow = weight_row<WN, SWIGLU>(n_tile0, b_row0 + j * kMmaN, N);
      const unsigned s = __ldg(scales + (long)wrow * groups_per_row + group);
      scale_next[j] = s | (s << 16);
    }
  };

  float acc[kMTiles][kNTiles][4];
#pragma unroll
  for (int i = 0; i < kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_tile(s, s);
    cp_async_commit();  // empty groups keep the wait_group arithmetic uniform
  }
  fetch_scales(0);

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt visible to all; stage (kt - 1) % STAGES free to overwrite
    const int next = kt + STAGES - 1;
    if (next < k_tiles) load_tile(next, next % STAGES);
    cp_async_commit();

    unsigned scale2[kNTiles];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) scale2[j] = scale_next[j];
    fetch_scales(kt + 1);

    const unsigned char* a_s = smem + (kt % STAGES) * S::kStageBytes;
    const uint4* b_s = reinterpret_cast<const uint4*>(a_s + S::kABytes);
    uint4 bw[kNTiles];  // chunk t of each of this thread's weight rows: 4 words each
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) bw[j] = b_s[(b_row0 + j * kMmaN) * kBUnitsPerRow + t];

    // Per word w: dequantize the B fragments of all n8 tiles (4 registers each), then stream
    // the A fragments one m16 tile at a time (8 registers), each feeding 2 mma per n8 tile.
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      unsigned b[kNTiles][4];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const uint4 q = bw[j];
        dequant_word(w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w, scale2[j], b[j]);
      }
      const int unit = 4 * t + w;
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        const int r0 = warp_m * kWarpM + i * kMmaM + g, r1 = r0 + 8;
        const uint4 lo = *reinterpret_cast<const uint4*>(
            a_s + (r0 * kAUnitsPerRow + a_swizzle(r0, unit)) * 16);
        const uint4 hi = *reinterpret_cast<const uint4*>(
            a_s + (r1 * kAUnitsPerRow + a_swizzle(r1, unit)) * 16);
        const unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y};  // mma k-step 0 of this word
        const unsigned a1[4] = {lo.z, hi.z, lo.w, hi.w};  // mma k-step 1
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          mma_16816(acc[i][j], a0, b[j][0], b[j][1]);
          mma_16816(acc[i][j], a1, b[j][2], b[j][3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: accumulator c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g + 8, same cols).
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m_tile0 + warp_m * kWarpM + i * kMmaM + g + 8 * h;
      if (row >= M) continue;
      if (SWIGLU) {
        const int out_cols = N / 2;
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
          const int col = n_tile0 / 2 + warp_n * (kWarpN / 2) + j * kMmaN + 2 * t;
          float v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float gate = acc[i][j][2 * h + e], up = acc[i][j + kNTiles / 2][2 * h + e];
            v[e] = gate / (1.f + __expf(-gate)) * up;
          }
          *reinterpret_cast<unsigned*>(out + (long)row * out_cols + col) = pack_half2(v[0], v[1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          const int col = n_tile0 + warp_n * kWarpN + j * kMmaN + 2 * t;
          float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
          if (bias) {
            v0 += half_to_float(bias[col]);
            v1 += half_to_float(bias[col + 1]);
          }
          const long idx = (long)row * N + col;
          if (residual) {
            const unsigned r = *reinterpret_cast<const unsigned*>(residual + idx);
            v0 += half_to_float(static_cast<half_t>(r & 0xFFFF));
            v1 += half_to_float(static_cast<half_t>(r >> 16));
          }
          *reinterpret_cast<unsigned*>(out + idx) = pack_half2(v0, v1);
        }
      }
    }
  }
}

#endif  // NANOQWEN_PREFILL_GEMM_CU
