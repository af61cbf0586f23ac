"""The KV page allocator and the prefix cache: the one home of page bookkeeping, shared by both
backends. Pure Python; it hands out page ids, the backends own the K/V memory behind them.

The pool is `num_pages` pages of PAGE_TOKENS positions. Each page is in exactly one state:

    free     refcount 0, holds nothing anyone can find                    (the free list)
    held     refcount > 0: in that many sequences' page tables
    cached   refcount 0, but its K/V are findable in the prefix cache     (an LRU, oldest first)

Cached pages count as capacity: when the free list is empty, `reserve` evicts the least
recently used one. A sequence's `PageTable` maps its logical page i (positions 16i..16i+15)
to a physical page, grown by `reserve` as the sequence grows.

Prefix caching. A full page whose K/V are written is sealed: it gets an entry (its 16 token
ids as int32 little-endian bytes, a serial number, its parent's serial) and goes into a map
keyed by (parent's serial, ids' bytes). That key is the chained hash of the page's whole
prefix with the hashing left to the dict: the parent's serial names the cached chain before
the page exactly, and a dict hit compares the whole key, so a hit's prefix equals the prompt's
token for token by induction, and no digest is ever trusted (a digest of (parent digest, ids),
nano-vllm's and vLLM's scheme, must be checked against the ids and the parent anyway). The
walk, which runs before the prefill's first launch, costs one bytes slice and one dict probe
a page and no hashing of our own. Serials, not page ids, name parents: an evicted page that is
reused gets a new serial, so its former children never match again.

The reuse rule: only full pages strictly before the prompt's last token are reused. The last
prompt token is always computed (its logits are the first sample), and every sequence writes
only pages it alone holds: a page is shared (refcount > 1) only when it is a sealed, full,
read-only cached page.

What is cached, and when: `commit` records the token ids whose K/V a step has written, and
seals each page that this completes, so a page's entry never names a position whose K/V were
not written (a cancelled step or a failed forward commits nothing). Prompt and generated tokens
alike: a chat's next turn resends the answer. `release` drops the sequence's references, tail
page first, so that among one sequence's pages the tail is evicted before the prefix it extends.

Not thread-safe: one engine thread drives it.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .config import PAGE_TOKENS
from .errors import ContextError

ROOT = 0  # the parent serial of every sequence's page 0


def id_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids (a sequence of ints or an integer array) as int32 little-endian bytes: what
    pages are keyed and compared by."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<i4", copy=False).tobytes()
    return struct.pack(f"<{len(tokens)}i", *tokens)


class CachedPage(NamedTuple):
    """The prefix-cache entry of one sealed page (a tuple: a 32k prompt seals 2048 of them
    after its generation, and a frozen dataclass costs several times as much to make)."""

    page: bytes  # id_bytes of the PAGE_TOKENS ids whose K/V the page holds
    serial: int  # unique per sealing: names this entry as a parent
    parent: int  # the serial of the page before it (ROOT for page 0)

    @property
    def key(self) -> tuple[int, bytes]:
        """Its key in the prefix map: (parent's serial, ids' bytes)."""
        return self.parent, self.page

    @property
    def tokens(self) -> tuple[int, ...]:
        return struct.unpack(f"<{PAGE_TOKENS}i", self.page)


@dataclass(frozen=True)
class KVStats:
    """The pool and the prefix cache, for leak checks and for the server to report."""

    pages: int  # the whole pool
    held: int  # in some page table
    cached: int  # unreferenced, reusable, evictable
    free: int
    lookup_tokens: int  # prompt tokens looked up by admit
    hit_tokens: int  # of those, served from the cache
    evictions: int  # cached pages taken back for new K/V


class PageTable:
    """One sequence's pages: `pages[i]` holds positions 16i..16i+15; `tokens` are the ids whose
    K/V are written (position order, so len(tokens) is the next position to compute);
    `cached_tokens` of them came from the prefix cache at admission."""

    __slots__ = ("pages", "tokens", "cached_tokens", "_sealed", "_parent")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.tokens: list[int] = []
        self.cached_tokens = 0
        self._sealed = 0  # leading pages that are sealed (or were hits)
        self._parent = ROOT  # the serial of the last sealed page's entry


class BlockManager:
    """Refcounted pages, a free list, an LRU of cached pages and the prefix map."""

    def __init__(self, num_pages: int, prefix_caching: bool = True) -> None:
        self.num_pages, self.prefix_caching = num_pages, prefix_caching
        self._refs = [0] * num_pages
        # Handed out from the top of the pool down, so a page table is never the identity and
        # a wrong indirection shows in the tests.
        self._free = list(range(num_pages))
        self._entries: list[CachedPage | None] = [None] * num_pages
        self._by_key: dict[tuple[int, bytes], int] = {}  # CachedPage.key -> page
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; oldest first
        self._serials = itertools.count(ROOT + 1)
        self._lookup_tokens = self._hit_tokens = self._evictions = 0

    # -- state -------------------------------------------------------------------------------
    @property
    def pages_held(self) -> int:
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def stats(self) -> KVStats:
        return KVStats(self.num_pages, self.pages_held, len(self._lru), len(self._free),
                       self._lookup_tokens, self._hit_tokens, self._evictions)  # fmt: skip

    # -- a sequence's life ---------------------------------------------------------------------
    def admit(self, prompt: Sequence[int]) -> PageTable:
        """A page table for `prompt` holding its longest cached prefix of full pages before the
        last token (none with prefix caching off); the caller computes from
        `table.cached_tokens` on and releases the table in every case."""
        table = PageTable()
        if not self.prefix_caching:
            return table
        # One pack for the whole prompt, then a bytes slice a page.
        ids, step = id_bytes(prompt), 4 * PAGE_TOKENS
        prompt = prompt.tolist() if isinstance(prompt, np.ndarray) else [int(t) for t in prompt]
        lookup, entries, refs, unlist = self._by_key.get, self._entries, self._refs, self._lru.pop
        pages, parent = table.pages, ROOT
        for i in range((len(prompt) - 1) // PAGE_TOKENS):
            page = lookup((parent, ids[i * step : (i + 1) * step]))
            if page is None:
                break
            unlist(page, None)  # one more reference: out of the LRU if it was unreferenced
            refs[page] += 1
            pages.append(page)
            parent = entries[page].serial
        n = len(table.pages) * PAGE_TOKENS
        table.tokens, table.cached_tokens = prompt[:n], n
        table._sealed, table._parent = len(table.pages), parent
        self._lookup_tokens += len(prompt)
        self._hit_tokens += n
        return table

    def reserve(self, table: PageTable, length: int) -> None:
        """Grow `table` until it covers positions [0, length): free pages first, then the least
        recently used cached ones. All or nothing: ContextError when the pool cannot."""
        needed = -(-length // PAGE_TOKENS) - len(table.pages)
        if needed <= 0:
            return
        if needed > len(self._free) + len(self._lru):
            raise ContextError(
                f"KV cache full: {length} positions need {needed} more {PAGE_TOKENS}-token "
                f"pages; {len(self._free)} free and {len(self._lru)} cached of {self.num_pages}, "
                f"the other {self.pages_held} held by running sequences"
            )
        for _ in range(needed):
            page = self._free.pop() if self._free else self._evict()
            self._refs[page] = 1
            table.pages.append(page)

    def commit(self, table: PageTable, tokens: Sequence[int]) -> None:
        """The K/V of `tokens` at positions len(table.tokens).. are written: record them and
        seal every page they complete."""
        end = len(table.tokens) + len(tokens)
        if end > len(table.pages) * PAGE_TOKENS:
            raise ValueError(
                f"commit up to position {end} runs past the {len(table.pages)} pages reserved"
            )
        table.tokens.extend(map(int, tokens))
        if not self.prefix_caching or end < (table._sealed + 1) * PAGE_TOKENS:
            return
        # The completed pages' ids packed once, then a slice each.
        first, step = table._sealed * PAGE_TOKENS, 4 * PAGE_TOKENS
        data = id_bytes(table.tokens[first : end - end % PAGE_TOKENS])
        for at in range(0, len(data), step):
            self._seal(table, data[at : at + step])

    def release(self, table: PageTable) -> None:
        """Drop the table's references, tail first (sealed pages stay cached); empties it."""
        for page in reversed(table.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._entries[page] is None:
                    self._free.append(page)
                else:
                    self._lru[page] = None
        table.pages.clear()

    def clear_cache(self) -> None:
        """Forget every cached page (they become free): for whoever writes K/V outside the
        tables (host-driven decode steps over the whole pool)."""
        while self._lru:
            self._free.append(self._evict())

    # -- internals ---------------------------------------------------------------------------
    def _evict(self) -> int:
        """The least recently used cached page, forgotten by the cache."""
        page, _ = self._lru.popitem(last=False)
        del self._by_key[self._entries[page].key]
        self._entries[page] = None
        self._evictions += 1
        return page

    def _seal(self, table: PageTable, data: bytes) -> None:
        """Enter the table's next full page, whose ids' bytes are `data`, into the cache. When
        its key is already there, the same ids after the same chain were computed twice (two
        sequences at once): the page stays private (freed at release) and the chain continues
        through the cached one."""
        i = table._sealed
        table._sealed += 1
        key = (table._parent, data)
        page = self._by_key.get(key)
        if page is None:
            page = table.pages[i]
            self._entries[page] = CachedPage(key[1], next(self._serials), key[0])
            self._by_key[key] = page
        table._parent = self._entries[page].serial
