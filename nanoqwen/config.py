"""The one home for the model's shape.

`ModelConfig` describes a Qwen2 decoder (Qwen2.5-Coder family). It is validated once, at
construction, for everything the rest of the stack relies on: INT4 groups of 128 along every
K dimension, grouped-query attention that divides evenly, an even head_dim for RoPE halves.
The kernels receive the same numbers as constexpr (a generated header), and the file reader
checks every tensor shape against `tensor_shapes()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import NanoqwenError

GROUP_SIZE = 128  # INT4 quantization group along K (input features)
# Tokens per KV-cache page: the unit the engine allocates and the kernels address (a page of
# one KV head is one m16n8k16 key tile in decode attention).
PAGE_TOKENS = 16

# The seven INT4 projections of a decoder layer, in file order.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BIASED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# Bytes an element of each stored dtype takes (tensor_shapes' dtypes).
DTYPE_BYTES = {"float16": 2, "uint32": 4, "int8": 1, "float32": 4}


class ConfigError(NanoqwenError, ValueError):
    """A model configuration that the runtime cannot serve."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        for field in (*ints, "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"{self.name}: num_heads * head_dim = {self.num_heads * self.head_dim} "
                f"!= hidden_size {self.hidden_size}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim {self.head_dim} must be even for RoPE")
        for field in ("hidden_size", "intermediate_size"):
            if getattr(self, field) % GROUP_SIZE:
                raise ConfigError(
                    f"{self.name}: {field} {getattr(self, field)} is not a multiple of the "
                    f"INT4 group size {GROUP_SIZE}"
                )
        if not (self.rope_theta > 0 and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"{self.name}: rope_theta and rms_norm_eps must be positive")

    # Derived sizes -----------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_ratio(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(N, K) = (output features, input features) of one INT4 projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }[proj]

    def tensor_shapes(self, lm_head: str = "float16") -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor a .nanoqwen file of this config holds: name -> (dtype, shape).

        INT4 projections are stored as `<proj>.qweight` (uint32 [N, K/8], ValueShuffle words,
        row-major) and `<proj>.scales` (float16 [N, K/128]); biases, norms and embeddings are
        float16. `lm_head` is the file's head format (quant.LM_HEAD_FORMATS): "float16" stores
        `lm_head` float16 [V, H], and a tied model has none (it reads `embed_tokens`); "int8"
        stores `lm_head.q8` int8 [V, H] and `lm_head.scale` float32 [V] (one scale a row,
        quant.quantize_rows_int8), tied or not: a tied model keeps its fp16 `embed_tokens` for
        the lookup beside them.
        """
        h, v = self.hidden_size, self.vocab_size
        shapes: dict[str, tuple[str, tuple[int, ...]]] = {"embed_tokens": ("float16", (v, h))}
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            shapes[p + "input_norm"] = ("float16", (h,))
            shapes[p + "post_attn_norm"] = ("float16", (h,))
            for proj in PROJECTIONS:
                n, k = self.projection_shape(proj)
                shapes[f"{p}{proj}.qweight"] = ("uint32", (n, k // 8))
                shapes[f"{p}{proj}.scales"] = ("float16", (n, k // GROUP_SIZE))
                if proj in BIASED_PROJECTIONS:
                    shapes[f"{p}{proj}.bias"] = ("float16", (n,))
        shapes["final_norm"] = ("float16", (h,))
        if lm_head == "int8":
            shapes["lm_head.q8"] = ("int8", (v, h))
            shapes["lm_head.scale"] = ("float32", (v,))
        elif lm_head != "float16":
            raise ConfigError(f"lm_head format {lm_head!r} is not float16 or int8")
        elif not self.tie_word_embeddings:
            shapes["lm_head"] = ("float16", (v, h))
        return shapes

    def weight_bytes_per_token(self, lm_head: str = "float16") -> int:
        """Bytes a batch-1 decode step must read: every weight once (embeddings: one row;
        a tied fp16 head reads the whole embedding table)."""
        total = 0
        for name, (dtype, shape) in self.tensor_shapes(lm_head).items():
            count = 1
            for d in shape:
                count *= d
            size = DTYPE_BYTES[dtype]
            total += self.hidden_size * 2 if name == "embed_tokens" else count * size
        if self.tie_word_embeddings and lm_head == "float16":
            total += self.vocab_size * self.hidden_size * 2
        return total

    # Serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"model config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config fields: {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"incomplete model config: {exc}") from None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "hf") -> ModelConfig:
        """Build from a Hugging Face Qwen2 `config.json` mapping."""
        arch = hf.get("model_type")
        if arch != "qwen2":
            raise ConfigError(f"config.json model_type is {arch!r}; only 'qwen2' is supported")
        try:
            heads = hf["num_attention_heads"]
            return cls(
                name=name,
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads", heads),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=hf.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks {exc.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` mapping of this config (for tests and export)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float16",
        }


_QWEN_VOCAB_SMALL = 151936  # <= 3B checkpoints
_QWEN_VOCAB_LARGE = 152064  # 7B and up

PRESETS: dict[str, ModelConfig] = {
    # Tiny test model: real Qwen2.5 vocabulary size so the special tokens keep their real ids.
    "tiny": ModelConfig("tiny", _QWEN_VOCAB_SMALL, 128, 384, 2, 2, 1, 64, tie_word_embeddings=True),
    "0.5b": ModelConfig(
        "0.5b", _QWEN_VOCAB_SMALL, 896, 4864, 24, 14, 2, 64, tie_word_embeddings=True
    ),
    "1.5b": ModelConfig(
        "1.5b", _QWEN_VOCAB_SMALL, 1536, 8960, 28, 12, 2, 128, tie_word_embeddings=True
    ),
    "3b": ModelConfig(
        "3b", _QWEN_VOCAB_SMALL, 2048, 11008, 36, 16, 2, 128, tie_word_embeddings=True
    ),
    "7b": ModelConfig("7b", _QWEN_VOCAB_LARGE, 3584, 18944, 28, 28, 4, 128),
    "14b": ModelConfig("14b", _QWEN_VOCAB_LARGE, 5120, 13824, 48, 40, 8, 128),
    "32b": ModelConfig("32b", _QWEN_VOCAB_LARGE, 5120, 27648, 64, 40, 8, 128),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
