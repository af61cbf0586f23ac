// decode_misc.cu: the small token-parallel kernels around the GEMVs and the device sampler.
//
// embed_gather   x[t] = embed[ids[t]], res[t] its fp32 copy  (T tokens; decode: T = 1)
// rmsnorm_rows   y[t] = rmsnorm(x[t]) * w                    (prefill: before each GEMM)
// rope_kv_write  q/k RoPE + K/V into 16-token pages          (T tokens at positions pos0..)
// lm_head_argmax logits = W_lm @ rmsnorm(x) (fp32) and a 64-bit atomicMax of (logit, -id);
//                lm_head_argmax_q8 the same over an int8 W_lm with a scale a row
// sample_finish  picks the token (greedy or temperature/top-k/top-p), advances the decode
//                state on the device, writes the ring buffers, sets the while-loop condition
// sample_batch   the same rule per row of the batched decode step, each row with its own
//                parameters and draw counter (the host keeps each sequence's state)
#include "common.cuh"
#include "kv_cache.cuh"
#include "sampler.cuh"
// From cuda_device_runtime_api.h (declared here: that header drags in host-only internals
// under NVRTC). Sets a graph conditional node's value from device code.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

// From the generated header (nanoqwen/cuda/registry.py): kMiscThreads (the token-parallel
// kernels' block), kNormRows (rmsnorm_rows' rows a CTA, a warp each), kLmWarps, kLmMaxSlots and
// kLmQ8MaxSlots (lm_head's warps a CTA and its most rows in flight a warp, fp16 and int8
// rows), kSampleThreads (the sampler's block: sampler.cuh) and enum StateWord: the decode
// state's int32 words in device memory (registry.StateWord), advanced by sample_finish.

// ids int32 [T]; embed fp16 [V, kHidden]; x fp16 [T, kHidden] (what the first RMSNorm reads)
// and res fp32 [T, kHidden] (the residual stream). Grid T, block kMiscThreads.
extern "C" __global__ void __launch_bounds__(kMiscThreads)
embed_gather(const int* __restrict__ ids, const uint4* __restrict__ embed, uint4* __restrict__ x,
             float4* __restrict__ res) {
  static_assert(kHidden % 8 == 0, "rows are copied as 16-byte vectors");
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const size_t id = (size_t)ids[t];
  for (int v = threadIdx.x; v < kHidden / 8; v += blockDim.x) {
    const uint4 e = embed[id * (kHidden / 8) + v];
    const size_t i = (size_t)t * (kHidden / 8) + v;
    x[i] = e;
    const half2* h = reinterpret_cast<const half2*>(&e);
    const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]);
    const float2 f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
    res[2 * i] = make_float4(f0.x, f0.y, f1.x, f1.y);
    res[2 * i + 1] = make_float4(f2.x, f2.y, f3.x, f3.y);
  }
}

// x fp16 [T, kHidden] -> y fp16 [T, kHidden] = x * rsqrt(mean(x^2) + eps) * w (fp32 math,
// one rounding, like the reference). w fp16 [kHidden]. One warp a row, kNormRows rows a CTA
// (grid ceil(T / kNormRows), block kMiscThreads): the row stays in registers, 16-byte vectors,
// between its sum of squares and its scaling, so x is read once. The launch and its gaps, not
// the CTA count, set its time (alternatives measured: docs/EXPERIMENTS.md).
extern "C" __global__ void __launch_bounds__(kMiscThreads)
rmsnorm_rows(const uint4* __restrict__ x, const uint4* __restrict__ w, uint4* __restrict__ y,
             int T) {
  constexpr int kVecs = kHidden / 8;
  constexpr int kPerLane = (kVecs + kWarp - 1) / kWarp;
  pdl_wait();
  pdl_trigger();
  const int row = blockIdx.x * kNormRows + threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (row >= T) return;
  const uint4* xr = x + (size_t)row * kVecs;
  uint4 v[kPerLane];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    if (c < kVecs) {
      v[i] = xr[c];
      add_squares(ss, v[i]);
    }
  }
  const float rstd = rsqrtf(warp_sum(ss) / kHidden + kRmsEps);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    if (c < kVecs) y[(size_t)row * kVecs + c] = rmsnorm_vec(v[i], w[c], rstd);
  }
}

