"""Symmetric INT4 group quantization and the ValueShuffle nibble layout (layout_id 1).

Quantization rule (one group = 128 consecutive K-elements of one output row):

    scale = fp16(max|w| / 7)             # stored; rounded to fp16 *before* quantizing
    q     = clip(rint(w / scale), -8, 7)  # rint = round half to even, in float32
    w'    = q * scale                    # what the kernels see (exact in fp32)

Dividing by 7 (not 8) keeps the largest magnitude exactly representable on both signs; -8 is
reachable only through rounding and costs nothing. Quantizing against the fp16-rounded scale
makes `dequantize` the exact inverse the kernels compute. An all-zero group gets scale 0 and
q = 0. A group whose max|w| / 7 overflows fp16 is an error, not a silent inf.

ValueShuffle (layout_id 1): eight signed nibbles per uint32, K-elements v0..v7 of one row,
even lanes in the low half-word and odd lanes in the high half-word:

    bits [4i, 4i+4)       hold v(2i)      i = 0..3
    bits [16+4i, 20+4i)   hold v(2i+1)

so `(w >> 4i) & 0x000F000F` yields the pair (v2i, v2i+1), one per 16-bit half: the shape that
prmt.b32 / lop3 turn into a half2 without shuffles. Words are tiled row-major: qweight[n, j]
holds K-elements 8j..8j+7 of output row n; scales[n, g] covers K-elements 128g..128g+127.
"""

from __future__ import annotations

import numpy as np

from .config import GROUP_SIZE
from .errors import NanoqwenError

LAYOUT_VALUE_SHUFFLE = 1
QMIN, QMAX = -8, 7
_FP16_MAX = float(np.finfo(np.float16).max)

# Bit offset of each of the 8 lanes within a word: lane 2i -> 4i, lane 2i+1 -> 16 + 4i.
LANE_SHIFTS = np.array([0, 16, 4, 20, 8, 24, 12, 28], dtype=np.uint32)


class QuantError(NanoqwenError, ValueError):
    """A weight that cannot be quantized (wrong shape, NaN/Inf, fp16 overflow)."""


def _check_matrix(w: np.ndarray, name: str) -> tuple[int, int]:
    if w.ndim != 2:
        raise QuantError(f"{name}: expected a 2-D [N, K] weight, got shape {w.shape}")
    n, k = w.shape
    if k % GROUP_SIZE:
        raise QuantError(f"{name}: K={k} is not a multiple of the group size {GROUP_SIZE}")
    return n, k


