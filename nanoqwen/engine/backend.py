"""CudaBackend: our kernels on one sm_90 GPU (nanoqwen.backend.Backend), and the engine's
public seam for the validation ladder, the benchmark and dev/.

Life of a generation (batch 1):

    load      the memory plan (memory.py: weights, KV pool for max_context, prefill scratch
              and workspace, decode buffers, checked against the free bytes before anything
              is allocated: refused with needed against free), the kernels (registry:
              compiled or from the cache), the weights (weights.py), the KV pool (kv_cache.py),
              the decode state and the host ring (decode_loop.py)
    pages     the block manager (nanoqwen.kv_pages, the reference's too) admits the prompt
              with its longest cached prefix (prefix caching: `cached_tokens` of it are not
              computed again) and takes the pages for prompt + max_tokens at once, so the
              graph never changes; the table goes to the device through the staging area,
              queued before the prefill
    prefill   the prompt's uncached tokens through forward.prefill (tensor-core GEMMs, causal
              attention over the cached and the new K/V, launched with PDL; its last layer
              takes the last token alone), lm_head and the sampler on that row: the first
              token
    decode    ONE launch of the generation graph (decode_loop.DecodeLoop: a while loop over
              forward.decode_step + the sampler) until a stop id, max_tokens or cancel; the
              host streams tokens from the mapped ring. After the final sync the prompt and the
              generated tokens whose K/V the graph wrote are committed to the prefix cache
              (ring tokens 0 .. count - 2: the last sampled token never runs through a decode
              step), so a chat's next turn, which resends the reply, reuses them too.
    batch     continuous batching (the scheduler in nanoqwen.batching drives it): the
              block_manager admits a sequence, prefill_chunk runs its prompt in chunks
              (forward.prefill into the sequence's table, or a chunk of at most max_batch
              ids as rows of the batch step; the first token sampled from the last row with
              the sequence's own params), decode_launch queues one token of up to
              max_batch sequences through ONE pass over the weights (batch.BatchStep: a
              graph per bucket of rows; read later, so the next step can be queued behind
              it first), release_slot forgets a leaving sequence's rows. The
              KV pool (kv_tokens positions) is shared by every sequence; a sequence is at
              most max_context positions long. Without speculative drafts; an int8 head
              turns the batch path off (max_batch 0: lm_head_rows reads fp16 rows).
    speculate with speculative=SpeculativeConfig(...), every generation runs a speculative
              graph instead (speculate.SpecLoop: n-gram drafts verified over 1 + K rows,
              several tokens a step; greedy: the same tokens as the plain loop, sampled:
              speculative sampling, each token distributed as the plain loop draws it); the
              ring, cancellation, max_tokens, stop ids and the prefix-cache commit are the
              plain loop's.

The seam: `forward` (decode_step, layer, prefill, the activations), `loop` (the state, the
sampler, the graph), `kernels` / `prefill_kernels` (the launchers), `weights`, `kv`; and the
methods below. After a sticky CUDA error the Gpu is marked broken and every call raises
DeviceError.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import numpy as np

from ..backend import DEFAULT_CONTEXT, check_fits, check_max_context, check_prompt
from ..config import PAGE_TOKENS
from ..cuda.decode import DecodeKernels
from ..cuda.device import Gpu
from ..cuda.launcher import Launch
from ..cuda.prefill import PrefillKernels
from ..cuda.registry import (
    DEFAULT_GEOMETRY,
    MAX_ROWS,
    Geometry,
    StateWord,
    k_cache_geometry,
    k_cache_name,
)
from ..errors import ContextError, NanoqwenError
from ..kv_pages import BlockManager, KVStats, PageTable
from ..sampling import SamplingParams
from ..speculative import SpecStats, SpeculativeConfig
from .batch import BatchPending, BatchStep, Row, chained_rows, decode_rows
from .decode_loop import DecodeLoop, DecodeState
from .forward import Forward
from .kv_cache import KVCache
from .memory import check_memory
from .speculate import SpecLoop, kv_positions, reserved_tokens
from .weights import check_speculation_head, upload_weights


class CudaBackend:
    name = "cuda"

    def __init__(
        self,
        file,
        max_context: int = DEFAULT_CONTEXT["cuda"],
        *,
        geometry: Geometry = DEFAULT_GEOMETRY,
        k_cache: str | None = None,
        pdl: bool = True,
        prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
        kv_tokens: int | None = None,
        max_batch: int = MAX_ROWS,
    ) -> None:
        """file: an open NanoqwenFile; geometry: the kernels' (registry.Geometry; dev/
        kernel_tune.py passes overrides); k_cache: the K cache's format (registry.K_CACHE:
        "fp16x2" holds k to ~22 bits, "fp16" takes 2/3 of the KV bytes), which sets
        geometry's K fields (None: the geometry's own; DEFAULT_GEOMETRY's is fp16x2); pdl:
        programmatic dependent launch between kernels; prefix_caching: generate() reuses the
        K/V of earlier prompts' and replies' full pages; speculative: generations verify
        n-gram drafts (speculate.py; None: one token a step). `spec_stats` holds the last
        generation's SpecStats. `speculative` may be set to None between generations, which
        then run the plain loop on the same engine (dev/speculate_e2e.py); otherwise the
        speculative graphs run. kv_tokens: the KV pool's positions, shared by every sequence
        (None: max_context); max_batch: the most sequences of one decode step (1..16; 0: no
        batch path, nothing of it allocated or compiled; an int8 head forces 0)."""
        cfg = file.config
        self.config, self.file = cfg, file
        if k_cache is not None:
            geometry = k_cache_geometry(k_cache, geometry)
        self.k_cache = k_cache_name(geometry)
        self.max_context = check_max_context(max_context, cfg)
        if speculative:
            check_speculation_head(file.lm_head)  # before anything is allocated
        self.speculative = speculative
        self.spec_stats = SpecStats()
        positions = kv_positions(self.max_context, speculative)
        if kv_tokens is not None and kv_tokens < 1:
            raise NanoqwenError(f"kv_tokens must be >= 1, got {kv_tokens}")
        pool = kv_positions(kv_tokens or self.max_context, speculative)
        if not 0 <= max_batch <= MAX_ROWS:
            raise NanoqwenError(f"max_batch must be 0..{MAX_ROWS}, got {max_batch}")
        self.max_batch = max_batch if file.lm_head == "float16" else 0
        self.gpu = Gpu()
        free, total = self.gpu.mem_info()  # the context exists; nothing of ours yet
        self._free_at_start = free
        self.plan = check_memory(cfg, self.max_context, free, total, self.gpu.num_sms, geometry,
                                 speculative, file.lm_head, kv_tokens,
                                 self.max_batch)  # fmt: skip
        self.kernels = DecodeKernels(self.gpu, cfg, geometry, pdl=pdl,
                                     rows=bool(speculative or self.max_batch))  # fmt: skip
        # Built here, not at the first prompt: on a cold kernel cache NVRTC takes seconds,
        # which a server's first request would otherwise wait for.
        self.prefill_kernels = PrefillKernels(self.gpu, cfg, geometry, pdl=pdl)
        self.weights = upload_weights(self.gpu, file)
        self.kv = KVCache(self.gpu, cfg, pool, geometry.k_parts, prefix_caching)
        self.loop = DecodeLoop(self.gpu, self.kernels, max_context, max(positions, pool))
        self.forward = Forward(self.gpu, cfg, self.kernels, self.prefill_kernels, self.weights,
                               self.kv, self.loop, positions)  # fmt: skip
        self.spec = SpecLoop(self, speculative) if speculative else None
        self.batch = None
        if self.max_batch:
            self.batch = BatchStep(self.gpu, cfg, self.kernels, self.weights, self.kv,
                                   self.forward.rope, self.max_batch, self.max_context)  # fmt: skip
        self.cached_tokens = 0  # of the running (or last) generation's prompt
        self.chunk_logits = 0  # the last sampling prefill_chunk's logits row (device address)
        # generate()'s iterators not yet finished: close() ends them while their memory lives
        self._generations: weakref.WeakSet = weakref.WeakSet()
        self.gpu.sync("load")

    # -- the seam ----------------------------------------------------------------------------
    def decode_step(self, stream=None, cond=0) -> None:
        """Enqueue one whole decode step: the forward of state[TOKEN] at state[POS] and the
        sampler, which advances the state (cond: the generation loop's condition, or 0)."""
        self.forward.decode_step(stream)
        self.loop.sample(self.forward.logits, self.forward.key, stream, cond)

    def set_decode_state(self, state: DecodeState) -> None:
        """Upload the decode state and zero the argmax key (synchronous); the page table maps
        the whole pool (KVCache.map_whole_pool: the engine must be idle)."""
        self.gpu.ensure_ok()
        self.kv.map_whole_pool()
        self.loop.set_state(state)
        self.gpu.memset(self.forward.key, 0, 8)
        self.gpu.sync("set the decode state")

    def record_decode_step(self) -> list[Launch]:
        """Every launch of one decode step (it runs once, from the current state)."""
        launches: list[Launch] = []
        self.kernels.on_launch = launches.append
        try:
            with self.gpu.guard("record a decode step"):
                self.decode_step()
                self.gpu.sync("record a decode step")
        finally:
            self.kernels.on_launch = None
        return launches

    def decode_hidden(self, token: int, pos: int, layers: int) -> np.ndarray:
        """fp32 [H]: the residual row after the first `layers` layers of the decode step for
        `token` at `pos` (its K/V written into the pages at pos)."""
        self.set_decode_state(DecodeState(token=token, pos=pos))
        out = np.empty(self.config.hidden_size, np.float32)
        with self.gpu.guard("decode_hidden"):
            self.forward.embed_token()
            for i in range(layers):
                self.forward.layer(i)
            return self.gpu.download(self.forward.res, out)

    def memory(self) -> dict:
        """Device memory: what we hold (weights, KV cache, workspace = the kernels' own
        buffers, decode buffers, RoPE and page tables, prefill scratch sized by the longest
        prompt so far) against what the device lost since the context was made (kernel
        images, allocator slack included), and the load's plan by part (memory.py)."""
        live, (free, _) = self.gpu.live_bytes(), self.gpu.mem_info()
        used = self._free_at_start - free
        return {
            "weights": self.weights.nbytes,
            "kv_cache": self.kv.nbytes,
            "workspace": live - self.weights.nbytes - self.kv.nbytes,
            "accounted": live,
            "device_used": used,
            "unaccounted_pct": 100.0 * (used - live) / live,
            "planned": dict(self.plan.parts),
        }

    # -- Backend API ------------------------------------------------------------------------
    @property
    def kv_pages_in_use(self) -> int:
        return self.kv.pages.pages_held

    @property
    def kv_stats(self) -> KVStats:
        return self.kv.pages.stats

    def _map_pages(self, table: PageTable, tokens: int) -> None:
        """Grow `table` to cover `tokens` positions (ContextError when the pool cannot) and
        queue its upload into the device page table through the staging area (no sync)."""
        self.kv.pages.reserve(table, tokens)
        with self.gpu.guard("page table upload"):
            self.loop.stage_pages(table.pages, self.kv.page_table)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits float32 [T, V] through the prefill path."""
        self.gpu.ensure_ok()
        ids = check_prompt(token_ids, self.config.vocab_size)
        check_fits(len(ids), 0, self.max_context)
        T, h = len(ids), self.config.hidden_size
        out = np.empty((T, self.config.vocab_size), np.float32)
        table = PageTable()  # teacher forcing commits nothing: the cache never sees it
        try:
            self._map_pages(table, T)
            with self.gpu.guard("logits"):
                self.loop.stage_ids(ids, self.forward.scratch(T)["ids"])
                x = self.forward.prefill(T)
                for t in range(T):
                    self.forward.head(x + t * h * 2)
                    self.gpu.download(self.forward.logits, out[t])
                self.gpu.memset(self.forward.key, 0, 8)
                self.gpu.sync("logits")
        finally:
            self.kv.pages.release(table)
        return out

    def decode_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits float32 [T, V] through the decode step (one token at a time,
        state set from the host): validates the decode kernels, not a serving path."""
        self.gpu.ensure_ok()
        ids = check_prompt(token_ids, self.config.vocab_size)
        check_fits(len(ids), 0, self.max_context)
        out = np.empty((len(ids), self.config.vocab_size), np.float32)
        table = PageTable()
        try:
            self._map_pages(table, len(ids))
            with self.gpu.guard("decode_logits"):
                for t, tok in enumerate(ids):
                    self.loop.set_state(DecodeState(token=int(tok), pos=t))
                    self.forward.decode_step()
                    self.gpu.download(self.forward.logits, out[t])
                self.gpu.memset(self.forward.key, 0, 8)
                self.gpu.sync("decode_logits")
        finally:
            self.kv.pages.release(table)
        return out

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        self.gpu.ensure_ok()
        ids = check_prompt(prompt_ids, self.config.vocab_size)
        check_fits(len(ids), params.max_tokens, self.max_context)
        generation = self._generate(ids, params, frozenset(stop_ids))
        self._generations.add(generation)
        return generation

    def _generate(self, ids: np.ndarray, params: SamplingParams, stop_ids) -> Iterator[int]:
        T, h, f, loop = len(ids), self.config.hidden_size, self.forward, self.loop
        spec = self.spec if self.speculative else None
        pages = self.kv.pages
        table = pages.admit(ids)  # holds the longest cached prefix (kv_pages' reuse rule)
        S = self.cached_tokens = table.cached_tokens
        self.spec_stats = SpecStats()
        prefilled = graph_running = ended = False
        try:
            self._map_pages(
                table, reserved_tokens(T, params.max_tokens, spec.spec if spec else None)
            )
            with self.gpu.guard("prefill"):
                loop.begin(DecodeState.for_prompt(T, params, stop_ids))
                scratch_ids = f.scratch(T - S)["ids"]
                if spec is None:
                    loop.stage_ids(ids[S:], scratch_ids)
                else:  # the staging area holds one prompt: stage it once, into the history
                    spec.begin(ids)
                    self.gpu.copy_d2d(scratch_ids, spec.h + 4 * S, 4 * (T - S))
                x = f.prefill(T - S, start=S, last_only=True)
                f.head(x + (T - S - 1) * h * 2)
                loop.sample(f.logits, f.key, ring=spec.first_ring(T) if spec else 0)
                self.gpu.sync("prefill")
            prefilled = True
            first = loop.host.token(0)
            yield first
            if first in stop_ids or params.max_tokens == 1:
                return
            with self.gpu.guard("decode launch"):
                if spec is None:
                    loop.build(lambda s, cond: self.decode_step(s, cond))
                    loop.launch()
                else:
                    spec.launch(params.greedy)
            graph_running = True
            yield from loop.stream_tokens(params.max_tokens, stop_ids)
            graph_running = False
        finally:
            if graph_running:
                loop.host.cancel()  # the loop stops after the current step
            try:
                self.gpu.sync("generation end")
                ended = True
            finally:
                if prefilled and ended:
                    # Committed here, off the first token's path (hashing a 32k prompt's pages
                    # takes milliseconds): the prompt, and every generated token but the last,
                    # whose K/V the graph wrote (speculate.py: the same with speculation).
                    generated = loop.host.tokens(max(loop.host.count - 1, 0))
                    pages.commit(table, [*ids[S:].tolist(), *generated])
                    if spec is not None:
                        self.spec_stats = spec.read_stats()
                pages.release(table)

    # -- batch primitives (the contract of nanoqwen.batching; Sequence fields by duck typing) --
    @property
    def block_manager(self) -> BlockManager:
        """The KV pool's pages (shared with generate(): run one or the other at a time)."""
        return self.kv.pages

    def _check_pages(self, seq, positions: int) -> None:
        if positions > self.max_context:
            raise ContextError(
                f"a sequence of {positions} positions is longer than max_context {self.max_context}"
            )
        have = len(seq.table.pages) * PAGE_TOKENS if seq.table is not None else 0
        if have < positions:
            raise NanoqwenError(
                f"the sequence's table covers {have} positions; {positions} must be reserved"
            )

    def prefill_chunk(self, seq, end: int, sample: bool) -> int | None:
        """ids[seq.kv_len:end] (ids = prompt + tokens) at positions kv_len .. end - 1 into
        seq.table's pages, the earlier positions' K/V read from the pages: a chunk of at most
        max_batch ids as rows of the batch step (batch.py: why), a longer one through
        forward.prefill at start kv_len; seq.kv_len = end. sample: the next token from the
        last row, with seq.params as draw number len(seq.tokens) (the plain loop's counter),
        else None; self.chunk_logits is then that row's logits (fp32 [V], device). One sync."""
        self.gpu.ensure_ok()
        ids = [*seq.prompt, *seq.tokens]
        start = seq.kv_len
        if not 0 <= start < end <= len(ids):
            raise NanoqwenError(f"prefill_chunk: need kv_len {start} < end {end} <= {len(ids)}")
        self._check_pages(seq, end + 1 if sample else end)
        if sample and self.batch is None:
            raise NanoqwenError("prefill_chunk: sampling needs the batch path (max_batch > 0)")
        T = end - start
        chunk = check_prompt(ids[start:end], self.config.vocab_size)
        if self.batch is not None and T <= self.max_batch:
            out = self.batch.step([Row(seq, start + j, int(t), len(seq.tokens))
                                  for j, t in enumerate(chunk)])  # fmt: skip
            self.chunk_logits = self.batch.buf["logits"] + (T - 1) * self.config.vocab_size * 4
            seq.kv_len = end
            return out[-1] if sample else None
        f, token = self.forward, None
        with self.gpu.guard("prefill_chunk"):
            self.loop.stage_pages(seq.table.pages, self.kv.page_table)
            self.loop.stage_ids(chunk, f.scratch(T)["ids"])
            if sample:  # prefill(last_only)'s last layer reads state[POS] on the decode kernels
                self.loop.host.staging[0] = end - 1
                self.gpu.upload_async(self.loop.word(StateWord.POS), self.loop.host.staging_ptr,
                                      4)  # fmt: skip
            x = f.prefill(T, start=start, last_only=sample)
            if sample:
                f.head(x + (T - 1) * self.config.hidden_size * 2)
                self.chunk_logits = f.logits
                self.batch.sample_first(seq, f.logits, f.key)
                token = self.batch.read_first()  # the sync
            else:
                self.gpu.sync("prefill_chunk")
        seq.kv_len = end
        return token

    def decode_launch(self, seqs: Sequence, after: BatchPending | None = None) -> BatchPending:
        """Queue one decode step of every sequence (distinct slots, pages reserved for
        kv_len + 1), kv_len += 1: without `after` each feeds its last token at position kv_len
        (== len(ids) - 1), drawn as draw number len(seq.tokens); with `after` (the step
        launched just before, unread) some of its sequences, in its order, each feeding the
        token that step samples for it (kv_len == len(ids)), draw len(seq.tokens) + 1
        (backend.Backend.decode_launch). No sync: the returned step's tokens() waits and gives
        the tokens in the order given. The rows run by slot order (batch.BatchStep)."""
        self.gpu.ensure_ok()
        if self.batch is None:
            raise NanoqwenError(
                "decode_launch: this engine has no batch path (max_batch 0, or an int8 lm_head)"
            )
        if not 1 <= len(seqs) <= self.max_batch:
            raise NanoqwenError(f"decode_launch: 1..{self.max_batch} sequences, got {len(seqs)}")
        if len({s.slot for s in seqs}) != len(seqs):
            raise NanoqwenError("decode_launch: two sequences share a slot")
        pending = int(after is not None)  # the token `after` samples, not in seq.tokens yet
        for s in seqs:
            if s.kv_len != len(s.prompt) + len(s.tokens) - 1 + pending:
                raise NanoqwenError(
                    f"decode_launch: kv_len {s.kv_len} must be len(ids) "
                    f"{'' if pending else '- 1 '}= {len(s.prompt) + len(s.tokens) - 1 + pending}"
                )
            self._check_pages(s, s.kv_len + 1)
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        by_slot = [seqs[i] for i in order]
        if after is None:
            step = self.batch.launch(decode_rows(by_slot))
        else:  # launch checks that `after` holds them, in its order
            step = self.batch.launch(chained_rows(by_slot), after.step)
        for s in seqs:
            s.kv_len += 1
        return BatchPending(list(seqs), order, step)

    def release_slot(self, seq) -> None:
        """Forget the rows `seq` held (its pages are the caller's to commit and release)."""
        if self.batch is not None:
            self.batch.forget(seq)

    def close(self) -> None:
        """End every generation still suspended, wait for the GPU, then free everything (the
        Gpu owns every buffer).

        A generation's `finally` writes the host ring's cancel word and reads its tokens: the
        ring is pinned memory that Gpu.close() returns to the driver, so a generator left to
        the garbage collector after close() would write into memory that is no longer ours
        (and perhaps another library's by then). Closed here, it cancels, syncs, commits and
        releases its pages while all of that still exists."""
        try:
            for generation in list(self._generations):
                generation.close()
            self.gpu.sync("close")
        finally:
            self.gpu.close()
