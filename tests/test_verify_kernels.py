"""CPU (no GPU): the multi-row step's kernels (registry.verify_specs: attn_rows, lm_head_rows)
compile for every preset without spills and fit their shared memory, the launcher refuses bad
row counts, and a float64 emulation of attn_rows' work split (clusters, tile groups, ranks,
page groups, the causal mask inside the block, the three merges) matches the reference: what
the GPU script (dev/attn_rows.py) cannot show about the index math without a GPU."""

import numpy as np
import pytest

from nanoqwen.config import PAGE_TOKENS, PRESETS, preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.decode import check_rows
from nanoqwen.errors import NanoqwenError

SMEM_PER_BLOCK = 227 * 1024  # sm_90's opt-in maximum of dynamic + static shared memory


@pytest.fixture(autouse=True)
def _cache(kernel_cache):
    return kernel_cache


@pytest.mark.parametrize("name", ["0.5b", "7b", "32b"])
def test_verify_specs_compile_and_fit(name):
    pytest.importorskip("cuda.bindings.nvrtc")
    cfg = preset(name)
    specs = registry.verify_specs(cfg)
    res = {}
    for mod in registry.compile_specs(specs, cfg).values():
        res.update(mod.resources())
    for s in specs:
        r = res[s.expression]
        assert r.spill_bytes == 0 and r.registers <= 65536 // s.threads, (s.key, r)
        assert s.smem + r.smem_bytes <= SMEM_PER_BLOCK, (s.key, s.smem, r.smem_bytes)


@pytest.mark.parametrize("name", list(PRESETS))
def test_lm_head_rows_ring(name):
    """Two stages beside x at the most rows (VerifyKernels refuses less); 7B: 10 / 6."""
    cfg = preset(name)
    assert registry.lmr_stages(cfg, registry.DEFAULT_GEOMETRY.verify_rows) >= 2
    if name == "7b":
        assert (registry.lmr_stages(cfg, 8), registry.lmr_stages(cfg, 16)) == (10, 6)


