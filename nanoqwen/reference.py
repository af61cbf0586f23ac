"""The reference model: a plain PyTorch Qwen2 decoder reading a .nanoqwen file. The oracle.

Every kernel and logit test compares against this file, and this file is in turn checked against
Hugging Face transformers' Qwen2 on the same weights (tests/test_reference.py). So it favours
being obviously right over being fast:

- Weights are what the kernels see: each INT4 projection is dequantized exactly
  (`quant.dequantize_packed`: q * fp16 scale, exact in float32); embeddings, norms, biases and
  lm_head are the file's fp16 values upcast; an int8 lm_head (`pack --lm-head int8`) is
  dequantized the same way (`quant.dequantize_rows_int8`: q * its row's fp32 scale), so ladder
  comparisons stay exact to the file's format (a tied model's embedding stays fp16). Compute
  runs in float32 unless `dtype` says otherwise; RMSNorm and softmax always run in float32.
- The KV cache is paged the way the engine pages it: per layer a pool of 16-token pages
  `[num_pages, 16, n_kv_heads, head_dim]` for K and for V, allocated by the block manager both
  backends share (nanoqwen.kv_pages: a page table per sequence, pages taken before the step
  that writes them, released when the sequence ends, full pages kept in the prefix cache).
  Prefill and decode both write K/V into the pages and read the whole context back through the
  page table, so the indirection is exercised on every step; a prefill that reuses a cached
  prefix is the same forward started at an offset.
- Speculative decoding (nanoqwen.speculative, the oracle of its rules) is the same multi-token
  forward again: a decode step feeds the last token and its drafts, and commits only the K/V
  of the tokens it keeps.
- RoPE is the NEOX form (rotate the halves [..., :d/2] and [..., d/2:]), its angles formed in
  float64 (nanoqwen.rope, shared with the engine) and rounded once.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from .backend import DEFAULT_CONTEXT, Ready, check_fits, check_max_context, check_prompt
from .config import PAGE_TOKENS, ModelConfig
from .errors import NanoqwenError
from .kv_pages import BlockManager, KVStats, PageTable
from .quant import dequantize_packed, dequantize_rows_int8
from .rope import rope_angles
from .sampling import SamplingParams, make_generator, sample
from .speculative import Backoff, SpecStats, SpeculativeConfig, accept, cut, draft, step_limit

if TYPE_CHECKING:
    from .fileformat import NanoqwenFile

# --- Paged KV cache -------------------------------------------------------------------------


class PagedKVCache:
    """K and V pools of 16-token pages per layer, and `pages`, the block manager that hands
    them out (pools and allocator travel together: a cache's page ids mean its own pools).

    Position p of a sequence lives in page `table[p // 16]`, slot `p % 16`.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        dtype: torch.dtype,
        device,
        prefix_caching: bool = True,
    ):
        shape = (num_pages, PAGE_TOKENS, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_pages = num_pages
        self.pages = BlockManager(num_pages, prefix_caching)

    def write(self, layer: int, table: torch.Tensor, start: int, k, v) -> None:
        """k, v: [T, n_kv_heads, head_dim] for positions start..start+T-1."""
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        pages, slots = table[pos // PAGE_TOKENS], pos % PAGE_TOKENS
        self.k[layer][pages, slots] = k
        self.v[layer][pages, slots] = v

    def read(self, layer: int, table: torch.Tensor, length: int):
        """K and V of positions 0..length-1, each [length, n_kv_heads, head_dim]."""
        pages = table[: -(-length // PAGE_TOKENS)]
        k = self.k[layer][pages].flatten(0, 1)[:length]  # [pages * 16, n_kv_heads, head_dim]
        v = self.v[layer][pages].flatten(0, 1)[:length]
        return k, v


# --- Weights ----------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H] float32
    post_attn_norm: torch.Tensor  # [H] float32
    q_proj: torch.Tensor  # [n_heads * head_dim, H]
    k_proj: torch.Tensor  # [n_kv_heads * head_dim, H]
    v_proj: torch.Tensor  # [n_kv_heads * head_dim, H]
    q_bias: torch.Tensor
    k_bias: torch.Tensor
    v_bias: torch.Tensor
    o_proj: torch.Tensor  # [H, n_heads * head_dim]
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]


def _fp16(file: NanoqwenFile, name: str, dtype: torch.dtype, device) -> torch.Tensor:
    """A float16 tensor of the file, upcast exactly (float32 holds every float16).

    torch converts the read-only mapped view into a new tensor (copy=True: nothing aliases the
    mapping). numpy's float16 -> float32 cast is not vectorized: 1.4 s against torch's 0.2 s
    (2 threads) for the 1.5B's 233M-value embedding table.
    """
    with warnings.catch_warnings():  # the view is only read, by the copy below
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        view = torch.from_numpy(file.tensor(name))
    return view.to(device, dtype, copy=True)


def _int4(file: NanoqwenFile, proj: str, dtype: torch.dtype, device) -> torch.Tensor:
    """An INT4 projection dequantized as the kernels see it: q * fp16 scale, [N, K]."""
    w = dequantize_packed(file.tensor(proj + ".qweight"), file.tensor(proj + ".scales"))
    return torch.from_numpy(w).to(device, dtype).contiguous()


def _load_layer(file: NanoqwenFile, i: int, dtype: torch.dtype, device) -> LayerWeights:
    p = f"layers.{i}."

    def fp16(name: str, to: torch.dtype = dtype) -> torch.Tensor:
        return _fp16(file, p + name, to, device)

    def int4(proj: str) -> torch.Tensor:
        return _int4(file, p + proj, dtype, device)

    return LayerWeights(
        input_norm=fp16("input_norm", torch.float32),
        post_attn_norm=fp16("post_attn_norm", torch.float32),
        q_proj=int4("q_proj"),
        k_proj=int4("k_proj"),
        v_proj=int4("v_proj"),
        q_bias=fp16("q_proj.bias"),
        k_bias=fp16("k_proj.bias"),
        v_bias=fp16("v_proj.bias"),
        o_proj=int4("o_proj"),
        gate_proj=int4("gate_proj"),
        up_proj=int4("up_proj"),
        down_proj=int4("down_proj"),
    )


def rope_table(config: ModelConfig, positions: int, dtype: torch.dtype, device):
    """cos, sin: [positions, head_dim / 2] of nanoqwen.rope's float64 angles, rounded to
    float32 or to `dtype` if that is wider."""
    angles = torch.from_numpy(rope_angles(config, positions))
    out = torch.promote_types(dtype, torch.float32)
    return angles.cos().to(device, out), angles.sin().to(device, out)


# --- The model --------------------------------------------------------------------------------


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in float32 (or wider); returns x's dtype."""
    xf = _at_least_fp32(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim / 2]. NEOX halves: (x1, x2) rotated."""
    half = x.shape[-1] // 2
    x1, x2 = _at_least_fp32(x[..., :half]), _at_least_fp32(x[..., half:])
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim / 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _int8_head(file: NanoqwenFile, dtype: torch.dtype, device) -> torch.Tensor:
    """The int8 head dequantized: q * scale[row] in float32 (exact), then `dtype`. [V, H]"""
    w = dequantize_rows_int8(file.tensor("lm_head.q8"), file.tensor("lm_head.scale"))
    return torch.from_numpy(w).to(device=device, dtype=dtype)


def weight_bytes(file: NanoqwenFile, dtype: torch.dtype) -> int:
    """Bytes the reference's weights take in `dtype`: 8 values per INT4 word, the fp16 scales
    folded into them, every other float16 tensor upcast."""
    values = 0
    for t in file.tensors.values():
        if t.dtype == "uint32":
            values += t.nbytes * 2
        elif t.dtype == "int8":
            values += t.nbytes
        elif t.dtype == "float16" and not t.name.endswith(".scales"):
            values += t.nbytes // 2
    return values * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Fp16Storage:
    """Where a float32 reference rounds to float16 as the CUDA engine stores its activations
    between kernels (an emulation of the engine's storage, not of its sums). `activations`:
    every tensor a kernel hands to the next in fp16: the copy of the residual stream each
    RMSNorm reads (the o and down kernels write it beside the fp32 residual), the normed x
    (fused into q/k/v, gate/up and lm_head, which round it in registers), q after RoPE and v
    (the q/k/v kernels add the bias and rotate in fp32, then store), K after RoPE unless
    `k_pair` (the K cache's (hi, lo) pair holds it to ~22 bits: kernels/kv_cache.cuh), the
    attention's fp16 P for P.V and its output, and silu(gate) * up (gate and up themselves
    stay fp32: the kernels apply SwiGLU in the GEMM's epilogue, decode and prefill alike).
    `residual`: the residual stream itself rounded after each branch's add, as the engine
    stored it before it kept the stream in fp32 (dev/residual_precision.py measures the
    difference). The sums stay float32 as the kernels' accumulators do."""

    residual: bool = False
    activations: bool = True
    k_pair: bool = True


def _round_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


class Qwen2Reference:
    """The decoder: weights on `device` in `dtype`, and the arithmetic of one forward pass."""

    fp16_storage: Fp16Storage | None = None  # None: no rounding beyond `dtype`

    def __init__(
        self, file: NanoqwenFile, max_positions: int, dtype: torch.dtype, device, progress=False
    ):
        from tqdm import tqdm

        cfg = self.config = file.config
        self.embed_tokens = _fp16(file, "embed_tokens", dtype, device)  # [V, H]
        gib = weight_bytes(file, dtype) / 2**30
        layers = tqdm(
            range(cfg.num_layers),
            desc=f"loading {cfg.name} ({gib:.1f} GiB of {str(dtype).removeprefix('torch.')})",
            unit="layer",
            disable=not progress,
        )
        self.layers = [_load_layer(file, i, dtype, device) for i in layers]
        self.final_norm = _fp16(file, "final_norm", torch.float32, device)  # [H]
        if file.lm_head == "int8":
            self.lm_head = _int8_head(file, dtype, device)  # [V, H]
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _fp16(file, "lm_head", dtype, device)  # [V, H]
        self.cos, self.sin = rope_table(cfg, max_positions, dtype, device)

    def forward(
        self, tokens: torch.Tensor, start: int, page_table: list[int], cache: PagedKVCache
    ) -> torch.Tensor:
        """tokens: int64 [T] at positions start..start+T-1 -> final hidden states [T, H].

        The pages of `page_table` must already cover positions [0, start + T).
        """
        table = torch.tensor(page_table, dtype=torch.int64, device=tokens.device)
        cos = self.cos[start : start + tokens.shape[0]]  # [T, head_dim / 2]
        sin = self.sin[start : start + tokens.shape[0]]
        x = self.embed_tokens[tokens]  # x: [T, H]
        for i, layer in enumerate(self.layers):
            x = self.block(x, layer, i, start, table, cache, cos, sin)
        return self.final(x)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of the residual stream x [T, H]: lm_head's input."""
        return self._act(rms_norm(self._act(x), self.final_norm, self.config.rms_norm_eps))

    def block(self, x, w: LayerWeights, layer: int, start: int, table, cache, cos, sin):
        """Decoder layer `layer`: x [T, H] (the residual stream) -> x [T, H]."""
        eps, act = self.config.rms_norm_eps, self._act
        h = act(rms_norm(act(x), w.input_norm, eps))
        x = self._residual(x + self.attention(h, w, layer, start, table, cache, cos, sin))
        h = act(rms_norm(act(x), w.post_attn_norm, eps))
        return self._residual(x + self.mlp(h, w))

    @contextlib.contextmanager
    def storing(self, storage: Fp16Storage | None) -> Iterator[Qwen2Reference]:
        """This model with `storage` (None: no rounding beyond `dtype`) inside the block, the
        previous setting restored after it."""
        before, self.fp16_storage = self.fp16_storage, storage
        try:
            yield self
        finally:
            self.fp16_storage = before

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return _round_fp16(x) if self.fp16_storage and self.fp16_storage.activations else x

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return _round_fp16(x) if self.fp16_storage and self.fp16_storage.residual else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H] -> logits float32 [T, V]."""
        return F.linear(hidden.to(self.lm_head.dtype), self.lm_head).float()

    def attention(self, x, w: LayerWeights, layer: int, start: int, table, cache, cos, sin):
        """x: [T, H] -> [T, H]. Causal GQA over positions 0..start+T-1 read from the pages."""
        cfg, t = self.config, x.shape[0]
        group, d = cfg.group_ratio, cfg.head_dim
        act = self._act
        q = F.linear(x, w.q_proj, w.q_bias).view(t, cfg.num_heads, d)  # q: [T, n_heads, d]
        k = F.linear(x, w.k_proj, w.k_bias).view(t, cfg.num_kv_heads, d)  # k: [T, n_kv, d]
        v = act(F.linear(x, w.v_proj, w.v_bias)).view(t, cfg.num_kv_heads, d)  # v: [T, n_kv, d]
        q, k = act(apply_rope(q, cos, sin)), apply_rope(k, cos, sin)
        if not (self.fp16_storage and self.fp16_storage.k_pair):
            k = act(k)
        cache.write(layer, table, start, k, v)
        k, v = cache.read(layer, table, start + t)  # k, v: [L, n_kv, d], L = start + T

        # Query head h reads KV head h // group: view q as [n_kv, group, T, d].
        q = q.view(t, cfg.num_kv_heads, group, d).permute(1, 2, 0, 3)
        k, v = k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None]  # [n_kv, 1, L, d]
        scores = _at_least_fp32(q @ k.transpose(-1, -2)) / math.sqrt(d)  # [n_kv, group, T, L]
        query_pos = torch.arange(start, start + t, device=x.device)[:, None]  # [T, 1]
        key_pos = torch.arange(start + t, device=x.device)[None, :]  # [1, L]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = act(torch.softmax(scores, dim=-1).to(v.dtype))  # P.V's mma takes fp16 P
        out = act((probs @ v).permute(2, 0, 1, 3).reshape(t, cfg.q_size))  # [T, n_heads * d]
        return F.linear(out, w.o_proj)

    def mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) * up(x)); x: [T, H] -> [T, H]."""
        gate, up = F.linear(x, w.gate_proj), F.linear(x, w.up_proj)
        return F.linear(self._act(F.silu(gate) * up), w.down_proj)


# --- Threads ----------------------------------------------------------------------------------

_TORCH_THREADS = torch.get_num_threads()  # torch's default: the physical cores, or $OMP_NUM_THREADS


def default_threads() -> int:
    """torch intra-op threads for the reference when not told: $OMP_NUM_THREADS when set, else
    one fewer than torch's default (the physical cores), at least one.

    Each op of a decode step is a GEMV split over the threads and closed by a barrier, so one
    thread that another process keeps off its core stalls the whole op; torch's every-core
    default collapses on a machine busy with anything else. Measured on 2 shared cores
    (Qwen2.5-Coder-1.5B, greedy decode, load average 2): 1 thread 2.4-2.6 tokens/s, 2 threads
    0.8-2.2; at load average 4: 0.9-1.5 against 0.4-0.5.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return _TORCH_THREADS
    return max(1, _TORCH_THREADS - 1)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (process-wide) to `threads`, or default_threads() when
    None; the count now in use."""
    torch.set_num_threads(default_threads() if threads is None else threads)
    return torch.get_num_threads()


# --- The backend ------------------------------------------------------------------------------

# Sequences in one decode step when not told: the per-sequence forwards make a batch no faster
# on the CPU, so this only bounds the slots (the server's --max-batch default).
DEFAULT_MAX_BATCH = 8


class ReferenceBackend:
    """nanoqwen.backend.Backend in plain PyTorch: host sampling, paged KV with prefix caching
    (nanoqwen.kv_pages): a prompt is prefilled from its first uncached token; with a
    SpeculativeConfig each generate() step verifies n-gram drafts (nanoqwen.speculative).

    The batch primitives (prefill_chunk, decode_launch, release_slot; nanoqwen.batching drives
    them) are the oracle of the batched path: each sequence runs its own forward, exactly the
    forward generate() runs, and samples with its own generator (seq.sampler), so every row is
    what the sequence gets alone, token for token. They decode one token a step, with or
    without a SpeculativeConfig."""

    name = "reference"

    def __init__(
        self,
        file: NanoqwenFile,
        max_context: int = DEFAULT_CONTEXT["reference"],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = True,
        progress: bool = False,
        speculative: SpeculativeConfig | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_pages: int | None = None,
    ):
        """prefix_caching: generate() reuses the K/V of earlier prompts' and replies' full
        pages (off: every prompt is prefilled cold, e.g. for validation); progress: a bar per
        loaded layer on stderr (a 1.5B loads for tens of seconds); speculative: draft and
        verify per nanoqwen.speculative (None: one token per step). `spec_stats` holds the
        last generation's SpecStats; max_batch: the most sequences in one decode step;
        kv_pages: the KV pool's 16-token pages (default: one max_context's worth, what a
        single stream needs; a batch shares them and the scheduler preempts when they run
        out)."""
        self.config: ModelConfig = file.config
        self.max_context = check_max_context(max_context, self.config)
        self.device = torch.device(device)
        self.speculative = speculative
        if max_batch < 1:
            raise NanoqwenError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        pages = -(-self.max_context // PAGE_TOKENS)
        if kv_pages is not None and kv_pages < pages:
            raise NanoqwenError(f"kv_pages {kv_pages} cannot hold one max_context of "
                                f"{self.max_context} positions ({pages} pages)")  # fmt: skip
        self.cached_tokens = 0
        self.spec_stats = SpecStats()
        with torch.inference_mode():
            self.model = Qwen2Reference(file, max_context, dtype, self.device, progress)
            self.cache = PagedKVCache(self.config, kv_pages or pages, dtype, self.device,
                                      prefix_caching)  # fmt: skip

    @property
    def kv_pages_in_use(self) -> int:
        return 0 if self.cache is None else self.cache.pages.pages_held

    @property
    def block_manager(self) -> BlockManager:
        self._require_open()
        return self.cache.pages

    @property
    def kv_stats(self) -> KVStats:
        self._require_open()
        return self.cache.pages.stats

    def _require_open(self) -> None:
        if self.model is None:
            raise NanoqwenError("the reference backend is closed")

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        """Prefill the prompt, then decode: one token per step, or with speculation the
        accepted drafts and one more (see backend.Backend)."""
        self._require_open()
        prompt = check_prompt(prompt_ids, self.config.vocab_size).tolist()
        check_fits(len(prompt), params.max_tokens, self.max_context)
        return self._generate(prompt, params, stop_ids)

    def _generate(self, prompt: list[int], params: SamplingParams, stop_ids) -> Iterator[int]:
        """Each step feeds `fed` (the uncached prompt, then the last token) and `drafts`, keeps
        what accept() emits up to a stop id or max_tokens, and commits the K/V of the fed
        tokens and of the kept drafts that were fed (those before the step's last kept token).
        Rejected drafts' K/V stay in the pages uncommitted, past len(table.tokens): no read
        reaches them (attention is causal) and the next step overwrites them. The lookup's
        drafts pass the sequence's Backoff first."""
        pages = self.cache.pages  # released into even if the backend is closed meanwhile
        table = pages.admit(prompt)
        self.cached_tokens = table.cached_tokens
        stats = self.spec_stats = SpecStats()
        generator = make_generator(params.seed)
        history, fed, drafts = list(prompt), prompt[table.cached_tokens :], []
        backoff = Backoff()
        left, decoding = params.max_tokens, False
        try:
            while True:
                logits = self._forward(fed + drafts, table, rows=len(drafts) + 1)
                kept = accept(logits.cpu(), drafts, params, generator)
                if decoding:
                    stats.steps += 1
                    stats.drafted += len(drafts)
                    stats.accepted += len(kept) - 1
                    if self.speculative:
                        backoff.update(len(drafts), len(kept) - 1, self.speculative)
                kept, stopped = cut(kept, left, stop_ids)
                pages.commit(table, fed + kept[:-1])
                yield from kept
                left -= len(kept)
                if stopped or left == 0:
                    return
                history += kept
                fed = kept[-1:]
                if self.speculative:
                    cap = step_limit(params.max_tokens, params.max_tokens - left, len(history),
                                     self.max_context)  # fmt: skip
                    found = draft(history, self.speculative, cap)
                    drafts = backoff.gate(found)
                    stats.skipped += len(drafts) < len(found)
                decoding = True
        finally:  # also runs on close() or garbage collection of an unfinished iterator
            pages.release(table)

    @torch.inference_mode()
    def _forward(self, tokens: list[int], table: PageTable, rows: int) -> torch.Tensor:
        """Run tokens at the table's next positions through the model, writing their K/V into
        the pages without committing them (the caller commits those it keeps); the logits of
        the last `rows` rows, [rows, V]."""
        start = len(table.tokens)
        self.cache.pages.reserve(table, start + len(tokens))
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, start, table.pages, self.cache)
        return self.model.logits(hidden[-rows:])

    # -- batch primitives (nanoqwen.batching.Scheduler calls them; the caller reserves pages) --
    def prefill_chunk(self, seq, end: int, sample: bool) -> int | None:
        """ids[kv_len:end] at positions kv_len .. end - 1; with `sample` the next token."""
        self._require_open()
        logits = self._run(seq, seq.ids[seq.kv_len : end])
        return self._sample(seq, logits) if sample else None

    def decode_launch(self, seqs: list, after: Ready | None = None) -> Ready:
        """One token for each sequence, one forward each, computed now: it feeds its last id at
        position kv_len, or with `after` the token that step sampled for it."""
        self._require_open()
        fed = [after.fed(s) if after is not None else s.ids[s.kv_len] for s in seqs]
        tokens = [self._sample(s, self._run(s, [t])) for s, t in zip(seqs, fed, strict=True)]
        return Ready(list(seqs), tokens)

    def release_slot(self, seq) -> None:
        """Nothing is kept per slot: the generator lives in seq.sampler."""

    @torch.inference_mode()
    def _run(self, seq, tokens: list[int]) -> torch.Tensor:
        """tokens at positions seq.kv_len.. into seq.table's pages; the last row's logits [V]."""
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(ids, seq.kv_len, seq.table.pages, self.cache)
        seq.kv_len += len(tokens)
        return self.model.logits(hidden[-1:])[0].cpu()

    @staticmethod
    def _sample(seq, logits: torch.Tensor) -> int:
        """Draw number len(seq.tokens) of the sequence: its own generator, made on first use,
        advances once per sampled draw (greedy draws nothing), as in generate()."""
        if seq.params.greedy:
            return sample(logits, seq.params)
        if seq.sampler is None:
            seq.sampler = make_generator(seq.params.seed)
        return sample(logits, seq.params, seq.sampler)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits, one cold prefill over the whole sequence: float32 [T, V].
        It neither reads nor fills the prefix cache (it commits nothing)."""
        self._require_open()
        tokens = torch.from_numpy(check_prompt(token_ids, self.config.vocab_size))
        check_fits(len(tokens), 0, self.max_context)
        tokens = tokens.to(self.device)
        table = PageTable()
        try:
            self.cache.pages.reserve(table, len(tokens))
            hidden = self.model.forward(tokens, 0, table.pages, self.cache)
            return self.model.logits(hidden).cpu().numpy()
        finally:
            self.cache.pages.release(table)

    def close(self) -> None:
        """Drop the weights and the KV pools; the backend is unusable afterwards."""
        self.model = self.cache = None
