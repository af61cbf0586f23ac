// gemv_int4.cu: batch-1 decode GEMV over INT4 ValueShuffle weights: whole weight rows stream
// into shared memory through a few large bulk copies, tensor cores take the dot products.
//
//   out = epilogue( dequant(W) @ norm(x) )      fp16 in/out, products exact, fp32 accumulation
//
// Why mma for a GEMV: a matrix-vector product is memory-bound, but a SIMT version spends
// ~2.8 instructions per weight and rounds products to fp16. Here the dequantized half2 pairs go
// straight into mma.sync.m16n8k16 as the A operand: fp32-exact products, fewer instructions.
//
// Pairs. The output rows are taken two at a time: pair p = (row a(p), row b(p)), where a and b
// each run over consecutive rows as p does (kResidual: p and p + ceil(N/2); kSwiGLU: gate row p
// and up row N + p; kRope: rows j and j + D/2 of a head, the RoPE partners). A CTA owns a
// contiguous range of pairs (the pairs split evenly over a persistent grid of two CTAs per SM:
// at most one pair of imbalance, no cross-CTA reduction) and streams them in stages of up to
// P consecutive pairs (stage_pairs): all K of rows a(p).. and of rows b(p).., two contiguous runs.
//
// One mma (a "diagonal" mapping): A rows 0..7 are row a at 8 consecutive groups 8o..8o+7 (one
// group per A row), A rows 8..15 row b at the same groups, and B column n holds x at group
// 8o + n. D[m][n] then dots group 8o + m of the weights with group 8o + n of x: only the
// diagonal D[m][m] (row a) and D[8+m][m] (row b) are wanted, and they sit in lane 4m + m/2 (c0
// or c1; c2 or c3). K order inside a group does not matter for a dot product, so thread t
// (lane % 4) takes the 16-byte chunk t of its group (32 nibbles) for A and x alike, and the
// fragment's k indices (2t, 2t+1, 2t+8, 2t+9) are mapped onto that chunk's pairs. One "item"
// (pair, octet o) is 8 mma over 2 x 8 groups; a group's scale multiplies its diagonal once.
//
// Pipeline: one producer warp issues, per stage, four 1-D cp.async.bulk copies (run a, run b,
// and their scales: the 16-byte units around them, so a stage row keeps its scales at an
// offset of 0..7 halves and a copy may read up to 14 bytes past the tensor's end, inside the
// slack every Gpu.alloc leaves) that land on the stage's "full" mbarrier. Few, large copies:
// the copy engine pays per copy (32 one-row copies per 16 KB stage ran at ~1.1 TB/s), and
// bulk copies take uniform operands, so per-lane copies issue one lane at a time. The ring
// holds as many stages as the launch's dynamic shared memory leaves room for (at most
// kGvMaxStages); the weights do not depend on the previous kernel, so the producer starts
// before anyone waits on it, but keeps only kGvEarlyStages stages in flight until x has
// landed (x queues behind every weight byte requested before it). The consumer warps wait
// (PDL) for x, stage it (RMSNorm-ed if NORM; folded for offset_word when K <= kGvFoldMaxK) in
// shared memory and keep their lanes' x chunks in registers (a warp takes the same octets of
// every pair), then take every stage: kGvConsumers / P warps per pair, each its own octets,
// and release it on "empty". The diagonal lanes store their fp32 sums per pair unreduced; the
// epilogue adds them in a fixed order (deterministic), with its global inputs (residual,
// bias, RoPE, K/V page) loaded right after the wait.
//
// Where a decode step's time went, and what changed for it (H200, 2026-11-30; a globaltimer
// stamp per CTA at each phase of two layers inside the captured 7B step at 513 tokens):
// 57.6 us a layer for ~27 us of weights at 4.5 TB/s. The consumers waited 4 us for x in
// gate/up (1.5 in q/k/v) with the ring requested ahead of it; each epilogue took 1-1.6 us
// (its thread-per-pair sum read 32-way bank conflicts, then an L2 round trip for the
// residual); the attention split-merge 3.7 us. Holding the ring back until x lands (1 stage
// in flight: 2 and 3 were slower, a whole ring 20-45 us a step slower), the conflict-free
// sums with early epilogue inputs and the leaner attention merge took the step (tools/
// kernel_tune.py step) from 1837 to 1609 us at 513 tokens and 1999 to 1805 at 8193; the
// offset form for K <= 8192 another ~15 us (1614 -> 1599 and 1809 -> 1798 against no fold;
// folding down's K = 18944 too, 1653: its x pass then costs more than its stages save).
// Tried in the same way, not kept: a work counter balancing the tail of gate/up and down
// (85% static, then units of one stage from an atomic counter): the last CTA of gate/up
// ended 1.5 us after the median one instead of 2.6, yet the launch took as long (19.91
// against 19.99 us) and the step no less (1683 against 1675 us); and 16 KB stages for
// q/k/v and o (32 KB for gate/up): 1879 against 1642 us. Later (step at 1.49-1.51 ms): o with
// its whole ring in flight before x (the others keeping one stage): o 4.49 -> 4.35 us, the
// step within its noise (1511 -> 1494 us at 513 tokens, 1657 both ways at 8193); a dry pass
// of the x staging, norm and fold before griddepcontrol.wait, so that its instructions are
// cached when x lands: that phase (x landed -> folded, 0.4 us for o, 1 us with the norm, by
// globaltimer stamps) did not shrink and the step took 50 us longer; and, as a bound, the
// norm and the fold skipped altogether (wrong sums): 5-15 us a step.
//
// Measured (H200, 2026-11-30, us per launch inside the 7B decode step at 513 tokens,
// nanoqwen bench --kernels): gate/up 18.8 (3.72 TB/s; 20.0 with one x item in registers,
// kGvXRegItems), down 11.6, q/k/v 5.4, o 4.5. Before
// the changes above, with the x swizzle against without (two runs interleaved): gate/up 22.8
// (23.4 unswizzled), down 13.85 (14.5), q/k/v 5.96 (6.2), o 4.84 (4.97); the whole step
// 1.841 / 1.846 ms against 1.853 / 1.856 (8193 tokens: 1.995 / 1.996 against 2.001 / 2.005):
// per launch the swizzle saved 1.6 us of a layer, the step kept ~10 us of the 45 (as every
// faster GEMV then: the waits for x above were the bound). The register-fed design before it
// (warps loading their own weights, two batches in flight): 28 / 15 / 6.4 / 4.0, whole step
// 2.12 ms against 2.03 when this one came. On the way: 16 one-row copies per stage (and a
// stream-K split over groups) 59 us for gate/up; the same fed by a warp of 16-byte cp.async
// 100 us (one producer warp cannot issue them fast enough); whole-row bulk copies 35 us, the
// consumers then bound by shared-memory traffic (ncu: stalls on the shared-memory loads, DRAM
// 30% busy; x was read per item, 2 KB of x for 1 KB of weights) until x moved into registers.
// Tried before the waits for x were cut (tools/kernel_tune.py step, both variants in one run):
//   - the offset form (offset_word): gate/up 23.4 -> 22.3 us and o 5.0 -> 4.8 alone, down
//     and q/k/v unchanged, the whole step unchanged (1.85 ms, +-3 us); kept now (above);
//   - cp.async.bulk.prefetch.L2 of the gate/up weights' first third (24 MB) from the q/k/v
//     launch: issued as its CTAs finish it has no effect at all (q/k/v's own time does not
//     move either: the prefetch seems dropped with the CTA); issued as they start, q/k/v takes
//     2 us longer and the whole step 20 us longer (1.98 -> 2.00 ms on that machine); and
//     each CTA's own next 2 / 4 / 8 stages as its producer starts, while the ring is held
//     back for x (HBM -> L2 only): the step 1615 -> 1672 / 1700 / 1773 us at 513 tokens;
//     later (step at 1438 us), a kernel of one warp a CTA on a graph branch beside attention
//     and o, loading the first 15% / 30% of every gate/up CTA's rows with the 256-byte L2
//     prefetch size (branch l2-prefetch): 1534 / 1562 us (8193 tokens: 1611 -> 1640 / 1668);
//   - one persistent launch per layer for o -> gate/up -> down -> the next q/k/v (a grid
//     barrier between the GEMVs, one CTA of 16 consumer warps + the producer per SM, one byte
//     ring across the GEMVs so the next GEMV's weights stream during the barrier; branch
//     gemv-chain-experiment): correct, but the step 1.99 ms against 1.83 in the same run. A
//     globaltimer timeline per CTA showed why: the producer keeps 170 KB a SM in flight and
//     the consumers still take 21.4 us over gate/up (13.2 us with the mma work removed), each
//     grid barrier 1.6-2.2 us (an L2 round trip is ~0.7 us under the weight streams), and the
//     offset fold changes nothing there either. Probes on the same machine (that branch's
//     experiments/): a bulk-copy ring streams 4.55 TB/s read (any stage of 7-56 KB, 1-4
//     copies, a ring >= 48 KB; 16-byte loads the same), and still 4.52 with 16 consumer warps
//     doing 2.3x this kernel's mma per byte (HMMA.16816.F32: 6.7 cycles an SM sub-partition,
//     28.6 latency). So neither the copies nor the tensor pipe bound a GEMV: the consumers'
//     instruction stream does (ncu on the chain: 1.7 IPC an SM, 4.2 warps a scheduler with
//     0.9 eligible; stalls: barrier 24%, wait 15%, not selected 12%, math throttle 10%).
//   - the same chain again with this kernel's CTAs (two an SM of 8 consumer warps + the
//     producer, 264 CTAs; one byte ring across o, gate/up, down and the next q/k/v, grid
//     barriers between; branch decode-chain): correct, still slower (H200, tools/kernel_tune.py
//     step, 513 tokens): 48.7 us a layer against 39.1 for the four launches, step 1696 against
//     1435 us (8193: 1878 against 1610). With the barriers made no-ops (timing only) 45.0 us,
//     still above the launches' 39.1 (its ring is 64 KB a CTA, down's x taking 37 KB of the
//     rest; 48 bytes of spills at 96 registers). What each op costs inside the step (its
//     launches skipped, experiments/ablate.py there): o 4.74 us a layer, q/k/v 5.45,
//     attention 2.89, gate/up 18.13, down 10.48, each its whole per-launch time.
//   - releasing the held-back ring once x is requested rather than landed: o 4.37 -> 4.27 us,
//     down 10.97 -> 11.0..11.3, the step 1448 -> 1452..1460 us at 513 tokens (1622 -> 1630 at
//     8193); one CTA an SM for o, q/k/v or down alone (the other slot free for the next
//     kernel's first CTA): o 4.38 -> 4.15 us a launch, every such step 6-60 us slower.
//   - two CTAs an SM as now, with less shared memory for o (44 KB: its 3-4 stages of a CTA's
//     work still fit) and q/k/v (52 KB), so that the next kernel's first CTA fits beside them
//     (gate/up's beside o's, attention's beside q/k/v's; registers allow it): the step within
//     its noise at 513 / 8193 / 32705 tokens (1444-1465 / 1626-1636 / 1957-1979 us, shipped
//     1453-1457 / 1627-1632 / 1974-1978, interleaved in one run), q/k/v 5.4 -> 6.5 us a launch.
//   - gate/up and down in one launch (branch mlp-fused, experiments/mlp_variants): each CTA
//     keeps its 72 SwiGLU outputs in shared memory, its ring streams on into down_proj's
//     columns for those features (a tile layout made at upload) and the 3584-row partials go
//     split-K into an fp32 row with float4 atomics, which the next q/k/v adds to the residual.
//     Correct (validate unit 2.5e-4, layer 2.3e-3) but 34.7 us a launch against 18.5 + 11.3
//     for the two, the step 1617 against 1460 us at 513 tokens (H200, tools/kernel_tune.py
//     step, 2026-11-30). Probes of the same kernel: 19.0 us without the down phase, 24.5 with
//     down streamed but not multiplied, 27.4 with its mma and no atomics (the step then 1420
//     us): the reduction of 264 x 3584 partials costs ~7 us in every form tried (float4 red
//     per pass, float4s spread 8 or 32 floats apart, cp.reduce.async.bulk; clusters of 2 / 4
//     pushing scalar st.async to the rank that reduces 47.9 / 68.1 us), more than the launch
//     boundary it removes.
// Why no layout of the launches gets far below ~3 us a kernel + its bytes at ~4.5 TB/s (gate/up
// 18.4 us, down 11.1, q/k/v 5.4, o 4.4 at 513 tokens): a dependency itself is cheap, but not
// free, and a grid barrier is dearer than a launch. tools/decode_probes.py (H200, 2026-11-30),
// chains of 112 dependent links of 264 CTAs that stage x and write a slice of the next x, us a
// link: PDL launch + griddepcontrol.wait 1.42 (0.96 with no x, 2.13 with down's 37 KB x); the
// same rounds in one persistent launch with a grid barrier between them 1.64 (1.17, 2.41);
// stream order without PDL 1.85. Then x queues behind the weights in flight (kGvEarlyStages),
// and the ring held back for it restarts the stream one HBM latency late.
//
// Epilogues:
//   kRope     (q/k/v projection) + bias, then RoPE on q and k (the pair is (x1, x2) of one
//             rotation) and the K/V write into the paged cache: the decode step's whole
//             attention prologue.
//   kResidual (o_proj, down_proj)  out[n] += dot (in place: the residual stream)
//   kSwiGLU   (fused gate/up)      out[n] = silu(dot_gate) * dot_up
#include "common.cuh"
#include "kv_cache.cuh"

