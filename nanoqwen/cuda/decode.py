"""Launchers of the decode kernels (gemv_int4.cu, decode_attention.cu, decode_misc.cu) and of
the multi-row step's (decode_attention_rows.cu, lm_head_rows.cu).

`DecodeKernels(gpu, config)` builds the registry's decode specs (registry.decode_specs) and
exposes one method per kernel. Every pointer is a device address (int); every method takes
`stream` (a cuda.core Stream or a GraphBuilder being built; default: the Gpu's stream). Shapes
are fixed by the config (constexpr in the kernels); the docstrings repeat each argument's
dtype, shape and layout from the .cu files. The prefill shares embed, rmsnorm and rope_kv.
`VerifyKernels(gpu, config)` does the same for registry.verify_specs: attention and lm_head +
argmax over M = 1..verify_rows rows of one sequence (speculative decoding's verify step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import GROUP_SIZE, PAGE_TOKENS, ModelConfig
from ..errors import NanoqwenError
from . import registry
from .device import Gpu
from .launcher import Launcher

_I32 = np.int32
_MAX_KEPT_MAPS = 4096  # gemv_rows' descriptors a cache keeps (four a layer of the largest model)


def _kept_map(cache: dict, key: tuple, make):
    """cache[key], made by make() the first time: a TMA descriptor kept per (address, shape),
    since the buffers and weights it names stay put; the cache is emptied once it holds
    _MAX_KEPT_MAPS (a caller cycling through buffers cannot grow it without bound)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= _MAX_KEPT_MAPS:
            cache.clear()
        found = cache[key] = make()
    return found


def check_rows(m, what: str) -> int:
    """m as an int when it is 1..registry.MAX_ROWS token rows, what the multi-row kernels take
    (gemv_rows' largest bucket); else NanoqwenError naming `what`."""
    if not isinstance(m, (int, np.integer)) or not 1 <= m <= registry.MAX_ROWS:
        raise NanoqwenError(f"{what}: m must be 1..{registry.MAX_ROWS} token rows, got {m!r}")
    return int(m)


def _check_res(kind: str, res: int) -> None:
    """The fp32 residual goes with the residual GEMVs (o, down) and with no other."""
    if bool(res) != (kind in ("o", "down")):
        raise NanoqwenError(
            f"gemv {kind}: the fp32 residual (res) is "
            + ("required" if kind in ("o", "down") else "only for o and down")
        )


@dataclass(frozen=True)
class AttentionScratch:
    """An attention kernel's split scratch (DeviceArrays): the splits' partial (max, sum)
    part_ml and outputs part_acc, fp32, and the last-CTA counters, int32 (zeroed once; every
    launch leaves them zero, so a captured graph replays). Shapes: attention_scratch_buffers
    (attn_decode) and rows_attention_scratch_buffers (attention_rows)."""

    part_ml: object
    part_acc: object
    counters: object

    @classmethod
    def allocate(cls, gpu: Gpu, sizes: dict[str, int], what: str) -> AttentionScratch:
        bufs = {k: gpu.alloc(n, f"{what} {k}") for k, n in sizes.items()}
        gpu.memset(bufs["counters"].ptr, 0, sizes["counters"])  # the last-CTA semaphores
        return cls(**bufs)

    def free(self) -> None:
        for buf in (self.part_ml, self.part_acc, self.counters):
            buf.free()


def attention_scratch_buffers(config: ModelConfig, g: registry.Geometry) -> dict[str, int]:
    """Bytes of attn_decode's scratch (S = g.attn_splits, the kernel's stride): part_ml fp32
    [n_heads, S, 2], part_acc fp32 [n_heads, S, D], counters int32 [n_kv]."""
    c, splits = config, g.attn_splits
    return {
        "part_ml": c.num_heads * splits * 2 * 4,
        "part_acc": c.num_heads * splits * c.head_dim * 4,
        "counters": c.num_kv_heads * 4,
    }


