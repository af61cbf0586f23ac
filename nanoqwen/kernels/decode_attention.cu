// decode_attention.cu: paged GQA decode attention (flash-decoding), warp-specialized: one
// producer warp streams K/V pages into shared memory with Hopper's bulk async copy
// (cp.async.bulk ... mbarrier::complete_tx), four consumer warps run QK^T and PV on mma.sync
// with an fp32 online softmax, and the split-combine is folded in (a cluster merge through
// distributed shared memory, then a last-CTA semaphore).
//
// attn_decode: grid (kKVHeads, S) in clusters of (1, kAttnCluster, 1), S <= kAttnSplits a
// multiple of kAttnCluster fixed per model (nanoqwen/cuda/decode.py: S = min(kAttnSplits,
// attn_ctas / kKVHeads) rounded down to whole clusters, one cluster at least), block
// kAttnThreads = 5 warps, the K/V ring in dynamic shared memory (kAttnStages pages: 96 KB at
// D = 128, 48 KB at D = 64), <= 136 registers. The K cache's parts (kv_cache.cuh) are summed
// in the QK^T accumulators.
//
// attn_decode<true>: the batched decode step's (engine/batch.py): `rows` sequences of one query
// token each, every one with its own position, page table and split scratch, in one launch of
// grid (kKVHeads, (rows + spare) x kAttnCluster): attn_batch_slot maps a cluster to a sequence
// and one of its splits, a sequence's split count following its own length (one at least; a
// long one beside short ones gets about what it would get alone). attn_decode<false> is the
// single-stream step's kernel, the same code with sequence 0's plan (rows, page_stride unused).
//
// Arguments (device pointers; fp16 = IEEE half bits; batched: per sequence b at b's stride):
//   q         fp16  [kHeads, kHeadDim]             query of the current token, RoPE applied
//   kc, vc    fp16  this layer's caches (kv_cache.cuh: one contiguous, chunk-swizzled tile of
//             kPageTokens x kHeadDim per page and kv head). Pages are fully allocated.
//   pages     int32 [max_pages]                     logical page -> physical page
//   pos       int32 *                               current position; L = *pos + 1 tokens valid
//             (batched: int32 [rows], staged by the host before the step)
//   part_ml   fp32  [kHeads, kAttnSplits, 2]        scratch: per cluster (max m in log2 units, l)
//   part_acc  fp32  [kHeads, kAttnSplits, kHeadDim] scratch: per cluster unnormalized sum p * v
//   counters  int32 [kKVHeads]                      zero before the first launch; every launch
//             leaves them zero again (so a captured graph replays)
//   out       fp16  [kHeads, kHeadDim] = softmax(q k^T / sqrt(D)) v; query head h reads kv head
//             h / kGroupRatio
//   rows      int   batched: sequences (1 .. gridDim.y / kAttnCluster); else unused
//   page_stride int batched: ints between two sequences' page tables; else unused
//
// Splits. P = ceil(L / 16) pages are cut into ncl = min(S / C, ceil(P / (C kAttnMinPages)))
// ranges of whole pages, one per cluster of C = kAttnCluster CTAs (grid y = S / C clusters of
// (1, C, 1)), and each cluster's range into C balanced sub-ranges (cluster c owns pages
// [c P / ncl, (c + 1) P / ncl), rank k the k-th C-th of that, possibly empty), so the split
// size follows L at run time while the grid keeps its shape (it is captured in a graph).
// Clusters with c >= ncl exit at once. Each CTA merges its warps, then the ranks of a cluster
// merge through distributed shared memory: every rank pushes column slice k of its partial and
// its (m, l) into rank k's inbox with st.async, which counts the bytes on rank k's mbarrier,
// and rank k merges what it received; with ncl == 1 that writes `out`. Otherwise each rank
// writes its slice of the cluster's partial per query head and bumps counters[kv head] (one
// acq_rel atomic); the last of the kv head's ncl x C CTAs merges the ncl partials, writes
// `out`, and resets the counter to 0, reading each cluster's (m, l) with its partial sums and
// rescaling online (a batch of clusters costs one L2 round trip). A push, not remote reads
// (ld.shared::cluster) between cluster barriers: barrier.cluster.arrive.release compiles to
// MEMBAR.ALL.GPU, which under the weight streams waits out this thread's global stores.
//
// Pipeline. One stage = one page of one kv head: its K tiles (kKParts of them, contiguous) and
// its V tile, one 1-D bulk copy each (producer lanes 0 and 1; 8 KB and 4 KB at D = 128 with
// the (hi, lo) K cache: the copy engine pays per copy, hence kv_cache.cuh's contiguous tiles),
// both completing on the stage's "full" mbarrier armed with arrive.expect_tx(12 KB). The ring
// holds 96 KB at D = 128 (Geometry.attn_stages: 8 stages with the (hi, lo) K cache, 12 with
// plain fp16 K): each consumer warp owns two slots or three, so its next pages are in flight
// while it computes the current one; deeper rings no longer let the next launch's CTAs fit
// beside the running ones. One page per stage because (a) a 16-token
// page is exactly one m16n8k16 key tile, so a consumer warp owns whole stages and never
// synchronizes with the other consumers inside the loop, and (b) small stages refill at a
// finer grain than big ones for the same bytes. The pages before the current token's are
// copied before griddepcontrol.wait, so the first ring fill overlaps the q/k/v GEMV. At long
// context every model runs 128 CTAs (Geometry.attn_ctas: 7B 4 kv heads x 32 splits), one per
// SM with 96 KB in flight; a launch at 32700 tokens streams ~2.6 TB/s, below the GEMVs' rings
// (dev/kernel_tune.py attention), and the copies alone run about as fast: what bounds that
// stream is open (alternatives measured: docs/EXPERIMENTS.md).
#include "common.cuh"
#include "kv_cache.cuh"

