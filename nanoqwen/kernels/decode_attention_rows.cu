// decode_attention_rows.cu: paged GQA attention of M = 1..kVerifyRows consecutive query rows of
// one sequence (the speculative decode step: the current token and its drafts, positions
// start .. start + M - 1) with the causal mask inside the block: row t attends to keys
// 0 .. start + t. The batch-1 decode step keeps attn_decode (decode_attention.cu); this is its
// multi-row sibling, built the same way: one producer warp streams K/V pages into shared
// memory with Hopper's bulk async copy, consumer warps run QK^T and PV on mma.sync with an fp32
// online softmax, and the split-combine is folded in (a cluster merge through distributed
// shared memory, then a last-CTA semaphore).
//
// GQA packing. The M x kGroupRatio query rows of one kv head are packed as (token, head of the
// group): row i = t * G + g is query head kvh * G + g of token t. They all read the same keys,
// so one CTA streams each of its pages once for all of them: the kv head's K/V bytes are read
// once per launch whatever M is (prefill_attention, one query head a CTA, reads them G times).
// The rows form R = ceil(M G / 16) m16 tiles (7B, M = 8: 56 rows, 4 tiles; M = 16: 7 tiles;
// at most kVerifyRows x 8 rows). mma.sync, not wgmma: a tile of 16 keys (one page) per step
// keeps a consumer warp on whole ring stages with no cross-warp synchronization inside the
// loop, and at the row counts here (<= 128) a warpgroup's m64 would mostly compute padding.
//
// Row-tile groups. Where the context needs fewer clusters than the grid has (short contexts),
// the spare clusters take row tiles: the kv head's R tiles are dealt over T tile groups, group
// z taking tiles z, z + T, ... (Rz of them) over the same pages, so that a CTA's warps take
// fewer tiles in turn (7B, M = 8, context 512: 64 CTAs of 2 tiles instead of 32 of 4). A page
// is then read by T CTAs at once, from L2 after the first. T = min(R, (clusters the grid has /
// clusters needed) / 2): the whole grid's clusters at once (16 clusters of 8 one-SM CTAs on
// the 7B) cost more than they save at short contexts, where each CTA's work is short beside
// its launch (docs/EXPERIMENTS.md, Speculative decoding).
//
// Warps. kMattnConsumers consumer warps (a power of two) and a producer. Consumer warp
// w < Rz J owns the group's row tile w % Rz and page group w / Rz, J = the largest power of
// two with Rz J <= kMattnConsumers: group j takes the CTA's pages j, j + J, ... So with one
// tile (Rz = 1: J = 8) eight warps split the pages, as the decode kernel's four do, and at
// M = 16 on long contexts (Rz = R = 7, J = 1) seven warps split the rows of every page. A
// page's stage is released by the Rz warps of its group (the empty barriers count Rz
// arrivals). kMattnStages % kMattnConsumers == 0, so every ring slot belongs to one group,
// and a group's full-barrier wait for round r finds the barrier in phase r (it consumed round
// r - 1 itself): the parity test cannot alias an older phase.
//
// Per page and warp (16 keys x 16 rows): S = Q K^T, Q the A operand (its fragments live in
// registers for the whole launch), K rows the B operand (ldmatrix), 2 key tiles x kHeadDim / 16
// k-steps a part of the K cache (kv_cache.cuh: hi and lo into the same accumulators); the
// scale log2(e) / sqrt(D) on the fp32 scores; base-2 online softmax per row; then O += P V
// with the score accumulators as the A fragment and V through a transposed ldmatrix.
// Only the pages holding a key past `start` need the causal mask, per row: key > start + t is
// -inf. A row can see no valid key in a page group or a split (its keys there all lie past its
// position): its running max stays -inf, the exponents take 0 for the max, and the merges weigh
// its (m = -1e30 floor, l = 0) partial 0.
//
// Splits, as attn_decode: grid (kKVHeads, S) in clusters of (1, C, 1); P = ceil((start + M) /
// 16) pages are cut into ncl = min(S / C, ceil(P / (C kMattnMinPages))) cluster ranges, each
// into C rank ranges; cluster q takes range q % ncl of tile group q / ncl, and clusters past
// ncl T exit at once. At context 512 with C = 8 that is one cluster of 8 CTAs a kv head and
// tile group (4 pages a CTA; the 7B at M = 8: two groups of two tiles, 64 CTAs), at 8k and
// beyond S / C clusters of one group (128 CTAs on every model, one an SM: the ring and the
// inbox take ~160 KB). Each CTA merges its warps, the ranks merge through distributed shared
// memory (every rank pushes column slice k of its partial and its (m, l) into rank k's inbox
// with st.async, counted on rank k's mbarrier), and with ncl > 1 every rank k writes its slice
// of the cluster's partial and bumps counters[kvh][z][k]: the last rank-k CTA of the kv head's
// tile group merges the ncl partials of slice k for the group's rows (the final merge spreads
// over C CTAs a group, not one: at M = 16 a kv head's partials are ncl x 112 rows x D floats).
// A CTA's merges and its inbox hold the group's rows only, in local order (tile k of the
// group: local rows 16 k ..).
//
// Two forms: C = 8 (mattn_cluster) and C = 2 (mattn_long_cluster), chosen by the step from P
// (VerifyKernels.long_pages). A cluster's CTAs must share a GPC, and at one CTA an SM the
// H200's GPCs hold 15 clusters of 8 (30 of 4, 66 of 2: dev/cluster_occupancy.cu): once the
// short form's working clusters (ncl a kv head, one tile group) pass what the GPU holds at once,
// the last of them waits for a whole cluster's run (the 7B from 193 pages on: 16 clusters).
// Clusters of 2 fill the grid in one wave at every P; below that P clusters of 8 are faster,
// each splitting a few pages eight ways behind one DSMEM merge (docs/PERFORMANCE.md, the
// multi-token step).
//
// Arguments (device pointers; fp16 = IEEE half bits):
//   q         fp16  [M, kHeads, kHeadDim]   the M tokens' queries, RoPE applied
//   kc, vc    fp16  this layer's caches (kv_cache.cuh), positions 0 .. start + M - 1 written;
//             pages fully allocated, every slot finite (a masked key's V is multiplied by 0)
//   pages     int32 [max_pages]             logical page -> physical page
//   start_p   int32 *                       position of row 0. Read before griddepcontrol.wait
//             (as attn_decode reads pos): written by an earlier step, not the preceding kernel
//   M         int   1 .. kVerifyRows        query rows (tokens)
//   part_ml   fp32  [kKVHeads, C, kMaMaxRows, kMattnSplits / C, 2]  scratch: (m, l) a cluster
//   part_acc  fp32  [kKVHeads, kMaMaxRows, kMattnSplits / C, kHeadDim]  scratch: sum p v
//   counters  int32 [kKVHeads, kMaMaxTiles, C]  zero before the first launch; every launch
//             leaves them zero
//   out       fp16  [M, kHeads, kHeadDim]   row t, head h: softmax over keys 0 .. start + t
// Block kMattnThreads, dynamic shared memory MaCluster<C>::kSmemBytes (registry.mattn_smem_bytes).
#include "common.cuh"
#include "kv_cache.cuh"

