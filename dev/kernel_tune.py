"""Tune the decode kernels on an sm_90 GPU by sweeping the registry's geometry inside the whole
decode step, or decode attention alone.

    PYTHONPATH=. python3 dev/kernel_tune.py step FILE.nanoqwen \
        --set kGvStageTarget=8192,16384 --set kGvCtasPerSm=1,2 --context 513,8193
    PYTHONPATH=. python3 dev/kernel_tune.py attention FILE.nanoqwen \
        --set kAttnMinPages=2,8 --set kAttnCtas=64,128 --context 513,8193,32768

`--set NAME=v1,v2`: NAME is a field of nanoqwen.cuda.registry.Geometry by its header name
(kGvEarlyStages, kAttnCtas, ...: the kernels' constexpr tunables and the launchers' geometry);
every combination of the values is a variant, DEFAULT_GEOMETRY.override(values), with a
generated header (and a compile-cache entry) of its own. The shipped geometry is timed first.
Every variant is compiled (NVRTC, no GPU) before the first is timed, so a value a kernel's
static_assert refuses ends the run at once.

`step` builds CudaBackend(file, max_context, geometry=variant) for each variant in turn and
prints bench --kernels' per-kernel breakdown of one decode step (harness.bench
kernel_breakdown: each label's launches over every layer's own weights, one graph of `--reps`
copies) and the whole step: what the kernels do to each other under PDL shows up there only.
The validation ladder (`nanoqwen validate`) is what proves a kept variant correct.

`attention` builds DecodeKernels(gpu, config, variant) over a KV cache of random K/V (no
weights) and times its attention over every layer's cache in one graph (harness.bench
time_graph; nothing served from L2), after checking it against the shipped geometry's kernel
on layer 0 (max difference over the rms of the outputs, printed as err): microseconds per
launch and the K/V read rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

from nanoqwen.config import PAGE_TOKENS
from nanoqwen.cuda import registry
from nanoqwen.cuda.decode import DecodeKernels
from nanoqwen.cuda.device import Gpu
from nanoqwen.engine import CudaBackend
from nanoqwen.engine.kv_cache import KVCache
from nanoqwen.errors import DeviceError
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.bench import kernel_breakdown, time_graph


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.sqrt(np.mean(a**2)), 1e-30))


class Attention:
    """Decode attention of one DecodeKernels over a shared KV cache, q and position, with the
    split scratch its geometry asks for."""

    def __init__(self, kernels: DecodeKernels, kv: KVCache, q: int, pos: int):
        self.kernels, self.kv, self.q, self.pos = kernels, kv, q, pos
        self.scratch = kernels.attention_scratch()

    def __call__(self, layer: int, out: int, stream=None) -> None:
        kv, sc = self.kv, self.scratch
        self.kernels.attention(self.q, kv.k[layer], kv.v[layer], kv.page_table, self.pos,
                               sc.part_ml.ptr, sc.part_acc.ptr, sc.counters.ptr, out,
                               stream=stream)  # fmt: skip

    def free(self) -> None:
        self.scratch.free()


def tune_attention(f: NanoqwenFile, sweep, args) -> tuple[str, list[dict]]:
    cfg, gpu = f.config, Gpu()
    rng = np.random.default_rng(0)
    # The K pools in the larger format (K_CACHE): a kKParts=1 variant reads the same finite
    # values in its own layout.
    kv = KVCache(gpu, cfg, max(args.context), k_parts=2)
    vals = (rng.standard_normal(kv.num_pages * PAGE_TOKENS * cfg.kv_size) * 0.3).astype(np.float16)
    for i in range(cfg.num_layers):  # finite K/V everywhere
        gpu.upload(kv.k[i], np.concatenate([vals, vals[::-1]]))
        gpu.upload(kv.v[i], vals[::-1].copy())
    q = gpu.alloc(cfg.q_size * 2, "q")
    gpu.upload(q.ptr, rng.standard_normal(cfg.q_size).astype(np.float16))
    pos = gpu.alloc(4, "pos")
    outs = [gpu.alloc(cfg.q_size * 2, "out") for _ in range(2)]
    shipped = Attention(DecodeKernels(gpu, cfg), kv, q.ptr, pos.ptr)
    rows = []
    for values, geometry in sweep:
        kernels = DecodeKernels(gpu, cfg, geometry)
        attend = Attention(kernels, kv, q.ptr, pos.ptr)
        regs = kernels.resources[kernels.specs["attention"].expression].registers
        for ctx in args.context:
            gpu.upload(pos.ptr, np.array([ctx - 1], np.int32))
            shipped(0, outs[0].ptr)
            attend(0, outs[1].ptr)
            err = rel(*(gpu.download(o.ptr, np.empty(cfg.q_size, np.float16)) for o in outs))

            def body(s, attend=attend) -> None:
                for i in range(cfg.num_layers):
                    attend(i, outs[0].ptr, s)

            us = 1e6 * time_graph(gpu, body, args.reps) / cfg.num_layers
            kv_bytes = ctx * cfg.kv_size * 2 * (geometry.k_parts + 1)
            row = dict(kernel="attention", **values, context=ctx, splits=kernels.attn_splits,
                       us=us, tb_s=kv_bytes / us / 1e6, regs=regs, err=err)  # fmt: skip
            rows.append(row)
            print(f"attn {values or 'shipped'} ctx {ctx:6} splits {kernels.attn_splits:3}  "
                  f"{us:8.2f} us  {row['tb_s']:6.3f} TB/s  regs {regs}  err {err:.1e}",
                  flush=True)  # fmt: skip
        attend.free()
    name = gpu.name
    gpu.close()
    return name, rows


def tune_step(f: NanoqwenFile, sweep, args) -> tuple[str, list[dict]]:
    rows, name = [], ""
    for values, geometry in sweep:
        e = CudaBackend(f, max_context=max(args.context) + args.reps, geometry=geometry)
        try:
            name = e.gpu.name
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
            e.close()
    return name, rows


def parse_sweep(ap: argparse.ArgumentParser, sets: list[str]) -> list[tuple[dict, object]]:
    """[(values, Geometry)]: the shipped geometry, then every combination of --set's values."""
    axes = []
    for s in sets:
        name, _, vs = s.partition("=")
        try:
            axes.append((name, [int(v) for v in vs.split(",")]))
        except ValueError:
            ap.error(f"--set {s!r}: expected NAME=v1,v2,... with integer values")
    names = [n for n, _ in axes]
    if len(set(names)) != len(names):
        ap.error(f"--set names a value twice: {names}")
    variants = [dict(zip(names, combo, strict=True))
                for combo in itertools.product(*[vs for _, vs in axes])]  # fmt: skip
    sweep = []
    for values in [{}] if variants == [{}] else [{}, *variants]:
        try:
            sweep.append((values, registry.DEFAULT_GEOMETRY.override(values)))
        except ValueError as exc:  # not a Geometry field (derived sizes are not either)
            ap.error(f"--set: {exc}")
    return sweep


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("kernel", choices=("attention", "step"))
    ap.add_argument("file")
    ap.add_argument("--set", action="append", default=[], help="NAME=v1,v2 (kGvEarlyStages=0,1)")
    ap.add_argument("--reps", type=int, default=10, help="copies of the timed launches a graph")
    ap.add_argument("--context", type=lambda s: [int(v) for v in s.split(",")], default=[513])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sweep = parse_sweep(ap, args.set)
    f = NanoqwenFile(args.file)
    cfg = f.config
    for values, geometry in sweep:  # CudaBackend builds the prefill's kernels too
        specs = (registry.kernel_table if args.kernel == "step" else registry.decode_specs)(
            cfg, geometry
        )
        try:
            registry.compile_specs(specs, cfg, geometry)
        except DeviceError as exc:
            raise SystemExit(f"{values}: the kernels do not build:\n{exc}") from None
    tune = {"attention": tune_attention, "step": tune_step}[args.kernel]
    gpu_name, rows = tune(f, sweep, args)
    print("\nbest:")
    key = ("kernel", "context")
    for group in sorted({tuple(r.get(k) for k in key) for r in rows}, key=str):
        best = sorted((r for r in rows if tuple(r.get(k) for k in key) == group),
                      key=lambda r: r["us"])[:3]  # fmt: skip
        for r in best:
            print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in r.items() if k != "per_launch_us"))  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": gpu_name, "model": cfg.name, "rows": rows}, fh, indent=1)
    f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