// From the generated header (nanoqwen/cuda/registry.py, Geometry): kAttnConsumers (consumer
// warps 0..kAttnConsumers-1; the next warp produces; kAttnThreads in all), kAttnSplits,
// kAttnCluster, kAttnStages (the ring depth, one page a stage: the launch passes the ring as
// dynamic shared memory), kAttnMinPages (a cluster rank owns at least this many pages) and
// kAttnMergeLoads (the merge's independent partial loads a thread).
constexpr int kAttnWarps = kAttnConsumers + 1;
static_assert(kAttnThreads == kAttnWarps * kWarp, "one producer warp beside the consumers");
constexpr int kAttnTileH = kKvTileH;                 // one page of V (or a K part) of a kv head
constexpr int kAttnStageH = (kKParts + 1) * kAttnTileH;  // K's tiles then V's
constexpr int kAttnRingBytes = kAttnStages * kAttnStageH * 2;
constexpr unsigned kAttnTileBytes = kAttnTileH * 2;
constexpr unsigned kAttnStageTx = kAttnStageH * 2;  // bytes landing per stage (two bulk copies)
constexpr int kAttnDK = kHeadDim / 16;      // mma k-steps over the head dim (QK^T)
constexpr int kAttnDN = kHeadDim / 8;       // n8 tiles over the head dim (PV)
constexpr int kAttnScrRow = kHeadDim + 8;   // padded fp32 row of the epilogue scratch

static_assert(kHeads % kKVHeads == 0, "GQA groups must divide evenly");
static_assert(kGroupRatio >= 1 && kGroupRatio <= 8, "query heads of a group fill mma rows 0..7");
static_assert(kHeadDim % 32 == 0, "head dim: whole ldmatrix x4 groups of 32 columns");
static_assert(kPageTokens == 16, "one page = one m16n8k16 key tile");
static_assert(kAttnStageTx < (1u << 20), "mbarrier tx-count range");
// Warp w consumes pages w, w + 4, ...: with kAttnStages a multiple of the consumer count each
// slot is only ever read by one warp, so a warp's full-barrier wait for round r finds the
// barrier in phase r (it consumed round r - 1 itself) and the parity test cannot alias an
// older phase.
static_assert(kAttnStages % kAttnConsumers == 0, "one consumer warp per ring slot");
static_assert(kAttnStages >= 2 * kAttnConsumers, "each consumer keeps its next page in flight");
// Epilogue scratch (aliases the drained ring): per consumer warp o[G][kAttnScrRow], m[G], l[G].
constexpr int kAttnScrO = kAttnConsumers * kGroupRatio * kAttnScrRow;
constexpr int kAttnScrFloats = kAttnScrO + 2 * kAttnConsumers * kGroupRatio;
static_assert(kAttnScrFloats * 4 <= kAttnRingBytes, "epilogue scratch must fit in the ring");
// The cluster merge: rank k merges head-dim columns [k kAttnCols, (k + 1) kAttnCols).
constexpr int kAttnCols = kHeadDim / kAttnCluster;
static_assert(kAttnCols % 4 == 0 && kAttnCols * kAttnCluster == kHeadDim,
              "each rank merges whole float4 columns");