class NormLink:
    """One multi-row step's side of gemv_rows.cu's RMSNorm hand-off: ss fp32 [NORM_PARTS,
    MAX_ROWS] (the producing CTAs' sums of squares of the residual) and two scale slots fp32
    [MAX_ROWS] in one allocation (NORM_LINK_BYTES). The step's launches go through it in
    order, and it keeps what the device chain holds between them: the rows of ss the last
    producer wrote, the slot with the c its x carries, and the slot with the last
    normalizing kernel's 1 / rms (the next producer's c). A normalizing kernel reads the first
    and writes the other slot, so no launch writes a slot the kernel before it reads."""

    def __init__(self, gpu: Gpu) -> None:
        self.buf = gpu.alloc(registry.NORM_LINK_BYTES, "rows norm hand-off")
        self.ss = self.buf.ptr
        slots = self.ss + registry.NORM_PARTS * registry.MAX_ROWS * 4
        self._slots = (slots, slots + registry.MAX_ROWS * 4)
        self._nparts = 0  # nothing handed off yet
        self._scale = self._rstd = self._slots[0]

    @property
    def rstd(self) -> int:
        """The slot of the last normalizing kernel's 1 / rms of each token row."""
        return self._rstd

    def head(self, m: int) -> int:
        """embed_rows of m rows writes ss rows 0 .. m - 1 and its 1 / rms (x's c): the slot."""
        self._nparts, self._scale = m, self._slots[0]
        self._rstd = self._scale
        return self._scale

    def produce(self, nparts: int) -> int:
        """A producer of `nparts` CTAs writes x scaled by the last 1 / rms: that slot (its c)."""
        if not 1 <= nparts <= registry.NORM_PARTS:
            raise NanoqwenError(f"norm hand-off: {nparts} producing CTAs, at most "
                                f"{registry.NORM_PARTS} rows of sums")  # fmt: skip
        self._nparts, self._scale = nparts, self._rstd
        return self._scale

    def normalize(self) -> tuple[int, np.int32, int, int]:
        """A normalizing kernel's (ss, nparts, scale, rstd): it writes rstd, the other slot."""
        if not self._nparts:
            raise NanoqwenError("norm hand-off: a normalizing kernel before any producer")
        self._rstd = self._slots[1] if self._scale == self._slots[0] else self._slots[0]
        return self.ss, _I32(self._nparts), self._scale, self._rstd


