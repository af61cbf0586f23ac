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

import os

import numpy as np

from ..config import ModelConfig
from . import jit
from .device import Gpu

GEMV_THREADS = 128  # kGemvWarps * 32 (gemv_int4.cu)
GEMV_ROWS = 2  # kRows (SIMT variant; N must be even)
TC_ROWS = 8  # kTcRows (tensor-core variant: any N); block is kTcWarps * 32 = GEMV_THREADS
GEMV_CTAS_PER_SM = 4  # persistent grid: 4 x 47 KiB padded x fits the 228 KiB of an SM
MISC_THREADS = 256  # kMiscThreads (decode_misc.cu)
LM_THREADS = 128  # kLmWarps * 32
LM_ROWS = 2  # kLmRows
SAMPLE_THREADS = 1024  # kSampleThreads
ATTN_THREADS = 128  # kAttnWarps * 32 (decode_attention.cu)

# Decode state words (decode_misc.cu: enum StateWord).
S_TOKEN, S_POS, S_STEP, S_MAX_NEW, S_DONE = 0, 1, 2, 3, 4
S_TOP_K, S_TEMP, S_TOP_P, S_SEED_LO, S_SEED_HI, S_NUM_EOS, S_EOS0 = 5, 6, 7, 8, 9, 10, 11
MAX_EOS = 8
STATE_WORDS = S_EOS0 + MAX_EOS

_I32 = np.int32


