"""Continuous batching: many sequences share one backend, one decode step at a time.

    seq = scheduler.add(prompt_ids, params, stop_ids)   # ContextError when it cannot fit
    while scheduler.has_work:
        for event in scheduler.step():                  # Event(seq, token, finish)
            ...

A `Sequence` is one request's token ids, sampling parameters and, while admitted, its KV page
table and batch slot. The `Scheduler` is the only one who admits, reserves, commits and
releases pages; it drives any backend with the batch primitives:

    max_batch                     most sequences in one decode step (slots 0 .. max_batch - 1)
    block_manager                 the backend's KV pool (nanoqwen.kv_pages.BlockManager)
    prefill_chunk(seq, end, sample) -> token | None
        ids[kv_len:end] at positions kv_len .. end - 1 into seq.table's pages (reserved by the
        caller to cover end, and end + 1 with sample), then kv_len = end; with sample, the next
        token, sampled as draw number len(seq.tokens) of the sequence
    decode_launch(seqs, after=None) -> step
        queue one step for each sequence (distinct slots): feed ids[kv_len] (its last id) at
        position kv_len, sample its next token as draw len(seq.tokens), kv_len += 1; each row
        is what the sequence gets alone; step.tokens() waits and gives them in seqs' order.
        With `after`, the step queued just before and not yet read: seqs are some of its
        sequences, each fed the token that step samples for it, as draw len(seq.tokens) + 1
    release_slot(seq)             the sequence leaves: forget per-slot state

(ReferenceBackend's are the oracle: exactly generate()'s tokens). Each `step()`:

1. drops cancelled sequences: their pages (committed as far as written) are released and their
   slot freed, so a cancel frees its KV within one step; then, when a sequence runs solo
   (below) and stays so, takes its next token and does nothing else; otherwise:
2. admits waiting sequences, oldest first, while a slot is free and the pool has pages for the
   sequence's first chunk besides the pages this step's decode takes (so an admission does not
   force a preemption in its own step); admission takes the prompt's cached prefix
   (`BlockManager.admit`), so `kv_len` starts at `table.cached_tokens`; a sequence whose
   prompt's next pages another one is prefilling right now waits for them instead;
3. prefills at most `prefill_chunk` tokens, across the admitted sequences that still have
   uncomputed ids, oldest first; a chunk that ends the prompt samples the first token. A long
   prompt therefore costs the running streams one bounded chunk per step, never a whole prefill;
4. launches one decode step over every sequence whose ids but the last were computed when the
   step began (one token each; not those whose first token this step's prefill sampled),
   having reserved kv_len + 1 positions for each, oldest first; then, one step behind (below),
   reads its tokens.

One step behind. Reading a step's tokens, committing and emitting them, and staging the next
step is host work (~0.1-0.2 ms at 16 sequences, docs/PERFORMANCE.md) that the GPU would sit
idle through. So when the next step can only be "the same sequences, one more token each" it
is launched before the tokens of the step in flight are read, each row fed the token that step
samples for it on the device (decode_launch's `after`), and the host's work runs under it. A
step() with a decode step in flight therefore chains the next one behind it and reads the one
in flight. It chains only when nothing else has to happen first: no cancel, no waiting request
with a slot free, no sequence prefilling, no lone sequence about to go solo, pages for every
row without preempting; otherwise it reads the step in flight, frees the cancelled sequences,
and the next step() runs the steps above. A sequence whose step in flight gives it its last
token by length is left out of the chained step; one that stops on a stop id is known only
when that token is read, so its row in the chained step is computed and thrown away (its K/V
lands in a page it no longer holds: every later use of that page runs after it on the stream).

Pages are reserved on demand, page by page as a sequence grows (vLLM's rule), not
prompt + max_tokens up front: most requests stop long before max_tokens (a code completion on a
newline, a chat answer on EOS), so reserving the maximum would hold most of the pool idle and
admit a fraction of the sequences that fit. The price is that the pool can run out mid-step;
then the most recently admitted sequence is preempted: what it wrote is already committed (the
prefix cache keeps its full pages), its pages and slot are released, and it goes back to the
front of the waiting queue with its tokens kept. It resumes by prefilling prompt + tokens[:-1],
mostly served from the prefix cache, and decodes on from its last token. Its sampler state (the
reference's generator, the cuda side's counter) lives in the sequence and is not touched, so a
seeded request samples the same tokens whether or not it was preempted.

A sequence finishes on a stop id or after max_tokens: the K/V of every id but the last sampled
one is written and committed (the plain generate() commits the same), its pages are released.

A sequence alone runs solo: through the backend's single-stream `generate` (the cuda engine's
one-graph loop, whose step a batch of one costs 1.44x; and speculative drafts, which
the batch step does not run), one token per step() call. When a request arrives behind it
(max_batch > 1), the solo generation is closed, which commits what it wrote to the prefix
cache, and the sequence goes back to the front of the waiting queue with its tokens kept, like
a preempted one: it resumes in the batch from the cached pages. When a batch shrinks to one
decoding sequence with nothing waiting and at least SOLO_MIN_LEFT tokens to go, it leaves the
batch the same way and resumes solo (generate() over prompt + tokens, the cached pages again).
A resumed generate() draws its samples afresh, so a seeded sampled request goes solo only with
max_batch 1 (never handed off): its tokens stay the same whatever runs beside it.

Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as IdSequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from .backend import check_fits, check_prompt
from .config import PAGE_TOKENS
from .errors import ContextError, NanoqwenError
from .kv_pages import PageTable
from .sampling import SamplingParams
from .speculative import SpecStats

# Prompt tokens prefilled per step across all admitted sequences: the running streams' step
# grows by at most one chunk of this many rows, and a 32k prompt still takes only 64 steps.
# A larger chunk trades those stalls for time to first token (docs/EXPERIMENTS.md, Server:
# 1024 and 2048 on the H200 doubled and tripled the stalls for 9-15% off the TTFT).
DEFAULT_PREFILL_CHUNK = 512
# A lone sequence leaves the batch for solo decoding only with this many tokens still to go:
# the move costs a prefill of its last partial page (a few decode steps on the GPU).
SOLO_MIN_LEFT = 16


@dataclass(eq=False)
class Sequence:
    """One request. The first eight fields are the backends' contract (read and written by
    prefill_chunk / decode_launch); the rest are the scheduler's. Identity equality: a sequence
    is a dict key of whoever tracks requests."""

    prompt: list[int]  # the request's prompt ids
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # generated so far
    table: PageTable | None = None  # its KV pages while admitted
    slot: int = -1  # 0 .. max_batch - 1 while admitted, unique among admitted sequences
    kv_len: int = 0  # positions 0 .. kv_len - 1 have their K/V in table's pages
    sampler: Any = None  # the backend's per-sequence sampling state, kept across preemptions
    request_id: int = 0
    cancelled: bool = False
    finish_reason: str | None = None  # "stop" / "length" / "cancelled" once it has left
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at its first prefill
    preemptions: int = 0
    spec: SpecStats | None = None  # its solo stretches' speculation (backends with drafts)
    _ids: list[int] = field(default_factory=list, repr=False)

    @property
    def ids(self) -> list[int]:
        """prompt + tokens, every known token (positions index it), kept as one list that
        grows with `tokens` rather than concatenated on every read."""
        if not self._ids:
            self._ids.extend(self.prompt)
        missing = len(self.prompt) + len(self.tokens) - len(self._ids)
        if missing:
            self._ids.extend(self.tokens[len(self.tokens) - missing :])
        return self._ids

    @property
    def prefill_end(self) -> int:
        """Where its prefill stops: the prompt's end before its first token (that chunk
        samples it), else every id but the last (a resumed sequence decodes from there)."""
        return len(self.prompt) if not self.tokens else len(self.prompt) + len(self.tokens) - 1

    @property
    def decoding(self) -> bool:
        """Admitted, with every id but the last computed: the next decode step takes it."""
        return self.table is not None and bool(self.tokens) and self.kv_len == len(self.ids) - 1


class Event(NamedTuple):
    """What a step did to one sequence: a new token (None for a cancellation, or a solo
    generate() that ended without a finishing token) and, when the sequence left, why
    ("stop", "length" or "cancelled")."""

    seq: Sequence
    token: int | None
    finish: str | None


class Scheduler:
    """Waiting and running sequences over one backend's KV pool and batch slots."""

    def __init__(
        self,
        backend,
        max_batch: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        solo: bool = True,
    ) -> None:
        """max_batch: sequences admitted at once (default and upper bound: the backend's);
        prefill_chunk: prompt tokens prefilled per step across sequences; solo: a lone
        sequence decodes through generate() (module docstring), False keeps it in the batch
        (to measure the batch step at one sequence, or test the batch's own rules). A backend
        without the batched step (max_batch 0: the cuda engine with an int8 lm_head) serves
        one sequence at a time, solo."""
        limit = backend.max_batch or int(solo)
        self.max_batch = limit if max_batch is None else max_batch
        if not 1 <= self.max_batch <= limit:
            raise NanoqwenError(f"max_batch {self.max_batch} must be in [1, {limit}] (the "
                                f"{backend.name} backend's max_batch)")  # fmt: skip
        if prefill_chunk < 1:
            raise NanoqwenError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.backend, self.pages = backend, backend.block_manager
        if self.pages.num_pages * PAGE_TOKENS < backend.max_context:
            # Alone in the pool, any request that passes add() must fit: no admission waits
            # forever and preemption always ends.
            raise NanoqwenError(f"the KV pool ({self.pages.num_pages} pages) is smaller than "
                                f"the context ({backend.max_context} positions)")  # fmt: skip
        self.prefill_chunk, self.solo_allowed = prefill_chunk, solo
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, oldest first (preemption takes the last)
        self.solo: Sequence | None = None  # decoding alone through backend.generate
        self._solo_tokens: Iterator[int] | None = None  # that generate()
        self._cancelled_solo: Sequence | None = None
        self.preemptions = 0
        self.solo_moves = 0  # sequences moved from solo into the batch or back
        self._free_slots = list(range(self.max_batch - 1, -1, -1))  # pop() hands out 0 first
        self._pending = None  # the decode step in flight (decode_launch's), not yet read
        self._ids = itertools.count(1)

    # -- requests ------------------------------------------------------------------------------
    def add(self, prompt: IdSequence[int], params: SamplingParams,
            stop_ids: frozenset[int] = frozenset()) -> Sequence:  # fmt: skip
        """Queue a request; ContextError when the prompt is empty, has ids outside the
        vocabulary, or prompt + max_tokens exceeds the backend's max_context."""
        ids = check_prompt(prompt, self.backend.config.vocab_size).tolist()
        check_fits(len(ids), params.max_tokens, self.backend.max_context)
        seq = Sequence(ids, params, frozenset(stop_ids), request_id=next(self._ids))
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Mark `seq` cancelled: the next step() frees it before running anything; the solo
        sequence is freed now (its seq.spec is then final)."""
        seq.cancelled = True
        if seq is self.solo:
            self._end_solo("cancelled")
            self._cancelled_solo = seq  # its event comes with the next step's

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.solo or self._pending)

    @property
    def active(self) -> int:
        """Sequences decoding or prefilling: the batch's and the solo one."""
        return len(self.running) + (self.solo is not None)

    def clear(self) -> list[Sequence]:
        """Drop every sequence now, without a step (after an engine failure, at shutdown):
        pages released, slots freed; returns them."""
        dropped = [*self.running, *self.waiting, *([self.solo] if self.solo else [])]
        self._pending = None  # never read: what it writes lands before any later use
        for seq in list(self.running):
            self._leave(seq, "cancelled")
        if self.solo is not None:
            self._end_solo("cancelled")
        self.waiting.clear()
        self._cancelled_solo = None
        return dropped

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """With a decode step in flight: chain the next one behind it when nothing else has to
        happen, read it (and, not chained, free the cancelled sequences). Otherwise cancel,
        then one solo token, or: admit, prefill one bounded chunk, decode once (module
        docstring)."""
        events: list[Event] = []
        if self._pending is not None:
            if not self._advance(events):
                self._drop_cancelled(events)
            return events
        self._drop_cancelled(events)
        if self.solo is not None and self.waiting and self.max_batch > 1:
            self._hand_off()
        if self.solo is None:
            self._go_solo()
        if self.solo is not None:
            self._solo_step(events)
            return events
        self._admit()
        decoding = [s for s in self.running if s.decoding]  # before the prefill adds any
        self._prefill(events)
        self._decode([s for s in decoding if s.table is not None], events)
        return events

    def _drop_cancelled(self, events: list[Event]) -> None:
        if self._cancelled_solo is not None:
            events.append(Event(self._cancelled_solo, None, "cancelled"))
            self._cancelled_solo = None
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.finish_reason = "cancelled"
            events.append(Event(seq, None, "cancelled"))
        for seq in [s for s in self.running if s.cancelled]:
            self._leave(seq, "cancelled")
            events.append(Event(seq, None, "cancelled"))

    # -- solo ----------------------------------------------------------------------------------
    def _solo_ok(self, seq: Sequence) -> bool:
        params = seq.params
        return self.solo_allowed and (self.max_batch == 1 or params.greedy or params.seed is None)

    def _go_solo(self) -> None:
        """Start the lone sequence solo: a waiting one with nothing admitted (the oldest with
        max_batch 1, which runs them one after the other), or the batch's only decoding one
        with nothing waiting and SOLO_MIN_LEFT tokens to go."""
        lone = len(self.waiting) == 1 or self.max_batch == 1
        if not self.running and self.waiting and lone and self._solo_ok(self.waiting[0]):
            seq = self.waiting.popleft()
        elif len(self.running) == 1 and not self.waiting and self._leaves_batch(self.running[0]):
            seq = self.running[0]
            self._leave(seq, None)
            self.solo_moves += 1
        else:
            return
        params = replace(seq.params, max_tokens=seq.params.max_tokens - len(seq.tokens))
        self._solo_tokens = self.backend.generate(seq.ids, params, seq.stop_ids)
        self.solo = seq

    def _leaves_batch(self, seq: Sequence, in_flight: int = 0) -> bool:
        """Whether the batch's lone sequence goes solo once the `in_flight` tokens its steps
        in flight give it are read."""
        left = seq.params.max_tokens - len(seq.tokens) - in_flight
        return (seq.decoding or in_flight > 0) and self._solo_ok(seq) and left >= SOLO_MIN_LEFT

    def _solo_step(self, events: list[Event]) -> None:
        seq = self.solo
        fresh = not seq.tokens
        token = next(self._solo_tokens, None)
        if token is None:  # generate() ended without a finishing token (LLM.stream's "length")
            self._end_solo("length")
            events.append(Event(seq, None, "length"))
            return
        if fresh:
            seq.cached_tokens = self.backend.cached_tokens
        finish = self._emit(seq, token, events)
        if finish:
            self._end_solo(finish)

    def _hand_off(self) -> None:
        """The solo sequence goes to the front of the waiting queue, its tokens kept."""
        seq = self.solo
        self._end_solo(None)
        self.waiting.appendleft(seq)
        self.solo_moves += 1

    def _end_solo(self, finish: str | None) -> None:
        """Close the solo generate(): it stops its loop, commits what it wrote to the prefix
        cache and releases its pages; its speculation counts into seq.spec."""
        seq, tokens = self.solo, self._solo_tokens
        self.solo = self._solo_tokens = None
        tokens.close()
        if self.backend.speculative:
            seq.spec = seq.spec or SpecStats()
            seq.spec.add(self.backend.spec_stats)
        seq.finish_reason = finish

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            if self._awaits_a_prefill(seq):
                return
            table = self.pages.admit(seq.ids)
            first = min(seq.prefill_end, table.cached_tokens + self.prefill_chunk)
            need = first + (first == seq.prefill_end)  # and the next step's position
            stats = self.pages.stats
            pages = -(-need // PAGE_TOKENS) - len(table.pages) + self._decode_pages()
            if pages > stats.free + stats.cached:
                self.pages.release(table)
                return
            self.pages.reserve(table, need)
            self.waiting.popleft()
            seq.table, seq.kv_len, seq.slot = table, table.cached_tokens, self._free_slots.pop()
            if not seq.tokens:
                seq.cached_tokens = table.cached_tokens
            self.running.append(seq)

    def _awaits_a_prefill(self, seq: Sequence) -> bool:
        """Whether a sequence being prefilled is computing pages of `seq`'s prompt that the
        prefix cache does not hold yet: `seq` then waits for them (a step or a few), to take
        them from the cache at admission rather than compute them again. The n choices of one
        request and a burst of requests on one file arrive so; the prefill, oldest first,
        would have reached `seq` only after the other's anyway."""
        if not self.pages.prefix_caching:
            return False
        usable = (len(seq.ids) - 1) // PAGE_TOKENS * PAGE_TOKENS  # what `admit` can reuse
        for other in self.running:
            if other.table is None or other.decoding:
                continue
            # Its next page to seal, if `seq` could reuse it: both prompts hold the same ids
            # up to that page's end (the pages before it are sealed, in the cache already).
            page_end = other.kv_len // PAGE_TOKENS * PAGE_TOKENS + PAGE_TOKENS
            if page_end <= min(usable, other.prefill_end) and (
                seq.ids[:page_end] == other.ids[:page_end]
            ):
                return True
        return False

    def _decode_pages(self) -> int:
        """Pages this step's decode takes: one for each decoding sequence on a page boundary."""
        return sum(s.decoding and s.kv_len >= len(s.table.pages) * PAGE_TOKENS
                   for s in self.running)  # fmt: skip

    def _prefill(self, events: list[Event]) -> None:
        budget = self.prefill_chunk
        for seq in list(self.running):
            if budget == 0:
                return
            if seq.table is None or seq.decoding:
                continue  # preempted by an earlier reservation, or done prefilling
            start, end = seq.kv_len, min(seq.prefill_end, seq.kv_len + budget)
            sample = not seq.tokens and end == len(seq.prompt)
            if not self._reserve(seq, end + sample):
                continue
            token = self.backend.prefill_chunk(seq, end, sample)
            self.pages.commit(seq.table, seq.ids[start:end])
            budget -= end - start
            if sample and (finish := self._emit(seq, token, events)):
                self._leave(seq, finish)

    def _decode(self, batch: list[Sequence], events: list[Event]) -> None:
        for seq in batch:
            if seq.table is not None:  # an earlier reservation may have preempted it
                self._reserve(seq, seq.kv_len + 1)
        batch = [s for s in batch if s.table is not None]
        if not batch:
            return
        self._pending = self.backend.decode_launch(batch)
        self._advance(events)

    def _advance(self, events: list[Event]) -> bool:
        """Chain the next decode step behind the one in flight where it may run (module
        docstring: one step behind), then read the one in flight; whether it chained."""
        step, chained = self._pending, None
        seqs = self._chainable(step)
        if seqs:
            chained = self.backend.decode_launch(seqs, after=step)
        self._pending = chained
        for seq, token in zip(step.seqs, step.tokens(), strict=True):
            if seq.table is None or seq.cancelled:
                continue  # it left while the step ran: the row is thrown away
            at = len(seq.table.tokens)  # the position the step fed
            self.pages.commit(seq.table, seq.ids[at : at + 1])
            if finish := self._emit(seq, token, events):
                self._leave(seq, finish)
        return chained is not None

    def _chainable(self, step) -> list[Sequence]:
        """The sequences of a step chained behind `step` (in flight): those it does not end
        by length, each with pages reserved for its next position; [] when the next step must
        wait for the host (module docstring)."""
        flight = {id(s) for s in step.seqs}
        lone = len(self.running) == 1 and not self.waiting
        if (
            any(s.cancelled or id(s) not in flight for s in self.running)
            or (self.waiting and self._free_slots)
            or any(s.cancelled for s in self.waiting)
            or (lone and self._leaves_batch(self.running[0], in_flight=1))
        ):
            return []
        seqs = [s for s in step.seqs
                if s.table is not None and len(s.tokens) + 1 < s.params.max_tokens]  # fmt: skip
        try:
            for seq in seqs:
                self.pages.reserve(seq.table, seq.kv_len + 1)
        except ContextError:  # short of pages: the next step may preempt, after the reads
            return []
        return seqs

    # -- helpers -------------------------------------------------------------------------------
    def _emit(self, seq: Sequence, token: int, events: list[Event]) -> str | None:
        """Append `token` to seq and its event; whether it ends seq ("stop" on a stop id,
        "length" at max_tokens, else None): the caller lets it go."""
        seq.tokens.append(int(token))
        finish = None
        if token in seq.stop_ids:
            finish = "stop"
        elif len(seq.tokens) == seq.params.max_tokens:
            finish = "length"
        events.append(Event(seq, int(token), finish))
        return finish

    def _reserve(self, seq: Sequence, length: int) -> bool:
        """Pages for `length` positions of `seq`, preempting the most recently admitted
        sequences while the pool is short; False when `seq` itself had to go."""
        while True:
            try:
                self.pages.reserve(seq.table, length)
                return True
            except ContextError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self._leave(seq, None)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _leave(self, seq: Sequence, finish: str | None) -> None:
        """Out of the batch: pages released (committed as far as written), slot freed."""
        self.running.remove(seq)
        self.pages.release(seq.table)
        self.backend.release_slot(seq)
        self._free_slots.append(seq.slot)
        seq.table, seq.slot, seq.kv_len, seq.finish_reason = None, -1, 0, finish