// RoPE (NEOX halves) on q and k, then K/V into the paged cache.
// qkv    fp32 [T, kQKVSize]   q | k | v per token, bias already added (the prefill GEMM's
//                             fp32 output: k reaches the cache without an fp16 rounding
//                             before RoPE, as the decode step's GEMV epilogue keeps it)
// pos0   int                  position of token 0 (the prefill's first uncached token)
// rope   float2 [max_pos, kHeadDim/2]  (cos, sin), formed in float64 on the host
// pages  int32 [max_pages]    page table of the sequence: logical page -> physical page
// kc, vc fp16                this layer's caches (kv_cache.cuh; prefill attention reads them)
// q_out  fp16 [T, kHeads, kHeadDim]
// Grid T, block kMiscThreads. A thread takes 8 rotations (chunk c of a head's first half and
// of its second) or 8 values of v: one 16-byte chunk of the cache (kv_chunk) a half head, and
// for K one of each part.
namespace rope_kv {
__device__ __forceinline__ void load8(float (&x)[8], const float* src) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
// x rounded to fp16 (hi) and, where rest is given, what it leaves: rest = fp16(x - hi).
__device__ __forceinline__ uint4 round8(const float (&x)[8], uint4* rest) {
  uint4 h;
  uint32_t* hw = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
  for (int k = 0; k < 4; ++k) hw[k] = pack_half2(x[2 * k], x[2 * k + 1]);
  if (rest) {
    const half2* h2 = reinterpret_cast<const half2*>(&h);
    uint32_t* rw = reinterpret_cast<uint32_t*>(rest);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(h2[k]);
      rw[k] = pack_half2(x[2 * k] - f.x, x[2 * k + 1] - f.y);
    }
  }
  return h;
}
// 8 values of a K row into the cache at k_offset `at` (kKParts parts).
__device__ __forceinline__ void store_k8(half* kc, size_t at, const float (&x)[8]) {
  uint4 lo;
  *reinterpret_cast<uint4*>(kc + at) = round8(x, kKParts == 2 ? &lo : nullptr);
  if constexpr (kKParts == 2) *reinterpret_cast<uint4*>(kc + at + kKvTileH) = lo;
}
}  // namespace rope_kv

extern "C" __global__ void __launch_bounds__(kMiscThreads)
rope_kv_write(const float* __restrict__ qkv, int pos0, const float2* __restrict__ rope,
              const int* __restrict__ pages, half* kc, half* vc, half* q_out) {
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kChunks = kHalf / 8;                    // 16-byte chunks of half a head
  constexpr int kRot = (kHeads + kKVHeads) * kChunks;  // rotation items; the v items follow
  static_assert(kHalf % 8 == 0, "a head's halves are whole 16-byte chunks");
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x;
  const int pos = pos0 + t;
  const float* row = qkv + (size_t)t * kQKVSize;
  const int page = pages[pos / kPageTokens], tp = pos % kPageTokens;
  const float4* cs = reinterpret_cast<const float4*>(rope + (size_t)pos * kHalf);
  for (int i = threadIdx.x; i < kRot + kKVSize / 8; i += blockDim.x) {
    if (i >= kRot) {
      const int e = 8 * (i - kRot);
      float v[8];
      rope_kv::load8(v, row + kQSize + kKVSize + e);
      *reinterpret_cast<uint4*>(vc + v_offset(page, e / kHeadDim, tp, e % kHeadDim)) =
          rope_kv::round8(v, nullptr);
      continue;
    }
    const int head = i / kChunks, j = 8 * (i % kChunks);  // pairs j .. j + 7
    const float* src = row + head * kHeadDim + j;
    float x1[8], x2[8], lo[8], hi[8];
    rope_kv::load8(x1, src);
    rope_kv::load8(x2, src + kHalf);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 c = cs[j / 2 + k];  // (cos, sin) of pairs j + 2k and j + 2k + 1
      lo[2 * k] = x1[2 * k] * c.x - x2[2 * k] * c.y;
      lo[2 * k + 1] = x1[2 * k + 1] * c.z - x2[2 * k + 1] * c.w;
      hi[2 * k] = x2[2 * k] * c.x + x1[2 * k] * c.y;
      hi[2 * k + 1] = x2[2 * k + 1] * c.z + x1[2 * k + 1] * c.w;
    }
    if (head < kHeads) {
      half* q = q_out + ((size_t)t * kHeads + head) * kHeadDim + j;
      *reinterpret_cast<uint4*>(q) = rope_kv::round8(lo, nullptr);
      *reinterpret_cast<uint4*>(q + kHalf) = rope_kv::round8(hi, nullptr);
    } else {
      const int kh = head - kHeads;
      rope_kv::store_k8(kc, k_offset(page, kh, tp, j), lo);
      rope_kv::store_k8(kc, k_offset(page, kh, tp, j + kHalf), hi);
    }
  }
}