constexpr int kGvConsumers = 8;  // consumer warps; one producer warp more
constexpr int kGvThreads = (kGvConsumers + 1) * kWarp;
constexpr int kGvCtasPerSm = 2;  // = GEMV_CTAS_PER_SM: 2 x 9 warps leave 96 registers a thread
// Weight bytes per stage to aim for (gate/up: twice). Whole-row stages of 7B's K = 3584 on the
// H200 (us per launch, tools/kernel_tune.py step): q/k/v 6.2 at 8 KB, 7.0 at 16 KB; o 5.0, 5.4;
// gate/up 26.7 at 8 KB, 23.2 at 16 KB, 23.8 at 32 KB (small launches want the first stage
// early, the long one fewer, larger copies). Again with the ring held back for x (2026-11-30,
// step 1435-1446 us at 513 tokens): 16 KB for q/k/v and o took o 4.38 -> 4.02 us and q/k/v
// 5.40 -> 5.65, the step within its noise (1444 / 1623 us at 513 / 8193 tokens); for o alone
// (7B ladder 43/43) o 4.39 -> 3.99 us a launch, yet the step 1454 -> 1451 / 1452 us at 513
// tokens and 1628 -> 1633 / 1632 at 8193 (bench --kernels times o after o; in the step it
// follows attention).
constexpr int kGvStageTarget = 8192;
constexpr int kGvMaxStages = 8;
// Stages the producer keeps in flight until x has landed in shared memory: x (an L2 hit) queues
// behind every weight byte already requested, so a full ring ahead of it delays the consumers'
// start. Landed stages do not count: a ring filled during a long wait costs x nothing.
// Measured apart (tools/decode_probes.py, H200, 2026-11-30; 264 CTAs staging a 7 KB x right
// after griddepcontrol.wait): x lands 448 ns after the wait with nothing in flight, 800 / 1216
// / 1792 ns behind 16 / 32 / 48 KB of bulk copies a CTA requested just before it, and as late
// in the CTAs that requested none while every other CTA asked for twice as much (1184 against
// 1248 ns at 32 KB): the queue is the memory system's, so weights requested anywhere (another
// CTA's ring, an L2 prefetch) delay every x. None before x (0) is worse still: gate/up 18.3 ->
// 21.0 us a launch, down 11.0 -> 12.4, the step 1448 -> 1553 us at 513 tokens and 1625 -> 1715
// at 8193 (tools/kernel_tune.py step, two rounds interleaved, same run).
constexpr int kGvEarlyStages = 1;
constexpr int kGroupBytes = kGroupSize / 2;
// offset_word's form (x folded) for K up to this; above it dequant_word (see offset_word).
constexpr int kGvFoldMaxK = 8192;
constexpr bool gv_fold(int K) { return K <= kGvFoldMaxK; }
// Items whose x a consumer lane keeps in registers (16 registers each); later items read it
// from shared memory (gate/up has 2 items a warp, down 3, q/k/v and o 1). Whole 7B step on the
// H200 at 513 / 8193 tokens (tools/kernel_tune.py step, one run, 2026-11-30), items taken one
// at a time (warp_items): 2 -> 1497 / 1649 us (gate/up 18.29 us a launch, down 11.21); 1 ->
// 1555 / 1697 (20.65, 11.40); 3 -> 1544 / 1673 (down 11.88). Two at a time with 1: 1540 /
// 1676 (gate/up 20.15); with 2 gate/up spilled at the 96-register cap.
constexpr int kGvXRegItems = 2;

