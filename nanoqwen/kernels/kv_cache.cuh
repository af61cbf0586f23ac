// kv_cache.cuh: the layout of the paged K/V cache, shared by its writers (the q/k/v GEMV's
// epilogue, rope_kv_write) and its readers (the attention kernels). Needs the model header.
//
// One cache per layer for K and one for V. V: fp16 [num_pages][kKVHeads][kPageTokens][kHeadDim]:
// the 16 token rows of one (page, kv head) form one contiguous tile, so decode attention moves
// a page of a head with one bulk copy (the copy engine pays per copy: a copy per 256-byte row
// would bound attention at long context). K: kKParts such tiles a (page, kv head), back to back
// (one bulk copy still): with kKParts = 2 the pair (hi, lo) = (fp16(k), fp16(k - hi)), whose
// sum holds k to ~22 bits, and attention adds q.lo to q.hi in the same fp32 accumulators
// (a second mma over the same q fragment). Why: a key rounded to fp16 was the largest rounding
// left in the engine (Qwen2's k bias makes a few dims of every key large, so their 2^-11
// relative rounding shows in every score); docs/DESIGN.md measures it. kKParts = 1 is the plain
// fp16 cache (K_CACHE in nanoqwen/cuda/registry.py).
// Inside a tile the 16-byte chunks of token row t are XOR-swizzled: chunk c is stored at
// c ^ (t % 8). The tile lands in shared memory as it is, and the 8 row addresses of one
// ldmatrix (8 consecutive tokens, one chunk) then fall on 8 different bank groups.
#pragma once

static_assert(kHeadDim % 64 == 0, "the swizzle permutes groups of 8 chunks of 16 bytes");
static_assert(kKParts == 1 || kKParts == 2, "K is fp16 or an fp16 (hi, lo) pair");

constexpr int kKvTileH = kPageTokens * kHeadDim;  // halves of one tile (a page of one kv head)

// Stored chunk of chunk c (8 halves) of token row t of a tile.
__device__ __forceinline__ int kv_chunk(int t, int c) { return c ^ (t & 7); }

// Element (page, head, token t of the page, d) of a layer's cache of `parts` tiles a (page,
// head): V's (parts 1) or the hi part of K's (parts kKParts; its lo part is kKvTileH further).
template <int parts>
__device__ __forceinline__ size_t kv_offset(int page, int head, int t, int d) {
  return ((((size_t)page * kKVHeads + head) * parts) * kPageTokens + t) * kHeadDim +
         kv_chunk(t, d >> 3) * 8 + (d & 7);
}
__device__ __forceinline__ size_t k_offset(int page, int head, int t, int d) {
  return kv_offset<kKParts>(page, head, t, d);
}
__device__ __forceinline__ size_t v_offset(int page, int head, int t, int d) {
  return kv_offset<1>(page, head, t, d);
}

// Key value k into the K cache at k_offset `at`: its hi part, and with kKParts = 2 the rest.
__device__ __forceinline__ void store_k(half* kc, size_t at, float k) {
  const half hi = __float2half_rn(k);
  kc[at] = hi;
  if constexpr (kKParts == 2) kc[at + kKvTileH] = __float2half_rn(k - __half2float(hi));
}
