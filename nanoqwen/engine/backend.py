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

from collections.abc import Iterator, Sequence

import numpy as np

from ..backend import DEFAULT_CONTEXT, check_fits, check_max_context, check_prompt
from ..cuda.decode import DecodeKernels
from ..cuda.device import Gpu
from ..cuda.launcher import Launch
from ..cuda.prefill import PrefillKernels
from ..cuda.registry import DEFAULT_GEOMETRY, Geometry
from ..kv_pages import KVStats, PageTable
from ..sampling import SamplingParams
from ..speculative import SpecStats, SpeculativeConfig
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
        pdl: bool = True,
        prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """file: an open NanoqwenFile; geometry: the kernels' (registry.Geometry; dev/
        kernel_tune.py passes overrides); pdl: programmatic dependent launch between kernels;
        prefix_caching: generate() reuses the K/V of earlier prompts' and replies' full pages;
        speculative: generations verify n-gram drafts (speculate.py; None: one token a
        step). `spec_stats` holds the last generation's SpecStats. `speculative` may be set
        to None between generations, which then run the plain loop on the same engine
        (dev/speculate_e2e.py); otherwise the speculative graphs run."""
        cfg = file.config
        self.config, self.file = cfg, file
        self.max_context = check_max_context(max_context, cfg)
        if speculative:
            check_speculation_head(file.lm_head)  # before anything is allocated
        self.speculative = speculative
        self.spec_stats = SpecStats()
        positions = kv_positions(self.max_context, speculative)
        self.gpu = Gpu()
        free, total = self.gpu.mem_info()  # the context exists; nothing of ours yet
        self._free_at_start = free
        self.plan = check_memory(cfg, self.max_context, free, total, self.gpu.num_sms, geometry,
                                 speculative, file.lm_head)  # fmt: skip
        self.kernels = DecodeKernels(self.gpu, cfg, geometry, pdl=pdl, rows=bool(speculative))
        # Built here, not at the first prompt: on a cold kernel cache NVRTC takes seconds,
        # which a server's first request would otherwise wait for.
        self.prefill_kernels = PrefillKernels(self.gpu, cfg, geometry, pdl=pdl)
        self.weights = upload_weights(self.gpu, file)
        self.kv = KVCache(self.gpu, cfg, positions, prefix_caching)
        self.loop = DecodeLoop(self.gpu, self.kernels, max_context, positions)
        self.forward = Forward(self.gpu, cfg, self.kernels, self.prefill_kernels, self.weights,
                               self.kv, self.loop, positions)  # fmt: skip
        self.spec = SpecLoop(self, speculative) if speculative else None
        self.cached_tokens = 0  # of the running (or last) generation's prompt
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
        """fp16 [H]: the residual row after the first `layers` layers of the decode step for
        `token` at `pos` (its K/V written into the pages at pos)."""
        self.set_decode_state(DecodeState(token=token, pos=pos))
        out = np.empty(self.config.hidden_size, np.float16)
        with self.gpu.guard("decode_hidden"):
            self.forward.embed_token()
            for i in range(layers):
                self.forward.layer(i)
            return self.gpu.download(self.forward.x, out)

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
        return self._generate(ids, params, frozenset(stop_ids))

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

    def close(self) -> None:
        """Wait for the GPU, then free everything (the Gpu owns every buffer)."""
        try:
            self.gpu.sync("close")
        finally:
            self.gpu.close()
