"""The multi-row verify step: M tokens of one sequence through one pass over the weights
(speculative decoding feeds the step's token and its drafts; dev/verify_step.py checks each row
against the decode step and times it by M).

The M tokens sit at the consecutive positions *start .. *start + M - 1 (`start` a device word:
the decode state's POS in the engine's loop). rows_forward (the batched step's too): per layer
gemv_rows q/k/v (RMSNorm, bias, RoPE, K/V into the pages at each row's position),
attention_rows (causal inside the block: row t over keys 0 .. *start + t), gemv_rows o (+
residual), gate/up (RMSNorm, SwiGLU), down (+ residual; K split across the CTAs where gemv_rows
would take its K in many slices: down_path); then lm_head_rows (final RMSNorm, logits, each
row's argmax key).

M is a launch argument, fixed when a graph captures the step: the engine captures it at
M = 1 + K and lets draft_ngram pad the rows past the drafts (speculate.cu).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..cuda import registry
from ..cuda.decode import DecodeKernels, NormLink, VerifyKernels, rows_attention_scratch_buffers
from ..cuda.registry import Geometry
from .kv_cache import KVCache
from .weights import Weights, check_speculation_head


def verify_buffers(config: ModelConfig, rows: int) -> dict[str, int]:
    """Bytes of Verify's own buffers for `rows` rows: tokens and pos int32 [rows], res fp32
    [rows, H] (the residual stream), x fp16 [rows, H] (the next RMSNorm's input: the hand-off,
    gemv_rows.cu; the plain copy after the last layer), q and attn fp16 [rows, q], mlp
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


# down_proj's two paths: "rows" (gemv_rows, each CTA its pairs over all K) and "split"
# (gemv_rows_split + gemv_rows_split_sum: K split across the CTAs, the slices summed by a second
# launch). gemv_rows pays for every K slice it takes in turn (a reload of x, a barrier and a
# reduction a stage): measured slower than the prefill's GEMM at every M from 5 slices (the
# real 1.5B) up (docs/EXPERIMENTS.md, Speculative decoding); one slice (the 0.5B at M <= 8) is
# its best case. From DOWN_SLICED_MIN_SLICES slices on, the step takes DOWN_SLICED, the split:
# faster than the GEMM on every shape (7B, M = 8: 17.0 us a layer against 27.6) and closer to
# float64 (dev/down_ab.py: the GEMM rounds the dequantized weights to fp16). Both hand the next
# RMSNorm's input over (gemv_rows.cu), which the GEMM's epilogue does not.
DOWN_SLICED_MIN_SLICES = 5
DOWN_SLICED = "split"
DOWN_PATHS = ("rows", "split")


def down_path(config: ModelConfig, rows: int, geometry: Geometry) -> str:
    """How the verify step runs down_proj at `rows` rows: DOWN_SLICED where x of the rows over
    the intermediate size is so far from fitting in shared memory that gemv_rows would take K
    in DOWN_SLICED_MIN_SLICES slices or more, else "rows"."""
    k, n, _, epi = registry.gemv_shapes(config)["down"]
    slices = registry.rows_split(k, n, epi, registry.row_bucket(rows), geometry)
    return DOWN_SLICED if slices >= DOWN_SLICED_MIN_SLICES else "rows"


def down_proj(step, m: int, path: str, mlp: int, layer, x: int, res: int, part: int,
              next_w: int, stream) -> None:  # fmt: skip
    """One layer's down_proj of m rows by `path` (down_path's): res fp32 [m, H] += W mlp and
    x fp16 [m, H] the hand-off to the RMSNorm of weight next_w (0: the plain fp16 copy), mlp
    fp16 [m, I]; `step` holds the launchers (kernels) and the NormLink (link); part: the
    split's workspace (registry.rows_split_workspace bytes)."""
    if path == "split":
        step.kernels.gemv_rows_split(m, mlp, layer.down_w, layer.down_s, x, res, part,
                                     link=step.link, next_w=next_w, stream=stream)  # fmt: skip
    elif path == "rows":
        step.kernels.gemv_rows("down", m, mlp, layer.down_w, layer.down_s, x, link=step.link,
                               res=res, next_w=next_w, stream=stream)  # fmt: skip
    else:
        raise ValueError(f"down_proj path {path!r}: one of {DOWN_PATHS}")


