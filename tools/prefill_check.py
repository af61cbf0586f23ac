"""Prefill kernels playground: validate against PyTorch, then time (run on an sm_90 GPU).

    PYTHONPATH=. python3 tools/prefill_check.py [--quick] [--only SUBSTR] [--extra] [--out DIR]

Variants: every GemmVariant of nanoqwen.prefill.GEMM_VARIANTS (the wgmma kernels of
prefill_gemm_wgmma.cu and the mma.sync kernels of prefill_gemm.cu), plus EXTRA_VARIANTS with
--extra; --only keeps the variants whose label contains SUBSTR (e.g. --only wgmma).

Correctness. GEMM: every 7B projection shape (qkv, o + residual in place, gate_up + SwiGLU,
down) at awkward M (1, 3, 17, 128, 511, 512, 513), fresh random INT4 weights each run, output
poisoned with NaN before the launch, followed by GUARD_ROWS poisoned rows that must stay NaN
(no store past row M); a launch that does not finish within a minute ends the script with a
HANG line naming the kernel. The reference dequantizes exactly as the kernel does
(q * scale rounded once to fp16; the packing is checked against nanoqwen.quant on a slice) and
multiplies in fp32, so what is left is fp32 summation order (~1e-6 relative) and the final
fp16 rounding (2^-11 relative): the tolerance is max|out - ref| <= 2e-3 * max|ref|.
Attention: T in (1, 15, 16, 17, 100, 512, 1000), GQA 7:1 (7B, D 128), 2:1 (D 128) and 2:1 (tiny,
D 64), against an fp32 causal softmax; P is rounded to fp16 before P V, so the tolerance is
max abs error <= 4e-3 on outputs of magnitude ~1.

Timing: CUDA events around 20 calls queued back to back, median of 5, for each 7B shape at
M = 512 and each tile variant, beside cuBLAS fp16 (torch.matmul) on the same shape as a
yardstick; the attention at T = 512, 2048 and 8192; then the projected 512-token prefill:
28 x (best per-shape GEMM times + attention at 512).

Printed: each variant's registers / spills / shared memory; a table of max|err| / max|ref|
per shape, variant and M (FAIL marks a case over tolerance or with a non-finite output);
the timing table; RESULT last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nanoqwen.config import ModelConfig, preset
from nanoqwen.cuda.device import Gpu
from nanoqwen.prefill import GEMM_VARIANTS, GemmVariant, PrefillKernels, wgmma_variant
from nanoqwen.quant import dequantize_packed

GEMM_M = (1, 3, 17, 128, 511, 512, 513)
ATTN_T = (1, 15, 16, 17, 100, 512, 1000)
ATTN_TIMED_T = (512, 2048, 8192)  # the prompt lengths the attention is timed at (7B shapes)
SPIN_CYCLES = 4_000_000  # torch.cuda._sleep ahead of a timed batch: ~2 ms at ~2 GHz
GEMM_REL_TOL = 2e-3
GUARD_ROWS = 256  # poisoned rows past M after every GEMM output (must stay untouched)
ATTN_ABS_TOL = 4e-3
LANE_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # ValueShuffle: lane -> bit offset
SCALE = 0.01  # weight scales: outputs of order 1 for K = 3584 and random N(0,1) activations
# Candidate tiles timed (and validated) beside the table in nanoqwen/prefill.py.
EXTRA_VARIANTS = tuple(
    GemmVariant(bm, bn, wm, wn, st, mc, sw)
    for sw in (False, True)
    for bm, bn, wm, wn, st, mc in ((64, 128, 64, 32, 3, 3), (64, 256, 64, 32, 3, 1))
) + tuple(
    wgmma_variant(bt, st, sw, 300.0) for sw in (False, True) for bt, st in ((128, 8), (256, 5))
)  # rates only steer pick_gemm; the timing table measures them


def sync_or_die(what: str, timeout_s: float = 60.0) -> None:
    """torch.cuda.synchronize with a deadline: a kernel that never finishes (a pipeline
    deadlock) ends the script with its name instead of eating the whole device lease."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout_s:
            print(f"HANG: {what} still running after {timeout_s:.0f} s; exiting", flush=True)
            os._exit(3)
        time.sleep(0.0005)
    torch.cuda.synchronize()


def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh:
        fh.write(msg + "\n")
        fh.flush()


