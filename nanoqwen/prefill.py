"""Prefill launchers: INT4 tensor-core GEMM and causal GQA attention over a whole prompt.

The kernels live in `kernels/prefill_gemm.cu` (mma.sync), `kernels/prefill_gemm_wgmma.cu`
(Hopper wgmma, warp-specialized) and `kernels/prefill_attention.cu` (wgmma; head_dim 64 or 128).
Construction compiles the explicit table of (kernel, template arguments) in
`prefill_kernels(config)` through `nanoqwen.cuda.jit` (disk cache; NANOQWEN_NO_COMPILE=1 makes a
miss an error), loads them, sets their shared-memory limits and reads their occupancy; `gemm` and
`attention` then only check shapes and launch: no compilation, no allocation. Every launcher
checks shapes in Python and raises ValueError with the numbers before anything reaches the GPU.

Pointers: every buffer argument is a device address: an int (a `DeviceArray.ptr`), an object
with `.ptr` (a DeviceArray), `.data_ptr()` (a torch tensor) or `.handle` (a cuda.core Buffer).
Streams: `stream=None` means the Gpu's stream; anything cuda.core's launch accepts otherwise.

The wgmma kernel takes every shape it can (N % 128 == 0, K % 128 == 0: all Qwen2.5 shapes);
it is stream-K (one CTA per SM, each an equal share of the tiles' K groups; a tile cut between
CTAs is summed up through `PrefillKernels`' parts buffer and flags). `pick_gemm` weighs the
variants by their work per SM (the mma.sync ones by whole waves) over a per-variant rate
(`GemmVariant.tflops`, measured: the tile table below). It reads A and the weights through TMA
descriptors, which `gemm` makes (and keeps) per buffer and shape. NANOQWEN_PREFILL_WGMMA=0 in
the environment keeps the engine on the mma.sync kernels (the wgmma ones stay compiled, and
explicit `variant=` works).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .config import GROUP_SIZE, ModelConfig
from .cuda import jit

GEMM_SOURCE = "prefill_gemm.cu"
WGMMA_SOURCE = "prefill_gemm_wgmma.cu"
ATTENTION_SOURCE = "prefill_attention.cu"

# Shared memory of one GEMM tile: BM rows x 128 fp16 of A + BN rows x 128 nibbles of W.
_GEMM_BK = 128
# prefill_gemm_wgmma.cu: 64-wide k-tiles, 128 weight rows per CTA, 3 warpgroups.
_WGMMA_BK = 64
_WGMMA_ROWS = 128
_WGMMA_THREADS = 384
_MAX_MAPS = 512  # TMA descriptors kept by PrefillKernels (each 128 bytes)
_ATTN_TILE = 64  # query rows per CTA and keys per K/V tile (prefill_attention.cu)
_ATTN_THREADS = 128


@dataclass(frozen=True)
class GemmVariant:
    """One compiled GEMM instantiation: a BM (tokens) x BN (weight rows) tile, a STAGES-deep
    pipeline. kind "mma": prefill_gemm.cu, warp tiles WM x WN. kind "wgmma":
    prefill_gemm_wgmma.cu, BN = 128 weight rows (two consumer warpgroups of 64) x BM tokens
    (the wgmma N: 128 or 256); wm/wn are unused there (set to bm, 64)."""

    bm: int
    bn: int
    wm: int  # warp tile: wm x wn outputs
    wn: int
    stages: int
    min_ctas: int  # CTAs per SM asked of the register allocator (__launch_bounds__)
    swiglu: bool
    kind: str = "mma"
    # TFLOP/s of this variant per busy SM slot, pick_gemm's only notion of speed (the tile
    # table below says how it is measured).
    tflops: float = 220.0

    @property
    def source(self) -> str:
        return WGMMA_SOURCE if self.kind == "wgmma" else GEMM_SOURCE

    @property
    def name(self) -> str:
        sw = "true" if self.swiglu else "false"
        if self.kind == "wgmma":
            return f"prefill_gemm_wgmma<{self.bm}, {self.stages}, {sw}>"
        args = (self.bm, self.bn, self.wm, self.wn, self.stages, self.min_ctas)
        return f"prefill_gemm_int4<{', '.join(map(str, args))}, {sw}>"

    @property
    def label(self) -> str:
        if self.kind == "wgmma":
            return f"wgmma {self.bm}x{self.bn}/s{self.stages}"
        return f"{self.bm}x{self.bn}/w{self.wm}x{self.wn}/s{self.stages}/c{self.min_ctas}"

    @property
    def threads(self) -> int:
        if self.kind == "wgmma":
            return _WGMMA_THREADS
        return (self.bm // self.wm) * (self.bn // self.wn) * 32

    @property
    def smem_bytes(self) -> int:
        if self.kind == "wgmma":  # = smem_bytes<BT, STAGES, SWIGLU>() in the kernel
            ring = self.stages * (self.bm * _WGMMA_BK * 2 + _WGMMA_ROWS * _WGMMA_BK // 2)
            cols = _WGMMA_ROWS // 2 if self.swiglu else _WGMMA_ROWS
            staging = self.bm * (cols + 4) * 4
            return 1024 + max(ring, staging) + (2 * self.stages + 1) * 8
        return self.stages * (self.bm * _GEMM_BK * 2 + self.bn * _GEMM_BK // 2)

    def fits(self, N: int, K: int) -> bool:
        """The shape preconditions of this variant's kernel (beyond gemm()'s own checks)."""
        if self.kind == "wgmma":
            return N % _WGMMA_ROWS == 0 and K % (2 * _WGMMA_BK) == 0
        return N % self.bn == 0


def wgmma_variant(bt: int, stages: int, swiglu: bool, tflops: float) -> GemmVariant:
    """A prefill_gemm_wgmma.cu instantiation: 128 weight rows x `bt` tokens, `stages` deep."""
    return GemmVariant(bt, _WGMMA_ROWS, bt, 64, stages, 1, swiglu, "wgmma", tflops)


# Tile table (H200, 2026-11-30, tools/prefill_check.py at M = 512). 64 x 128 CTAs of four
# 64 x 32 warp tiles, 4 stages (96 KiB: two CTAs per SM) beat, on every 7B shape, 128 x 128
# (one CTA/SM; 235 vs 256 TFLOP/s on gate_up) and 32 x 64 warp tiles (half the A traffic but
# twice the dequantization per mma: 219). Three CTAs per SM would need <= 168 registers and
# spills. The first variant of a kind wins ties in pick_gemm.
# Rates: TFLOP/s per busy SM slot. mma.sync: the chip's rate on a shape divided by the share
# of SM slots its launch fills (ctas / (waves x slots)), pick_gemm counting the waves itself;
# the stream-K wgmma kernel keeps every SM busy, so its rate is the chip's on the padded work
# (ceil(M / BM) x BM tokens). Measured (prefill_check.py --quick, M = 512, 2026-11-30, calls
# queued back to back; chip TFLOP/s), q/k/v, o, gate_up, down:
#   wgmma 128 tokens, 6 stages (121 KiB): 474, 448, 547, 461;
#   wgmma 256 tokens, 4 stages (145 KiB): 487, 427, 637, 584;
#   mma 64 x 128 (timed one call at a time, before; -> per busy slot): 154 -> 282,
#   167 -> 197, 253 -> 254, 218 -> 257;
#   cuBLAS fp16 (chip): 654, 637, 695, 676.
# With these (plain kinds: their mean), the picker takes 256 tokens for every 7B shape at
# M = 512: the measured winner (q/k/v 0.035 ms, gate_up 0.218, down 0.119) or within 5% of it
# (o: 0.031 against 0.029 for 128), and 128 below 256 tokens (less padding). Before stream-K
# (one CTA per tile), down took 0.149 ms at best (128 tokens: 112 CTAs on 132 SMs) and gate_up
# 0.240 (4.5 waves of 256 tokens); a 192-token tile then won q/k/v (0.034 ms) but lost every
# shape under stream-K (q/k/v 0.036, o 0.030, gate_up 0.285, down 0.136) and was dropped.
# 8 and 5 stages for 128 and 256 tokens measured within 2% of 6 and 4 (one CTA per tile);
# thread block clusters sharing the activation loads (TMA multicast) and 256-row CTA tiles
# did not pay (branch prefill-cluster-experiment).
MMA_VARIANTS = (
    GemmVariant(64, 128, 64, 32, 4, 1, False, tflops=245.0),
    GemmVariant(64, 128, 64, 32, 4, 1, True, tflops=254.0),
)
WGMMA_VARIANTS = (
    wgmma_variant(128, 6, False, 461.0),
    wgmma_variant(128, 6, True, 547.0),
    wgmma_variant(256, 4, False, 499.0),
    wgmma_variant(256, 4, True, 637.0),
)
GEMM_VARIANTS = WGMMA_VARIANTS + MMA_VARIANTS


def wgmma_enabled() -> bool:
    """False when NANOQWEN_PREFILL_WGMMA=0: pick_gemm then keeps to the mma.sync kernels."""
    return os.environ.get("NANOQWEN_PREFILL_WGMMA", "1") != "0"


def gemm_variants() -> tuple[GemmVariant, ...]:
    return GEMM_VARIANTS


def attention_variant(config: ModelConfig) -> str:
    """The attention instantiation for a model: head_dim, query heads and KV heads as constexpr."""
    return f"prefill_attention<{config.head_dim}, {config.num_heads}, {config.num_kv_heads}>"


def attention_smem_bytes(head_dim: int) -> int:
    """prefill_attention.cu's Layout<D>::kSmemBytes: 1024 bytes of alignment slack + Q, two K
    and two V tiles of 64 rows x head_dim halves."""
    return 1024 + 5 * _ATTN_TILE * head_dim * 2


def prefill_kernels(
    config: ModelConfig, variants: tuple[GemmVariant, ...] = GEMM_VARIANTS
) -> dict[str, list[str]]:
    """The explicit (source, kernel name expressions) table of the prefill path: one entry
    per GEMM source that some variant uses, then attention."""
    table: dict[str, list[str]] = {}
    for v in variants:
        table.setdefault(v.source, [])
        if v.name not in table[v.source]:
            table[v.source].append(v.name)
    table[ATTENTION_SOURCE] = [attention_variant(config)]
    return table


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


def _load_kernels(compiled) -> tuple[object, dict]:
    """Load a jit.Compiled cubin and look its kernels up by mangled name.

    Not `Compiled.kernel()`: cuda.core's get_kernel wants symbol_mapping values as bytes (it
    passes them to the driver as const char*) and the device image's cuda.core rejects the
    str mapping ("expected bytes, str found", H200 run 2026-11-30). A name that is not in the
    mapping is encoded by get_kernel itself, so the mangled str works on every version.
    """
    from cuda.core import ObjectCode

    module = ObjectCode.from_cubin(compiled.cubin)
    return module, {name: module.get_kernel(m) for name, m in compiled.symbols.items()}


class PrefillKernels:
    """The prefill kernels of one model, compiled and ready to launch.

    Construction compiles the .cu files with NVRTC (model dims as template constexpr), loads
    them on the current device and sets shared-memory limits. `gemm` and `attention` then
    only check shapes and launch: no allocation, no compilation.
    """

    def __init__(
        self,
        config: ModelConfig,
        gpu,
        variants: tuple[GemmVariant, ...] = GEMM_VARIANTS,
        *,
        pdl: bool = True,
    ) -> None:
        """config: the model; gpu: a nanoqwen.cuda.device.Gpu (device current, its stream the
        default); variants: the GEMM tile table (tools/prefill_check.py passes extra ones);
        pdl: launch with programmatic stream serialization (every prefill kernel triggers its
        dependents at entry and waits for its predecessor before touching global memory)."""
        self.config, self.gpu, self.variants, self.pdl = config, gpu, tuple(variants), pdl
        self.num_sms = gpu.num_sms
        self.use_wgmma = wgmma_enabled()
        table = prefill_kernels(config, self.variants)
        mods = {src: jit.compile_module(src, names, config) for src, names in table.items()}
        self.resources = {}  # ptxas -v, by name expression
        for mod in mods.values():
            self.resources.update(mod.resources())
        self._gemm, self._per_sm, self._maps = {}, {}, {}
        with gpu.guard("loading the prefill kernels"):
            loaded = {src: _load_kernels(mod) for src, mod in mods.items()}
            self._modules = tuple(lib for lib, _ in loaded.values())  # keep the libraries alive
            attn_kernels = loaded[ATTENTION_SOURCE][1]
            for v in self.variants:
                kernel = loaded[v.source][1][v.name]
                gpu.set_max_dynamic_smem(kernel, v.smem_bytes)
                self._gemm[v] = kernel
                # CTAs resident per SM (registers and shared memory), for the tile choice.
                occ = kernel.occupancy.max_active_blocks_per_multiprocessor(v.threads, v.smem_bytes)
                self._per_sm[v] = max(1, occ)
            # The stream-K hand-over of the wgmma GEMMs: a part of fp32 sums per CTA (256
            # consumer threads x BT / 2 accumulators; one CTA per SM: 17 MB on an H200) and
            # its flag, zero between launches.
            bts = [v.bm for v in self.variants if v.kind == "wgmma"]
            self._parts = gpu.alloc(
                self.num_sms * 256 * max(bts, default=0) // 2 * 4, "prefill parts"
            )
            self._flags = gpu.alloc(self.num_sms * 4, "prefill part flags")
            gpu.memset(self._flags.ptr, 0, self.num_sms * 4)
            self.attention_name = table[ATTENTION_SOURCE][0]
            self._attn = attn_kernels[self.attention_name]
            self._attn_smem = attention_smem_bytes(config.head_dim)
            gpu.set_max_dynamic_smem(self._attn, self._attn_smem)

    # -- GEMM ---------------------------------------------------------------------------------
    def pick_gemm(self, M: int, N: int, swiglu: bool = False, K: int | None = None) -> GemmVariant:
        """Tile choice: the least estimated time, SM-waves x (the work of one wave on one SM,
        per_sm CTAs of bm x bn) / the variant's nominal rate; per_sm is the CTAs resident per
        SM (occupancy API), and the waves of the stream-K wgmma kernel are fractional (every
        SM busy to the end). Variants whose preconditions fail for (N, K) are skipped, and the
        wgmma ones when NANOQWEN_PREFILL_WGMMA=0. Ties go to the first variant in the table."""
        best, best_cost = None, None
        for v in self.variants:
            if v.swiglu != swiglu or not v.fits(N, K if K is not None else 2 * _WGMMA_BK):
                continue
            if v.kind == "wgmma" and not self.use_wgmma:
                continue
            ctas = -(-M // v.bm) * (N // v.bn)
            per_sm = self._per_sm[v]
            if v.kind == "wgmma":  # stream-K: the tiles' work spread evenly over every SM
                waves = ctas / (self.num_sms * per_sm)
            else:
                waves = -(-ctas // (self.num_sms * per_sm))
            cost = waves * per_sm * v.bm * v.bn / v.tflops
            if best_cost is None or cost < best_cost:
                best, best_cost = v, cost
        if best is None:
            raise ValueError(f"prefill gemm: no tile fits N={N} (needs a multiple of 128)")
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
        variant: GemmVariant | None = None,
        stream=None,
    ) -> None:
        """out = a @ dequant(qweight, scales)^T (+ bias) (+ residual), fp32 accumulate.

        a        fp16   [M, K] row-major activations (M >= 1, any)
        qweight  uint32 [N, K/8] ValueShuffle words, row-major (nanoqwen.quant)
        scales   fp16   [N, K/128] one scale per output row and 128-group of K
        bias     fp16   [N] or None
        out      fp16   [M, N]; with swiglu=True [M, N/2]: the weight is [gate; up] stacked
                 (rows 0..N/2-1 gate, N/2..N-1 up) and out = silu(a @ gate^T) * (a @ up^T)
        residual fp16   [M, N] or None; added in fp32 before rounding; may be `out` itself
        K % 128 == 0, N % 128 == 0 (swiglu: N/2 % 64 == 0). All pointers 16-byte aligned.
        """
        if M < 1 or K < GROUP_SIZE or K % GROUP_SIZE:
            raise ValueError(f"prefill gemm: need M >= 1 and K % {GROUP_SIZE} == 0; M={M} K={K}")
        if N < 128 or N % 128:
            raise ValueError(f"prefill gemm: N={N} must be a positive multiple of 128")
        if swiglu and (bias is not None or residual is not None):
            raise ValueError("prefill gemm: swiglu takes no bias and no residual")
        v = variant if variant is not None else self.pick_gemm(M, N, swiglu, K)
        if v.swiglu != swiglu:
            raise ValueError(f"prefill gemm: variant {v.name} does not match swiglu={swiglu}")
        if not v.fits(N, K):
            raise ValueError(f"prefill gemm: variant {v.name} does not take N={N} K={K}")
        ptrs = [_ptr(x) for x in (a, qweight, scales, out)]
        res_ptr = 0 if residual is None else _ptr(residual)
        if any(p % 16 for p in (*ptrs, res_ptr)):  # the wgmma epilogue reads 16-byte residuals
            raise ValueError(
                f"prefill gemm: pointers must be 16-byte aligned, got {ptrs} residual {res_ptr}"
            )
        tiles = -(-M // v.bm) * (N // v.bn)
        if v.kind == "wgmma":  # stream-K: one CTA per SM, each an equal share of the groups
            iterations = tiles * (K // GROUP_SIZE)  # the kernel's Split: tiles x K groups
            grid = (min(iterations, self.num_sms), 1, 1)
            extra = (self._parts.ptr, self._flags.ptr)
        else:
            grid, extra = (-(-M // v.bm), N // v.bn, 1), ()
        self._launch(
            stream,
            "prefill gemm",
            grid,
            v.threads,
            v.smem_bytes,
            self._gemm[v],
            *self._maps_for(v, ptrs[0], ptrs[1], M, N, K),
            ptrs[2],
            0 if bias is None else _ptr(bias),
            res_ptr,
            ptrs[3],
            np.int32(M),
            np.int32(N),
            np.int32(K),
            *extra,
        )

    def _maps_for(self, v: GemmVariant, a: int, qweight: int, M: int, N: int, K: int) -> tuple:
        """The A and qweight arguments of variant v: the addresses (mma.sync) or the wgmma
        kernel's TMA descriptors, A [M, K] in boxes of 64 K x bm tokens and qweight [N, K/8]
        (uint32) in boxes of 64 rows x 8 words."""
        if v.kind != "wgmma":
            return a, qweight
        return (
            self._map(a, M, K, v.bm, _WGMMA_BK, True),
            self._map(qweight, N, K // 8, 64, _WGMMA_BK // 8, False),
        )

    def _map(self, ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, fp16: bool):
        """A TMA descriptor, kept per shape and address: the engine's prefill reuses a few
        buffers, and the weights stay put."""
        key = (ptr, rows, cols, box_rows, box_cols, fp16)
        tmap = self._maps.get(key)
        if tmap is None:
            if len(self._maps) >= _MAX_MAPS:
                self._maps.clear()
            tmap = self.gpu.tensor_map_2d(ptr, rows, cols, box_rows, box_cols, fp16=fp16)
            self._maps[key] = tmap
        return tmap

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q, k, v, out, T: int, *, stream=None) -> None:
        """Causal GQA attention over positions 0..T-1, softmax scale 1/sqrt(head_dim).

        q    fp16 [T, num_heads, head_dim]     RoPE applied, row-major
        k, v fp16 [T, num_kv_heads, head_dim]  RoPE applied to k, row-major
        out  fp16 [T, num_heads, head_dim]     must not alias q, k, v
        """
        if T < 1:
            raise ValueError(f"prefill attention: T={T} must be >= 1")
        ptrs = [_ptr(x) for x in (q, k, v, out)]
        if any(p % 16 for p in ptrs):
            raise ValueError(f"prefill attention: pointers must be 16-byte aligned, got {ptrs}")
        grid = (self.config.num_heads, -(-T // _ATTN_TILE), 1)
        self._launch(
            stream, "prefill attention", grid, _ATTN_THREADS, self._attn_smem, self._attn, *ptrs,
            np.int32(T),
        )  # fmt: skip

    # -- launch ----------------------------------------------------------------------------------
    def _launch(self, stream, what, grid, threads, smem, kernel, *args) -> None:
        with self.gpu.guard(what):  # a sticky error marks the Gpu broken
            self.gpu.launch(kernel, grid, threads, *args, smem=smem, pdl=self.pdl, stream=stream)