def rows_forward(step, m: int, tokens: int, pos: int, pages: int, page_stride: int, down: str,
                 attend, stream) -> None:  # fmt: skip
    """The multi-row forward pass of Verify.step and BatchStep.forward over m rows, with
    `step`'s kernels, verify (VerifyKernels), weights, kv, rope, buf (x, res, q, attn, mlp,
    logits, keys), part and link: embed_rows of tokens int32 [m]; per layer gemv_rows q/k/v
    (RMSNorm, bias, RoPE at pos[r], K/V into row r's pages, its table at pages + r
    page_stride), attend(i, stream) (the step's attention of layer i: buf q -> attn), gemv_rows
    o, gate/up, down_proj by `down`; then lm_head_rows (final RMSNorm, logits, argmax keys).
    The residual GEMVs hand the next RMSNorm's input over (gemv_rows.cu's hand-off, through
    step.link); the last down_proj writes the plain fp16 copy that lm_head_rows normalizes."""
    b, k, w, kv, link = step.buf, step.kernels, step.weights, step.kv, step.link
    layers = w.layers
    k.embed_rows(tokens, w.embed, layers[0].input_norm, b["x"], b["res"], m, link,
                 stream=stream)  # fmt: skip
    for i, L in enumerate(layers):
        k.gemv_rows("qkv", m, b["x"], L.qkv_w, L.qkv_s, b["q"], link=link, bias=L.qkv_b,
                    pos=pos, rope=step.rope, pages=pages, page_stride=page_stride, kc=kv.k[i],
                    vc=kv.v[i], stream=stream)  # fmt: skip
        attend(i, stream)
        k.gemv_rows("o", m, b["attn"], L.o_w, L.o_s, b["x"], link=link, res=b["res"],
                    next_w=L.post_norm, stream=stream)  # fmt: skip
        k.gemv_rows("gate_up", m, b["x"], L.gate_up_w, L.gate_up_s, b["mlp"], link=link,
                    stream=stream)  # fmt: skip
        next_w = layers[i + 1].input_norm if i + 1 < len(layers) else 0
        down_proj(step, m, down, b["mlp"], L, b["x"], b["res"], step.part, next_w, stream)
    step.verify.lm_head_rows(b["x"], w.final_norm, w.lm_head, b["logits"], b["keys"], m,
                             stream=stream)  # fmt: skip


def verify_plan(config: ModelConfig, rows: int, geometry: Geometry) -> list[int]:
    """Every buffer Verify allocates, in bytes (engine.memory)."""
    scratch = rows_attention_scratch_buffers(config, geometry)
    split = registry.rows_split_workspace(config, geometry)  # down_proj's split: Verify.part
    return [*verify_buffers(config, rows).values(), *scratch.values(), split,
            registry.NORM_LINK_BYTES]  # fmt: skip


class Verify:
    """The verify step over an engine's weights, KV cache and RoPE table, with its own buffers
    for up to `rows` rows (verify_buffers; `buf` maps each name to its device address).
    `kernels` must be built with rows=True (gemv_rows). The argmax keys must be zero before a
    step (lm_head_rows takes an atomic max): the caller zeroes them after reading them. `down`
    is down_proj's path (down_path); `part` the split path's workspace, allocated whatever the
    path so that a test may switch; `link` the RMSNorm hand-off's buffers (NormLink)."""

    def __init__(
        self,
        gpu,
        config: ModelConfig,
        kernels: DecodeKernels,
        weights: Weights,
        kv: KVCache,
        rope: int,
        rows: int,
    ) -> None:
        check_speculation_head(weights.lm_head_format)  # lm_head_rows reads fp16 rows
        self.gpu, self.config, self.kernels = gpu, config, kernels
        self.weights, self.kv, self.rope, self.rows = weights, kv, rope, rows
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
        self.link = NormLink(gpu)

    def step(self, m: int, start: int, long: bool = False, stream=None) -> None:
        """The verify step over the first m rows of buf["tokens"] at positions buf["pos"];
        start: int32* the first row's position (the causal bound of attention_rows); long:
        attention_rows' long form (VerifyKernels.long_form of the rows' positions: any form is
        exact at any context, the right one is faster)."""
        if not 1 <= m <= self.rows:
            raise ValueError(f"verify step: m must be 1..{self.rows}, got {m}")
        b, kv = self.buf, self.kv

        def attend(i: int, stream) -> None:
            self.verify.attention_rows(b["q"], kv.k[i], kv.v[i], kv.page_table, start, m,
                                       self.attn_scratch, b["attn"], long=long,
                                       stream=stream)  # fmt: skip

        rows_forward(self, m, b["tokens"], b["pos"], kv.page_table, 0, self.down, attend, stream)