// From the generated header (nanoqwen/cuda/registry.py, Geometry): kVerifyRows (the most query
// rows), kMattnConsumers, kMattnThreads, kMattnSplits, kMattnStages, kMattnMinPages,
// kMattnMergeLoads. The cluster size C is the template argument (mattn_cluster, the short form;
// mattn_long_cluster, the long one).
constexpr int kMaG = kGroupRatio, kMaD = kHeadDim;
constexpr int kMaMaxRows = kVerifyRows * kMaG;
constexpr int kMaMaxTiles = (kMaMaxRows + 15) / 16;
constexpr int kMaTileH = kKvTileH;                   // one page of V (or a K part) of a kv head
constexpr int kMaStageH = (kKParts + 1) * kMaTileH;  // K's tiles then V's
constexpr int kMaRingBytes = kMattnStages * kMaStageH * 2;
constexpr unsigned kMaTileBytes = kMaTileH * 2;
constexpr unsigned kMaStageTx = kMaStageH * 2;
constexpr int kMaDK = kMaD / 16;  // k-steps over the head dim (QK^T)
constexpr int kMaDN = kMaD / 8;   // n8 tiles over the head dim (PV)
constexpr int kMaScrRow = kMaD + 8;  // padded fp32 row of the epilogue scratch
// The shapes that follow from the cluster size C. Dynamic shared memory: the ring, then the
// cluster inbox (recv_acc [C][kMaMaxRows][kCols], recv_ml [C][kMaMaxRows] float2);
// registry.mattn_smem_bytes is the host's copy.
template <int C>
struct MaCluster {
  static constexpr int kCols = kMaD / C;  // head-dim columns a cluster rank merges
  static constexpr int kCols4 = kCols / 4;
  static constexpr int kMaxCl = kMattnSplits / C;  // clusters a kv head, at most
  static constexpr int kAccBytes = C * kMaMaxRows * kCols * 4;
  static constexpr int kSmemBytes = kMaRingBytes + kAccBytes + C * kMaMaxRows * 8;
  static_assert(kCols % 4 == 0 && kCols * C == kMaD, "ranks merge float4 columns");
  static_assert(kMattnSplits % C == 0, "the splits come in whole clusters");
  static_assert(kMaD / 4 >= C, "a row's first C threads push its (m, l), one rank each");
};

