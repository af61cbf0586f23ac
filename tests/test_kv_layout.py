"""CI (no GPU): the host view of the device K/V cache layout (kernels/kv_cache.cuh), which the
unit tier uses to read what the kernels wrote and to upload caches for attention."""

import numpy as np
import pytest

from nanoqwen.engine.kv_cache import kv_cache_from_device, kv_cache_to_device


@pytest.mark.parametrize("parts", [1, 2])
def test_layout_matches_kv_offset(parts):
    rng = np.random.default_rng(0)
    pages, tokens, heads, d = 5, 16, 4, 128
    kv = rng.standard_normal((pages, tokens, heads, d)).astype(np.float32)
    dev = kv_cache_to_device(kv, parts)
    assert dev.shape == (pages, heads, parts, tokens, d) and dev.flags.c_contiguous
    assert dev.dtype == np.float16
    flat = dev.reshape(-1).astype(np.float32)
    for _ in range(200):  # kv_offset<parts>(page, head, t, d) of kv_cache.cuh, written out
        p, h, t, e = (int(rng.integers(n)) for n in (pages, heads, tokens, d))
        off = (((p * heads + h) * parts) * tokens + t) * d + ((e // 8) ^ (t % 8)) * 8 + e % 8
        hi = np.float16(kv[p, t, h, e])
        assert flat[off] == hi  # the hi part: k rounded to fp16
        if parts == 2:  # the lo part, a tile further: what hi leaves, rounded
            assert flat[off + tokens * d] == np.float16(kv[p, t, h, e] - np.float32(hi))
    back = kv_cache_from_device(dev)
    if parts == 1:
        assert np.array_equal(back, kv.astype(np.float16).astype(np.float32))
    else:  # hi + lo holds k to ~22 bits: within 2^-21 of it, far inside fp16's 2^-11
        assert np.abs(back - kv).max() <= 2.0**-21 * np.abs(kv).max()
        assert np.abs(back - kv).max() < np.abs(kv.astype(np.float16) - kv).max() / 100


def test_every_row_is_a_permutation():
    kv = np.arange(2 * 16 * 1 * 64, dtype=np.float32).reshape(2, 16, 1, 64)
    dev = kv_cache_to_device(kv)[:, :, 0]
    assert np.array_equal(np.sort(dev, axis=-1), np.sort(kv.transpose(0, 2, 1, 3), axis=-1))
    assert not np.array_equal(dev, kv.transpose(0, 2, 1, 3))  # rows 1..15 are swizzled


def test_k_cache_formats():
    """registry.K_CACHE: the (hi, lo) pair is the default; both formats keep the same bytes in
    decode attention's ring, and the plain one plans 2/3 of the KV pools."""
    from nanoqwen.config import preset
    from nanoqwen.cuda import registry
    from nanoqwen.engine import memory

    cfg, plain = preset("7b"), registry.k_cache_geometry("fp16")
    assert registry.k_cache_name(registry.DEFAULT_GEOMETRY) == registry.DEFAULT_K_CACHE == "fp16x2"
    assert registry.k_cache_geometry("fp16x2") == registry.DEFAULT_GEOMETRY  # one default
    assert plain.k_parts == 1 and registry.k_cache_name(plain) == "fp16"
    assert registry.attn_smem_bytes(cfg) == registry.attn_smem_bytes(cfg, plain) == 96 * 1024
    assert (
        registry.kv_token_bytes(cfg) == 3 * 512 * 2 and registry.kv_token_bytes(cfg, plain) == 2048
    )
    pools = [memory.plan_memory(cfg, 32768, geometry=g).parts["kv_cache"]
             for g in (registry.DEFAULT_GEOMETRY, plain)]  # fmt: skip
    assert 3 * pools[1] == pytest.approx(2 * pools[0], rel=1e-3)
    with pytest.raises(ValueError, match="unknown K cache format 'fp8'"):
        registry.k_cache_geometry("fp8")
