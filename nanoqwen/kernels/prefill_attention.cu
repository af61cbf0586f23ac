// prefill_attention.cu — causal grouped-query attention of a prompt's new tokens over the
// sequence's paged K/V (flash-attention style, Hopper wgmma).
//
//   out[i, h, :] = sum_{j <= start + i} softmax_j(q[i, h, :] . k[j, h / G, :] / sqrt(D))
//                  v[j, h / G, :]
//   with G = HQ / HKV query heads per KV head: query row i is position start + i; keys 0 ..
//   start - 1 are a cached prefix (written by an earlier request), the rest the new tokens'
//   own (rope_kv_write puts them into the pages before this launch).
//
// One CTA = one warpgroup per (64-query tile, query head). Per 64-key tile: S = Q K^T as
// wgmma m64n64k16 with both operands in shared memory (Q and K tiles are K-major: the head dim
// runs along their rows), an fp32 online softmax in the exp2 domain on the accumulators (the
// 1/sqrt(D) scale folded into the exponent, the causal mask on the tiles that reach past the
// tile's first query position: one, or two when start is not a multiple of 64), then
// O += P V as wgmma m64nDk16 with P straight from the accumulator registers (wgmma's D layout
// per 8 columns is mma.m16n8k16's, so S's n8 tiles 2kk, 2kk+1 are the A fragment of k-step kk)
// and V N-major from shared memory (keys along its rows: the transposed-B form, no transpose in
// memory). Row sums are reduced across the quad once, at the end. K/V tiles are double-buffered
// through cp.async, one tile ahead; tile kb + 1's copies are issued after S(kb)'s wgmmas, so
// that issuing them (their address arithmetic, 2 x 8 copies a thread at D = 128) overlaps the
// tensor cores instead of delaying S behind the barrier. Query tiles are issued latest first
// (they have the most keys), every head of a tile before the next tile (the grid's x is the
// head), so the long CTAs start early, the short ones fill the tail, and in a single wave
// (T = 512: 224 CTAs, two an SM) the second CTA an SM gets is a shorter one than the first. S
// of the next tile and O += P V of this one are not issued together: ptxas hoists the wait for
// P V above the softmax, so the overlap would not happen (alternatives measured:
// docs/EXPERIMENTS.md).
//
// Shared memory: every tile is 64 rows x D halves, stored as D / 64 blocks of 64 rows x 128
// bytes in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7); blocks 8 KB
// apart, 1024-byte aligned), the layout wgmma's descriptors name: K-major operands step 32 bytes
// per k16 inside a block and a block per 64 of K; V's descriptor (N-major) has the leading
// byte offset 8 KB (the next 64 head dims) and the stride byte offset 1024 (the next 8 keys);
// the reverse reads garbage.
//
// Splits along the keys (grid z = Z > 1): a few new tokens after a long cached prefix make few
// CTAs (T = 64 after 8k: 28 on the 7B, one per head) each with a long key loop, so the host
// cuts every (head, query tile)'s key tiles into Z even ranges, one a CTA. Such a CTA writes
// its unnormalized partial O, running max m (raw-score units) and row sum l to part_o / part_ml
// and prefill_attention_merge combines the Z partials of each (row, head):
// out = sum_z 2^((m_z - M) c) O_z / sum_z 2^((m_z - M) c) l_z with M = max_z m_z and c the
// log2-domain scale. A range can hold no key at or before some of its rows' positions (those
// rows keep m = -inf, l = 0, O = 0: the softmax update below guards its exponents); the range
// holding key tile 0 has key 0 for every row, so M is finite.
//
// K/V tiles come straight from the paged cache (kv_cache.cuh): a 64-key tile is four pages'
// 16-row tiles of the kv head, each row 16-byte chunks in the cache's XOR order, which is the
// order the shared tile wants (chunk c of row r lands at (c % 8) ^ (r & 7) of block c / 8, and
// the cache stores it at c ^ (r & 7): the same low bits, r & 7 being the row's slot & 7). The
// four page ids of a tile are loaded from the page table one tile before its copies
// (KvTileCopy): a copy whose address waited on its page id would put a global load's latency
// between the barrier and S every tile.
//
// Timed at T = 512, 2048 and 8192 on the 7B shapes by dev/prefill_check.py (--parts timing);
// dev/attn_ab.py times it against this file at another git revision, in one process.
//
// Arguments (device pointers, 16-byte aligned, fp16 bits):
//   q      fp16 [T, HQ, D]  the new tokens' queries (RoPE applied), row-major
//   kc, vc fp16             this layer's K and V caches (kv_cache.cuh), positions
//                           0 .. start + T - 1 written
//   pages  int32            the sequence's page table (logical page -> physical page)
//   out    fp16 [T, HQ, D]  may not alias q (written when Z = 1)
//   part_o  fp32 [Z, HQ, R, D], part_ml fp32 [Z, HQ, R, 2] with R = 64 ceil(T / 64): the
//           partials when Z > 1 (unused, may be null, when Z = 1)
//   start >= 0 cached positions before the new tokens; T >= 1 new tokens.
// Grid (HQ, ceil(T / 64), Z), 128 threads, dynamic shared memory Layout<D>::kSmemBytes.

