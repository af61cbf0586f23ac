"""The block manager (nanoqwen.kv_pages) on its own: pure Python, no model.

1. A simulated engine drives it with 1000 random requests (shared prefixes, chat-style
   continuations, several sequences live at once, random cancellations, errors mid-step, a
   pool small enough to evict and to run out) while keeping a fake K/V pool: each slot holds the
   whole token prefix whose K/V a real forward would have written there, or a poison mark for a
   step that failed part way. Checked after every operation: no page owned twice (refcount > 1
   only for a cached full page), refcounts equal the number of tables holding the page, free +
   held + cached == pool with no page in two of them, the prefix map names exactly the cached
   pages; at every admission each reused slot holds exactly the new prompt's prefix; every
   write lands in a page its writer alone holds; at the end zero pages are held and every
   cached page holds fully written K/V of its entry's tokens.
2. Unit cases: the reuse rule, LRU eviction order, equal pages under other prefixes (parents
   compared), duplicates, all-or-nothing reserve, prefix caching off.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nanoqwen.config import PAGE_TOKENS
from nanoqwen.errors import ContextError
from nanoqwen.kv_pages import BlockManager, PageTable

P = PAGE_TOKENS
POISON = ("unwritten",)


def check_invariants(bm: BlockManager, tables: list[PageTable]) -> None:
    owners = Counter(p for t in tables for p in t.pages)
    for t in tables:
        assert len(set(t.pages)) == len(t.pages), "a page twice in one table"
    free, lru = set(bm._free), set(bm._lru)
    held = {p for p in range(bm.num_pages) if owners[p]}
    assert len(free) == len(bm._free), "a page twice on the free list"
    assert not (free & lru or free & held or lru & held), "a page in two states"
    assert free | lru | held == set(range(bm.num_pages)), "a page lost"
    for p in range(bm.num_pages):
        assert bm._refs[p] == owners[p], (p, bm._refs[p], owners[p])
        if owners[p] > 1:
            assert bm._entries[p] is not None, f"page {p} shared but not a cached page"
    cached = {p for p in range(bm.num_pages) if bm._entries[p] is not None}
    assert lru <= cached and not (free & cached)
    assert {bm._entries[p].key: p for p in cached} == bm._by_key
    s = bm.stats
    assert (s.held, s.cached, s.free) == (len(held), len(lru), len(free))
    assert s.held + s.cached + s.free == s.pages


class Engine:
    """Drives a BlockManager the way a backend does, over a fake K/V pool."""

    def __init__(self, num_pages: int, rng: random.Random):
        self.bm, self.rng = BlockManager(num_pages), rng
        self.kv: dict[tuple[int, int], tuple] = {}  # (page, slot) -> the prefix written there
        self.live: list[dict] = []
        self.finished: list[list[int]] = []  # full token lists, for chat-style continuations
        self.bases = [[rng.randrange(50) for _ in range(120)] for _ in range(5)]
        self.counts = Counter()

    def tables(self) -> list[PageTable]:
        return [r["table"] for r in self.live]

    def check(self) -> None:
        check_invariants(self.bm, self.tables())

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.finished and rng.random() < 0.3:
            head = rng.choice(self.finished)  # the next turn resends the whole conversation
        else:
            head = rng.choice(self.bases)[: rng.randint(1, 100)]
        # Tails and replies of few symbols (runs of zeros, often) make equal pages under
        # different histories, and duplicates.
        return head + self.few_symbols(rng.randint(0, 40))

    def few_symbols(self, n: int) -> list[int]:
        if self.rng.random() < 0.5:
            return [0] * n
        return [self.rng.randrange(2) for _ in range(n)]

    def start(self) -> None:
        prompt = self.prompt()
        table = self.bm.admit(prompt)
        n = table.cached_tokens
        assert n % P == 0 and n <= (len(prompt) - 1) // P * P and table.tokens == prompt[:n]
        for pos in range(n):  # every reused slot holds this prompt's own prefix
            assert self.kv[table.pages[pos // P], pos % P] == tuple(prompt[: pos + 1]), pos
        self.counts["hit"] += n > 0
        gen = self.few_symbols(self.rng.randint(1, 30))
        fate = self.rng.choice(["finish", "finish", "cancel", "error"])
        stop_at = self.rng.randint(0, len(gen))  # the step where a cancel or error happens
        self.live.append(dict(table=table, tokens=prompt + gen, prompt=len(prompt),
                              fate=fate, stop_at=stop_at, step=0))  # fmt: skip

    def write(self, table: PageTable, tokens: list[int], start: int, end: int, ok: bool):
        for pos in range(start, end):
            page = table.pages[pos // P]
            assert self.bm._refs[page] == 1 and self.bm._entries[page] is None, "shared write"
            self.kv[page, pos % P] = tuple(tokens[: pos + 1]) if ok else POISON

    def advance(self, r: dict) -> None:
        """One step of a live request: the prefill at step 0, then one decode step each."""
        table, tokens, step = r["table"], r["tokens"], r["step"]
        if r["fate"] == "cancel" and step == r["stop_at"]:
            return self.end(r, "cancel")
        start = len(table.tokens)
        end = r["prompt"] if step == 0 else start + 1
        if end > len(tokens) - 1:  # the last sampled token never gets its K/V
            return self.end(r, "finish")
        try:
            self.bm.reserve(table, end)
        except ContextError:  # pages held by the other live requests
            return self.end(r, "full")
        if r["fate"] == "error" and step == r["stop_at"]:
            self.write(table, tokens, start, self.rng.randint(start, end), ok=False)
            return self.end(r, "error")
        self.write(table, tokens, start, end, ok=True)
        self.bm.commit(table, tokens[start:end])
        r["step"] += 1

    def end(self, r: dict, why: str) -> None:
        self.bm.release(r["table"])
        self.live.remove(r)
        self.counts[why] += 1
        if why == "finish":
            self.finished = (self.finished + [r["tokens"]])[-20:]

    def run(self, requests: int, max_live: int) -> None:
        started = 0
        while started < requests or self.live:
            if started < requests and (not self.live or (
                    len(self.live) < max_live and self.rng.random() < 0.2)):  # fmt: skip
                self.start()
                started += 1
            else:
                self.advance(self.rng.choice(self.live))
            self.check()

    def check_cached_content(self) -> None:
        for p in range(self.bm.num_pages):
            entry = self.bm._entries[p]
            if entry is not None:
                slots = [self.kv.get((p, j)) for j in range(P)]
                assert POISON not in slots and None not in slots, f"page {p} not fully written"
                assert all(s[-(j + 1) :] == entry.tokens[: j + 1] for j, s in enumerate(slots))


def test_random_requests_leave_nothing_held():
    seed = random.randrange(1 << 32)
    engine = Engine(num_pages=24, rng=random.Random(seed))
    engine.run(requests=1000, max_live=3)
    s, c = engine.bm.stats, engine.counts
    assert s.held == 0 and s.cached + s.free == s.pages, (seed, s)
    engine.check_cached_content()
    # The run exercised what it claims to (seed in the message if not).
    assert c["cancel"] and c["error"] and c["full"] and c["finish"] > 300, (seed, c)
    assert s.evictions > 0, (seed, s)
    assert c["hit"] > 100 and s.hit_tokens > 0.1 * s.lookup_tokens, (seed, c, s)


# -- unit cases --------------------------------------------------------------------------------
def run_sequence(bm: BlockManager, tokens: list[int], written: int | None = None) -> PageTable:
    """Admit `tokens`, commit its K/V up to `written` positions (all by default); not released."""
    table = bm.admit(tokens)
    written = len(tokens) if written is None else written
    bm.reserve(table, len(tokens))
    bm.commit(table, tokens[len(table.tokens) : written])
    return table


def finish(bm: BlockManager, tokens: list[int], written: int | None = None) -> None:
    bm.release(run_sequence(bm, tokens, written))


def seq(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_reuse_rule_full_pages_before_the_last_token():
    bm = BlockManager(16)
    finish(bm, seq(80))
    for length, cached in [(1, 0), (16, 0), (17, 16), (32, 16), (33, 32), (80, 64), (81, 80)]:
        table = bm.admit(seq(length))
        assert table.cached_tokens == cached and table.tokens == seq(cached), length
        bm.release(table)
    other = bm.admit([*seq(20), 999, *seq(40, 21)])  # differs at position 20: page 1 on
    assert other.cached_tokens == 16
    bm.release(other)
    s = bm.stats
    assert s.held == 0 and s.cached == 5 and s.hit_tokens == 16 + 16 + 32 + 64 + 80 + 16


def test_only_written_pages_are_cached():
    bm = BlockManager(8)
    finish(bm, seq(40), written=31)  # page 1 misses position 31: a cancelled step
    assert bm.stats.cached == 1
    table = bm.admit(seq(40))
    assert table.cached_tokens == 16
    bm.release(table)
    with pytest.raises(ValueError, match="past the 1 pages reserved"):
        t = PageTable()
        bm.reserve(t, 10)
        bm.commit(t, seq(17))


def test_eviction_is_lru_tail_first():
    bm = BlockManager(6)
    a, b = seq(33), seq(33, 100)
    pages = {}
    for name, tokens in [("a", a), ("b", b), ("a", a)]:  # A used again after B
        table = run_sequence(bm, tokens)
        pages[name] = list(table.pages)  # pages 0, 1 cached; page 2 (position 32) freed
        bm.release(table)
    assert bm.stats.cached == 4 and bm.stats.free == 2
    table, taken = PageTable(), []
    for n in range(1, 7):
        bm.reserve(table, n * P)
        taken.append(table.pages[-1])
    (a0, a1, _), (b0, b1, _) = pages["a"], pages["b"]
    assert set(taken[:2]) == set(range(6)) - {a0, a1, b0, b1}  # free pages before evictions
    assert taken[2:] == [b1, b0, a1, a0]  # least recently used first, a tail before its head
    assert bm.stats.evictions == 4 and bm.stats.cached == 0
    bm.release(table)


def test_a_hit_needs_the_same_parent():
    """X|Y and W|Y share page 1's ids: page 1 of W|Y is not served from X|Y's page (its K/V
    attended over X, not W), and X|Y|Z does not reach W|Y|Z's page 2 through it."""
    bm = BlockManager(8)
    x, y, w, z = seq(P), seq(P, 100), seq(P, 200), seq(P, 300)
    finish(bm, x + y + [1])
    probe = bm.admit(w + y + [2])
    assert probe.cached_tokens == 0
    bm.release(probe)
    finish(bm, w + y + z + [1])  # its own page 1: same ids, another parent
    assert bm.stats.cached == 5
    for prompt, cached in [(x + y + z + [2], 32), (w + y + z + [2], 48)]:
        probe = bm.admit(prompt)
        assert probe.cached_tokens == cached
        bm.release(probe)