// Bytes each CTA's recv_bar expects: every rank's slice of G x kAttnCols floats and G (m, l).
constexpr unsigned kAttnRecvTx = kAttnCluster * kGroupRatio * (kAttnCols + 2) * 4;
static_assert(kAttnSplits % kAttnCluster == 0, "the splits come in whole clusters");
// CTAs an SM by shared memory (228 KB an SM, 1 KB of it reserved a CTA; ~5 KB of static
// shared memory beside the ring), at most 3: the single-stream kernel's register bound.
constexpr int kAttnCtasBySmem = 228 * 1024 / (kAttnRingBytes + 6 * 1024);
constexpr int kAttnCtasPerSm = kAttnCtasBySmem < 3 ? kAttnCtasBySmem : 3;

namespace attn {  // helpers local to this file (common.cuh holds the shared ones)
// m16n8k16 (fp16 in, fp32 accumulate) with A rows 8..15 zero: only the row-(lane / 4)
// accumulators c0, c1 are kept; a = {a0, a2} (row lane / 4, k = 2 (lane % 4) + {0, 1} and + 8).
__device__ __forceinline__ void mma_top(float& c0, float& c1, uint32_t a0, uint32_t a2,
                                        uint32_t b0, uint32_t b1) {
  float x2, x3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};"
      : "=f"(c0), "=f"(c1), "=f"(x2), "=f"(x3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(0.f),
        "f"(0.f));
}
// Distributed shared memory: `addr` (this CTA's shared window) in cluster rank `rank`'s.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// st.async: a store into rank-mapped shared memory `addr` that completes its bytes on the
// mbarrier `bar` of the same rank (both shared::cluster addresses): no barrier, no fence.
__device__ __forceinline__ void st_async(uint32_t addr, float4 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], "
               "{%1, %2, %3, %4}, [%5];"
               ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async(uint32_t addr, float2 v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, "
               "[%3];" ::"r"(addr), "f"(v.x), "f"(v.y), "r"(bar) : "memory");
}
}  // namespace attn

// The batched step's split plan (kBatched): which sequence and which of its clusters the
// launch's cluster index g takes, over `rows` sequences with positions pos[0 .. rows - 1]. Each
// sequence b wants want_b = min(kAttnSplits / C, ceil(P_b / (C kAttnMinPages))) clusters (the
// single-stream rule at the stride's cap); it gets one, plus a share of the grid's spare
// clusters (cap - rows, cap = gridDim.y / C) in proportion to its pages, at most want_b in all.
// The shares sum to at most cap, so no sequence loses its cluster, and a long one beside short
// ones gets about the clusters it would get alone (the launcher leaves the single-stream
// step's cluster count spare). Sequences are laid out in order: b's clusters are g = first_b ..
// first_b + ncl_b - 1. Every CTA computes the same plan from the same words.
struct AttnSlot {
  int b, cl, ncl, L;  // cl >= ncl: no work (the grid's spare clusters past the plan)
};

__device__ __forceinline__ int attn_want(int P) {
  constexpr int kClusterPages = kAttnCluster * kAttnMinPages;
  return min(kAttnSplits / kAttnCluster, (P + kClusterPages - 1) / kClusterPages);
}

__device__ __forceinline__ AttnSlot attn_batch_slot(const int* pos, int rows, int g) {
  const int cap = gridDim.y / kAttnCluster;
  int total = 0;
  for (int b = 0; b < rows; ++b) total += pos[b] / kPageTokens + 1;
  const int spare = cap - rows;
  int first = 0;
  for (int b = 0; b < rows; ++b) {
    const int L = pos[b] + 1, P = (L + kPageTokens - 1) / kPageTokens;
    const int ncl = 1 + min(attn_want(P) - 1, (int)((long long)spare * P / total));
    if (g < first + ncl) return {b, g - first, ncl, L};
    first += ncl;
  }
  return {0, 1, 0, 1};
}