#include "common.cuh"
#include "kv_cache.cuh"
#include "wgmma.cuh"

namespace nanoqwen_prefill_attention {

constexpr int kTileQ = kPrefillAttnTile;  // query rows per CTA: the warpgroup's m64
constexpr int kTileK = kPrefillAttnTile;  // keys per K/V tile
constexpr int kThreads = kPrefillAttnThreads;  // one warpgroup
static_assert(kTileQ == 64 && kThreads == 128, "one warpgroup of m64 query rows");
constexpr int kBlockBytes = 64 * 128;  // 64 rows x 128 bytes, 128-byte swizzled (8 KB)
constexpr int kSmemPerSm = 228 * 1024;  // sm_90: an SM's shared memory at the largest carveout
constexpr int kSmemCtaReserve = 1024;   // sm_90: what the system takes of it per resident CTA

template <int D>
struct Layout {
  static_assert(D == 64 || D == 128, "head_dim must be 64 or 128");
  static constexpr int kBlocks = D / 64;                 // 128-byte column blocks of a row
  static constexpr int kTileBytes = kBlocks * kBlockBytes;  // one Q or V tile, or a K part
  static constexpr int kKTileBytes = kKParts * kTileBytes;  // a K tile: its parts, in turn
  // alignment + Q + 2 x K + 2 x V (host side: nanoqwen/cuda/registry.py
  // prefill_attention_smem_bytes)
  static constexpr int kSmemBytes = 1024 + 3 * kTileBytes + 2 * kKTileBytes;
  // CTAs an SM holds by shared memory (2 at D = 128, 3 at D = 64 with the (hi, lo) K cache).
  // The kernel's __launch_bounds__ asks ptxas for registers that allow as many: at D = 64 it
  // would otherwise take 104 a thread, room for 4.
  static constexpr int kCtasPerSm = kSmemPerSm / (kSmemBytes + kSmemCtaReserve);
};

// Shared-memory byte offset of 16-byte chunk c of tile row r: block c / 8, row r, chunk
// (c % 8) ^ (r & 7) (the 128-byte swizzle).
__device__ __forceinline__ int tile_chunk(int r, int c) {
  return (c / 8) * kBlockBytes + r * 128 + (((c % 8) ^ (r & 7)) << 4);
}

// Query rows tok0..tok0+63 of one head (row stride `stride` halves) into a swizzled tile.
// Rows >= T read as zeros.
template <int D>
__device__ __forceinline__ void load_q_tile(unsigned char* dst, const unsigned short* src,
                                            int tok0, int T, int stride) {
  constexpr int kChunks = D / 8;
  static_assert(kTileQ * kChunks % kThreads == 0, "tile copy must split evenly");
#pragma unroll
  for (int i = 0; i < kTileQ * kChunks / kThreads; ++i) {
    const int u = threadIdx.x + i * kThreads, row = u / kChunks, c = u % kChunks;
    const int tok = tok0 + row;
    const unsigned short* s = src + (long)(tok < T ? tok : 0) * stride + c * 8;
    cp_async16(dst + tile_chunk(row, c), s, tok < T ? 16 : 0);
  }
}

// One thread's share of the K and V tile copies from a layer's paged cache (kv_cache.cuh). A
// tile of kTileK keys is kPagesPerTile pages of the kv head; thread tid copies 16-byte chunk
// c = tid % kChunks of tile rows r0 + i kRowStep (r0 = tid / kChunks, i < kCopies), of K and
// of V (of each K part: the lo part kKvTileH halves after the hi part in the cache, a tile
// after it in shared memory). All but the page ids is fixed for the CTA and computed once:
// k_offset and v_offset are the page times a page's elements plus an in-page offset, and a
// row's slot in its page repeats every kRowsPerPage copies, so a source pointer per such slot
// (K and V, page 0) makes a copy's address one multiply-add; copy i lands i kRowStep rows
// below copy 0 in the shared tile (kRowStep being a multiple of 8, every row of the thread has
// the same row & 7, hence the same swizzled chunk). The page ids come from fetch_pages a tile
// ahead, into registers, so the copies wait on no global load.
template <int D>
struct KvTileCopy {
  static constexpr int kChunks = D / 8;                        // 16-byte chunks of a row
  static constexpr int kRowStep = kThreads / kChunks;          // rows between a thread's copies
  static constexpr int kCopies = kTileK / kRowStep;            // a thread's copies of a tile
  static constexpr int kRowsPerPage = kPageTokens / kRowStep;  // ... of one page
  static constexpr int kPagesPerTile = kTileK / kPageTokens;
  static_assert(kThreads % kChunks == 0, "a thread copies one chunk column");
  static_assert(kTileK % kPageTokens == 0, "a tile is whole pages");
  static_assert(kPageTokens % kRowStep == 0, "a thread's copies take the same slots of each page");
  static_assert(kRowStep % 8 == 0, "a thread's rows share row & 7 (the swizzle's row bits)");

