"""The model's forward pass on our kernels: the decode step for one token and the prefill of a
prompt. Only launches: no allocation on the decode path, no host sync anywhere.

Decode step (captured into the generation graph), per layer:

    gemv_qkv      RMSNorm + q/k/v + bias + RoPE, K/V written into the pages at state[POS]
    attention     over the pages 0..POS, split along the sequence, merged in one launch
    gemv o        + residual (res in place, fp32; x its fp16 copy)
    gemv gate_up  RMSNorm + SwiGLU
    gemv down     + residual

then lm_head (final RMSNorm + logits + argmax key); the sampler is the loop's (decode_loop).

Prefill of the tokens at positions start .. start + T - 1 (start > 0: a cached prefix whose
K/V are already in the sequence's pages), per layer: RMSNorm, the q/k/v GEMM, RoPE + K/V into
the pages, causal attention over the pages (cached and new keys alike), the o GEMM + residual,
RMSNorm, gate/up GEMM + SwiGLU, down GEMM + residual. When only the last row is wanted (a
generation's first token), the last layer writes every token's K/V but runs the last token
alone through the decode kernels: nothing reads the other rows of its output.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..cuda import registry
from ..cuda.decode import DecodeKernels
from ..cuda.device import Gpu
from ..cuda.prefill import PrefillKernels
from ..cuda.registry import StateWord
from ..rope import rope_table
from .decode_loop import DecodeLoop
from .kv_cache import KVCache
from .weights import Weights


def decode_buffers(config: ModelConfig, max_context: int) -> dict[str, int]:
    """Bytes of Forward's own device buffers (the attention scratch is the kernels'):
    rope float32 [max_context, D/2, 2] (rope_table), res fp32 [H] (the residual stream), x
    fp16 [H] (its copy, what the RMSNorms read), q and attn fp16 [heads, D], mlp fp16 [I],
    logits fp32 [V], the argmax key u64."""
    c = config
    return {
        "rope": max_context * (c.head_dim // 2) * 2 * 4,
        "res": c.hidden_size * 4,
        "x": c.hidden_size * 2,
        "q": c.q_size * 2,
        "attn": c.q_size * 2,
        "mlp": c.intermediate_size * 2,
        "logits": c.vocab_size * 4,
        "key": 8,
    }


def scratch_rows(tokens: int) -> int:
    """Rows of the prefill's buffers for `tokens` new tokens: whole tiles of the widest GEMM
    tile (at least one), so that every GEMM reads its A boxes inside the buffer
    (PrefillKernels.gemm's a_rows)."""
    widest = max(t.tokens for t in registry.GEMM_TILES)
    return -(-max(tokens, 1) // widest) * widest


def prefill_scratch_buffers(config: ModelConfig, tokens: int) -> dict[str, int]:
    """Bytes of the prefill's buffers for a prompt of `tokens` new tokens (scratch_rows of
    them): ids int32 [T]; res fp32 [T, H]; x, h fp16 [T, H]; qkv fp32 [T, q + 2 kv] (k reaches
    the K cache unrounded: kernels/kv_cache.cuh); q, attn fp16 [T, q]; mlp fp16 [T, I]."""
    c, cap = config, scratch_rows(tokens)
    per_token = {
        "ids": 4,
        "res": c.hidden_size * 4,
        "x": c.hidden_size * 2,
        "h": c.hidden_size * 2,
        "qkv": (c.q_size + 2 * c.kv_size) * 4,
        "q": c.q_size * 2,
        "attn": c.q_size * 2,
        "mlp": c.intermediate_size * 2,
    }
    return {k: cap * n for k, n in per_token.items()}


class Forward:
    """The forward of one model over its weights and KV cache, reading the token and the
    position from the decode loop's state words. Public buffers (device addresses):
    `res` fp32 [H] the decode step's residual row and `x` fp16 [H] its copy (what the RMSNorms
    read); `logits` fp32 [V]; `key` u64 lm_head's argmax key (the sampler re-zeroes it).

    Why two: the residual stream is a running sum over every layer, so it is kept in fp32 (an
    fp16 rounding there carries into every later layer: docs/DESIGN.md, Activation precision),
    while each RMSNorm reads the fp16 copy the writer stores beside it, so that the norm-fused
    kernels keep their fp16 x staging."""

    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        kernels: DecodeKernels,
        prefill: PrefillKernels,
        weights: Weights,
        kv: KVCache,
        loop: DecodeLoop,
        max_context: int,
    ) -> None:
        self.gpu, self.config, self.kernels, self.prefill_kernels = gpu, config, kernels, prefill
        self.weights, self.kv, self.loop = weights, kv, loop
        ptrs = {k: gpu.alloc(n, k).ptr for k, n in decode_buffers(config, max_context).items()}
        self.rope, self.res, self.x = ptrs["rope"], ptrs["res"], ptrs["x"]
        self.q, self.attn = ptrs["q"], ptrs["attn"]
        self.mlp, self.logits, self.key = ptrs["mlp"], ptrs["logits"], ptrs["key"]
        gpu.upload(self.rope, rope_table(config, max_context))
        self.attn_scratch = kernels.attention_scratch()
        gpu.memset(self.key, 0, 8)
        self.last_token_shortcut = True  # prefill(last_only=True) ends on the decode kernels
        self._scratch: dict[str, int] = {}
        self._scratch_buffers: list = []
        self._scratch_tokens = 0

    # -- decode ------------------------------------------------------------------------------
    def embed_token(self, stream=None) -> None:
        """res, x = embed[state[TOKEN]]."""
        self.kernels.embed(self.loop.word(StateWord.TOKEN), self.weights.embed, self.x, self.res,
                           1, stream=stream)  # fmt: skip

    def layer(self, i: int, stream=None) -> None:
        """Decoder layer i for the token at state[POS] (res, x in place; its K/V into the
        pages)."""
        L, k = self.weights.layers[i], self.kernels
        k.qkv_rope(self.x, L.input_norm, L.qkv_w, L.qkv_s, L.qkv_b, self.loop.word(StateWord.POS),
                   self.rope, self.kv.page_table, self.kv.k[i], self.kv.v[i], self.q,
                   stream=stream)  # fmt: skip
        self._token_tail(i, self.q, self.x, self.res, stream)

    def _token_tail(self, i: int, q: int, x: int, res: int, stream=None) -> None:
        """Layer i after its q/k/v for one token at state[POS] (its K/V already in the
        pages): attention of q (fp16 [heads, D]), o, gate/up, down; res (fp32 [H], the token's
        residual row) and x (fp16 [H], its copy) updated in place."""
        L, k, c, sc = self.weights.layers[i], self.kernels, self.config, self.attn_scratch
        k.attention(q, self.kv.k[i], self.kv.v[i], self.kv.page_table,
                    self.loop.word(StateWord.POS), sc.part_ml.ptr, sc.part_acc.ptr,
                    sc.counters.ptr, self.attn, stream=stream)  # fmt: skip
        k.gemv("o", self.attn, 0, L.o_w, L.o_s, x, c.hidden_size, res, stream=stream)
        k.gemv("gate_up", x, L.post_norm, L.gate_up_w, L.gate_up_s, self.mlp,
               c.intermediate_size, stream=stream)  # fmt: skip
        k.gemv("down", self.mlp, 0, L.down_w, L.down_s, x, c.hidden_size, res, stream=stream)

    def head(self, x: int, stream=None, key: int = 0) -> None:
        """logits = lm_head(final_norm(x)) and the argmax key (into `key`, a zeroed u64, when
        given, else self.key); x fp16 [H]. Every consumer of the head (decode step, prefill's
        last row, teacher-forced rows) comes through here, so an int8 head
        (Weights.lm_head_format) is read by its own kernel everywhere."""
        w, k, key = self.weights, self.kernels, key or self.key
        if w.lm_head_format == "int8":
            k.lm_head_q8(x, w.final_norm, w.lm_head, w.lm_head_scale, self.logits, key,
                         stream=stream)  # fmt: skip
        else:
            k.lm_head(x, w.final_norm, w.lm_head, self.logits, key, stream=stream)

    def decode_step(self, stream=None, key: int = 0) -> None:
        """Embedding, every layer and lm_head for the token at state[TOKEN], state[POS]
        (key: where lm_head's argmax key goes, default self.key)."""
        self.embed_token(stream)
        for i in range(self.config.num_layers):
            self.layer(i, stream)
        self.head(self.x, stream, key)

    # -- prefill -----------------------------------------------------------------------------
    def scratch(self, T: int) -> dict[str, int]:
        """The prefill's buffers for T tokens (device addresses; prefill_scratch_buffers),
        grown as prompts grow (engine.memory plans them for a max_context prompt)."""
        if T <= self._scratch_tokens:
            return self._scratch
        for b in self._scratch_buffers:
            b.free()
        sizes = prefill_scratch_buffers(self.config, T)
        self._scratch_buffers = [self.gpu.alloc(n, f"prefill {k}") for k, n in sizes.items()]
        self._scratch = {k: b.ptr for k, b in zip(sizes, self._scratch_buffers, strict=True)}
        self._scratch_tokens = scratch_rows(T)
        return self._scratch

    def prefill(self, T: int, start: int = 0, last_only: bool = False) -> int:
        """The T tokens in scratch(T)["ids"] at positions start .. start + T - 1 through every
        layer, their K/V into the pages (positions 0 .. start - 1 already there). Returns the
        device address of x fp16 [T, H] (the residual's copy: the pre final-norm hidden states
        lm_head reads); with last_only (and last_token_shortcut) only row T - 1 of it is valid,
        and state[POS] must be start + T - 1 (the decode kernels of the last layer read it)."""
        c, k, pk, kv = self.config, self.kernels, self.prefill_kernels, self.kv
        h, qkv_n, b = c.hidden_size, c.q_size + 2 * c.kv_size, self.scratch(T)
        rows = self._scratch_tokens  # the buffers' rows: a_rows of every GEMM
        k.embed(b["ids"], self.weights.embed, b["x"], b["res"], T)
        for i, L in enumerate(self.weights.layers):
            k.rmsnorm(b["x"], L.input_norm, b["h"], T)
            pk.gemm(b["h"], L.qkv_w, L.qkv_s, L.qkv_b, b["qkv"], T, qkv_n, h, a_rows=rows,
                    out_fp32=True, label="gemm qkv")  # fmt: skip
            k.rope_kv(b["qkv"], start, self.rope, kv.page_table, kv.k[i], kv.v[i], b["q"], T)
            if last_only and self.last_token_shortcut and i == c.num_layers - 1:
                self._token_tail(i, b["q"] + (T - 1) * c.q_size * 2, b["x"] + (T - 1) * h * 2,
                                 b["res"] + (T - 1) * h * 4)  # fmt: skip
                break
            pk.attention(b["q"], kv.k[i], kv.v[i], kv.page_table, b["attn"], start, T)
            pk.gemm(b["attn"], L.o_w, L.o_s, None, b["x"], T, h, c.q_size, residual=b["res"],
                    a_rows=rows, label="gemm o")  # fmt: skip
            k.rmsnorm(b["x"], L.post_norm, b["h"], T)
            pk.gemm(b["h"], L.gate_up_w, L.gate_up_s, None, b["mlp"], T,
                    2 * c.intermediate_size, h, swiglu=True, a_rows=rows,
                    label="gemm gate_up")  # fmt: skip
            pk.gemm(b["mlp"], L.down_w, L.down_s, None, b["x"], T, h, c.intermediate_size,
                    residual=b["res"], a_rows=rows, label="gemm down")  # fmt: skip
        return b["x"]
