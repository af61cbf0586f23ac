// kv_cache.cuh: the layout of the paged K/V cache, shared by its writers (the q/k/v GEMV's
// epilogue, rope_kv_write) and its reader (attn_decode). Needs the model header.
//
// One cache per layer for K and one for V, fp16 [num_pages][kKVHeads][kPageTokens][kHeadDim]:
// the 16 token rows of one (page, kv head) form one contiguous tile, so decode attention moves
// a page of a head with one bulk copy (the copy engine pays per copy: a copy per 256-byte row
// would bound attention at long context).
// Inside a tile the 16-byte chunks of token row t are XOR-swizzled: chunk c is stored at
// c ^ (t % 8). The tile lands in shared memory as it is, and the 8 row addresses of one
// ldmatrix (8 consecutive tokens, one chunk) then fall on 8 different bank groups.
#pragma once

static_assert(kHeadDim % 64 == 0, "the swizzle permutes groups of 8 chunks of 16 bytes");

// Stored chunk of chunk c (8 halves) of token row t of a tile.
__device__ __forceinline__ int kv_chunk(int t, int c) { return c ^ (t & 7); }

// Element (page, head, token t of the page, d) of a layer's K or V cache.
__device__ __forceinline__ size_t kv_offset(int page, int head, int t, int d) {
  return (((size_t)page * kKVHeads + head) * kPageTokens + t) * kHeadDim +
         kv_chunk(t, d >> 3) * 8 + (d & 7);
}