enum TcEpilogue { kRope = 0, kResidual = 1, kSwiGLU = 2 };

__device__ __forceinline__ uint32_t h2u(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// x in shared memory, 16-byte units swizzled within each group: chunk c (0..15) of group grp
// sits at unit grp * 16 + (c ^ 2 bit3(c) ^ (grp & 1)). A quarter warp's lanes (g = 2h, 2h + 1;
// t4 = 0..3) load chunk 4 t4 + q of groups 8o + g: 8 distinct bank quads. Unswizzled they
// were 4-way conflicts (ncu: 16 wavefronts a load of the x register fill instead of 4, the
// loads of the items past KR likewise).
__device__ __forceinline__ int x_unit(int grp, int c) {
  static_assert(kGroupSize / 8 == 16, "16 chunks of 16 bytes per group");
  return grp * 16 + (c ^ (((c >> 3) & 1) << 1) ^ (grp & 1));
}

// What a pair's epilogue reads from global memory, loaded before the stage loop (under the
// weight stream an L2 round trip takes ~1 us; after the last stage it would add that to the
// launch). kResidual: the residual rows a, b; kRope: the biases, (cos, sin), the K/V page and
// the token's slot in it.
struct EpiIn {
  float a, b;
  float2 cs;
  int page, t;
};

// A ValueShuffle word as the mma's A operand without the dequantization's subtractions: pairs 0
// and 2 (mask 0x000F000F and XOR 0x0008 under exponent 0x6400: common.cuh's dequant_word) are
// the halves 1032 + v, pairs 1 and 3 (taken in place, 16 x larger) 1152 + 16 v. Their x halves
// are stored divided by 16 (fold_x), so a group's dot product comes out as
// sum(v x) + 1032 sum(x of pairs 0, 2) + 1152 sum(x / 16 of pairs 1, 3); the second part, one
// number per group shared by every row, is subtracted once per group (xc). 5 instructions per
// word instead of 9. The products stay exact; the fp32 sums carry the offsets' magnitude
// (~100 x the dot product's), which costs ~7 of their 24 bits.
__device__ __forceinline__ void offset_word(uint32_t w, uint32_t (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t x = i ? w >> 8 : w;  // 0x6a = (a & b) ^ c
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(out[2 * i]) : "r"(x), "r"(0x000F000Fu),
        "r"(0x64086408u));
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(out[2 * i + 1]) : "r"(x), "r"(0x00F000F0u),
        "r"(0x64806480u));
  }
}
// One 16-byte x vector into offset_word's form: halves 2, 3 and 6, 7 (the B registers facing
// pairs 1 and 3) divided by 16 (exact unless subnormal); c = its share of the group's offsets.
__device__ __forceinline__ uint4 fold_x(uint4 xv, float& c) {
  half2* h = reinterpret_cast<half2*>(&xv);
  h[1] = __hmul2(h[1], __float2half2_rn(0.0625f));
  h[3] = __hmul2(h[3], __float2half2_rn(0.0625f));
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  const float2 e = __half22float2(h[2]), f = __half22float2(h[3]);
  c = 1032.f * (a.x + a.y + e.x + e.y) + 1152.f * (b.x + b.y + f.x + f.y);
  return xv;
}

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kGvConsumers * kWarp) : "memory");
}

