"""CudaBackend: our kernels on one sm_90 GPU (nanoqwen.backend.Backend).

Life of a generation (batch 1):

    load      weights -> device (q/k/v and gate/up stacked at upload), KV pool sized from
              max_context (refused at start-up with needed vs free bytes), RoPE table (float64
              on the host), decode state + mapped host ring buffer
    prefill   prefill.PrefillKernels: tensor-core INT4 GEMMs + causal attention over the prompt,
              our token-parallel kernels around them (embed, RMSNorm, RoPE + page write),
              launched with PDL; the last layer writes every token's K/V but runs the last
              token alone through the decode kernels; lm_head + sampler on that row give the
              first token
    decode    ONE graph launch for the whole generation: a conditional while node whose body is
              the decode step (embed, 28 x [qkv + RoPE + K/V page write, split attention + merge,
              o, gate/up, down], lm_head, sampler). Token, position, step and the stop flag live
              in device memory and are advanced by the sampler kernel, which also writes each
              token to a mapped host ring and sets the loop condition. The host only reads the
              ring to stream tokens. Pages for prompt + max_tokens are reserved before the
              launch, so the graph never changes.
    fallback  if the while node cannot be built, a one-step graph is launched back to back
              (steps queued on the stream; same device-side state).

After a sticky CUDA error the Gpu is marked broken and every call raises DeviceError.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator, Sequence

import numpy as np

from .config import ModelConfig
from .cuda import jit
from .cuda.device import Gpu, check
from .cuda.kernels import (
    MAX_EOS,
    S_EOS0,
    S_MAX_NEW,
    S_NUM_EOS,
    S_POS,
    S_SEED_HI,
    S_SEED_LO,
    S_TEMP,
    S_TOKEN,
    S_TOP_K,
    S_TOP_P,
    STATE_WORDS,
    DecodeKernels,
)
from .errors import ContextError, DeviceError
from .prefill import PrefillKernels
from .sampling import SamplingParams

PAGE = jit.PAGE_TOKENS
MEMORY_MARGIN = 1 << 30  # keep 1 GiB free for prefill scratch and the driver
POLL_S = 20e-6  # host ring poll interval while a generation graph runs


class _Layer:
    """Device addresses of one decoder layer's weights (stacked where fused)."""

    __slots__ = ("in_norm", "post_norm", "qkv_w", "qkv_s", "qkv_b", "o_w", "o_s", "gu_w",
                 "gu_s", "d_w", "d_s", "kc", "vc")  # fmt: skip


