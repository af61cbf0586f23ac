"""The M-row INT4 GEMV (gemv_rows.cu) and its split over K for down_proj: validated against
float64 numpy, then timed.

    PYTHONPATH=. python3 dev/gemv_rows.py [--presets 7b,1.5b,14b:5:16,32b:1:8:16@down]
        [--time-presets 7b,1.5b] [--kinds qkv,o,gate_up,down] [--parts check,time]
        [--variant kMrMaxStages=4 ...]
    quick (down_proj alone, under 2 minutes):
    PYTHONPATH=. python3 dev/gemv_rows.py --kinds down --presets 7b,1.5b,32b:1:8:16

check: for each preset's four shapes, every epilogue, M in 1, 2, 3, 5, 8, 9, 16 (the 14B's at
  M = 5 and 16: its hidden size takes K slices with RMSNorm at MT = 16; the 32B's down_proj,
  the longest K, at 1, 8, 16; NAME:M:M@KIND+KIND limits a preset's M and kinds): fresh random
  weights and inputs, outputs (and the K/V caches) poisoned with NaN before the launch, the
  reference on the dequantized weights in float64 (RMSNorm's input as the kernel takes it:
  the hand-off's fp16 x, times 1 / rms over its c). q/k/v: one sequence (page_stride 0) at
  consecutive positions 14.. across a page boundary of a scattered page table, and one table
  per row (page_stride > 0); every other cache slot must stay NaN. down_proj is checked
  twice: gemv_rows ("down") and the split over K ("down split": gemv_rows_split +
  gemv_rows_split_sum; its fp32 workspace poisoned with NaN, so a partial sum not written
  before the sum reads it shows). The
  RMSNorm hand-off (gemv_rows.cu): q/k/v and gate/up take x = fp16(h w c) with its rows of
  sums of squares (hand_off) and must write each row's 1 / rms; o, down and the split must
  write out = fp16(res w c) exactly (the plain fp16 copy at even M: no next RMSNorm) and rows
  of sums of squares that add up to the new residual's. Tolerance
  (max |err| / rms(ref)): 5e-3 for the linear epilogues (fp32 sums of exact products; what is
  left is the fp16 output and, with RMSNorm, one fp16 rounding of x c w per element), 2e-2
  for SwiGLU (fp16 output of silu(g) u with large g), the ladder's values
  (nanoqwen/config/nanoqwen.yaml).
  Weights are drawn once per (preset, kind), inputs per case.
time: the 7B and 1.5B shapes (--time-presets), each as one CUDA graph of 28 launches over 28
  layers' own weights (so the L2 does not hold them), median of 7 replays: today's batch-1
  kernel (gemv_int4) and gemv_rows at M = 1, 2, 4, 8, 16; us a launch, the ratio to
  gemv_int4, and a layer's sum by kernel (with the kinds it covers). down_proj also times, at
  each M, "split" (gemv_rows_split and gemv_rows_split_sum, both launches) and "gemm" (the
  prefill's tensor-core GEMM, its 16-token tile: the verify and batch steps' path before the
  split). --variant NAME=v,NAME=v (repeatable): gemv_rows (and the split) built again with
  those Geometry values (C names, as dev/kernel_tune.py's --set) and timed beside the shipped
  geometry's in the same process: an A/B of a geometry. The check part takes the shipped
  geometry.
The target (issue #26): gemv_rows at M = 8 within ~1.25x of gemv_int4 at M = 1 on down_proj
(7B, 1.5B), ~1.1x on the others; the split's: down_proj at M = 1..16 in ~10-13 us a launch
at the 7B (the weight stream, 8.7 us at 4 TB/s, plus a small fixed cost).
Each part of each preset runs in its own process (--timeout seconds at most): a failure, a trap
that leaves the CUDA context unusable or a hang prints and the rest goes on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from nanoqwen.config import PAGE_TOKENS, preset
from nanoqwen.cuda.decode import DecodeKernels, NormLink
from nanoqwen.cuda.device import Gpu
from nanoqwen.cuda.prefill import PrefillKernels
from nanoqwen.cuda.registry import (
    DEFAULT_GEOMETRY,
    GEMM_TILES,
    MAX_ROWS,
    NORM_LINK_BYTES,
    NORM_PARTS,
    gemv_shapes,
    rows_split_workspace,
)
from nanoqwen.engine.kv_cache import kv_cache_from_device
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.validate import _Dev, _f16, _rand_int4, _rel_err, _rope_ref
from nanoqwen.rope import rope_table

MS = (1, 2, 3, 5, 8, 9, 16)
KINDS = ("qkv", "o", "gate_up", "down")
TOL = {"linear": 5e-3, "swiglu": 2e-2, "k_pair": 1e-4}  # config/nanoqwen.yaml's unit tier
LAYERS = 28


def hand_off(dev, link: NormLink, cfg, h: np.ndarray, normw: np.ndarray, rng):
    """What a producer hands a normalizing kernel over (gemv_rows.cu's hand-off), set up on the
    host for the residual h fp32 [m, K]: ss split into 7 rows of sums of squares (random
    shares, NaN past the rows), each token row's c near its 1 / rms, x = fp16(h w c) on the
    device. Returns x's address and the input the kernel's dot products take, float64 x rstd /
    c (its one rounding is x's, as the reference's fp16(h rstd w)). The rstd slot the
    normalizing launch writes is NaN-poisoned (check_rstd reads it)."""
    m = h.shape[0]
    sq = (h.astype(np.float64) ** 2).sum(axis=1)
    shares = rng.dirichlet(np.ones(7), m).T  # [7, m]
    ss = np.full((NORM_PARTS, MAX_ROWS), np.nan, np.float32)
    ss[:7, :m] = shares * sq
    c = 1 / np.sqrt(sq / h.shape[1] + cfg.rms_norm_eps) * rng.uniform(0.8, 1.25, m)
    dev.gpu.memset(link.ss, 0xFF, NORM_LINK_BYTES)  # NaN: ss past its rows, both slots
    slot = link.produce(7)
    dev.gpu.upload(link.ss, ss)
    dev.gpu.upload(slot, c.astype(np.float32))
    x = _f16((h * normw.astype(np.float32)) * c.astype(np.float32)[:, None])
    rstd = 1 / np.sqrt(sq / h.shape[1] + cfg.rms_norm_eps)
    return dev.put(x), x.astype(np.float64) * (rstd / c.astype(np.float32))[:, None]


def check_linear(k, dev, cfg, kind, m, rng, weights, split: bool = False) -> float:
    """o / down (+ residual, handing the next RMSNorm's input over) and gate_up (RMSNorm of
    the hand-off + SwiGLU) over m rows; weights: _rand_int4's (words, scales, dequantized) of
    the kind's shape. split: down through gemv_rows_split and its sum, the workspace
    NaN-poisoned. The hand-off's out must be fp16(res w c) exactly (and with no next RMSNorm,
    the plain fp16 copy: every other launch), its rows of sums of squares add up to the
    residual's, and gate_up's 1 / rms must be the reference's."""
    kdim, n, norm, _ = gemv_shapes(cfg)[kind]
    words, scales, deq = weights
    link = NormLink(dev.gpu)
    normw = _f16(1 + 0.1 * rng.standard_normal(kdim if norm else n))
    if norm:
        h = rng.standard_normal((m, kdim)).astype(np.float32)
        xptr, xin = hand_off(dev, link, cfg, h, normw, rng)
    else:
        x = _f16(rng.standard_normal((m, kdim)))
        if kind == "down":  # the MLP's activations carry a few huge outliers
            x[:, rng.choice(kdim, 8, replace=False)] = _f16(rng.choice([-300.0, 300.0], (m, 8)))
        xptr, xin = dev.put(x), x
    y = xin.astype(np.float64) @ deq.astype(np.float64).T  # [m, rows]
    optr, host = dev.out((m, n), np.float16)
    if kind == "gate_up":
        g, u = y[:, :n], y[:, n:]
        k.gemv_rows(kind, m, xptr, dev.put(words), dev.put(scales), optr, link=link)
        err = _rel_err(dev.get(optr, host), g / (1 + np.exp(-g)) * u)
        return max(err, check_rstd(dev, link, h, cfg))
    # the fp32 residual, off the fp16 grid; the next RMSNorm's c and weight (or none)
    resid = rng.standard_normal((m, n)).astype(np.float32)
    ref, rptr = resid.astype(np.float64) + y, dev.put(resid)
    c = rng.uniform(0.05, 2.0, m).astype(np.float32)
    dev.gpu.upload(link.head(m), c)  # the producer's c: the last 1 / rms slot
    next_w = dev.put(normw) if m % 2 else 0  # odd M: a hand-off; even: the last layer's copy
    dev.gpu.memset(link.ss, 0xFF, NORM_PARTS * MAX_ROWS * 4)
    if split:
        part, _ = dev.out((rows_split_workspace(cfg, k.geometry) // 4,), np.float32)
        k.gemv_rows_split(m, xptr, dev.put(words), dev.put(scales), optr, rptr, part,
                          link=link, next_w=next_w)  # fmt: skip
    else:
        k.gemv_rows(kind, m, xptr, dev.put(words), dev.put(scales), optr, link=link, res=rptr,
                    next_w=next_w)  # fmt: skip
    got = dev.get(optr, host)
    res = dev.get(rptr, np.empty((m, n), np.float32))  # the result; out its hand-off
    want = _f16(res * normw.astype(np.float32) * c[:, None]) if next_w else _f16(res)
    nparts = int(link.normalize()[1])
    ss = dev.get(link.ss, np.empty((NORM_PARTS, MAX_ROWS), np.float32))
    sq = (res.astype(np.float64) ** 2).sum(axis=1)
    ss_ok = (np.isfinite(ss[:nparts, :m]).all()
             and np.allclose(ss[:nparts, :m].sum(axis=0), sq, rtol=1e-5))  # fmt: skip
    return _rel_err(res, ref) if np.array_equal(want, got) and ss_ok else float("inf")


def check_rstd(dev, link: NormLink, h: np.ndarray, cfg) -> float:
    """0 when the normalizing launch wrote each token row's 1 / rms of h into its slot
    (link.rstd; fp32 sums: 1e-5), else inf."""
    m = h.shape[0]
    got = dev.get(link.rstd, np.empty(m, np.float32))
    want = 1 / np.sqrt((h.astype(np.float64) ** 2).mean(axis=1) + cfg.rms_norm_eps)
    return 0.0 if np.allclose(got, want, rtol=1e-5) else float("inf")


def check_qkv(k, dev, cfg, m, rng, page_stride: int) -> tuple[float, float, bool]:
    """RMSNorm + q/k/v + bias + RoPE + K/V write for m rows at positions 14 .. 14 + m - 1
    (across the first page boundary); page_stride > 0: each row its own page table. Returns
    the error of q and v, K's (the (hi, lo) cache's bound is TOL["k_pair"]) and whether only
    the rows' slots were written."""
    h, npages = cfg.hidden_size, 8
    hq, hkv, d, n = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size + 2 * cfg.kv_size
    rope = rope_table(cfg, npages * PAGE_TOKENS)
    rows = m if page_stride else 1  # page tables: one per row, or one for the sequence
    tables = rng.permutation(rows * npages).astype(np.int32).reshape(rows, npages)
    pos = np.arange(14, 14 + m, dtype=np.int32)
    words, scales, deq = _rand_int4(rng, n, h)
    hres = rng.standard_normal((m, h)).astype(np.float32)
    normw = _f16(1 + 0.1 * rng.standard_normal(h))
    bias = _f16(rng.standard_normal(n))
    link = NormLink(dev.gpu)
    x, xin = hand_off(dev, link, cfg, hres, normw, rng)
    qkv = xin @ deq.astype(np.float64).T + bias  # [m, n]: rotated in fp32, rounded after
    heads = qkv[:, : cfg.q_size + cfg.kv_size].reshape(m, hq + hkv, d)
    rot = _rope_ref(heads, rope, pos)
    total = tables.size
    q_ptr, qh = dev.out((m, hq, d), np.float16)
    kc_ptr, kc = dev.out((total, hkv, k.geometry.k_parts, PAGE_TOKENS, d), np.float16)
    vc_ptr, vc = dev.out((total, hkv, 1, PAGE_TOKENS, d), np.float16)
    k.gemv_rows("qkv", m, x, dev.put(words), dev.put(scales), q_ptr, link=link,
                bias=dev.put(bias), pos=dev.put(pos), rope=dev.put(rope),
                pages=dev.put(tables), page_stride=npages if page_stride else 0, kc=kc_ptr,
                vc=vc_ptr)  # fmt: skip
    err, k_err = _rel_err(dev.get(q_ptr, qh), rot[:, :hq]), 0.0
    err = max(err, check_rstd(dev, link, hres, cfg))
    kc, vc = kv_cache_from_device(dev.get(kc_ptr, kc)), kv_cache_from_device(dev.get(vc_ptr, vc))
    for r in range(m):
        t = tables[r if page_stride else 0]
        slot = t[pos[r] // PAGE_TOKENS], pos[r] % PAGE_TOKENS
        v_ref = qkv[r, cfg.q_size + cfg.kv_size :].reshape(hkv, d)
        err = max(err, _rel_err(vc[slot], v_ref))
        k_err = max(k_err, _rel_err(kc[slot], rot[r, hq:]))
        kc[slot], vc[slot] = np.nan, np.nan
    return err, k_err, bool(np.isnan(kc).all() and np.isnan(vc).all())


def part_check(gpu, name: str, ms: tuple[int, ...], kinds, rng, rows: list) -> None:
    """Appends (preset, case, M, err, ok, note) to `rows` case by case (a later trap keeps
    the earlier results)."""
    cfg = preset(name)
    k = DecodeKernels(gpu, cfg, rows=True)
    dev = _Dev(gpu)
    for kind in [kd for kd in ("o", "down", "gate_up", "qkv") if kd in kinds]:
        kdim, n, _, _ = gemv_shapes(cfg)[kind]
        weights = (
            None if kind == "qkv" else _rand_int4(rng, 2 * n if kind == "gate_up" else n, kdim)
        )
        # down_proj twice: gemv_rows, then the split over K (gemv_rows_split + its sum)
        cases = [(kind, False)] + ([("down split", True)] if kind == "down" else [])
        for m, (case, split) in itertools.product(ms, cases):
            try:
                if kind == "qkv":
                    for stride in (0, 1):
                        err, k_err, clean = check_qkv(k, dev, cfg, m, rng, stride)
                        k_tol = TOL["k_pair"] if k.geometry.k_parts == 2 else TOL["linear"]
                        ok = err <= TOL["linear"] and k_err <= k_tol and clean
                        note = f"K {k_err:.1e}" + ("" if clean else ", other K/V slots WRITTEN")
                        rows.append(
                            (name, f"qkv stride={'row' if stride else 0}", m, err, ok, note)
                        )
                        dev.free()
                else:
                    err = check_linear(k, dev, cfg, kind, m, rng, weights, split)
                    tol = TOL["swiglu" if kind == "gate_up" else "linear"]
                    rows.append((name, case, m, err, err <= tol, ""))
            except Exception as e:  # noqa: BLE001 - one case's failure must not hide the rest
                rows.append((name, case, m, float("nan"), False, f"{type(e).__name__}: {e}"))
                gpu.ensure_ok()
            dev.free()


def part_time(gpu, name: str, kinds, variants: list[str]) -> list[tuple]:
    """us a launch of each GEMV shape (of `kinds`) of preset `name`, 28 layers' own weights in
    one graph: gemv_int4, gemv_rows of the shipped geometry, then of each variant; down_proj
    also the split over K (each build's) and the prefill GEMM."""
    cfg, rng = preset(name), np.random.default_rng(0)
    shapes = {kd: v for kd, v in gemv_shapes(cfg).items() if kd in kinds}
    k = DecodeKernels(gpu, cfg, rows=True)
    # The GEMM's tile at M <= 16 (PrefillKernels.pick_gemm's choice there), compiled alone.
    tiles = tuple(t for t in GEMM_TILES if t.tokens == 16 and not t.swiglu)
    gemm = PrefillKernels(gpu, cfg, tiles=tiles) if "down" in kinds else None
    builds = [("", k)] + [  # (the label's suffix, the kernels)
        (f" {text}", DecodeKernels(gpu, cfg, geometry, rows=True))
        for text, geometry in ((v, DEFAULT_GEOMETRY.override_text(v)) for v in variants)
    ]
    bufs = []

    def put(a):
        b = gpu.alloc(a.nbytes, "gemv_rows time")
        bufs.append(b)
        gpu.upload(b.ptr, a)
        return b.ptr

    npages, mmax = 64, 16
    h, n_qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    act = {s: put(_f16(rng.standard_normal(mmax * s) * 0.1)) for s in {h, cfg.intermediate_size}}
    outs = {s: put(np.zeros(mmax * s, np.float16)) for s in {h, cfg.intermediate_size, cfg.q_size}}
    res = put(np.zeros(mmax * h, np.float32))  # o and down: the fp32 residual
    normw = put(_f16(1 + 0.1 * rng.standard_normal(h)))
    bias = put(_f16(rng.standard_normal(n_qkv)))
    rope = put(rope_table(cfg, npages * PAGE_TOKENS))
    pos, pages = (
        put(np.arange(100, 100 + mmax, dtype=np.int32)),
        put(np.arange(npages, dtype=np.int32)),
    )
    kv = [put(np.zeros(parts * npages * cfg.kv_size * PAGE_TOKENS, np.float16))
          for parts in (DEFAULT_GEOMETRY.k_parts, 1)]  # fmt: skip
    part = put(np.zeros(max(rows_split_workspace(cfg, kr.geometry) for _, kr in builds) // 4,
                        np.float32))  # fmt: skip
    link = NormLink(gpu)  # the hand-off: sums of squares and scales of 1 (values do not matter)
    gpu.upload(link.ss, np.ones(NORM_LINK_BYTES // 4, np.float32))
    link.head(mmax)
    weights = {}
    for kind, (kdim, n, _, _) in shapes.items():
        rows = 2 * n if kind == "gate_up" else n
        words, scales, _ = _rand_int4(rng, rows, kdim)
        weights[kind] = [(put(words), put(scales)) for _ in range(LAYERS)]  # distinct copies
    table = []
    for kind, (kdim, n, norm, _) in shapes.items():
        x = act[kdim]
        out = outs[
            cfg.q_size if kind == "qkv" else (cfg.intermediate_size if kind == "gate_up" else h)
        ]
        nw = normw if norm else 0
        r = res if kind in ("o", "down") else 0

        def today(s, kind=kind, x=x, out=out, nw=nw, n=n, r=r):
            for w, sc in weights[kind]:
                if kind == "qkv":
                    k.qkv_rope(x, nw, w, sc, bias, pos, rope, pages, kv[0], kv[1], out, stream=s)
                else:
                    k.gemv(kind, x, nw, w, sc, out, n, r, stream=s)

        def rows_m(s, m, kr, kind=kind, x=x, out=out, r=r):
            for w, sc in weights[kind]:  # o and down hand the next RMSNorm's input over
                kr.gemv_rows(kind, m, x, w, sc, out, link=link, res=r, bias=bias, pos=pos,
                             rope=rope, pages=pages, kc=kv[0], vc=kv[1],
                             next_w=normw if r else 0, stream=s)  # fmt: skip

        def split_m(s, m, kr, x=x, out=out):
            for w, sc in weights["down"]:
                kr.gemv_rows_split(m, x, w, sc, out, res, part, link=link, next_w=normw,
                                   stream=s)  # fmt: skip

        def gemm_m(s, m, x=x, out=out, kdim=kdim):
            for w, sc in weights["down"]:
                gemm.gemm(x, w, sc, None, out, m, h, kdim, residual=res, stream=s)

        paths = [(f"gemv_rows{sfx}", lambda s, m, kr=kr: rows_m(s, m, kr)) for sfx, kr in builds]
        if kind == "down":
            paths += [(f"split{sfx}", lambda s, m, kr=kr: split_m(s, m, kr)) for sfx, kr in builds]
            paths.append(("gemm", gemm_m))
        base = time_graph(gpu, today, reps=2, timed=7) / LAYERS * 1e6
        table.append((name, kind, "gemv_int4", 1, base, 1.0))
        for m in (1, 2, 4, 8, 16):
            for label, body in paths:  # side by side at each M: the same clocks and L2
                t = time_graph(gpu, lambda s, m=m, body=body: body(s, m), reps=2, timed=7)
                t = t / LAYERS * 1e6
                table.append((name, kind, label, m, t, t / base))
    for b in bufs:
        b.free()
    return table


def print_times(times: list[tuple]) -> None:
    print("\n== time (us a launch, median of 7 graph replays of 28 layers)")
    width = max(10, *(len(t[2]) for t in times))
    print(f"  {'model':5} {'kind':8} {'kernel':{width}} {'M':>3} {'us':>8} {'x M=1':>6}")
    for name, kind, kern, m, t, ratio in times:
        print(f"  {name:5} {kind:8} {kern:{width}} {m:3d} {t:8.2f} {ratio:6.2f}")
    for name in dict.fromkeys(t[0] for t in times):
        rows = [t for t in times if t[0] == name]
        base = sum(t[4] for t in rows if t[2] == "gemv_int4")
        print(f"  {name}: a layer's GEMVs (sum over the kinds timed; down_proj's own paths:")
        print("  split, gemm, summed over down alone)")
        for kern, m in dict.fromkeys((t[2], t[3]) for t in rows):
            got = [t for t in rows if t[2] == kern and t[3] == m]
            s = sum(t[4] for t in got)
            kinds = "+".join(t[1] for t in got)
            print(f"    {kern:{width}} M={m:2d} {s:8.2f} us  {s / base:5.2f}x  ({kinds})")


def run_part(part: str, target: str, kinds: str, seed, variants: list[str], checks: list,
             times: list) -> None:  # fmt: skip
    """One part ("check" or "time") of one preset (NAME[:M...][@KIND+KIND]) in this process,
    into checks / times."""
    gpu, rng = Gpu(), np.random.default_rng(seed)
    spec, _, only = target.partition("@")
    kinds = set(kinds.split(",")) & (set(only.split("+")) if only else set(KINDS))
    if part == "check":
        name, *ms = spec.split(":")
        part_check(gpu, name, tuple(map(int, ms)) or MS, kinds, rng, checks)
    else:
        times += part_time(gpu, spec.split(":")[0], kinds, variants)


def run_isolated(part: str, target: str, kinds: str, seed, variants: list[str],
                 timeout: int) -> tuple[list, list, str]:  # fmt: skip
    """run_part in a child process (a kernel that traps leaves the CUDA context unusable, one
    that hangs would stop the run): (checks, times, "" or why it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        cmd = [sys.executable, __file__, "--one", part, target, str(out), "--kinds", kinds]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        for v in variants:
            cmd += ["--variant", v]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return [], [], f"timed out after {timeout} s (a hang?)"
        sys.stdout.write(proc.stdout)
        res = json.loads(out.read_text()) if out.exists() else {"checks": [], "times": []}
        why = f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}" if proc.returncode else ""
        return [tuple(c) for c in res["checks"]], [tuple(t) for t in res["times"]], why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="7b,1.5b,14b:5:16,32b:1:8:16@down",
                    help="presets validated (comma-separated; NAME:M:M... checks only those M, "
                         "else 1, 2, 3, 5, 8, 9, 16; @KIND+KIND only those kinds)")  # fmt: skip
    ap.add_argument("--time-presets", default="7b,1.5b", help="presets timed (comma-separated)")
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="GEMV kinds checked and timed (comma-separated: qkv,o,gate_up,down)",
    )
    ap.add_argument("--parts", default="check,time", help="check, time or both")
    ap.add_argument("--seed", type=int, default=None, help="inputs' seed (default: fresh)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds a part may take")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=v,NAME=v: gemv_rows of the shipped geometry with these values "
                         "(C names: kMrMaxStages=4) timed beside it (repeatable)")  # fmt: skip
    ap.add_argument(
        "--one", nargs=3, metavar=("PART", "TARGET", "JSON"), help=argparse.SUPPRESS
    )  # a child process: one part, results to JSON
    args = ap.parse_args()
    if args.one:
        part, target, path = args.one
        checks, times = [], []
        try:
            run_part(part, target, args.kinds, args.seed, args.variant, checks, times)
        finally:  # what ran before a failure still reaches the table
            Path(path).write_text(json.dumps({"checks": checks, "times": times}))
        return 0
    parts = [("check", t) for t in args.presets.split(",") if "check" in args.parts]
    parts += [("time", t) for t in args.time_presets.split(",") if "time" in args.parts]
    for v in args.variant:  # a bad name or value stops here, not in every child
        try:
            DEFAULT_GEOMETRY.override_text(v)
        except ValueError as exc:
            ap.error(f"--variant {v!r}: {exc}")
    checks, times, failed = [], [], []
    for part, target in parts:
        c, t, why = run_isolated(part, target, args.kinds, args.seed, args.variant, args.timeout)
        checks, times = checks + c, times + t
        if why:
            failed.append(f"{part} {target}")
            print(f"!! {part} {target}: {why}")
    bad = [c for c in checks if not c[4]]
    print(f"\n== check: {len(checks) - len(bad)}/{len(checks)} pass (tolerance {TOL})")
    for c in checks:  # every case, PASS or FAIL
        print(f"  {c[0]:5} {c[1]:16} M={c[2]:2} err {c[3]:.2e} {'PASS' if c[4] else 'FAIL'} {c[5]}")
    if times:
        print_times(times)
    print(f"\nfailed parts: {', '.join(failed) or 'none'}")
    print(f"RESULT {'FAIL' if failed or bad else 'PASS'}")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
