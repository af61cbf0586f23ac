"""Tune the decode kernels on an sm_90 GPU by sweeping their constexpr knobs (and the launch
constants of nanoqwen/cuda/kernels.py) inside the whole decode step, or decode attention alone.

    PYTHONPATH=. python3 tools/kernel_tune.py step FILE.nanoqwen \
        --set kGvStageTarget=8192,16384 --set GEMV_CTAS_PER_SM=1,2 --context 513,8193
    PYTHONPATH=. python3 tools/kernel_tune.py attention FILE.nanoqwen \
        --set kAttnMinPages=2,8 --grid-y 16,64 --context 513,8193,32768

`step` applies each variant (`NAME=V`: a `constexpr int NAME = V;` line of whichever kernel
file holds it, or an upper-case int constant of nanoqwen.cuda.kernels or, for the generated
header's launch constants such as ATTN_STAGES, nanoqwen.cuda.jit), rebuilds the decode
kernels and prints bench --kernels' per-kernel breakdown of one decode step (each label's
launches over every layer's own weights, one graph of `--reps` copies) and the whole step:
what the kernels do to each other under PDL shows up there only. The validation ladder
(`nanoqwen validate`) is what proves a kept variant correct.

`attention` times the decode attention variant alone (one graph over every layer's KV cache,
nothing served from L2), after checking it against the shipped kernel on layer 0 (max relative
difference of the outputs, printed as err); the median of 5 graph launches / launches is
microseconds per launch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys

import numpy as np

from nanoqwen.bench import kernel_breakdown, time_graph
from nanoqwen.cuda import jit
from nanoqwen.cuda.kernels import ATTN_THREADS, S_POS, STATE_WORDS
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
    baseline = [] if variants == [{}] else [{}]  # {}: the shipped kernels, timed once
    for values in baseline + variants:
        consts = {n: v for n, v in values.items() if n.isupper()}
        owner = {n: kmod if hasattr(kmod, n) else jit for n in consts}
        if consts.get("ATTN_SPLITS", 0) > jit.ATTN_SPLITS:  # the engine sized its scratch
            raise SystemExit("ATTN_SPLITS: at most the shipped value (edit jit.py to go above)")
        saved = {n: getattr(owner[n], n, None) for n in consts}
        with tempfile.TemporaryDirectory() as tmp:
            for src in shipped.iterdir():
                shutil.copy(src, tmp)
            for name, v in values.items():
                if name in consts:
                    if not isinstance(saved[name], int):
                        raise SystemExit(f"{name}: not an int constant of nanoqwen.cuda.kernels "
                                         "or nanoqwen.cuda.jit")  # fmt: skip
                    continue
                hits = [
                    p for p in Path(tmp).glob("*.cu") if f"constexpr int {name} = " in p.read_text()
                ]
                if len(hits) != 1:
                    raise SystemExit(f"{name}: in {len(hits)} kernel files")
                hits[0].write_text(variant_source(hits[0], {name: v}))
            # The constants stay set while the variant is timed: some (ATTN_CTAS) are read at
            # every launch, not only when the kernels are built.
            for n, v in consts.items():
                setattr(owner[n], n, v)
            try:
                jit.KERNEL_DIR = Path(tmp)
                try:
                    e.k = kmod.DecodeKernels(e.gpu, e.config)
                finally:
                    jit.KERNEL_DIR = shipped
                for ctx in args.context:
                    res = kernel_breakdown(e, ctx - 1, args.reps)
                    us = res["whole_step"]["us"]
                    per = {r["label"]: r["us"] / r["count"] for r in res["rows"]}
                    rows.append(dict(kernel="step", **values, context=ctx, us=us,
                                     per_launch_us=per))  # fmt: skip
                    cols = "  ".join(f"{k} {v:.2f}" for k, v in per.items())
                    print(f"step {values or 'shipped'} ctx {ctx:6}  {us:8.1f} us   {cols}",
                          flush=True)  # fmt: skip
            finally:
                for n, v in saved.items():
                    setattr(owner[n], n, v)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=("attention", "step"))
    ap.add_argument("file")
    ap.add_argument("--set", action="append", default=[], help="NAME=v1,v2 (constexpr sweep)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--grid-y", type=lambda s: [int(v) for v in s.split(",")], default=[64])
    ap.add_argument("--context", type=lambda s: [int(v) for v in s.split(",")], default=[513])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    axes = [(n, [int(v) for v in vs.split(",")]) for n, vs in (s.split("=") for s in args.set)]
    variants = [dict(zip([n for n, _ in axes], combo, strict=True))
                for combo in itertools.product(*[vs for _, vs in axes])]  # fmt: skip
    f = NanoqwenFile(args.file)
    max_ctx = max(args.context) + args.reps
    e = CudaBackend(f, max_context=max_ctx)
    tune = {"attention": tune_attention, "step": tune_step}[args.kernel]
    rows = tune(e, variants, args)
    print("\nbest:")
    key = ("kernel", "context")
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
