// speculate.cu: prompt-lookup speculation on the device, the two ends of a speculative decode
// step (nanoqwen/speculative.py states the rules token for token; these kernels mirror them).
//
// draft_ngram    the step's input rows: the fed token h[len - 1] and up to K drafts found by
//                an n-gram lookup in the history h, their positions, and the draft count d
// accept_greedy  after the verify forward: keep the drafts that agree with the rows' argmax
//                and the model's next token, cut at an eos id and at max_new, append them to
//                h and the host ring, advance the decode state, set the while-loop condition
// sample_rows    (sampled generations) each row's acceptance test of its draft against the
//                row's sampling distribution p, and the token the step ends on if it stops
//                at that row: a draw from p without the draft (rejected), or from p (row d)
// accept_sampled the tokens sample_rows' picks give, then accept_greedy's tail (emit_step)
//
// The history. h int32 [capacity] holds the prompt and every generated token, h[0 .. len - 1],
// with len = state[kPos] + 1: the token the step feeds (state[kToken]) sits at position POS,
// and every position before it is in h. accept_greedy appends each step's tokens at h[len ..];
// the first generated token (the prefill's sample) must land at h[prompt_len], which it does
// when sample_finish's device ring is h + prompt_len (its ring[step] = h[prompt_len + step]).
//
// The draft limit (speculative.step_limit): limit = min(K, max_new - step - 1,
// capacity - len - 1). The step emits at most d + 1 tokens, so d <= max_new - step - 1 keeps it
// within max_tokens and d <= capacity - len - 1 keeps h[len + d] (and the KV slots of positions
// POS .. POS + d) inside the capacity. limit <= 0: no drafts.
//
// The backoff (speculative.Backoff), in two state words: draft_ngram drops the drafts it found
// while SPEC_SKIP > 0 (one skip used a drop, counted in stats[3]), so the loop body takes the
// decode step; the accept kernels (emit_step) update SPEC_FAILS and SPEC_SKIP from the step's d
// and accepted count: a failure (d > 0, none accepted) counts, and past backoff_grace failures
// in a row sets skip = min(backoff_cap, 2^(fails - grace - 1)); any acceptance clears both;
// d = 0 leaves them.
#include "common.cuh"
#include "sampler.cuh"
// From cuda_device_runtime_api.h (declared here: that header drags in host-only internals
// under NVRTC). Sets a graph conditional node's value from device code.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

