// gemv_int4_tc.cu: batch-1 decode GEMV over INT4 ValueShuffle weights on the tensor cores.
//
//   out = epilogue( dequant(W) @ norm(x) )      fp16 in/out, products exact, fp32 accumulation
//
// Why mma for a GEMV: a matrix-vector product is memory-bound, but the SIMT version spends
// ~2.8 instructions per weight (shift, lop3, hsub2, hfma2, cvt, add) and rounds products to
// fp16. Here the dequantized half2 pairs go straight into mma.sync.m16n8k16 as the A operand:
// ~1.6 instructions per weight and fp32-exact products. The 8 B columns are mostly idle
// (zeros); the tensor cores have throughput to spare.
//
// Mapping (one warp, one mma): the 16 A rows are two 8-row halves.
//   A rows 0..7  ("A part"): output rows n0..n0+7, group gA of K
//   A rows 8..15 ("B part"): kStore/kResidual: the same rows, group gB of the other K half
//                            kSwiGLU: the up rows N+n0..N+n0+7, group gA (gB = gA)
//   B column 0 holds x at group gA, column 1 x at group gB, columns 2..7 zero. Then
//   D[g][0] (thread g*4, c0) is the A-part dot and D[g+8][1] (thread g*4, c3) the B-part dot.
// K order inside a group does not matter for a dot product, so thread t (lane % 4) takes the
// 16-byte word chunk t of the group (32 nibbles) for both rows it serves, and the logical
// k indices of the mma fragment (2t, 2t+1, 2t+8, 2t+9) are mapped onto that chunk's pairs; the
// B fragment supplies x in the same order. One group = 4 threads x 32 = 128 = kGroupSize,
// so a group's scale multiplies the fresh mma result once (no scale inside the K loop).
//
// A CTA (kTcWarps warps) owns 8 output rows; its warps split the groups and reduce through
// shared memory. The grid is persistent. PDL: the first weight batch is loaded before
// griddepcontrol.wait.
#include "decode_common.cuh"

constexpr int kTcWarps = 4;
constexpr int kTcRows = 8;      // output rows per CTA tile (the A part of the mma)
constexpr int kTcUnroll = 4;    // groups per warp loaded ahead (2 x 16 B per thread each)
constexpr int kChunkElems = 32; // nibbles in one thread's 16-byte word chunk
static_assert(4 * kChunkElems == kGroupSize, "4 threads x 32 nibbles must cover one group");

enum TcEpilogue { kTcStore = 0, kTcResidual = 1, kTcSwiGLU = 2 };

