"""Launchers of the batched decode step's own kernels (registry.batch_specs): attention over B
sequences of one query token each (decode_attention.cu's attn_decode<true>) and the per-row
sampler (decode_misc.cu's sample_batch). The step's GEMVs are DecodeKernels.gemv_rows, its
lm_head VerifyKernels.lm_head_rows; engine/batch.py composes them.

Every pointer is a device address (int); every method takes `stream` (a cuda.core Stream or a
GraphBuilder being built; default: the Gpu's stream).
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import NanoqwenError
from . import registry
from .decode import AttentionScratch
from .device import Gpu
from .launcher import Launcher

_I32 = np.int32


def batch_attention_scratch_buffers(
    config: ModelConfig, g: registry.Geometry, rows: int
) -> dict[str, int]:
    """Bytes of attn_decode<true>'s scratch for `rows` sequences (S = g.attn_splits, the
    kernel's stride): part_ml fp32 [rows, n_heads, S, 2], part_acc fp32 [rows, n_heads, S, D],
    counters int32 [rows, n_kv]."""
    c, splits = config, g.attn_splits
    return {
        "part_ml": rows * c.num_heads * splits * 2 * 4,
        "part_acc": rows * c.num_heads * splits * c.head_dim * 4,
        "counters": rows * c.num_kv_heads * 4,
    }


def spare_clusters(config: ModelConfig, g: registry.Geometry) -> int:
    """The batched attention grid's clusters a kv head beyond one a sequence: the single-stream
    step's (DecodeKernels.attn_splits / attn_cluster), so that one long sequence among short
    ones gets about the splits it would get alone."""
    cl = g.attn_cluster
    per_head = min(g.attn_splits, g.attn_ctas // config.num_kv_heads)
    return max(cl, per_head // cl * cl) // cl


class BatchKernels(Launcher):
    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        *,
        pdl: bool = True,
    ) -> None:
        super().__init__(gpu, config, registry.batch_specs(config, geometry), geometry, pdl=pdl)
        for kernel in self.kernels.values():  # the decode step's one carveout (DecodeKernels)
            gpu.set_smem_carveout(kernel, self.geometry.smem_carveout)
        self.spare = spare_clusters(config, self.geometry)

    def attention(self, q, kc, vc, pages, page_stride: int, pos, rows: int,
                  scratch: AttentionScratch, out, stream=None) -> None:  # fmt: skip
        """Decode attention of `rows` sequences, one query token each, sequence b over its
        L_b = pos[b] + 1 cached tokens; the splits follow each sequence's length (one launch:
        decode_attention.cu's attn_batch_slot).

        q fp16 [rows, n_heads, D] (RoPE applied); kc, vc the layer's K/V caches
        (engine.kv_cache's device layout); pages int32 [rows, page_stride] (sequence b's table
        at pages + b * page_stride); pos int32 [rows] (device, staged before the step: not
        written by the preceding kernel); scratch from scratch(rows) or larger; out fp16
        [rows, n_heads, D].
        """
        if not 1 <= rows <= registry.MAX_ROWS or page_stride < 1:
            raise NanoqwenError(
                f"attention_batch: rows must be 1..{registry.MAX_ROWS} and page_stride >= 1, "
                f"got {rows}, {page_stride}"
            )
        c, cl = self.config, self.geometry.attn_cluster
        self.launch("attention_batch", (c.num_kv_heads, (rows + self.spare) * cl, 1), q, kc, vc,
                    pages, pos, scratch.part_ml.ptr, scratch.part_acc.ptr, scratch.counters.ptr,
                    out, _I32(rows), _I32(page_stride), stream=stream, label="attention",
                    per_token=registry.kv_token_bytes(c, self.geometry))  # fmt: skip

    def scratch(self, rows: int) -> AttentionScratch:
        """attention's scratch for up to `rows` sequences, allocated on the Gpu."""
        sizes = batch_attention_scratch_buffers(self.config, self.geometry, rows)
        return AttentionScratch.allocate(self.gpu, sizes, "attention_batch")

    def sample(self, logits, keys, params, tokens, rows: int, stream=None) -> None:
        """Each row's token by sample_finish's rule with the row's own parameters.

        logits fp32 [rows, V]; keys u64 [rows] (lm_head's argmax keys; re-zeroed); params
        int32 [rows, registry.STATE_WORDS] (each row's StateWord words: TEMP, TOP_K, TOP_P,
        SEED_LO, SEED_HI and STEP, the draw's counter, are read); tokens int32 [rows] out.
        """
        v = self.config.vocab_size
        self.launch("sample_batch", (rows, 1, 1), logits, keys, params, tokens, _I32(v),
                    stream=stream, label="sample", nbytes=rows * v * 4)  # fmt: skip