  const unsigned short* k_src[kRowsPerPage];  // kc + k_offset(0, head, r0 + j kRowStep, 8 c)
  const unsigned short* v_src[kRowsPerPage];  // the same in vc
  int r0;                                     // the thread's first tile row
  int dst0;                                   // its shared-memory offset in a tile

  __device__ __forceinline__ KvTileCopy(const unsigned short* kc, const unsigned short* vc,
                                        int head) {
    r0 = threadIdx.x / kChunks;
    const int c = threadIdx.x % kChunks;
    dst0 = tile_chunk(r0, c);
#pragma unroll
    for (int j = 0; j < kRowsPerPage; ++j) {
      k_src[j] = kc + k_offset(0, head, r0 + j * kRowStep, c * 8);
      v_src[j] = vc + v_offset(0, head, r0 + j * kRowStep, c * 8);
      // Opaque to the optimizer, which would otherwise fold the offsets into every copy's address
      // (a 64-bit element offset, a shift and two adds per K/V pair, SASS): with it, an
      // IMAD.WIDE.U32 a copy.
      asm("" : "+l"(k_src[j]), "+l"(v_src[j]));
    }
  }

  // pg[j] = the physical page of logical page key0 / kPageTokens + j; 0 past the last key
  // (key0 is a multiple of kTileK; entries past n_keys' page are never read).
  __device__ __forceinline__ static void fetch_pages(int (&pg)[kPagesPerTile],
                                                     const int* __restrict__ pages, int key0,
                                                     int n_keys) {
#pragma unroll
    for (int j = 0; j < kPagesPerTile; ++j)
      pg[j] = key0 + j * kPageTokens < n_keys ? pages[key0 / kPageTokens + j] : 0;
  }