// kBatched = false: the single-stream decode step (grid (kKVHeads, S)); rows and page_stride
// are unused and the code is the same as without them. Its bound asks for the CTAs an SM the
// ring lets reside, at most 3 (kAttnCtasPerSm: 2 at D = 128, 3 at D = 64): the registers of 3
// (128) spill under the (hi, lo) K cache's second ldmatrix a key tile (ptxas -v: 16 bytes).
// The batched kernel's bound asks for 2: its plan holds two registers more over the main loop
// (b, cl), which at the 128 registers of 3 CTAs spilled (ptxas -v: 20 bytes).
// kBatched = true: `rows` sequences of one query token each (grid (kKVHeads, (rows + spare) x
// C): attn_batch_slot), sequence b's q, out, pos, page table and scratch at b's stride: q/out
// rows [b kHeads + h], pos[b], pages + b page_stride, part_ml/part_acc as
// [rows][kHeads][kAttnSplits][2 | D], counters [rows][kKVHeads].
template <bool kBatched>
__global__ void __launch_bounds__(kAttnThreads, kBatched ? 2 : kAttnCtasPerSm)
    __cluster_dims__(1, kAttnCluster, 1)
attn_decode(const half* __restrict__ q, const half* __restrict__ kc, const half* __restrict__ vc,
            const int* __restrict__ pages, const int* pos, float* part_ml, float* part_acc,
            int* counters, half* __restrict__ out, int rows, int page_stride) {
  constexpr int G = kGroupRatio, D = kHeadDim;
  extern __shared__ __align__(128) unsigned char ring[];  // kAttnRingBytes (dynamic)
  __shared__ __align__(8) unsigned long long full_bar[kAttnStages], empty_bar[kAttnStages];
  __shared__ int sm_last;
  // The cluster merge's inbox: from each rank its partial's column slice and its (m, l), pushed
  // with st.async and counted on recv_bar.
  __shared__ __align__(16) float recv_acc[kAttnCluster][G][kAttnCols];
  __shared__ __align__(8) float2 recv_ml[kAttnCluster][G];
  __shared__ __align__(8) unsigned long long recv_bar;

  // Cluster cl of this kv head; rank = %cluster_ctarank for clusters of (1, kAttnCluster, 1).
  const int kvh = blockIdx.x;
  int cl = blockIdx.y / kAttnCluster;  // batched: the launch's cluster, then attn_batch_slot's
  const int rank = blockIdx.y % kAttnCluster;
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const uint32_t ring_s = smem_addr(ring);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kAttnStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);   // the producer's arrive.expect_tx
      mbar_init(smem_addr(&empty_bar[s]), 1);  // the consuming warp's one arrive
    }
    mbar_init(smem_addr(&recv_bar), 1);
    mbar_arrive_expect_tx(smem_addr(&recv_bar), kAttnRecvTx);  // its one arrival
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // recv_bar is armed before any rank pushes into it: the wait sits before the pushes.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");

  // Before griddepcontrol.wait: pos (written by the sampler, a step ago) and the page table are
  // not written by the preceding kernel, nor are the K/V pages before the current token's; q
  // and the current token's K/V row are (the q/k/v GEMV), so they are read after the wait.
  pdl_trigger();
  // b: the sequence (batched; else 0). Its q/out/scratch rows are addressed through the query
  // head index b kHeads + h and its counter through b kKVHeads + kvh: one register over the
  // main loop, where offset pointers would be six 64-bit ones beside parameters that stay in
  // the constant bank.
  int L, ncl, b = 0;
  if constexpr (kBatched) {
    // The batch's positions are staged by the host before the step: read before the wait too.
    const AttnSlot slot = attn_batch_slot(pos, rows, cl);
    b = slot.b, cl = slot.cl, ncl = slot.ncl, L = slot.L;
  } else {
    L = *pos + 1;
  }
  const int P = (L + kPageTokens - 1) / kPageTokens;
  if constexpr (!kBatched) {
    // grid y: the launch's split cap; a cluster covers kAttnCluster * kAttnMinPages pages at
    // least
    constexpr int kClusterPages = kAttnCluster * kAttnMinPages;
    const int max_cl = min((int)gridDim.y, kAttnSplits) / kAttnCluster;
    ncl = min(max_cl, (P + kClusterPages - 1) / kClusterPages);
  }
  if (cl >= ncl) return;  // uniform over the cluster: an empty one
  const int cb = cl * P / ncl, ce = (cl + 1) * P / ncl;  // >= 1 page (ncl <= P)
  const int pb = cb + rank * (ce - cb) / kAttnCluster;
  const int pe = cb + (rank + 1) * (ce - cb) / kAttnCluster;
  const int npages = pe - pb;  // 0 when the cluster has fewer pages than ranks

  // Consumer state (warps 0..3): row r = lane / 4 of the mma tiles is query head kvh * G + r.
  const int r = lane >> 2, c = lane & 3;
  float m_run = neg_inf(), l_run = 0.f;
  float o[kAttnDN][2];
