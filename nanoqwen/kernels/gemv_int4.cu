// gemv_int4.cu: batch-1 decode GEMV over INT4 ValueShuffle weights on the tensor cores.
//
//   out = epilogue( dequant(W) @ norm(x) )      fp16 in/out, products exact, fp32 accumulation
//
// Why mma for a GEMV: a matrix-vector product is memory-bound, but a SIMT version spends
// ~2.8 instructions per weight (shift, lop3, hsub2, hfma2, cvt, add) and rounds products to
// fp16. Here the dequantized half2 pairs go straight into mma.sync.m16n8k16 as the A operand:
// ~1.6 instructions per weight and fp32-exact products. The 8 B columns are mostly idle
// (zeros); the tensor cores have throughput to spare. (A SIMT lop3/hfma2 kernel measured the
// same 2.72 ms/token end to end on the H200; it was dropped to keep one GEMV.)
//
// Mapping (one warp, one mma): the 16 A rows are two 8-row halves.
//   A rows 0..7  ("A part"): output rows n0..n0+7, group gA of K
//   A rows 8..15 ("B part"): kResidual / kRope: the same rows, group gB of the other K half
//                            kSwiGLU: the up rows N+n0..N+n0+7, group gA (gB = gA)
//   B column 0 holds x at group gA, column 1 x at group gB, columns 2..7 zero. Then
//   D[g][0] (thread g*4, c0) is the A-part dot and D[g+8][1] (thread g*4, c3) the B-part dot.
// K order inside a group does not matter for a dot product, so thread t (lane % 4) takes the
// 16-byte word chunk t of the group (32 nibbles) for both rows it serves, and the logical
// k indices of the mma fragment (2t, 2t+1, 2t+8, 2t+9) are mapped onto that chunk's pairs; the
// B fragment supplies x in the same order. One group = 4 threads x 32 = 128 = kGroupSize,
// so a group's scale multiplies the fresh mma result once (no scale inside the K loop).
//
// Memory pipeline: a CTA (kTcWarps warps) owns 8 output rows at a time (a tile); its warps
// split the tile's groups and reduce through shared memory. Each warp walks a flat sequence of
// batches (kTcUnroll groups, 2 x 16 B per thread each) over its tiles and always has the NEXT
// batch's loads in flight while it computes the current one, across tile boundaries too. The
// grid is persistent. PDL: the first batch is loaded before griddepcontrol.wait, x is copied to
// shared memory with cp.async (every copy in flight at once) after it.
//
// Measured (H200, 2026-11-30, tools/kernel_tune.py over 28 layers' own weights; us per launch,
// 7B): q/k/v 6.4, o 4.0, gate/up 28 (2.5 TB/s), down 15 (2.3 TB/s); ncu: 4 warps per
// scheduler, ~0.5 instructions issued per cycle, 45-60% of cycles with no eligible warp, i.e.
// latency-bound with 64 KB in flight per SM. Tried and dropped: a bulk L2 prefetch of the next
// tile (slower: 6.4 -> 7.3 us on q/k/v); each warp walking a contiguous K range instead of
// interleaved groups (same alone, 2.36 -> 2.42 ms for the whole step); dequantization without
// the hsub2 (the 1032 offset taken off with per-group sums of x: gate/up 28.1 -> 26.7 us but
// down and q/k/v slower by the sums, and the whole step no better); 8 warps per CTA and 2
// groups per batch (slower); loading two batches before the wait (156 registers, spills).
// Next: a shared-memory ring fed by cp.async/TMA so more bytes are in flight per SM.
//
// Epilogues:
//   kRope     (q/k/v projection) + bias, then RoPE on q and k and the K/V write into the
//             paged cache: the decode step's whole attention prologue. The tile's 8 rows are
//             4 RoPE pairs: logical row n of a q/k head maps to head row (n/2) + (n%2)*D/2, so
//             rows j and j + D/2 of a head sit in neighbouring threads (no weight reordering:
//             only the row each thread loads changes). v rows keep their order.
//   kResidual (o_proj, down_proj)  out[n] += dot (in place: the residual stream)
//   kSwiGLU   (fused gate/up)      out[n] = silu(dot_gate) * dot_up
#include "common.cuh"

constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * kWarp;
constexpr int kTcRows = 8;      // output rows per CTA tile (the A part of the mma)
constexpr int kTcUnroll = 4;    // groups per warp batch (2 x 16 B per thread each)
constexpr int kChunkElems = 32; // nibbles in one thread's 16-byte word chunk
static_assert(4 * kChunkElems == kGroupSize, "4 threads x 32 nibbles must cover one group");
static_assert(kHeadDim % kTcRows == 0, "a tile must not straddle two heads");