# -- references ---------------------------------------------------------------------------------
def random_int4_weight(n: int, k: int, gen: torch.Generator):
    """Fresh random INT4 weight on the GPU: (qweight int32-bits [N, K/8], scales fp16
    [N, K/128], dequantized fp16 [N, K] = fp16(q * scale), the value the kernel computes)."""
    q = torch.randint(-8, 8, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand((n, k // 128), device="cuda", generator=gen) + 0.5) * SCALE
    scales = scales.half()
    nib = (q & 0xF).to(torch.int64).view(n, k // 8, 8)
    shifts = torch.tensor(LANE_SHIFTS, device="cuda", dtype=torch.int64)
    words = (nib << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    deq = (q.view(n, k // 128, 128).float() * scales.float()[:, :, None]).half().view(n, k)
    return words, scales, deq


def check_packing_against_quant(words, scales, deq) -> None:
    """The GPU packer above must agree with nanoqwen.quant (the file format's definition)."""
    w = words[:4].cpu().numpy().view(np.uint32)
    ref = dequantize_packed(w, scales[:4].cpu().numpy())
    got = deq[:4].float().cpu().numpy()
    if not np.array_equal(ref.astype(np.float16).astype(np.float32), got):
        raise AssertionError("GPU INT4 packing disagrees with nanoqwen.quant.dequantize_packed")


def gemm_reference(a, deq, bias=None, residual=None, swiglu=False):
    ref = a.float() @ deq.float().t()
    if bias is not None:
        ref += bias.float()
    if residual is not None:
        ref += residual.float()
    if swiglu:
        i = ref.shape[1] // 2
        ref = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    return ref


def attention_reference(q, k, v):
    """fp32 causal GQA softmax attention. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)
    mask = torch.ones(t, t, device=q.device, dtype=torch.bool).triu(1)
    s.masked_fill_(mask, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vf)


# -- checks ---------------------------------------------------------------------------------------
def gemm_shapes(cfg: ModelConfig):
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": dict(n=cfg.q_size + 2 * cfg.kv_size, k=h, bias=True),
        "o": dict(n=h, k=cfg.q_size, residual=True),
        "gate_up": dict(n=2 * i, k=h, swiglu=True),
        "down": dict(n=h, k=i, residual=True),
    }


def run_gemm_case(pk, stream, a, words, scales, deq, shape, m, variant=None, bias=None):
    n = shape["n"]
    swiglu = shape.get("swiglu", False)
    out_cols = n // 2 if swiglu else n
    # `out` is the first m rows of a NaN-poisoned buffer with GUARD_ROWS more: a kernel that
    # stores past row M shows up as a finite guard row.
    buf = torch.full((m + GUARD_ROWS, out_cols), float("nan"), device="cuda", dtype=torch.float16)
    out = buf[:m]
    if shape.get("residual") and m % 2 == 0:  # in place, as the engine's h += o_proj(...)
        residual = torch.randn(m, n, device="cuda", dtype=torch.float16)
        out.copy_(residual)
        ref = gemm_reference(a, deq, bias, residual, swiglu)
        res_arg = out
    elif shape.get("residual"):  # separate residual buffer, poisoned output
        res_arg = torch.randn(m, n, device="cuda", dtype=torch.float16)
        ref = gemm_reference(a, deq, bias, res_arg, swiglu)
    else:
        ref = gemm_reference(a, deq, bias, None, swiglu)
        res_arg = None
    torch.cuda.synchronize()
    what = f"gemm {variant.name if variant else 'picked'} N={n} K={shape['k']} M={m}"
    pk.gemm(
        a,
        words,
        scales,
        bias,
        out,
        m,
        n,
        shape["k"],
        res_arg,
        swiglu=swiglu,
        variant=variant,
        stream=stream,
    )
    sync_or_die(what)
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    guard_ok = bool(torch.isnan(buf[m:]).all().item())
    if not guard_ok:
        err = float("inf")  # reported as a failure: the kernel wrote past row M
    ok = guard_ok and bool(torch.isfinite(out).all().item()) and err <= GEMM_REL_TOL * scale
    return ok, err, scale


def check_gemm(pk, stream, cfg, gen, fh, quick):
    rows, ok_all = [], True
    ms = (GEMM_M[:3] + GEMM_M[-1:]) if quick else GEMM_M
    for name, shape in gemm_shapes(cfg).items():
        words, scales, deq = random_int4_weight(shape["n"], shape["k"], gen)
        check_packing_against_quant(words, scales, deq)
        bias = (
            torch.randn(shape["n"], device="cuda", dtype=torch.float16)
            if shape.get("bias")
            else None
        )
        variants = [v for v in pk.variants if v.swiglu == shape.get("swiglu", False)]
        variants.sort(key=lambda v: v.kind == "wgmma")  # known-good mma.sync kernels first
        for m in ms:
            a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
            for v in variants:
                ok, err, scale = run_gemm_case(pk, stream, a, words, scales, deq, shape, m, v, bias)
                ok_all &= ok
                rows.append((name, m, v.label, err, scale, ok))
                if not ok:
                    log(
                        f"GEMM FAIL {name} M={m} {v.name}: err {err:.3g} (max|ref| {scale:.3g})",
                        fh,
                    )
        del words, scales, deq
    # max|err| / max|ref| per (shape, variant) and M: which kernel, which shapes, which M.
    log(f"\nmax|err|/max|ref| (tol {GEMM_REL_TOL}); * = FAIL", fh)
    log(f"{'shape':8s} {'variant':24s} " + " ".join(f"{'M=' + str(m):>9s}" for m in ms), fh)
    for name in gemm_shapes(cfg):
        for label in dict.fromkeys(r[2] for r in rows if r[0] == name):
            cells = []
            for m in ms:
                r = next(r for r in rows if r[0] == name and r[2] == label and r[1] == m)
                rel = r[3] / max(r[4], 1e-30)
                cells.append(f"{rel:8.1e}{' ' if r[5] else '*'}")
            log(f"{name:8s} {label:24s} " + " ".join(cells), fh)
    worst = max(r[3] / max(r[4], 1e-30) for r in rows)
    log(
        f"gemm correctness: {sum(r[5] for r in rows)}/{len(rows)} pass; worst max|err|/max|ref| = "
        f"{worst:.2e} (tol {GEMM_REL_TOL})",
        fh,
    )
    return ok_all, worst


def check_attention(configs, stream, gen, fh):
    ok_all, worst = True, 0.0
    for cfg, pk in configs:
        for t in ATTN_T:
            hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.float16, generator=gen)
            k = torch.randn(t, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
            v = torch.randn(t, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
            out = torch.full_like(q, float("nan"))
            torch.cuda.synchronize()
            pk.attention(q, k, v, out, t, stream=stream)
            torch.cuda.synchronize()
            err = (out.float() - attention_reference(q, k, v)).abs().max().item()
            ok = bool(torch.isfinite(out).all().item()) and err <= ATTN_ABS_TOL
            worst = max(worst, err)
            ok_all &= ok
            if not ok:
                log(f"ATTN FAIL {cfg.name} {hq}:{hkv} D={d} T={t}: max err {err:.3g}", fh)
    log(
        f"attention correctness: {'pass' if ok_all else 'FAIL'}; worst max abs err {worst:.2e} "
        f"(tol {ATTN_ABS_TOL})",
        fh,
    )
    return ok_all, worst


# -- timing ---------------------------------------------------------------------------------------
def time_ms(fn, reps=5, batch=20, warmup=3) -> float:
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
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        e0.record()
        for _ in range(batch):
            fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / batch)
    return statistics.median(times)


def time_shape(pk, stream, name, shape, gen, m=512):
    """Median ms and TFLOP/s of every tile variant and of cuBLAS fp16 on one 7B shape."""
    n, k, swiglu = shape["n"], shape["k"], shape.get("swiglu", False)
    words, scales, _ = random_int4_weight(n, k, gen)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n // 2 if swiglu else n, device="cuda", dtype=torch.float16)
    flop = 2 * m * n * k
    rows = []
    for v in (x for x in pk.variants if x.swiglu == swiglu):

        def launch(v=v):
            pk.gemm(a, words, scales, None, out, m, n, k, swiglu=swiglu, variant=v, stream=stream)

        ms = time_ms(launch)
        rows.append((name, v.label, ms, flop / ms / 1e9))
    wf = torch.randn(n, k, device="cuda", dtype=torch.float16)
    ms = time_ms(lambda: torch.matmul(a, wf.t()))
    rows.append((name, "cuBLAS fp16", ms, flop / ms / 1e9))
    picked = pk.pick_gemm(m, n, swiglu, k)
    picked_ms = next(r[2] for r in rows if r[1] == picked.label)
    rows.append((name, f"picked {picked.label}", picked_ms, flop / picked_ms / 1e9))
    return rows, picked_ms


def time_all(pk, stream, cfg, gen):
    results, best = [], {}
    for name, shape in gemm_shapes(cfg).items():
        rows, picked_ms = time_shape(pk, stream, name, shape, gen)
        results += rows
        best[name] = picked_ms  # what the engine runs: the tile pick_gemm chooses
    attn_ms = {}
    for t in ATTN_TIMED_T:
        q = torch.randn(t, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.float16)
        kv = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.float16)
        out = torch.empty_like(q)
        attn_ms[t] = time_ms(
            lambda q=q, kv=kv, out=out, t=t: pk.attention(q, kv, kv, out, t, stream=stream)
        )
        attn_flop = 4 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2
        results.append(("attention", f"T={t}", attn_ms[t], attn_flop / attn_ms[t] / 1e9))
    return results, best, attn_ms[512], sum(best.values()) + attn_ms[512]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer M values")
    ap.add_argument("--extra", action="store_true", help="also validate and time EXTRA_VARIANTS")
    ap.add_argument(
        "--only", default="", help="keep the GEMM variants whose label contains this substring"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log/JSON directory")
    ap.add_argument(
        "--parts", default="gemm,attention,timing", help="comma list: gemm, attention, timing"
    )
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    fh = open(out_dir / f"prefill_check_{'_'.join(sorted(parts))}.log", "w")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.init()
    from cuda.core import Stream

    gpu = Gpu(torch.cuda.current_device())
    log(
        f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}",
        fh,
    )
    cfg7 = preset("7b")
    t0 = time.time()
    variants = GEMM_VARIANTS + (EXTRA_VARIANTS if args.extra else ())
    variants = tuple(v for v in variants if args.only in v.label)
    if not variants:
        raise SystemExit(f"--only {args.only!r} matches no GEMM variant")
    pk = PrefillKernels(cfg7, gpu, variants)
    log(f"compile+load 7b kernels: {time.time() - t0:.2f} s", fh)
    for v in pk.variants:
        r = pk.resources[v.name]
        log(
            f"  {v.label}{' swiglu' if v.swiglu else ''}: {r.registers} regs, "
            f"{r.spill_bytes} B spilled, smem {v.smem_bytes} B, {v.threads} threads, "
            f"{pk._per_sm[v]} CTA/SM",
            fh,
        )
    r = pk.resources[pk.attention_name]
    log(f"  attention: {r.registers} regs, {r.spill_bytes} B spilled, smem {pk._attn_smem} B", fh)
    log(f"  wgmma in pick_gemm: {pk.use_wgmma} (NANOQWEN_PREFILL_WGMMA=0 turns it off)", fh)
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; logged to replay
    gen.manual_seed(seed)
    torch.manual_seed(seed)
    log(f"seed {seed}", fh)

    g_ok = a_ok = True
    summary = {}
    if "gemm" in parts:
        g_ok, g_worst = check_gemm(pk, stream, cfg7, gen, fh, args.quick)
        summary.update(gemm_ok=g_ok, gemm_worst_rel=g_worst)
    if "attention" in parts:
        gqa2 = ModelConfig("gqa2-d128", 1000, 512, 512, 1, 4, 2, 128)
        tiny = preset("tiny")
        configs = [(c, PrefillKernels(c, gpu)) for c in (gqa2, tiny)]
        a_ok, a_worst = check_attention([(cfg7, pk), *configs], stream, gen, fh)
        summary.update(attn_ok=a_ok, attn_worst_abs=a_worst)
    if "timing" in parts:
        results, best, attn_ms, per_layer = time_all(pk, stream, cfg7, gen)
        log(
            "\nshape      variant                        ms   TFLOP/s   (M = 512, 5 x 20 calls)", fh
        )
        for name, var, ms, tf in results:
            log(f"{name:10s} {var:28s} {ms:8.4f} {tf:9.1f}", fh)
        total = per_layer * cfg7.num_layers
        log(
            f"\nper layer: picked GEMMs {sum(best.values()):.3f} ms + attention {attn_ms:.3f} ms; "
            f"x{cfg7.num_layers} layers = {total:.2f} ms projected 512-token prefill",
            fh,
        )
        summary.update(best_ms=best, attn_ms=attn_ms, projected_prefill_ms=total, table=results)
    (out_dir / f"prefill_check_{'_'.join(sorted(parts))}.json").write_text(
        json.dumps(summary, indent=1)
    )
    log(f"RESULT gemm {'PASS' if g_ok else 'FAIL'} attention {'PASS' if a_ok else 'FAIL'}", fh)
    return 0 if (g_ok and a_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
