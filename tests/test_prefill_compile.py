"""Prefill kernels on the CPU: they compile with NVRTC for sm_90a (7b, 1.5b and tiny) through
nanoqwen.cuda.jit, use tensor cores (mma.sync, and wgmma with setmaxnreg in
prefill_gemm_wgmma.cu) and spill nothing; the GEMMs' register dequantization, K permutation and
(wgmma) swizzled shared-memory layout, A fragments and epilogue mapping, emulated in numpy lane
by lane, reproduce A @ dequant(W)^T; pick_gemm prefers wgmma and falls back to mma.sync."""

import numpy as np
import pytest

from nanoqwen.config import preset
from nanoqwen.prefill import (
    ATTENTION_SOURCE,
    GEMM_SOURCE,
    GEMM_VARIANTS,
    MMA_VARIANTS,
    WGMMA_SOURCE,
    WGMMA_VARIANTS,
    PrefillKernels,
    attention_smem_bytes,
    prefill_kernels,
)
from nanoqwen.quant import dequantize_packed, pack_value_shuffle, quantize_pack

pytest.importorskip("cuda.bindings.nvrtc")
jit = pytest.importorskip("nanoqwen.cuda.jit")

SMEM_LIMIT = 227 * 1024  # Hopper: largest dynamic shared memory one CTA may opt into


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOQWEN_NO_COMPILE", raising=False)


def _ptx(source_name: str, names: list[str], cfg) -> str:
    """The PTX of a module, through jit's NANOQWEN_DUMP_PTX switch."""
    import os

    os.environ["NANOQWEN_DUMP_PTX"] = names[0]
    try:
        jit.compile_module(source_name, names, cfg)
    finally:
        del os.environ["NANOQWEN_DUMP_PTX"]
    (path,) = jit.cache_dir().glob(f"{source_name.split('.')[0]}-*.ptx")
    return path.read_text(errors="replace")


@pytest.mark.parametrize("name", ["7b", "1.5b", "tiny"])
def test_prefill_kernels_compile_without_spills(name):
    cfg = preset(name)
    for source, names in prefill_kernels(cfg).items():
        res = jit.compile_module(source, names, cfg).resources()
        assert set(res) == set(names), f"{source}: ptxas reported {sorted(res)}"
        for kernel, r in res.items():
            assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{kernel} uses local memory: {r}"
            assert r.registers <= 255, f"{kernel}: {r.registers} registers"
    assert all(v.smem_bytes <= SMEM_LIMIT for v in GEMM_VARIANTS)
    assert attention_smem_bytes(cfg.head_dim) <= SMEM_LIMIT


def test_wgmma_kernel_ptxas_report():
    """setmaxnreg honoured (no C7508), wgmma not serialized by ptxas (no C7515-style
    advisory), every instantiation of the table and the --extra candidates spill-free."""
    cfg = preset("7b")
    names = sorted({v.name for v in WGMMA_VARIANTS})
    names += ["prefill_gemm_wgmma<128, 8, false>", "prefill_gemm_wgmma<256, 5, true>"]
    mod = jit.compile_module(WGMMA_SOURCE, names, cfg)
    for kernel, r in mod.resources().items():
        assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{kernel} uses local memory: {r}"
    log = mod.log.lower()
    assert "c7508" not in log and "setmaxnreg" not in log, mod.log
    assert "serializ" not in log and "performance loss" not in log, mod.log


def test_kernels_use_tensor_cores():
    cfg = preset("tiny")
    table = prefill_kernels(cfg)
    gemm = _ptx(GEMM_SOURCE, table[GEMM_SOURCE], cfg)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in gemm
    assert "cp.async.cg.shared.global" in gemm
    wg = _ptx(WGMMA_SOURCE, table[WGMMA_SOURCE], cfg)
    for bt in sorted({v.bm for v in WGMMA_VARIANTS}):
        assert f"wgmma.mma_async.sync.aligned.m64n{bt}k16.f32.f16.f16" in wg
    for needle in (
        "setmaxnreg.dec.sync.aligned.u32 40",
        "setmaxnreg.inc.sync.aligned.u32 232",
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
        "wgmma.wait_group.sync.aligned 1",
    ):
        assert needle in wg, needle
    attn = _ptx(ATTENTION_SOURCE, table[ATTENTION_SOURCE], cfg)
    d = cfg.head_dim  # S = Q K^T from shared memory; O += P V with P in registers, V N-major
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in attn
    assert f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16" in attn


