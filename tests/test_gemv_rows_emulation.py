"""gemv_rows.cu's index math emulated in numpy (no GPU): the producer's copies (bulk copies,
TMA boxes, the scales' cp.async) into a stage's bytes, the swizzled x, each lane's A / B
fragments of mma.m16n8k16, the scales' offsets, the groups each warp takes, the stage
reduction, the epilogue of each stage's pairs at one slice, the K slices a CTA takes in turn (x
double-buffered, sums added slice after slice) and the epilogue's items after them, on small
awkward shapes; the result must be the dequantized weights' product. The same for down_proj's
split over K (gemv_rows_split's grid of row ranges x K slices, its sub-stages and teams, the
workspace layout, gemv_rows_split_sum's slice order).

The emulation follows the kernel statement by statement (names as there); it checks the
layout arithmetic, not the hardware: a mismatch here is an indexing bug in one of the two.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nanoqwen.config import GROUP_SIZE
from nanoqwen.cuda import registry
from nanoqwen.quant import dequantize_packed

C, P, HEAD_DIM = registry.DEFAULT_GEOMETRY.mr_consumers, registry.ROWS_STAGE_PAIRS, 64
ROPE, RESIDUAL, SWIGLU = (registry.Epilogue.ROPE, registry.Epilogue.RESIDUAL,
                          registry.Epilogue.SWIGLU)  # fmt: skip


def shape(k: int, s: int) -> dict[str, int]:
    """MrShape<K, MT, S>'s byte counts."""
    g = k // GROUP_SIZE
    gs = -(-g // s)
    row = k // 2 if s == 1 else gs * 64
    sc_row = ((gs + 2) * 2 + 15) // 16 * 16
    scales = (P * g * 2 + 28 + 15) // 16 * 16 if s == 1 else P * sc_row
    pad = 64 if s == 1 and row % 128 == 0 else 0
    stage = (2 * P * row + pad + 2 * scales + 127) // 128 * 128
    assert stage == registry.rows_stage_bytes(k, s) and pad == registry.rows_run_pad(k, s)
    return {"G": g, "GS": gs, "kRow": row, "kRun": P * row, "kPad": pad,
            "kRunB": P * row + pad, "kSc": 2 * P * row + pad, "kScRow": sc_row,
            "kScales": scales, "kStage": stage}  # fmt: skip


def nibbles(words: np.ndarray) -> np.ndarray:
    """dequant_word's values of 32-bit words [...]: [..., 8] in pair order (nibbles 0, 4, 1, 5,
    2, 6, 3, 7; each the signed two's-complement nibble)."""
    order = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    nib = (words[..., None].astype(np.int64) >> (4 * order)) & 0xF
    return ((nib ^ 8) - 8).astype(np.float64)


def xr_unit(r, u):
    return u ^ ((u >> 3) & 1) ^ ((r & 1) << 1)


def test_lane_x_units_are_xr_units():
    """group_mma's x index, 16 j + 4 t4 + (q ^ sw) past the lane's row (sw = bit 1 of t4 ^
    2 x (g & 1)), is xr_unit's swizzle of unit 16 j + 4 t4 + q of token row 8 tt + g."""
    for j, t4, q, g, tt in itertools.product(range(40), range(4), range(4), range(8), range(2)):
        sw = (t4 >> 1) ^ ((g & 1) << 1)
        assert 16 * j + 4 * t4 + (q ^ sw) == xr_unit(8 * tt + g, 16 * j + 4 * t4 + q)


def x_box_unit(mt, j, r, u):
    """S = 1: where the TMA box of group j (x_map: box (64, 2, MT), the 128-byte swizzle) puts
    unit u (0..15: elements 8 u ..) of token row r: line l = 2 r + u // 8 of the box at 16 MT j
    units, chunk u % 8 at (u % 8) ^ (l % 8)."""
    line = 2 * r + u // 8
    return 16 * mt * j + 8 * line + ((u % 8) ^ (line % 8))


def lane_xt(mt, lane, j, tt, q):
    """gemv_rows.cu's lane_xt(...)[16 MT j + 128 tt + (q ^ (lane_xt_sw(lane) & 3))]."""
    g, t4 = lane // 4, lane % 4
    sw = (2 * g + t4 // 2) & 7
    base = 8 * (2 * g + t4 // 2) + ((4 * (lane % 2)) ^ (sw & 4))
    return base + 16 * mt * j + 128 * tt + (q ^ (sw & 3))


@pytest.mark.parametrize("mt", [8, 16])
def test_lane_xt_reads_its_units_without_conflicts(mt):
    """S = 1: lane (g, t4)'s word q of group j, token tile tt is unit 4 t4 + q of token row
    8 tt + g as the TMA box placed it, and each quarter warp's LDS.128 (lanes 8 h .. 8 h + 7)
    reads 8 distinct bank quads (units mod 8)."""
    for j, tt, q in itertools.product(range(5), range(mt // 8), range(4)):
        for lane in range(32):
            r, u = 8 * tt + lane // 4, 4 * (lane % 4) + q
            assert lane_xt(mt, lane, j, tt, q) == x_box_unit(mt, j, r, u)
        for h in range(4):
            quads = {lane_xt(mt, lane, j, tt, q) % 8 for lane in range(8 * h, 8 * h + 8)}
            assert len(quads) == 8


class Emulation:
    """gemv_rows<K, MT, *, EPI, S, T> over words uint32 [R, K/8], scales fp16 [R, G], x fp16
    [M, K] (already normalized), N features, on `ncl` CTAs, the consumers in T `teams`.
    run() -> [M, R] float64: each row's epilogue sums (kRope's rows a and b written raw)."""

    def __init__(self, words, scales, x, n, epi, mt, s, ncl, teams=1):
        self.words, self.x, self.n, self.epi, self.mt, self.s, self.ncl = (
            words, x, n, epi, mt, s, ncl)  # fmt: skip
        self.teams = teams
        self.warps = C // teams  # the warps that split a stage's groups: its team's
        self.m, self.k = x.shape
        self.sh = shape(self.k, s)
        self.wbytes = np.concatenate([words.reshape(-1).view(np.uint8), np.zeros(16, np.uint8)])
        self.sbytes = np.concatenate([scales.reshape(-1).view(np.uint8), np.zeros(16, np.uint8)])
        self.pairs = n if epi == SWIGLU else (n + 1) // 2
        self.rows_total = 2 * n if epi == SWIGLU else n
        self.rng = np.random.default_rng(1)  # stale shared memory: random bytes (NaN, inf)

    def row_a(self, p):
        return p // (HEAD_DIM // 2) * HEAD_DIM + p % (HEAD_DIM // 2) if self.epi == ROPE else p

    def row_b(self, p):
        if self.epi == ROPE:
            return self.row_a(p) + HEAD_DIM // 2
        return p + (self.n if self.epi == SWIGLU else (self.n + 1) // 2)

    def run(self):
        """[M, R] the sums; self.parts [CTAs][M]: kResidual's sums of squares of what each CTA
        finished (its row of ss: each consumer thread's squares, then token row r's threads
        r, r + MT, ... in order), here of the raw sums."""
        out = np.full((self.m, self.rows_total), np.nan)
        self.parts = np.zeros((self.ncl, self.m))
        for cta in range(self.ncl):
            p0, p1 = cta * self.pairs // self.ncl, (cta + 1) * self.pairs // self.ncl
            self.sq = np.zeros(C * 32)  # a consumer thread's squares (token row tid % MT)
            self.cta(out, p0, p1)
            for r in range(self.m):
                self.parts[cta, r] = self.sq[r :: self.mt].sum()
        return out

    def cta(self, out, p0, p1):
        """One CTA: slice after slice, x of the slice staged into buffer s % 2, then the
        slice's stages over the CTA's pairs (i counts on across slices). One slice: stage i's
        team i % T sums it (its warps' groups), and its pairs are finished after the team's
        reduction (the team's thread kRt0 + j MT + r: pair j, token r); else the
        [npairs][2][MT] sums, then the epilogue."""
        sh, s_ = self.sh, self.s
        xbufs = [self.rng.integers(0, 255, (self.mt * sh["GS"] * 16, 16)).astype(np.uint8)
                 for _ in range(1 if s_ == 1 else 2)]  # fmt: skip
        sm = np.full((p1 - p0, 2, self.mt), np.nan) if s_ > 1 else None  # slice 0 writes it
        i = 0
        for s in range(s_):
            g0 = s * sh["G"] // s_
            gs = (s + 1) * sh["G"] // s_ - g0
            assert 1 <= gs <= sh["GS"] and (s_ == 1 or sh["GS"] <= registry.ROWS_SLICE_GROUPS)
            xs = xbufs[s % 2]
            for r in range(self.m if s_ > 1 else self.mt):  # S = 1: boxes of MT rows, zeros
                for u in range(gs * 16):  # past M
                    e = g0 * GROUP_SIZE + u * 8
                    if s_ == 1:
                        v = self.x[r, e : e + 8] if r < self.m else np.zeros(8, np.float16)
                        xs[x_box_unit(self.mt, u // 16, r, u % 16)] = v.view(np.uint8)
                    else:
                        xs[r * sh["GS"] * 16 + xr_unit(r, u)] = self.x[r, e : e + 8].view(np.uint8)
            xh = xs.view(np.float16).astype(np.float64)  # [units, 8]
            p = p0
            while p < p1:
                np_ = min(P, p1 - p)
                if self.epi == ROPE:
                    np_ = min(np_, HEAD_DIM // 2 - p % (HEAD_DIM // 2))
                st = self.stage(p, np_, g0, gs)
                cw = self.warps
                red = np.stack([self.warp_sums(st, xh, p, i, w, g0, gs) for w in range(cw)])
                red = red.reshape(cw, -1)
                t0 = i % self.teams * cw * 32  # the stage's team's first thread
                for rt in range(P * self.mt if s_ == 1 else 0):  # its last warps, in order
                    j, r = rt // self.mt, rt % self.mt
                    if j < np_ and r < self.m:
                        da, db = red[:, rt].sum(), red[:, P * self.mt + rt].sum()
                        self.finish(out, p + j, r, da, db, t0 + cw * 32 - P * self.mt + rt)
                for tid in range(16 * self.mt if s_ > 1 else 0):  # a thread a (row, token)
                    row, r = tid // self.mt, tid % self.mt
                    v = red[:, tid].sum()
                    if row % 8 < np_ and r < self.m:
                        idx = p - p0 + row % 8, row // 8, r
                        sm[idx] = v if s == 0 else sm[idx] + v
                p += np_
                i += 1
        if s_ > 1:
            self.epilogue(out, sm, p0, p1 - p0)

    def stage(self, p, np_, g0, gs):
        """The stage's bytes after the producer's copies (stale bytes elsewhere)."""
        sh, k = self.sh, self.k
        st = self.rng.integers(0, 255, sh["kStage"]).astype(np.uint8)
        for lane in range(4 if self.s == 1 else 0):  # bulk copies: runs, then their scales
            run = lane & 1
            r0 = self.row_b(p) if run else self.row_a(p)
            rows = max(0, min(np_, self.rows_total - r0))
            if lane < 2:
                src, dst, nb, from_ = r0 * (k // 2), run * sh["kRunB"], rows * (k // 2), self.wbytes
            else:
                e0 = (r0 * sh["G"]) & ~7
                src, dst = e0 * 2, sh["kSc"] + run * sh["kScales"]
                nb = ((((r0 + rows) * sh["G"] + 7) & ~7) - e0) * 2 if rows else 0
                from_ = self.sbytes
            assert src % 16 == 0 and dst % 16 == 0 and nb % 16 == 0
            assert dst + nb <= sh["kStage"] and src + nb <= from_.size
            st[dst : dst + nb] = from_[src : src + nb]
        if self.s > 1:  # two TMA boxes [8 rows][GS x 16 words] at word g0 x 16, zeros past
            for run, r0 in enumerate((self.row_a(p), self.row_b(p))):  # the matrix
                box = np.zeros((8, sh["GS"] * 16), np.uint32)
                part = self.words[r0 : r0 + 8, g0 * 16 : (g0 + sh["GS"]) * 16]
                box[: part.shape[0], : part.shape[1]] = part
                o = run * sh["kRunB"]
                st[o : o + sh["kRun"]] = box.reshape(-1).view(np.uint8)
            for rr in range(16):  # the scales' 4-byte cp.async, row by row
                ra = self.row_a(p) if rr < 8 else self.row_b(p)
                if rr % 8 >= max(0, min(np_, self.rows_total - ra)):
                    continue
                first = (ra + rr % 8) * sh["G"] + g0
                e0 = first & ~1
                units = (first + gs + 1 - e0) // 2
                dst = sh["kSc"] + rr * sh["kScRow"]
                assert 4 * units <= sh["kScRow"] and e0 * 2 + 4 * units <= self.sbytes.size
                st[dst : dst + 4 * units] = self.sbytes[e0 * 2 : e0 * 2 + 4 * units]
        return st

    def warp_sums(self, st, xh, p, i, warp, g0, gs):
        """Warp `warp`'s [16 rows][MT] sums of stage i, as its lanes store them into red."""
        sh, mt = self.sh, self.mt
        sc = st[sh["kSc"] :].view(np.float16).astype(np.float64)
        acc = np.zeros((8, 4, mt // 8, 4))  # lane (g, t4): [tt][c]
        c = self.warps  # S = 1: the same groups every stage; S > 1 rotated by the stage
        for j in range(warp if self.s == 1 else (warp + c - i % c) % c, gs, c):
            for g in range(8):
                if self.s == 1:
                    sa = (self.row_a(p) * sh["G"]) % 8 + g * sh["G"]
                    sb = sh["kScales"] // 2 + (self.row_b(p) * sh["G"]) % 8 + g * sh["G"]
                else:
                    sa = g * sh["kScRow"] // 2 + ((self.row_a(p) + g) * sh["G"] + g0) % 2
                    sb = (8 + g) * sh["kScRow"] // 2 + ((self.row_b(p) + g) * sh["G"] + g0) % 2
                # Lane g's A rows g and g + 8: row g of run a and of run b, swapped in odd
                # lanes where the runs are padded.
                odd = g % 2 if sh["kPad"] else 0
                f1, f2 = (sc[sb + j], sc[sa + j]) if odd else (sc[sa + j], sc[sb + j])
                # The mma's D over the four lanes t4' of a row and a column: A row g / g + 8
                # is chunk t4' of the row's group j in the stage, column col the x units that
                # lane (col % 8, t4') loads.
                o = odd * sh["kRunB"] + g * sh["kRow"] + j * 64
                v1 = nibbles(st[o : o + 64].view(np.uint32)).reshape(4, 4, 8)
                o = (1 - odd) * sh["kRunB"] + g * sh["kRow"] + j * 64
                v2 = nibbles(st[o : o + 64].view(np.uint32)).reshape(4, 4, 8)
                u = j * 16 + np.arange(16).reshape(4, 4)  # [t4', q]
                cols = np.arange(mt)[:, None, None]
                if self.s == 1:  # lane (col % 8, t4')'s word q of token tile col // 8
                    lanes = 4 * (cols % 8) + np.arange(4)[:, None]
                    q = np.arange(4)
                    xu = xh[lane_xt(mt, lanes, j, cols // 8, q)]  # [mt, t4', q, 8]
                else:
                    xu = xh[cols * sh["GS"] * 16 + xr_unit(cols, u)]  # [mt, t4', q, 8]
                d1 = np.einsum("tqe,ctqe->c", v1, xu)
                d2 = np.einsum("tqe,ctqe->c", v2, xu)
                for t4 in range(4):
                    for tt in range(mt // 8):
                        col = tt * 8 + 2 * t4
                        acc[g, t4, tt, :2] += f1 * d1[col : col + 2]
                        acc[g, t4, tt, 2:] += f2 * d2[col : col + 2]
        red = np.zeros((16, mt))
        for g in range(8):
            odd = g % 2 if sh["kPad"] else 0
            for t4 in range(4):
                for tt in range(mt // 8):
                    col = tt * 8 + 2 * t4
                    a, b = acc[g, t4, tt, :2], acc[g, t4, tt, 2:]
                    red[g, col : col + 2] = b if odd else a
                    red[g + 8, col : col + 2] = a if odd else b
        return red

    def epilogue(self, out, sums, p0, npairs):
        """Item e (token e % MT of pair p0 + e / MT, rows past M skipped) on consumer thread
        e % (C x 32): a thread keeps one token row, tid % MT."""
        mt = self.mt
        for tid in range(C * 32):
            for e in range(tid, npairs * mt, C * 32):
                i, r = e // mt, e % mt
                assert r == tid % mt
                if r < self.m:
                    self.finish(out, p0 + i, r, sums[i, 0, r], sums[i, 1, r], tid)

    def finish(self, out, p, r, da, db, tid):
        """The epilogue of pair p, token r (its rows' sums written raw) on consumer thread
        tid, each item once; kResidual's squares into the thread's."""
        assert np.isnan(out[r, self.row_a(p)]) and r == tid % self.mt
        out[r, self.row_a(p)] = da
        self.sq[tid] += da * da
        if self.row_b(p) < self.rows_total:
            out[r, self.row_b(p)] = db
            self.sq[tid] += db * db


@pytest.mark.parametrize(
    "k_groups, n, epi, m, mt, s, ncl, teams",
    [
        (7, 38, RESIDUAL, 3, 8, 1, 3, 1),  # G < C warps; pairs not a multiple of 8
        (21, 22, SWIGLU, 8, 8, 1, 2, 1),  # SwiGLU: gate p / up p
        (28, 38, SWIGLU, 5, 8, 1, 3, 1),  # the 7B's hidden size: rows of 128-byte multiples,
        # runs padded (kPad) and swapped in odd lanes
        (28, 70, SWIGLU, 8, 8, 1, 2, 2),  # the 7B's gate/up in two teams (5 stages a CTA)
        (12, 45, SWIGLU, 7, 8, 1, 3, 2),  # the 1.5B's: teams' last warps one group short
        (7, 38, RESIDUAL, 3, 8, 1, 3, 2),  # teams with G < their warps
        (6, 3 * HEAD_DIM, ROPE, 9, 16, 1, 4, 1),  # padded runs with RoPE, two token tiles
        (37, 30, RESIDUAL, 11, 16, 3, 2, 1),  # uneven K slices (12, 12, 13), two token tiles
        (37, 20, SWIGLU, 16, 16, 5, 1, 1),  # boxes past a shorter slice's end (the matrix's)
        (18, 3 * HEAD_DIM, ROPE, 5, 8, 2, 5, 1),  # RoPE partners; stages end at head boundaries
        (148, 26, RESIDUAL, 8, 8, 10, 2, 1),  # the 7B's down_proj K: 10 slices, x buffers reused
    ],
)
def test_gemv_rows_emulated(k_groups, n, epi, m, mt, s, ncl, teams):
    rng = np.random.default_rng(0)
    k = k_groups * GROUP_SIZE
    rows = 2 * n if epi == SWIGLU else n
    words = rng.integers(0, 2**32, (rows, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.5, 1.5, (rows, k // GROUP_SIZE)).astype(np.float16)
    x = rng.standard_normal((m, k)).astype(np.float16)
    ref = x.astype(np.float64) @ dequantize_packed(words, scales).astype(np.float64).T
    emu = Emulation(words, scales, x, n, epi, mt, s, ncl, teams)
    with np.errstate(invalid="ignore", over="ignore"):  # stale rows and columns, discarded
        got = emu.run()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    # the RMSNorm hand-off: the CTAs' rows of sums of squares add up to each token row's
    np.testing.assert_allclose(emu.parts.sum(axis=0), (got**2).sum(axis=1), rtol=1e-12)


# -- gemv_rows_split + gemv_rows_split_sum ------------------------------------------------------
SUB = registry.DEFAULT_GEOMETRY.mr_split_sub  # kMrSplitSub: 16-row sub-stages a stage
K_ROWS = 16 * SUB  # SplitShape::kRows


class SplitEmulation(Emulation):
    """gemv_rows_split<K, MT, S> on a (ranges x S) grid, then gemv_rows_split_sum, over a
    residual. A sub-stage is gemv_rows' S > 1 stage with run a = rows p .. p + 7 and run b =
    p + 8 .. p + 15 (Emulation.stage with those rows), its groups split over one team's
    C / kMrSplitSub warps."""

    def __init__(self, *args):
        super().__init__(*args)
        self.warps = registry.DEFAULT_GEOMETRY.mr_split_consumers // SUB  # a team's

    def row_a(self, p):
        return p

    def row_b(self, p):
        return p + 8

    def run_split(self, ranges):
        """part fp32 [S][Npad][MT] as the CTAs store it (NaN where nothing is stored)."""
        sh, n, mt = self.sh, self.n, self.mt
        blocks = -(-n // K_ROWS)
        part = np.full(self.s * blocks * K_ROWS * mt, np.nan)
        for split in range(self.s):
            g0 = split * sh["G"] // self.s
            gs = (split + 1) * sh["G"] // self.s - g0
            assert 1 <= gs <= sh["GS"] <= registry.ROWS_SLICE_GROUPS
            for b in range(ranges):
                b0, b1 = b * blocks // ranges, (b + 1) * blocks // ranges
                xs = self.rng.integers(0, 255, (mt * sh["GS"] * 16, 16)).astype(np.uint8)
                for r in range(self.m):
                    for u in range(gs * 16):
                        e = g0 * GROUP_SIZE + u * 8
                        xs[r * sh["GS"] * 16 + xr_unit(r, u)] = self.x[r, e : e + 8].view(np.uint8)
                xh = xs.view(np.float16).astype(np.float64)
                dst = (split * blocks + b0) * K_ROWS * mt
                for i in range(b1 - b0):
                    reds = []
                    for team in range(SUB):
                        p = (b0 + i) * K_ROWS + team * 16
                        st = self.stage(p, 8, g0, gs)
                        reds += [self.warp_sums(st, xh, p, i, w, g0, gs) for w in range(self.warps)]
                    rb = np.stack(reds).reshape(-1)  # [C][16][MT]
                    for e in range(K_ROWS * mt):
                        src = (e // (16 * mt)) * self.warps * 16 * mt + e % (16 * mt)
                        v = 0.0
                        for ww in range(self.warps):
                            v += rb[src + ww * 16 * mt]
                        at = dst + i * K_ROWS * mt + e
                        assert np.isnan(part[at])  # each sum stored once
                        part[at] = v
        return part

    def run_sum(self, part, resid):
        """gemv_rows_split_sum's threads over part (flat) and the residual [M, N]; self.parts
        [CTAs][M] its CTAs' rows of ss (thread u's squares of token quad u % Q, component c,
        summed for token row 4 (u % Q) + c in thread order)."""
        n, m, q = self.n, self.m, self.mt // 4
        npad = -(-n // K_ROWS) * K_ROWS
        threads = registry.DEFAULT_GEOMETRY.mr_sum_threads
        ctas = -(-npad * q // threads)
        sq = np.zeros((ctas, 4, threads))
        out = resid.astype(np.float64).copy()
        for t in range(npad * q):
            nn, r0 = t // q, 4 * (t % q)
            if nn >= n or r0 >= m:
                continue
            acc = np.zeros(4)
            for s in range(self.s):
                acc += part[(t + s * npad * q) * 4 : (t + s * npad * q) * 4 + 4]
            for c in range(4):
                if r0 + c < m:
                    out[r0 + c, nn] += acc[c]
                    sq[t // threads, c, t % threads] = out[r0 + c, nn] ** 2
        self.parts = np.array([[sq[b, r % 4, r // 4 :: q].sum() for r in range(m)]
                               for b in range(ctas)])  # fmt: skip
        return out


@pytest.mark.parametrize(
    "k_groups, n, m, mt, s, ranges",
    [
        (37, 100, 3, 8, 3, 2),  # uneven slices (12, 12, 13); rows past N in the last stage
        (37, 64, 16, 16, 5, 1),  # boxes past a shorter slice's end (the matrix's), two tiles
        (148, 64, 9, 16, 10, 2),  # the 7B's down_proj K: 10 slices of 14-15 groups
    ],
)
def test_gemv_rows_split_emulated(k_groups, n, m, mt, s, ranges):
    rng = np.random.default_rng(0)
    k = k_groups * GROUP_SIZE
    words = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.5, 1.5, (n, k // GROUP_SIZE)).astype(np.float16)
    x = rng.standard_normal((m, k)).astype(np.float16)
    resid = rng.standard_normal((m, n)).astype(np.float16)
    ref = resid + x.astype(np.float64) @ dequantize_packed(words, scales).astype(np.float64).T
    emu = SplitEmulation(words, scales, x, n, RESIDUAL, mt, s, 1)
    with np.errstate(invalid="ignore", over="ignore"):  # stale rows and columns, discarded
        got = emu.run_sum(emu.run_split(ranges), resid)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
    np.testing.assert_allclose(emu.parts.sum(axis=0), (got**2).sum(axis=1), rtol=1e-12)
