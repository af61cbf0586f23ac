"""Speculation's projected effect: greedy speculation walked over plain greedy outputs under a
step-cost model, for several (cap, grace) backoff settings and draft lengths K at once.

    PYTHONPATH=. python3 dev/spec_backoff_walk.py FILE [--workloads chat,edit,fim] [--requests 8]
        [--gen-len 128] [--backend reference] [--truths PATH] [--verify-cost 1.693 | M:US,..]
        [--backoffs 0,16:0,16:1,64:1,16:2] [--ks 15] [--step-ms MS] [--stdlib PATH]

- truths: each workload's prompts (nanoqwen.harness.workloads, from this Python's stdlib or
  --stdlib's: edit and fim prompts differ between Python versions) generated plain and greedy:
  the truth T of each. Kept in --truths (JSON; reused when it holds the workload, so a slow CPU
  generation runs once).
- walk: greedy speculation emits exactly T, so a step at position i (history prompt + T[:i])
  drafts by speculative.draft through a speculative.Backoff, accepts the drafts' agreeing
  prefix with T[i:] and moves to i + a + 1. A step costs 1 (no drafts: the decode step) or
  the verify step's cost at K (it runs 1 + K rows, whatever d: engine/speculate.py): a bare
  --verify-cost serves every K (default the real 1.5B's at K 15 on an H200 with the split
  down_proj, 1163.1 / 686.9 us: docs/PERFORMANCE.md, the verify step); a table of step times
  by rows M (dev/verify_step.py's, "1:1436.7,8:1923.1,16:2493.1", M = 1 the decode step)
  gives each K of --ks its own, r(1 + K) as dev/draft_model.py's cost_ratio reads it (linear
  in between and beyond). Projected speed-up = plain steps / the walk's cost, and with --step-ms (a
  model's decode step) ms/token = step-ms / speed-up: another model's replies stand in for
  the projected model's own (the 7B's from the 1.5B's), so its acceptance is assumed; also
  verify steps, accepted drafts and dropped matches per setting.

The projection leaves out everything but the forwards (the sampler, the draft kernel, the
graph), so it ranks settings; the bench (dev/spec_workloads.py) measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from draft_model import cost_ratio  # dev/, beside this script

from nanoqwen.harness.workloads import build
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import Backoff, SpeculativeConfig, draft, step_limit

VERIFY_COST = 1163.1 / 686.9  # the 1.5B's verify step (M = 16, split) over its decode step
MAX_CONTEXT = 8192  # the longest prompt plus gen-len, with room


def truths(path: str, workloads: list[str], args) -> dict:
    """{workload: [{"prompt": ids, "truth": tokens}]}, from --truths or generated."""
    cache = Path(args.truths) if args.truths else None
    out = json.loads(cache.read_text()) if cache and cache.exists() else {}
    todo = [w for w in workloads if w not in out]
    if todo:
        params = SamplingParams(temperature=0.0, max_tokens=args.gen_len)
        with LLM(path, backend=args.backend, max_context=MAX_CONTEXT) as llm:
            stop = frozenset(llm.tokenizer.eos_token_ids)
            for w in todo:
                out[w] = []
                for p in build(w, args.requests, args.seed, args.stdlib):
                    ids = [int(t) for t in llm.prepare(**p.prepare_args())]
                    truth = list(llm.backend.generate(ids, params, stop))
                    out[w].append({"prompt": ids, "truth": truth})
                    print(f"  {w}: prompt {len(ids)} tokens, reply {len(truth)}", flush=True)
                if cache:
                    cache.write_text(json.dumps(out))
    return out


def walk(prompt: list[int], truth: list[int], spec: SpeculativeConfig, gen_len: int,
         verify_cost: float) -> tuple[float, list[int]]:  # fmt: skip
    """(cost, [verify steps, accepted drafts, dropped matches]) of greedy speculation
    emitting `truth` after `prompt` (truth[0] is the prefill's token)."""
    h, i, backoff, cost, counts = prompt + truth[:1], 1, Backoff(), 0.0, [0, 0, 0]
    while i < len(truth):
        found = draft(h, spec, step_limit(gen_len, i, len(h), MAX_CONTEXT))
        drafts = backoff.gate(found)
        a = 0  # the agreeing prefix, leaving truth's last token to the model
        while a < len(drafts) and i + a < len(truth) - 1 and drafts[a] == truth[i + a]:
            a += 1
        backoff.update(len(drafts), a, spec)
        cost += verify_cost if drafts else 1.0
        counts = [counts[0] + bool(drafts), counts[1] + a, counts[2] + (len(drafts) < len(found))]
        h += truth[i : i + a + 1]
        i += a + 1
    return cost, counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", help=".nanoqwen model")
    p.add_argument("--workloads", default="chat,edit,fim")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="reference", choices=("cuda", "reference"))
    p.add_argument("--truths", default=None, help="JSON cache of the plain greedy outputs")
    p.add_argument("--verify-cost", default=str(VERIFY_COST),
                   help="the verify step's cost over the decode step's for every K, or step "
                        "times by rows, M:US,M:US (M = 1 the decode step)")  # fmt: skip
    p.add_argument("--backoffs", default="0,16:0,16:1,64:1,16:2",
                   help="comma list of CAP:GRACE (0: no backoff)")  # fmt: skip
    p.add_argument("--ks", default=str(SpeculativeConfig().k),
                   help="draft lengths K walked, comma-separated")  # fmt: skip
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="the projected model's decode step (ms): adds ms/token")  # fmt: skip
    p.add_argument("--stdlib", type=Path, default=None,
                   help="the stdlib the edit and fim prompts come from (default: this "
                        "Python's)")  # fmt: skip
    args = p.parse_args()
    workloads = args.workloads.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    try:
        costs = verify_costs(args.verify_cost, ks)
    except ValueError as exc:
        p.error(f"--verify-cost {args.verify_cost!r}: {exc}")
    data = truths(args.file, workloads, args)
    base = SpeculativeConfig()
    print(f"RESULT projected speed-up (n {base.n_min}:{base.n_max}, gen {args.gen_len}, "
          f"verify cost by K {costs})")  # fmt: skip
    for w in workloads:
        print(f"  {w} ({len(data[w])} prompts, {sum(len(r['truth']) for r in data[w])} tokens)")
        for k, b in ((k, b) for k in ks for b in args.backoffs.split(",")):
            cap, _, grace = b.partition(":")
            spec = replace(base, k=k, backoff_cap=int(cap), backoff_grace=int(grace or 1))
            plain = cost = 0.0
            total = [0, 0, 0]
            for r in data[w]:
                c, counts = walk(r["prompt"], r["truth"], spec, args.gen_len, costs[k])
                plain, cost = plain + len(r["truth"]) - 1, cost + c
                total = [x + y for x, y in zip(total, counts, strict=True)]
            ms = f"  {args.step_ms * cost / plain:.3f} ms/token" if args.step_ms else ""
            print(f"    K {k:2d} backoff {b:6s} {plain / cost:6.3f}x{ms}  verify {total[0]:4d}  "
                  f"accepted {total[1]:5d}  dropped {total[2]:4d}")  # fmt: skip
    return 0


def verify_costs(text: str, ks: list[int]) -> dict[int, float]:
    """--verify-cost as {K: the verify step's cost over the decode step's} for every K of ks:
    one ratio for all, or r(1 + K) of a table of step times by rows (cost_ratio)."""
    if ":" not in text:
        return dict.fromkeys(ks, float(text))
    r = cost_ratio(text)
    return {k: round(r(1 + k), 4) for k in ks}


if __name__ == "__main__":
    sys.exit(main())