def test_duplicate_pages_continue_the_chain():
    """Two sequences compute the same page 0 at once: the second one's copy stays private
    (freed at release) and its page 1 is cached as the child of the first one's page 0."""
    bm = BlockManager(8)
    x = seq(P)
    first, second = bm.admit(x + [7]), bm.admit(x + seq(P, 50) + [7])
    bm.reserve(first, P + 1)
    bm.reserve(second, 2 * P + 1)
    bm.commit(first, x)
    bm.commit(second, x + seq(P, 50))
    assert bm.stats.held == 5
    x_page, y_page = first.pages[0], second.pages[1]
    bm.release(first)
    bm.release(second)
    assert (bm.stats.cached, bm.stats.free) == (2, 6)
    probe = bm.admit(x + seq(P, 50) + [8])
    assert probe.cached_tokens == 32 and probe.pages == [x_page, y_page]
    bm.release(probe)


def test_reserve_is_all_or_nothing():
    bm = BlockManager(4)
    finish(bm, seq(17))  # one page cached
    holder = PageTable()
    bm.reserve(holder, 2 * P)
    table = PageTable()
    with pytest.raises(ContextError, match=r"3 more 16-token pages; 1 free and 1 cached of 4, "
                                           r"the other 2 held"):  # fmt: skip
        bm.reserve(table, 3 * P)
    assert table.pages == [] and bm.stats.free == 1 and bm.stats.cached == 1
    bm.reserve(table, 2 * P)  # the free page, then the cached one
    assert bm.stats.evictions == 1 and bm.stats.held == 4
    bm.release(table)
    bm.release(holder)
    bm.release(holder)  # a second release of an emptied table changes nothing
    assert bm.stats.free == 4


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(8, prefix_caching=False)
    finish(bm, seq(40))
    table = bm.admit(seq(40))
    assert table.cached_tokens == 0 and table.pages == []
    bm.release(table)
    s = bm.stats
    assert (s.cached, s.free, s.lookup_tokens, s.hit_tokens) == (0, 8, 0, 0)
