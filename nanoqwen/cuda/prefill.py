"""Launchers of the prefill kernels: the INT4 tensor-core GEMM (prefill_gemm_wgmma.cu) and the
causal GQA attention of a prompt's new tokens over the paged K/V (prefill_attention.cu).

`PrefillKernels(gpu, config)` builds the registry's prefill specs (one GEMM instantiation per
registry.GEMM_TILES entry, then attention). `gemm` and `attention` check shapes in Python,
raising ValueError with the numbers before anything reaches the GPU, and launch.

Pointers: every buffer argument is a device address: an int (a `DeviceArray.ptr`), an object
with `.ptr` (a DeviceArray), `.data_ptr()` (a torch tensor) or `.handle` (a cuda.core Buffer).
Streams: `stream=None` means the Gpu's stream.

The GEMM is stream-K: one CTA per SM, each an equal share of the output tiles' K groups; a
tile cut between CTAs is summed up through the parts buffer and flags this class owns. It
reads A and the weights through TMA descriptors, which `gemm` makes (and keeps) per buffer
and shape; `pick_gemm` chooses the tile (16 to 256 tokens) by padded work over the tile's
rate (registry.GEMM_TILES).
"""

from __future__ import annotations

import numpy as np

from ..config import GROUP_SIZE, ModelConfig
from . import registry
from .device import Gpu
from .launcher import Launcher

_MAX_KEPT = 512  # TMA descriptors (128 bytes each) and gemm launches kept: buffers x shapes
# Attention's key splits (prefill_attention.cu): when the (head, query tile) CTAs would not
# fill the SMs once (at the kernel's occupancy, two an SM), each one's key tiles are cut into
# ranges of at least SPLIT_MIN_TILES, as many as keep every CTA in that one wave: a CTA past
# it would run its whole range after the others, doubling the launch (SPLIT_CTAS_PER_SM
# bounds the partials buffer).
SPLIT_MIN_TILES = 16  # 1024 keys: shorter loops gain less than the merge launch costs
SPLIT_CTAS_PER_SM = 3


def workspace_buffers(
    config: ModelConfig,
    num_sms: int,
    geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
    tiles: tuple[registry.GemmTile, ...] = registry.GEMM_TILES,
) -> dict[str, int]:
    """Bytes of PrefillKernels' own buffers (engine/memory.py plans them). The stream-K
    hand-over: a part of fp32 sums per CTA (256 consumer threads x tokens / 2 accumulators of
    the widest tile; one CTA per SM: 17 MB on an H200) and its flag. Attention's key-split
    partials: at most SPLIT_CTAS_PER_SM CTAs an SM of prefill_attn_tile query rows, each row
    head_dim fp32 sums and (m, l)."""
    tokens = max(t.tokens for t in tiles)
    rows = SPLIT_CTAS_PER_SM * num_sms * geometry.prefill_attn_tile
    return {
        "parts": num_sms * 256 * tokens // 2 * 4,
        "flags": num_sms * 4,
        "part_o": rows * config.head_dim * 4,
        "part_ml": rows * 2 * 4,
    }


def _ptr(x) -> int:
    """Device address of an int, a DeviceArray, a torch tensor or a cuda.core Buffer."""
    if isinstance(x, int):
        return x
    if hasattr(x, "ptr"):
        return int(x.ptr)
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    if hasattr(x, "handle"):
        return int(x.handle)
    return int(x)


