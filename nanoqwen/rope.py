"""The RoPE table, one home for the engine, the reference and the validation ladder.

NEOX form: dims (i, i + D/2) of a head rotate together by pos * theta^(-2i/D). The angles are
formed in float64 and rounded once: an angle `pos * inv_freq` formed in float32 is off by
~pos * 6e-8 radians, 2e-3 at position 32k.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig


def rope_angles(config: ModelConfig, positions: int) -> np.ndarray:
    """float64 [positions, head_dim / 2]: pos * theta^(-i / (head_dim / 2))."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    return np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]


def rope_table(config: ModelConfig, positions: int) -> np.ndarray:
    """float32 [positions, head_dim / 2, 2]: (cos, sin) pairs, the kernels' `rope` argument."""
    angles = rope_angles(config, positions)
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
