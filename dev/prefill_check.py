"""Prefill kernels playground: validate against PyTorch, then time (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/prefill_check.py [--model 7b] [--quick] [--only SUBSTR] [--extra]
        [--out DIR] [--parts gemm,attention,timing] [--timing-m 512]

Tiles: every GemmTile of nanoqwen.cuda.registry.GEMM_TILES, plus EXTRA_TILES with --extra,
built as one PrefillKernels(tiles=...); --only keeps the tiles whose TOKENSxSTAGES (e.g.
256x4) contains SUBSTR.

Correctness: nanoqwen.harness.prefill_checks (shapes, awkward M and T, NaN poisoning, guard
rows, the tolerances and their reasons), the GEMMs on every shape of --model's preset (the 7B
by default) with every tile, the attention at its GQA (7:1 on the 7B, 5:1 on the 32B), 2:1
(D 128) and 2:1 (tiny, D 64).

Timing: the Gpu's events around 20 calls queued back to back, median of 5, for each shape
at each M of --timing-m (512: the rate the table's 64- to 256-token tiles record; 16: the
16-token tile's, for the verify step's M = 1..16) and each tile, beside cuBLAS
fp16 (torch.matmul) on the same shape as a yardstick; the attention at T = 512, 2048 and
8192; then the projected 512-token prefill: layers x (the picked tile's GEMM times + attention
at 512). torch runs on the Gpu's stream throughout, so its spin kernel, cuBLAS and our
launches share one queue.

Printed (and logged to --out with a JSON summary): each kernel's registers / spills / shared
memory; a table of max|err| / max|ref| per shape, tile and M (* marks a case over tolerance
or with a non-finite output); the timing table; RESULT last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from nanoqwen.config import ModelConfig, preset
from nanoqwen.cuda.device import Gpu
from nanoqwen.cuda.prefill import PrefillKernels
from nanoqwen.cuda.registry import GEMM_TILES, GemmTile
from nanoqwen.engine.forward import scratch_rows
from nanoqwen.harness.gpu_script import gpu_session
from nanoqwen.harness.prefill_checks import (
    check_attention,
    check_gemm,
    gemm_shapes,
    paged_kv,
    random_int4_weight,
)

ATTN_TIMED_T = (512, 2048, 8192)  # the prompt lengths the attention is timed at
SPIN_CYCLES = 4_000_000  # torch.cuda._sleep ahead of a timed batch: ~2 ms at ~2 GHz
# Candidate tiles validated and timed beside GEMM_TILES (other ring depths; a key already in
# the table would replace its spec). Their rates (below the table's tile of their size, 16
# tokens: 100 against 150) keep pick_gemm on the table's tiles; the timing table measures them.
EXTRA_TILES = tuple(
    GemmTile(tokens, stages, swiglu, rate)
    for swiglu in (False, True)
    for tokens, stages, rate in ((16, 8, 100.0), (16, 24, 100.0), (64, 12, 300.0),
                                 (128, 8, 300.0), (256, 5, 300.0))
)  # fmt: skip


def tile_name(t: GemmTile) -> str:
    return f"{t.tokens}x{t.stages}"


# -- timing -------------------------------------------------------------------------------------
def time_ms(gpu, fn, reps=5, batch=20, warmup=3) -> float:
    """Milliseconds per fn() call: the median over `reps` timings of `batch` calls queued back
    to back between two events, as the engine queues its prefill (timed one call at a time, the
    host's launch time showed up as idle GPU: 10-15% of a 40 us GEMM). A spin kernel of ~2 ms
    ahead of the first event lets the host queue the whole batch before the GPU reaches it, so
    a launch shorter than its host-side cost (~25 us through the Python launchers) is timed,
    not the host."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(SPIN_CYCLES)
        e0 = gpu.record()
        for _ in range(batch):
            fn()
        e1 = gpu.record()
        e1.sync()
        times.append((e1 - e0) / batch)
    return statistics.median(times)


def time_shape(pk, name, shape, gen, m=512):
    """Rows (shape, tile, ms, TFLOP/s) of every tile, cuBLAS fp16 and the picked tile on one
    shape, and the picked tile's ms.
    A's buffer has the engine's scratch rows (forward.scratch_rows), passed as a_rows; a tile
    whose last box would cross M is also timed without them ("A to M": the TMA fills the rows
    past M)."""
    n, k, swiglu = shape["n"], shape["k"], shape.get("swiglu", False)
    words, scales, _ = random_int4_weight(n, k, gen)
    cap = scratch_rows(m)
    a = torch.randn(cap, k, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n // 2 if swiglu else n, device="cuda", dtype=torch.float16)
    flop = 2 * m * n * k
    rows = []
    for spec in (s for s in pk.gemms if s.tile.swiglu == swiglu):
        for a_rows in (cap, 0) if m % spec.tile.tokens else (cap,):

            def launch(spec=spec, a_rows=a_rows):
                pk.gemm(a, words, scales, None, out, m, n, k, swiglu=swiglu, spec=spec,
                        a_rows=a_rows)  # fmt: skip

            ms = time_ms(pk.gpu, launch)
            rows.append((name, spec.key + ("" if a_rows else " A to M"), ms, flop / ms / 1e9))
    wf = torch.randn(n, k, device="cuda", dtype=torch.float16)
    ms = time_ms(pk.gpu, lambda: torch.matmul(a[:m], wf.t()))
    rows.append((name, "cuBLAS fp16", ms, flop / ms / 1e9))
    picked = pk.pick_gemm(m, swiglu)
    picked_ms = next(r[2] for r in rows if r[1] == picked.key)
    rows.append((name, f"picked {picked.key}", picked_ms, flop / picked_ms / 1e9))
    return rows, picked_ms


def time_all(pk, cfg, gen, ms=(512,)):
    """The GEMM rows at every M of `ms`; `best` (the picked tiles' times) at the first."""
    results, best = [], {}
    for m in ms:
        for name, shape in gemm_shapes(cfg).items():
            rows, picked_ms = time_shape(pk, name, shape, gen, m)
            results += [(f"{shape_name} M={m}", *rest) for shape_name, *rest in rows]
            if m == ms[0]:
                best[name] = picked_ms  # what the engine runs: the tile pick_gemm chooses
    attn_ms = {}
    for t in ATTN_TIMED_T:
        q = torch.randn(t, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.float16)
        kv = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.float16)
        kc, vc, table = paged_kv([kv] * pk.geometry.k_parts, kv, gen)
        out = torch.empty_like(q)
        attn_ms[t] = time_ms(
            pk.gpu,
            lambda q=q, c=(kc, vc, table), out=out, t=t: pk.attention(q, *c, out, 0, t),
        )
        attn_flop = 4 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2
        results.append(("attention", f"T={t}", attn_ms[t], attn_flop / attn_ms[t] / 1e9))
    return results, best, attn_ms[512], sum(best.values()) + attn_ms[512]


# -- the run ------------------------------------------------------------------------------------
def run(args, gpu: Gpu, tiles: tuple[GemmTile, ...], parts: set[str], log) -> int:
    log(f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    cfg = preset(args.model)
    t0 = time.time()
    pk = PrefillKernels(gpu, cfg, tiles=tiles)
    log(f"compile+load {args.model} kernels: {time.time() - t0:.2f} s")
    for spec in pk.gemms:
        r = pk.resources[spec.expression]
        log(f"  {spec.key}: {r.registers} regs, {r.spill_bytes} B spilled, smem {spec.smem} B, "
            f"{spec.threads} threads, {pk.ctas_per_sm(spec.key)} CTA/SM")  # fmt: skip
    spec = pk.specs["prefill_attention"]
    r = pk.resources[spec.expression]
    log(f"  {spec.key}: {r.registers} regs, {r.spill_bytes} B spilled, smem {spec.smem} B")
    gen = torch.Generator(device="cuda")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; logged to replay
    gen.manual_seed(seed)
    torch.manual_seed(seed)
    log(f"seed {seed}")

    g_ok = a_ok = True
    summary = {}
    if "gemm" in parts:
        g_ok, g_worst = check_gemm(pk, cfg, gen, log, args.quick)
        summary.update(gemm_ok=g_ok, gemm_worst_rel=g_worst)
    if "attention" in parts:
        gqa2 = ModelConfig("gqa2-d128", 1000, 512, 512, 1, 4, 2, 128)
        configs = [(cfg, pk)] + [(c, PrefillKernels(gpu, c)) for c in (gqa2, preset("tiny"))]
        a_ok, a_worst = check_attention(configs, gen, log)
        summary.update(attn_ok=a_ok, attn_worst_abs=a_worst)
    if "timing" in parts:
        results, best, attn_ms, per_layer = time_all(pk, cfg, gen, args.timing_m)
        log(f"\n{'shape':16s} {'tile':28s} {'ms':>8s} {'TFLOP/s':>9s}   (5 x 20 calls)")
        for name, tile, ms, tf in results:
            log(f"{name:16s} {tile:28s} {ms:8.4f} {tf:9.1f}")
        total = per_layer * cfg.num_layers
        log(
            f"\nper layer: picked GEMMs at M = {args.timing_m[0]} {sum(best.values()):.3f} ms + "
            f"attention at 512 {attn_ms:.3f} ms; x{cfg.num_layers} layers = {total:.2f} ms"
        )
        summary.update(best_ms=best, attn_ms=attn_ms, projected_prefill_ms=total, table=results)
    (Path(args.out) / f"prefill_check_{'_'.join(sorted(parts))}.json").write_text(
        json.dumps(summary, indent=1)
    )
    log(f"RESULT gemm {'PASS' if g_ok else 'FAIL'} attention {'PASS' if a_ok else 'FAIL'}")
    return 0 if (g_ok and a_ok) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="7b", help="the preset whose shapes are checked and timed")
    ap.add_argument("--quick", action="store_true", help="fewer M values")
    ap.add_argument("--extra", action="store_true", help="also validate and time EXTRA_TILES")
    ap.add_argument("--only", default="", help="keep the GEMM tiles whose TOKENSxSTAGES has this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log/JSON directory")
    ap.add_argument(
        "--parts", default="gemm,attention,timing", help="comma list: gemm, attention, timing"
    )
    ap.add_argument("--timing-m", default="512", help="comma list of GEMM M values to time")
    args = ap.parse_args()
    args.timing_m = tuple(int(m) for m in args.timing_m.split(","))
    tiles = GEMM_TILES + (EXTRA_TILES if args.extra else ())
    tiles = tuple(t for t in tiles if args.only in tile_name(t))
    for swiglu in (False, True):  # pick_gemm and the shapes need both kinds
        if not any(t.swiglu == swiglu for t in tiles):
            kind = "SwiGLU" if swiglu else "plain"
            raise SystemExit(f"--only {args.only!r} leaves no {kind} GEMM tile")
    parts = set(args.parts.split(","))
    with gpu_session(args.out, f"prefill_check_{'_'.join(sorted(parts))}.log") as (gpu, log):
        return run(args, gpu, tiles, parts, log)


if __name__ == "__main__":
    sys.exit(main())
