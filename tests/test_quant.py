"""INT4 quantizer and ValueShuffle layout: nibble positions pinned, round trips, bad input."""

import numpy as np
import pytest

from nanoqwen.quant import (
    QuantError,
    dequantize,
    dequantize_packed,
    pack_value_shuffle,
    quantize,
    quantize_onto,
    quantize_pack,
    signed_scales,
    unpack_value_shuffle,
)


def test_value_shuffle_test_vectors():
    # v0..v7 = 0..7: even lanes (0, 2, 4, 6) in the low half-word, odd lanes in the high one.
    q = np.array([[0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1]], dtype=np.int8)
    words = pack_value_shuffle(q)
    assert words.dtype == np.uint32 and words.shape == (1, 2)
    assert words[0, 0] == 0x75316420
    # -8..-1 as nibbles: lanes 0, 2, 4, 6 = -8, -6, -4, -2 -> 8, A, C, E in the low half.
    assert words[0, 1] == 0xFDB9ECA8


@pytest.mark.parametrize("lane", range(8))
@pytest.mark.parametrize("value", [-8, -1, 1, 7])
def test_every_nibble_position(lane, value):
    q = np.zeros((1, 8), dtype=np.int8)
    q[0, lane] = value
    word = int(pack_value_shuffle(q)[0, 0])
    shift = 4 * (lane // 2) + (16 if lane % 2 else 0)
    assert word == (value & 0xF) << shift
    # The kernels' extraction: (w >> 4i) & 0x000F000F gives lanes (2i, 2i+1) in the two halves.
    i = lane // 2
    pair = (word >> (4 * i)) & 0x000F000F
    half = (pair >> 16) if lane % 2 else (pair & 0xFFFF)
    assert half == value & 0xF


def test_pack_unpack_round_trip_random():
    rng = np.random.default_rng()
    for n, k in [(1, 8), (3, 16), (17, 136), (111, 1024)]:
        q = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
        assert np.array_equal(unpack_value_shuffle(pack_value_shuffle(q)), q)


def test_quantize_rule():
    rng = np.random.default_rng()
    w = rng.standard_normal((17, 384)).astype(np.float32) * rng.uniform(0.01, 3.0)
    q, scales = quantize(w)
    assert q.dtype == np.int8 and scales.dtype == np.float16 and scales.shape == (17, 3)
    groups = w.reshape(17, 3, 128)
    expected_scale = (np.abs(groups).max(axis=2) / 7).astype(np.float16)
    assert np.array_equal(scales, expected_scale)
    assert q.min() >= -8 and q.max() <= 7
    # Round to nearest against the fp16 scale: error at most half a step (plus fp32 slack).
    err = np.abs(dequantize(q, scales) - w).reshape(17, 3, 128)
    step = scales.astype(np.float32)[:, :, None]
    assert (err <= 0.5 * step * (1 + 1e-6)).all()


def test_zero_group_and_exact_values():
    w = np.zeros((2, 256), dtype=np.float32)
    w[1, 128:] = np.arange(-7, 7 + 1, dtype=np.float32).repeat(9)[:128] * 0.5
    q, scales = quantize(w)
    assert scales[0, 0] == 0 and not q[0].any()
    assert np.array_equal(dequantize(q, scales), w)  # exactly representable values survive


def test_quantize_pack_matches_dequantize():
    rng = np.random.default_rng()
    w = rng.standard_normal((5, 256)).astype(np.float32)
    qweight, scales = quantize_pack(w)
    q, s = quantize(w)
    assert np.array_equal(dequantize_packed(qweight, scales), dequantize(q, s))


def test_signed_scales_reach_minus_8():
    rng = np.random.default_rng()
    w = rng.uniform(-1, 1, (5, 384)).astype(np.float32)
    w[0, 3], w[1, 200], w[2, :128] = -2.0, 2.0, 0.0  # negative, positive extreme; a zero group
    s = signed_scales(w)
    assert s.dtype == np.float16 and s.shape == (5, 3)
    assert s[0, 0] == np.float16(2.0 / 8) and s[1, 1] == np.float16(2.0 / 7) and s[2, 0] == 0
    q = quantize_onto(w, s)
    assert q[0, 3] == -8 and q[1, 200] == 7 and not q[2, :128].any()
    groups = w.reshape(5, 3, 128)
    want = np.maximum(groups.max(2) / 7, -groups.min(2) / 8).astype(np.float16)
    np.testing.assert_array_equal(s, want)
    # No value clips: every error is within half a step (of the fp16-rounded scale, +1 ulp).
    err = np.abs(dequantize(q, s) - w).reshape(5, 3, 128).max(2)
    assert (err <= 0.5 * s.astype(np.float32) * (1 + 2**-9) + 1e-7).all()
    # Never a coarser step than RTN's max|w| / 7, strictly finer where the extreme is negative.
    rtn = quantize(w)[1]
    assert (s <= rtn).all() and s[0, 0] < rtn[0, 0]


def test_quantize_onto_rtn_scales_is_rtn():
    w = np.random.default_rng().standard_normal((7, 256)).astype(np.float32)
    q, s = quantize(w)
    np.testing.assert_array_equal(quantize_onto(w, s), q)
    half = (s * np.float16(0.5)).astype(np.float16)  # values beyond the range clip to [-8, 7]
    assert quantize_onto(w, half).min() == -8 and quantize_onto(w, half).max() == 7
    with pytest.raises(QuantError, match="scales"):
        quantize_onto(w, s[:, :1])


@pytest.mark.parametrize(
    "w, message",
    [
        (np.zeros((4, 100), np.float32), "multiple of the group size"),
        (np.zeros(128, np.float32), "2-D"),
        (np.full((1, 128), np.nan, np.float32), "non-finite value at \\[0, 0\\]"),
        (np.full((1, 128), 1e6, np.float32), "overflows the fp16 scale"),
    ],
)
def test_quantize_rejects(w, message):
    with pytest.raises(QuantError, match=message):
        quantize(w, "w")
    with pytest.raises(QuantError, match=message):
        signed_scales(w, "w")


def test_pack_rejects_out_of_range():
    with pytest.raises(QuantError, match="outside"):
        pack_value_shuffle(np.full((1, 8), 8, dtype=np.int8))
    with pytest.raises(QuantError, match="K % 8"):
        pack_value_shuffle(np.zeros((1, 7), dtype=np.int8))
