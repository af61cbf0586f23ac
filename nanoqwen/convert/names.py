"""The one map from Hugging Face and GGUF tensor names to ours, and the shared storing step.

A converter yields *logical* tensors: `(our_name, float array)` in Hugging Face orientation
(rows = output features). Logical names are the stored names of `ModelConfig.tensor_shapes()`,
except that a projection weight is `layers.{i}.{proj}` (float [N, K]); `to_stored` turns it
into `layers.{i}.{proj}.qweight` (uint32 [N, K/8], ValueShuffle) and `.scales` (float16
[N, K/128]) through a projection quantizer (`quant.quantize_pack`, round to nearest, unless the
converter passes another of nanoqwen.quantizers). Everything else is stored as float16, refusing
NaN/Inf and values beyond the fp16 range.

A source `lm_head` of a tied model (`tie_word_embeddings`) is accepted only when it equals the
embeddings; `TieCheck` compares SHA-256 digests, so neither tensor is held in memory.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..config import PROJECTIONS, ModelConfig
from ..errors import ConvertError
from ..quant import QuantError, quantize_pack

LM_HEAD = "lm_head"
EMBED = "embed_tokens"

# Per-layer tensors: logical suffix -> (Hugging Face suffix, GGUF suffix).
_LAYER_NAMES: dict[str, tuple[str, str]] = {
    "input_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "post_attn_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "q_proj": ("self_attn.q_proj.weight", "attn_q.weight"),
    "q_proj.bias": ("self_attn.q_proj.bias", "attn_q.bias"),
    "k_proj": ("self_attn.k_proj.weight", "attn_k.weight"),
    "k_proj.bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_proj": ("self_attn.v_proj.weight", "attn_v.weight"),
    "v_proj.bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "o_proj": ("self_attn.o_proj.weight", "attn_output.weight"),
    "gate_proj": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "up_proj": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down_proj": ("mlp.down_proj.weight", "ffn_down.weight"),
}
# Model-level tensors: logical name -> (Hugging Face name, GGUF name).
_GLOBAL_NAMES: dict[str, tuple[str, str]] = {
    EMBED: ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    LM_HEAD: ("lm_head.weight", "output.weight"),
}
_SOURCES = {"hf": 0, "gguf": 1}


def source_names(config: ModelConfig, source: str) -> dict[str, str]:
    """Every tensor a `source` ("hf" or "gguf") checkpoint of `config` holds: name -> logical.

    Includes `lm_head` even for a tied model (an optional source tensor there).
    """
    col = _SOURCES[source]
    layer_prefix = "model.layers.{}." if source == "hf" else "blk.{}."
    names = {pair[col]: logical for logical, pair in _GLOBAL_NAMES.items()}
    for layer in range(config.num_layers):
        prefix = layer_prefix.format(layer)
        for suffix, pair in _LAYER_NAMES.items():
            names[prefix + pair[col]] = f"layers.{layer}.{suffix}"
    return names


def logical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical name -> float shape a converter must deliver (projections as [N, K])."""
    shapes = {}
    for name, (_, shape) in config.tensor_shapes().items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            shapes[base] = config.projection_shape(base.rsplit(".", 1)[1])
        else:
            shapes[name] = shape
    shapes.setdefault(LM_HEAD, (config.vocab_size, config.hidden_size))
    return shapes


def check_names(config: ModelConfig, present: list[str], source: str, where: str) -> list[str]:
    """Refuse missing or unknown source tensors; return the names to convert, in order.

    Unknown names are refused except `rotary_emb.inv_freq` buffers of old HF checkpoints.
    A tied model may omit `lm_head`; an untied one may not.
    """
    expected = source_names(config, source)
    optional = {n for n, logical in expected.items() if logical == LM_HEAD}
    optional = optional if config.tie_word_embeddings else set()
    have = set(present)
    missing = [n for n in expected if n not in have and n not in optional]
    extra = [n for n in present if n not in expected and not n.endswith("rotary_emb.inv_freq")]
    if missing:
        raise ConvertError(
            f"{where}: {len(missing)} tensor(s) missing for a {config.num_layers}-layer model, "
            f"e.g. {', '.join(missing[:4])}"
        )
    if extra:
        raise ConvertError(
            f"{where}: {len(extra)} unexpected tensor(s) for a {config.num_layers}-layer model, "
            f"e.g. {', '.join(extra[:4])}"
        )
    return [n for n in present if n in expected]


