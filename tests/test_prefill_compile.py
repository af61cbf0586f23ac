"""Prefill kernels on the CPU: they compile with NVRTC for sm_90a (every preset) through the
registry, use tensor cores (wgmma, with setmaxnreg in prefill_gemm_wgmma.cu) and spill
nothing; the GEMM's register dequantization, swizzled shared-memory layout, A fragments and
epilogue mapping, emulated in numpy lane by lane, reproduce A @ dequant(W)^T; the stream-K
schedule covers every tile once; pick_gemm takes the measured tile; the host's shared-memory
formulas are the kernels'."""

import numpy as np
import pytest

from nanoqwen.config import PAGE_TOKENS, PRESETS, preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.prefill import PrefillKernels
from nanoqwen.quant import dequantize_packed, pack_value_shuffle, quantize_pack

pytest.importorskip("cuda.bindings.nvrtc")
jit = pytest.importorskip("nanoqwen.cuda.jit")

SMEM_LIMIT = 227 * 1024  # Hopper: largest dynamic shared memory one CTA may opt into
GEMM, ATTENTION = registry.PREFILL_GEMM, registry.PREFILL_ATTENTION


@pytest.fixture(autouse=True)
def _cache(kernel_cache):
    return kernel_cache


def _ptx(source_name: str, names: list[str], cfg, tmp_path, monkeypatch) -> str:
    """The PTX of a module, through jit's NANOQWEN_DUMP_PTX switch (in a private cache, so the
    one .ptx there is this module's)."""
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOQWEN_DUMP_PTX", names[0])
    jit.compile_module(source_name, names, registry.header(cfg))
    (path,) = jit.cache_dir().glob(f"{source_name.split('.')[0]}-*.ptx")
    return path.read_text(errors="replace")


@pytest.mark.parametrize("name", list(PRESETS))
def test_prefill_kernels_compile_without_spills(name):
    cfg = preset(name)
    specs = registry.prefill_specs(cfg)
    modules = registry.compile_specs(specs, cfg)
    for source, names in registry.sources(specs).items():
        res = modules[source].resources()
        assert set(res) == set(names), f"{source}: ptxas reported {sorted(res)}"
        for kernel, r in res.items():
            assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{kernel} uses local memory: {r}"
            assert r.registers <= 255, f"{kernel}: {r.registers} registers"
    assert all(s.smem <= SMEM_LIMIT for s in specs)


def test_wgmma_kernel_ptxas_report():
    """setmaxnreg honoured (no C7508), wgmma not serialized by ptxas (no C7515-style
    advisory), every tile of the table and three deeper candidates (dev/prefill_check.py
    EXTRA_TILES) spill-free."""
    cfg = preset("7b")
    names = sorted({s.expression for s in registry.prefill_specs(cfg) if s.tile})
    names += [
        "prefill_gemm_wgmma<16, 24, false>",
        "prefill_gemm_wgmma<128, 8, false>",
        "prefill_gemm_wgmma<256, 5, true>",
    ]
    mod = jit.compile_module(GEMM, names, registry.header(cfg))
    for kernel, r in mod.resources().items():
        assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{kernel} uses local memory: {r}"
    log = mod.log.lower()
    assert "c7508" not in log and "setmaxnreg" not in log, mod.log
    assert "serializ" not in log and "performance loss" not in log, mod.log


def test_kernels_use_tensor_cores(tmp_path, monkeypatch):
    cfg = preset("tiny")
    table = registry.sources(registry.prefill_specs(cfg))
    wg = _ptx(GEMM, table[GEMM], cfg, tmp_path / "gemm", monkeypatch)
    for tokens in sorted({t.tokens for t in registry.GEMM_TILES}):
        assert f"wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32.f16.f16" in wg
    for needle in (
        "setmaxnreg.dec.sync.aligned.u32 40",
        "setmaxnreg.inc.sync.aligned.u32 232",
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "wgmma.wait_group.sync.aligned 1",
    ):
        assert needle in wg, needle
    attn = _ptx(ATTENTION, table[ATTENTION], cfg, tmp_path / "attn", monkeypatch)
    d = cfg.head_dim  # S = Q K^T from shared memory; O += P V with P in registers, V N-major
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in attn
    assert f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16" in attn


