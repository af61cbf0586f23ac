"""CI (no GPU): the host view of the device K/V cache layout (kernels/kv_cache.cuh), which the
unit tier uses to read what the kernels wrote and to upload caches for attention."""

import numpy as np

from nanoqwen.engine.kv_cache import kv_cache_from_device, kv_cache_to_device


def test_layout_matches_kv_offset():
    rng = np.random.default_rng(0)
    pages, tokens, heads, d = 5, 16, 4, 128
    kv = rng.standard_normal((pages, tokens, heads, d)).astype(np.float16)
    dev = kv_cache_to_device(kv)
    assert dev.shape == (pages, heads, tokens, d) and dev.flags.c_contiguous
    flat = dev.reshape(-1)
    for _ in range(200):  # kv_offset(page, head, t, d) of kv_cache.cuh, written out
        p, h, t, e = (int(rng.integers(n)) for n in (pages, heads, tokens, d))
        off = ((p * heads + h) * tokens + t) * d + ((e // 8) ^ (t % 8)) * 8 + e % 8
        assert flat[off] == kv[p, t, h, e]
    assert np.array_equal(kv_cache_from_device(dev), kv)


def test_every_row_is_a_permutation():
    kv = np.arange(2 * 16 * 1 * 64, dtype=np.float32).reshape(2, 16, 1, 64)
    dev = kv_cache_to_device(kv)
    assert np.array_equal(np.sort(dev, axis=-1), np.sort(kv.transpose(0, 2, 1, 3), axis=-1))
    assert not np.array_equal(dev, kv.transpose(0, 2, 1, 3))  # rows 1..15 are swizzled