// From the generated header (nanoqwen/cuda/registry.py): kDraftThreads (draft_ngram's block),
// kDraftLoads (its 16-byte history loads in flight a thread), kVerifyRows (the verify step's
// most rows, 1 + K), kSampleThreads (sample_rows' block: sampler.cuh), enum StateWord,
// kMaxEos, kBackoffMaxFails (SPEC_FAILS saturates there) and kBackoffMaxShift (the largest
// skip is 2^it).
constexpr int kHistVec = 4;  // history words a 16-byte load brings
static_assert(kDraftThreads % kWarp == 0 && kDraftThreads <= 1024, "whole warps, one CTA");
static_assert(kVerifyRows <= kWarp, "accept_greedy, accept_sampled: a lane a row");

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// The draft of the step after h[0 .. len - 1] (speculative.draft, one CTA).
//
// One pass finds every size at once. For each i in [0, len - 2] (the last index of a window
// that a token follows) L(i) = the longest l <= min(n_max, i + 1) with h[i - t] == h[len - 1 - t]
// for t < l: a match of size n at j = i + 1 - n exists iff L(i) >= n. Each candidate i becomes
// the packed key (n << 32) | (min(limit, len - e) * len + j), n = L(i) (skipped below n_min),
// e = i + 1 = j + n the first draft index; a block-wide max of it picks the largest size with a
// match (the first size the rule tries) and, among that size's matches, the maximum of
// speculative.draft's min(limit, len - j - n) * len + j. A thread's own best has the largest n
// of its candidates, so every candidate of the winning size reaches the reduction. The key's
// low word is below 2^32 while len < 2^27 (the launcher checks the capacity).
//
// Why one pass is fast: the history is read once, as 16-byte vectors in order, kDraftLoads of
// them a thread in flight before the compares consume them (32k tokens: 128 KB, 8 loads a
// thread at 1024 threads, two rounds of memory latency); only a candidate whose last token
// equals h[len - 1] reads further (cached lines; rare on varied text, every position on a run,
// the slow case dev/speculate_check.py times). Then one warp shuffle max, one shared-memory max
// over the warps.
//
// Arguments:
//   h        int32 [capacity]   the history (16-byte aligned; capacity a multiple of 4, so the
//                               last vector load of a window stays inside it)
//   state    int32 [kEos0 + kMaxEos]  StateWord words: reads POS (len = POS + 1), STEP, MAX_NEW;
//                               SPEC_SKIP read, and decremented when it drops found drafts
//   tokens   int32 [1 + K]      out: h[len - 1], the d drafts, then h[len - 1] again for rows
//                               d + 1 .. K (a verify step of fixed 1 + K rows feeds valid ids)
//   positions int32 [1 + K]     out: POS + r for every row r (padding rows included)
//   ndraft   int32 *            out: d, 0 .. limit (0 when the backoff dropped the drafts)
//   stats    int32 [4]          (may be null) stats[3] += 1 when the backoff dropped drafts
//   K        int 1 .. kVerifyRows - 1; n_min, n_max int, 1 <= n_min <= n_max; capacity int
//   long_pages int              the fewest pages of the verify step's 1 + K rows,
//                               ceil((POS + 1 + K) / 16), that take attention_rows' long form
//                               (VerifyKernels.long_pages)
//   branch   graph conditional handle (0 = none): set to the step's StepCase, so the engine's
//            loop body runs the decode step without drafts (kCaseDecode), else the verify
//            step over 1 + K rows with attention_rows' short form (kCaseVerify) or, from
//            long_pages pages on, its long form (kCaseVerifyLong)
// Grid 1, block kDraftThreads.
extern "C" __global__ void __launch_bounds__(kDraftThreads)
draft_ngram(const int* __restrict__ h, int* __restrict__ state, int* __restrict__ tokens,
            int* __restrict__ positions, int* __restrict__ ndraft, int* __restrict__ stats, int K,
            int n_min, int n_max, int capacity, int long_pages, unsigned long long branch) {
  __shared__ unsigned long long warp_best[kDraftThreads / kWarp];
  pdl_wait();
  const int pos = state[kPos], len = pos + 1, step = state[kStep];
  const int limit = min(K, min(state[kMaxNew] - step - 1, capacity - len - 1));
  const int last = h[len - 1];
  unsigned long long best = 0;
  if (limit > 0) {
    const int4* h4 = reinterpret_cast<const int4*>(h);
    const int chunks = (len - 1 + kHistVec - 1) / kHistVec;  // covering i = 0 .. len - 2
    for (int c0 = threadIdx.x; c0 < chunks; c0 += kDraftThreads * kDraftLoads) {
      int4 v[kDraftLoads];  // all issued before the first compare: one latency a round
#pragma unroll
      for (int u = 0; u < kDraftLoads; ++u) {
        const int c = c0 + u * kDraftThreads;
        v[u] = c < chunks ? __ldg(h4 + c) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kDraftLoads; ++u) {
        const int w[kHistVec] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int k = 0; k < kHistVec; ++k) {
          const int i = (c0 + u * kDraftThreads) * kHistVec + k;
          if (i > len - 2 || w[k] != last) continue;  // past the candidates, or no match
          int l = 1;
          while (l < n_max && l <= i && __ldg(h + i - l) == __ldg(h + len - 1 - l)) ++l;
          if (l < n_min) continue;
          const int e = i + 1;
          const unsigned long long key =
              (unsigned long long)min(limit, len - e) * len + (unsigned long long)(e - l);
          const unsigned long long packed = ((unsigned long long)l << 32) | key;
          best = packed > best ? packed : best;
        }
      }
    }
  }
  pdl_trigger();
  best = warp_max_u64(best);
  if (threadIdx.x % kWarp == 0) warp_best[threadIdx.x / kWarp] = best;
  __syncthreads();
  best = threadIdx.x < kDraftThreads / kWarp ? warp_best[threadIdx.x] : 0ull;
  if (threadIdx.x < kWarp) best = warp_max_u64(best);
  __shared__ int d_s, src_s;
  if (threadIdx.x == 0) {
    const unsigned key = (unsigned)(best & 0xFFFFFFFFull);  // 0 when nothing matched
    const int n = (int)(best >> 32);
    int d = n ? (int)(key / (unsigned)len) : 0;
    // Every thread read POS, STEP and MAX_NEW above, none reads SPEC_SKIP: thread 0 alone
    // writes the state here.
    if (d > 0 && state[kSpecSkip] > 0) {
      state[kSpecSkip] -= 1;
      if (stats) stats[3] += 1;
      d = 0;
    }
    d_s = d;
    src_s = n ? (int)(key % (unsigned)len) + n : 0;  // j + n: the first draft token
    *ndraft = d;
    if (branch) {
      const int pages = (len + K + kPageTokens - 1) / kPageTokens;  // rows POS .. POS + K
      const int c = d == 0 ? kCaseDecode : pages >= long_pages ? kCaseVerifyLong : kCaseVerify;
      cudaGraphSetConditional(branch, (unsigned)c);
    }
  }
  __syncthreads();
  if (threadIdx.x <= K) {
    const int r = threadIdx.x;
    tokens[r] = r >= 1 && r <= d_s ? h[src_s + r - 1] : last;
    positions[r] = pos + r;
  }
}

