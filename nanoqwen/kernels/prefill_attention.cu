// prefill_attention.cu — causal grouped-query attention over a prompt (flash-attention-2 style).
//
//   out[i, h, :] = sum_{j <= i} softmax_j(q[i, h, :] . k[j, h / G, :] / sqrt(D)) v[j, h / G, :]
//   with G = HQ / HKV query heads per KV head.
//
// Why this shape. Prefill attention is a small share of the prompt's work (about 2 GFLOP per
// layer at T = 512 against ~240 GFLOP of GEMMs), so this kernel aims to be correct and plainly
// tensor-core bound rather than clever: one CTA per (64-query tile, query head), 4 warps of 16
// query rows each, K/V tiles of 64 keys double-buffered through cp.async, S = Q K^T and
// O += P V on mma.sync m16n8k16 (fp16 in, fp32 accumulate), an fp32 online softmax in the
// exp2 domain, and the row sums reduced across the quad only once at the end. The causal mask
// touches only the diagonal tile. Query tiles are issued latest first, since they have the most
// keys, so the long CTAs start early and the short ones fill the tail. Tried, not kept: two
// sets of 4 warps, each taking half of every tile's keys and merged through shared memory at
// the end (halving the longest CTA's chain of tiles; Q fragments re-read per k-step pair to
// stay at the 128 registers of two CTAs an SM): 0.0367 ms a launch at T = 512 against 0.0281
// (7B, H200, tools/prefill_check.py, same run), and no better a TTFT.
//
// Shared-memory rows are padded by 16 bytes (D + 8 halves): the 8 row addresses of one
// ldmatrix then fall 4 banks apart and cover all 32 banks without a swizzle.
//
// Arguments (device pointers, 16-byte aligned, row-major, fp16 bits):
//   q    fp16 [T, HQ, D]    query (RoPE already applied), row stride HQ * D
//   k    fp16 [T, HKV, D]   key   (RoPE already applied), row stride HKV * D
//   v    fp16 [T, HKV, D]   value
//   out  fp16 [T, HQ, D]    may not alias q, k or v
//   T >= 1 tokens, positions 0..T-1 (the whole prompt; no earlier context).
// Grid (ceil(T / 64), HQ), 128 threads, dynamic shared memory kSmemBytes<D>.

#ifndef NANOQWEN_PREFILL_ATTENTION_CU
#define NANOQWEN_PREFILL_ATTENTION_CU
#include "common.cuh"

namespace nanoqwen_prefill_attention {

constexpr int kTileQ = 64;   // query rows per CTA (4 warps x 16)
constexpr int kTileK = 64;   // keys per K/V tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;      // halves of padding per shared row (16 bytes; see above)
static_assert(kTileQ == kWarps * 16, "each warp owns one m16 slice of the query tile");

template <int D>
struct Layout {
  static_assert(D % 32 == 0 && D <= 256, "head_dim must be a multiple of 32 (<= 256)");
  static constexpr int kRow = D + kPad;               // halves per shared row
  static constexpr int kTileHalves = kTileK * kRow;   // one Q, K or V tile
  static constexpr int kSmemBytes = 5 * kTileHalves * 2;  // Q + 2 x K + 2 x V
  static constexpr int kUnitsPerRow = D / 8;          // 16-byte units per row
};



// Copy 64 token rows of one head (row stride `stride` halves) into a padded shared tile;
// tokens >= T are zero-filled (masked later, never stored).
template <int D>
__device__ __forceinline__ void load_rows(unsigned short* dst, const unsigned short* src,
                                          int tok0, int T, int stride) {
  using L = Layout<D>;
  static_assert(kTileK * L::kUnitsPerRow % kThreads == 0, "tile copy must split evenly");
#pragma unroll
  for (int i = 0; i < kTileK * L::kUnitsPerRow / kThreads; ++i) {
    const int q = threadIdx.x + i * kThreads, row = q / L::kUnitsPerRow;
    const int unit = q % L::kUnitsPerRow, tok = tok0 + row;
    const unsigned short* s = src + (long)(tok < T ? tok : 0) * stride + unit * 8;
    cp_async16(dst + row * L::kRow + unit * 8, s, tok < T ? 16 : 0);
  }
}

}  // namespace nanoqwen_prefill_attention

