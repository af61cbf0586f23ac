"""GGUF (llama.cpp) qwen2 checkpoints -> logical float tensors, one at a time.

The file is memory-mapped by `gguf.GGUFReader`; each tensor is dequantized to float32 with
`gguf.quants.dequantize` only when the writer asks for it, so peak memory is about one
dequantized tensor. GGUF lists dims fastest-first (ne0 = K for a weight); the reader's numpy
view is already row-major [N, K], which is Hugging Face orientation.

Q/K row order: llama.cpp's HF -> GGUF converter permutes the Q/K rows (to interleaved RoPE pairs)
only for the LLaMA family; qwen2 uses NEOX RoPE and keeps the Hugging Face order, so rows are
taken as they are. (Checked on the real Qwen2.5-Coder 0.5B/1.5B files: see tests and the
converter notes in the helper report.)

Config comes from the `qwen2.*` metadata; the vocabulary size from the rows of token_embd; the
model is tied exactly when the file has no output.weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ConfigError, ModelConfig
from ..errors import ConvertError
from .names import check_names, convert_stream, source_names
from .tokenizers import spec_from_gguf_fields

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q4_0")
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
)


def open_gguf(path: Path):
    """A GGUFReader over `path`, with ConvertError for a missing or unreadable file."""
    import gguf

    if not path.is_file():
        raise ConvertError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise ConvertError(f"{path}: not a readable GGUF file: {exc}") from None


def field_value(reader, key: str):
    """The Python value of metadata `key` (str, int, float, list), or None when absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _f32(value) -> float:
    """A float32 metadata value as its shortest decimal (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def config_from_gguf(reader, name: str) -> ModelConfig:
    """The ModelConfig of a qwen2 GGUF file (architecture and `qwen2.*` keys)."""
    arch = field_value(reader, "general.architecture")
    if arch != "qwen2":
        raise ConvertError(f"{name}: general.architecture is {arch!r}; only 'qwen2' is supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConvertError(f"{name}: no token_embd.weight tensor")

    def need(key: str):
        value = field_value(reader, f"qwen2.{key}")
        if value is None:
            raise ConvertError(f"{name}: metadata qwen2.{key} is missing")
        return value

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    key_length = field_value(reader, "qwen2.attention.key_length")
    try:
        return ModelConfig(
            name=name,
            vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ne = [hidden, vocab]
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(need("attention.head_count_kv")),
            head_dim=int(key_length) if key_length else hidden // heads,
            rope_theta=_f32(need("rope.freq_base")),
            rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in tensors,
        )
    except ConfigError as exc:
        raise ConvertError(f"{name}: {exc}") from None


def tokenizer_from_gguf(reader, where: str):
    """The TokenizerSpec rebuilt from the file's tokenizer.* metadata, or None without one."""
    if reader.fields.get("tokenizer.ggml.tokens") is None:
        return None
    fields = {key: field_value(reader, key) for key in _TOKENIZER_KEYS}
    return spec_from_gguf_fields(fields, where)


def dequantize_tensor(tensor) -> np.ndarray:
    """One ReaderTensor -> float32 array, row-major with GGUF dims reversed ([N, K] / [H])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind.name not in SUPPORTED_TYPES:
        raise ConvertError(
            f"tensor {tensor.name}: GGUF type {kind.name} is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if kind == GGMLQuantizationType.BF16:
        bits = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        data = bits.view(np.float32)
    else:
        data = dequantize(np.asarray(tensor.data), kind)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def read_gguf(path: Path, quantizer: str = "rtn", device: str = "cpu"):
    """(config, tokenizer spec or None, stored-tensor iterator) for one GGUF file; projections
    quantized by `quantizer` (a name of nanoqwen.quantizers.QUANTIZERS; a calibrated one on the
    torch `device`)."""
    from ..quantizers import projection_quantizer

    reader = open_gguf(path)
    config = config_from_gguf(reader, path.stem)
    tokenizer = tokenizer_from_gguf(reader, str(path))
    tensors = {t.name: t for t in reader.tensors}
    order = check_names(config, list(tensors), "gguf", str(path))
    logical = source_names(config, "gguf")
    by_logical = {logical[name]: name for name in order}

    def items():
        for name in order:
            yield name, logical[name], dequantize_tensor(tensors[name])

    def get(name: str) -> np.ndarray:
        return dequantize_tensor(tensors[by_logical[name]])

    quantize = projection_quantizer(quantizer, config, tokenizer, get, str(path), device)
    return config, tokenizer, convert_stream(config, items(), str(path), quantize)