// The end of every speculative step, shared by accept_greedy and accept_sampled (one warp, lane
// t for the step's token t): the step emits token[0 .. agree] (lane t's `token`, valid for
// t <= agree), cut after the first eos id (state words kEos0..) and to max_new - step tokens;
// the state advanced as sample_finish advances it, several tokens at once, and the backoff
// words updated from d and agree (agree counts before the cuts, as SpecStats.accepted does).
// The host ring carries them one slot a token as sample_finish does: host_ring[step + t] =
// token t, then one count word host_ring[-1] = step + e after a system fence, so the host
// (HostRing, stream_tokens) sees a step's e tokens appear together and needs no other protocol.
// keys[0 .. K] are re-zeroed for the next step (lm_head_rows and lm_head take an atomic max into
// them).
__device__ __forceinline__ void emit_step(int token, int agree, int d, unsigned long long* keys,
                                          int* state, int* h, volatile int* host_ring,
                                          const volatile int* cancel, int* stats,
                                          unsigned long long cond, int K, int backoff_cap,
                                          int backoff_grace) {
  const int lane = threadIdx.x;
  const int step = state[kStep], pos = state[kPos];
  bool eos = false;
  for (int i = 0; i < state[kNumEos]; ++i) eos |= token == state[kEos0 + i];
  const unsigned stops = __ballot_sync(0xffffffffu, eos && lane <= agree);
  // At least one token, as sample_finish always writes one (the loop never runs a step with
  // max_new - step < 1: the previous step set DONE).
  const int e = max(1, min(stops ? __ffs(stops) : agree + 1, state[kMaxNew] - step));
  if (lane < e) {
    h[pos + 1 + lane] = token;
    if (host_ring) host_ring[step + lane] = token;
    __threadfence_system();  // this lane's token is visible to the host before the count
  }
  const int last = __shfl_sync(0xffffffffu, token, e - 1);
  __syncwarp();
  if (lane <= K) keys[lane] = 0ull;
  if (lane == 0) {
    const bool done = step + e >= state[kMaxNew] || stops != 0 || (cancel && *cancel);
    state[kToken] = last;
    state[kPos] = pos + e;
    state[kStep] = step + e;
    state[kDone] = done ? 1 : 0;
    if (d > 0) {  // the backoff (speculative.Backoff.update)
      const int fails = agree > 0 ? 0 : min(state[kSpecFails] + 1, kBackoffMaxFails);
      const int over = fails - backoff_grace;  // failures past the grace
      state[kSpecFails] = fails;
      state[kSpecSkip] = over > 0 ? min(backoff_cap, 1 << min(over - 1, kBackoffMaxShift)) : 0;
    }
    if (stats) {
      stats[0] += 1;
      stats[1] += d;
      stats[2] += agree;
    }
    if (host_ring) host_ring[-1] = step + e;  // word before the ring: tokens written so far
    if (cond) cudaGraphSetConditional(cond, done ? 0u : 1u);
  }
}