__device__ __forceinline__ uint4 ld_stream_tc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// x       fp16   [K]            activations (one token), 16-byte aligned
// norm_w  fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kTcSwiGLU: 2N, [gate; up])
// scales  fp16   [R, K/128]
// bias    fp16   [N] or null    (kTcStore only)
// out     fp16   [N]            kTcResidual: read and written in place (the residual stream)
// N       int                   output features, any N >= 1
template <int K, bool NORM, int EPI>
__global__ void __launch_bounds__(kTcWarps * kWarp)
gemv_int4_tc(const half* __restrict__ x, const half* __restrict__ norm_w,
             const uint4* __restrict__ qweight, const half* __restrict__ scales,
             const half* __restrict__ bias, half* out, int N) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  constexpr int G = K / kGroupSize;                   // groups per row
  constexpr int GA = (EPI == kTcSwiGLU) ? G : (G + 1) / 2;  // iterations (A-part groups)
  constexpr int GB0 = (EPI == kTcSwiGLU) ? 0 : GA;    // B part: group = GB0 + i
  constexpr int kVecs = K / kChunkElems;              // uint4 per row
  static_assert(K * 2 <= 40 * 1024, "x must fit static shared memory beside the reduction");
  __shared__ __align__(16) half xs[K];
  __shared__ float red[kTcWarps][kTcRows][2];
  __shared__ float nred[kTcWarps];

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  const int tiles = (N + kTcRows - 1) / kTcRows;

  uint4 wa[kTcUnroll], wb[kTcUnroll];
  float sa[kTcUnroll], sb[kTcUnroll];
  // Rows this thread loads for tile `tile`: A part row n0+g; B part row (SwiGLU) N+n0+g.
  auto load_batch = [&](int tile, int i0) {
    const int n = tile * kTcRows + g;
    const bool row_ok = n < N && tile < tiles;
    const int rowA = n, rowB = (EPI == kTcSwiGLU) ? n + N : n;
#pragma unroll
    for (int u = 0; u < kTcUnroll; ++u) {
      const int i = i0 + u * kTcWarps;  // this warp's u-th iteration of the batch
      const int gb = GB0 + i;
      const bool okA = row_ok && i < GA;
      const bool okB = row_ok && i < GA && gb < G;
      wa[u] = okA ? ld_stream_tc(qweight + (size_t)rowA * kVecs + i * 4 + t) : make_uint4(0, 0, 0, 0);
      wb[u] = okB ? ld_stream_tc(qweight + (size_t)rowB * kVecs + gb * 4 + t) : make_uint4(0, 0, 0, 0);
      sa[u] = (okA && t == 0) ? __half2float(scales[(size_t)rowA * G + i]) : 0.f;
      sb[u] = (okB && t == 0) ? __half2float(scales[(size_t)rowB * G + gb]) : 0.f;
    }
  };

  int tile = blockIdx.x;
  const int step = kTcUnroll * kTcWarps;  // iterations consumed per batch by the CTA
  if (tile < tiles) load_batch(tile, warp);
  pdl_wait();
  pdl_trigger();

  // Prologue: x (RMSNorm-ed if NORM) into shared memory.
  {
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    uint4* xs4 = reinterpret_cast<uint4*>(xs);
    float ss = 0.f;
    for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
      uint4 xv = x4[v];
      const half2* h = reinterpret_cast<const half2*>(&xv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __half22float2(h[j]);
        ss += f.x * f.x + f.y * f.y;
      }
      xs4[v] = xv;
    }
    if (NORM) {
      const float rstd = rsqrtf(block_sum<kTcWarps>(ss, nred) / K + kRmsEps);
      const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
      for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
        uint4 xv = xs4[v], wn = w4[v];
        half2* h = reinterpret_cast<half2*>(&xv);
        const half2* gw = reinterpret_cast<const half2*>(&wn);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float2 f = __half22float2(h[j]), gf = __half22float2(gw[j]);
          h[j] = __floats2half2_rn(f.x * rstd * gf.x, f.y * rstd * gf.y);
        }
        xs4[v] = xv;
      }
    }
    __syncthreads();
  }
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);

  for (; tile < tiles; tile += gridDim.x) {
    float accA = 0.f, accB = 0.f;
#pragma unroll 1
    for (int i0 = warp; i0 < GA; i0 += step) {
      if (i0 != warp) load_batch(tile, i0);
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        const int i = i0 + u * kTcWarps;
        if (i >= GA) break;  // warp-uniform
        // B fragment: column g = 0 takes x of group gA = i, column 1 x of group GB0 + i.
        const int gx = (g == 0) ? i : GB0 + i;
        const bool has_x = g < 2 && gx < G;
        const uint32_t wA[4] = {wa[u].x, wa[u].y, wa[u].z, wa[u].w};
        const uint32_t wB[4] = {wb[u].x, wb[u].y, wb[u].z, wb[u].w};
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
          mma16816(d, a0, xv.x, xv.y);
          mma16816(d, a1, xv.z, xv.w);
        }
        accA = fmaf(sa[u], d[0], accA);  // D[g][0]: meaningful in threads t == 0
        accB = fmaf(sb[u], d[3], accB);  // D[g+8][1]
      }
    }
    if (t == 0) {
      red[warp][g][0] = accA;
      red[warp][g][1] = accB;
    }
    __syncthreads();
    if (threadIdx.x < kTcRows) {
      const int r = threadIdx.x, n = tile * kTcRows + r;
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int w = 0; w < kTcWarps; ++w) {
        a += red[w][r][0];
        b += red[w][r][1];
      }
      if (n < N) {
        if (EPI == kTcSwiGLU) {
          out[n] = __float2half_rn(a / (1.f + __expf(-a)) * b);
        } else if (EPI == kTcResidual) {
          out[n] = __float2half_rn(__half2float(out[n]) + a + b);
        } else {
          out[n] = __float2half_rn(a + b + (bias ? __half2float(bias[n]) : 0.f));
        }
      }
    }
    __syncthreads();  // red is reused by the next tile
    const int next = tile + gridDim.x;
    if (next < tiles) load_batch(next, warp);
  }
}
