"""Speculative decoding against plain greedy on the three workloads, one GPU call: issue #26's
targets (real Qwen2.5-Coder-1.5B: edit >= 2.5x, fim >= 1.3x, chat >= 0.98x effective tokens/s,
outputs identical).

    PYTHONPATH=. python3 dev/spec_workloads.py FILE [--workloads edit,fim,chat] [--requests 8]
        [--gen-len 128] [--runs 3] [--spec-k 8] [--spec-ngram 3:5] [--backend cuda]
        [--down engine|gemm|rows] [--json PATH]

Each workload is `nanoqwen bench --workload W` (nanoqwen/harness/spec_bench.py): the same
prompts plain then speculative on the same backend kind. Validate: each prompt's speculative
tokens against its plain tokens (the first differing index when not). Time: decode ms/token
of each mode, medians over --runs. A workload that fails does not stop the others. RESULT
last: one row a workload with its target and whether it is met. --down gemm|rows forces the
verify step's down_proj path (engine.verify.down_gemm, replaced for this process) to A/B the
engine's rule.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

from nanoqwen.engine import verify
from nanoqwen.harness.spec_bench import print_spec_result, run_spec_bench
from nanoqwen.harness.workloads import WORKLOADS, build
from nanoqwen.llm import LLM
from nanoqwen.speculative import SpeculativeConfig, resolve

TARGETS = {"edit": 2.5, "fim": 1.3, "chat": 0.98}  # speed-up over plain greedy (issue #26)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", help=".nanoqwen model")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    base = SpeculativeConfig()
    p.add_argument("--spec-k", type=int, default=base.k)
    p.add_argument("--spec-ngram", default=f"{base.n_min}:{base.n_max}")
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--down", choices=("engine", "gemm", "rows"), default="engine",
                   help="the verify step's down_proj: the engine's rule, or forced")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    spec = resolve("ngram", args.spec_k, args.spec_ngram)
    if args.down != "engine":
        verify.down_gemm = lambda *_: args.down == "gemm"  # looked up when Verify is built

    def open_llm(config):
        return LLM(args.file, backend=args.backend, max_context=args.max_context,
                   speculative=config)  # fmt: skip

    results = {}
    for workload in args.workloads.split(","):
        t0 = time.time()
        try:
            prompts = build(workload, args.requests, args.seed)
            results[workload] = run_spec_bench(open_llm, workload, prompts, spec, args.gen_len,
                                               args.warmup, args.runs)  # fmt: skip
            print_spec_result(results[workload])
        except Exception:  # the other workloads still run
            print(f"{workload}: FAILED\n{traceback.format_exc()}", flush=True)
            results[workload] = None
        print(f"[{workload}: {time.time() - t0:.1f} s]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "verify_down": args.down}, f, indent=2)
    print(f"\nRESULT speculative ({spec.method} k={spec.k} n={spec.n_min}:{spec.n_max}) vs plain "
          f"greedy, {args.requests} prompts, gen {args.gen_len}, {args.backend}, verify down_proj "
          f"{args.down}")  # fmt: skip
    print(f"  {'workload':9} {'plain t/s':>10} {'spec t/s':>10} {'speed-up':>9} {'target':>7} "
          f"{'acc/step':>9} {'identical':>10}")  # fmt: skip
    ok = True
    for workload, res in results.items():
        if res is None:
            print(f"  {workload:9} FAILED")
            ok = False
            continue
        target = TARGETS.get(workload, 0.0)
        met = res["speedup"] >= target
        ok &= met and res["identical"]
        same = "yes" if res["identical"] else f"no @{res['first_difference']}"
        print(f"  {workload:9} {res['plain_tokens_per_s']:10.1f} "
              f"{res['speculative_tokens_per_s']:10.1f} {res['speedup']:8.2f}x "
              f"{target:6.2f}{'' if met else '!'} {res['acceptance']['accepted_per_step']:9.2f} "
              f"{same:>10}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
