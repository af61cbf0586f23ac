// lm_head_rows.cu: the final RMSNorm, lm_head and greedy argmax for M = 1..kVerifyRows rows of
// one sequence (the speculative decode step's current token and drafts): logits[r] = W @
// rmsnorm(x[r]) * norm_w for every row r, and keys[r] = the row's argmax key (decode_misc.cu's
// argmax_key format, the sampler's). The batch-1 decode step keeps lm_head_argmax.
//
// Why tensor cores: W (fp16 [V, kHidden], 1.09 GB on the 7B) is read once a launch whatever M
// is, so the launch stays memory-bound (~245 us at 4.5 TB/s) only while its FLOPs keep up: at
// M = 16 that is 2 x 16 x V x kHidden = 17.4 GFLOP in 245 us, 71 TFLOP/s, past the CUDA cores'
// fp32 FMA peak (~67 TFLOP/s on an H200), a tenth of mma.sync's. W is the A operand of
// m16n8k16 (16 vocab rows x 16 of K), the normalized x rows the B columns (n8 tiles: one for
// M <= 8, two up to 16).
//
// Streaming. Persistent grid, one CTA an SM; CTA b takes blocks of kLmrBlockRows vocab rows b,
// b + grid, ... (7B: 1188 blocks, 9 a CTA on 132 SMs). One producer thread streams a block's
// k-tiles (kLmrBlockRows rows x kLmrKTile columns, 16 KB) with one TMA 2-D copy each, in the
// 128-byte swizzle (chunk c of a 128-byte row r at c ^ (r % 8)), into a ring of `stages` slots
// ((dynamic shared memory - x) / 16 KB, at most kLmrMaxStages: 10 at M <= 8, 6 at M = 16 on
// the 7B); rows past V load as zeros. A whole-tile copy, not a copy per row: the copy engine
// pays per copy (a row of one k-tile is 128 bytes). kLmrConsumers consumer warps own 32 rows
// (two m16 tiles) of the block each and keep their accumulators over the block's k-tiles, A
// fragments by ldmatrix from the swizzled tile (conflict-free), B fragments by ldmatrix from
// x. The producer starts before griddepcontrol.wait: the weights do not depend on x.
//
// x. The consumers RMS-normalize the M rows into shared memory once (fp16, one rounding, as
// the reference), rows M .. 8 NT - 1 zero, each row padded by 16 bytes so the 8 row addresses of
// an ldmatrix fall on 8 different bank groups. 8 NT rows of kHidden halves: 57 KB at M <= 8,
// 115 KB at M = 16 on the 7B (the ring takes what is left).
//
// Arguments:
//   w_map   CUtensorMap of W fp16 [V, kHidden] row-major: boxes of kLmrBlockRows rows x
//           kLmrKTile columns, 128-byte swizzle (registry: lm_head_rows' map)
//   x       fp16 [M, kHidden]    the rows' hidden states (pre-norm)
//   norm_w  fp16 [kHidden]       the final RMSNorm weight
//   logits  fp32 [M, V]          row-major
//   keys    u64  [M]             atomicMax of argmax_key(logit, id) per row; zero before the
//                                launch (sample_finish's contract re-zeroes its own key)
//   M       int 1 .. kVerifyRows; V int vocabulary rows (<= W's rows)
// Grid: at most one CTA an SM; block kLmrThreads; dynamic shared memory registry.lmr_smem.
#include "common.cuh"