class PrefillKernels(Launcher):
    """The prefill kernels of one model, compiled and ready to launch.

    tiles: the GEMM tile table (dev/prefill_check.py passes extra ones to time them).
    """

    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        tiles: tuple[registry.GemmTile, ...] = registry.GEMM_TILES,
        *,
        pdl: bool = True,
    ) -> None:
        specs = registry.prefill_specs(config, geometry, tiles)
        super().__init__(gpu, config, specs, geometry, pdl=pdl)
        self.gemms = [s for s in self.specs.values() if s.tile is not None]
        self._maps: dict = {}
        self._gemm_launches: dict = {}
        # workspace_buffers: the flags are zero between launches (each stream-K owner resets
        # the flags it consumed).
        n, sizes = gpu.num_sms, workspace_buffers(config, gpu.num_sms, geometry, tiles)
        self._parts = gpu.alloc(sizes["parts"], "prefill parts")
        self._flags = gpu.alloc(sizes["flags"], "prefill part flags")
        gpu.memset(self._flags.ptr, 0, sizes["flags"])
        self._part_o = gpu.alloc(sizes["part_o"], "prefill attention partials")
        self._part_ml = gpu.alloc(sizes["part_ml"], "prefill attention partial (m, l)")
        self._attn_wave = self.ctas_per_sm("prefill_attention") * n  # CTAs resident at once

    # -- GEMM ---------------------------------------------------------------------------------
    def pick_gemm(self, M: int, swiglu: bool = False) -> registry.KernelSpec:
        """The tile of least estimated time: every SM is busy to the end (stream-K), so the
        time is the padded work ceil(M / tokens) x tokens over the tile's rate. Ties go to the
        first tile of the table."""
        best, best_cost = None, None
        for spec in self.gemms:
            t = spec.tile
            if t.swiglu != swiglu:
                continue
            cost = -(-M // t.tokens) * t.tokens / t.tflops
            if best_cost is None or cost < best_cost:
                best, best_cost = spec, cost
        return best

    def gemm(
        self,
        a,
        qweight,
        scales,
        bias,
        out,
        M: int,
        N: int,
        K: int,
        residual=None,
        *,
        swiglu: bool = False,
        out_fp32: bool = False,
        spec: registry.KernelSpec | None = None,
        a_rows: int = 0,
        label: str = "prefill gemm",
        stream=None,
    ) -> None:
        """out = a @ dequant(qweight, scales)^T (+ bias), fp32 accumulate; with a residual,
        residual += a @ dequant(qweight, scales)^T and out = fp16(residual).

        a        fp16   [M, K] row-major activations (M >= 1, any)
        qweight  uint32 [N, K/8] ValueShuffle words, row-major (nanoqwen.quant)
        scales   fp16   [N, K/128] one scale per output row and 128-group of K
        bias     fp16   [N] or None
        out      fp16   [M, N]; with swiglu=True [M, N/2]: the weight is [gate; up] stacked
                 (rows 0..N/2-1 gate, N/2..N-1 up) and out = silu(a @ gate^T) * (a @ up^T)
        residual fp32   [M, N] or None; the residual stream, updated in place (out: its fp16
                 copy, a separate buffer)
        out_fp32 out is fp32 [M, N] (a plain GEMM: no swiglu, no residual): the q/k/v
                 projection's output, k unrounded until the K cache (kernels/kv_cache.cuh)
        K % 128 == 0, N % 128 == 0. All pointers 16-byte aligned.
        spec     a GEMM spec of this launcher (default: pick_gemm's)
        a_rows   rows of `a`'s buffer that may be read (0: M). When they cover M rounded up to
                 the tile's tokens, A's boxes lie wholly inside it: the rows past M are read,
                 whatever they hold (a token's outputs depend on its own row alone, and rows
                 past M are never stored), instead of being filled by the TMA: a partly
                 out-of-bounds box slows the 256-token tile's last tile far past a full one's
                 (docs/PERFORMANCE.md, Prompt lengths and the GEMM tiles)
        label    the launch's name for on_launch (the engine names the projection)
        """
        ptrs = (_ptr(a), _ptr(qweight), _ptr(scales), 0 if bias is None else _ptr(bias),
                0 if residual is None else _ptr(residual), _ptr(out))  # fmt: skip
        given = (bias is not None, residual is not None)
        key = (*ptrs, *given, M, N, K, swiglu, out_fp32, None if spec is None else spec.key,
               a_rows)  # fmt: skip
        launch = self._gemm_launches.get(key)
        if launch is None:
            launch = self._gemm_launch(ptrs, given, M, N, K, swiglu, out_fp32, spec, a_rows)
            if len(self._gemm_launches) >= _MAX_KEPT:
                self._gemm_launches.clear()
            self._gemm_launches[key] = launch
        with self.gpu.guard("prefill gemm"):  # a sticky error marks the Gpu broken
            self.launch(*launch, stream=stream, label=label)

    def _gemm_launch(self, ptrs, given, M, N, K, swiglu, out_fp32, spec, a_rows) -> tuple:
        """gemm's checks, tile and TMA descriptors: (spec key, grid, *arguments) of its
        launch, kept per call (a prefill repeats the same few hundred)."""
        a, qweight, scales, bias, residual, out = ptrs
        rows = self.geometry.prefill_rows
        if M < 1 or K < GROUP_SIZE or K % GROUP_SIZE:
            raise ValueError(f"prefill gemm: need M >= 1 and K % {GROUP_SIZE} == 0; M={M} K={K}")
        if N < rows or N % rows:
            raise ValueError(f"prefill gemm: N={N} must be a positive multiple of {rows}")
        if swiglu and any(given):  # (bias, residual) passed
            raise ValueError("prefill gemm: swiglu takes no bias and no residual")
        if residual and residual == out:
            raise ValueError("prefill gemm: the fp32 residual and the fp16 out are two buffers")
        if out_fp32 and (swiglu or residual):
            raise ValueError("prefill gemm: an fp32 out is a plain GEMM's (no swiglu, no residual)")
        spec = spec if spec is not None else self.pick_gemm(M, swiglu)
        if spec.tile is None or spec.tile.swiglu != swiglu:
            raise ValueError(f"prefill gemm: {spec.expression} does not match swiglu={swiglu}")
        if any(p % 16 for p in (a, qweight, scales, residual, out)):  # 2 x 16-byte residual reads
            raise ValueError(
                f"prefill gemm: pointers must be 16-byte aligned, got {[a, qweight, scales, out]} "
                f"residual {residual}"
            )
        tokens, k_tile = spec.tile.tokens, self.geometry.prefill_k_tile
        # Stream-K: the launch's iterations (tiles x K groups) cut evenly over the CTAs.
        iterations = -(-M // tokens) * (N // rows) * (K // GROUP_SIZE)
        grid = (min(iterations, self.gpu.num_sms), 1, 1)
        padded = -(-M // tokens) * tokens
        a_map = self._map(a, padded if a_rows >= padded else M, K, tokens, k_tile, True)
        w_map = self._map(qweight, N, K // 8, 64, k_tile // 8, False)  # 64 rows x 8 words
        out16, out32 = (0, out) if out_fp32 else (out, 0)
        return (spec.key, grid, a_map, w_map, scales, bias, residual, out16, out32, np.int32(M),
                np.int32(N), np.int32(K), self._parts.ptr, self._flags.ptr)  # fmt: skip

    def _map(self, ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, fp16: bool):
        """A TMA descriptor, kept per shape and address: the engine's prefill reuses a few
        buffers, and the weights stay put."""
        key = (ptr, rows, cols, box_rows, box_cols, fp16)
        tmap = self._maps.get(key)
        if tmap is None:
            if len(self._maps) >= _MAX_KEPT:
                self._maps.clear()
            tmap = self.gpu.tensor_map_2d(ptr, rows, cols, box_rows, box_cols, fp16=fp16)
            self._maps[key] = tmap
        return tmap

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q, kc, vc, pages, out, start: int, T: int, *, stream=None) -> None:
        """Causal GQA attention of T new tokens at positions start .. start + T - 1 over the
        sequence's paged K/V (positions 0 .. start + T - 1 written), softmax scale
        1/sqrt(head_dim).

        q      fp16 [T, num_heads, head_dim]  RoPE applied, row-major
        kc, vc the layer's K/V caches (engine.kv_cache's device layout)
        pages  int32 page table of the sequence
        out    fp16 [T, num_heads, head_dim]  must not alias q
        """
        if T < 1 or start < 0:
            raise ValueError(f"prefill attention: need T >= 1 and start >= 0; T={T} start={start}")
        ptrs = [_ptr(x) for x in (q, kc, vc, pages, out)]
        if any(p % 16 for p in ptrs):
            raise ValueError(f"prefill attention: pointers must be 16-byte aligned, got {ptrs}")
        tile, heads = self.geometry.prefill_attn_tile, self.config.num_heads
        ctas = heads * -(-T // tile)
        Z = self.splits(start, T)
        part = (self._part_o.ptr, self._part_ml.ptr)
        with self.gpu.guard("prefill attention"):
            self.launch("prefill_attention", (heads, ctas // heads, Z), *ptrs, *part,
                        np.int32(start), np.int32(T), stream=stream,
                        label="prefill attention")  # fmt: skip
            if Z > 1:
                warps = self.geometry.prefill_merge_threads // 32
                self.launch("prefill_attention_merge", (-(-T * heads // warps), 1, 1), *part,
                            ptrs[4], np.int32(T), np.int32(Z), stream=stream,
                            label="prefill attention merge")  # fmt: skip

    def splits(self, start: int, T: int) -> int:
        """Key splits of one attention launch (Z; prefill_attention.cu): 1 when the (head,
        query tile) CTAs fill one wave; else the most that stay in one wave, each range at
        least SPLIT_MIN_TILES key tiles, within the partials buffer."""
        tile, n = self.geometry.prefill_attn_tile, self.gpu.num_sms
        ctas = self.config.num_heads * -(-T // tile)
        key_tiles = -(-(start + T) // tile)
        return max(1, min(self._attn_wave // ctas, key_tiles // SPLIT_MIN_TILES,
                          SPLIT_CTAS_PER_SM * n // ctas))  # fmt: skip
