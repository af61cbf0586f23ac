"""The paged KV cache on the device, and its layout.

Per layer one K and one V pool of fp16 pages; a page holds PAGE_TOKENS tokens of every KV
head. Device layout (kernels/kv_cache.cuh, shared by its writers and the attention kernels):
V fp16 [num_pages][n_kv][PAGE_TOKENS][head_dim], so the 16 token rows of one (page, kv head)
form one contiguous tile that decode attention moves with one bulk copy; K the same with
`k_parts` tiles a (page, kv head), [num_pages][n_kv][k_parts][PAGE_TOKENS][head_dim]: with 2,
the pair (hi, lo) = (fp16(k), fp16(k - hi)) that holds k to ~22 bits (registry.K_CACHE). Inside
a tile the 16-byte chunks of token row t are XOR-swizzled (chunk c stored at c ^ (t % 8)) so
that the rows of one ldmatrix fall on different bank groups. `kv_cache_to_device` /
`kv_cache_from_device` convert between that and the reference's [pages, PAGE_TOKENS, n_kv,
head_dim].

The page table (int32 [num_pages], device memory) maps the running sequence's logical page to
a physical one; the kernels read `page_table[pos // PAGE_TOKENS]` for every position they touch.
The pages come from the block manager both backends share (nanoqwen.kv_pages, `KVCache.pages`,
over the whole pool, prefix caching included); whoever writes K/V uploads its own table first.
"""

from __future__ import annotations

import numpy as np

from ..config import PAGE_TOKENS, ModelConfig
from ..cuda.device import Gpu
from ..errors import NanoqwenError
from ..kv_pages import BlockManager


def _swizzle(d: int) -> np.ndarray:
    """[PAGE_TOKENS, d] column gather of the chunk swizzle (its own inverse)."""
    t, col = np.arange(PAGE_TOKENS)[:, None], np.arange(d)[None, :]
    return ((col // 8) ^ (t % 8)) * 8 + col % 8


def kv_tiles_to_device(parts: list[np.ndarray]) -> np.ndarray:
    """fp16 [pages, PAGE_TOKENS, n_kv, D] arrays, one a part (a K cache's hi then lo: the
    kernels sum them; V's one) -> the device layout [pages, n_kv, len(parts), PAGE_TOKENS,
    D], each token row's 16-byte chunks swizzled."""
    tiles = np.ascontiguousarray(np.stack([p.transpose(0, 2, 1, 3) for p in parts], axis=2))
    return np.take_along_axis(tiles, _swizzle(tiles.shape[-1])[None, None, None], axis=4)


def kv_cache_to_device(kv: np.ndarray, parts: int = 1) -> np.ndarray:
    """A K or V cache [pages, PAGE_TOKENS, n_kv, D] -> the device layout of `parts` fp16 tiles
    a (page, kv head): parts 1 (V, and K in plain fp16) rounds each value to fp16, parts 2 (K's
    (hi, lo)) stores fp16(x) and fp16(x - fp16(x))."""
    x = kv.astype(np.float32)
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    return kv_tiles_to_device([hi] if parts == 1 else [hi, lo])


def kv_cache_from_device(raw: np.ndarray) -> np.ndarray:
    """The inverse of kv_cache_to_device: raw fp16 [pages, n_kv, parts, PAGE_TOKENS, D] ->
    float32 [pages, PAGE_TOKENS, n_kv, D], the parts summed."""
    tiles = np.take_along_axis(raw, _swizzle(raw.shape[-1])[None, None, None], axis=4)
    return np.ascontiguousarray(tiles.astype(np.float32).sum(axis=2).transpose(0, 2, 1, 3))


def kv_cache_buffers(config: ModelConfig, max_context: int, k_parts: int) -> list[int]:
    """The bytes of KVCache's device buffers for `max_context` positions: a K pool (k_parts
    fp16 tiles a page and kv head) and a V pool per layer (pages num_pages + 1: the last is the
    padding page), then the page table (int32 [num_pages])."""
    num_pages = -(-max_context // PAGE_TOKENS)
    v_pool = (num_pages + 1) * PAGE_TOKENS * config.kv_size * 2
    return [k_parts * v_pool, v_pool] * config.num_layers + [num_pages * 4]


class KVCache:
    """K and V pools for `max_context` tokens on `gpu` (engine.memory plans them beside the
    rest before anything is allocated); `pages` allocates them, `page_table` is the device's
    int32 [num_pages] map of the sequence being computed. One page more, `pad_page`, is in no
    table the block manager hands out: the batched step's padding rows (engine/batch.py) write
    their K/V there."""

    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        max_context: int,
        k_parts: int,
        prefix_caching: bool = True,
    ) -> None:
        *pools, table_bytes = kv_cache_buffers(config, max_context, k_parts)
        self.num_pages = self.pad_page = table_bytes // 4
        self.k_parts = k_parts
        self.nbytes = sum(pools)
        self.gpu = gpu
        # Zeroed once: attention reads whole tiles and multiplies a masked key's V by P = 0,
        # and 0 x NaN is NaN, so no slot may ever hold a non-finite bit pattern. Only finite
        # K/V are written later, but recycled device memory (a closed engine's) holds anything.
        self.k, self.v = [], []
        for layer in range(config.num_layers):
            for pool, nbytes in ((self.k, pools[2 * layer]), (self.v, pools[2 * layer + 1])):
                pool.append(gpu.alloc(nbytes, "k/v cache").ptr)
                gpu.memset(pool[-1], 0, nbytes)
        self.page_table = gpu.alloc(table_bytes, "page table").ptr
        self.pages = BlockManager(self.num_pages, prefix_caching)
        self._identity = np.arange(self.num_pages, dtype=np.int32)
        self.map_whole_pool()  # a bare KVCache maps every page (dev/kernel_tune.py)

    def map_whole_pool(self) -> None:
        """Upload the identity page table (synchronous) for host-driven decode steps at any
        position whose K/V persist between calls (CudaBackend.set_decode_state). They write
        pages no table holds, so no generation may run, and the prefix cache is cleared."""
        held = self.pages.pages_held
        if held:
            raise NanoqwenError(
                f"host-driven decode steps map the whole KV pool, but {held} pages are held: "
                "finish or close the running generation first"
            )
        self.pages.clear_cache()
        self.gpu.upload(self.page_table, self._identity)