// Pairs per stage: a power of two dividing kGvConsumers, about `target` bytes of weights.
template <int K>
constexpr int stage_pairs(int target) {
  int p = 1;
  while (p < kGvConsumers && 2 * p * K <= target) p *= 2;
  return p;
}

// The dot product of item KS (octet o) of one pair, scaled and summed into accA (row a) / accB
// (row b) in the diagonal lanes. wa/wb: the pair's rows in the stage; sa/sb: their scales; xr:
// this lane's x chunk of the group of the warp's first KR items (registers: a warp takes the
// same octets of every pair), later items read xs4; xc: the groups' offset terms (offset_word,
// K <= kGvFoldMaxK). 8 mma in two independent chains.
template <int KS, int G, int KR>
__device__ __forceinline__ void pair_item(const unsigned char* wa, const unsigned char* wb,
                                          const half* sa, const half* sb,
                                          const uint4 (&xr)[KR][4], const uint4* xs4,
                                          const float* xc, int o, int g, int t4, float& accA,
                                          float& accB) {
  const int grp = min(8 * o + g, G - 1);  // past the row's end: any group, unused
  const uint4 a = *reinterpret_cast<const uint4*>(wa + grp * kGroupBytes + t4 * 16);
  const uint4 b = *reinterpret_cast<const uint4*>(wb + grp * kGroupBytes + t4 * 16);
  float d[2][4] = {};
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word q of the chunk: elements 8q..8q+7
    const uint4 xv = KS < KR ? xr[min(KS, KR - 1)][q] : xs4[x_unit(grp, t4 * 4 + q)];
    uint32_t pa[4], pb[4];
    if constexpr (gv_fold(G * kGroupSize)) {
      offset_word((&a.x)[q], pa);
      offset_word((&b.x)[q], pb);
    } else {
      half2 ha[4], hb[4];
      dequant_word((&a.x)[q], ha);
      dequant_word((&b.x)[q], hb);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[i] = h2u(ha[i]);
        pb[i] = h2u(hb[i]);
      }
    }
    // pairs 0, 1 (k 2t.., 2t+8..) -> chain 0; pairs 2, 3 -> chain 1
    const uint32_t a0[4] = {pa[0], pb[0], pa[1], pb[1]};
    const uint32_t a1[4] = {pa[2], pb[2], pa[3], pb[3]};
    mma_16816(d[0], a0, xv.x, xv.y);
    mma_16816(d[1], a1, xv.z, xv.w);
  }
  if (t4 == g / 2 && 8 * o + g < G) {  // the diagonal lane of group 8o + g: c0 / c2 (g even),
    const bool odd = g & 1;            // c1 / c3 (odd)
    const float c = gv_fold(G * kGroupSize) ? xc[grp] : 0.f;
    const float va = (odd ? d[0][1] + d[1][1] : d[0][0] + d[1][0]) - c;
    const float vb = (odd ? d[0][3] + d[1][3] : d[0][2] + d[1][2]) - c;
    accA = fmaf(__half2float(sa[grp]), va, accA);
    accB = fmaf(__half2float(sb[grp]), vb, accB);
  }
}

