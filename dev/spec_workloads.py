"""Speculative decoding against plain decoding on the three workloads, one GPU call: issue #26's
targets (real Qwen2.5-Coder-1.5B: edit >= 2.5x, fim >= 1.3x, chat >= 1.00x effective tokens/s,
greedy outputs identical).

    PYTHONPATH=. python3 dev/spec_workloads.py FILE [--workloads edit,fim,chat] [--requests 8]
        [--gen-len 128] [--runs 3] [--spec-k 15] [--spec-ngram 3:5] [--spec-backoff 0,16:1,16:0]
        [--sampled] [--backend cuda] [--down engine|split|rows] [--margins] [--json PATH]

Each (backoff, workload) is `nanoqwen bench --workload W --spec-backoff CAP` with the config's
backoff_grace set to GRACE (nanoqwen/harness/spec_bench.py; --spec-backoff takes CAP[:GRACE],
the config's grace when left out): the same prompts plain then speculative on the same backend
kind, greedy, or with --sampled at temperature 0.8, top-k 50, top-p 0.95 (prompt i seeded with
i). Validate (greedy): each prompt's speculative tokens against its plain tokens (the first
differing index when not). Time: decode ms/token of each mode, medians over --runs. A run that
fails does not stop the others. RESULT last: one row a (backoff, workload) with its target and
whether it is met; --spec-backoff 0 is speculation without the backoff, for the A/B. --down
split|rows forces the verify step's down_proj path (engine.verify.down_path, replaced for
this process) to A/B the engine's rule. --margins: where a greedy reply parts from the plain
one, the float32 reference's top-2 margin there (nanoqwen.reference on the GPU; the ladder's
greedy rule calls a split under ladder.graph.near_tie_over_std std a near-tie).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace

from nanoqwen.engine import verify
from nanoqwen.harness import import_torch_first
from nanoqwen.harness.spec_bench import print_spec_result, run_spec_bench
from nanoqwen.harness.workloads import WORKLOADS, build
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import SpeculativeConfig, resolve

TARGETS = {"edit": 2.5, "fim": 1.3, "chat": 1.0}  # speed-up over plain decoding (issue #26)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)


def backoff(spec: SpeculativeConfig, text: str) -> SpeculativeConfig:
    """spec with the backoff "CAP[:GRACE]" (GRACE: spec's when left out)."""
    cap, _, grace = text.partition(":")
    return replace(spec, backoff_cap=int(cap), backoff_grace=int(grace or spec.backoff_grace))


def reference_margin(file: str, max_context: int):
    """margin(ids, a, b) for run_spec_bench: |logit a - logit b| / std of the float32
    reference's logits after ids (built on first use, on the GPU)."""
    import numpy as np

    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.reference import ReferenceBackend

    ref = None

    def margin(ids: list[int], a: int, b: int) -> float:
        nonlocal ref
        ref = ref or ReferenceBackend(NanoqwenFile(file), max_context=max_context,
                                      device="cuda", prefix_caching=False)  # fmt: skip
        row = ref.logits(ids)[-1]
        return abs(float(row[a]) - float(row[b])) / float(np.std(row))

    return margin


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
    p.add_argument("--spec-backoff", default=f"{base.backoff_cap}:{base.backoff_grace}",
                   help="comma list of CAP[:GRACE], a run of each workload each")  # fmt: skip
    p.add_argument("--sampled", action="store_true",
                   help="temperature 0.8, top-k 50, top-p 0.95 instead of greedy")  # fmt: skip
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--down", choices=("engine", *verify.DOWN_PATHS), default="engine",
                   help="the verify step's down_proj: the engine's rule, or forced")  # fmt: skip
    p.add_argument("--margins", action="store_true",
                   help="the float32 reference's margin where greedy replies part")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    specs = [backoff(resolve("ngram", args.spec_k, args.spec_ngram), b)
             for b in args.spec_backoff.split(",")]  # fmt: skip
    sampling = SAMPLED if args.sampled else None
    if args.down != "engine":
        verify.down_path = lambda *_: args.down  # looked up when Verify is built

    def open_llm(config):
        return LLM(args.file, backend=args.backend, max_context=args.max_context,
                   speculative=config)  # fmt: skip

    if args.margins:
        import_torch_first()  # the reference is built after the engine's kernels
    margin = reference_margin(args.file, args.max_context) if args.margins else None
    results = {}
    for spec in specs:
        for workload in args.workloads.split(","):
            name = f"backoff {spec.backoff_cap}:{spec.backoff_grace} {workload}"
            t0 = time.time()
            try:
                prompts = build(workload, args.requests, args.seed)
                results[name] = run_spec_bench(
                    open_llm, workload, prompts, spec, args.gen_len, args.warmup, args.runs,
                    sampling, margin,
                )  # fmt: skip
                print_spec_result(results[name])
            except Exception:  # the other runs still run
                print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
                results[name] = None
            print(f"[{name}: {time.time() - t0:.1f} s]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "verify_down": args.down}, f, indent=2)
    return report(results, specs[0], args)


def report(results: dict, spec, args) -> int:
    """The RESULT table; 0 when every run meets its target (and greedy outputs match)."""
    mode = "sampled T 0.8 top-k 50 top-p 0.95" if args.sampled else "greedy"
    print(f"\nRESULT speculative ({spec.method} k={spec.k} n={spec.n_min}:{spec.n_max}) vs plain "
          f"{mode}, {args.requests} prompts, gen {args.gen_len}, {args.backend}, verify "
          f"down_proj {args.down}")  # fmt: skip
    print(f"  {'run':18} {'plain t/s':>10} {'spec t/s':>10} {'speed-up':>9} {'target':>7} "
          f"{'acc/step':>9} {'skipped':>8} {'identical':>10}")  # fmt: skip
    ok = True
    for name, res in results.items():
        if res is None:
            print(f"  {name:18} FAILED")
            ok = False
            continue
        target = TARGETS.get(res["workload"], 0.0)
        met = res["speedup"] >= target
        ok &= met and res["identical"] is not False  # None: sampled, not compared
        same = {True: "yes", None: "-"}.get(res["identical"], f"no @{res['first_difference']}")
        a = res["acceptance"]
        print(f"  {name:18} {res['plain_tokens_per_s']:10.1f} "
              f"{res['speculative_tokens_per_s']:10.1f} {res['speedup']:8.2f}x "
              f"{target:6.2f}{'' if met else '!'} {a['accepted_per_step']:9.2f} "
              f"{a['skipped']:8d} {same:>10}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