static_assert(kMattnThreads == (kMattnConsumers + 1) * kWarp, "one producer beside consumers");
static_assert((kMattnConsumers & (kMattnConsumers - 1)) == 0, "page groups are powers of two");
static_assert(kMaMaxTiles <= kMattnConsumers, "one consumer warp per m16 row tile at least");
static_assert(kMattnStages % kMattnConsumers == 0, "every ring slot belongs to one page group");
// With J = kMattnConsumers groups (M G <= 16 rows) a group owns kMattnStages / J slots: one
// where the (hi, lo) K cache's 12 KB stages leave room for 8 (decode_attention.cu's 96 KB),
// and then its next page comes in while the other groups compute theirs.
static_assert(kMattnStages >= kMattnConsumers, "every page group owns a ring slot");
static_assert(kPageTokens == 16, "one page = one m16n8k16 key tile");
static_assert(kMaD % 32 == 0, "head dim: whole ldmatrix x4 groups");
static_assert(kMaStageTx < (1u << 20), "mbarrier tx-count range");
static_assert(kMattnConsumers * 16 * kMaScrRow * 4 + 2 * kMattnConsumers * 16 * 4 <=
                  kMaRingBytes, "epilogue scratch must fit in the drained ring");

namespace mattn {  // helpers local to this file
// Distributed shared memory: `addr` (this CTA's shared window) in cluster rank `rank`'s.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// st.async into rank-mapped shared memory, its bytes completing on that rank's mbarrier `bar`.
// No "memory" clobber: the inboxes it writes are read only after the wait on their mbarrier (a
// volatile asm that clobbers memory), so the push loop's scratch loads of the next row may be
// issued ahead of this row's push, and a warp's rows overlap instead of running one at a time.
__device__ __forceinline__ void st_async(uint32_t addr, float4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], "
               "{%1, %2, %3, %4}, [%5];"
               ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar));
}
__device__ __forceinline__ void st_async(uint32_t addr, float2 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, "
               "[%3];" ::"r"(addr), "f"(v.x), "f"(v.y), "r"(bar));
}
// fp16 row offset of packed row i (token i / G, head kvh G + i % G) in q / out.
__device__ __forceinline__ size_t row_offset(int i, int kvh) {
  return ((size_t)(i / kMaG) * kHeads + kvh * kMaG + i % kMaG) * kMaD;
}
}  // namespace mattn