// Items KS.. of the warp, one at a time: its octets o0 + k * dO for k < KR (x in registers),
// then o0r + k * dO (x from shared memory). One at a time leaves the registers for KR = 2
// (two at a time, the items' chains interleaved, gate/up then spilled at KR = 2). o0r rotates
// with the stage, so when the octets do not divide evenly over the warps (down: 19 over 8)
// every warp takes its share of the extra ones: the warps run up to a ring's length apart
// (down 14.9 -> 14.6 us per launch; the inter-token latency unchanged at 2.07 ms).
template <int KS, int G, int KX, int KR>
__device__ __forceinline__ void warp_items(const unsigned char* wa, const unsigned char* wb,
                                           const half* sa, const half* sb,
                                           const uint4 (&xr)[KR][4], const uint4* xs4,
                                           const float* xc, int o0, int o0r, int dO, int g,
                                           int t4, float& accA, float& accB) {
  if constexpr (KS < KX) {
    constexpr int O = (G + 7) / 8;
    const int o = (KS < KR ? o0 : o0r) + KS * dO;
    if (o < O) pair_item<KS, G, KR>(wa, wb, sa, sb, xr, xs4, xc, o, g, t4, accA, accB);
    warp_items<KS + 1, G, KX, KR>(wa, wb, sa, sb, xr, xs4, xc, o0, o0r, dO, g, t4, accA, accB);
  }
}