def _groups(w: np.ndarray, name: str) -> np.ndarray:
    """w float [N, K] -> float32 [N, K/128, 128], checked: 2-D, K % 128 == 0, finite."""
    n, k = _check_matrix(w, name)
    groups = np.asarray(w, dtype=np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    if not np.isfinite(groups).all():
        bad = np.argwhere(~np.isfinite(groups.reshape(n, k)))[0]
        raise QuantError(f"{name}: non-finite value at [{bad[0]}, {bad[1]}]")
    return groups


def _fp16_scales(scales: np.ndarray, name: str) -> np.ndarray:
    if scales.max(initial=0.0) > _FP16_MAX:
        raise QuantError(f"{name}: scale {scales.max():.4g} overflows the fp16 scale")
    return scales.astype(np.float16)


def _round(groups: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """groups float32 [N, G, 128], scales float16 [N, G] -> q int8 [N, G * 128]."""
    s32 = scales.astype(np.float32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint(groups / s32), 0.0)
    return np.clip(q, QMIN, QMAX).astype(np.int8).reshape(groups.shape[0], -1)


def quantize(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """INT4-quantize one projection.

    w: float [N, K] (any float dtype; computed in float32), K % 128 == 0.
    Returns (q: int8 [N, K] in [-8, 7], scales: float16 [N, K/128]).
    """
    groups = _groups(w, name)
    scales = _rtn_scales(groups, name)
    return _round(groups, scales), scales


def _rtn_scales(groups: np.ndarray, name: str) -> np.ndarray:
    return _fp16_scales(np.abs(groups).max(axis=2) / QMAX, name)


def rtn_scales(w: np.ndarray, name: str = "weight") -> np.ndarray:
    """quantize's scales alone: float16 [N, K/128] = fp16(max|w| / 7) per group."""
    return _rtn_scales(_groups(w, name), name)


def signed_scales(w: np.ndarray, name: str = "weight") -> np.ndarray:
    """The smallest scales that clip no value: float16 [N, K/128] = fp16(max(max(w) / 7,
    -min(w) / 8)) per group. A group whose largest magnitude is negative reaches it with -8,
    on a step 7/8 of max|w| / 7."""
    groups = _groups(w, name)
    return _fp16_scales(np.maximum(groups.max(axis=2) / QMAX, groups.min(axis=2) / QMIN), name)


def quantize_onto(w: np.ndarray, scales: np.ndarray, name: str = "weight") -> np.ndarray:
    """w float [N, K] rounded to nearest onto the given scales float16 [N, K/128]:
    q int8 [N, K] in [-8, 7] (values beyond a scale's range clip)."""
    groups = _groups(w, name)
    if scales.shape != groups.shape[:2]:
        raise QuantError(f"{name}: scales {scales.shape}, expected {groups.shape[:2]}")
    return _round(groups, np.asarray(scales, np.float16))


def dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q: int8 [N, K], scales: float16 [N, K/128] -> float32 [N, K] (exact)."""
    n, k = q.shape
    groups = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    return (groups * scales.astype(np.float32)[:, :, None]).reshape(n, k)


def pack_value_shuffle(q: np.ndarray) -> np.ndarray:
    """q: int8 [N, K] in [-8, 7], K % 8 == 0 -> uint32 [N, K/8] ValueShuffle words."""
    if q.ndim != 2 or q.shape[1] % 8:
        raise QuantError(f"pack: expected int8 [N, K] with K % 8 == 0, got {q.shape}")
    if q.size and (q.min() < QMIN or q.max() > QMAX):
        raise QuantError(f"pack: values outside [{QMIN}, {QMAX}]")
    n, k = q.shape
    nibbles = (q.astype(np.int32) & 0xF).astype(np.uint32).reshape(n, k // 8, 8)
    return np.bitwise_or.reduce(nibbles << LANE_SHIFTS, axis=2).astype(np.uint32)


def unpack_value_shuffle(words: np.ndarray) -> np.ndarray:
    """uint32 [N, K/8] ValueShuffle words -> int8 [N, K] in [-8, 7]."""
    if words.ndim != 2 or words.dtype != np.uint32:
        raise QuantError(f"unpack: expected uint32 [N, K/8], got {words.dtype} {words.shape}")
    n, kw = words.shape
    nibbles = ((words[:, :, None] >> LANE_SHIFTS) & 0xF).astype(np.int8)  # [N, K/8, 8]
    # Two's complement of a nibble without a masked write (4x slower on a 1.5B's weights):
    # flipping bit 3 then subtracting 8 maps 0..7 to 0..7 and 8..15 to -8..-1.
    return ((nibbles ^ 8) - 8).reshape(n, kw * 8)


def quantize_pack(w: np.ndarray, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (qweight uint32 [N, K/8] ValueShuffle, scales float16 [N, K/128])."""
    q, scales = quantize(w, name)
    return pack_value_shuffle(q), scales


def dequantize_packed(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(qweight uint32 [N, K/8], scales float16 [N, K/128]) -> float32 [N, K]."""
    return dequantize(unpack_value_shuffle(qweight), scales)


# The lm_head in INT8 (opt-in: `pack --lm-head int8`) ------------------------------------------
# One float32 scale per vocabulary row (symmetric, over the whole row of H values):
#
#     scale[v] = max_k |w[v, k]| / 127        (float32; 0 for an all-zero row)
#     q[v, k]  = clip(rint(w[v, k] / scale[v]), -127, 127)    int8
#     logit[v] = scale[v] * sum_k q[v, k] * x[k]      (the kernel: one multiply after the dot)
#
# Per row rather than per group of 128 along H: a row scale factors out of the row's dot product
# (one multiply a logit, no scale stream beside the bytes, the fp16 kernel's ring unchanged).
# On the real 0.5B (tied head, 4088 tokens of stdlib code, dev/lm_head_quality.py) per row
# costs +0.04% perplexity and keeps the fp16 head's top-1 on 99.17% of tokens; per group of
# 128 keeps 99.56% (-0.01% perplexity) for 28 fp32 scales a row at 7B and a multiply per 8
# values: not worth a second kernel layout at this gap. Clipping a row's scale below max|w|
# (least squared error over 0.7..1.0 of it) chose no clipping on every row. float32 scales: a
# tiny-norm row's max/127 may fall below fp16's normal range.
LM_HEAD_FORMATS = ("float16", "int8")
Q8_MAX = 127


def quantize_rows_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float [V, H] -> (q int8 [V, H], scale float32 [V]) by the rule above."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantError(f"lm_head must be 2-D [V, H], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise QuantError("lm_head has non-finite values")
    scale = (np.abs(w).max(axis=1) / Q8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.clip(np.rint(w / safe), -Q8_MAX, Q8_MAX).astype(np.int8)
    return q, scale


def dequantize_rows_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(q int8 [V, H], scale float32 [V]) -> float32 [V, H] = q * scale (exact in float32)."""
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None]