template <int C>
__global__ void __launch_bounds__(kMattnThreads, 1) __cluster_dims__(1, C, 1)
attn_rows(const half* __restrict__ q, const half* __restrict__ kc, const half* __restrict__ vc,
          const int* __restrict__ pages, const int* start_p, int M, float* part_ml,
          float* part_acc, int* counters, half* __restrict__ out) {
  using Cl = MaCluster<C>;
  constexpr int D = kMaD, kMaCols = Cl::kCols, kMaCols4 = Cl::kCols4, kMaMaxCl = Cl::kMaxCl;
  extern __shared__ __align__(128) unsigned char ring[];  // Cl::kSmemBytes (dynamic)
  float* recv_acc = reinterpret_cast<float*>(ring + kMaRingBytes);    // [C][kMaMaxRows][kMaCols]
  float2* recv_ml = reinterpret_cast<float2*>(ring + kMaRingBytes + Cl::kAccBytes);  // [C][rows]
  __shared__ __align__(8) unsigned long long full_bar[kMattnStages], empty_bar[kMattnStages];
  __shared__ __align__(8) unsigned long long recv_bar;
  __shared__ int sm_last;

  const int kvh = blockIdx.x, rank = blockIdx.y % C;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int rows = M * kMaG, R = (rows + 15) / 16;
  // The next kernel may launch at once (it waits for this grid's end): its CTAs take the SMs
  // this grid leaves free and start their weights while start is read and the barriers set.
  pdl_trigger();
  const int start = *start_p;
  const int P = (start + M + kPageTokens - 1) / kPageTokens;
  constexpr int kClusterPages = C * kMattnMinPages;
  const int max_cl = min((int)gridDim.y, kMattnSplits) / C;
  const int ncl = min(max_cl, (P + kClusterPages - 1) / kClusterPages);
  const int T = max(1, min(R, max_cl / (2 * ncl)));  // tile groups (the file's head: why 2)
  const int z = blockIdx.y / C / ncl, cl = blockIdx.y / C % ncl;
  if (z >= T) return;  // uniform over the cluster
  // The group's tiles z, z + T, ...: Rz of them, local row li = global row grow(li). Its rows
  // are local rows 0 .. zrows - 1: the last tile's padding (past `rows`) can only be the group's
  // last local tile.
  const int Rz = (R - z + T - 1) / T;
  const int zrows = 16 * Rz - ((R - 1 - z) % T == 0 ? 16 * R - rows : 0);
  auto grow = [&](int li) { return (z + li / 16 * T) * 16 + li % 16; };
  int J = 1;  // page groups
  while (2 * J * Rz <= kMattnConsumers) J *= 2;
  const uint32_t ring_s = smem_addr(ring);
  if (tid == 0) {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < Cl::kSmemBytes || M < 1 || M > kVerifyRows) __trap();  // a launch the host refuses
#pragma unroll
    for (int s = 0; s < kMattnStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);    // the producer's arrive.expect_tx
      mbar_init(smem_addr(&empty_bar[s]), Rz);  // the Rz warps of the slot's page group
    }
    mbar_init(smem_addr(&recv_bar), 1);
    mbar_arrive_expect_tx(smem_addr(&recv_bar), C * zrows * (kMaCols + 2) * 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // inboxes armed

  const int cb = cl * P / ncl, ce = (cl + 1) * P / ncl;
  const int pb = cb + rank * (ce - cb) / C, pe = cb + (rank + 1) * (ce - cb) / C;
  const int npages = pe - pb;

  // Consumer state: rows lo = tile * 16 + lane / 4 and hi = lo + 8 of the warp's row tile.
  const int tile = z + warp % Rz * T, grp = warp / Rz, r = lane >> 2, c = lane & 3;
  const int row_lo = tile * 16 + r, row_hi = row_lo + 8;
  float m_lo = neg_inf(), m_hi = neg_inf(), l_lo = 0.f, l_hi = 0.f;
  float o[kMaDN][4];
#pragma unroll
  for (int n = 0; n < kMaDN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  if (warp == kMattnConsumers) {
    // ---- producer warp: lane 0 copies a page's K tiles, lane 1 its V tile (attn_decode's).
    const int parts = lane == 0 ? kKParts : 1;
    const half* src_base = (lane == 0 ? kc : vc) + (size_t)kvh * parts * kMaTileH;
    const size_t src_page = (size_t)kKVHeads * parts * kMaTileH;
    const uint32_t dst_base = ring_s + (lane & 1) * kKParts * kMaTileH * 2;
    int cur = pb + lane < pe ? pages[pb + lane] : 0;
    int nxt = pb + 32 + lane < pe ? pages[pb + 32 + lane] : 0;
    const int first_new = start / kPageTokens;  // pages from here hold the M new K/V rows
    bool waited = false;
    for (int i = 0; i < npages; ++i) {
      if (!waited && (pb + i >= first_new || i >= kMattnStages)) {
        pdl_wait();
        asm volatile("fence.proxy.async.global;" ::: "memory");  // generic-proxy K/V rows
        waited = true;
      }
      if (i > 0 && i % 32 == 0) {
        cur = nxt;
        nxt = pb + i + 32 + lane < pe ? pages[pb + i + 32 + lane] : 0;
      }
      const int phys = __shfl_sync(0xffffffffu, cur, i % 32);
      const int slot = i % kMattnStages, round = i / kMattnStages;
      if (round > 0) mbar_wait(smem_addr(&empty_bar[slot]), (round - 1) & 1);
      const uint32_t full = smem_addr(&full_bar[slot]);
      if (lane == 0) mbar_arrive_expect_tx(full, kMaStageTx);
      __syncwarp();
      if (lane < 2)
        bulk_g2s(dst_base + slot * kMaStageH * 2, src_base + phys * src_page,
                 parts * kMaTileBytes, full);
    }
  } else if (grp < J) {
    // ---- consumer warps (the file's head): group grp's pages, the warp's row tile.
    pdl_wait();  // q comes from the q/k/v GEMV
    const float scale = kLog2e * rsqrtf((float)D);
    uint32_t qa[kMaDK][4];
    {
      const uint32_t* lo = reinterpret_cast<const uint32_t*>(q + mattn::row_offset(row_lo, kvh));
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(q + mattn::row_offset(row_hi, kvh));
#pragma unroll
      for (int s = 0; s < kMaDK; ++s) {
        qa[s][0] = row_lo < rows ? lo[8 * s + c] : 0u;
        qa[s][1] = row_hi < rows ? hi[8 * s + c] : 0u;
        qa[s][2] = row_lo < rows ? lo[8 * s + 4 + c] : 0u;
        qa[s][3] = row_hi < rows ? hi[8 * s + 4 + c] : 0u;
      }
    }
    // Each row's last key; padding rows (>= rows) take the last row's, so no row is all -inf
    // where a real one is not.
    const int lim_lo = start + min(row_lo / kMaG, M - 1);
    const int lim_hi = start + min(row_hi / kMaG, M - 1);
    const uint32_t k_row = (lane & 7) * D * 2, v_row = (lane & 15) * D * 2;
    for (int i = grp; i < npages; i += J) {
      const int slot = i % kMattnStages;
      mbar_wait(smem_addr(&full_bar[slot]), (i / kMattnStages) & 1);
      const uint32_t k_s = ring_s + slot * kMaStageH * 2, v_s = k_s + kKParts * kMaTileH * 2;

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int p = 0; p < kMaDK / 2; ++p) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t at =
              k_s + k_row + j * 8 * D * 2 + kv_chunk(lane, 4 * p + (lane >> 3)) * 16;
#pragma unroll
          for (int part = 0; part < kKParts; ++part) {  // K's (hi, lo): the same accumulators
            uint32_t b[4];
            ldmatrix_x4(b, at + part * kMaTileH * 2);
            mma_16816(s[j], qa[2 * p], b[0], b[1]);
            mma_16816(s[j], qa[2 * p + 1], b[2], b[3]);
          }
        }
      }
      const int tok0 = (pb + i) * kPageTokens;
      const bool tail = tok0 + kPageTokens - 1 > start;  // holds a key past some row's last
      float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = tok0 + j * 8 + 2 * c + e;
          s[j][e] = tail && key > lim_lo ? neg_inf() : s[j][e] * scale;
          s[j][2 + e] = tail && key > lim_hi ? neg_inf() : s[j][2 + e] * scale;
          mx_lo = fmaxf(mx_lo, s[j][e]);
          mx_hi = fmaxf(mx_hi, s[j][2 + e]);
        }
      }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {  // the quad shares its rows
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
      }
      // A row with no valid key yet keeps m = -inf; 0 stands in for its max in the exponents.
      const float safe_lo = mx_lo == neg_inf() ? 0.f : mx_lo;
      const float safe_hi = mx_hi == neg_inf() ? 0.f : mx_hi;
      const float a_lo = fast_exp2(m_lo - safe_lo), a_hi = fast_exp2(m_hi - safe_hi);
      m_lo = mx_lo;
      m_hi = mx_hi;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s[j][0] = fast_exp2(s[j][0] - safe_lo);
        s[j][1] = fast_exp2(s[j][1] - safe_lo);
        s[j][2] = fast_exp2(s[j][2] - safe_hi);
        s[j][3] = fast_exp2(s[j][3] - safe_hi);
      }
      l_lo = l_lo * a_lo + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
      l_hi = l_hi * a_hi + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
