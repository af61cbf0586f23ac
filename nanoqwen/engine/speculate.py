"""Speculative decoding inside the one-graph generation loop, greedy and sampled
(nanoqwen.speculative has the rules; speculate.cu mirrors them on the device).

The device keeps the history h int32 [capacity]: the prompt ids staged into h[0 .. P - 1], the
prefill's first token written at h[P] (its sampler's device ring is h + P), every later token
appended by the step's accept kernel. The generation graph is one while loop whose body is

    draft_ngram     h, state -> tokens [1 + K], positions [1 + K], d; the step's case
                    (registry.StepCase; found drafts dropped while the backoff's SPEC_SKIP > 0:
                    d = 0)
    switch case     CASE_DECODE (d = 0): the decode step (M = 1, forward.py) with its argmax
                    key into keys[0]
                    CASE_VERIFY: the verify step over 1 + K rows at positions POS .. POS + K
                    (verify.py; rows past d are padding: the fed token again, one position
                    further each)
                    CASE_VERIFY_LONG: the same with attention_rows' long form, from
                    VerifyKernels.long_pages pages on (decode_attention_rows.cu, "Two forms")
    greedy:
    accept_greedy   keys, tokens, d -> h, host ring, TOKEN/POS/STEP/DONE, the backoff words
                    SPEC_SKIP/SPEC_FAILS, stats, keys zeroed, the while condition = !DONE
    sampled:
    sample_rows     logits (the verify step's, or the decode step's when d = 0), keys, tokens,
                    d, state -> picks [1 + K]: each row's acceptance test and draw
    accept_sampled  picks, tokens, d -> what accept_greedy writes

A generation's parameters pick one of two graphs, each captured at its first use: greedy
generations keep the argmax path (one warp after the step's forward), sampled ones run
speculative sampling (speculate.cu's sample_rows: the rule, and the random counters that make
a seeded generation reproducible and a step without drafts draw exactly as the plain loop's
sample_finish).

Why a conditional node and a fixed M = 1 + K. gemv_rows, attention_rows and lm_head_rows take
M as a launch argument (gemv_rows compiled in buckets of 8 and 16 rows, its grid checked per
M), so a captured verify step has one M; making them read M from a device word would change
three kernels for the sake of the no-draft step, which the decode step serves better. Every M
up to 8 reads the weights once in the same bucket, so verifying 1 + K rows when d < K costs
the padding rows' attention and logits mostly (7B, context 512: M = 2 1736 us, 4 1748, 8 1793,
16 2175 against the decode step's 1448, `dev/verify_step.py`, docs/PERFORMANCE.md); a switch
over d would capture the layers K times. The verify step costs 1.18-1.24x the decode step at
M <= 8 and 1.50x at 16 on that record, so a step without a draft (most steps on text that
does not repeat) must not pay it: the switch runs the decode step there, the tuned M = 1
path. That case ends on the same accept kernels with d = 0, which are the plain sampler
(greedy: row 0's argmax, lowest id on ties; sampled: sample_finish's draw) plus the history
append, so the same kernels advance the state in every case.

Positions. Each verify step writes K/V at POS .. POS + K for every row, padding included, so
the KV pool, the page table and the RoPE table cover `kv_positions` = max_context + K, and a
speculative generation reserves prompt + max_tokens + K positions. The draft cap
(speculative.step_limit) never binds on capacity: capacity >= max_context >= P + max_tokens
makes capacity - len - 1 >= max_new - step - 1.

Prefix cache. A position's K/V is right once the true token was fed at it from a true prefix:
every position of the history but the last (the accepted drafts were fed in their step, the
model's own token is fed by the next step, rejected and padding rows lie past the last
position and are overwritten before the history reaches them). That is the plain loop's rule:
commit the prompt and every generated token but the last.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..cuda.registry import Geometry, StateWord, StepCase
from ..cuda.speculate import SpeculateKernels
from ..speculative import SpecStats, SpeculativeConfig
from .verify import Verify, verify_plan

STATS_WORDS = 4  # the kernels' counters: steps, drafted, accepted (accept), skipped (draft)


def history_capacity(max_context: int) -> int:
    """Words of the history: max_context rounded up to draft_ngram's 16-byte loads."""
    return -(-max(max_context, 4) // 4) * 4


def kv_positions(max_context: int, spec: SpeculativeConfig | None) -> int:
    """Positions the KV pool, page table and RoPE table cover: K beyond max_context with
    speculation (the verify step's rows past the last token write there)."""
    return max_context + (spec.k if spec else 0)


def reserved_tokens(prompt_len: int, max_tokens: int, spec: SpeculativeConfig | None) -> int:
    """KV positions a generation reserves: prompt + max_tokens, + K when it speculates."""
    return prompt_len + max_tokens + (spec.k if spec else 0)


def spec_buffers(
    config: ModelConfig, max_context: int, spec: SpeculativeConfig, geometry: Geometry
) -> list[int]:
    """Bytes of SpecLoop's buffers: the history int32 [capacity], d int32, stats int32 [4],
    sample_rows' picks int32 [1 + K], then Verify's (verify.verify_plan: tokens, positions,
    logits, keys, ...)."""
    return [history_capacity(max_context) * 4, 4, STATS_WORDS * 4, (1 + spec.k) * 4,
            *verify_plan(config, 1 + spec.k, geometry)]  # fmt: skip


def stats_from_words(words: np.ndarray) -> SpecStats:
    return SpecStats(steps=int(words[0]), drafted=int(words[1]), accepted=int(words[2]),
                     skipped=int(words[3]))  # fmt: skip


class SpecLoop:
    """The speculative generation graph of one engine (module docstring)."""

    def __init__(self, engine, spec: SpeculativeConfig) -> None:
        e, gpu = engine, engine.gpu
        self.e, self.gpu, self.spec = e, gpu, spec
        self.capacity = history_capacity(e.max_context)
        self.kernels = SpeculateKernels(gpu, e.config, spec, self.capacity, e.kernels.geometry,
                                        pdl=False)  # fmt: skip
        self.verify = Verify(gpu, e.config, e.kernels, e.weights, e.kv, e.forward.rope, 1 + spec.k)
        self.h = gpu.alloc(self.capacity * 4, "speculation history").ptr
        self.ndraft = gpu.alloc(4, "speculation d").ptr
        self.stats = gpu.alloc(STATS_WORDS * 4, "speculation stats").ptr
        self.picks = gpu.alloc((1 + spec.k) * 4, "speculation picks").ptr
        self._graphs: dict[bool, object] = {}  # greedy -> its captured generation graph

    def begin(self, ids: np.ndarray) -> None:
        """Queue a generation's history (the prompt ids into h) and zeroed stats (no sync)."""
        self.e.loop.stage_ids(ids, self.h)
        self.gpu.memset(self.stats, 0, STATS_WORDS * 4)

    def first_ring(self, prompt_len: int) -> int:
        """The prefill sampler's device ring: h + P, so the first token lands at h[P]."""
        return self.h + 4 * prompt_len

    def body(self, s, cond, greedy: bool) -> None:
        """One loop iteration on builder `s` (cond: the while loop's condition), ending on
        accept_greedy (greedy) or on sample_rows + accept_sampled."""
        e, v, sk = self.e, self.verify, self.kernels
        loop, host, b = e.loop, e.loop.host, v.buf
        case = s.create_condition(default_value=int(StepCase.CASE_DECODE))
        sk.draft(self.h, loop.state, b["tokens"], b["pos"], self.ndraft, self.stats, case,
                 long_pages=v.verify.long_pages, stream=s)  # fmt: skip
        cases = s.switch(case, len(StepCase))
        for c in StepCase:
            cases[c].begin_building()
            if c == StepCase.CASE_DECODE:
                e.forward.decode_step(stream=cases[c], key=b["keys"])
            else:
                v.step(1 + self.spec.k, loop.word(StateWord.POS),
                       long=c == StepCase.CASE_VERIFY_LONG, stream=cases[c])  # fmt: skip
            cases[c].end_building()
        if greedy:
            sk.accept(b["keys"], b["tokens"], self.ndraft, loop.state, self.h, host.ring_ptr,
                      host.cancel_ptr, self.stats, cond, stream=s)  # fmt: skip
            return
        sk.sample_rows(b["logits"], e.forward.logits, b["keys"], b["tokens"], self.ndraft,
                       loop.state, self.picks, stream=s)  # fmt: skip
        sk.accept_sampled(b["keys"], b["tokens"], self.ndraft, self.picks, loop.state, self.h,
                          host.ring_ptr, host.cancel_ptr, self.stats, cond, stream=s)  # fmt: skip

    def launch(self, greedy: bool) -> None:
        """Capture the greedy or the sampled graph at its first use, then run it from the
        current state (queued)."""
        if greedy not in self._graphs:
            self._graphs[greedy] = self.e.loop.capture(lambda s, cond: self.body(s, cond, greedy))
        self._graphs[greedy].launch(self.gpu.stream)

    def read_stats(self) -> SpecStats:
        """The last generation's counters (synchronous)."""
        return stats_from_words(self.gpu.download(self.stats, np.zeros(STATS_WORDS, np.int32)))
