"""The model's weights on the device, in the layouts the kernels read.

The file keeps every projection apart; at upload q/k/v are stacked into one [q; k; v] matrix
(one GEMV, one GEMM, one bias vector) and gate/up into [gate; up] (the SwiGLU kernels read
gate row n and up row N + n). A tied model's lm_head is its embedding table, uploaded once.
Every field is a device address (int).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..cuda.device import Gpu, alloc_size


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
    lm_head: int  # fp16 [V, H] (tied: = embed)
    layers: tuple[LayerWeights, ...]
    nbytes: int  # device bytes they take


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


def weight_buffers(config: ModelConfig) -> list[tuple[int | None, str, tuple[str, ...]]]:
    """The weights' device buffers in upload order: (layer or None, its Weights or
    LayerWeights field, the file's tensors stacked into it). A tied model has no lm_head."""
    out = [(None, "embed", ("embed_tokens",)), (None, "final_norm", ("final_norm",))]
    if not config.tie_word_embeddings:
        out.append((None, "lm_head", ("lm_head",)))
    for i in range(config.num_layers):
        out += [(i, field, tuple(f"layers.{i}.{t}" for t in names))
                for field, names in _LAYER_BUFFERS.items()]  # fmt: skip
    return out


def weight_bytes(config: ModelConfig) -> int:
    """Device bytes upload_weights takes for `config` (each buffer as Gpu.alloc rounds it)."""
    shapes, total = config.tensor_shapes(), 0
    for _, _, names in weight_buffers(config):
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
    for layer, field, names in weight_buffers(cfg):
        arrays = [file.tensor(n) for n in names]
        array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        buf = gpu.alloc(array.nbytes, "+".join(names))
        gpu.upload(buf.ptr, array)
        (top if layer is None else layers[layer])[field] = buf.ptr
    lm_head = top.get("lm_head", top["embed"])  # tied: the embedding table, uploaded once
    return Weights(top["embed"], top["final_norm"], lm_head,
                   tuple(LayerWeights(**fields) for fields in layers),
                   gpu.live_bytes() - before)  # fmt: skip