class DecodeKernels(Launcher):
    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        *,
        pdl: bool = True,
        rows: bool = False,
    ) -> None:
        specs = registry.decode_specs(config, geometry)
        if rows:  # the M-row GEMVs (gemv_rows), only for the engines that launch them
            specs += registry.rows_specs(config, geometry) + registry.rows_split_specs(
                config, geometry
            )
        super().__init__(gpu, config, specs, geometry, pdl=pdl)
        g = self.geometry
        # One carveout for the step's kernels: overlapping (PDL) kernels with different
        # carveouts make an SM drain before it reconfigures.
        for key in ("gemv_qkv", "gemv_o", "gemv_gate_up", "gemv_down", "embed", "lm_head",
                    "lm_head_q8", "sample", "attention"):  # fmt: skip
            gpu.set_smem_carveout(self.kernels[key], g.smem_carveout)
        # The GEMVs run a persistent grid: as many CTAs as are resident at once (their form's
        # CTAs an SM). Grids by (kernel, N), checked once each; the model's are made here, so
        # a ring that cannot hold two stages is refused at load.
        self._gemv_grids: dict[tuple[str, int], int] = {}
        self._rows_grids: dict[tuple[str, int], int] = {}
        self._rows_maps: dict[tuple[int, int, int, int], object] = {}
        self._x_maps: dict[tuple[int, int, int, int], object] = {}
        for kind, (_, n, _, _) in registry.gemv_shapes(config).items():
            self._gemv_grid(f"gemv_{kind}", n)
            for mt in registry.ROW_BUCKETS if rows else ():
                self._rows_grid(f"gemv_rows_{kind}_m{mt}", n)
        self._split_grids = {mt: self._split_grid(mt) for mt in registry.ROW_BUCKETS if rows}
        # Attention splits: whole clusters, at most attn_splits, about attn_ctas CTAs in all.
        cl = g.attn_cluster
        per_head = min(g.attn_splits, g.attn_ctas // config.num_kv_heads)
        self.attn_splits = max(cl, per_head // cl * cl)

    def embed(self, ids: int, embed: int, x: int, res: int, T: int, stream=None) -> None:
        """ids int32 [T] (device); embed fp16 [V, H]; x fp16 [T, H] = embed[ids] and res
        fp32 [T, H] the same values (the residual stream; x is its fp16 copy)."""
        self.launch("embed", (T, 1, 1), ids, embed, x, res, stream=stream,
                    nbytes=T * self.config.hidden_size * 6)  # fmt: skip

    def rmsnorm(self, x: int, w: int, y: int, T: int, stream=None) -> None:
        """x fp16 [T, H]; w fp16 [H]; y fp16 [T, H] = x * rsqrt(mean(x^2) + eps) * w."""
        grid = (-(-T // self.geometry.norm_rows), 1, 1)
        self.launch("rmsnorm", grid, x, w, y, _I32(T), stream=stream)

    def gemv(self, kind, x, norm_w, qweight, scales, out, n, res=0, stream=None) -> None:
        """One INT4 GEMV (batch 1), fp32 accumulate.

        kind     "o" / "down" (res += W x, in place: the residual stream; out its fp16 copy),
                 "gate_up" (RMSNorm + SwiGLU over the stacked [gate; up] weight)
        x        fp16 [K]; norm_w fp16 [K] (gate_up) or 0
        qweight  uint32 [R, K/8] ValueShuffle rows; scales fp16 [R, K/128]; R = n (gate_up: 2n)
        out      fp16 [n]
        res      fp32 [n] the residual stream (o, down; else 0)
        """
        _check_res(kind, res)
        self._gemv(kind, n, stream, x, norm_w, qweight, scales, 0, out, res, _I32(n), 0, 0, 0,
                   0, 0)  # fmt: skip

    def qkv_rope(self, x, norm_w, qweight, scales, bias, pos, rope, pages, kc, vc, q,
                 stream=None) -> None:  # fmt: skip
        """RMSNorm + fused q/k/v INT4 GEMV + bias + RoPE + K/V page write (decode, one token).

        x fp16 [H]; norm_w fp16 [H]; qweight uint32 [q+2kv, H/8]; scales fp16 [q+2kv, H/128];
        bias fp16 [q+2kv]; pos int32* (device); rope float32 [max_pos, D/2, 2] (cos, sin);
        pages int32 [max_pages]; kc, vc the layer's K/V caches (engine.kv_cache's device
        layout); q fp16 [n_heads, D].
        """
        n = self.config.q_size + 2 * self.config.kv_size
        self._gemv("qkv", n, stream, x, norm_w, qweight, scales, bias, q, 0, _I32(n), pos, rope,
                   pages, kc, vc)  # fmt: skip

    def _gemv(self, kind: str, n: int, stream, *args) -> None:
        key = f"gemv_{kind}"
        k = self.specs[key].targs[0]
        rows = 2 * n if kind == "gate_up" else n  # [gate; up] stacked
        grid = (self._gemv_grids.get((key, n)) or self._gemv_grid(key, n), 1, 1)
        self.launch(key, grid, *args, stream=stream, label=f"gemv {kind}",
                    nbytes=rows * k // 2 + rows * (k // GROUP_SIZE) * 2)  # fmt: skip

    def _gemv_grid(self, key: str, n: int) -> int:
        """CTAs of GEMV `key` over n output features: one per pair at most; raises when a CTA's
        ring would hold fewer than two stages (the kernel would trap)."""
        k, epi = self.specs[key].targs[0], registry.Epilogue(self.specs[key].targs[2])
        form, pairs = registry.gemv_form(k, self.geometry), registry.gemv_pairs(n, epi)
        ctas = min(form.ctas_per_sm, self.ctas_per_sm(key)) * self.gpu.num_sms
        grid = min(ctas, pairs)
        stages = registry.gemv_stages(k, epi, -(-pairs // grid), self.geometry)
        if stages < 2:
            raise NanoqwenError(
                f"{self.specs[key].expression} over N={n}: {grid} CTAs of {form.smem} bytes of "
                f"shared memory hold {stages} stage(s) of its ring, at least 2 are needed "
                "(registry.gemv_stages; lower kGvWideMinK or raise kGvSmem)"
            )
        self._gemv_grids[key, n] = grid
        return grid

    def embed_rows(self, ids, embed, norm_w, x, res, m, link: NormLink, stream=None) -> None:
        """The multi-row steps' embedding, the head of the RMSNorm hand-off (gemv_rows.cu):
        ids int32 [m] (device); embed fp16 [V, H]; norm_w fp16 [H] (the first layer's input
        RMSNorm); res fp32 [m, H] = embed[ids]; x fp16 [m, H] = rmsnorm(res) * norm_w."""
        m = check_rows(m, "embed_rows")
        self.launch("embed_rows", (m, 1, 1), ids, embed, norm_w, x, res, link.ss, link.head(m),
                    stream=stream, label="embed",
                    nbytes=m * self.config.hidden_size * 8)  # fmt: skip

    def gemv_rows(self, kind, m, x, qweight, scales, out, *, link: NormLink, res=0, bias=0,
                  pos=0, rope=0, pages=0, page_stride=0, kc=0, vc=0, next_w=0, n=None,
                  stream=None) -> None:  # fmt: skip
        """The INT4 GEMV over m = 1..16 token rows, every weight byte read once (gemv_rows.cu).

        kind     "qkv" (RMSNorm + q/k/v + bias + RoPE at pos[r] + K/V write into the pages),
                 "o" / "down" (res[r] += W x[r], in place; out[r] the hand-off to the next
                 RMSNorm, fp16(res[r] * next_w) scaled by the token's c, or with next_w = 0
                 the plain fp16 copy), "gate_up" (RMSNorm + SwiGLU)
        m        token rows (1..registry.MAX_ROWS; compiled in buckets of 8 and 16)
        x        fp16 [m, K] row-major (qkv, gate_up: the hand-off the producer before wrote)
        link     the step's NormLink: qkv and gate_up normalize through it, o and down hand off
        next_w   fp16 [n] the next RMSNorm's weight (o, down) or 0
        qweight  uint32 [R, K/8] ValueShuffle rows; scales fp16 [R, K/128]; R = n (gate_up: 2n)
        out      fp16 [m, n] (qkv: q fp16 [m, n_heads, D])
        res      fp32 [m, n] the residual stream (o, down; else 0)
        qkv only: bias fp16 [q+2kv]; pos int32 [m] (device: each row's position); rope float32
                 [max_pos, D/2, 2] (cos, sin); pages int32 page tables, row r's at pages +
                 r * page_stride (0: every row of one sequence); kc, vc the layer's K/V caches
        n        output features (default: the model's for `kind`)
        The launch grid (one CTA an SM at most: registry.rows_grid) is checked once per
        (kernel, n); qweight's TMA descriptor (K slices: registry.rows_split) is made on first
        use and kept.
        """
        check_rows(m, "gemv_rows")
        if page_stride < 0:
            raise NanoqwenError(f"gemv_rows: page_stride must be >= 0, got {page_stride}")
        _check_res(kind, res)
        _, n_model, _, _ = registry.gemv_shapes(self.config)[kind]
        n = n_model if n is None else n
        key = f"gemv_rows_{kind}_m{registry.row_bucket(int(m))}"
        if key not in self.specs:
            raise NanoqwenError(f"{key}: DecodeKernels was built without rows=True")
        k, epi = self.specs[key].targs[0], registry.Epilogue(self.specs[key].targs[3])
        grid = self._rows_grids.get((key, n)) or self._rows_grid(key, n)
        rows = 2 * n if epi == registry.Epilogue.SWIGLU else n
        w_map = self._rows_map(qweight, rows, k, self.specs[key].targs[4])
        x_map = self._x_map(x, k, int(m), self.specs[key].targs[1])
        # q/k/v and gate/up normalize (NORM); o and down, the residual GEMVs, hand off.
        norm = (
            link.normalize()
            if self.specs[key].targs[2]
            else (link.ss, _I32(0), link.produce(grid), 0)
        )
        self.launch(key, (grid, 1, 1), w_map, x_map, x, qweight, scales, bias, out, res, _I32(n),
                    _I32(m), pos, rope, pages, _I32(page_stride), kc, vc, *norm, next_w,
                    stream=stream, label=f"gemv_rows {kind}",
                    nbytes=rows * k // 2 + rows * (k // GROUP_SIZE) * 2)  # fmt: skip

    def _rows_map(self, qweight: int, rows: int, k: int, s: int):
        """gemv_rows' TMA descriptor of qweight uint32 [rows, K/8], box 8 rows x one K slice's
        ceil(G / s) groups of 16 words (kept per address: the weights stay put). S = 1 kernels
        ignore theirs: they get boxes of 8 x 8 words."""
        words = 8 if s == 1 else -(-(k // GROUP_SIZE) // s) * (GROUP_SIZE // 8)
        return _kept_map(self._rows_maps, (qweight, rows, k, s),
                         lambda: self.gpu.tensor_map_2d(qweight, rows, k // 8,
                                                        registry.ROWS_STAGE_PAIRS, words,
                                                        fp16=False))  # fmt: skip

    def _x_map(self, x: int, k: int, m: int, mt: int):
        """gemv_rows' TMA descriptor of x fp16 [m, K] at S = 1 (K slices ignore it), as
        (m, K / 64, 64) with boxes (MT, 2, 64): one group of MT rows, rows past m zero-filled
        (gemv_rows.cu's lane_xt). Kept per (address, K, m, MT): the steps' buffers stay put."""
        return _kept_map(
            self._x_maps,
            (x, k, m, mt),
            lambda: self.gpu.tensor_map_3d(x, (m, k // 64, 64), (mt, 2, 64)),
        )

    def _rows_grid(self, key: str, n: int) -> int:
        """gemv_rows' grid of kernel `key` over n features on this GPU (cached); raises when a
        CTA's ring would hold fewer than two stages (the kernel would trap)."""
        spec = self.specs[key]
        k, mt, epi = spec.targs[0], spec.targs[1], registry.Epilogue(spec.targs[3])
        s, teams = spec.targs[4], spec.targs[5]
        grid = registry.rows_grid(n, epi, self.gpu.num_sms, self.geometry)
        npairs = -(-registry.gemv_pairs(n, epi) // grid)
        stages = registry.rows_stages(k, mt, s, npairs, self.geometry, teams)
        if stages < 2 * teams:
            raise NanoqwenError(
                f"{spec.expression} over N={n}: {grid} CTAs of {spec.smem} bytes of shared "
                f"memory hold {stages} stage(s) of its ring, at least {2 * teams} are needed "
                "(registry.rows_stages, rows_split; raise mr_min_sms' margin)"
            )
        self._rows_grids[key, n] = grid
        return grid

    def gemv_rows_split(self, m, x, qweight, scales, out, res, part, *, link: NormLink,
                        next_w=0, stream=None) -> None:  # fmt: skip
        """down_proj over m = 1..16 token rows, split over K: gemv_rows_split (grid: row
        ranges x K slices, registry.rows_split_grid) writes each slice's sums into `part`,
        then gemv_rows_split_sum adds them to the residual in slice order (deterministic).

        m        token rows (1..registry.MAX_ROWS; compiled in buckets of 8 and 16)
        x        fp16 [m, I] row-major (the SwiGLU output)
        qweight  uint32 [H, I/8] ValueShuffle rows; scales fp16 [H, I/128]
        res      fp32 [m, H], the residual stream: res += W x, in place
        out      fp16 [m, H], the hand-off to the next RMSNorm (gemv_rows' o and down)
        link, next_w  as gemv_rows' (the sum kernel hands off)
        part     fp32 workspace of registry.rows_split_workspace(config) bytes, the step's own
                 (allocated once; each launch writes what its sum then reads)
        """
        check_rows(m, "gemv_rows_split")
        mt = registry.row_bucket(int(m))
        key, sum_key = f"gemv_rows_split_down_m{mt}", f"gemv_rows_split_sum_m{mt}"
        if key not in self.specs:
            raise NanoqwenError(f"{key}: DecodeKernels was built without rows=True")
        k, _, s = self.specs[key].targs
        n = self.config.hidden_size
        w_map = self._rows_map(qweight, n, k, s)
        self.launch(key, (self._split_grids[mt], s, 1), w_map, x, scales, part, _I32(n),
                    _I32(m), stream=stream, label="gemv_rows_split down",
                    nbytes=n * k // 2 + n * (k // GROUP_SIZE) * 2)  # fmt: skip
        quads = registry.rows_split_padded(n, self.geometry) * mt // 4  # a thread each
        ctas = -(-quads // self.specs[sum_key].threads)
        self.launch(sum_key, (ctas, 1, 1), part, res, out, _I32(n), _I32(m), next_w,
                    link.produce(ctas), link.ss, stream=stream, label="gemv_rows_split sum",
                    nbytes=s * n * m * 4 + m * n * 10)  # fmt: skip

    def _split_grid(self, mt: int) -> int:
        """gemv_rows_split's row ranges at bucket mt on this GPU; raises when its ring would
        hold fewer than two stages (the kernel would trap)."""
        spec = self.specs[f"gemv_rows_split_down_m{mt}"]
        k, _, s = spec.targs
        ranges, s_grid = registry.rows_split_grid(k, self.config.hidden_size, mt,
                                                  self.gpu.num_sms, self.geometry)  # fmt: skip
        stages = registry.rows_split_stages(k, mt, s, self.geometry)
        if stages < 2 or s_grid != s:
            raise NanoqwenError(
                f"{spec.expression}: {spec.smem} bytes of shared memory hold {stages} stage(s) "
                f"of its ring (at least 2 are needed), its grid takes {s_grid} K slices "
                "(registry.rows_split_stages, rows_split_slices)"
            )
        return ranges

    def rope_kv(self, qkv, pos0: int, rope, pages, kc, vc, q, T, stream=None) -> None:
        """RoPE + paged K/V write for T tokens at positions pos0 .. pos0 + T - 1.

        qkv fp32 [T, q+2kv] (bias added); rope float32 [max_pos, D/2, 2] (cos, sin); pages
        int32 [max_pages]; kc, vc the layer's K/V caches (engine.kv_cache's device layout);
        q fp16 [T, n_heads, D] (the rotated queries).
        """
        self.launch("rope_kv", (T, 1, 1), qkv, _I32(pos0), rope, pages, kc, vc, q,
                    stream=stream, label="rope_kv_write")  # fmt: skip

    def attention(self, q, kc, vc, pages, pos, part_ml, part_acc, counters, out,
                  stream=None) -> None:  # fmt: skip
        """Decode attention of one token over L = *pos + 1 cached tokens, split along the
        sequence in `attn_splits` CTAs a kv head with the split-combine folded in (one launch).

        q fp16 [n_heads, D]; kc, vc the layer's K/V caches (engine.kv_cache's device layout);
        pages int32 [max_pages]; part_ml fp32 [n_heads, S, 2]; part_acc fp32 [n_heads, S, D]
        (scratch, S = geometry.attn_splits); counters int32 [n_kv] (zeroed once; every launch
        leaves it zero); out fp16 [n_heads, D].
        """
        c = self.config
        self.launch("attention", (c.num_kv_heads, self.attn_splits, 1), q, kc, vc, pages, pos,
                    part_ml, part_acc, counters, out, _I32(1), _I32(0), stream=stream,
                    per_token=registry.kv_token_bytes(c, self.geometry))  # fmt: skip

    def attention_scratch(self) -> AttentionScratch:
        """The scratch `attention` needs for this geometry, allocated on the Gpu."""
        sizes = attention_scratch_buffers(self.config, self.geometry)
        return AttentionScratch.allocate(self.gpu, sizes, "attention")

    def lm_head(self, x, norm_w, w, logits, key, stream=None, rows: int | None = None) -> None:
        """x fp16 [H] (pre-norm); norm_w fp16 [H]; w fp16 [V, H]; logits fp32 [V];
        key uint64* (atomicMax of the (logit, -id) key; zero before first use).
        rows: only the first `rows` rows of w (the unit tests' small vocabularies)."""
        v = self.config.vocab_size if rows is None else rows
        ctas = min(-(-v // self.geometry.lm_warps), self.gpu.num_sms)
        self.launch("lm_head", (ctas, 1, 1), x, norm_w, w, logits, key, _I32(v), stream=stream,
                    nbytes=v * self.config.hidden_size * 2)  # fmt: skip

    def lm_head_q8(self, x, norm_w, w, scale, logits, key, stream=None,
                   rows: int | None = None) -> None:  # fmt: skip
        """lm_head over an int8 head: w int8 [V, H] row-major, scale fp32 [V] (logit =
        scale[row] * (w[row] . rmsnorm(x) * norm_w)); the other arguments as lm_head's."""
        v = self.config.vocab_size if rows is None else rows
        ctas = min(-(-v // self.geometry.lm_warps), self.gpu.num_sms)
        self.launch("lm_head_q8", (ctas, 1, 1), x, norm_w, w, scale, logits, key, _I32(v),
                    stream=stream, label="lm_head",
                    nbytes=v * (self.config.hidden_size + 4))  # fmt: skip

    def sample(self, logits, key, state, ring, host_ring, cancel, cond, stream=None) -> None:
        """Pick the next token and advance the decode state.

        logits fp32 [V]; key uint64* (lm_head's argmax key; re-zeroed); state int32
        [registry.STATE_WORDS]; ring int32 [max_new] (device: ring[step] = token); host_ring
        int32* mapped host memory (or 0): host_ring[step] = token, then host_ring[-1] = the
        count; cancel int32* mapped host flag (or 0): nonzero stops after this token; cond the
        generation while loop's GraphCondition (or 0): set to "not done".
        """
        cond_arg = cond if cond is not None and not isinstance(cond, int) else np.uint64(cond or 0)
        self.launch("sample", (1, 1, 1), logits, key, state, ring, host_ring, cancel, cond_arg,
                    _I32(self.config.vocab_size), stream=stream,
                    nbytes=self.config.vocab_size * 4)  # fmt: skip


def rows_attention_scratch_buffers(config: ModelConfig, g: registry.Geometry) -> dict[str, int]:
    """Bytes of attention_rows' scratch, one for both forms (each launch leaves the counters
    zero; the larger of the two layouts: R = verify_rows x group ratio rows a kv head, C the
    form's cluster, S = mattn_splits / C clusters a kv head, Z = ceil(R / 16) tile groups at
    most, the kernel's kMaMaxTiles): part_ml fp32 [n_kv, C, R, S, 2], part_acc fp32 [n_kv, R,
    S, D], counters int32 [n_kv, Z, C]."""
    c, rows = config, g.verify_rows * config.group_ratio
    forms = [
        {
            "part_ml": c.num_kv_heads * cl * rows * (g.mattn_splits // cl) * 2 * 4,
            "part_acc": c.num_kv_heads * rows * (g.mattn_splits // cl) * c.head_dim * 4,
            "counters": c.num_kv_heads * -(-rows // 16) * cl * 4,
        }
        for cl in (g.mattn_cluster, g.mattn_long_cluster)
    ]
    return {name: max(f[name] for f in forms) for name in forms[0]}


class VerifyKernels(Launcher):
    """The multi-row step's kernels (registry.verify_specs): attention and lm_head + argmax
    for M = 1..geometry.verify_rows consecutive positions of one sequence (speculative
    decoding verifies a token and its drafts in one step). The batch-1 step keeps
    DecodeKernels.attention and DecodeKernels.lm_head."""

    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        *,
        pdl: bool = True,
    ) -> None:
        super().__init__(gpu, config, registry.verify_specs(config, geometry), geometry, pdl=pdl)
        g = self.geometry
        for key in self.kernels:
            gpu.set_smem_carveout(self.kernels[key], g.smem_carveout)
        stages = registry.lmr_stages(config, g.verify_rows, g)
        if stages < 2:
            raise NanoqwenError(
                f"lm_head_rows at M={g.verify_rows}: {g.lmr_smem} bytes of shared memory hold "
                f"{stages} stage(s) beside x, at least 2 are needed (registry.lmr_stages)"
            )
        # Attention splits as DecodeKernels': whole clusters of either form, about attn_ctas
        # CTAs in all; the long form from the pages where the short form's clusters stop
        # fitting the GPU at once (registry.mattn_long_pages).
        cl = max(g.mattn_cluster, g.mattn_long_cluster)
        if cl % min(g.mattn_cluster, g.mattn_long_cluster):
            raise NanoqwenError("attention_rows' cluster sizes must divide one another")
        per_head = min(g.mattn_splits, g.attn_ctas // config.num_kv_heads)
        self.attn_splits = max(cl, per_head // cl * cl)
        spec = self.specs["attention_rows"]
        fits = gpu.max_active_clusters(self.kernels["attention_rows"],
                                       (config.num_kv_heads, self.attn_splits, 1), spec.threads,
                                       spec.smem)  # fmt: skip
        self.long_pages = registry.mattn_long_pages(config, self.attn_splits, fits, g)
        self._maps: dict[tuple[int, int], object] = {}

    def long_form(self, start: int, m: int) -> bool:
        """Whether the verify step of m rows from position `start` takes attention_rows' long
        form (its pages, ceil((start + m) / 16), from long_pages on); draft_ngram decides the
        same on the device."""
        return -(-(start + m) // PAGE_TOKENS) >= self.long_pages

    def attention_rows(self, q, kc, vc, pages, start, m: int, scratch: AttentionScratch,
                       out, long: bool = False, stream=None) -> None:  # fmt: skip
        """Attention of M query rows at positions *start .. *start + M - 1 (row t over keys 0 ..
        *start + t), split along the sequence in `attn_splits` CTAs a kv head (the clusters a
        short context leaves over take groups of the row tiles), with the split-combine folded
        in (one launch); long: the long form's clusters (long_form), else the short form's.

        q fp16 [M, n_heads, D] (RoPE applied); kc, vc the layer's K/V caches (engine.kv_cache's
        device layout) with positions 0 .. *start + M - 1 written; pages int32 [max_pages];
        start int32* (device; written by an earlier step, not the preceding kernel); scratch
        from attention_scratch(); out fp16 [M, n_heads, D].
        """
        c = self.config
        key = "attention_rows_long" if long else "attention_rows"
        self.launch(key, (c.num_kv_heads, self.attn_splits, 1), q, kc, vc, pages,
                    start, _I32(check_rows(m, "attention_rows")), scratch.part_ml.ptr,
                    scratch.part_acc.ptr, scratch.counters.ptr, out, stream=stream,
                    label="attention_rows",
                    per_token=registry.kv_token_bytes(c, self.geometry))  # fmt: skip

    def attention_scratch(self) -> AttentionScratch:
        """The scratch attention_rows needs for this geometry, allocated on the Gpu."""
        sizes = rows_attention_scratch_buffers(self.config, self.geometry)
        return AttentionScratch.allocate(self.gpu, sizes, "attention_rows")

    def lm_head_rows(self, x, norm_w, w, logits, keys, m: int, stream=None,
                     rows: int | None = None) -> None:  # fmt: skip
        """Final RMSNorm + lm_head + argmax for M rows.

        x fp16 [M, H] (pre-norm); norm_w fp16 [H]; w fp16 [V, H] (16-byte aligned); logits
        fp32 [M, V]; keys uint64 [M] (atomicMax of each row's (logit, -id) key; zero before
        the launch). rows: only the first `rows` rows of w (the unit tests' small
        vocabularies). The TMA descriptor of (w, rows) is made on first use and kept
        (_kept_map).
        """
        g, v = self.geometry, self.config.vocab_size if rows is None else rows
        h = self.config.hidden_size
        w_map = _kept_map(self._maps, (w, v),
                          lambda: self.gpu.tensor_map_2d(w, v, h, g.lmr_block_rows,
                                                         g.lmr_k_tile))  # fmt: skip
        ctas = min(-(-v // g.lmr_block_rows), self.gpu.num_sms)
        self.launch("lm_head_rows", (ctas, 1, 1), w_map, x, norm_w, logits, keys,
                    _I32(check_rows(m, "lm_head_rows")), _I32(v), stream=stream,
                    nbytes=v * self.config.hidden_size * 2)  # fmt: skip
