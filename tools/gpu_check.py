"""The decode engine's device script: one call does build + checks + timings, table last.

    python3 tools/gpu_check.py --unit 7b,tiny --models tiny,1.5b --graph-prompts 20 \
        --bench 1.5b --out $OUT

Stages (each isolated: a failure is logged with its traceback and the next stage runs):
  kernels   NVRTC-compile the decode table for every preset named anywhere (ptxas resources)
  unit      validate.unit_tier for each preset in --unit (no model file needed)
  models    pack_synthetic(preset) under /tmp once, CudaBackend, layer + graph tiers
  bench     run_bench on the packed model; JSON written to --out/bench_<preset>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoqwen import validate as v  # noqa: E402
from nanoqwen.config import preset  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def stage(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
                ROWS.append((name, "ok", f"{time.perf_counter() - t0:.1f}s"))
                return out
            except Exception as exc:
                traceback.print_exc()
                ROWS.append((name, "ERROR", f"{type(exc).__name__}: {str(exc)[:300]}"))
                return None

        return run

    return wrap


def packed(name: str) -> str:
    path = f"/tmp/synthetic-{name}.nanoqwen"
    if not os.path.exists(path):
        from nanoqwen.convert import pack_synthetic

        t0 = time.perf_counter()
        pack_synthetic(name, path, seed=0, progress=False)
        print(f"packed {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unit", default="")
    ap.add_argument("--models", default="")
    ap.add_argument("--graph-prompts", type=int, default=20)
    ap.add_argument("--bench", default="")
    ap.add_argument("--bench-runs", type=int, default=10)
    ap.add_argument("--pdl", type=int, default=1)
    ap.add_argument("--graph", default="while")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    ladder = v.load_ladder()["ladder"]
    checks: list[v.Check] = []
    names = {n for n in (args.unit + "," + args.models + "," + args.bench).split(",") if n}

    @stage("kernels")
    def kernels():
        from nanoqwen.cuda import jit

        for n in sorted(names):
            for mod in jit.compile_decode(preset(n)).values():
                for k, r in mod.resources().items():
                    print(f"{n:5} {k:36} regs {r.registers:3} smem {r.smem_bytes:6} "
                          f"spill {r.spill_bytes}")  # fmt: skip

    kernels()
    for n in filter(None, args.unit.split(",")):
        res = stage(f"unit {n}")(v.unit_tier)(preset(n), ladder["unit"]["tolerances"])
        checks += [v.Check(c.tier, f"[{n}] {c.name}", c.ok, c.detail) for c in res or []]

    engines = {}

    def engine_for(n):
        from nanoqwen.engine import CudaBackend
        from nanoqwen.fileformat import NanoqwenFile

        if n not in engines:
            f = NanoqwenFile(packed(n))
            engines[n] = (CudaBackend(f, max_context=4096, pdl=bool(args.pdl), graph=args.graph), f)
        return engines[n]

    for n in filter(None, args.bench.split(",")):

        @stage(f"bench {n}")
        def bench(n=n):
            from nanoqwen.bench import print_result, run_bench, save

            e, _ = engine_for(n)
            res = run_bench(e, runs=args.bench_runs)
            res["pdl"] = e.k.pdl
            res["gemv"] = e.k.gemv_variant
            print_result(res)
            save(res, os.path.join(args.out, f"bench_{n}.json"))
            return res

        bench()

    for n in filter(None, args.models.split(",")):

        @stage(f"layer {n}")
        def layer(n=n):
            e, f = engine_for(n)
            return v.layer_tier(e, f, ladder["layer"]["tolerance"])

        @stage(f"graph {n}")
        def graph(n=n):
            e, f = engine_for(n)
            return v.graph_tier(e, f, ladder["graph"], args.graph_prompts)

        for res in (layer(), graph()):
            new = [v.Check(c.tier, f"[{n}] {c.name}", c.ok, c.detail) for c in res or []]
            v.print_table(new)
            checks += new

    print("\n==== checks ====")
    v.print_table(checks)
    print("\n==== stages ====")
    for r in ROWS:
        print(f"{r[0]:14} {r[1]:6} {r[2]}")
    with open(os.path.join(args.out, "checks.json"), "w") as f:
        json.dump([c.__dict__ for c in checks] + [{"stage": r} for r in ROWS], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
