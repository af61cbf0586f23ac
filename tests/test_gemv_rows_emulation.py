"""gemv_rows.cu's index math emulated in numpy (no GPU): the producer's copies (bulk copies,
TMA boxes, the scales' cp.async) into a stage's bytes, the swizzled x, each lane's A / B
fragments of mma.m16n8k16, the scales' offsets, the groups' rotation over the warps, the stage
reduction, the cluster's K slices and the epilogue's items, on small awkward shapes; the
result must be the dequantized weights' product.

The emulation follows the kernel statement by statement (names as there); it checks the
layout arithmetic, not the hardware: a mismatch here is an indexing bug in one of the two.
"""

from __future__ import annotations

import numpy as np
import pytest

from nanoqwen.config import GROUP_SIZE
from nanoqwen.cuda import registry
from nanoqwen.quant import dequantize_packed

C, P, HEAD_DIM = 16, registry.ROWS_STAGE_PAIRS, 64  # consumer warps, pairs a stage
ROPE, RESIDUAL, SWIGLU = (registry.Epilogue.ROPE, registry.Epilogue.RESIDUAL,
                          registry.Epilogue.SWIGLU)  # fmt: skip


def shape(k: int, s: int) -> dict[str, int]:
    """MrShape<K, MT, S>'s byte counts."""
    g = k // GROUP_SIZE
    gs = -(-g // s)
    row = k // 2 if s == 1 else gs * 64
    sc_row = ((gs + 2) * 2 + 15) // 16 * 16
    scales = (P * g * 2 + 28 + 15) // 16 * 16 if s == 1 else P * sc_row
    stage = (2 * P * row + 2 * scales + 127) // 128 * 128
    assert stage == registry.rows_stage_bytes(k, s)
    return {"G": g, "GS": gs, "kRow": row, "kRun": P * row, "kScRow": sc_row, "kScales": scales,
            "kStage": stage}  # fmt: skip


def nibbles(words: np.ndarray) -> np.ndarray:
    """dequant_word's values of 32-bit words [...]: [..., 8] in pair order (nibbles 0, 4, 1, 5,
    2, 6, 3, 7; each the signed two's-complement nibble)."""
    order = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    nib = (words[..., None].astype(np.int64) >> (4 * order)) & 0xF
    return ((nib ^ 8) - 8).astype(np.float64)


def xr_unit(r, u):
    return u ^ ((u >> 3) & 1) ^ ((r & 1) << 1)


def emulate(words, scales, x, n, epi, mt, s, ncl):
    """out[r, row] = the sums of gemv_rows's epilogue for every weight row (kRope: rows a and
    b written raw), from clusters of s ranks, ncl clusters."""
    m, k = x.shape
    sh = shape(k, s)
    g_all, gs_max = sh["G"], sh["GS"]
    wbytes = np.concatenate([words.reshape(-1).view(np.uint8), np.zeros(16, np.uint8)])
    sbytes = np.concatenate([scales.reshape(-1).view(np.uint8), np.zeros(16, np.uint8)])
    pairs = n if epi == SWIGLU else (n + 1) // 2
    half_n = (n + 1) // 2
    rows_total = 2 * n if epi == SWIGLU else n
    out = np.full((m, rows_total), np.nan)

    def row_a(p):
        return p // (HEAD_DIM // 2) * HEAD_DIM + p % (HEAD_DIM // 2) if epi == ROPE else p

    def row_b(p):
        if epi == ROPE:
            return row_a(p) + HEAD_DIM // 2
        return p + (n if epi == SWIGLU else half_n)

    rng = np.random.default_rng(1)  # stale shared memory: random bytes (NaN in unused lanes)
    for cl in range(ncl):
        p0, p1 = cl * pairs // ncl, (cl + 1) * pairs // ncl
        npairs = p1 - p0
        sums = []
        for rank in range(s):
            g0 = rank * g_all // s
            gs = (rank + 1) * g_all // s - g0
            xs = rng.integers(0, 255, (mt * gs_max * 16, 16)).astype(np.uint8)  # stale bytes
            for r in range(m):
                for u in range(gs * 16):
                    e = g0 * GROUP_SIZE + u * 8
                    xs[r * gs_max * 16 + xr_unit(r, u)] = x[r, e : e + 8].view(np.uint8)
            xh = xs.view(np.float16).astype(np.float64)  # [units, 8]
            sm = np.zeros((npairs, 2, mt))
            p, i = p0, 0
            while p < p1:
                np_ = min(P, p1 - p)
                if epi == ROPE:
                    np_ = min(np_, HEAD_DIM // 2 - p % (HEAD_DIM // 2))
                st = rng.integers(0, 255, sh["kStage"]).astype(np.uint8)
                for lane in range(4 if s == 1 else 0):  # the producer's bulk copies
                    run = lane & 1
                    r0 = row_b(p) if run else row_a(p)
                    rows = max(0, min(np_, rows_total - r0))
                    if lane < 2:
                        src, dst, nb, from_ = (
                            r0 * (k // 2),
                            run * sh["kRun"],
                            rows * (k // 2),
                            wbytes,
                        )
                    else:
                        e0 = (r0 * g_all) & ~7
                        src, dst = e0 * 2, 2 * sh["kRun"] + run * sh["kScales"]
                        nb = ((((r0 + rows) * g_all + 7) & ~7) - e0) * 2 if rows else 0
                        from_ = sbytes
                    assert src % 16 == 0 and dst % 16 == 0 and nb % 16 == 0
                    assert dst + nb <= sh["kStage"] and src + nb <= from_.size
                    st[dst : dst + nb] = from_[src : src + nb]
                if s > 1:  # two TMA boxes [8 rows][GS groups][64 bytes], zeros past the matrix
                    words3 = words.reshape(rows_total, g_all, 16)
                    for run, r0 in enumerate((row_a(p), row_b(p))):
                        box = np.zeros((8, gs_max, 16), np.uint32)
                        part = words3[r0 : r0 + 8, g0 : g0 + gs_max]
                        box[: part.shape[0], : part.shape[1]] = part
                        st[run * sh["kRun"] : (run + 1) * sh["kRun"]] = box.reshape(-1).view(
                            np.uint8
                        )
                    for rr in range(16):  # the scales' 4-byte cp.async, row by row
                        ra = row_a(p) if rr < 8 else row_b(p)
                        if rr % 8 >= max(0, min(np_, rows_total - ra)):
                            continue
                        e0 = ((ra + rr % 8) * g_all + g0) & ~1
                        units = ((ra + rr % 8) * g_all + g0 + gs + 1 - e0) // 2
                        dst = 2 * sh["kRun"] + rr * sh["kScRow"]
                        assert 4 * units <= sh["kScRow"] and e0 * 2 + 4 * units <= sbytes.size
                        st[dst : dst + 4 * units] = sbytes[e0 * 2 : e0 * 2 + 4 * units]
                sc = st[2 * sh["kRun"] :].view(np.float16).astype(np.float64)
                red = np.zeros((C, 16, mt))
                for warp in range(C):
                    acc = np.zeros((8, 4, mt // 8, 4))  # [g][t4][tt][c]
                    for j in range((warp + C - i % C) % C, gs, C):
                        for g in range(8):
                            if s == 1:
                                sa = (row_a(p) * g_all) % 8 + g * g_all
                                sb = sh["kScales"] // 2 + (row_b(p) * g_all) % 8 + g * g_all
                            else:
                                sa = g * sh["kScRow"] // 2 + ((row_a(p) + g) * g_all + g0) % 2
                                sb = (8 + g) * sh["kScRow"] // 2 + ((row_b(p) + g) * g_all + g0) % 2
                            fa, fb = sc[sa + j], sc[sb + j]
                            # The mma's D over the four lanes t4' of a row and column: row g
                            # (a) / g + 8 (b) is chunk t4' of the row's group j in the stage,
                            # column col the x units that lane (col % 8, t4') loads.
                            o = g * sh["kRow"] + j * 64
                            va = nibbles(st[o : o + 64].view(np.uint32)).reshape(4, 4, 8)
                            o += sh["kRun"]
                            vb = nibbles(st[o : o + 64].view(np.uint32)).reshape(4, 4, 8)
                            u = j * 16 + np.arange(16).reshape(4, 4)  # [t4', q]
                            cols = np.arange(mt)[:, None, None]
                            xu = xh[cols * gs_max * 16 + xr_unit(cols, u)]  # [mt, t4', q, 8]
                            d_a = np.einsum("tqe,ctqe->c", va, xu)
                            d_b = np.einsum("tqe,ctqe->c", vb, xu)
                            for t4 in range(4):
                                for tt in range(mt // 8):
                                    col = tt * 8 + 2 * t4
                                    acc[g, t4, tt, :2] += fa * d_a[col : col + 2]
                                    acc[g, t4, tt, 2:] += fb * d_b[col : col + 2]
                    for g in range(8):
                        for t4 in range(4):
                            for tt in range(mt // 8):
                                col = tt * 8 + 2 * t4
                                red[warp, g, col : col + 2] = acc[g, t4, tt, :2]
                                red[warp, g + 8, col : col + 2] = acc[g, t4, tt, 2:]
                for tid in range(16 * mt):
                    row, r = tid // mt, tid % mt
                    v = red.reshape(C, -1)[:, tid].sum()
                    if row % 8 < np_ and r < m:
                        sm[p - p0 + row % 8, row // 8, r] = v
                p += np_
                i += 1
            sums.append(sm)
        for rank in range(s):  # the epilogue's items: rank e % S, consumer thread tid
            for tid in range(C * 32):
                for e in range(rank + s * tid, npairs * m, s * C * 32):
                    i, r = e // m, e % m
                    da = sum(sums[q][i, 0, r] for q in range(s))
                    db = sum(sums[q][i, 1, r] for q in range(s))
                    p = p0 + i
                    assert np.isnan(out[r, row_a(p)])  # each item once
                    out[r, row_a(p)] = da
                    if row_b(p) < rows_total:
                        out[r, row_b(p)] = db
    return out


@pytest.mark.parametrize(
    "k_groups, n, epi, m, mt, s, ncl",
    [
        (7, 38, RESIDUAL, 3, 8, 1, 3),  # G < C warps; pairs not a multiple of 8
        (21, 22, SWIGLU, 8, 8, 1, 2),  # SwiGLU: gate p / up p
        (37, 30, RESIDUAL, 11, 16, 4, 2),  # uneven K slices, two token tiles
        (37, 20, SWIGLU, 16, 16, 8, 1),  # boxes past the last slice's end (zeros)
        (18, 3 * HEAD_DIM, ROPE, 5, 8, 2, 5),  # RoPE partners; stages end at head boundaries
    ],
)
def test_gemv_rows_emulated(k_groups, n, epi, m, mt, s, ncl):
    rng = np.random.default_rng(0)
    k = k_groups * GROUP_SIZE
    rows = 2 * n if epi == SWIGLU else n
    words = rng.integers(0, 2**32, (rows, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.5, 1.5, (rows, k // GROUP_SIZE)).astype(np.float16)
    x = rng.standard_normal((m, k)).astype(np.float16)
    ref = x.astype(np.float64) @ dequantize_packed(words, scales).astype(np.float64).T
    with np.errstate(invalid="ignore", over="ignore"):  # stale rows and columns, discarded
        got = emulate(words, scales, x, n, epi, mt, s, ncl)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