class DecodeKernels:
    def __init__(
        self, gpu: Gpu, config: ModelConfig, pdl: bool = True, gemv: str | None = None
    ) -> None:
        """gemv: "tc" (tensor-core mma, default) or "simt"; $NANOQWEN_GEMV overrides."""
        self.gpu, self.config, self.pdl = gpu, config, pdl
        self.gemv_variant = os.environ.get("NANOQWEN_GEMV") or gemv or "tc"
        if self.gemv_variant not in ("tc", "simt"):
            raise ValueError(f"gemv variant must be 'tc' or 'simt', got {self.gemv_variant!r}")
        h, i = config.hidden_size, config.intermediate_size
        mods = jit.compile_decode(config)
        tc = self.gemv_variant == "tc"
        g = mods["gemv_int4_tc.cu" if tc else "gemv_int4.cu"]
        name = "gemv_int4_tc" if tc else "gemv_int4"
        self._gemv = {
            "qkv": (g.kernel(f"{name}<{h}, true, 0>"), False),
            "o": (g.kernel(f"{name}<{h}, false, 1>"), False),
            "gate_up": (g.kernel(f"{name}<{h}, true, 2>"), True),
            "down": (g.kernel(f"{name}<{i}, false, 1>"), False),
        }
        m = mods["decode_misc.cu"]
        self._embed = m.kernel("embed_gather")
        self._rmsnorm = m.kernel("rmsnorm_rows")
        self._rope = m.kernel("rope_kv_write")
        self._lm = m.kernel("lm_head_argmax")
        self._sample = m.kernel("sample_finish")
        a = mods["decode_attention.cu"]
        self._attn_split = a.kernel("attn_decode_split")
        self._attn_combine = a.kernel("attn_decode_combine")
        self.max_ctas = gpu.num_sms * GEMV_CTAS_PER_SM

    def _go(self, kernel, grid, block, *args, stream=None):
        self.gpu.launch(kernel, grid, block, *args, pdl=self.pdl, stream=stream)

    def embed(self, ids: int, embed: int, x: int, T: int, stream=None) -> None:
        """ids int32 [T] (device); embed fp16 [V, H]; x fp16 [T, H] = embed[ids]."""
        self._go(self._embed, (T, 1, 1), MISC_THREADS, ids, embed, x, stream=stream)

    def rmsnorm(self, x: int, w: int, y: int, T: int, stream=None) -> None:
        """x fp16 [T, H]; w fp16 [H]; y fp16 [T, H] = x * rsqrt(mean(x^2) + eps) * w."""
        self._go(self._rmsnorm, (T, 1, 1), MISC_THREADS, x, w, y, stream=stream)

    def gemv(self, kind, x, norm_w, qweight, scales, bias, out, n, stream=None) -> None:
        """One INT4 GEMV (batch 1), fp32 accumulate.

        kind     "qkv" (RMSNorm + store + bias), "o" / "down" (out += W x, in place),
                 "gate_up" (RMSNorm + SwiGLU over the stacked [gate; up] weight)
        x        fp16 [K]; norm_w fp16 [K] (qkv, gate_up) or 0
        qweight  uint32 [R, K/8] ValueShuffle rows; scales fp16 [R, K/128]; R = n (gate_up: 2n)
        bias     fp16 [n] or 0; out fp16 [n]
        """
        kernel, swiglu = self._gemv[kind]
        if self.gemv_variant == "tc":
            ctas = min(-(-n // TC_ROWS), self.max_ctas)  # one CTA per 8 output rows
        else:
            tiles = n if swiglu else n // GEMV_ROWS
            ctas = min(-(-tiles // (GEMV_THREADS // 32)), self.max_ctas)
        self._go(kernel, (ctas, 1, 1), GEMV_THREADS, x, norm_w, qweight, scales, bias, out,
                 _I32(n), stream=stream)  # fmt: skip

    def rope_kv(self, qkv, pos, rope, pages, kc, vc, q, k_out, v_out, T, stream=None) -> None:
        """RoPE + paged K/V write for T tokens at positions *pos .. *pos + T - 1.

        qkv fp16 [T, q+2kv] (bias added); pos int32* (device); rope float32 [max_pos, D/2, 2]
        (cos, sin); pages int32 [max_pages]; kc, vc fp16 [pages, 16, n_kv, D];
        q fp16 [T, n_heads, D]; k_out, v_out fp16 [T, n_kv, D] or 0.
        """
        self._go(self._rope, (T, 1, 1), MISC_THREADS, qkv, pos, rope, pages, kc, vc, q, k_out,
                 v_out, stream=stream)  # fmt: skip

    def attention(self, q, kc, vc, pages, pos, part_ml, part_acc, out, stream=None) -> None:
        """Decode attention of one token over L = *pos + 1 cached tokens.

        q fp16 [n_heads, D]; kc, vc fp16 [pages, 16, n_kv, D]; pages int32 [max_pages];
        part_ml fp32 [n_heads, S, 2]; part_acc fp32 [n_heads, S, D] (scratch, S = ATTN_SPLITS);
        out fp16 [n_heads, D].
        """
        c = self.config
        self._go(self._attn_split, (c.num_kv_heads, jit.ATTN_SPLITS, 1), ATTN_THREADS, q, kc,
                 vc, pages, pos, part_ml, part_acc, stream=stream)  # fmt: skip
        self._go(self._attn_combine, (c.num_heads, 1, 1), c.head_dim, part_ml, part_acc, out,
                 stream=stream)  # fmt: skip

    def lm_head(self, x, norm_w, w, logits, key, stream=None) -> None:
        """x fp16 [H] (pre-norm); norm_w fp16 [H]; w fp16 [V, H]; logits fp32 [V];
        key uint64* (atomicMax of the (logit, -id) key; zero before first use)."""
        v = self.config.vocab_size
        ctas = min(-(-(v // LM_ROWS) // (LM_THREADS // 32)), self.max_ctas)
        self._go(self._lm, (ctas, 1, 1), LM_THREADS, x, norm_w, w, logits, key, _I32(v),
                 stream=stream)  # fmt: skip

    def sample(self, logits, key, state, ring, host_ring, cancel, cond, stream=None) -> None:
        """Pick the next token, advance state (int32 [STATE_WORDS]), write ring[step] (device
        int32) and host_ring[step] (mapped host int32, count at host_ring[-1]; or 0), read the
        mapped cancel flag (or 0), set the while-loop condition `cond` (GraphCondition or 0)."""
        cond_arg = cond if cond is not None and not isinstance(cond, int) else np.uint64(cond or 0)
        self._go(self._sample, (1, 1, 1), SAMPLE_THREADS, logits, key, state, ring, host_ring,
                 cancel, cond_arg, _I32(self.config.vocab_size), stream=stream)  # fmt: skip