template <int D, int HQ, int HKV>
__global__ void __launch_bounds__(nanoqwen_prefill_attention::kThreads)
    prefill_attention(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                      const unsigned short* __restrict__ v, unsigned short* __restrict__ out,
                      int T) {
  using namespace nanoqwen_prefill_attention;
  using L = Layout<D>;
  static_assert(HQ % HKV == 0, "query heads must be a multiple of KV heads (GQA)");
  constexpr int kGroup = HQ / HKV;
  constexpr int kDSteps = D / 16;   // mma k-steps over the head dim (S = Q K^T)
  constexpr int kDTiles = D / 8;    // n8 tiles over the head dim (O)
  constexpr int kKeyTiles = kTileK / 8;  // n8 tiles over the keys (S)

  extern __shared__ __align__(128) unsigned short smem_h[];
  unsigned short* q_s = smem_h;
  unsigned short* k_s = q_s + L::kTileHalves;  // [2][64][kRow]
  unsigned short* v_s = k_s + 2 * L::kTileHalves;

  pdl_trigger();
  pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q_tile = gridDim.x - 1 - blockIdx.x;  // latest (longest) tiles first
  const int head = blockIdx.y, kv_head = head / kGroup;
  const int q0 = q_tile * kTileQ;
  const unsigned short* k_head = k + kv_head * D;
  const unsigned short* v_head = v + kv_head * D;
  constexpr int kQStride = HQ * D, kKVStride = HKV * D;

  load_rows<D>(q_s, q + head * D, q0, T, kQStride);
  load_rows<D>(k_s, k_head, 0, T, kKVStride);
  load_rows<D>(v_s, v_head, 0, T, kKVStride);
  cp_async_commit();

  // Row ids of this thread's two rows (c0,c1 -> row g; c2,c3 -> row g + 8 of the warp slice).
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(D));

  unsigned qf[kDSteps][4];
  float o[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_a = neg_inf(), m_b = neg_inf(), l_a = 0.f, l_b = 0.f;

  const int n_kv = q_tile + 1;  // causal: key tiles 0..q_tile
  for (int kb = 0; kb < n_kv; ++kb) {
    const int buf = kb & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile kb landed; buffer buf ^ 1 no longer read
    if (kb + 1 < n_kv) {
      load_rows<D>(k_s + (buf ^ 1) * L::kTileHalves, k_head, (kb + 1) * kTileK, T, kKVStride);
      load_rows<D>(v_s + (buf ^ 1) * L::kTileHalves, v_head, (kb + 1) * kTileK, T, kKVStride);
    }
    cp_async_commit();
    if (kb == 0) {  // Q fragments (A operand) once: rows (mi & 1) * 8 + r, cols (mi >> 1) * 8
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int s = 0; s < kDSteps; ++s)
        ldmatrix_x4(qf[s], q_s + (warp * 16 + (mi & 1) * 8 + r) * L::kRow + s * 16 + (mi >> 1) * 8);
    }
    const unsigned short* kt_s = k_s + buf * L::kTileHalves;
    const unsigned short* vt_s = v_s + buf * L::kTileHalves;

    // S = Q K^T: K rows are keys, so a non-transposed ldmatrix yields B fragments
    // (k = head dim, n = key); matrices 0..3 = dims +0, +8, +16, +24 of 8 keys.
    float s[kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int p = 0; p < kDSteps / 2; ++p) {
        unsigned b[4];
        ldmatrix_x4(b, kt_s + (j * 8 + (lane & 7)) * L::kRow + p * 32 + (lane >> 3) * 8);
        mma_16816(s[j], qf[2 * p], b[0], b[1]);
        mma_16816(s[j], qf[2 * p + 1], b[2], b[3]);
      }
    }

    // Online softmax in the log2 domain; mask keys after the query on the diagonal tile.
    const bool diagonal = kb == q_tile;
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = kb * kTileK + j * 8 + 2 * t + e;
        s[j][e] = (diagonal && key > row_a) ? neg_inf() : s[j][e] * scale_log2;
        s[j][2 + e] = (diagonal && key > row_b) ? neg_inf() : s[j][2 + e] * scale_log2;
        mx_a = fmaxf(mx_a, s[j][e]);
        mx_b = fmaxf(mx_b, s[j][2 + e]);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {  // the 4 lanes of a quad share a row
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
    // Every row has key 0 <= its own position unmasked, so mx_* is finite from tile 0 on.
    const float alpha_a = exp2f(m_a - mx_a), alpha_b = exp2f(m_b - mx_b);
    m_a = mx_a;
    m_b = mx_b;
    l_a *= alpha_a;
    l_b *= alpha_b;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      o[n][0] *= alpha_a;
      o[n][1] *= alpha_a;
      o[n][2] *= alpha_b;
      o[n][3] *= alpha_b;
    }
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      s[j][0] = exp2f(s[j][0] - m_a);
      s[j][1] = exp2f(s[j][1] - m_a);
      s[j][2] = exp2f(s[j][2] - m_b);
      s[j][3] = exp2f(s[j][3] - m_b);
      l_a += s[j][0] + s[j][1];
      l_b += s[j][2] + s[j][3];
    }

    // O += P V: the S accumulators of n8 tiles 2kk, 2kk+1 are exactly the A fragment of
    // k-step kk; V rows are keys, so a transposed ldmatrix yields B (k = key, n = dim).
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      const unsigned a[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]),
                             pack_half2(s[2 * kk][2], s[2 * kk][3]),
                             pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const int mi = lane >> 3, r = lane & 7;
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        unsigned b[4];
        const int key = kk * 16 + (mi & 1) * 8 + r;
        ldmatrix_x4_trans(b, vt_s + key * L::kRow + dp * 16 + (mi >> 1) * 8);
        mma_16816(o[2 * dp], a, b[0], b[1]);
        mma_16816(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = 1.f / l_a, inv_b = 1.f / l_b;
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) {
    const int col = head * D + n * 8 + 2 * t;
    if (row_a < T)
      *reinterpret_cast<unsigned*>(out + (long)row_a * kQStride + col) =
          pack_half2(o[n][0] * inv_a, o[n][1] * inv_a);
    if (row_b < T)
      *reinterpret_cast<unsigned*>(out + (long)row_b * kQStride + col) =
          pack_half2(o[n][2] * inv_b, o[n][3] * inv_b);
  }
}

#endif  // NANOQWEN_PREFILL_ATTENTION_CU