enum TcEpilogue { kRope = 0, kResidual = 1, kSwiGLU = 2 };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}


__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// kRope: weight row of logical output row n (q and k heads pair rows j, j + D/2).
__device__ __forceinline__ int rope_row(int n) {
  if (n >= kQSize + kKVSize) return n;
  const int idx = n % kHeadDim;
  return n - idx + (idx >> 1) + (idx & 1) * (kHeadDim / 2);
}

// One warp batch: kTcUnroll groups of the A-part and B-part rows this thread serves.
struct Batch {
  uint4 wa[kTcUnroll], wb[kTcUnroll];
  float sa[kTcUnroll], sb[kTcUnroll];
};

// x       fp16   [K]            activations (one token), 16-byte aligned
// norm_w  fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N, [gate; up])
// scales  fp16   [R, K/128]
// bias    fp16   [N]            kRope only (q | k | v biases)
// out     fp16   [N]            kResidual: read and written in place (the residual stream);
//                               kRope: q fp16 [kHeads, kHeadDim] (rotated; only kQSize used)
// N       int                   output features (kRope: kQKVSize)
// kRope only: pos int32* (the token's position; device memory), rope float2 [max_pos,
//   kHeadDim/2] (cos, sin), pages int32 [max_pages], kc/vc fp16 [pages, kPageTokens,
//   kKVHeads, kHeadDim] (this layer's caches). Other epilogues ignore them (pass 0).
template <int K, bool NORM, int EPI>
__global__ void __launch_bounds__(kTcThreads)
gemv_int4(const half* __restrict__ x, const half* __restrict__ norm_w,
          const uint4* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, int N, const int* pos,
          const float2* __restrict__ rope, const int* __restrict__ pages, half* kc, half* vc) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  constexpr int G = K / kGroupSize;                   // groups per row
  constexpr int GA = (EPI == kSwiGLU) ? G : (G + 1) / 2;  // iterations (A-part groups)
  constexpr int GB0 = (EPI == kSwiGLU) ? 0 : GA;      // B part: group = GB0 + i
  constexpr int kVecs = K / kChunkElems;              // uint4 per row
  constexpr int kStep = kTcUnroll * kTcWarps;         // iterations a CTA consumes per batch
  static_assert(K * 2 <= 40 * 1024, "x must fit static shared memory beside the reduction");
  __shared__ __align__(16) half xs[K];
  __shared__ float red[kTcWarps][kTcRows][2];
  __shared__ float nred[kTcWarps];

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const int tiles = (N + kTcRows - 1) / kTcRows;

  // Rows this thread loads for `tile`: A part row n0+g; B part the same row (SwiGLU: N+n0+g).
  auto load = [&](Batch& b, int tile, int i0) {
    int n = tile * kTcRows + g;
    const bool row_ok = n < N;
    if (EPI == kRope) n = rope_row(n);
    const int rowA = n, rowB = (EPI == kSwiGLU) ? n + N : n;
#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
      const int i = i0 + u * kTcWarps;  // this warp's u-th iteration of the batch
      const int gb = GB0 + i;
      const bool okA = row_ok && i < GA;
      const bool okB = okA && gb < G;
      b.wa[u] = okA ? ld_stream(qweight + (size_t)rowA * kVecs + i * 4 + t) : make_uint4(0, 0, 0, 0);
      b.wb[u] = okB ? ld_stream(qweight + (size_t)rowB * kVecs + gb * 4 + t) : make_uint4(0, 0, 0, 0);
      b.sa[u] = (okA && t == 0) ? __half2float(scales[(size_t)rowA * G + i]) : 0.f;
      b.sb[u] = (okB && t == 0) ? __half2float(scales[(size_t)rowB * G + gb]) : 0.f;
    }
  };

  int tile = blockIdx.x, i0 = warp;
  Batch cur, nxt;
  if (tile < tiles) load(cur, tile, i0);
  pdl_wait();
  pdl_trigger();

  // Prologue: x -> shared memory (all copies in flight at once), RMSNorm-ed in place if NORM.
  {
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    uint4* xs4 = reinterpret_cast<uint4*>(xs);
    constexpr int kXVecs = K / 8;
#pragma unroll
    for (int j = 0; j < (kXVecs + kTcThreads - 1) / kTcThreads; ++j) {
      const int v = threadIdx.x + j * kTcThreads;
      if (v < kXVecs) cp_async16(xs4 + v, x4 + v);
    }
    cp_async_wait_all();
    __syncthreads();
    if (NORM) {
      float ss = 0.f;
      for (int v = threadIdx.x; v < kXVecs; v += kTcThreads) {
        const uint4 xv = xs4[v];
        const half2* h = reinterpret_cast<const half2*>(&xv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(h[j]);
          ss += f.x * f.x + f.y * f.y;
        }
      }
      const float rstd = rsqrtf(block_sum<kTcWarps>(ss, nred) / K + kRmsEps);
      const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
      for (int v = threadIdx.x; v < kXVecs; v += kTcThreads) {
        uint4 xv = xs4[v];
        const uint4 wn = w4[v];
        half2* h = reinterpret_cast<half2*>(&xv);
        const half2* gw = reinterpret_cast<const half2*>(&wn);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(h[j]), gf = __half22float2(gw[j]);
          h[j] = __floats2half2_rn(f.x * rstd * gf.x, f.y * rstd * gf.y);
        }
        xs4[v] = xv;
      }
      __syncthreads();
    }
  }
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  float accA = 0.f, accB = 0.f;
  while (tile < tiles) {  // CTA-uniform: every warp walks the same tiles
    int ntile = tile, ni0 = i0 + kStep;
    if (ni0 >= GA) {
      ntile += gridDim.x;
      ni0 = warp;
    }
    if (ntile < tiles) load(nxt, ntile, ni0);  // in flight while `cur` is computed

#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
      const int i = i0 + u * kTcWarps;
      if (i >= GA) break;  // warp-uniform
      // B fragment: column g = 0 takes x of group gA = i, column 1 x of group GB0 + i.
      const int gx = (g == 0) ? i : GB0 + i;
      const bool has_x = g < 2 && gx < G;
      const uint32_t wA[4] = {cur.wa[u].x, cur.wa[u].y, cur.wa[u].z, cur.wa[u].w};
      const uint32_t wB[4] = {cur.wb[u].x, cur.wb[u].y, cur.wb[u].z, cur.wb[u].w};
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // word q of the chunk: elements 8q..8q+7
        const uint4 xv = has_x ? xs4[(gx * kGroupSize + t * kChunkElems) / 8 + q]
                               : make_uint4(0, 0, 0, 0);
        half2 pa[4], pb[4];
        dequant_word(wA[q], pa);
        dequant_word(wB[q], pb);
        // mma 2q: pairs 0 (k 2t..) and 1 (k 2t+8..); mma 2q+1: pairs 2 and 3.
        const uint32_t a0[4] = {h2u(pa[0]), h2u(pb[0]), h2u(pa[1]), h2u(pb[1])};
        const uint32_t a1[4] = {h2u(pa[2]), h2u(pb[2]), h2u(pa[3]), h2u(pb[3])};
        mma_16816(d, a0, xv.x, xv.y);
        mma_16816(d, a1, xv.z, xv.w);
      }
      accA = fmaf(cur.sa[u], d[0], accA);  // D[g][0]: meaningful in threads t == 0
      accB = fmaf(cur.sb[u], d[3], accB);  // D[g+8][1]
    }

    if (ntile != tile) {  // this warp finished its share of `tile`: reduce over the warps
      if (t == 0) {
        red[warp][g][0] = accA;
        red[warp][g][1] = accB;
      }
      accA = accB = 0.f;
      __syncthreads();
      if (threadIdx.x < kTcRows) {
        const int r = threadIdx.x, n = tile * kTcRows + r;
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int w = 0; w < kTcWarps; ++w) {
          a += red[w][r][0];
          b += red[w][r][1];
        }
        if (EPI == kRope) {
          // N == kQKVSize, a multiple of 8: all 8 threads are here for the pair exchange.
          const int row = rope_row(n);
          half hv = __float2half_rn(a + b + __half2float(bias[row]));
          const int p = *pos;
          if (n < kQSize + kKVSize) {  // rotate the pair (row j, row j + D/2)
            const float v = __half2float(hv);
            const float other = __shfl_xor_sync(0xffu, v, 1);
            const float2 cs = rope[(size_t)p * (kHeadDim / 2) + (n % kHeadDim) / 2];
            hv = __float2half_rn((r & 1) ? v * cs.x + other * cs.y : v * cs.x - other * cs.y);
          }
          const size_t slot = (size_t)pages[p / kPageTokens] * kPageTokens + p % kPageTokens;
          if (row < kQSize) {
            out[row] = hv;
          } else if (row < kQSize + kKVSize) {
            kc[slot * kKVSize + row - kQSize] = hv;
          } else {
            vc[slot * kKVSize + row - kQSize - kKVSize] = hv;
          }
        } else if (n < N) {
          if (EPI == kSwiGLU) {
            out[n] = __float2half_rn(a / (1.f + __expf(-a)) * b);
          } else {
            out[n] = __float2half_rn(__half2float(out[n]) + a + b);
          }
        }
      }
      __syncthreads();  // red is reused by the next tile
    }
    cur = nxt;
    tile = ntile;
    i0 = ni0;
  }
}