constexpr int kLrRows = kLmrBlockRows;
constexpr int kLrKT = kLmrKTile;
constexpr int kLrStageBytes = kLrRows * kLrKT * 2;
constexpr int kLrKTiles = kHidden / kLrKT;
constexpr int kLrXStride = kHidden * 2 + 16;  // bytes of a padded x row
constexpr int kLrMT = kLrRows / (16 * kLmrConsumers);  // m16 tiles a consumer warp
constexpr int kLrConsumerThreads = kLmrConsumers * kWarp;
constexpr int kLrXBarrier = 1;  // named barrier: the consumers, once x is in shared memory
static_assert(kLmrThreads == kLrConsumerThreads + kWarp, "one producer warp beside consumers");
static_assert(kLrKT * 2 == 128, "a k-tile row is one 128-byte swizzle row");
static_assert(kHidden % kLrKT == 0, "whole k-tiles");
static_assert(kLrRows % (16 * kLmrConsumers) == 0 && kLrRows <= 256, "TMA box rows");
static_assert(kLrXStride % 128 == 16, "x rows' ldmatrix addresses on distinct bank groups");
static_assert(kVerifyRows <= 16, "two n8 tiles of x rows at most");
static_assert(kLrStageBytes % 1024 == 0, "128-byte-swizzled TMA boxes are 1024-byte aligned");

template <int NT>
__device__ __forceinline__ void lm_rows_consume(uint32_t x_s, uint32_t ring_s,
                                                unsigned long long* full_bar,
                                                unsigned long long* empty_bar, int stages,
                                                float* __restrict__ logits, int M, int V,
                                                unsigned long long (&best)[2][2]) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane >> 2, c = lane & 3;
  // ldmatrix lane addresses: A rows warp 32 + mt 16 + lane % 16 at chunk 2 ks + lane / 16 of
  // the swizzled tile; B (x) rows nt 8 + lane % 8 at chunk 4 kp + lane / 8 of a k-tile.
  const int a_row = warp * 16 * kLrMT + (lane & 15);
  const uint32_t x_lane = x_s + (lane & 7) * kLrXStride + (lane >> 3) * 16;
  int it = 0;
  for (int blk = blockIdx.x; blk * kLrRows < V; blk += gridDim.x) {
    float acc[kLrMT][NT][4] = {};
    for (int kt = 0; kt < kLrKTiles; ++kt, ++it) {
      const int slot = it % stages;
      mbar_wait(smem_addr(&full_bar[slot]), (it / stages) & 1);
      const uint32_t tile = ring_s + slot * kLrStageBytes;
#pragma unroll
      for (int kp = 0; kp < kLrKT / 32; ++kp) {
        uint32_t b[NT][4];  // k-steps 2 kp (b[.][0..1]) and 2 kp + 1 (b[.][2..3])
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          ldmatrix_x4(b[nt], x_lane + nt * 8 * kLrXStride + (kt * (kLrKT / 8) + 4 * kp) * 16);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ks = 2 * kp + h;
#pragma unroll
          for (int mt = 0; mt < kLrMT; ++mt) {
            const int row = a_row + mt * 16;
            uint32_t a[4];
            ldmatrix_x4(a, tile + row * 128 + (((2 * ks + (lane >> 4)) ^ (row & 7)) << 4));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
              mma_16816(acc[mt][nt], a, b[nt][2 * h], b[nt][2 * h + 1]);
          }
        }
      }
      __syncwarp();  // every lane's ldmatrix of this slot is done
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[slot]));
    }
    // c0, c1: vocab row v, x rows n, n + 1; c2, c3: vocab row v + 8.
