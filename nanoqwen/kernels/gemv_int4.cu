// gemv_int4.cu: batch-1 decode GEMV over INT4 ValueShuffle weights, fp32 accumulation.
//
//   out = epilogue( dequant(W) @ norm(x) )
//
// Design (memory-bound: every weight byte is read exactly once per token):
// * A warp owns kRows output rows; a lane reads 16-byte words (32 nibbles) of each row, strided
//   by 32 lanes, kUnroll x kRows loads in flight before any arithmetic (MLP to cover ~1 us HBM
//   latency). Loads use ld.global.nc.L1::no_allocate: weights are streamed, never reused.
// * The grid is persistent (host picks ~4 CTAs per SM); warps loop over row tiles, so the
//   RMSNorm prologue runs once per CTA, not once per 8 rows.
// * x (normalized if NORM) is staged in shared memory with a 16-byte pad after every 64 bytes:
//   lane L reads bytes [80L, 80L + 64), which puts the 8 lanes of each 128-bit phase on
//   distinct banks (no conflicts).
// * Dequant: lop3 + hsub2 per nibble pair (decode_common.cuh); products in half2 over 4
//   elements per half (|x| < 2047 cannot overflow: |v| <= 8), then fp32 with the group scale.
// * PDL: the first weight batch is loaded *before* griddepcontrol.wait, so the fetch overlaps
//   the previous kernel's tail; x is read only after the wait.
#include "decode_common.cuh"

constexpr int kGemvWarps = 4;   // warps per CTA
constexpr int kRows = 2;        // rows per warp tile (SwiGLU: the gate row and its up row)
constexpr int kUnroll = 4;      // 16-byte words per row per lane in flight
constexpr int kElemsPerVec = 32;  // nibbles in one uint4
constexpr int kPadVecs = 5;     // shared x: 4 uint4 of data + 1 pad per 64-byte chunk

enum Epilogue { kStore = 0, kResidual = 1, kSwiGLU = 2 };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Dot product of one uint4 of weights (32 elements) with the matching 32 elements of x.
__device__ __forceinline__ float dot32(const uint4& w, const uint4* xs) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float acc = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint4 xv = xs[q];  // 8 halves = the 8 K-elements of word q
    const half2* x2 = reinterpret_cast<const half2*>(&xv);
    half2 wv[4];
    dequant_word(words[q], wv);
    half2 s = __hmul2(wv[0], x2[0]);
    s = __hfma2(wv[1], x2[1], s);
    s = __hfma2(wv[2], x2[2], s);
    s = __hfma2(wv[3], x2[3], s);
    float2 f = __half22float2(s);
    acc += f.x + f.y;
  }
  return acc;
}