@pytest.mark.parametrize("name", ["7b", "0.5b"])
def test_attention_wgmma_not_serialized(name):
    """ptxas keeps the attention's wgmma asynchronous (no C7514-style advisory) at both head
    dims the kernel takes (128 and 64)."""
    cfg = preset(name)
    names = registry.sources(registry.prefill_specs(cfg))[ATTENTION]
    mod = jit.compile_module(ATTENTION, names, registry.header(cfg))
    log = mod.log.lower()
    assert "serializ" not in log and "performance loss" not in log, mod.log


# -- the magic-number dequantization (common.cuh dequant_word, the GEMM's dequant_pair) ------
def _halves(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)


def _word(lo, hi) -> int:
    h = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint32)
    return int(h[0] | (h[1] << 16))


def _op(a, b, c=None, kind="mul"):
    x, y = _halves(a).astype(np.float32), _halves(b).astype(np.float32)
    r = {"mul": x * y, "sub": x - y, "fma": x * y + (0 if c is None else _halves(c))}[kind]
    return _word(*r.astype(np.float16))  # one fp16 rounding, as the f16x2 instructions


def _dequant_word(w: int) -> list[int]:
    """common.cuh dequant_word: pairs 0, 2 through 1024 + u - 1032, pairs 1, 3 taken in place
    (16 x larger) and brought back with one fma (x / 16 - 72)."""
    p0, p1 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    w >>= 8
    p2, p3 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    lo = [_op(p, 0x64086408, kind="sub") for p in (p0, p2)]
    hi = [_op(p, 0x2C002C00, 0xD480D480, kind="fma") for p in (p1, p3)]
    return [lo[0], hi[0], lo[1], hi[1]]


def _dequant_pair(w: int, shift: int) -> int:
    """prefill_gemm_wgmma.cu dequant_pair before the scale: (w >> shift) & 0x000F000F."""
    return _op(((w >> shift) & 0x000F000F) ^ 0x64086408, 0x64086408, kind="sub")


@pytest.mark.parametrize("value", range(-8, 8))
def test_dequant_magic_numbers_exact(value):
    q = np.full((1, 8), value, dtype=np.int8)
    q[0, 1::2] = -1 - value  # odd lanes: a different value in the high half-word
    word = int(pack_value_shuffle(q)[0, 0])
    pairs = [_halves(p) for p in _dequant_word(word)]
    pairs += [_halves(_dequant_pair(word, 4 * i)) for i in range(4)]
    assert all(p[0] == value and p[1] == -1 - value for p in pairs)


# -- numpy emulation of prefill_gemm_wgmma.cu ------------------------------------------------
def _wg_weight_row(tile_n: int, r: int, n: int, swiglu: bool) -> int:
    """prefill_gemm_wgmma.cu weight_row: CTA-local row r -> global weight row."""
    if not swiglu:
        return tile_n * 128 + r
    col = tile_n * 64 + 8 * (r >> 4) + (r & 7)
    return n // 2 + col if r & 8 else col