#pragma unroll
  for (int n = 0; n < kAttnDN; ++n) o[n][0] = o[n][1] = 0.f;

  if (warp == kAttnConsumers) {
    // ---- producer warp: lane 0 copies the page's K tiles (kKParts, contiguous), lane 1 its
    // V tile.
    const int parts = lane == 0 ? kKParts : 1;
    const half* src_base = (lane == 0 ? kc : vc) + (size_t)kvh * parts * kAttnTileH;
    const size_t src_page = (size_t)kKVHeads * parts * kAttnTileH;
    if constexpr (kBatched) pages += (size_t)b * page_stride;
    const uint32_t dst_base = ring_s + (lane & 1) * kKParts * kAttnTileH * 2;
    // Page ids 32 at a time, one batch ahead, so no page-table load sits on the issue path.
    int cur = pb + lane < pe ? pages[pb + lane] : 0;
    int nxt = pb + 32 + lane < pe ? pages[pb + 32 + lane] : 0;
    bool waited = false;
    for (int i = 0; i < npages; ++i) {
      // Pages of earlier tokens fill the ring before the wait (they overlap the q/k/v GEMV's
      // tail); the page holding token L - 1, and anything needing a freed slot, after it.
      if (!waited && (pb + i == P - 1 || i >= kAttnStages)) {
        pdl_wait();
        // The current token's K/V row came through the generic proxy; the bulk copy reads
        // through the async proxy.
        asm volatile("fence.proxy.async.global;" ::: "memory");
        waited = true;
      }
      if (i > 0 && i % 32 == 0) {
        cur = nxt;
        nxt = pb + i + 32 + lane < pe ? pages[pb + i + 32 + lane] : 0;
      }
      const int phys = __shfl_sync(0xffffffffu, cur, i % 32);
      const int slot = i % kAttnStages, round = i / kAttnStages;
      if (round > 0) mbar_wait(smem_addr(&empty_bar[slot]), (round - 1) & 1);
      const uint32_t full = smem_addr(&full_bar[slot]);
      if (lane == 0) mbar_arrive_expect_tx(full, kAttnStageTx);
      __syncwarp();
      if (lane < 2)
        bulk_g2s(dst_base + slot * kAttnStageH * 2, src_base + phys * src_page,
                 parts * kAttnTileBytes, full);
    }
  } else {
    // ---- consumer warps. Warp w takes the split's pages w, w + 4, ... (stage slot = page %
    // kAttnStages, full barrier parity = (page / kAttnStages) & 1), then arrives on the slot's
    // "empty" barrier (count 1, one arrival per consumed page); the producer waits on "empty"
    // with parity ((page / kAttnStages) - 1) & 1 before it reuses a slot. Per page: S = Q K^T
    // with Q as the A operand (rows = the kGroupRatio <= 8 query heads of this kv head; rows
    // 8..15 are zero) and K rows as B (a plain ldmatrix), 2 key tiles x kHeadDim / 16 k-steps;
    // the scale log2(e) / sqrt(D) is applied to the fp32 scores (not folded into the fp16 q:
    // that would add one fp16 rounding for nothing); base-2 online softmax in fp32; tokens >= L
    // masked to -inf; then O += P V with the score accumulators reused as the A fragment (P
    // rounded to fp16) and V rows as B (a transposed ldmatrix). Row sums stay per lane until
    // the end. The tiles keep the cache's chunk swizzle (kv_chunk), which makes every ldmatrix
    // conflict-free.
    pdl_wait();  // q comes from the q/k/v GEMV
    const float scale = kLog2e * rsqrtf((float)D);
    uint32_t qa[kAttnDK][2];  // A fragment {a0, a2} per k-step; a1 = a3 = 0 (rows 8..15)
    {
      const uint32_t* qrow =
          reinterpret_cast<const uint32_t*>(q + (size_t)(b * kHeads + kvh * G + r) * D);
#pragma unroll
      for (int s = 0; s < kAttnDK; ++s) {
        qa[s][0] = r < G ? qrow[8 * s + c] : 0u;
        qa[s][1] = r < G ? qrow[8 * s + 4 + c] : 0u;
      }
    }
    // ldmatrix lane rows (bytes, relative to a K or V tile): K rows 8j + lane % 8 at chunk
    // 4p + lane / 8, V rows lane % 16 at chunk 2dp + lane / 16, each chunk where the swizzle
    // put it (row % 8 = lane % 8 in both).
    const uint32_t k_row = (lane & 7) * D * 2, v_row = (lane & 15) * D * 2;
    for (int i = warp; i < npages; i += kAttnConsumers) {
      const int slot = i % kAttnStages;
      mbar_wait(smem_addr(&full_bar[slot]), (i / kAttnStages) & 1);
      const uint32_t k_s = ring_s + slot * kAttnStageH * 2;
      const uint32_t v_s = k_s + kKParts * kAttnTileH * 2;

      // S = Q K^T for keys j * 8 + 2c + e (j = key tile 0/1), row r: K's parts (hi, lo) into
      // the same accumulators, a part's tile at a constant offset from the hi tile's address.
      float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
      for (int p = 0; p < kAttnDK / 2; ++p) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t at =
              k_s + k_row + j * 8 * D * 2 + kv_chunk(lane, 4 * p + (lane >> 3)) * 16;
#pragma unroll
          for (int part = 0; part < kKParts; ++part) {
            uint32_t b[4];
            ldmatrix_x4(b, at + part * kAttnTileH * 2);
            attn::mma_top(s[j][0], s[j][1], qa[2 * p][0], qa[2 * p][1], b[0], b[1]);
            attn::mma_top(s[j][0], s[j][1], qa[2 * p + 1][0], qa[2 * p + 1][1], b[2], b[3]);
          }
        }
      }
      // Online softmax (log2 domain). Only the page holding token L - 1 needs the mask; it
      // has at least one valid token, so mx is finite.
      const int tok0 = (pb + i) * kPageTokens;
      const bool tail = tok0 + kPageTokens > L;
      float mx = m_run;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = s[j][e] * scale;
          s[j][e] = tail && tok0 + j * 8 + 2 * c + e >= L ? neg_inf() : v;
          mx = fmaxf(mx, s[j][e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the quad shares row r
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float alpha = fast_exp2(m_run - mx);  // 0 on the first page (m_run = -inf)
      m_run = mx;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s[j][0] = fast_exp2(s[j][0] - mx);
        s[j][1] = fast_exp2(s[j][1] - mx);
      }
      l_run = l_run * alpha + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
#pragma unroll
      for (int n = 0; n < kAttnDN; ++n) {
        o[n][0] *= alpha;
        o[n][1] *= alpha;
      }
      // O += P V: the score accumulators of key tiles 0, 1 are the A fragment {a0, a2} of the
      // single k-step over the page's 16 keys.
      const uint32_t pa0 = pack_half2(s[0][0], s[0][1]);
      const uint32_t pa2 = pack_half2(s[1][0], s[1][1]);
#pragma unroll
      for (int dp = 0; dp < kAttnDK; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + v_row + kv_chunk(lane, 2 * dp + (lane >> 4)) * 16);
        attn::mma_top(o[2 * dp][0], o[2 * dp][1], pa0, pa2, b[0], b[1]);
        attn::mma_top(o[2 * dp + 1][0], o[2 * dp + 1][1], pa0, pa2, b[2], b[3]);
      }
      __syncwarp();  // every lane's ldmatrix of this slot is done
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[slot]));
    }
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  }

  // ---- epilogue: merge the consumer warps (scratch aliases the drained ring). __syncthreads
  // (all 5 warps: the ring is drained), the consumers park (m, l, o) in shared memory,
  // __syncthreads, all threads merge the 4 warps and push, then the split logic of the file's
  // head. Two relaxed cluster barriers: the first (arrived after the inboxes' mbarriers are
  // armed at the start, waited on before the first push) keeps any push ahead of its inbox's
  // arming; an empty cluster leaves before it, as a whole. The second (arrived once a rank's
  // own inbox is full, waited on before it leaves) keeps every rank resident until all pushes
  // have landed. Every thread of a CTA reaches every __syncthreads (the exits after the merge
  // are uniform over the CTA).
  float* scr_o = reinterpret_cast<float*>(ring);  // [kAttnConsumers][G][kAttnScrRow]
  float* scr_m = scr_o + kAttnScrO;               // [kAttnConsumers][G]
  float* scr_l = scr_m + kAttnConsumers * G;      // [kAttnConsumers][G]
  __syncthreads();  // every page consumed: no bulk copy or ldmatrix touches the ring any more
  if (warp < kAttnConsumers && r < G) {
    float* row = scr_o + (warp * G + r) * kAttnScrRow + 2 * c;
#pragma unroll
    for (int n = 0; n < kAttnDN; ++n)
      *reinterpret_cast<float2*>(row + n * 8) = make_float2(o[n][0], o[n][1]);
    if (c == 0) {
      scr_m[warp * G + r] = m_run;  // -inf, l = 0, o = 0 for a warp that had no page
      scr_l[warp * G + r] = l_run;
    }
  }
  __syncthreads();
  // The CTA's partial, 4 columns a thread, pushed into the cluster: columns of slice k go to
  // rank k's recv_acc[rank], (m, l) to every rank's recv_ml[rank].
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every rank's recv_bar is set
  constexpr int kD4 = D / 4;
  const uint32_t acc_s = smem_addr(&recv_acc[rank][0][0]), ml_s = smem_addr(&recv_ml[rank][0]);
  const uint32_t bar_s = smem_addr(&recv_bar);
