"""The multi-row verify step: M tokens of one sequence through one pass over the weights
(speculative decoding feeds the step's token and its drafts; dev/verify_step.py checks each row
against the decode step and times it by M).

The M tokens sit at the consecutive positions *start .. *start + M - 1 (`start` a device word:
the decode state's POS in the engine's loop). Per layer: gemv_rows q/k/v (RMSNorm, bias, RoPE,
K/V into the pages at each row's position), attention_rows (causal inside the block: row t over
keys 0 .. *start + t), gemv_rows o (+ residual), gate/up (RMSNorm, SwiGLU), down (+ residual;
K split across the CTAs where gemv_rows would take its K in many slices: down_path); then
lm_head_rows (final RMSNorm, logits, each row's argmax key).

M is a launch argument, fixed when a graph captures the step: the engine captures it at
M = 1 + K and lets draft_ngram pad the rows past the drafts (speculate.cu).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..cuda import registry
from ..cuda.decode import DecodeKernels, VerifyKernels, rows_attention_scratch_buffers
from ..cuda.prefill import PrefillKernels
from ..cuda.registry import Geometry
from .kv_cache import KVCache
from .weights import Weights, check_speculation_head


def verify_buffers(config: ModelConfig, rows: int) -> dict[str, int]:
    """Bytes of Verify's own buffers for `rows` rows: tokens and pos int32 [rows], res fp32
    [rows, H] (the residual stream), x fp16 [rows, H] (its copy), q and attn fp16 [rows, q], mlp
    fp16 [rows, I], logits fp32 [rows, V], keys u64 [rows] (attention_rows' scratch:
    rows_attention_scratch_buffers)."""
    c = config
    return {
        "tokens": rows * 4,
        "pos": rows * 4,
        "res": rows * c.hidden_size * 4,
        "x": rows * c.hidden_size * 2,
        "q": rows * c.q_size * 2,
        "attn": rows * c.q_size * 2,
        "mlp": rows * c.intermediate_size * 2,
        "logits": rows * c.vocab_size * 4,
        "keys": rows * 8,
    }


# down_proj's three paths: "rows" (gemv_rows, each CTA its pairs over all K), "split"
# (gemv_rows_split + gemv_rows_split_sum: K split across the CTAs, the slices summed by a second
# launch), "gemm" (the prefill's tensor-core GEMM, its 16-token tile). gemv_rows pays for every
# K slice it takes in turn (a reload of x, a barrier and a reduction a stage): measured slower
# than the GEMM at every M from 5 slices (the real 1.5B) up (docs/EXPERIMENTS.md, Speculative
# decoding); one slice (the 0.5B at M <= 8) is its best case. From DOWN_SLICED_MIN_SLICES
# slices on, the step takes DOWN_SLICED, the split: faster than the GEMM on every shape (7B, M =
# 8: 17.0 us a layer against 27.6) and the closest of the three to float64 (dev/down_ab.py: the
# GEMM rounds the dequantized weights to fp16). "gemm" stays as the A/B baseline of
# dev/verify_step.py and dev/spec_workloads.py (--down).
DOWN_SLICED_MIN_SLICES = 5
DOWN_SLICED = "split"
DOWN_PATHS = ("rows", "split", "gemm")


def down_path(config: ModelConfig, rows: int, geometry: Geometry) -> str:
    """How the verify step runs down_proj at `rows` rows: DOWN_SLICED where x of the rows over
    the intermediate size is so far from fitting in shared memory that gemv_rows would take K
    in DOWN_SLICED_MIN_SLICES slices or more, else "rows"."""
    k, n, _, epi = registry.gemv_shapes(config)["down"]
    slices = registry.rows_split(k, n, epi, registry.row_bucket(rows), geometry)
    return DOWN_SLICED if slices >= DOWN_SLICED_MIN_SLICES else "rows"


def down_proj(step, m: int, path: str, mlp: int, layer, x: int, res: int, part: int,
              stream) -> None:  # fmt: skip
    """One layer's down_proj of m rows by `path` (down_path's): res fp32 [m, H] += W mlp and
    x fp16 [m, H] its copy, mlp fp16 [m, I]; `step` holds the launchers (kernels,
    prefill_kernels); part: the split's workspace (registry.rows_split_workspace bytes)."""
    if path == "split":
        step.kernels.gemv_rows_split(m, mlp, layer.down_w, layer.down_s, x, res, part,
                                     stream=stream)  # fmt: skip
    elif path == "gemm":
        c = step.config
        step.prefill_kernels.gemm(mlp, layer.down_w, layer.down_s, None, x, m, c.hidden_size,
                                  c.intermediate_size, residual=res, label="gemm down",
                                  stream=stream)  # fmt: skip
    elif path == "rows":
        step.kernels.gemv_rows("down", m, mlp, 0, layer.down_w, layer.down_s, x, res=res,
                               stream=stream)  # fmt: skip
    else:
        raise ValueError(f"down_proj path {path!r}: one of {DOWN_PATHS}")