// K: input features (template: the loops fully unroll). NORM: fuse RMSNorm(x) * norm_w.
// EPI: kStore  out[n] = W[n].x + bias[n] (bias may be null)
//      kResidual out[n] += W[n].x (out is the residual stream, read and written in place)
//      kSwiGLU  out[n] = silu(W[n].x) * W[n + N].x   (the weight is [gate; up] stacked)
//
// x       fp16   [K]            activations (one token)
// norm_w  fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N)
// scales  fp16   [R, K/128]     one scale per row and 128-group
// bias    fp16   [N] or null    (kStore only)
// out     fp16   [N]
// N       int                   output features; N % (kRows) == 0 (kSwiGLU: any N)
template <int K, bool NORM, int EPI>
__global__ void __launch_bounds__(kGemvWarps * kWarp)
gemv_int4(const half* __restrict__ x, const half* __restrict__ norm_w,
          const uint4* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, int N) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  static_assert(kGroupSize % kElemsPerVec == 0, "a 16-byte word must not straddle groups");
  constexpr int kVecs = K / kElemsPerVec;            // uint4 per row
  constexpr int kIters = (kVecs + kWarp - 1) / kWarp;  // per lane
  constexpr int kGroups = K / kGroupSize;
  constexpr int kChunks = K / kElemsPerVec;          // 64-byte x chunks
  static_assert(kChunks * kPadVecs * 16 <= 48 * 1024, "padded x must fit static shared memory");
  __shared__ __align__(16) uint4 xs[kChunks * kPadVecs];
  __shared__ float red[kGemvWarps];

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int tiles = (EPI == kSwiGLU) ? N : N / kRows;  // kSwiGLU: one output per tile
  int tile = blockIdx.x * kGemvWarps + warp;
  const int tile_stride = gridDim.x * kGemvWarps;

  // Row r of a tile: kStore/kResidual: rows 2t, 2t+1. kSwiGLU: output n = t (gate row n, up row
  // n + N); a SwiGLU tile is one output with two weight rows.
  auto row_of = [&](int t, int r) -> int {
    return (EPI == kSwiGLU) ? (t + r * N) : (t * kRows + r);
  };

  uint4 wv[kRows][kUnroll];
  float sc[kRows][kUnroll];
  auto load_batch = [&](int t, int j0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row_of(t, r);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = (j0 + u) * kWarp + lane;
        const bool ok = (j0 + u < kIters) && c < kVecs && t < tiles;
        wv[r][u] = ok ? ld_stream(qweight + (size_t)row * kVecs + c) : make_uint4(0, 0, 0, 0);
        sc[r][u] = ok ? __half2float(scales[(size_t)row * kGroups + c / 4]) : 0.f;
      }
    }
  };

  if (tile < tiles) load_batch(tile, 0);  // weights do not depend on the previous kernel
  pdl_wait();
  pdl_trigger();

  // Prologue: stage x (RMSNorm-ed if NORM) in padded shared memory.
  {
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    float ss = 0.f;
    for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
      uint4 xv = x4[v];
      const half2* h = reinterpret_cast<const half2*>(&xv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 f = __half22float2(h[i]);
        ss += f.x * f.x + f.y * f.y;
      }
      xs[(v / 4) * kPadVecs + v % 4] = xv;
    }
    if (NORM) {
      const float rstd = rsqrtf(block_sum<kGemvWarps>(ss, red) / K + kRmsEps);
      const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
      for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
        uint4 xv = xs[(v / 4) * kPadVecs + v % 4], wn = w4[v];
        half2* h = reinterpret_cast<half2*>(&xv);
        const half2* g = reinterpret_cast<const half2*>(&wn);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float2 f = __half22float2(h[i]), gf = __half22float2(g[i]);
          h[i] = __floats2half2_rn(f.x * rstd * gf.x, f.y * rstd * gf.y);
        }
        xs[(v / 4) * kPadVecs + v % 4] = xv;
      }
    }
    __syncthreads();
  }

  for (; tile < tiles; tile += tile_stride) {
    float acc[kRows] = {};
#pragma unroll 1
    for (int j0 = 0; j0 < kIters; j0 += kUnroll) {
      if (j0 > 0) load_batch(tile, j0);  // batch 0 was loaded ahead
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = (j0 + u) * kWarp + lane;
        if (j0 + u < kIters && c < kVecs) {
          const uint4* xc = xs + c * kPadVecs;
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc[r] += sc[r][u] * dot32(wv[r][u], xc);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
      if (EPI == kSwiGLU) {
        // One rounding: silu(gate) * up in fp32 (the fp32 reference rounds nothing here).
        const float g = acc[0], u = acc[1];
        out[tile] = __float2half_rn(g / (1.f + __expf(-g)) * u);
      } else {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int n = tile * kRows + r;
          if (EPI == kResidual) {
            out[n] = __float2half_rn(__half2float(out[n]) + acc[r]);
          } else {
            out[n] = __float2half_rn(acc[r] + (bias ? __half2float(bias[n]) : 0.f));
          }
        }
      }
    }
    const int next = tile + tile_stride;
    if (next < tiles) load_batch(next, 0);
  }
}