  // Keys key0..key0 + kTileK - 1 of K and V (pages pg) into the swizzled tiles at k_dst (its
  // kKParts parts, kTileBytes apart) and v_dst. Keys >= n_keys read as zeros.
  __device__ __forceinline__ void issue(unsigned char* k_dst, unsigned char* v_dst,
                                        const int (&pg)[kPagesPerTile], int key0,
                                        int n_keys) const {
    const int live_rows = n_keys - key0;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const size_t page = static_cast<unsigned>(pg[i / kRowsPerPage]);
      const int at = dst0 + i * kRowStep * 128, bytes = r0 + i * kRowStep < live_rows ? 16 : 0;
      const unsigned short* k = k_src[i % kRowsPerPage] + page * k_offset(1, 0, 0, 0);
#pragma unroll
      for (int part = 0; part < kKParts; ++part)
        cp_async16(k_dst + part * Layout<D>::kTileBytes + at, k + part * kKvTileH, bytes);
      cp_async16(v_dst + at, v_src[i % kRowsPerPage] + page * v_offset(1, 0, 0, 0), bytes);
    }
  }
};

}  // namespace nanoqwen_prefill_attention

template <int D, int HQ, int HKV>
__global__ void __launch_bounds__(nanoqwen_prefill_attention::kThreads,
                                  nanoqwen_prefill_attention::Layout<D>::kCtasPerSm)
    prefill_attention(const unsigned short* __restrict__ q, const unsigned short* __restrict__ kc,
                      const unsigned short* __restrict__ vc, const int* __restrict__ pages,
                      unsigned short* __restrict__ out, float* __restrict__ part_o,
                      float* __restrict__ part_ml, int start, int T) {
  using namespace nanoqwen_prefill_attention;
  using L = Layout<D>;
  static_assert(HQ % HKV == 0, "query heads must be a multiple of KV heads (GQA)");
  static_assert(D == kHeadDim && HKV == kKVHeads, "the cache layout is the model's");
  constexpr int kGroup = HQ / HKV;
  constexpr int kDSteps = D / 16;   // k16 steps of S = Q K^T
  constexpr int kKSteps = kTileK / 16;  // k16 steps of O += P V

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = smem_addr(smem_raw);
  unsigned char* q_s = smem_raw + ((raw + 1023) & ~1023u) - raw;
  unsigned char* k_s = q_s + L::kTileBytes;       // [2] K tiles (kKParts parts each)
  unsigned char* v_s = k_s + 2 * L::kKTileBytes;  // [2] tiles
  const unsigned q_a = smem_addr(q_s), k_a = smem_addr(k_s), v_a = smem_addr(v_s);

  pdl_trigger();
  pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int q_tile = gridDim.y - 1 - blockIdx.y;  // latest (longest) tiles first
  const int head = blockIdx.x, kv_head = head / kGroup;
  const int q0 = q_tile * kTileQ;
  const int n_keys = start + T;
  constexpr int kQStride = HQ * D;

  // Causal: key tiles up to the one holding the tile's last live position; masking from the
  // first tile that reaches past the tile's first position. This CTA's split: [kb0, kb1).
  const int n_kv = (start + min(q0 + kTileQ, T) - 1) / kTileK + 1;
  const int first_masked = (start + q0) / kTileK;
  const int kb0 = blockIdx.z * n_kv / gridDim.z, kb1 = (blockIdx.z + 1) * n_kv / gridDim.z;

  using Copy = KvTileCopy<D>;
  const Copy kv_copy(kc, vc, kv_head);
  int pg[Copy::kPagesPerTile];  // the page ids of the next K/V tile to copy
  load_q_tile<D>(q_s, q + head * D, q0, T, kQStride);
  if (kb0 < kb1) {
    Copy::fetch_pages(pg, pages, kb0 * kTileK, n_keys);
    kv_copy.issue(k_s, v_s, pg, kb0 * kTileK, n_keys);
  }
  cp_async_commit();
  Copy::fetch_pages(pg, pages, (kb0 + 1) * kTileK, n_keys);

  // This thread's two query rows (local to the new tokens) and their positions.
  const int row_a = q0 + warp * 16 + (lane >> 2), row_b = row_a + 8;
  const int pos_a = start + row_a, pos_b = start + row_b;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_a = neg_inf(), m_b = neg_inf(), l_a = 0.f, l_b = 0.f;

  for (int kb = kb0; kb < kb1; ++kb) {
    const int buf = (kb - kb0) & 1;
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();  // tile kb landed and visible to wgmma; buffer buf ^ 1 no longer read

    // S = Q K^T: A = the Q tile, B = the K tile's parts in turn (hi, lo: one sum), both
    // K-major (head dim along the rows). Issued before the next tile's copies, so the tensor
    // cores run while the copies are issued.
    float s[kTileK / 2];
    const unsigned kt_a = k_a + buf * L::kKTileBytes;
    wgmma_fence();
#pragma unroll
    for (int part = 0; part < kKParts; ++part) {
#pragma unroll
      for (int st = 0; st < kDSteps; ++st) {
        const unsigned off = (st / 4) * kBlockBytes + (st % 4) * 32;
        WgmmaSS<kTileK>::mma(s, make_desc_sw128(q_a + off),
                             make_desc_sw128(kt_a + part * L::kTileBytes + off), part + st > 0);
      }
    }
    wgmma_commit();
    if (kb + 1 < kb1) {  // tile kb + 1 into buffer buf ^ 1; tile kb + 2's page ids
      const int key0 = (kb + 1) * kTileK;
      kv_copy.issue(k_s + (buf ^ 1) * L::kKTileBytes, v_s + (buf ^ 1) * L::kTileBytes, pg, key0,
                    n_keys);
      Copy::fetch_pages(pg, pages, key0 + kTileK, n_keys);
    }
    cp_async_commit();
    wgmma_wait<0>();
    fence_acc(s);

    // Online softmax in the log2 domain, on the raw scores (the scale folded into the
    // exponent); keys after the query's position are masked (only tiles >= first_masked hold
    // any; keys >= n_keys are past every live row's position, so the mask covers them too).
    if (kb >= first_masked) {
#pragma unroll
      for (int j = 0; j < kTileK / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = kb * kTileK + j * 8 + 2 * t + e;
          if (key > pos_a) s[4 * j + e] = neg_inf();
          if (key > pos_b) s[4 * j + 2 + e] = neg_inf();
        }
      }
    }
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      mx_a = fmaxf(mx_a, fmaxf(s[4 * j], s[4 * j + 1]));
      mx_b = fmaxf(mx_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {  // the 4 lanes of a quad share a row
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
    // A row whose keys so far are all masked (only in a split that starts past its position)
    // keeps m = -inf: its exponents take 0 for the max, so they give 0, not NaN.
    const float safe_a = mx_a == neg_inf() ? 0.f : mx_a, safe_b = mx_b == neg_inf() ? 0.f : mx_b;
    const float alpha_a = fast_exp2((m_a - safe_a) * scale_log2);
    const float alpha_b = fast_exp2((m_b - safe_b) * scale_log2);
    m_a = mx_a;
    m_b = mx_b;
    const float base_a = -safe_a * scale_log2, base_b = -safe_b * scale_log2;
    l_a *= alpha_a;
    l_b *= alpha_b;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[4 * n] *= alpha_a;
      o[4 * n + 1] *= alpha_a;
      o[4 * n + 2] *= alpha_b;
      o[4 * n + 3] *= alpha_b;
    }
    unsigned p[kKSteps][4];
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      const float p0 = fast_exp2(fmaf(s[4 * j], scale_log2, base_a));
      const float p1 = fast_exp2(fmaf(s[4 * j + 1], scale_log2, base_a));
      const float p2 = fast_exp2(fmaf(s[4 * j + 2], scale_log2, base_b));
      const float p3 = fast_exp2(fmaf(s[4 * j + 3], scale_log2, base_b));
      l_a += p0 + p1;
      l_b += p2 + p3;
      p[j / 2][2 * (j % 2)] = pack_half2(p0, p1);      // row g, keys 8j + 2t..
      p[j / 2][2 * (j % 2) + 1] = pack_half2(p2, p3);  // row g + 8
    }

    // O += P V: A = P from registers, B = the V tile N-major (keys along the rows).
    const unsigned vt_a = v_a + buf * L::kTileBytes;
    fence_acc(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      WgmmaRS<D, 1>::mma(o, p[kk], make_desc_sw128(vt_a + kk * 16 * 128, kBlockBytes, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(o);
  }

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  if (gridDim.z > 1) {  // this split's partial: O unnormalized, (m, l) once a row (lane t 0)
    const long rows = (long)gridDim.y * kTileQ;
    const long base = ((long)blockIdx.z * HQ + head) * rows;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * t;
      if (row_a < T)
        *reinterpret_cast<float2*>(part_o + (base + row_a) * D + col) =
            make_float2(o[4 * n], o[4 * n + 1]);
      if (row_b < T)
        *reinterpret_cast<float2*>(part_o + (base + row_b) * D + col) =
            make_float2(o[4 * n + 2], o[4 * n + 3]);
    }
    if (t == 0 && row_a < T)
      *reinterpret_cast<float2*>(part_ml + (base + row_a) * 2) = make_float2(m_a, l_a);
    if (t == 0 && row_b < T)
      *reinterpret_cast<float2*>(part_ml + (base + row_b) * 2) = make_float2(m_b, l_b);
    return;
  }
  const float inv_a = 1.f / l_a, inv_b = 1.f / l_b;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = head * D + n * 8 + 2 * t;
    if (row_a < T)
      *reinterpret_cast<unsigned*>(out + (long)row_a * kQStride + col) =
          pack_half2(o[4 * n] * inv_a, o[4 * n + 1] * inv_a);
    if (row_b < T)
      *reinterpret_cast<unsigned*>(out + (long)row_b * kQStride + col) =
          pack_half2(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b);
  }
}