#pragma unroll
  for (int it = 0; it < (G * kD4 + kAttnThreads - 1) / kAttnThreads; ++it) {
    const int idx = tid + it * kAttnThreads;
    if (idx >= G * kD4) break;
    const int g = idx / kD4, d = idx % kD4 * 4;
    // A finite floor: a CTA without pages (all m = -inf) then weighs its warps 2^-inf = 0
    // and passes on m = -1e30, l = 0, acc = 0, which the cluster merge weighs 0 in turn.
    float mx = -1e30f;
#pragma unroll
    for (int w = 0; w < kAttnConsumers; ++w) mx = fmaxf(mx, scr_m[w * G + g]);
    float lsum = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kAttnConsumers; ++w) {
      const float cw = fast_exp2(scr_m[w * G + g] - mx);
      const float4 v = *reinterpret_cast<const float4*>(scr_o + (w * G + g) * kAttnScrRow + d);
      lsum = fmaf(scr_l[w * G + g], cw, lsum);
      a = make_float4(fmaf(v.x, cw, a.x), fmaf(v.y, cw, a.y), fmaf(v.z, cw, a.z),
                      fmaf(v.w, cw, a.w));
    }
    const int k = d / kAttnCols;
    attn::st_async(attn::map_rank(acc_s + (g * kAttnCols + d % kAttnCols) * 4, k), a,
                   attn::map_rank(bar_s, k));
    if (d == 0) {
#pragma unroll
      for (int j = 0; j < kAttnCluster; ++j)
        attn::st_async(attn::map_rank(ml_s + g * 8, j), make_float2(mx, lsum),
                       attn::map_rank(bar_s, j));
    }
  }

  // ---- cluster merge: rank k merges columns [k, k + 1) * kAttnCols of every query head from the
  // cluster's partial slices it received. With one cluster it writes `out`; else the cluster's
  // partial (slot cl), and the last CTA of the kv head to finish merges below.
  mbar_wait(bar_s, 0);
  // Every push to this CTA has landed. A relaxed cluster arrive now and its wait before
  // leaving: no rank exits while a push it made may still be in flight (the CUDA guide asks
  // distributed shared memory operations to finish before a block exits); it costs nothing
  // measurable.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  for (int idx = tid; idx < G * kAttnCols; idx += kAttnThreads) {
    const int g = idx / kAttnCols, d = rank * kAttnCols + idx % kAttnCols;
    const int hq = b * kHeads + kvh * G + g;
    float mx = recv_ml[0][g].x;