@pytest.mark.parametrize("name", ["7b", "0.5b"])
def test_attention_wgmma_not_serialized(name):
    """ptxas keeps the attention's wgmma asynchronous (no C7514-style advisory) at both head
    dims the kernel takes (128 and 64)."""
    cfg = preset(name)
    mod = jit.compile_module(ATTENTION_SOURCE, prefill_kernels(cfg)[ATTENTION_SOURCE], cfg)
    log = mod.log.lower()
    assert "serializ" not in log and "performance loss" not in log, mod.log


# -- numpy emulation of prefill_gemm.cu's fragment assembly ----------------------------------
def _halves(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)


def _word(lo, hi) -> int:
    h = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint32)
    return int(h[0] | (h[1] << 16))


def _op(a, b, c=None, kind="mul"):
    x, y = _halves(a).astype(np.float32), _halves(b).astype(np.float32)
    r = {"mul": x * y, "sub": x - y, "fma": x * y + (0 if c is None else _halves(c))}[kind]
    return _word(*r.astype(np.float16))  # one fp16 rounding, as the f16x2 instructions


def _dequant_word(w: int, scale2: int) -> list[int]:
    """prefill_gemm.cu dequant_word: magic-number int4 -> fp16 pairs, times the scale."""
    p0, p1 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    w >>= 8
    p2, p3 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    lo = [_op(p, 0x64086408, kind="sub") for p in (p0, p2)]
    hi = [_op(p, 0x2C002C00, 0xD480D480, kind="fma") for p in (p1, p3)]
    return [_op(x, scale2) for x in (lo[0], hi[0], lo[1], hi[1])]


def test_gemm_fragment_emulation_matches_matmul():
    rng = np.random.default_rng()
    m, n, k = 16, 8, 128  # one m16n8 mma tile over one 128-wide k-tile
    a = rng.standard_normal((m, k)).astype(np.float16)
    qweight, scales = quantize_pack(rng.standard_normal((n, k)).astype(np.float32))
    w16 = dequantize_packed(qweight, scales).astype(np.float16)  # the kernel rounds here too
    a_bits = a.view(np.uint16).astype(np.uint32)
    c = np.zeros((m, n), np.float32)
    for w in range(4):  # word w of each lane's 16-byte chunk
        for q in range(2):  # mma k-step within the word
            la, lb = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                cols = [32 * t + 8 * w + 2 * e for e in range(4)]
                lo = [int(a_bits[g, x] | (a_bits[g, x + 1] << 16)) for x in cols]
                hi = [int(a_bits[g + 8, x] | (a_bits[g + 8, x + 1] << 16)) for x in cols]
                regs = [lo[2 * q], hi[2 * q], lo[2 * q + 1], hi[2 * q + 1]]
                s = int(scales[g, 0].view(np.uint16))
                b = _dequant_word(int(qweight[g, 4 * t + w]), s | (s << 16))
                # PTX m16n8k16 fragment layouts: where each register's two halves live.
                la[g, 2 * t : 2 * t + 2] = _halves(regs[0])
                la[g + 8, 2 * t : 2 * t + 2] = _halves(regs[1])
                la[g, 2 * t + 8 : 2 * t + 10] = _halves(regs[2])
                la[g + 8, 2 * t + 8 : 2 * t + 10] = _halves(regs[3])
                lb[2 * t : 2 * t + 2, g] = _halves(b[2 * q])
                lb[2 * t + 8 : 2 * t + 10, g] = _halves(b[2 * q + 1])
            c += la @ lb
    ref = a.astype(np.float32) @ w16.astype(np.float32).T
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("value", range(-8, 8))
def test_dequant_magic_numbers_exact(value):
    q = np.full((1, 8), value, dtype=np.int8)
    q[0, 1::2] = -1 - value  # odd lanes: a different value in the high half-word
    word = int(pack_value_shuffle(q)[0, 0])
    one = 0x3C003C00  # fp16 1.0 in both halves: no scaling
    pairs = [_halves(p) for p in _dequant_word(word, one)]
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
        residual = rng.standard_normal((m, n)).astype(np.float16)
        ref = ref + bias.astype(np.float32) + residual.astype(np.float32)
        ref = ref[:, tile_n * 128 : (tile_n + 1) * 128]
        got = _emulate_wgmma_cta(a, qweight, scales, bt, tile_n, False, bias, residual)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