#pragma unroll
    for (int mt = 0; mt < kLrMT; ++mt) {
      const int v = blk * kLrRows + warp * 16 * kLrMT + mt * 16 + g;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = nt * 8 + 2 * c + e;
          if (n >= M) continue;
#pragma unroll
          for (int hv = 0; hv < 2; ++hv) {
            const int vv = v + 8 * hv;
            if (vv >= V) continue;
            const float val = acc[mt][nt][2 * hv + e];
            logits[(size_t)n * V + vv] = val;
            const unsigned long long k = argmax_key(val, vv);
            best[nt][e] = k > best[nt][e] ? k : best[nt][e];
          }
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(kLmrThreads, 1)
lm_head_rows(const __grid_constant__ TensorMap w_map, const half* __restrict__ x,
             const half* __restrict__ norm_w, float* __restrict__ logits,
             unsigned long long* keys, int M, int V) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full_bar[kLmrMaxStages], empty_bar[kLmrMaxStages];
  __shared__ unsigned long long best_s[kLmrConsumers][16];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int NT = M > 8 ? 2 : 1;
  const uint32_t raw = smem_addr(smem_raw);
  unsigned char* x_p = smem_raw + ((raw + 1023) & ~1023u) - raw;
  const int x_bytes = (NT * 8 * kLrXStride + 1023) & ~1023;
  unsigned char* ring = x_p + x_bytes;
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int stages = min(kLmrMaxStages, (int)(dyn - (ring - smem_raw)) / kLrStageBytes);
  if (stages < 2 || M < 1 || M > kVerifyRows) __trap();  // a launch the host refuses
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);               // the producer's expect_tx
      mbar_init(smem_addr(&empty_bar[s]), kLmrConsumers);  // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kLmrConsumers) {
    // ---- producer: one thread, the (block, k-tile) sequence of this CTA.
    if (lane == 0) {
      int it = 0;
      for (int blk = blockIdx.x; blk * kLrRows < V; blk += gridDim.x) {
        for (int kt = 0; kt < kLrKTiles; ++kt, ++it) {
          const int slot = it % stages, round = it / stages;
          if (round > 0) mbar_wait(smem_addr(&empty_bar[slot]), (round - 1) & 1);
          const uint32_t full = smem_addr(&full_bar[slot]);
          mbar_arrive_expect_tx(full, kLrStageBytes);
          tma_load_2d(smem_addr(ring + slot * kLrStageBytes), w_map, kt * kLrKT, blk * kLrRows,
                      full);
        }
      }
    }
    pdl_trigger();
    return;
  }

  // ---- consumers: x rows into shared memory (warp w: rows w, w + kLmrConsumers, ...).
  pdl_wait();  // x comes from the last layer
  pdl_trigger();
  constexpr int kVecs = kHidden / 8;
  const uint4* nw4 = reinterpret_cast<const uint4*>(norm_w);
  for (int n = warp; n < NT * 8; n += kLmrConsumers) {
    uint4* dst = reinterpret_cast<uint4*>(x_p + n * kLrXStride);
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)n * kHidden);
    if (n >= M) {
      for (int v = lane; v < kVecs; v += kWarp) dst[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    float ss = 0.f;
    for (int v = lane; v < kVecs; v += kWarp) add_squares(ss, src[v]);
    const float rstd = rsqrtf(warp_sum(ss) / kHidden + kRmsEps);
    for (int v = lane; v < kVecs; v += kWarp) dst[v] = rmsnorm_vec(src[v], nw4[v], rstd);
  }
  named_barrier_sync(kLrXBarrier, kLrConsumerThreads);

  unsigned long long best[2][2] = {{0ull, 0ull}, {0ull, 0ull}};
  const uint32_t x_s = smem_addr(x_p), ring_s = smem_addr(ring);
  if (NT == 1)
    lm_rows_consume<1>(x_s, ring_s, full_bar, empty_bar, stages, logits, M, V, best);
  else
    lm_rows_consume<2>(x_s, ring_s, full_bar, empty_bar, stages, logits, M, V, best);
  // Lanes with the same c hold the same x rows: reduce over g, then over the warps.
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int off = 4; off < kWarp; off <<= 1) {
        const unsigned long long o = __shfl_xor_sync(0xffffffffu, best[nt][e], off);
        best[nt][e] = o > best[nt][e] ? o : best[nt][e];
      }
    }
  }
  if (lane < 4) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) best_s[warp][nt * 8 + 2 * lane + e] = best[nt][e];
  }
  named_barrier_sync(kLrXBarrier, kLrConsumerThreads);
  if (threadIdx.x < M) {
    unsigned long long b = 0;
    for (int w = 0; w < kLmrConsumers; ++w) {
      const unsigned long long o = best_s[w][threadIdx.x];
      b = o > b ? o : b;
    }
    atomicMax(keys + threadIdx.x, b);
  }
}
