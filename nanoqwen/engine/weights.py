"""The model's weights on the device, in the layouts the kernels read.

The file keeps every projection apart; at upload q/k/v are stacked into one [q; k; v] matrix
(one GEMV, one GEMM, one bias vector) and gate/up into [gate; up] (the SwiGLU kernels read
gate row n and up row N + n). A tied model's lm_head is its embedding table, uploaded once.
Every field is a device address (int).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cuda.device import Gpu


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


def upload_weights(gpu: Gpu, file) -> Weights:
    """Every tensor of the open .nanoqwen `file` onto `gpu` (stacked where fused)."""
    cfg = file.config
    before = gpu.live_bytes()

    def put(array: np.ndarray, what: str) -> int:
        buf = gpu.alloc(array.nbytes, what)
        gpu.upload(buf.ptr, array)
        return buf.ptr

    def stacked(p: str, projections: tuple[str, ...], part: str) -> int:
        return put(np.concatenate([file.tensor(f"{p}{n}.{part}") for n in projections]),
                   f"{p}{'+'.join(projections)}.{part}")  # fmt: skip

    embed = put(file.tensor("embed_tokens"), "embed_tokens")
    final_norm = put(file.tensor("final_norm"), "final_norm")
    lm_head = embed if cfg.tie_word_embeddings else put(file.tensor("lm_head"), "lm_head")
    layers = []
    qkv, gate_up = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=put(file.tensor(p + "input_norm"), p + "input_norm"),
                post_norm=put(file.tensor(p + "post_attn_norm"), p + "post_attn_norm"),
                qkv_w=stacked(p, qkv, "qweight"),
                qkv_s=stacked(p, qkv, "scales"),
                qkv_b=stacked(p, qkv, "bias"),
                o_w=put(file.tensor(p + "o_proj.qweight"), p + "o_proj.qweight"),
                o_s=put(file.tensor(p + "o_proj.scales"), p + "o_proj.scales"),
                gate_up_w=stacked(p, gate_up, "qweight"),
                gate_up_s=stacked(p, gate_up, "scales"),
                down_w=put(file.tensor(p + "down_proj.qweight"), p + "down_proj.qweight"),
                down_s=put(file.tensor(p + "down_proj.scales"), p + "down_proj.scales"),
            )
        )
    return Weights(embed, final_norm, lm_head, tuple(layers), gpu.live_bytes() - before)