// The Z split partials of prefill_attention -> out fp16 [T, HQ, D] (formula above). One warp a
// (row, head): lane j takes columns 2j, 2j + 1, 2j + 64, ... Grid ceil(T HQ / warps), block
// kPrefillMergeThreads.
template <int D, int HQ>
__global__ void __launch_bounds__(kPrefillMergeThreads)
    prefill_attention_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                            unsigned short* __restrict__ out, int T, int Z) {
  using namespace nanoqwen_prefill_attention;
  static_assert(D % 64 == 0, "a lane takes whole float2 pairs");
  pdl_wait();
  pdl_trigger();
  constexpr int warps = kPrefillMergeThreads / 32;
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * warps + (threadIdx.x >> 5);
  if (item >= T * HQ) return;
  const int row = item / HQ, head = item % HQ;
  const long rows = (long)((T + kTileQ - 1) / kTileQ) * kTileQ;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  float mx = neg_inf();
  for (int z = 0; z < Z; ++z) mx = fmaxf(mx, part_ml[((z * HQ + head) * rows + row) * 2]);
  float acc[D / 32], l = 0.f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = 0.f;
  for (int z = 0; z < Z; ++z) {
    const long at = (z * HQ + head) * rows + row;
    const float2 ml = *reinterpret_cast<const float2*>(part_ml + at * 2);
    const float w = ml.x == neg_inf() ? 0.f : fast_exp2((ml.x - mx) * scale_log2);
    l += w * ml.y;
#pragma unroll
    for (int i = 0; i < D / 64; ++i) {
      const float2 v = *reinterpret_cast<const float2*>(part_o + at * D + 64 * i + 2 * lane);
      acc[2 * i] += w * v.x;
      acc[2 * i + 1] += w * v.y;
    }
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < D / 64; ++i)
    *reinterpret_cast<unsigned*>(out + ((long)row * HQ + head) * D + 64 * i + 2 * lane) =
        pack_half2(acc[2 * i] * inv, acc[2 * i + 1] * inv);
}