// The step's tokens from the verify rows' argmax (speculative.accept, greedy). One warp, lane r
// for row r. Row r's argmax id is target[r] (argmax_key_id of keys[r]: the lowest id on ties).
// Drafts agree while tokens[1 + r] == target[r]; with `agree` of them agreeing the step emits
// target[0 .. agree] (an agreeing draft is its row's target), then emit_step.
//
// Arguments:
//   keys      u64 [1 + K]     lm_head_rows' argmax key per row (re-zeroed here for the next
//                             step, as sample_finish re-zeroes its key)
//   tokens    int32 [1 + K]   draft_ngram's rows (tokens[1 .. d] the drafts)
//   ndraft    int32 *         d
//   state     int32 [kEos0 + kMaxEos]  StateWord words: TOKEN, POS, STEP, DONE advanced,
//                             SPEC_SKIP and SPEC_FAILS updated (the backoff)
//   h         int32 [capacity]  the history: h[POS + 1 + t] = token t
//   host_ring int32 [max_new]  mapped pinned host memory (may be null): the host streams it
//   cancel    int32 *         mapped pinned host flag (may be null): nonzero stops the loop
//   stats     int32 [4]       (may be null) stats[0 .. 2] += (1, d, agree): steps, drafted,
//                             accepted before the eos / max_new cut (speculative.SpecStats;
//                             stats[3], skipped, is draft_ngram's)
//   cond      graph conditional handle of the generation while-loop (0 = none): set to !done
//   K         int 1 .. kVerifyRows - 1
//   backoff_cap int >= 0     the backoff's largest skip (0: no backoff)
//   backoff_grace int >= 0   failures in a row it forgives before it skips
// Grid 1, block kWarp. Greedy generations (the engine runs accept_sampled for the others).
extern "C" __global__ void __launch_bounds__(kWarp)
accept_greedy(unsigned long long* keys, const int* __restrict__ tokens,
              const int* __restrict__ ndraft, int* state, int* h, volatile int* host_ring,
              const volatile int* cancel, int* stats, unsigned long long cond, int K,
              int backoff_cap, int backoff_grace) {
  pdl_wait();
  const int lane = threadIdx.x;
  const int d = *ndraft;
  const int target = lane <= K ? argmax_key_id(keys[lane]) : 0;
  const unsigned miss = __ballot_sync(0xffffffffu, lane < d && tokens[1 + lane] != target);
  const int agree = miss ? __ffs(miss) - 1 : d;
  emit_step(target, agree, d, keys, state, h, host_ring, cancel, stats, cond, K, backoff_cap,
            backoff_grace);
}