// x        fp16   [K]            activations (one token), 16-byte aligned
// norm_w   fp16   [K]            RMSNorm weight (NORM only; else ignored)
// qweight  uint32 [R, K/8]       ValueShuffle words, row-major; R = N (kSwiGLU: 2N, [gate; up])
// scales   fp16   [R, K/128]
// bias     fp16   [N]            kRope only (q | k | v biases)
// out      fp16   [N]            kResidual: read and written in place (the residual stream);
//                                kRope: q fp16 [kHeads, kHeadDim] (rotated; only kQSize used)
// N        int                   output features (kRope: kQKVSize)
// kRope only: pos int32* (the token's position; device memory), rope float2 [max_pos,
//   kHeadDim/2] (cos, sin), pages int32 [max_pages], kc/vc this layer's caches
//   (kv_cache.cuh). Other epilogues ignore them (pass 0).
// Grid: at most one CTA per pair (ceil(N/2) pairs; kSwiGLU: N). Dynamic shared memory: the
// ring, x (K halves) and the per-pair sums; at least two stages must fit.
template <int K, bool NORM, int EPI>
__global__ void __launch_bounds__(kGvThreads, kGvCtasPerSm)
gemv_int4(const half* __restrict__ x, const half* __restrict__ norm_w,
          const unsigned char* __restrict__ qweight, const half* __restrict__ scales,
          const half* __restrict__ bias, half* out, int N, const int* pos,
          const float2* __restrict__ rope, const int* __restrict__ pages, half* kc, half* vc) {
  static_assert(K % kGroupSize == 0, "K must be a multiple of the INT4 group (128)");
  constexpr int G = K / kGroupSize;          // groups per row
  constexpr int O = (G + 7) / 8;             // octets per row
  constexpr int P = stage_pairs<K>(EPI == kSwiGLU ? 2 * kGvStageTarget : kGvStageTarget);
  constexpr int WP = kGvConsumers / P;       // warps per pair
  constexpr int kRunBytes = P * K / 2;       // one run of P rows
  constexpr int kScaleBytes = (P * G * 2 + 28 + 15) / 16 * 16;  // + 16-byte alignment
  constexpr int kStageBytes = (2 * kRunBytes + 2 * kScaleBytes + 127) / 128 * 128;
  static_assert(EPI != kRope || (kHeadDim / 2) % P == 0, "a stage must not straddle two heads");
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full_bar[kGvMaxStages], empty_bar[kGvMaxStages];
  __shared__ __align__(8) unsigned long long x_bar;  // x staged: the producer may fill the ring
  __shared__ float nred[kGvConsumers];

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int pairs = EPI == kSwiGLU ? N : (N + 1) / 2;
  const int half_n = (N + 1) / 2;  // kResidual: row b(p) = p + half_n
  const int p0 = (int)(blockIdx.x * (unsigned)pairs / gridDim.x);
  const int p1 = (int)((blockIdx.x + 1) * (unsigned)pairs / gridDim.x);
  const int npairs = p1 - p0;

  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  constexpr int kXcFloats = (G + 1) / 2 * 2;  // xc, padded for red's 8-byte alignment
  const int red_bytes = npairs * WP * 8 * 2 * 4;
  const int stages =
      min(kGvMaxStages, ((int)dyn - K * 2 - kXcFloats * 4 - red_bytes) / kStageBytes);
  if (stages < 2) __trap();  // a launch the host must not make
  half* xs = reinterpret_cast<half*>(smem + stages * kStageBytes);
  // The diagonal lanes' sums, [WP * 8][npairs] float2: the epilogue's thread per pair reads
  // consecutive pairs across a warp (pair-major it read 32-way bank conflicts, ~1 us a launch).
  float* xc = reinterpret_cast<float*>(xs + K);  // [G] the groups' offset terms (offset_word)
  float2* red = reinterpret_cast<float2*>(xc + kXcFloats);
  const uint32_t ring = smem_addr(smem);

  // Weight rows a(p), b(p); rows past the matrix (kResidual, odd N) are never copied.
  auto row_a = [&](int p) -> int {
    if (EPI == kRope) return p / (kHeadDim / 2) * kHeadDim + p % (kHeadDim / 2);
    return p;
  };
  auto row_b = [&](int p) -> int {
    if (EPI == kRope) return row_a(p) + kHeadDim / 2;
    return p + (EPI == kSwiGLU ? N : half_n);
  };
  // Pairs in the stage starting at pair p.
  auto stage_len = [&](int p) -> int {
    const int n = min(P, p1 - p);
    return EPI == kRope ? min(n, kHeadDim / 2 - p % (kHeadDim / 2)) : n;
  };
  auto epi_load = [&](int p) -> EpiIn {
    EpiIn e{};
    if (EPI == kResidual) {
      e.a = __half2float(out[p]);
      if (p + half_n < N) e.b = __half2float(out[p + half_n]);
    } else if (EPI == kRope) {
      const int ra = row_a(p), ps = *pos;
      e.a = __half2float(bias[ra]);
      e.b = __half2float(bias[row_b(p)]);
      if (ra < kQSize + kKVSize) e.cs = rope[(size_t)ps * (kHeadDim / 2) + ra % kHeadDim];
      if (ra >= kQSize) e.page = pages[ps / kPageTokens];
      e.t = ps % kPageTokens;
    }
    return e;
  };

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);  // the producer's arrive.expect_tx
      mbar_init(smem_addr(&empty_bar[s]), kGvConsumers);
    }
    mbar_init(smem_addr(&x_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_trigger();  // the whole grid is resident: the next kernel may launch (and wait)
  EpiIn epi_in{};  // consumers: the epilogue inputs of pair p0 + tid

  if (warp == kGvConsumers) {
    // ---- producer warp: weights and scales are constant, nothing to wait for. Lanes 0, 1
    // copy run a and run b, lanes 2, 3 their scales.
    int slot = 0, phase = 0;
    bool x_in = false;
    for (int p = p0, i = 0; p < p1; ++i) {
      const int np = stage_len(p);
      const int r0 = lane & 1 ? row_b(p) : row_a(p);
      const int rows = max(0, min(np, (EPI == kSwiGLU ? 2 * N : N) - r0));
      const uint32_t st = ring + slot * kStageBytes;
      const void* src = nullptr;
      uint32_t dst = 0, bytes = 0;
      if (lane < 2) {
        src = qweight + (size_t)r0 * (K / 2);
        dst = st + lane * kRunBytes;
        bytes = rows * (K / 2);
      } else if (lane < 4) {
        const size_t e0 = ((size_t)r0 * G) & ~(size_t)7;  // 16-byte units
        src = scales + e0;
        dst = st + 2 * kRunBytes + (lane - 2) * kScaleBytes;
        bytes = rows ? (uint32_t)((((size_t)(r0 + rows) * G + 7) & ~(size_t)7) - e0) * 2 : 0;
      }
      const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
      if (!x_in && i >= kGvEarlyStages) {  // until x is in: stage i - kGvEarlyStages landed
        const int j = i - kGvEarlyStages;     // (j < stages: nothing is consumed before x)
        const uint32_t jb = smem_addr(&full_bar[j % stages]), jp = (j / stages) & 1;
        while (!(x_in = mbar_test(smem_addr(&x_bar), 0)) && !mbar_test(jb, jp)) {
        }
      }
      if (i >= stages) mbar_wait(smem_addr(&empty_bar[slot]), phase ^ 1);
      const uint32_t full = smem_addr(&full_bar[slot]);
      if (lane == 0) mbar_arrive_expect_tx(full, total);
      __syncwarp();
      if (bytes) bulk_g2s(dst, src, bytes, full);
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
      p += np;
    }
  } else {
    // ---- consumer warps: x -> shared memory (x_unit order; RMSNorm-ed in place if NORM).
    constexpr int kXVecs = K / 8, kCThreads = kGvConsumers * kWarp;
    constexpr int kNV = (kXVecs + kCThreads - 1) / kCThreads;  // x vectors per thread
    uint4* xs4 = reinterpret_cast<uint4*>(xs);
    uint4 nw[kNV];  // NORM: this thread's norm weights, loaded before the wait (constant)
    if (NORM) {
#pragma unroll
      for (int u = 0; u < kNV; ++u)
        if (tid + u * kCThreads < kXVecs)
          nw[u] = reinterpret_cast<const uint4*>(norm_w)[tid + u * kCThreads];
    }
    pdl_wait();
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int v = tid; v < kXVecs; v += kCThreads)
      cp_async16(xs4 + x_unit(v / 16, v % 16), x4 + v);
    if (tid < npairs) epi_in = epi_load(p0 + tid);
    cp_async_wait_all();
    consumer_sync();
    if (tid == 0) mbar_arrive(smem_addr(&x_bar));
    float rstd = 1.f;
    if (NORM) {
      const float ss = warp_sum(sum_squares(xs4, kXVecs, tid, kCThreads));
      if (lane == 0) nred[warp] = ss;
      consumer_sync();
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kGvConsumers; ++w) total += nred[w];
      rstd = rsqrtf(total / K + kRmsEps);
    }
    // x into offset_word's form (RMSNorm-ed first if NORM) and each group's offset term: the
    // 16 vectors of a group sit in 16 consecutive lanes.
#pragma unroll
    for (int u = 0; u < kNV; ++u) {
      const int v = tid + u * kCThreads;
      if constexpr (gv_fold(K)) {
        float c = 0.f;
        if (v < kXVecs) {
          uint4& xv = xs4[x_unit(v / 16, v % 16)];
          xv = fold_x(NORM ? rmsnorm_vec(xv, nw[u], rstd) : xv, c);
        }
#pragma unroll
        for (int m = 1; m < 16; m *= 2) c += __shfl_xor_sync(0xffffffffu, c, m);
        if (v < kXVecs && v % 16 == 0) xc[v / 16] = c;
      } else if (NORM && v < kXVecs) {
        uint4& xv = xs4[x_unit(v / 16, v % 16)];
        xv = rmsnorm_vec(xv, nw[u], rstd);
      }
    }
    if constexpr (NORM || gv_fold(K)) consumer_sync();

    const int g = lane / 4, t4 = lane % 4;
    const int pp = warp / WP, o0 = warp % WP;  // this warp's pair in a stage, first octet
    // x of this lane's group in the warp's first KR octets o0, o0 + WP, ... (of KX at most):
    // 16 registers each; with two CTAs of 9 warps per SM a thread has 96.
    constexpr int KX = (O + WP - 1) / WP, KR = KX < kGvXRegItems ? KX : kGvXRegItems;
    uint4 xr[KR][4];
#pragma unroll
    for (int k = 0; k < KR; ++k) {
      const int grp = min(8 * (o0 + k * WP) + g, G - 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) xr[k][q] = xs4[x_unit(grp, t4 * 4 + q)];
    }
    int slot = 0, phase = 0;
    for (int p = p0; p < p1;) {
      const int np = stage_len(p);
      mbar_wait(smem_addr(&full_bar[slot]), phase);
      if (pp < np) {
        const unsigned char* st = smem + slot * kStageBytes;
        const half* sc = reinterpret_cast<const half*>(st + 2 * kRunBytes);
        const half* sa = sc + (((size_t)row_a(p) * G) & 7) + pp * G;
        const half* sb = sc + kScaleBytes / 2 + (((size_t)row_b(p) * G) & 7) + pp * G;
        const unsigned char* wa = st + pp * (K / 2);
        const unsigned char* wb = st + kRunBytes + pp * (K / 2);
        float accA = 0.f, accB = 0.f;
        warp_items<0, G, KX, KR>(wa, wb, sa, sb, xr, xs4, xc, o0, (o0 + p) % WP, WP, g, t4,
                                 accA, accB);
        if (t4 == g / 2)  // the diagonal lanes' sums, unreduced (no shuffles on the way)
          red[(o0 * 8 + g) * npairs + p + pp - p0] = make_float2(accA, accB);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty_bar[slot]));
      if (++slot == stages) {
        slot = 0;
        phase ^= 1;
      }
      p += np;
    }
  }
  __syncthreads();

  // ---- epilogue, one thread per pair: the warps' sums in a fixed order.
  for (int i = tid; i < npairs; i += kGvThreads) {
    const int p = p0 + i;
    // The consumer threads loaded their first pair's inputs before the stages.
    const EpiIn e = i == tid && warp < kGvConsumers ? epi_in : epi_load(p);
    float da = 0.f, db = 0.f;
#pragma unroll 8
    for (int j = 0; j < WP * 8; ++j) {
      const float2 v = red[j * npairs + i];
      da += v.x;
      db += v.y;
    }
    if (EPI == kRope) {
      const int ra = row_a(p), rb = row_b(p);
      half ha = __float2half_rn(da + e.a);
      half hb = __float2half_rn(db + e.b);
      if (ra < kQSize + kKVSize) {  // q and k heads: rotate (x1, x2) = (row j, row j + D/2)
        const float x1 = __half2float(ha), x2 = __half2float(hb);
        ha = __float2half_rn(x1 * e.cs.x - x2 * e.cs.y);
        hb = __float2half_rn(x2 * e.cs.x + x1 * e.cs.y);
      }
      if (ra < kQSize) {
        out[ra] = ha;
        out[rb] = hb;
      } else {  // k or v: rows ra, rb are dims d, d + D/2 of one kv head
        const bool is_k = ra < kQSize + kKVSize;
        const int f = ra - kQSize - (is_k ? 0 : kKVSize), kh = f / kHeadDim, d = f % kHeadDim;
        half* cache = is_k ? kc : vc;
        cache[kv_offset(e.page, kh, e.t, d)] = ha;
        cache[kv_offset(e.page, kh, e.t, d + kHeadDim / 2)] = hb;
      }
    } else if (EPI == kSwiGLU) {
      out[p] = __float2half_rn(da / (1.f + __expf(-da)) * db);
    } else {
      out[p] = __float2half_rn(e.a + da);
      if (p + half_n < N) out[p + half_n] = __float2half_rn(e.b + db);
    }
  }
}
