"""A synthetic model with massive residual channels, as real Qwen2-family checkpoints have.

Real checkpoints carry a few residual channels at 1e4..6e4 on a few "sink" tokens (the first
token, some delimiters), next to channels of order 1. fp16 holds at most 65504, so these rows
test every place the engine stores or squares the residual: the embedding copy, RMSNorm's sum of
squares (6e4^2 = 3.6e9 overflows fp16, not fp32), the o and down kernels' fused residual add,
and the fp16 copy of the (fp32) residual that the RMSNorms read.

The plant (planted_tensors): the synthetic model of a preset (convert.synthetic), then
  * embed_tokens[s, c] = PLANTED[c] for every sink token s (an embedding column, one of the
    ways real checkpoints get them): the residual rows of sink tokens start at those values and
    the branches' small writes keep them there;
  * the input and post-attention RMSNorm weights at the planted channels are PLANTED_NORM, small
    as in real checkpoints, so a sink row's normed input is not all planted channel;
  * final_norm is 0 at the planted channels: the tied lm_head's sink rows (which hold the
    planted values too) never see them, so logits keep the synthetic model's clear margins.
Everything else is the synthetic model's (clear top-1 margins: convert/synthetic.py).
"""

from __future__ import annotations

import os

import numpy as np

from ..config import ModelConfig

# Residual channel -> planted value (taken modulo the hidden size): 1e4..6e4, both signs.
PLANTED = {17: 1.0e4, 301: -3.0e4, 702: 6.0e4}
PLANTED_NORM = 0.01  # RMSNorm weight at the planted channels
SINK_TOKENS = (1000, 2001, 3002)  # token ids whose embeddings carry the planted values


def planted_channels(config: ModelConfig) -> dict[int, float]:
    return {c % config.hidden_size: v for c, v in PLANTED.items()}


def planted_tensors(config: ModelConfig, seed: int):
    """The synthetic tensors of `config` with the plant above, one at a time."""
    from ..convert.synthetic import synthetic_tensors

    chans = planted_channels(config)
    idx = np.array(list(chans))
    for name, t in synthetic_tensors(config, seed):
        if name == "embed_tokens":
            t = t.copy()
            for s in SINK_TOKENS:
                t[s, idx] = np.array(list(chans.values()), np.float16)
        elif name.endswith(("input_norm", "post_attn_norm")):
            t = t.copy()
            t[idx] = PLANTED_NORM
        elif name == "final_norm":
            t = t.copy()
            t[idx] = 0.0
        yield name, t


def pack_planted(config: ModelConfig, out: str | os.PathLike[str], seed: int = 0) -> None:
    """Write the planted model of `config` (any shapes: a preset's, or a real file's config,
    whose compiled kernels it then shares) to `out`."""
    from ..convert.tokenizers import byte_level_spec
    from ..fileformat import write_nanoqwen

    meta = {"source": f"synthetic:{config.name}", "source_format": "synthetic", "seed": str(seed)}
    meta["planted"] = f"residual channels {planted_channels(config)} on tokens {SINK_TOKENS}"
    write_nanoqwen(out, config, planted_tensors(config, seed), byte_level_spec(), meta)


def sink_prompts(config: ModelConfig, rng: np.random.Generator, count: int, length: int):
    """`count` prompts of `length` random ids with a sink token first (as real text's first
    token) and at two random later positions."""
    prompts = []
    for _ in range(count):
        ids = rng.integers(0, config.vocab_size, length)
        ids[0] = SINK_TOKENS[0]
        ids[rng.choice(np.arange(1, length), 2, replace=False)] = rng.choice(SINK_TOKENS, 2)
        prompts.append(ids.tolist())
    return prompts