class CudaBackend:
    name = "cuda"

    def __init__(self, file, max_context: int = 32768, *, pdl: bool = True, graph: str = "while"):
        cfg: ModelConfig = file.config
        self.config, self.file = cfg, file
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise ContextError(
                f"max_context {max_context} must be in [1, {cfg.max_position_embeddings}]"
            )
        self.max_context = max_context
        self.gpu = Gpu()
        self._free_at_start = self.gpu.mem_info()[0]  # the context exists; nothing of ours yet
        self.k = DecodeKernels(self.gpu, cfg, pdl=pdl)
        # Built here, not at the first prompt: on a cold kernel cache NVRTC takes ~5 s for the
        # prefill kernels, which a server's first request would otherwise wait for.
        self._prefill = PrefillKernels(cfg, self.gpu, pdl=pdl)
        self.graph_mode = graph
        self._pages_in_use = 0
        self._graphs: dict[str, object] = {}
        self._pbufs: dict[str, object] = {}
        self._pcap = 0
        before = self.gpu.live_bytes()  # the kernels' own buffers count as workspace
        self._upload_weights()
        self.weight_bytes = self.gpu.live_bytes() - before
        self._alloc_runtime()

    # -- load -----------------------------------------------------------------------------------
    def _put(self, array: np.ndarray, what: str) -> int:
        buf = self.gpu.alloc(array.nbytes, what)
        self.gpu.upload(buf.ptr, array)
        return buf.ptr

    def _upload_weights(self) -> None:
        cfg, f = self.config, self.file
        self.embed = self._put(f.tensor("embed_tokens"), "embed_tokens")
        self.final_norm = self._put(f.tensor("final_norm"), "final_norm")
        lm = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        self.lm_head = self.embed if cfg.tie_word_embeddings else self._put(f.tensor(lm), lm)
        self.layers = []
        for i in range(cfg.num_layers):
            p, L = f"layers.{i}.", _Layer()

            def t(name: str, _p: str = p) -> np.ndarray:
                return f.tensor(_p + name)

            L.in_norm = self._put(t("input_norm"), p + "input_norm")
            L.post_norm = self._put(t("post_attn_norm"), p + "post_attn_norm")
            qkv = ("q_proj", "k_proj", "v_proj")
            L.qkv_w = self._put(np.concatenate([t(n + ".qweight") for n in qkv]), p + "qkv.w")
            L.qkv_s = self._put(np.concatenate([t(n + ".scales") for n in qkv]), p + "qkv.s")
            L.qkv_b = self._put(np.concatenate([t(n + ".bias") for n in qkv]), p + "qkv.b")
            L.o_w = self._put(t("o_proj.qweight"), p + "o.w")
            L.o_s = self._put(t("o_proj.scales"), p + "o.s")
            gu = ("gate_proj", "up_proj")  # stacked [gate; up]: the SwiGLU kernels' layout
            L.gu_w = self._put(np.concatenate([t(n + ".qweight") for n in gu]), p + "gu.w")
            L.gu_s = self._put(np.concatenate([t(n + ".scales") for n in gu]), p + "gu.s")
            L.d_w = self._put(t("down_proj.qweight"), p + "down.w")
            L.d_s = self._put(t("down_proj.scales"), p + "down.s")
            self.layers.append(L)

    def _alloc_runtime(self) -> None:
        cfg, gpu = self.config, self.gpu
        self.num_pages = -(-self.max_context // PAGE)
        layer_bytes = self.num_pages * PAGE * cfg.kv_size * 2
        need = cfg.num_layers * 2 * layer_bytes
        free, total = gpu.mem_info()
        if need + MEMORY_MARGIN > free:
            raise DeviceError(
                f"KV cache for max_context {self.max_context} needs {need} bytes "
                f"(+{MEMORY_MARGIN} margin) but only {free} of {total} bytes are free; "
                "lower max_context"
            )
        for L in self.layers:
            L.kc = gpu.alloc(layer_bytes, "k cache").ptr
            L.vc = gpu.alloc(layer_bytes, "v cache").ptr
        self.kv_bytes = need
        # Single sequence: logical page i -> physical page i; reserved per generation.
        self.pages = self._put(np.arange(self.num_pages, dtype=np.int32), "page table")
        half, dt = cfg.head_dim // 2, np.float64
        inv = cfg.rope_theta ** (-np.arange(half, dtype=dt) / half)
        ang = np.arange(self.max_context, dtype=dt)[:, None] * inv[None, :]
        rope = np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)
        self.rope = self._put(rope, "rope table")  # [max_context, D/2, 2]
        a = lambda n, w: gpu.alloc(n, w).ptr  # noqa: E731
        self.x = a(cfg.hidden_size * 2, "x")
        self.q = a(cfg.q_size * 2, "q")
        self.attn = a(cfg.q_size * 2, "attn")
        self.mlp = a(cfg.intermediate_size * 2, "mlp")
        self.logits_buf = a(cfg.vocab_size * 4, "logits")
        self.key = a(8, "argmax key")
        self.state = a(STATE_WORDS * 4, "state")
        self.ring = a(self.max_context * 4, "ring")
        self.part_ml = a(cfg.num_heads * jit.ATTN_SPLITS * 2 * 4, "attn m/l")
        self.part_acc = a(cfg.num_heads * jit.ATTN_SPLITS * cfg.head_dim * 4, "attn acc")
        self.attn_count = a(cfg.num_kv_heads * 4, "attn counters")  # last-CTA semaphores
        gpu.memset(self.attn_count, 0, cfg.num_kv_heads * 4)  # once: each launch re-zeroes
        self.zero = self._put(np.zeros(4, np.int32), "zero")
        gpu.memset(self.key, 0, 8)
        # Mapped pinned host memory: the cancel flag, [count, ring...]; then the staging of a
        # generation's inputs (decode state, prompt ids), copied to the device asynchronously:
        # every entry point ends on a stream sync, so no copy from it is pending when the next
        # one writes it (gpu.upload syncs the stream twice a call, on the TTFT's path).
        from cuda.bindings import driver

        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        n = self.max_context + 2
        total = n + STATE_WORDS + self.max_context
        self._host = int(check(driver.cuMemHostAlloc(total * 4, flags), "cuMemHostAlloc"))
        whole = np.ctypeslib.as_array((ctypes.c_int32 * total).from_address(self._host))
        self._host_view, self._stage = whole[:n], whole[n:]
        self._stage_ptr = self._host + 4 * n
        dev = int(check(driver.cuMemHostGetDevicePointer(self._host, 0), "HostGetDevicePointer"))
        self.host_cancel, self.host_ring = dev, dev + 8  # word 0 cancel, word 1 count, 2.. ring
        gpu.sync("load")

    # -- one decode step (launch list; captured into graphs) -----------------------------------
    def _layer_step(self, L: _Layer, s) -> None:
        pos = self.state + 4 * S_POS
        self.k.qkv_rope(self.x, L.in_norm, L.qkv_w, L.qkv_s, L.qkv_b, pos, self.rope, self.pages,
                        L.kc, L.vc, self.q, stream=s)  # fmt: skip
        self._token_tail(L, self.q, self.x, s)

    def _token_tail(self, L: _Layer, q: int, x: int, s=None) -> None:
        """Layer L after its q/k/v for one token, at position state[S_POS] (its K/V already in
        the pages): attention of q (fp16 [heads, D]), o, gate/up, down; x (fp16 [H], the
        token's residual row) updated in place. The decode step, and the prefill's last
        layer for the last token."""
        cfg, k = self.config, self.k
        k.attention(q, L.kc, L.vc, self.pages, self.state + 4 * S_POS, self.part_ml,
                    self.part_acc, self.attn_count, self.attn, stream=s)  # fmt: skip
        k.gemv("o", self.attn, 0, L.o_w, L.o_s, x, cfg.hidden_size, stream=s)
        k.gemv("gate_up", x, L.post_norm, L.gu_w, L.gu_s, self.mlp, cfg.intermediate_size,
               stream=s)  # fmt: skip
        k.gemv("down", self.mlp, 0, L.d_w, L.d_s, x, cfg.hidden_size, stream=s)

    def _step(self, s, cond=0, sample: bool = True) -> None:
        self.k.embed(self.state + 4 * S_TOKEN, self.embed, self.x, 1, stream=s)
        for L in self.layers:
            self._layer_step(L, s)
        self.k.lm_head(self.x, self.final_norm, self.lm_head, self.logits_buf, self.key, stream=s)
        if sample:
            self.k.sample(self.logits_buf, self.key, self.state, self.ring, self.host_ring,
                          self.host_cancel, cond, stream=s)  # fmt: skip

    def _graph(self, mode: str):
        """Build (once) the generation graph: "while" (one launch runs until done) or "step"."""
        if mode in self._graphs:
            return self._graphs[mode]
        try:
            return self._build_graph(mode)
        except DeviceError:
            if self.gpu.broken or not self.k.pdl:
                raise
            self.k.pdl = False  # the driver refused PDL edges in this graph: build without
            return self._build_graph(mode)

    def _build_graph(self, mode: str):
        with self.gpu.guard(f"build {mode} graph"):
            gb = self.gpu.stream.create_graph_builder().begin_building()
            if mode == "while":
                cond = gb.create_condition(default_value=1)
                body = gb.while_loop(cond).begin_building()
                self._step(body, cond)
                body.end_building()
            else:
                self._step(gb, 0)
            graph = gb.end_building().complete()
            graph.upload(self.gpu.stream)
        self._graphs[mode] = graph
        return graph

    # -- prefill ----------------------------------------------------------------------------
    def _prefill_buffers(self, T: int) -> dict:
        if T <= self._pcap:
            return self._pbufs
        for b in self._pbufs.values():
            b.free()
        cfg, a = self.config, self.gpu.alloc
        cap = max(T, 64)
        self._pbufs = {
            "ids": a(cap * 4, "prefill ids"),
            "x": a(cap * cfg.hidden_size * 2, "prefill x"),
            "h": a(cap * cfg.hidden_size * 2, "prefill h"),
            "qkv": a(cap * (cfg.q_size + 2 * cfg.kv_size) * 2, "prefill qkv"),
            "q": a(cap * cfg.q_size * 2, "prefill q"),
            "kk": a(cap * cfg.kv_size * 2, "prefill k"),
            "vv": a(cap * cfg.kv_size * 2, "prefill v"),
            "attn": a(cap * cfg.q_size * 2, "prefill attn"),
            "mlp": a(cap * cfg.intermediate_size * 2, "prefill mlp"),
        }
        self._pcap = cap
        return self._pbufs

    def _prefill_hidden(self, ids: np.ndarray, last_only: bool = False) -> int:
        """Run the prompt (positions 0..T-1) through all layers; KV pages written.
        Returns the device address of x fp16 [T, H] (pre final-norm hidden states).

        last_only: only row T - 1 of x is wanted (generation's first token). The last layer
        then writes every token's K/V but takes the last token alone through attention, o
        and the MLP, with the decode kernels (its attention reads the pages at state[S_POS],
        which _init_state set to T - 1): nothing reads the other rows of its output. At
        T = 512 that took ~0.5 ms off the 7B's TTFT (H200, tools/ttft_profile.py).

        RMSNorm and RoPE + K/V stay launches of their own: fused into the wgmma GEMMs (x read
        raw, the norm weights multiplied into the dequantized weights, the factors from
        per-128-column sums of squares; RoPE and the page writes in the q/k/v epilogue) the
        7B's TTFT read 13.63 / 13.84 ms against 13.04 / 13.02 (H200, interleaved; branch
        prefill-fused-epilogue-experiment): the extra work in the consumers' k-loop cost
        gate_up more than the launches it saved. A second form left the k-loop alone (x
        written pre-multiplied by the next norm's weights, rsqrt applied in the epilogue,
        correct on the GPU tests): 13.005 / 13.023 ms against 12.914 / 12.928 apart (same run,
        tools/ttft_profile.py, 2026-11-30)."""
        cfg, k, pk, s = self.config, self.k, self._prefill, self.gpu.stream
        T, h, qkv_n = len(ids), cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        b = {n: v.ptr for n, v in self._prefill_buffers(T).items()}
        self._stage[STATE_WORDS : STATE_WORDS + T] = ids
        self.gpu.upload_async(b["ids"], self._stage_ptr + 4 * STATE_WORDS, 4 * T)
        k.embed(b["ids"], self.embed, b["x"], T)
        for i, L in enumerate(self.layers):
            last = last_only and i == len(self.layers) - 1
            k.rmsnorm(b["x"], L.in_norm, b["h"], T)
            pk.gemm(b["h"], L.qkv_w, L.qkv_s, L.qkv_b, b["qkv"], T, qkv_n, h, stream=s)
            k_out, v_out = (0, 0) if last else (b["kk"], b["vv"])
            k.rope_kv(b["qkv"], self.zero, self.rope, self.pages, L.kc, L.vc, b["q"], k_out,
                      v_out, T)  # fmt: skip
            if last:
                self._token_tail(L, b["q"] + (T - 1) * cfg.q_size * 2, b["x"] + (T - 1) * h * 2)
                break
            pk.attention(b["q"], b["kk"], b["vv"], b["attn"], T, stream=s)
            pk.gemm(b["attn"], L.o_w, L.o_s, None, b["x"], T, h, cfg.q_size, residual=b["x"],
                    stream=s)  # fmt: skip
            k.rmsnorm(b["x"], L.post_norm, b["h"], T)
            pk.gemm(b["h"], L.gu_w, L.gu_s, None, b["mlp"], T, 2 * cfg.intermediate_size, h,
                    swiglu=True, stream=s)  # fmt: skip
            pk.gemm(b["mlp"], L.d_w, L.d_s, None, b["x"], T, h, cfg.intermediate_size,
                    residual=b["x"], stream=s)  # fmt: skip
        return b["x"]

    def memory(self) -> dict:
        """Device memory: what we hold (weights, KV cache, workspace = decode buffers, RoPE and
        page tables, the prefill GEMMs' stream-K parts, prefill scratch sized by the longest
        prompt so far) against what the
        device lost since the context was made (kernel images, allocator slack included)."""
        live, (free, _) = self.gpu.live_bytes(), self.gpu.mem_info()
        used = self._free_at_start - free
        return {
            "weights": self.weight_bytes,
            "kv_cache": self.kv_bytes,
            "workspace": live - self.weight_bytes - self.kv_bytes,
            "accounted": live,
            "device_used": used,
            "unaccounted_pct": 100.0 * (used - live) / live,
        }

    # -- Backend API ------------------------------------------------------------------------
    @property
    def kv_pages_in_use(self) -> int:
        return self._pages_in_use

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens < 1 or prompt_tokens + max_tokens > self.max_context:
            raise ContextError(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} does not fit "
                f"max_context {self.max_context}"
            )

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1 or arr.size == 0:
            raise ContextError("token ids must be a non-empty 1-D sequence")
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ContextError(f"token id out of range [0, {self.config.vocab_size})")
        return arr

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits float32 [T, V] through the prefill path."""
        self.gpu.ensure_ok()
        ids = self._check_ids(token_ids)
        self.check_fits(len(ids), 0)
        T, V, h = len(ids), self.config.vocab_size, self.config.hidden_size
        out = np.empty((T, V), np.float32)
        with self.gpu.guard("logits"):
            x = self._prefill_hidden(ids)
            for t in range(T):
                self.k.lm_head(x + t * h * 2, self.final_norm, self.lm_head, self.logits_buf,
                               self.key)  # fmt: skip
                self.gpu.download(self.logits_buf, out[t])
            self.gpu.memset(self.key, 0, 8)
        return out

    def decode_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits float32 [T, V] through the decode step (one token at a time,
        state patched from the host): validates the decode kernels, not a serving path."""
        self.gpu.ensure_ok()
        ids = self._check_ids(token_ids)
        self.check_fits(len(ids), 0)
        out = np.empty((len(ids), self.config.vocab_size), np.float32)
        state = np.zeros(STATE_WORDS, np.int32)
        with self.gpu.guard("decode_logits"):
            for t, tok in enumerate(ids):
                state[S_TOKEN], state[S_POS] = tok, t
                self.gpu.upload(self.state, state)
                self._step(self.gpu.stream, sample=False)
                self.gpu.download(self.logits_buf, out[t])
            self.gpu.memset(self.key, 0, 8)
        return out

    def _init_state(self, T: int, params: SamplingParams, stop_ids) -> None:
        st = self._stage[:STATE_WORDS]
        st[:] = 0
        st[S_POS], st[S_MAX_NEW] = T - 1, params.max_tokens
        st[S_TOP_K] = params.top_k
        st[S_TEMP] = np.float32(params.temperature).view(np.int32)
        st[S_TOP_P] = np.float32(params.top_p).view(np.int32)
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy)
        seed &= (1 << 64) - 1
        st[S_SEED_LO] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
        st[S_SEED_HI] = np.uint32(seed >> 32).view(np.int32)
        eos = sorted(stop_ids)[:MAX_EOS]  # more stop ids: the host cancels (see _generate)
        st[S_NUM_EOS] = len(eos)
        st[S_EOS0 : S_EOS0 + len(eos)] = eos
        self.gpu.upload_async(self.state, self._stage_ptr, 4 * STATE_WORDS)
        self._host_view[:] = 0

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        self.gpu.ensure_ok()
        ids = self._check_ids(prompt_ids)
        self.check_fits(len(ids), params.max_tokens)
        return self._generate(ids, params, frozenset(stop_ids))

    def _generate(self, ids: np.ndarray, params: SamplingParams, stop_ids) -> Iterator[int]:
        T, h = len(ids), self.config.hidden_size
        self._pages_in_use = -(-(T + params.max_tokens) // PAGE)  # reserved up front
        graph_running = False
        try:
            with self.gpu.guard("prefill"):
                self._init_state(T, params, stop_ids)
                x = self._prefill_hidden(ids, last_only=True)
                self.k.lm_head(x + (T - 1) * h * 2, self.final_norm, self.lm_head,
                               self.logits_buf, self.key)  # fmt: skip
                self.k.sample(self.logits_buf, self.key, self.state, self.ring, self.host_ring,
                              self.host_cancel, 0)  # fmt: skip
                self.gpu.sync("prefill")
            first = int(self._host_view[2])
            yield first
            if first in stop_ids or params.max_tokens == 1:
                return
            with self.gpu.guard("decode launch"):
                self._launch_decode(params.max_tokens - 1)
            graph_running = True
            yield from self._stream_tokens(params.max_tokens, stop_ids)
            graph_running = False
        finally:
            if graph_running:
                self._host_view[0] = 1  # cancel: the sampler stops after the current step
            try:
                self.gpu.sync("generation end")
            finally:
                self._pages_in_use = 0

    def _launch_decode(self, steps: int) -> None:
        if self.graph_mode == "while":
            try:
                self._graph("while").launch(self.gpu.stream)
                return
            except DeviceError:
                if self.gpu.broken:
                    raise
                self.graph_mode = "step"  # the driver refused the conditional node
        graph = self._graph("step")
        for _ in range(steps):  # queued back to back; the host only reads the ring
            graph.launch(self.gpu.stream)

    def _stream_tokens(self, max_tokens: int, stop_ids) -> Iterator[int]:
        from cuda.bindings import driver

        seen = 1
        view = self._host_view
        while True:
            count = int(view[1])
            while seen < count:
                token = int(view[2 + seen])
                seen += 1
                yield token
                if token in stop_ids or seen >= max_tokens:
                    return
            (err,) = driver.cuStreamQuery(self.gpu.stream.handle)
            if err == driver.CUresult.CUDA_SUCCESS and int(view[1]) == seen:
                return  # the graph stopped (eos within the device's list, or cancelled)
            if err not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_NOT_READY):
                check((err,), "decode graph")
            time.sleep(POLL_S)

    def close(self) -> None:
        from cuda.bindings import driver

        if getattr(self, "_host", 0):
            try:
                self.gpu.sync("close")
            finally:
                driver.cuMemFreeHost(self._host)
                self._host = 0
        self.gpu.close()