def test_mattn_smem_7b():
    """Ring 8 pages x 12 KB (K's hi and lo, V), inbox C ranks x 112 rows x 128 / C columns
    fp32, (m, l) C x 112; with the plain fp16 K cache 16 pages x 8 KB. Either form takes one
    CTA an SM (dev/cluster_occupancy.cu: why the long form exists)."""
    cfg, plain = preset("7b"), registry.k_cache_geometry("fp16")
    for c in (8, 2):
        inbox = c * 112 * (128 // c) * 4 + c * 112 * 8
        assert registry.mattn_smem_bytes(cfg, c) == 8 * 12288 + inbox
        assert registry.mattn_smem_bytes(cfg, c, plain) == 16 * 8192 + inbox
        assert registry.mattn_smem_bytes(cfg, c) > SMEM_PER_BLOCK // 2


@pytest.mark.parametrize("name", list(PRESETS))
def test_mattn_long_pages(name):
    """The long form from the first page count where the short form's working clusters (n_kv x
    ncl, one tile group) pass what the GPU holds at once: the H200's 15 clusters of 8 one-SM
    CTAs put the 7B's switch at 193 pages (3072 tokens); a GPU that holds every cluster never
    switches. The tile groups of shorter contexts use at most half the grid's clusters."""
    cfg, g = preset(name), registry.DEFAULT_GEOMETRY
    c, mp, n_kv = g.mattn_cluster, g.mattn_min_pages, cfg.num_kv_heads
    per_head = min(g.mattn_splits, g.attn_ctas // n_kv)
    splits = max(c, per_head // c * c)  # VerifyKernels.attn_splits

    def working(pages: int) -> int:
        return n_kv * min(splits // c, -(-pages // (c * mp)))

    assert registry.mattn_long_pages(cfg, splits, n_kv * splits // c) == registry.MATTN_NEVER_LONG
    for fits in (15, 30, n_kv, n_kv * splits // c - 1):
        first = registry.mattn_long_pages(cfg, splits, fits)
        if first == registry.MATTN_NEVER_LONG:
            assert working(1 << 20) <= fits
            continue
        assert working(first - 1) <= fits < working(first)
    assert n_kv * (splits // c) // 2 <= 8  # tile groups' clusters: one wave on the H200's 15
    if name == "7b":
        assert splits == 32 and registry.mattn_long_pages(cfg, splits, 15) == 193
    assert registry.mattn_long_pages(cfg, splits, 0) == 1  # no cluster of 8 fits: always long


@pytest.mark.parametrize("m", [0, -1, 17])
def test_bad_row_counts_raise(m):
    """The multi-row kernels' one row check (attention_rows, lm_head_rows, the GEMVs)."""
    with pytest.raises(NanoqwenError, match="1..16"):
        check_rows(m, "attention_rows")
    assert check_rows(16, "x") == 16 and check_rows(1, "x") == 1


@pytest.mark.parametrize("name", list(PRESETS))
def test_down_path_and_its_workspace(name):
    """down_proj's path by rows: DOWN_SLICED (the split over K) wherever gemv_rows would take
    DOWN_SLICED_MIN_SLICES K slices or more (every bucket of the 7B), else gemv_rows; the
    verify step's buffers include the split's workspace whatever the path (dev/verify_step.py's
    --down switches)."""
    from nanoqwen.engine import verify

    cfg, g = preset(name), registry.DEFAULT_GEOMETRY
    k, n, _, epi = registry.gemv_shapes(cfg)["down"]
    for m in range(1, registry.MAX_ROWS + 1):
        slices = registry.rows_split(k, n, epi, registry.row_bucket(m), g)
        want = verify.DOWN_SLICED if slices >= verify.DOWN_SLICED_MIN_SLICES else "rows"
        assert verify.down_path(cfg, m, g) == want
        if name == "7b":
            assert want == "split"
    plan = verify.verify_plan(cfg, 16, g)
    assert registry.rows_split_workspace(cfg, g) in plan and registry.NORM_LINK_BYTES in plan
    with pytest.raises(ValueError, match="down_proj path 'nope'"):
        verify.down_proj(None, 1, "nope", 0, None, 0, 0, 0, 0, None)


# -- attn_rows' split and merges, emulated ------------------------------------------------------
def emulate_attn_rows(q, k, v, start, splits, c: int, g: registry.Geometry):
    """attn_rows<c>'s algorithm in float64 for one kv head: q [M, G, D], k, v [start + M, D] ->
    [M, G, D]. Mirrors the kernel's ranges (clusters of c, tile groups, ranks, page groups),
    its per-page causal mask and -inf guards, the CTA merge's -1e30 floor, the cluster merge
    and the final one."""
    m, grp, d = q.shape
    rows = m * grp
    lim = start + np.minimum(np.arange(rows) // grp, m - 1)  # each row's last key
    p = -(-(start + m) // PAGE_TOKENS)
    ncl = min(splits // c, -(-p // (c * g.mattn_min_pages)))
    r_tiles = -(-rows // 16)
    groups_z = max(1, min(r_tiles, splits // c // (2 * ncl)))  # half the spare clusters
    kp = np.zeros((start + m + PAGE_TOKENS, d))  # page-padded keys (slots past L: finite)
    vp = np.zeros_like(kp)
    kp[: start + m], vp[: start + m] = k, v
    out = np.full((rows, d), np.nan)
    for z in range(groups_z):
        tiles = list(range(z, r_tiles, groups_z))
        sel = np.array([16 * t + r for t in tiles for r in range(16) if 16 * t + r < rows])
        j_groups = 1
        while 2 * j_groups * len(tiles) <= g.mattn_consumers:
            j_groups *= 2
        acc, lsum = _tile_group(q.reshape(rows, d)[sel], lim[sel], kp, vp, p, ncl, c, j_groups)
        assert np.isnan(out[sel]).all()  # every row in one group
        out[sel] = acc / lsum[:, None]
    return out.reshape(m, grp, d)


def _tile_group(qr, lim, kp, vp, p, ncl, c, j_groups):
    """One tile group's rows (qr [rows, D], lim their last keys) over the kv head's pages:
    the clusters' ranks, their page groups, and the three merges; (acc, lsum)."""
    rows, d = qr.shape
    clusters = []
    for cl in range(ncl):
        cb, ce = cl * p // ncl, (cl + 1) * p // ncl
        ranks = []
        for rank in range(c):
            pb, pe = cb + rank * (ce - cb) // c, cb + (rank + 1) * (ce - cb) // c
            groups = []
            for grp_i in range(j_groups):
                mr, lr, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, d))
                for i in range(grp_i, pe - pb, j_groups):
                    keys = np.arange(PAGE_TOKENS) + (pb + i) * PAGE_TOKENS
                    s = qr @ kp[keys].T / np.sqrt(d)
                    s[keys[None, :] > lim[:, None]] = -np.inf
                    mx = np.maximum(mr, s.max(1))
                    safe = np.where(mx == -np.inf, 0.0, mx)
                    alpha, pr = np.exp(mr - safe), np.exp(s - safe[:, None])
                    lr = lr * alpha + pr.sum(1)
                    o = o * alpha[:, None] + pr @ vp[keys]
                    mr = mx
                groups.append((mr, lr, o))
            mx = np.maximum(-1e30, np.max([gm for gm, _, _ in groups], axis=0))
            w = [np.exp(gm - mx) for gm, _, _ in groups]
            lsum = sum(wi * gl for wi, (_, gl, _) in zip(w, groups, strict=True))
            acc = sum(wi[:, None] * go for wi, (_, _, go) in zip(w, groups, strict=True))
            ranks.append((mx, lsum, acc))
        mx = np.max([rm for rm, _, _ in ranks], axis=0)
        w = [np.exp(rm - mx) for rm, _, _ in ranks]
        lsum = sum(wi * rl for wi, (_, rl, _) in zip(w, ranks, strict=True))
        acc = sum(wi[:, None] * ra for wi, (_, _, ra) in zip(w, ranks, strict=True))
        clusters.append((mx, lsum, acc))
    mx = np.max([cm for cm, _, _ in clusters], axis=0)
    w = [np.exp(cm - mx) for cm, _, _ in clusters]
    lsum = sum(wi * cl_ for wi, (_, cl_, _) in zip(w, clusters, strict=True))
    acc = sum(wi[:, None] * ca for wi, (_, _, ca) in zip(w, clusters, strict=True))
    return acc, lsum


def reference(q, k, v, start):
    m, grp, d = q.shape
    s = np.einsum("mgd,ld->mgl", q, k) / np.sqrt(d)
    late = np.arange(k.shape[0])[None, None, :] > start + np.arange(m)[:, None, None]
    s = np.where(late, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("mgl,ld->mgd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize(
    ("m", "grp", "start", "splits"),
    [(1, 7, 0, 32), (2, 7, 15, 32), (3, 6, 5, 64), (5, 5, 511, 16), (8, 7, 4000, 32),
     (16, 7, 8191 - 16, 32), (16, 8, 2047, 64), (9, 2, 30, 8), (8, 7, 512, 32),
     (16, 6, 600, 32), (11, 7, 100, 32), (8, 7, 1500, 64)],
)  # fmt: skip
def test_attn_rows_split_emulation(m, grp, start, splits, long):
    """Both forms: clusters of mattn_cluster and of mattn_long_cluster."""
    rng = np.random.default_rng(start * 131 + m)
    d, g = 16, registry.DEFAULT_GEOMETRY
    c = g.mattn_long_cluster if long else g.mattn_cluster
    q = 2 * rng.standard_normal((m, grp, d))
    k, v = rng.standard_normal((start + m, d)), rng.standard_normal((start + m, d))
    got = emulate_attn_rows(q, k, v, start, splits, c, g)
    np.testing.assert_allclose(got, reference(q, k, v, start), rtol=1e-9, atol=1e-12)


class _FakeGpu:
    """Gpu.alloc's contract without a GPU: one address range a buffer."""

    def __init__(self) -> None:
        self.next = 1 << 20

    def alloc(self, nbytes, what):
        buf = type("Buf", (), {"ptr": self.next})()
        self.next += nbytes
        return buf


def test_norm_link_follows_the_step():
    """NormLink mirrors the device chain of a step (embed_rows, then per layer q/k/v normalizes,
    o hands off, gate/up normalizes, down hands off): a normalizing launch reads the c that x
    carries and the rows of sums its producer wrote, and writes its 1 / rms into the other slot,
    which the next producer takes as its c; no launch writes a slot the one before it reads."""
    from nanoqwen.cuda.decode import NormLink

    link = NormLink(_FakeGpu())
    with pytest.raises(NanoqwenError, match="before any producer"):
        link.normalize()
    slots = (link.ss + registry.NORM_PARTS * registry.MAX_ROWS * 4,
             link.ss + (registry.NORM_PARTS + 1) * registry.MAX_ROWS * 4)  # fmt: skip
    assert link.head(5) == slots[0]
    read = slots[0]  # the slot the last launch read
    for layer in range(3):
        for producer_ctas in (132, 56):  # o (one CTA an SM), then down's sum kernel
            ss, nparts, scale, rstd = link.normalize()
            assert ss == link.ss and scale == read and rstd != scale and rstd in slots
            assert int(nparts) == (5 if layer == 0 and producer_ctas == 132 else
                                   (56 if producer_ctas == 132 else 132))  # fmt: skip
            assert link.produce(producer_ctas) == rstd  # the producer's c: that 1 / rms
            read = rstd
    for bad in (0, registry.NORM_PARTS + 1):
        with pytest.raises(NanoqwenError, match="producing CTAs"):
            link.produce(bad)
