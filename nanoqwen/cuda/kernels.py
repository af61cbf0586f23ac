"""Launch wrappers for the decode kernels (nanoqwen/kernels/*.cu).

`DecodeKernels(gpu, config)` compiles (or takes from the cache) the table in
`jit.decode_kernels(config)`, loads it, and exposes one method per kernel. Every pointer is a
device address (int); every method takes `stream` (a cuda.core Stream or a GraphBuilder being
built; default: the Gpu's stream). Shapes are fixed by the config (constexpr in the kernels);
the docstrings repeat each argument's dtype, shape and layout from the .cu files.

PDL: with `pdl=True` each launch sets programmatic stream serialization; every kernel calls
griddepcontrol.wait before it reads anything an earlier kernel wrote (the GEMVs prefetch their
first weight batch before the wait), so correctness does not depend on the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from . import jit
from .device import Gpu

GEMV_THREADS = 288  # kGvThreads (gemv_int4.cu): 8 consumer warps + 1 producer warp
# Dynamic shared memory per GEMV CTA: the bulk-copy ring takes what x and the per-pair sums
# leave (7B: 8 stages of 7.4 KB for q/k/v and o, 6 of 14.5 KB for gate/up, 3 of 19 KB for
# down); two CTAs per SM (GEMV_CTAS_PER_SM). Whole step on the H200 at 513 tokens
# (tools/kernel_tune.py step): one CTA per SM, leaving room for the next kernel's CTA to stream
# its first weights early, 2.68 ms; two: 2.05 ms (again at 1.61 ms, 2026-11-30: one CTA 2.35 ms,
# though q/k/v and o alone got faster).
GEMV_SMEM = 110 * 1024
GEMV_CTAS_PER_SM = 2
# One shared-memory carveout for every kernel of the decode step, so no SM drains to reconfigure
# between overlapping (PDL) kernels: percent of 228 KB; 100 -> two GEMV CTAs per SM (the
# register-fed GEMV before them preferred 71: it needed L1 for its scale loads).
SMEM_CARVEOUT = 100
MISC_THREADS = 256  # kMiscThreads (decode_misc.cu)
NORM_ROWS = MISC_THREADS // 32  # kNormRows: rmsnorm_rows takes a row a warp
LM_WARPS = 8  # kLmWarps: lm_head runs one CTA of 8 warps an SM
LM_MAX_SLOTS = 4  # kLmMaxSlots
# lm_head's shared memory: each warp gets as many whole-row slots (rows in flight) as fit.
LM_RING = 200 * 1024
SAMPLE_THREADS = 1024  # kSampleThreads
ATTN_THREADS = 160  # kAttnThreads: 4 consumer warps + 1 producer warp (decode_attention.cu)
# Attention grid target at long context: one CTA per SM. 256 (two a SM, more bytes in flight)
# was faster with one CTA per split, but 32 clusters of 8 do not all fit at once (7B step at
# 32705 tokens 2299 us against 2073; decode_attention.cu). In clusters of 2 or 4 (all resident;
# H200, 2026-11-30, tools/kernel_tune.py step, one run): attention alone at 32705 tokens 21.5 /
# 25.8 us a launch against 25.65, yet the step 1988 / 2135 us against 1970, and at 513 tokens
# 1538 / 1472 against 1444; clusters of 4 with 8 stages 22.9 us alone, the step 1994.
ATTN_CTAS = 128

# Decode state words (decode_misc.cu: enum StateWord).
S_TOKEN, S_POS, S_STEP, S_MAX_NEW, S_DONE = 0, 1, 2, 3, 4
S_TOP_K, S_TEMP, S_TOP_P, S_SEED_LO, S_SEED_HI, S_NUM_EOS, S_EOS0 = 5, 6, 7, 8, 9, 10, 11
MAX_EOS = 8
STATE_WORDS = S_EOS0 + MAX_EOS

_I32 = np.int32


def _kv_swizzle(d: int) -> np.ndarray:
    """[PAGE_TOKENS, d] column gather of kv_cache.cuh's chunk swizzle (its own inverse: chunk
    c of token row t is stored at c ^ (t % 8))."""
    t, col = np.arange(jit.PAGE_TOKENS)[:, None], np.arange(d)[None, :]
    return ((col // 8) ^ (t % 8)) * 8 + col % 8


def kv_cache_to_device(kv: np.ndarray) -> np.ndarray:
    """A K or V cache [pages, PAGE_TOKENS, n_kv, D] -> the device layout (kv_cache.cuh):
    [pages, n_kv, PAGE_TOKENS, D], each token row's 16-byte chunks swizzled."""
    tiles = np.ascontiguousarray(kv.transpose(0, 2, 1, 3))
    return np.take_along_axis(tiles, _kv_swizzle(kv.shape[-1])[None, None], axis=3)