# -- tile choice (no GPU: the occupancy numbers are what the H200 reports) ----------------------
def _fake_kernels(variants, use_wgmma=True, num_sms=132):
    pk = PrefillKernels.__new__(PrefillKernels)
    pk.variants, pk.num_sms, pk.use_wgmma = tuple(variants), num_sms, use_wgmma
    pk._per_sm = {v: (1 if v.kind == "wgmma" else 2) for v in variants}
    return pk


@pytest.mark.parametrize("m", [1, 17, 512, 513, 4096])
def test_pick_gemm_prefers_wgmma_and_falls_back(m):
    cfg = preset("7b")
    shapes = [
        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False),
        (cfg.hidden_size, cfg.q_size, False),
        (2 * cfg.intermediate_size, cfg.hidden_size, True),
        (cfg.hidden_size, cfg.intermediate_size, False),
    ]
    on, off = _fake_kernels(GEMM_VARIANTS), _fake_kernels(GEMM_VARIANTS, use_wgmma=False)
    for n, k, swiglu in shapes:
        v = on.pick_gemm(m, n, swiglu, k)
        assert v.swiglu == swiglu and v.fits(n, k)
        if m in (512, 4096):  # whole waves of wgmma tiles: the tensor-core kernel wins
            assert v.kind == "wgmma"
        assert off.pick_gemm(m, n, swiglu, k) in MMA_VARIANTS
    mma_only = _fake_kernels(MMA_VARIANTS)
    assert mma_only.pick_gemm(m, 4608, False, 3584).kind == "mma"


def test_pick_gemm_takes_the_measured_winners():
    """At M = 512 on the 7B shapes the picker takes the tile prefill_check.py timed fastest
    (prefill.py's tile table) or one within 5% of it: 256 tokens for q/k/v, gate_up and down,
    256 for o (0.031 ms against 0.029 for 128); 128 for a short prompt (less padding)."""
    cfg = preset("7b")
    pk = _fake_kernels(GEMM_VARIANTS)
    for n, k, swiglu, bm in [
        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, False, 256),
        (cfg.hidden_size, cfg.q_size, False, 256),
        (2 * cfg.intermediate_size, cfg.hidden_size, True, 256),
        (cfg.hidden_size, cfg.intermediate_size, False, 256),
    ]:
        v = pk.pick_gemm(512, n, swiglu, k)
        assert (v.kind, v.bm) == ("wgmma", bm), (n, k, v.label)
        assert pk.pick_gemm(17, n, swiglu, k).bm == 128


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


def test_wgmma_smem_formula():
    """prefill.py's smem_bytes is the kernel's smem_bytes<BT, STAGES, SWIGLU>() (static_asserts
    appended to the source must compile), within one CTA's limit."""
    text = (jit.KERNEL_DIR / WGMMA_SOURCE).read_text()
    for v in WGMMA_VARIANTS:
        args = f"{v.bm}, {v.stages}, {'true' if v.swiglu else 'false'}"
        text += (
            f'static_assert(nanoqwen_wgmma::smem_bytes<{args}>() == {v.smem_bytes}, "{v.label}");\n'
        )
        assert v.smem_bytes <= SMEM_LIMIT and v.threads == 384 and v.bn == 128
    jit.compile_module(WGMMA_SOURCE, [], preset("7b"), source=text)