def check_shape(source_name: str, logical: str, shape: tuple[int, ...], want: tuple[int, ...]):
    """Refuse a source tensor whose (HF-orientation) shape is not the config's."""
    if tuple(shape) != tuple(want):
        raise ConvertError(
            f"tensor {source_name} ({logical}): shape {tuple(shape)}, expected {tuple(want)}"
        )


def _to_fp16(array: np.ndarray, label: str) -> np.ndarray:
    """float [...] -> float16, refusing NaN/Inf and |x| > 65504 (min/max need no temporaries;
    NaN propagates through them)."""
    a32 = np.asarray(array, dtype=np.float32)
    lo, hi = (float(a32.min()), float(a32.max())) if a32.size else (0.0, 0.0)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        finite = np.isfinite(a32)
        bad = np.unravel_index(int(np.argmin(finite)), a32.shape)
        raise ConvertError(f"tensor {label}: non-finite value {a32[bad]} at {list(bad)}")
    peak = max(hi, -lo)
    if peak > float(np.finfo(np.float16).max):
        raise ConvertError(f"tensor {label}: max |value| {peak:.6g} overflows float16 (65504)")
    return a32.astype(np.float16)


def rtn(logical: str, array: np.ndarray, label: str) -> tuple[np.ndarray, np.ndarray]:
    """The default projection quantizer: round to nearest (quant.quantize_pack)."""
    return quantize_pack(array, label)


def to_stored(
    logical: str, array: np.ndarray, source_name: str, quantize=rtn
) -> list[tuple[str, np.ndarray]]:
    """One logical float tensor -> the stored (name, array) pairs of the .nanoqwen file.

    quantize(logical, float [N, K], label) -> (qweight uint32 [N, K/8], scales float16
    [N, K/128]) stores a projection."""
    label = f"{source_name} ({logical})" if source_name != logical else logical
    base = logical.rsplit(".", 1)[-1]
    if base in PROJECTIONS:
        try:
            qweight, scales = quantize(logical, array, label)
        except QuantError as exc:
            raise ConvertError(f"tensor {exc}") from None
        return [(logical + ".qweight", qweight), (logical + ".scales", scales)]
    return [(logical, _to_fp16(array, label))]


class TieCheck:
    """Accepts a tied model's source lm_head only if it equals the embeddings (by digest)."""

    def __init__(self, where: str):
        self.where = where
        self.digests: dict[str, str] = {}

    def add(self, logical: str, array: np.ndarray) -> None:
        """Record the float32 digest of `embed_tokens` or `lm_head` (others are ignored)."""
        if logical in (EMBED, LM_HEAD):
            data = np.ascontiguousarray(array, dtype=np.float32)
            self.digests[logical] = hashlib.sha256(data.data).hexdigest()

    def finish(self) -> None:
        if LM_HEAD in self.digests and self.digests[LM_HEAD] != self.digests.get(EMBED):
            raise ConvertError(
                f"{self.where}: the config ties word embeddings but the checkpoint's lm_head "
                "differs from embed_tokens; set tie_word_embeddings false or drop lm_head"
            )


def convert_stream(config: ModelConfig, items, where: str, quantize=rtn):
    """Logical (source_name, logical, float array) items -> stored (name, array) pairs;
    projections through `quantize` (see to_stored).

    Shapes are checked against `config`; a tied model's lm_head is dropped after TieCheck.
    """
    tie = TieCheck(where) if config.tie_word_embeddings else None
    shapes = logical_shapes(config)
    for source_name, logical, array in items:
        check_shape(source_name, logical, array.shape, shapes[logical])
        if tie is not None:
            tie.add(logical, array)
            if logical == LM_HEAD:
                continue
        yield from to_stored(logical, array, source_name, quantize)
        del array  # release the source tensor before the next one is read
    if tie is not None:
        tie.finish()