def kv_cache_from_device(raw: np.ndarray) -> np.ndarray:
    """The inverse of kv_cache_to_device: [pages, n_kv, PAGE_TOKENS, D] (device layout) ->
    [pages, PAGE_TOKENS, n_kv, D]."""
    tiles = np.take_along_axis(raw, _kv_swizzle(raw.shape[-1])[None, None], axis=3)
    return np.ascontiguousarray(tiles.transpose(0, 2, 1, 3))


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: `label` names the op ("gemv gate_up", "attention"); what it
    must read from memory at minimum is `nbytes` + `per_token` x the context length (attention
    reads every cached token's K and V; the length lives on the device)."""

    label: str
    kernel: object
    grid: tuple
    block: int
    args: tuple
    nbytes: int
    per_token: int = 0  # bytes per token of context
    smem: int = 0  # dynamic shared memory bytes


class DecodeKernels:
    def __init__(self, gpu: Gpu, config: ModelConfig, pdl: bool = True) -> None:
        self.gpu, self.config, self.pdl = gpu, config, pdl
        h, i = config.hidden_size, config.intermediate_size
        mods = jit.compile_decode(config)
        g = mods["gemv_int4.cu"]
        self._gemv = {}  # kind -> (kernel, K, weight rows per output feature, max CTAs)
        for kind, name, k, per in (
            ("qkv", f"gemv_int4<{h}, true, 0>", h, 1),
            ("o", f"gemv_int4<{h}, false, 1>", h, 1),
            ("gate_up", f"gemv_int4<{h}, true, 2>", h, 2),
            ("down", f"gemv_int4<{i}, false, 1>", i, 1),
        ):
            kern = g.kernel(name)
            gpu.set_max_dynamic_smem(kern, GEMV_SMEM)
            ctas = min(GEMV_CTAS_PER_SM, self._per_sm(kern, GEMV_THREADS, GEMV_SMEM)) * gpu.num_sms
            self._gemv[kind] = (kern, k, per, ctas)
        m = mods["decode_misc.cu"]
        self._embed = m.kernel("embed_gather")
        self._rmsnorm = m.kernel("rmsnorm_rows")
        self._rope = m.kernel("rope_kv_write")
        self._lm = m.kernel("lm_head_argmax")
        self._sample = m.kernel("sample_finish")
        a = mods["decode_attention.cu"]
        self._attn = a.kernel("attn_decode")
        d = config.head_dim  # the K/V ring: stages x (16 K + 16 V rows of D halves)
        self._attn_smem = jit.ATTN_STAGES * 2 * jit.PAGE_TOKENS * d * 2
        gpu.set_max_dynamic_smem(self._attn, self._attn_smem)
        if SMEM_CARVEOUT >= 0:  # one carveout for the step's kernels: no SM drains between them
            step = [v[0] for v in self._gemv.values()]
            for kern in step + [self._embed, self._lm, self._sample, self._attn]:
                gpu.set_smem_carveout(kern, SMEM_CARVEOUT)
        row = config.hidden_size * 2
        self._lm_smem = LM_WARPS * min(LM_MAX_SLOTS, LM_RING // (LM_WARPS * row)) * row
        gpu.set_max_dynamic_smem(self._lm, self._lm_smem)
        self.trace: list[Launch] | None = None  # set to a list to record every launch

    @staticmethod
    def _per_sm(kernel, threads: int, smem: int = 0) -> int:
        return max(1, kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem))

    def _go(self, kernel, grid, block, *args, stream=None, label="", nbytes=0, per_token=0,
            smem=0) -> None:  # fmt: skip
        if self.trace is not None:
            self.trace.append(Launch(label or "?", kernel, grid, block, args, nbytes, per_token,
                                     smem))  # fmt: skip
        self.gpu.launch(kernel, grid, block, *args, smem=smem, pdl=self.pdl, stream=stream)

    def replay(self, launch: Launch, stream=None) -> None:
        """Launch a recorded `Launch` again (bench --kernels times the step's launches)."""
        self.gpu.launch(launch.kernel, launch.grid, launch.block, *launch.args, smem=launch.smem,
                        pdl=self.pdl, stream=stream)  # fmt: skip

    def embed(self, ids: int, embed: int, x: int, T: int, stream=None) -> None:
        """ids int32 [T] (device); embed fp16 [V, H]; x fp16 [T, H] = embed[ids]."""
        self._go(self._embed, (T, 1, 1), MISC_THREADS, ids, embed, x, stream=stream,
                 label="embed", nbytes=T * self.config.hidden_size * 2)  # fmt: skip

    def rmsnorm(self, x: int, w: int, y: int, T: int, stream=None) -> None:
        """x fp16 [T, H]; w fp16 [H]; y fp16 [T, H] = x * rsqrt(mean(x^2) + eps) * w."""
        grid = (-(-T // NORM_ROWS), 1, 1)
        self._go(self._rmsnorm, grid, MISC_THREADS, x, w, y, np.int32(T), stream=stream,
                 label="rmsnorm")  # fmt: skip

    def gemv(self, kind, x, norm_w, qweight, scales, out, n, stream=None) -> None:
        """One INT4 GEMV (batch 1), fp32 accumulate.

        kind     "o" / "down" (out += W x, in place: the residual stream),
                 "gate_up" (RMSNorm + SwiGLU over the stacked [gate; up] weight)
        x        fp16 [K]; norm_w fp16 [K] (gate_up) or 0
        qweight  uint32 [R, K/8] ValueShuffle rows; scales fp16 [R, K/128]; R = n (gate_up: 2n)
        out      fp16 [n]
        """
        self._gemv_launch(kind, n, stream, x, norm_w, qweight, scales, 0, out, _I32(n), 0, 0, 0,
                          0, 0)  # fmt: skip

    def qkv_rope(self, x, norm_w, qweight, scales, bias, pos, rope, pages, kc, vc, q,
                 stream=None) -> None:  # fmt: skip
        """RMSNorm + fused q/k/v INT4 GEMV + bias + RoPE + K/V page write (decode, one token).

        x fp16 [H]; norm_w fp16 [H]; qweight uint32 [q+2kv, H/8]; scales fp16 [q+2kv, H/128];
        bias fp16 [q+2kv]; pos int32* (device); rope float32 [max_pos, D/2, 2] (cos, sin);
        pages int32 [max_pages]; kc, vc the layer's K/V caches (kv_cache_to_device's layout);
        q fp16 [n_heads, D].
        """
        n = self.config.q_size + 2 * self.config.kv_size
        self._gemv_launch("qkv", n, stream, x, norm_w, qweight, scales, bias, q, _I32(n), pos,
                          rope, pages, kc, vc)  # fmt: skip

    def _gemv_launch(self, kind, n, stream, *args) -> None:
        kernel, k, per, max_ctas = self._gemv[kind]
        pairs = n if per == 2 else -(-n // 2)  # output rows are taken two at a time
        rows = per * n
        self._go(kernel, (min(max_ctas, pairs), 1, 1), GEMV_THREADS, *args, stream=stream,
                 label=f"gemv {kind}", nbytes=rows * k // 2 + rows * (k // 128) * 2,
                 smem=GEMV_SMEM)  # fmt: skip

    def rope_kv(self, qkv, pos, rope, pages, kc, vc, q, k_out, v_out, T, stream=None) -> None:
        """RoPE + paged K/V write for T tokens at positions *pos .. *pos + T - 1.

        qkv fp16 [T, q+2kv] (bias added); pos int32* (device); rope float32 [max_pos, D/2, 2]
        (cos, sin); pages int32 [max_pages]; kc, vc the layer's K/V caches (kv_cache_to_device's
        layout); q fp16 [T, n_heads, D]; k_out, v_out fp16 [T, n_kv, D] or 0.
        """
        self._go(self._rope, (T, 1, 1), MISC_THREADS, qkv, pos, rope, pages, kc, vc, q, k_out,
                 v_out, stream=stream, label="rope_kv_write")  # fmt: skip

    def attention(self, q, kc, vc, pages, pos, part_ml, part_acc, counters, out,
                  stream=None) -> None:  # fmt: skip
        """Decode attention of one token over L = *pos + 1 cached tokens, split along the
        sequence with the split-combine folded in (one launch).

        q fp16 [n_heads, D]; kc, vc the layer's K/V caches (kv_cache_to_device's layout);
        pages int32 [max_pages];
        part_ml fp32 [n_heads, S, 2]; part_acc fp32 [n_heads, S, D] (scratch, S = ATTN_SPLITS);
        counters int32 [n_kv] (zeroed once; every launch leaves it zero); out fp16 [n_heads, D].
        """
        c = self.config
        cl = jit.ATTN_CLUSTER  # fixed per model: whole clusters of splits
        splits = max(cl, min(jit.ATTN_SPLITS, ATTN_CTAS // c.num_kv_heads) // cl * cl)
        self._go(self._attn, (c.num_kv_heads, splits, 1), ATTN_THREADS, q, kc, vc, pages, pos,
                 part_ml, part_acc, counters, out, stream=stream, label="attention",
                 per_token=c.kv_size * 2 * 2, smem=self._attn_smem)  # fmt: skip

    def lm_head(self, x, norm_w, w, logits, key, stream=None, rows: int | None = None) -> None:
        """x fp16 [H] (pre-norm); norm_w fp16 [H]; w fp16 [V, H]; logits fp32 [V];
        key uint64* (atomicMax of the (logit, -id) key; zero before first use).
        rows: only the first `rows` rows of w (the unit tests' small vocabularies)."""
        v = self.config.vocab_size if rows is None else rows
        ctas = min(-(-v // LM_WARPS), self.gpu.num_sms)
        self._go(self._lm, (ctas, 1, 1), LM_WARPS * 32, x, norm_w, w, logits, key, _I32(v),
                 stream=stream, label="lm_head", nbytes=v * self.config.hidden_size * 2,
                 smem=self._lm_smem)  # fmt: skip

    def sample(self, logits, key, state, ring, host_ring, cancel, cond, stream=None) -> None:
        """Pick the next token, advance state (int32 [STATE_WORDS]), write ring[step] (device
        int32) and host_ring[step] (mapped host int32, count at host_ring[-1]; or 0), read the
        mapped cancel flag (or 0), set the while-loop condition `cond` (GraphCondition or 0)."""
        cond_arg = cond if cond is not None and not isinstance(cond, int) else np.uint64(cond or 0)
        self._go(self._sample, (1, 1, 1), SAMPLE_THREADS, logits, key, state, ring, host_ring,
                 cancel, cond_arg, _I32(self.config.vocab_size), stream=stream,
                 label="sample", nbytes=self.config.vocab_size * 4)  # fmt: skip