// Eight int8 weights (one 8-byte word, K-elements 8c..8c+7 of a row) dotted with eight fp16
// activations (one 16-byte vector of x), added to acc in fp32. Each byte becomes a float
// without I2F (16 a clock an SM on sm_90, too few for the head's rate): flipping its sign bit
// gives q + 128 as an unsigned byte, which a byte permute drops into the low mantissa byte of
// 2^23, so the float is 2^23 + 128 + q exactly, and one subtraction leaves q.
__device__ __forceinline__ float dot_q8x8(uint2 wq, uint4 xv, float acc) {
  constexpr float kBias = 8388608.f + 128.f;  // 2^23 + 128
  constexpr uint32_t kExp = 0x4B000000u;      // the bits of 2^23
  const uint32_t u[2] = {wq.x ^ 0x80808080u, wq.y ^ 0x80808080u};
  const half2* x2 = reinterpret_cast<const half2*>(&xv);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 b = __half22float2(x2[i]);
    const uint32_t w = u[i / 2], lo = 2 * (i % 2);  // bytes lo, lo + 1 of word i / 2
    const float a0 = __uint_as_float(__byte_perm(w, kExp, 0x7650u + lo)) - kBias;
    const float a1 = __uint_as_float(__byte_perm(w, kExp, 0x7650u + lo + 1)) - kBias;
    acc = fmaf(a0, b.x, fmaf(a1, b.y, acc));
  }
  return acc;
}

