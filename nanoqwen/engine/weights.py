"""The model's weights on the device, in the layouts the kernels read.

The file keeps every projection apart; at upload q/k/v are stacked into one [q; k; v] matrix
(one GEMV, one GEMM, one bias vector) and gate/up into [gate; up] (the SwiGLU kernels read
gate row n and up row N + n). A tied model's fp16 lm_head is its embedding table, uploaded
once; an int8 head (`pack --lm-head int8`) is its own two buffers, tied or not. Every field is
a device address (int).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..cuda.device import Gpu, alloc_size
from ..errors import NanoqwenError


@dataclass(frozen=True)
class LayerWeights:
    input_norm: int  # fp16 [H]
    post_norm: int  # fp16 [H]
    qkv_w: int  # uint32 [q + 2 kv, H / 8] ValueShuffle rows; qkv_s fp16 [q + 2 kv, H / 128]
    qkv_s: int
    qkv_b: int  # fp16 [q + 2 kv]
    o_w: int  # uint32 [H, q / 8]; o_s fp16 [H, q / 128]
    o_s: int
    gate_up_w: int  # uint32 [2 I, H / 8]: [gate; up]; gate_up_s fp16 [2 I, H / 128]
    gate_up_s: int
    down_w: int  # uint32 [H, I / 8]; down_s fp16 [H, I / 128]
    down_s: int


@dataclass(frozen=True)
class Weights:
    embed: int  # fp16 [V, H]
    final_norm: int  # fp16 [H]
    lm_head: int  # fp16 [V, H] (tied: = embed), or int8 [V, H] when lm_head_format is "int8"
    layers: tuple[LayerWeights, ...]
    nbytes: int  # device bytes they take
    lm_head_format: str = "float16"  # quant.LM_HEAD_FORMATS
    lm_head_scale: int = 0  # int8 head: fp32 [V], one scale a row; 0 for fp16


def check_speculation_head(lm_head_format: str) -> None:
    """Refuse speculative decoding over an int8 head: the verify step's lm_head_rows.cu reads
    fp16 rows only. Call it where speculation is switched on (with Weights.lm_head_format or
    NanoqwenFile.lm_head): the engine at load, and the verify step itself."""
    if lm_head_format != "float16":
        raise NanoqwenError(
            f"speculative decoding needs the fp16 lm_head; this file's head is {lm_head_format} "
            "(re-pack with `nanoqwen pack --lm-head fp16`, or generate without speculation)"
        )


_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# LayerWeights field -> the file's tensors of a layer (names after "layers.{i}.") stacked into it.
_LAYER_BUFFERS = {
    "input_norm": ("input_norm",),
    "post_norm": ("post_attn_norm",),
    "qkv_w": tuple(f"{p}.qweight" for p in _QKV),
    "qkv_s": tuple(f"{p}.scales" for p in _QKV),
    "qkv_b": tuple(f"{p}.bias" for p in _QKV),
    "o_w": ("o_proj.qweight",),
    "o_s": ("o_proj.scales",),
    "gate_up_w": tuple(f"{p}.qweight" for p in _GATE_UP),
    "gate_up_s": tuple(f"{p}.scales" for p in _GATE_UP),
    "down_w": ("down_proj.qweight",),
    "down_s": ("down_proj.scales",),
}


def weight_buffers(
    config: ModelConfig, lm_head: str = "float16"
) -> list[tuple[int | None, str, tuple[str, ...]]]:
    """The weights' device buffers in upload order: (layer or None, its Weights or
    LayerWeights field, the file's tensors stacked into it). A tied model with an fp16 head
    has no lm_head buffer; an int8 head (`lm_head` "int8") has two, tied or not."""
    out = [(None, "embed", ("embed_tokens",)), (None, "final_norm", ("final_norm",))]
    if lm_head == "int8":
        out += [(None, "lm_head", ("lm_head.q8",)), (None, "lm_head_scale", ("lm_head.scale",))]
    elif not config.tie_word_embeddings:
        out.append((None, "lm_head", ("lm_head",)))
    for i in range(config.num_layers):
        out += [(i, field, tuple(f"layers.{i}.{t}" for t in names))
                for field, names in _LAYER_BUFFERS.items()]  # fmt: skip
    return out


def weight_bytes(config: ModelConfig, lm_head: str = "float16") -> int:
    """Device bytes upload_weights takes for `config` with a head in `lm_head` format (each
    buffer as Gpu.alloc rounds it)."""
    shapes, total = config.tensor_shapes(lm_head), 0
    for _, _, names in weight_buffers(config, lm_head):
        nbytes = 0
        for name in names:
            dtype, shape = shapes[name]
            nbytes += math.prod(shape) * np.dtype(dtype).itemsize
        total += alloc_size(nbytes)
    return total


def upload_weights(gpu: Gpu, file) -> Weights:
    """Every tensor of the open .nanoqwen `file` onto `gpu` (stacked where fused)."""
    cfg = file.config
    before = gpu.live_bytes()
    top: dict[str, int] = {}
    layers: list[dict[str, int]] = [{} for _ in range(cfg.num_layers)]
    for layer, field, names in weight_buffers(cfg, file.lm_head):
        arrays = [file.tensor(n) for n in names]
        array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        buf = gpu.alloc(array.nbytes, "+".join(names))
        gpu.upload(buf.ptr, array)
        (top if layer is None else layers[layer])[field] = buf.ptr
    lm_head = top.get("lm_head", top["embed"])  # tied fp16: the embedding table, uploaded once
    return Weights(top["embed"], top["final_norm"], lm_head,
                   tuple(LayerWeights(**fields) for fields in layers),
                   gpu.live_bytes() - before, file.lm_head,
                   top.get("lm_head_scale", 0))  # fmt: skip