#pragma unroll
    for (int k = 1; k < kAttnCluster; ++k) mx = fmaxf(mx, recv_ml[k][g].x);
    float lsum = 0.f, a = 0.f;
#pragma unroll
    for (int k = 0; k < kAttnCluster; ++k) {
      const float w = fast_exp2(recv_ml[k][g].x - mx);
      lsum = fmaf(recv_ml[k][g].y, w, lsum);
      a = fmaf(recv_acc[k][g][idx % kAttnCols], w, a);
    }
    if (ncl == 1) {
      out[hq * D + d] = __float2half_rn(a / lsum);
    } else {
      part_acc[((size_t)hq * kAttnSplits + cl) * D + d] = a;
      if (d == 0)
        *reinterpret_cast<float2*>(part_ml + (hq * kAttnSplits + cl) * 2) =
            make_float2(mx, lsum);
    }
  }
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  if (ncl == 1) return;  // uniform over the cluster

  // ---- semaphore over the kv head's CTAs: the last of the ncl x kAttnCluster to publish its
  // slice merges the ncl cluster partials; its acquire (and the barrier after it) orders the
  // other CTAs' slices before its loads.
  __syncthreads();  // this CTA's slice before its release
  if (tid == 0)
    sm_last = atom_add_acq_rel(&counters[b * kKVHeads + kvh], 1) == ncl * kAttnCluster - 1;
  __syncthreads();
  if (!sm_last) return;  // uniform
  // out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s: per output element,
  // online over batches of kAttnMergeLoads splits (the m, l and acc loads of a batch in flight
  // together).
  for (int idx = tid; idx < G * kD4; idx += kAttnThreads) {
    const int g = idx / kD4, d4 = idx % kD4, hq = b * kHeads + kvh * G + g;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + hq * kAttnSplits;
    const float4* src = reinterpret_cast<const float4*>(part_acc) +
                        (size_t)hq * kAttnSplits * kD4 + d4;
    float mx = neg_inf(), lsum = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < ncl; s += kAttnMergeLoads) {
      float2 m[kAttnMergeLoads];
      float4 v[kAttnMergeLoads];
#pragma unroll
      for (int u = 0; u < kAttnMergeLoads; ++u) {
        const bool in = s + u < ncl;
        m[u] = in ? __ldcg(ml + s + u) : make_float2(neg_inf(), 0.f);
        v[u] = in ? __ldcg(src + (size_t)(s + u) * kD4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float bm = mx;  // finite from the first batch on: every cluster has a token
#pragma unroll
      for (int u = 0; u < kAttnMergeLoads; ++u) bm = fmaxf(bm, m[u].x);
      const float r = fast_exp2(mx - bm);  // 0 on the first batch (mx = -inf)
      lsum *= r;
      a = make_float4(a.x * r, a.y * r, a.z * r, a.w * r);
#pragma unroll
      for (int u = 0; u < kAttnMergeLoads; ++u) {
        const float w = fast_exp2(m[u].x - bm);
        lsum = fmaf(m[u].y, w, lsum);
        a = make_float4(fmaf(w, v[u].x, a.x), fmaf(w, v[u].y, a.y), fmaf(w, v[u].z, a.z),
                        fmaf(w, v[u].w, a.w));
      }
      mx = bm;
    }
    const float inv = 1.f / lsum;
    half2* dst = reinterpret_cast<half2*>(out + hq * D + 4 * d4);
    dst[0] = __floats2half2_rn(a.x * inv, a.y * inv);
    dst[1] = __floats2half2_rn(a.z * inv, a.w * inv);
  }
  // every CTA of this launch has counted: re-arm for replay
  if (tid == 0) counters[b * kKVHeads + kvh] = 0;
}