// logits fp32 [V] = W [V, kHidden] @ rmsnorm(x) * norm_w, and *key = max over rows of
// argmax_key(logit, row) (the caller zeroes *key before the first use; sample_finish re-zeroes).
// x fp16 [kHidden]; norm_w fp16 [kHidden]; V int rows. W is fp16 [V, kHidden] row-major
// (lm_head_argmax), or int8 [V, kHidden] row-major with scale fp32 [V], logit = scale[row] *
// (q_row . xn) (lm_head_argmax_q8: half the bytes; quant.quantize_rows_int8).
// Persistent grid of at most one CTA an SM; warp j of the grid takes rows j, j + warps, ...
// Each warp streams its own rows: lane 0 copies a whole row (one bulk copy, kRowBytes) into the
// next of the warp's slots in dynamic shared memory (slots = dynamic size / (kLmWarps * row
// bytes), at most kMaxSlots; the host side: nanoqwen/cuda/registry.py lm_head_smem_bytes), so
// its next rows are in flight while it dots the current one; the first ones are requested
// before griddepcontrol.wait (the weights do not depend on x). Every warp loads all of x into
// registers (kHidden / 256 vectors a lane) and RMS-normalizes it itself: no block barrier before
// the first row. An int8 warp's lanes load the scales of its next 32 rows at once, one batch
// ahead, and a shuffle hands each row its scale: no dependent global load a row.
template <bool kInt8>
__device__ __forceinline__ void lm_head_body(const half* __restrict__ x,
                                             const half* __restrict__ norm_w,
                                             const unsigned char* __restrict__ w,
                                             const float* __restrict__ scale,
                                             float* __restrict__ logits, unsigned long long* key,
                                             int V) {
  constexpr int kVecs = kHidden / 8;  // 16-byte vectors of x per row
  constexpr int kPer = (kVecs + kWarp - 1) / kWarp;  // of them per lane
  constexpr uint32_t kRowBytes = kHidden * (kInt8 ? 1 : 2);
  constexpr int kMaxSlots = kInt8 ? kLmQ8MaxSlots : kLmMaxSlots;
  static_assert(kRowBytes % 16 == 0, "bulk copies move 16-byte units");
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long full[kLmWarps][kMaxSlots];
  __shared__ unsigned long long best_s[kLmWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int slots = min(kMaxSlots, (int)(dyn / (kLmWarps * kRowBytes)));
  if (slots < 1) __trap();  // a launch the host must not make
  const int nw = gridDim.x * kLmWarps, row0 = blockIdx.x * kLmWarps + warp;
  const uint32_t ring_s = smem_addr(ring) + warp * slots * kRowBytes;
  if (lane == 0) {
    for (int k = 0; k < slots; ++k) mbar_init(smem_addr(&full[warp][k]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  // Row number k of this warp (row0 + k * nw) into slot k % slots.
  auto request = [&](int k) {
    const int row = row0 + k * nw;
    if (lane == 0 && row < V) {
      const uint32_t bar = smem_addr(&full[warp][k % slots]);
      mbar_arrive_expect_tx(bar, kRowBytes);
      bulk_g2s(ring_s + (k % slots) * kRowBytes, w + (size_t)row * kRowBytes, kRowBytes, bar);
    }
  };
  for (int k = 0; k < slots; ++k) request(k);
  // The scale of this warp's row number 32 b + lane (int8 only).
  auto batch_scale = [&](int b) {
    const int row = row0 + (b * kWarp + lane) * nw;
    return kInt8 && row < V ? scale[row] : 0.f;
  };
  float s_cur = batch_scale(0), s_next = batch_scale(1);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* nw4 = reinterpret_cast<const uint4*>(norm_w);
  uint4 xr[kPer], gw[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = j * kWarp + lane;
    gw[j] = c < kVecs ? nw4[c] : make_uint4(0, 0, 0, 0);
  }
  pdl_wait();
  pdl_trigger();
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = j * kWarp + lane;
    xr[j] = c < kVecs ? x4[c] : make_uint4(0, 0, 0, 0);
    add_squares(ss, xr[j]);
  }
  const float rstd = rsqrtf(warp_sum(ss) / kHidden + kRmsEps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) xr[j] = rmsnorm_vec(xr[j], gw[j], rstd);

  unsigned long long best = 0;
  for (int k = 0, row = row0; row < V; ++k, row += nw) {
    const int slot = k % slots;
    mbar_wait(smem_addr(&full[warp][slot]), (k / slots) & 1);
    const unsigned char* wr = ring + (warp * slots + slot) * kRowBytes;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int c = j * kWarp + lane;
      if (c < kVecs) {
        if constexpr (kInt8) {
          acc = dot_q8x8(reinterpret_cast<const uint2*>(wr)[c], xr[j], acc);
        } else {
          const uint4 wv = reinterpret_cast<const uint4*>(wr)[c];
          const half2* w2 = reinterpret_cast<const half2*>(&wv);
          const half2* x2 = reinterpret_cast<const half2*>(&xr[j]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 a = __half22float2(w2[i]), b = __half22float2(x2[i]);
            acc = fmaf(a.x, b.x, fmaf(a.y, b.y, acc));
          }
        }
      }
    }
    __syncwarp();  // every lane has read the slot: its next row may land there
    if (lane == 0) fence_proxy_async_smem();
    request(k + slots);
    float v = warp_sum(acc);
    if constexpr (kInt8) {
      if (k % kWarp == 0 && k > 0) {
        s_cur = s_next;
        s_next = batch_scale(k / kWarp + 1);
      }
      v *= __shfl_sync(0xffffffffu, s_cur, k % kWarp);
    }
    if (lane == 0) logits[row] = v;
    const unsigned long long kk = argmax_key(v, row);
    best = kk > best ? kk : best;
  }
  if (lane == 0) best_s[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 0; i < kLmWarps; ++i) best = best_s[i] > best ? best_s[i] : best;
    atomicMax(key, best);
  }
}

// w fp16 [V, kHidden] row-major; the other arguments: lm_head_body.
extern "C" __global__ void __launch_bounds__(kLmWarps * kWarp, 1)
lm_head_argmax(const half* __restrict__ x, const half* __restrict__ norm_w,
               const half* __restrict__ w, float* __restrict__ logits,
               unsigned long long* key, int V) {
  lm_head_body<false>(x, norm_w, reinterpret_cast<const unsigned char*>(w), nullptr, logits,
                      key, V);
}

// w int8 [V, kHidden] row-major; scale fp32 [V], one a row; the other arguments: lm_head_body.
extern "C" __global__ void __launch_bounds__(kLmWarps * kWarp, 1)
lm_head_argmax_q8(const half* __restrict__ x, const half* __restrict__ norm_w,
                  const signed char* __restrict__ w, const float* __restrict__ scale,
                  float* __restrict__ logits, unsigned long long* key, int V) {
  lm_head_body<true>(x, norm_w, reinterpret_cast<const unsigned char*>(w), scale, logits, key,
                     V);
}

// The sampler's rule, one CTA of kSampleThreads over one row of logits: with temperature > 0
// and top_k != 1 one draw from the kept set (sampler.cuh) with the counter state[kStep], else
// the argmax key's id (lowest id on ties). The token is valid in thread 0 only. The branch is
// uniform over the CTA (the words are the same for every thread): kept_set's barriers are whole.
// logits fp32 [V]; key: the row's u64 argmax key; state: the row's StateWord words (reads
// TEMP, TOP_K, TOP_P, SEED_LO, SEED_HI, STEP).
__device__ __forceinline__ int pick_token(const float* __restrict__ logits, int V,
                                          unsigned long long key, const int* state) {
  const float temp = __int_as_float(state[kTemp]);
  const int top_k = state[kTopK];
  int token = argmax_key_id(key);
  if (temp > 0.f && top_k != 1) {
    __shared__ float part[kSampleThreads];
    const KeptSet s = kept_set(logits, V, argmax_key_value(key), temp, top_k,
                               __int_as_float(state[kTopP]));
    kept_parts(logits, V, s, -1, part);
    if (threadIdx.x == 0) {
      const unsigned long long seed =
          ((unsigned long long)(uint32_t)state[kSeedHi] << 32) | (uint32_t)state[kSeedLo];
      const int pick = draw_parts(logits, V, s, -1, part, parts_total(part),
                                  uniform01(seed, (unsigned long long)state[kStep]));
      if (pick >= 0) token = pick;  // -1: no kept weight (total 0), the argmax stands
    }
  }
  return token;
}

// Picks the next token (pick_token) and advances the decode state (one CTA of kSampleThreads).
// logits   fp32 [V]; key: u64 argmax key from lm_head_argmax (re-zeroed here)
// state    int32 [kEos0 + kMaxEos]  (StateWord)
// ring     int32 [max_new]  device copy of the generated ids (ring[step] = token)
// host_ring int32 [max_new] mapped pinned host memory (may be null): the host streams from it
// cancel   int32 * mapped pinned host flag (may be null): nonzero stops after this token
// cond     graph conditional handle of the generation while-loop (0 = none): set to !done
// One block an SM in the bounds: without it ptxas aimed at two (32 registers) and spilled
// kept_set's selection state (ptxas -v: 168 bytes; with it 64 registers, none).
extern "C" __global__ void __launch_bounds__(kSampleThreads, 1)
sample_finish(const float* __restrict__ logits, unsigned long long* key, int* state, int* ring,
              volatile int* host_ring, const volatile int* cancel,
              unsigned long long cond, int V) {
  pdl_wait();
  const int token = pick_token(logits, V, *key, state);
  if (threadIdx.x == 0) {
    const int step = state[kStep];
    ring[step] = token;
    bool done = step + 1 >= state[kMaxNew];
    for (int i = 0; i < state[kNumEos]; ++i) done |= token == state[kEos0 + i];
    if (cancel && *cancel) done = true;
    state[kToken] = token;
    state[kPos] += 1;
    state[kStep] = step + 1;
    state[kDone] = done ? 1 : 0;
    *key = 0ull;
    if (host_ring) {
      host_ring[step] = token;
      __threadfence_system();  // the token is visible to the host before the count moves
      host_ring[-1] = step + 1;  // word before the ring: tokens written so far
    }
    if (cond) cudaGraphSetConditional(cond, done ? 0u : 1u);
  }
}

// Per-row sampling of the batched decode step (engine/batch.py) and of a batch sequence's
// first token (CudaBackend.prefill_chunk): row r picks by pick_token with its own words, so
// a row's draw is the plain loop's draw for the same (seed, step). Nothing else of a decode
// state is read or advanced: the host keeps each sequence's state.
// logits  fp32 [rows, V]                  row r at r * V (lm_head_rows)
// keys    u64 [rows]                      each row's argmax key (re-zeroed here)
// params  int32 [rows, kEos0 + kMaxEos]   row r's StateWord words; reads TEMP, TOP_K, TOP_P,
//                                         SEED_LO, SEED_HI, STEP
// tokens  int32 [rows]                    out: row r's token
// Grid rows, block kSampleThreads (one CTA a row; the bound as sample_finish's: no spills).
extern "C" __global__ void __launch_bounds__(kSampleThreads, 1)
sample_batch(const float* __restrict__ logits, unsigned long long* keys,
             const int* __restrict__ params, int* __restrict__ tokens, int V) {
  pdl_wait();
  pdl_trigger();
  const int r = blockIdx.x;
  const int token = pick_token(logits + (size_t)r * V, V, keys[r],
                               params + r * (kEos0 + kMaxEos));
  if (threadIdx.x == 0) {
    tokens[r] = token;
    keys[r] = 0ull;
  }
}