#pragma unroll
      for (int n = 0; n < kMaDN; ++n) {
        o[n][0] *= a_lo;
        o[n][1] *= a_lo;
        o[n][2] *= a_hi;
        o[n][3] *= a_hi;
      }
      // O += P V: key tiles 0, 1 of S are the A fragment of the page's one k-step.
      const uint32_t pa[4] = {pack_half2(s[0][0], s[0][1]), pack_half2(s[0][2], s[0][3]),
                              pack_half2(s[1][0], s[1][1]), pack_half2(s[1][2], s[1][3])};
#pragma unroll
      for (int dp = 0; dp < kMaDK; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + v_row + kv_chunk(lane, 2 * dp + (lane >> 4)) * 16);
        mma_16816(o[2 * dp], pa, b[0], b[1]);
        mma_16816(o[2 * dp + 1], pa, b[2], b[3]);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[slot]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
  }

  // ---- epilogue: merge the page groups (scratch aliases the drained ring: slot w = grp Rz +
  // local tile holds o[16][kMaScrRow], m[16], l[16]), push into the cluster, merge the cluster
  // (the barriers as attn_decode's: every thread reaches every __syncthreads; the cluster waits
  // order the pushes after the inboxes' arming and keep every rank resident until its pushes
  // have landed).
  float* scr_o = reinterpret_cast<float*>(ring);       // [kMattnConsumers][16][kMaScrRow]
  float* scr_m = scr_o + kMattnConsumers * 16 * kMaScrRow;  // [kMattnConsumers][16]
  float* scr_l = scr_m + kMattnConsumers * 16;              // [kMattnConsumers][16]
  __syncthreads();  // every page consumed
  if (warp < Rz * J) {
    float* lo = scr_o + (warp * 16 + r) * kMaScrRow + 2 * c;
    float* hi = lo + 8 * kMaScrRow;
#pragma unroll
    for (int n = 0; n < kMaDN; ++n) {
      *reinterpret_cast<float2*>(lo + n * 8) = make_float2(o[n][0], o[n][1]);
      *reinterpret_cast<float2*>(hi + n * 8) = make_float2(o[n][2], o[n][3]);
    }
    if (c == 0) {
      scr_m[warp * 16 + r] = m_lo;
      scr_m[warp * 16 + r + 8] = m_hi;
      scr_l[warp * 16 + r] = l_lo;
      scr_l[warp * 16 + r + 8] = l_hi;
    }
  }
  __syncthreads();
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every rank's recv_bar is set
  constexpr int kD4 = D / 4;
  const uint32_t acc_s = smem_addr(recv_acc + rank * kMaMaxRows * kMaCols);
  const uint32_t ml_s = smem_addr(recv_ml + rank * kMaMaxRows);
  const uint32_t bar_s = smem_addr(&recv_bar);
  for (int idx = tid; idx < zrows * kD4; idx += kMattnThreads) {
    const int i = idx / kD4, u = idx % kD4, d = 4 * u;  // local row i
    float mx = -1e30f;  // a finite floor: a CTA without valid keys passes (-1e30, 0, 0)
    for (int g = 0; g < J; ++g) mx = fmaxf(mx, scr_m[g * Rz * 16 + i]);
    float lsum = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int g = 0; g < J; ++g) {
      const int slot_row = g * Rz * 16 + i;  // warp g Rz + i / 16, its row i % 16
      const float cw = fast_exp2(scr_m[slot_row] - mx);
      const float4 v = *reinterpret_cast<const float4*>(scr_o + slot_row * kMaScrRow + d);
      lsum = fmaf(scr_l[slot_row], cw, lsum);
      a = make_float4(fmaf(v.x, cw, a.x), fmaf(v.y, cw, a.y), fmaf(v.z, cw, a.z),
                      fmaf(v.w, cw, a.w));
    }
    const int k = d / kMaCols;
    mattn::st_async(mattn::map_rank(acc_s + (i * kMaCols + d % kMaCols) * 4, k), a,
                    mattn::map_rank(bar_s, k));
    // Row i's (m, l) to every rank: thread u < C pushes rank u's copy (one thread pushing all
    // C in turn would hold its warp C pushes long on every row).
    if (u < C)
      mattn::st_async(mattn::map_rank(ml_s + i * 8, u), make_float2(mx, lsum),
                      mattn::map_rank(bar_s, u));
  }

  // ---- cluster merge: rank k merges columns [k, k + 1) * kMaCols of every row.
  mbar_wait(bar_s, 0);
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  const size_t slice = (size_t)kvh * C + rank;  // this rank's (m, l) copies
  for (int idx = tid; idx < zrows * kMaCols4; idx += kMattnThreads) {
    const int li = idx / kMaCols4, i = grow(li), d = rank * kMaCols + idx % kMaCols4 * 4;
    float mx = recv_ml[li].x;
#pragma unroll
    for (int k = 1; k < C; ++k) mx = fmaxf(mx, recv_ml[k * kMaMaxRows + li].x);
    float lsum = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const float w = fast_exp2(recv_ml[k * kMaMaxRows + li].x - mx);
      const float4 v = *reinterpret_cast<const float4*>(
          recv_acc + (k * kMaMaxRows + li) * kMaCols + d % kMaCols);
      lsum = fmaf(recv_ml[k * kMaMaxRows + li].y, w, lsum);
      a = make_float4(fmaf(v.x, w, a.x), fmaf(v.y, w, a.y), fmaf(v.z, w, a.z),
                      fmaf(v.w, w, a.w));
    }
    if (ncl == 1) {
      const float inv = 1.f / lsum;
      half2* dst = reinterpret_cast<half2*>(out + mattn::row_offset(i, kvh) + d);
      dst[0] = __floats2half2_rn(a.x * inv, a.y * inv);
      dst[1] = __floats2half2_rn(a.z * inv, a.w * inv);
    } else {
      *reinterpret_cast<float4*>(
          part_acc + (((size_t)kvh * kMaMaxRows + i) * kMaMaxCl + cl) * D + d) = a;
      if (d % kMaCols == 0)
        *reinterpret_cast<float2*>(part_ml + ((slice * kMaMaxRows + i) * kMaMaxCl + cl) * 2) =
            make_float2(mx, lsum);
    }
  }
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  if (ncl == 1) return;  // uniform over the cluster

  // ---- semaphore over the tile group's rank-k CTAs: the last of the ncl merges slice k.
  int* counter = counters + ((size_t)kvh * kMaMaxTiles + z) * C + rank;
  __syncthreads();
  if (tid == 0) sm_last = atom_add_acq_rel(counter, 1) == ncl - 1;
  __syncthreads();
  if (!sm_last) return;  // uniform
  for (int idx = tid; idx < zrows * kMaCols4; idx += kMattnThreads) {
    const int i = grow(idx / kMaCols4), d = rank * kMaCols + idx % kMaCols4 * 4;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + (slice * kMaMaxRows + i) *
                                                                      kMaMaxCl;
    const float4* src = reinterpret_cast<const float4*>(
        part_acc + ((size_t)kvh * kMaMaxRows + i) * kMaMaxCl * D + d);
    float mx = neg_inf(), lsum = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < ncl; s += kMattnMergeLoads) {
      float2 m[kMattnMergeLoads];
      float4 v[kMattnMergeLoads];
#pragma unroll
      for (int u = 0; u < kMattnMergeLoads; ++u) {
        const bool in = s + u < ncl;
        m[u] = in ? __ldcg(ml + s + u) : make_float2(neg_inf(), 0.f);
        v[u] = in ? __ldcg(src + (size_t)(s + u) * kD4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float bm = mx;  // finite from the first batch on: cluster 0 has key 0 for every row
#pragma unroll
      for (int u = 0; u < kMattnMergeLoads; ++u) bm = fmaxf(bm, m[u].x);
      const float rs = fast_exp2(mx - bm);
      lsum *= rs;
      a = make_float4(a.x * rs, a.y * rs, a.z * rs, a.w * rs);
#pragma unroll
      for (int u = 0; u < kMattnMergeLoads; ++u) {
        const float w = fast_exp2(m[u].x - bm);
        lsum = fmaf(m[u].y, w, lsum);
        a = make_float4(fmaf(w, v[u].x, a.x), fmaf(w, v[u].y, a.y), fmaf(w, v[u].z, a.z),
                        fmaf(w, v[u].w, a.w));
      }
      mx = bm;
    }
    const float inv = 1.f / lsum;
    half2* dst = reinterpret_cast<half2*>(out + mattn::row_offset(i, kvh) + d);
    dst[0] = __floats2half2_rn(a.x * inv, a.y * inv);
    dst[1] = __floats2half2_rn(a.z * inv, a.w * inv);
  }
  if (tid == 0) *counter = 0;  // every rank-k CTA of the group has counted
}