def _wg_stage_rows(tile_n: int, n: int, swiglu: bool) -> list[int]:
    """The global weight row in each of a stage's 128 rows: prefill_gemm_wgmma.cu's two TMA
    boxes of 64 rows from weight_box_row (SwiGLU: the gate rows, then the up rows)."""
    firsts = (tile_n * 64, n // 2 + tile_n * 64) if swiglu else (tile_n * 128, tile_n * 128 + 64)
    return [first + j for first in firsts for j in range(64)]


def _wg_weight_slot(r: int, swiglu: bool) -> int:
    """prefill_gemm_wgmma.cu weight_slot: the stage row a consumer reads for CTA-local row r."""
    return ((r & 8) << 3) + 8 * (r >> 4) + (r & 7) if swiglu else r


def _sw128(addr: int) -> int:
    """The 128-byte swizzle (wgmma descriptor mode 1, TMA SWIZZLE_128B) on a 1024-aligned base:
    address bits 4-6 ^= bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def _emulate_wgmma_cta(a, qweight, scales, bt, tile_n, swiglu, bias=None, residual=None):
    """One CTA of prefill_gemm_wgmma<bt, *, swiglu> (token tile 0), step by step as the kernel:
    the swizzled activation stage and the weight stage (two TMA boxes), the wgmma B operand read
    through the K-major 128B-swizzle descriptor (start + 32 B per k16, SBO 1024), the per-lane A
    fragments (pair t of words 2s / 2s+1 of rows g / g+8, times the group scale), the m64nBT
    accumulator layout, and the epilogue's staging and column mapping. Returns the CTA's
    output block [m, cols] in float32 (before the final fp16 rounding)."""
    m, k = a.shape
    n = qweight.shape[0]
    a_pad = np.zeros((bt, k), np.float16)
    a_pad[:m] = a  # the TMA zero-fills token rows past M
    acc = np.zeros((2, 4, 32, bt // 2), np.float32)  # [warpgroup][warp][lane][register]
    for kt in range(k // 64):
        stage = np.zeros(bt * 128, np.uint8)  # the TMA: chunk c of row r at chunk c ^ (r & 7)
        rows = a_pad[:, kt * 64 : (kt + 1) * 64].view(np.uint8).reshape(bt, 128)
        for r in range(bt):
            for c in range(8):
                off = r * 128 + ((c ^ (r & 7)) << 4)
                stage[off : off + 16] = rows[r, c * 16 : (c + 1) * 16]
        halves = stage.view(np.float16)
        wsm = qweight[_wg_stage_rows(tile_n, n, swiglu), kt * 8 : kt * 8 + 8]
        for s in range(4):
            b = np.zeros((bt, 16), np.float32)  # B[token][k] as the descriptor addresses it
            for tok in range(bt):
                for kk in range(16):
                    addr = _sw128(32 * s + (tok // 8) * 1024 + (tok % 8) * 128 + 2 * kk)
                    b[tok, kk] = halves[addr // 2]
            for cw in range(2):
                frag = np.zeros((64, 16), np.float32)  # the warpgroup's A, from its lanes
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        r0 = 64 * cw + 16 * warp + g
                        regs = []
                        for w_idx, r in ((2 * s, r0), (2 * s, r0 + 8), (2 * s + 1, r0),
                                         (2 * s + 1, r0 + 8)):  # fmt: skip
                            sc = int(scales[_wg_weight_row(tile_n, r, n, swiglu), kt // 2]
                                     .view(np.uint16))  # fmt: skip
                            word = int(wsm[_wg_weight_slot(r, swiglu), w_idx])
                            p = ((word >> (4 * t)) & 0x000F000F) ^ 0x64086408
                            h = _op(_op(p, 0x64086408, kind="sub"), sc | (sc << 16))
                            regs.append(_halves(h).astype(np.float32))
                        row = 16 * warp + g
                        frag[row, 2 * t : 2 * t + 2] = regs[0]
                        frag[row + 8, 2 * t : 2 * t + 2] = regs[1]
                        frag[row, 2 * t + 8 : 2 * t + 10] = regs[2]
                        frag[row + 8, 2 * t + 8 : 2 * t + 10] = regs[3]
                d = frag @ b.T  # [64 weight rows][bt tokens]
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for j in range(bt // 8):
                            for e in range(2):
                                acc[cw, warp, lane, 4 * j + e] += d[
                                    16 * warp + g, 8 * j + 2 * t + e
                                ]
                                acc[cw, warp, lane, 4 * j + 2 + e] += d[
                                    16 * warp + g + 8, 8 * j + 2 * t + e
                                ]
    cols = 64 if swiglu else 128
    stg = np.full((bt, cols), np.nan, np.float32)
    for cw in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                r0 = 64 * cw + 16 * warp + g
                for j in range(bt // 8):
                    for e in range(2):
                        tok, x0, x1 = (
                            8 * j + 2 * t + e,
                            acc[cw, warp, lane, 4 * j + e],
                            acc[cw, warp, lane, 4 * j + 2 + e],
                        )
                        if swiglu:
                            stg[tok, 32 * cw + 8 * warp + g] = x0 / (1 + np.exp(-x0)) * x1
                        else:
                            b0 = 0.0 if bias is None else float(bias[tile_n * 128 + r0])
                            b1 = 0.0 if bias is None else float(bias[tile_n * 128 + r0 + 8])
                            stg[tok, r0], stg[tok, r0 + 8] = x0 + b0, x1 + b1
    out = stg[:m].copy()
    if residual is not None:
        out += residual[:m, tile_n * cols : (tile_n + 1) * cols].astype(np.float32)
    return out


@pytest.mark.parametrize("swiglu", [False, True], ids=["bias+residual", "swiglu"])
def test_wgmma_emulation_matches_matmul(swiglu):
    rng = np.random.default_rng()
    n, k, bt, m, tile_n = 256, 256, 16, 13, 1  # 4 k-tiles, 2 scale groups, 3 padded tokens
    a = rng.standard_normal((m, k)).astype(np.float16)
    qweight, scales = quantize_pack(rng.standard_normal((n, k)).astype(np.float32))
    w16 = dequantize_packed(qweight, scales).astype(np.float16).astype(np.float32)
    ref = a.astype(np.float32) @ w16.T
    if swiglu:
        gate, up = ref[:, : n // 2], ref[:, n // 2 :]
        ref = (gate / (1 + np.exp(-gate)) * up)[:, tile_n * 64 : (tile_n + 1) * 64]
        got = _emulate_wgmma_cta(a, qweight, scales, bt, tile_n, True)
    else:
        bias = rng.standard_normal(n).astype(np.float16)
        residual = rng.standard_normal((m, n)).astype(np.float32)  # the fp32 residual stream
        ref = ref + bias.astype(np.float32) + residual
        ref = ref[:, tile_n * 128 : (tile_n + 1) * 128]
        got = _emulate_wgmma_cta(a, qweight, scales, bt, tile_n, False, bias, residual)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


# -- tile choice --------------------------------------------------------------------------------
def _picker() -> PrefillKernels:
    """A PrefillKernels with the table's GEMM specs and nothing on a device (pick_gemm reads
    only them)."""
    pk = PrefillKernels.__new__(PrefillKernels)
    pk.gemms = [s for s in registry.prefill_specs(preset("7b")) if s.tile]
    return pk


@pytest.mark.parametrize("m", [1, 17, 128, 512, 513, 4096])
def test_pick_gemm_matches_swiglu(m):
    pk = _picker()
    for swiglu in (False, True):
        spec = pk.pick_gemm(m, swiglu)
        assert spec.tile.swiglu == swiglu and spec.key in {s.key for s in pk.gemms}


def test_pick_gemm_takes_the_measured_winners():
    """The tiles the H200 timed fastest (docs/PERFORMANCE.md, Prompt lengths and the GEMM
    tiles; registry.GEMM_TILES holds the rates): at M = 512 the 256-token tile; just past it
    (530, 576) and at 1100 the 192-token one, whose padding is the least (576 and 1152 rows
    against 768 and 1280); at 700 the 256-token one again (both pad to 768); up to 16 tokens
    (the verify step's rows) the 16-token one, up to 64 the 64-token one and up to 128 the
    128-token one."""
    pk = _picker()
    for swiglu in (False, True):
        for m, tokens in ((1, 16), (8, 16), (16, 16), (17, 64), (32, 64), (64, 64), (65, 128),
                          (128, 128), (129, 192), (384, 192), (512, 256), (530, 192),
                          (576, 192), (700, 256), (1100, 192), (2048, 256)):  # fmt: skip
            assert pk.pick_gemm(m, swiglu).tile.tokens == tokens, (m, swiglu)


def _stream_k_segments(tiles: int, groups: int, parts: int, c: int) -> list[tuple[int, int, int]]:
    """prefill_gemm_wgmma.cu's Split: CTA c's segments (tile, g0, g1), in the order it runs
    them (last first)."""
    total = tiles * groups
    lo_bound, hi, segs = total * c // parts, total * (c + 1) // parts, []
    while hi > lo_bound:
        u = (hi - 1) // groups
        lo = max(lo_bound, u * groups)
        segs.append((u, lo - u * groups, hi - u * groups))
        hi = lo
    return segs


@pytest.mark.parametrize(
    "tiles,groups",
    [(112, 148), (56, 148), (36, 28), (592, 28), (1, 28), (2, 1), (7168, 148), (3, 5)],
)
def test_stream_k_schedule(tiles, groups):
    """The stream-K split of prefill_gemm_wgmma.cu over min(groups of work, 132) CTAs: every
    (tile, group) is computed once; a CTA hands a part over only as its first segment; each
    tile's owner (the segment with its last group) collects, walking down from the CTA below
    it until one began the tile (the kernel's loop), exactly the other CTAs holding groups of
    that tile, each of which handed it over as its first work: an owner waits only on CTAs
    launched before it, never on one that waits itself."""
    parts = min(tiles * groups, 132)
    first = [tiles * groups * c // parts for c in range(parts + 1)]
    seen, holders, owners = set(), {}, {}
    for c in range(parts):
        segs = _stream_k_segments(tiles, groups, parts, c)
        assert segs, "every CTA has work"
        for i, (u, g0, g1) in enumerate(segs):
            assert 0 <= g0 < g1 <= groups
            for g in range(g0, g1):
                assert (u, g) not in seen
                seen.add((u, g))
            if g1 < groups:
                assert i == 0, "a part is handed over first"
            else:
                owners[u] = (c, g0)
            holders.setdefault(u, set()).add(c)
    assert len(seen) == tiles * groups and set(owners) == set(range(tiles))
    for u, (owner, g0) in owners.items():
        collected, c = set(), owner - 1
        while g0 > 0:
            collected.add(c)
            if first[c] <= u * groups:
                break
            c -= 1
        assert collected == holders[u] - {owner}, u
        assert all(c < owner for c in collected)


def test_smem_formulas_are_the_kernels():
    """registry.gemm_smem_bytes is prefill_gemm_wgmma.cu's smem_bytes<BT, STAGES, SWIGLU>() and
    registry.prefill_attention_smem_bytes is prefill_attention.cu's Layout<D>::kSmemBytes
    (static_asserts appended to the sources must compile), within one CTA's limit."""
    cfg = preset("7b")
    text = (jit.KERNEL_DIR / GEMM).read_text()
    for t in registry.GEMM_TILES:
        args = f"{t.tokens}, {t.stages}, {'true' if t.swiglu else 'false'}"
        want = registry.gemm_smem_bytes(t)
        text += f'static_assert(nanoqwen_wgmma::smem_bytes<{args}>() == {want}, "{args}");\n'
        assert want <= SMEM_LIMIT
    jit.compile_module(GEMM, [], registry.header(cfg), source=text)
    text = (jit.KERNEL_DIR / ATTENTION).read_text()
    for d in (64, 128):
        want = registry.prefill_attention_smem_bytes(d)
        text += f"static_assert(nanoqwen_prefill_attention::Layout<{d}>::kSmemBytes == {want});\n"
        assert want <= SMEM_LIMIT
    jit.compile_module(ATTENTION, [], registry.header(cfg), source=text)


# -- prefill attention: occupancy and the K/V tile copies' index math ----------------------------
SMEM_PER_SM = 228 * 1024  # sm_90: an SM's shared memory (prefill_attention.cu kSmemPerSm)
SMEM_CTA_RESERVE = 1024  # sm_90: taken per resident CTA (kSmemCtaReserve)
REGS_PER_SM = 65536
REG_GRANULE = 8  # registers a thread are allocated in steps of 8 (256 a warp)


@pytest.mark.parametrize("name", list(PRESETS))
def test_attention_registers_keep_the_smem_occupancy(name):
    """The attention's registers allow as many CTAs an SM as its shared memory does (2 at
    head_dim 128, 3 at 64 with the (hi, lo) K cache's tiles: the kernel's __launch_bounds__),
    so registers never cut occupancy."""
    cfg = preset(name)
    (spec,) = (s for s in registry.prefill_specs(cfg) if s.key == "prefill_attention")
    regs = registry.compile_specs([spec], cfg)[ATTENTION].resources()[spec.expression].registers
    by_smem = SMEM_PER_SM // (spec.smem + SMEM_CTA_RESERVE)
    per_cta = -(-regs // REG_GRANULE) * REG_GRANULE * spec.threads
    assert by_smem == (2 if cfg.head_dim == 128 else 3)
    assert REGS_PER_SM // per_cta >= by_smem, f"{regs} registers allow fewer than {by_smem} CTAs"


def _swizzled(r: int, c: int) -> int:
    """prefill_attention.cu tile_chunk(r, c): block c / 8, row r, chunk (c % 8) ^ (r & 7)."""
    return (c // 8) * 64 * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4)


def _kv_offset(page: int, head: int, t: int, d: int, heads: int, head_dim: int) -> int:
    """kv_cache.cuh kv_offset (tests/test_kv_layout.py checks it against the host layout)."""
    return ((page * heads + head) * PAGE_TOKENS + t) * head_dim + ((d // 8) ^ (t % 8)) * 8 + d % 8


def _copies_per_row(pages, head, key0, n_keys, heads, d, tile, threads):
    """A K tile's copies computed row by row from the key: {shared offset: (source offset or
    None for a zero-filled row, bytes)}."""
    chunks, out = d // 8, {}
    for u in range(tile * chunks):
        row, c = u // chunks, u % chunks
        key = key0 + row
        live = key < n_keys
        src = _kv_offset(pages[key // PAGE_TOKENS], head, key % PAGE_TOKENS, c * 8, heads, d)
        out[_swizzled(row, c)] = (src if live else None, 16 if live else 0)
    return out


def _copies_by_thread(pages, head, key0, n_keys, heads, d, tile, threads):
    """The same copies as KvTileCopy<D> issues them: per thread, in-page pointers and a shared
    offset fixed at construction, the tile's page ids from fetch_pages, one multiply-add each."""
    chunks = d // 8
    step = threads // chunks
    per_page, copies = PAGE_TOKENS // step, tile // step
    page_elems = _kv_offset(1, 0, 0, 0, heads, d)
    pg = [pages[key0 // PAGE_TOKENS + j] if key0 + j * PAGE_TOKENS < n_keys else 0
          for j in range(tile // PAGE_TOKENS)]  # fmt: skip
    out = {}
    for tid in range(threads):
        r0, c = tid // chunks, tid % chunks
        src = [_kv_offset(0, head, r0 + j * step, c * 8, heads, d) for j in range(per_page)]
        for i in range(copies):
            live = r0 + i * step < n_keys - key0
            at = src[i % per_page] + pg[i // per_page] * page_elems
            dst = _swizzled(r0, c) + i * step * 128
            assert dst not in out, f"thread {tid} copy {i} lands on another copy's chunk"
            out[dst] = (at if live else None, 16 if live else 0)
    return out


@pytest.mark.parametrize("d", [64, 128])
def test_kv_tile_copy_index_math(d):
    """KvTileCopy's hoisted addresses (page ids a tile ahead, in-page pointers and shared
    offsets fixed per thread) copy exactly what the key-by-key formula copies, on a scattered
    page table, at full tiles, a part tile and a tile with one live key."""
    g = registry.DEFAULT_GEOMETRY
    tile, threads, heads = g.prefill_attn_tile, g.prefill_attn_threads, 3
    rng = np.random.default_rng()
    for key0, live in ((0, 64), (64, 64), (4096, 37), (128, 1), (192, 16), (256, 17)):
        n_keys = key0 + live
        pages = rng.permutation(n_keys // PAGE_TOKENS + 8).tolist()
        head = int(rng.integers(heads))
        args = (pages, head, key0, n_keys, heads, d, tile, threads)
        assert _copies_by_thread(*args) == _copies_per_row(*args), (key0, live)