def verify_plan(config: ModelConfig, rows: int, geometry: Geometry) -> list[int]:
    """Every buffer Verify allocates, in bytes (engine.memory)."""
    scratch = rows_attention_scratch_buffers(config, geometry)
    split = registry.rows_split_workspace(config, geometry)  # down_proj's split: Verify.part
    return [*verify_buffers(config, rows).values(), *scratch.values(), split]


class Verify:
    """The verify step over an engine's weights, KV cache and RoPE table, with its own buffers
    for up to `rows` rows (verify_buffers; `buf` maps each name to its device address).
    `kernels` must be built with rows=True (gemv_rows). The argmax keys must be zero before a
    step (lm_head_rows takes an atomic max): the caller zeroes them after reading them. `down`
    is down_proj's path (down_path; "gemm" runs on prefill_kernels); `part` the split path's
    workspace, allocated whatever the path so that a test may switch."""

    def __init__(
        self,
        gpu,
        config: ModelConfig,
        kernels: DecodeKernels,
        weights: Weights,
        kv: KVCache,
        rope: int,
        rows: int,
        prefill_kernels: PrefillKernels,
    ) -> None:
        check_speculation_head(weights.lm_head_format)  # lm_head_rows reads fp16 rows
        self.gpu, self.config, self.kernels = gpu, config, kernels
        self.weights, self.kv, self.rope, self.rows = weights, kv, rope, rows
        self.prefill_kernels = prefill_kernels
        self.down = down_path(config, rows, kernels.geometry)
        self.verify = VerifyKernels(gpu, config, kernels.geometry, pdl=kernels.pdl)
        if not 1 <= rows <= self.verify.geometry.verify_rows:
            raise ValueError(f"verify rows must be 1..{self.verify.geometry.verify_rows}")
        self.attn_scratch = self.verify.attention_scratch()
        sizes = verify_buffers(config, rows)
        self.buf = {k: gpu.alloc(n, f"verify {k}").ptr for k, n in sizes.items()}
        gpu.memset(self.buf["keys"], 0, sizes["keys"])
        split = registry.rows_split_workspace(config, kernels.geometry)
        self.part = gpu.alloc(split, "verify down_proj split").ptr

    def step(self, m: int, start: int, stream=None) -> None:
        """The verify step over the first m rows of buf["tokens"] at positions buf["pos"];
        start: int32* the first row's position (the causal bound of attention_rows)."""
        if not 1 <= m <= self.rows:
            raise ValueError(f"verify step: m must be 1..{self.rows}, got {m}")
        b, k, v, w, kv = self.buf, self.kernels, self.verify, self.weights, self.kv
        k.embed(b["tokens"], w.embed, b["x"], b["res"], m, stream=stream)
        for i, L in enumerate(w.layers):
            k.gemv_rows("qkv", m, b["x"], L.input_norm, L.qkv_w, L.qkv_s, b["q"], bias=L.qkv_b,
                        pos=b["pos"], rope=self.rope, pages=kv.page_table, page_stride=0,
                        kc=kv.k[i], vc=kv.v[i], stream=stream)  # fmt: skip
            v.attention_rows(b["q"], kv.k[i], kv.v[i], kv.page_table, start, m,
                             self.attn_scratch, b["attn"], stream=stream)  # fmt: skip
            k.gemv_rows("o", m, b["attn"], 0, L.o_w, L.o_s, b["x"], res=b["res"], stream=stream)
            k.gemv_rows("gate_up", m, b["x"], L.post_norm, L.gate_up_w, L.gate_up_s, b["mlp"],
                        stream=stream)  # fmt: skip
            down_proj(self, m, self.down, b["mlp"], L, b["x"], b["res"], self.part, stream)
        v.lm_head_rows(b["x"], w.final_norm, w.lm_head, b["logits"], b["keys"], m, stream=stream)