// Speculative sampling's per-row work (speculative.accept, sampled), one CTA a row r <= d,
// rows past d idle. p_r is row r's sampling distribution (sampler.cuh's kept set: temperature,
// top-k, top-p as sample_finish applies them), u_a and u_d two uniforms (sampler.cuh's
// counters: the draft at row r is proposed as generated token STEP + r, so u_a =
// uniform01(seed, kAcceptCounter + STEP + r) and u_d = uniform01(seed, STEP + r)):
//
//   r < d   the draft x = tokens[1 + r] is accepted when u_a < p_r(x): picks[r] = -1; else
//           picks[r] = a draw with u_d from p_r without x, renormalised ((p - q)+ for the
//           point-mass draft q), the token the step ends on if row r is the first rejection
//   r = d   picks[d] = a draw with u_d from p_d: the token after d accepted drafts
//
// Every row decides alone (its test needs no other row's outcome), so the rows run in
// parallel and accept_sampled takes the first pick >= 0. A step without drafts (d = 0, the
// decode step's logits) draws exactly as sample_finish: the same kept set, the same counter.
// A consumed uniform's counter is never consumed again: a step that emits e tokens consults
// counters STEP .. STEP + e - 1 (tests and one draw), and the next step starts at STEP + e.
//
// Arguments:
//   logits    fp32 [1 + K, V]  the verify step's logits (lm_head_rows), row r at r * V
//   logits0   fp32 [V]         the decode step's logits: row 0 when d = 0 (the no-draft
//                              branch ran the decode step, not the verify step)
//   keys      u64 [1 + K]      each row's argmax key (its largest logit: the kept set's m)
//   tokens    int32 [1 + K]    draft_ngram's rows (tokens[1 .. d] the drafts)
//   ndraft    int32 *          d
//   state     int32 [kEos0 + kMaxEos]  reads STEP, TEMP, TOP_K, TOP_P, SEED_LO, SEED_HI
//   picks     int32 [1 + K]    out, rows 0 .. d: -1 (draft accepted) or the row's token
//   V         int              vocabulary size
// Grid 1 + K, block kSampleThreads. Sampled generations only (temperature > 0, top_k != 1).
extern "C" __global__ void __launch_bounds__(kSampleThreads)
sample_rows(const float* __restrict__ logits, const float* __restrict__ logits0,
            const unsigned long long* __restrict__ keys, const int* __restrict__ tokens,
            const int* __restrict__ ndraft, const int* __restrict__ state,
            int* __restrict__ picks, int V) {
  __shared__ float part[kSampleThreads];
  pdl_wait();
  pdl_trigger();
  const int r = blockIdx.x, d = *ndraft;
  if (r > d) return;  // the whole CTA: no barrier below is split
  const float* row = d == 0 ? logits0 : logits + (size_t)r * V;
  const unsigned long long key = keys[r];
  const int draft = r < d ? tokens[1 + r] : -1;
  const KeptSet s = kept_set(row, V, argmax_key_value(key), __int_as_float(state[kTemp]),
                             state[kTopK], __int_as_float(state[kTopP]));
  kept_parts(row, V, s, draft, part);  // without the draft: the residual's weights
  if (threadIdx.x == 0) {
    const unsigned long long seed =
        ((unsigned long long)(uint32_t)state[kSeedHi] << 32) | (uint32_t)state[kSeedLo];
    const unsigned long long t = (unsigned long long)(state[kStep] + r);  // the token index
    const float rest = parts_total(part);
    if (draft >= 0) {
      const float w = kept_weight(row[draft], s);
      if (uniform01(seed, kAcceptCounter + t) < w / (rest + w)) {
        picks[r] = -1;
        return;
      }
    }
    // A rejected draft has p < 1, so rest > 0; rest = 0 at row d (no kept weight) falls back
    // to the argmax, as sample_finish does.
    const int pick = draw_parts(row, V, s, draft, part, rest, uniform01(seed, t));
    picks[r] = pick >= 0 ? pick : argmax_key_id(key);
  }
}

// The step's tokens from sample_rows' picks (speculative.accept, sampled), then emit_step. One
// warp, lane r for row r: agree = the first row r <= d with picks[r] >= 0 (row d always has
// one), and the step emits tokens[1 .. agree] (the accepted drafts) and picks[agree].
//
// Arguments: accept_greedy's, and
//   picks     int32 [1 + K]   sample_rows' rows 0 .. d
// keys are only re-zeroed (sample_rows read them). Grid 1, block kWarp.
extern "C" __global__ void __launch_bounds__(kWarp)
accept_sampled(unsigned long long* keys, const int* __restrict__ tokens,
               const int* __restrict__ ndraft, const int* __restrict__ picks, int* state,
               int* h, volatile int* host_ring, const volatile int* cancel, int* stats,
               unsigned long long cond, int K, int backoff_cap, int backoff_grace) {
  pdl_wait();
  const int lane = threadIdx.x;
  const int d = *ndraft;
  const int pick = lane <= d ? picks[lane] : -1;
  const int agree = __ffs(__ballot_sync(0xffffffffu, pick >= 0)) - 1;
  const int last = __shfl_sync(0xffffffffu, pick, agree);
  const int token = lane < agree ? tokens[1 + lane] : last;
  emit_step(token, agree, d, keys, state, h, host_ring, cancel, stats, cond, K, backoff_cap,
            backoff_grace);
}
