"""Tune the decode GEMV (kernels/gemv_int4.cu) and decode attention (kernels/decode_attention.cu)
on an sm_90 GPU by sweeping their constexpr knobs, alone or inside the whole decode step.

    PYTHONPATH=. python3 tools/kernel_tune.py gemv FILE.nanoqwen \
        --set kTcUnroll=2,4 --set kL2Ahead=0,1,2 [--ctas-per-sm 2,4] [--json OUT.json]
    PYTHONPATH=. python3 tools/kernel_tune.py attention FILE.nanoqwen \
        --set kAttnMinPages=2,8 --grid-y 16,64 --context 513,8193,32768
    PYTHONPATH=. python3 tools/kernel_tune.py step FILE.nanoqwen --set kFold=0,1 --context 513

`step` applies each variant to whichever kernel file holds the knob, rebuilds the decode
kernels from those sources and times the whole decode step (one graph of `--reps` steps, the
token's position fixed): what the kernels do to each other under PDL shows up there only.

Each variant is the shipped source with `constexpr int NAME = V;` lines replaced, compiled
through nanoqwen.cuda.jit. It is first checked against the shipped kernel on layer 0 (max
relative difference of the outputs, printed as err), then timed: one CUDA graph runs the kernel
over every layer's own weights or KV cache (nothing is served from L2, as in the decode step),
`--reps` times; the median of 5 graph launches / launches is microseconds per launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys

import numpy as np

from nanoqwen.bench import time_graph
from nanoqwen.cuda import jit
from nanoqwen.cuda.kernels import ATTN_THREADS, GEMV_THREADS, S_POS, STATE_WORDS
from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile


def variant_source(path, values: dict[str, int]) -> str:
    text = path.read_text()
    for name, v in values.items():
        text, n = re.subn(rf"constexpr int {name} = \d+;", f"constexpr int {name} = {v};", text)
        if n != 1:
            raise SystemExit(f"{name}: not a `constexpr int {name} = N;` line of {path.name}")
    return text


def graph_us(gpu, kernel, grid, threads, arg_sets, reps: int, smem: int = 0) -> float:
    """Microseconds per launch of `kernel` over `arg_sets` (one launch each, PDL), in one
    graph repeated `reps` times (bench.time_graph: events, median of its timed launches)."""

    def body(stream) -> None:
        for a in arg_sets:
            gpu.launch(kernel, grid, threads, *a, smem=smem, pdl=True, stream=stream)

    return 1e6 * time_graph(gpu, body, reps) / len(arg_sets)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.sqrt(np.mean(a**2)), 1e-30))


def set_pos(e, pos: int) -> None:
    st = np.zeros(STATE_WORDS, np.int32)
    st[S_POS] = pos
    e.gpu.upload(e.state, st)


def tune_gemv(e, variants, args) -> list[dict]:
    cfg, gpu = e.config, e.gpu
    h, i = cfg.hidden_size, cfg.intermediate_size
    nqkv = cfg.q_size + 2 * cfg.kv_size
    rng = np.random.default_rng(0)
    xin = gpu.alloc(i * 2, "x in")
    gpu.upload(xin.ptr, (rng.standard_normal(i) * 0.5).astype(np.float16))
    outs = [gpu.alloc(max(nqkv, i, h) * 2, "out") for _ in range(2)]
    pos = e.state + 4 * S_POS
    set_pos(e, 100)
    i32 = np.int32

    def kargs(kind, L, out):  # (kernel args, N, weight rows)
        if kind == "qkv":
            return (xin.ptr, L.in_norm, L.qkv_w, L.qkv_s, L.qkv_b, out, i32(nqkv), pos, e.rope,
                    e.pages, L.kc, L.vc), nqkv, nqkv  # fmt: skip
        if kind == "o":
            return (xin.ptr, 0, L.o_w, L.o_s, 0, out, i32(h), 0, 0, 0, 0, 0), h, h
        if kind == "gate_up":
            return (xin.ptr, L.post_norm, L.gu_w, L.gu_s, 0, out, i32(i), 0, 0, 0, 0, 0), i, 2 * i
        return (xin.ptr, 0, L.d_w, L.d_s, 0, out, i32(h), 0, 0, 0, 0, 0), h, h

    names = {"qkv": f"gemv_int4<{h}, true, 0>", "o": f"gemv_int4<{h}, false, 1>",
             "gate_up": f"gemv_int4<{h}, true, 2>",
             "down": f"gemv_int4<{i}, false, 1>"}  # fmt: skip
    kdim = {"qkv": h, "o": h, "gate_up": h, "down": i}
    ref = jit.compile_module("gemv_int4.cu", list(names.values()), cfg)
    rows = []
    for values in variants:
        src = variant_source(jit.KERNEL_DIR / "gemv_int4.cu", values)
        mod = jit.compile_module("gemv_int4.cu", list(names.values()), cfg, source=src)
        res = mod.resources()
        threads = values.get("kTcWarps", GEMV_THREADS // 32) * 32
        for kind, name in names.items():
            kern = mod.kernel(name)
            outv = []
            for o, kk, th in ((outs[0], ref.kernel(name), GEMV_THREADS), (outs[1], kern, threads)):
                a, n, _ = kargs(kind, e.layers[0], o.ptr)
                gpu.memset(o.ptr, 0, o.nbytes)
                gpu.launch(kk, (min(-(-n // 8), 4 * gpu.num_sms), 1, 1), th, *a)
                outv.append(gpu.download(o.ptr, np.empty(n, np.float16)))
            if kind == "qkv":  # the q part (k/v went to the caches)
                outv = [v[: cfg.q_size] for v in outv]
            err = rel(*outv)
            _, n, nrows = kargs(kind, e.layers[0], 0)
            wbytes = nrows * kdim[kind] // 2 + nrows * kdim[kind] // 64
            for cps in args.ctas_per_sm:
                grid = (min(-(-n // 8), cps * gpu.num_sms), 1, 1)
                sets = [kargs(kind, L, outs[0].ptr)[0] for L in e.layers]
                us = graph_us(gpu, kern, grid, threads, sets, args.reps)
                row = dict(kernel=kind, **values, ctas_per_sm=cps, us=us, tb_s=wbytes / us / 1e6,
                           regs=res[name].registers, err=err)  # fmt: skip
                rows.append(row)
                print(f"{kind:8} {values} c{cps}  {us:8.2f} us  {row['tb_s']:6.3f} TB/s  "
                      f"regs {row['regs']}  err {err:.1e}", flush=True)  # fmt: skip
    return rows


def tune_attention(e, variants, args) -> list[dict]:
    cfg, gpu = e.config, e.gpu
    rng = np.random.default_rng(0)
    q = gpu.alloc(cfg.q_size * 2, "q")
    gpu.upload(q.ptr, rng.standard_normal(cfg.q_size).astype(np.float16))
    kv = (rng.standard_normal(e.num_pages * 16 * cfg.kv_size) * 0.3).astype(np.float16)
    for L in e.layers:  # finite K/V everywhere
        gpu.upload(L.kc, kv)
        gpu.upload(L.vc, kv[::-1].copy())
    outs = [gpu.alloc(cfg.q_size * 2, "out") for _ in range(2)]
    pos = e.state + 4 * S_POS
    ref = jit.compile_module("decode_attention.cu", ["attn_decode"], cfg)
    rows = []

    def kargs(L, out):
        return (q.ptr, L.kc, L.vc, e.pages, pos, e.part_ml, e.part_acc, e.attn_count, out)

    for values in variants:
        src = variant_source(jit.KERNEL_DIR / "decode_attention.cu", values)
        mod = jit.compile_module("decode_attention.cu", ["attn_decode"], cfg, source=src)
        kern, regs = mod.kernel("attn_decode"), mod.resources()["attn_decode"].registers
        smem = e.k._attn_smem
        gpu.set_max_dynamic_smem(kern, smem)
        gpu.set_max_dynamic_smem(ref.kernel("attn_decode"), smem)
        for ctx, gy in itertools.product(args.context, args.grid_y):
            set_pos(e, ctx - 1)
            outv = []
            for o, kk in ((outs[0], ref.kernel("attn_decode")), (outs[1], kern)):
                gpu.launch(kk, (cfg.num_kv_heads, gy, 1), ATTN_THREADS, *kargs(e.layers[0], o.ptr),
                           smem=smem)  # fmt: skip
                outv.append(gpu.download(o.ptr, np.empty(cfg.q_size, np.float16)))
            err = rel(*outv)
            sets = [kargs(L, outs[0].ptr) for L in e.layers]
            us = graph_us(gpu, kern, (cfg.num_kv_heads, gy, 1), ATTN_THREADS, sets, args.reps, smem)
            kv = ctx * cfg.kv_size * 2 * 2
            row = dict(kernel="attention", **values, context=ctx, grid_y=gy, us=us,
                       tb_s=kv / us / 1e6, regs=regs, err=err)  # fmt: skip
            rows.append(row)
            print(f"attn {values} ctx {ctx:6} y{gy:3}  {us:8.2f} us  {row['tb_s']:6.3f} TB/s  "
                  f"regs {regs}  err {err:.1e}", flush=True)  # fmt: skip
    return rows


def tune_step(e, variants, args) -> list[dict]:
    import shutil
    import tempfile
    from pathlib import Path

    import nanoqwen.cuda.kernels as kmod

    shipped, rows = jit.KERNEL_DIR, []
    carveouts = [{"carveout": c} for c in args.carveout]
    baseline = [] if variants == [{}] else [{}]  # {}: the shipped kernels, timed once
    for values in baseline + variants + carveouts:
        with tempfile.TemporaryDirectory() as tmp:
            for src in shipped.iterdir():
                shutil.copy(src, tmp)
            for name, v in values.items():
                if name == "carveout":
                    continue
                hits = [
                    p for p in Path(tmp).glob("*.cu") if f"constexpr int {name} = " in p.read_text()
                ]
                if len(hits) != 1:
                    raise SystemExit(f"{name}: in {len(hits)} kernel files")
                hits[0].write_text(variant_source(hits[0], {name: v}))
            jit.KERNEL_DIR, shipped_carveout = Path(tmp), kmod.SMEM_CARVEOUT
            kmod.SMEM_CARVEOUT = values.get("carveout", shipped_carveout)
            try:
                e.k = kmod.DecodeKernels(e.gpu, e.config)
            finally:
                jit.KERNEL_DIR, kmod.SMEM_CARVEOUT = shipped, shipped_carveout
        for ctx in args.context:
            set_pos(e, ctx - 1)
            us = 1e6 * time_graph(e.gpu, lambda stream: e._step(stream, sample=False), args.reps)
            rows.append(dict(kernel="step", **values, context=ctx, us=us))
            print(f"step {values or 'shipped'} ctx {ctx:6}  {us:8.1f} us", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=("gemv", "attention", "step"))
    ap.add_argument("file")
    ap.add_argument("--set", action="append", default=[], help="NAME=v1,v2 (constexpr sweep)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ctas-per-sm", type=lambda s: [int(v) for v in s.split(",")], default=[4])
    ap.add_argument("--grid-y", type=lambda s: [int(v) for v in s.split(",")], default=[64])
    ap.add_argument("--context", type=lambda s: [int(v) for v in s.split(",")], default=[513])
    ap.add_argument(
        "--carveout",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[],
        help="step: SMEM_CARVEOUT percentages to try (-1: the driver's choice)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    axes = [(n, [int(v) for v in vs.split(",")]) for n, vs in (s.split("=") for s in args.set)]
    variants = [dict(zip([n for n, _ in axes], combo, strict=True))
                for combo in itertools.product(*[vs for _, vs in axes])]  # fmt: skip
    f = NanoqwenFile(args.file)
    max_ctx = max(args.context) + args.reps if args.kernel != "gemv" else 1024
    e = CudaBackend(f, max_context=max_ctx)
    tune = {"gemv": tune_gemv, "attention": tune_attention, "step": tune_step}[args.kernel]
    rows = tune(e, variants, args)
    print("\nbest:")
    key = ("kernel",) if args.kernel == "gemv" else ("kernel", "context")
    for group in sorted({tuple(r.get(k) for k in key) for r in rows}, key=str):
        best = sorted((r for r in rows if tuple(r.get(k) for k in key) == group),
                      key=lambda r: r["us"])[:3]  # fmt: skip
        for r in best:
            print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in r.items()))  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": e.gpu.name, "model": f.config.name, "rows": rows}, fh, indent=1)
    e.close()
    f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
