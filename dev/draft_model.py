"""Would a draft model pay? Qwen2.5-Coder-0.5B drafting for a larger target, against n-gram
(prompt lookup) drafting, on the same positions of the same real prompts. Issue #26 item 6.

    PYTHONPATH=. python3 dev/draft_model.py TARGET DRAFT [--workload edit] [--requests 4]
        [--gen-len 128] [--ks 1,2,3,4,6,8] [--verify-cost 1:2.07,2:2.10,4:2.14,8:2.22]
        [--json PATH] [--backend cuda]

TARGET, DRAFT: .nanoqwen files (a .gguf is packed to /tmp first), sharing one tokenizer.

Parts (each fails alone; RESULT last):
- target: the workload's prompts (nanoqwen.harness.workloads) generated greedily by the target
  with plain decoding: the truth T of each prompt, and the target's ms/token (decode only:
  first token -> last, after one warm-up generation).
- draft: the draft model's plain ms/token on the same prompts, then, teacher-forced, at every
  decode position i of T (history = prompt + T[:i], the step feeding T[i - 1]) its own greedy
  continuation of max(ks) tokens (its generate(), the prefix cache making each prefill short):
  accepted = the agreeing prefix with T[i:]. A greedy continuation's first k tokens are the
  k-token continuation, so one pass serves every k.
- ngram: nanoqwen.speculative.draft over the same histories, for each k (its match choice
  depends on k), with the same step_limit cap.
- project: greedy speculation emits exactly T, so walking T (at position i: accept a tokens,
  emit a + 1, go to i + a + 1) gives each mode's steps. A step's cost, with t_T and t_D the
  measured ms/token of target and draft, r(M) the verify step's cost at M rows over M = 1
  (--verify-cost: step times by M, normalized by M = 1, linear in between and beyond):
    plain: t_T;  ngram with d drafts: t_T r(1 + d) (d = 0: the plain step);
    draft model with d drafts: t_T r(1 + d) + t_D (r(a' + 1) + d - 1): the draft's first
    forward also takes in the a' + 1 tokens the previous step emitted, at r(a' + 1) of its
    one-row step (the target's r used for the draft too), then d - 1 one-row steps.
  Effective ms/token = the walk's cost / the decode tokens; speed-up = t_T / that.

The verdict line: the draft-model mode pays where its best k beats n-gram's best k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from nanoqwen.harness.workloads import WORKLOADS, build
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import SpeculativeConfig, draft, step_limit

DEFAULT_VERIFY_COST = "1:2.07,2:2.10,4:2.14,8:2.22"  # ms by M, synthetic 7B, dev/verify_step.py
DEFAULT_KS = "1,2,3,4,6,8"
MAX_CONTEXT = 8192  # the longest prompt plus gen-len, with room


def log(msg: str) -> None:
    print(msg, flush=True)


def run_part(name: str, results: dict, fn):
    """results[name] = fn(), or None (traceback printed) when it raises."""
    t0 = time.time()
    try:
        results[name] = fn()
    except Exception:  # the later parts still run
        log(f"{name}: FAILED\n{traceback.format_exc()}")
        results[name] = None
    log(f"[{name}: {time.time() - t0:.1f} s]")
    return results[name]


def packed(path: str) -> Path:
    """A .nanoqwen path; a .gguf is packed to /tmp/<stem>.nanoqwen once."""
    src = Path(path)
    if src.suffix.lower() != ".gguf":
        return src
    out = Path("/tmp") / (src.stem + ".nanoqwen")
    if not out.exists():
        from nanoqwen.convert import pack_source

        log(f"packing {src} -> {out}")
        pack_source(src, out, progress=False)
    return out


def cost_ratio(table: str):
    """r(M) from "M:ms,M:ms,...": step time over the M = 1 step, piecewise linear in M, the
    last segment extended."""
    pairs = sorted((int(m), float(ms)) for m, ms in (p.split(":") for p in table.split(",")))
    ms_by_m = dict(pairs)
    if 1 not in ms_by_m or len(pairs) < 2:
        raise ValueError(f"--verify-cost needs M = 1 and one more M, got {table!r}")
    m, t = np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs], float)

    def r(rows: int) -> float:
        if rows > m[-1]:
            slope = (t[-1] - t[-2]) / (m[-1] - m[-2])
            return float(t[-1] + slope * (rows - m[-1])) / ms_by_m[1]
        return float(np.interp(rows, m, t)) / ms_by_m[1]

    return r


def timed(backend, ids, params, stop_ids) -> tuple[list[int], float]:
    tokens, first = [], None
    for token in backend.generate(ids, params, stop_ids):
        tokens.append(token)
        first = first or time.perf_counter()
    return tokens, time.perf_counter() - first


def plain_runs(llm, ids: list[list[int]], gen_len: int) -> dict:
    """Greedy tokens of each prompt and the decode ms/token over all (one warm-up first)."""
    stop = frozenset(llm.tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=gen_len)
    timed(llm.backend, ids[0], params, stop)
    outs, seconds = [], 0.0
    for prompt in ids:
        tokens, s = timed(llm.backend, prompt, params, stop)
        outs.append(tokens)
        seconds += s
    decode = sum(len(t) - 1 for t in outs)
    return {"tokens": outs, "ms_per_token": 1e3 * seconds / max(decode, 1)}


def agree(drafts, truth) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def caps(prompt_len: int, n: int, gen_len: int) -> list[int]:
    """step_limit at each decode position i of an n-token generation (index 0 unused)."""
    return [0] + [step_limit(gen_len, i, prompt_len + i, MAX_CONTEXT) for i in range(1, n)]


def draft_model_acceptance(llm, ids, truths, gen_len: int, kmax: int) -> list[list[int]]:
    """Per prompt, per decode position i: the draft model's greedy kmax-token continuation of
    prompt + T[:i] agreeing with T[i:] (capped by step_limit)."""
    params = SamplingParams(max_tokens=kmax)
    out = []
    for prompt, truth in zip(ids, truths, strict=True):
        cap = caps(len(prompt), len(truth), gen_len)
        row = [0]
        for i in range(1, len(truth)):
            guess = list(llm.backend.generate(prompt + truth[:i], params, frozenset()))
            row.append(agree(guess[: max(cap[i], 0)], truth[i:]))
        out.append(row)
    return out


def ngram_acceptance(ids, truths, gen_len: int, k: int, n_min: int, n_max: int):
    """Per prompt, per decode position: (drafts, accepted) of speculative.draft at k."""
    config = SpeculativeConfig("ngram", k, n_min, n_max)
    out = []
    for prompt, truth in zip(ids, truths, strict=True):
        cap = caps(len(prompt), len(truth), gen_len)
        row = [(0, 0)]
        for i in range(1, len(truth)):
            guess = draft(prompt + truth[:i], config, cap[i])
            row.append((len(guess), agree(guess, truth[i:])))
        out.append(row)
    return out


def draft_steps(ids, accepted, gen_len: int, k: int) -> list[list[tuple[int, int]]]:
    """The draft model's (drafts, accepted) at each position when it drafts k tokens: min(k,
    the step's cap) drafts, of which the first min(k, accepted at kmax) agree."""
    out = []
    for prompt, row in zip(ids, accepted, strict=True):
        cap = caps(len(prompt), len(row), gen_len)
        out.append(
            [(0, 0)] + [(max(min(k, cap[i]), 0), min(k, row[i])) for i in range(1, len(row))]
        )
    return out


def walk(steps_at) -> list[tuple[int, int]]:
    """The steps greedy speculation takes over one generation: steps_at[i] = (drafts,
    accepted) at position i; [(drafts, accepted)] per step."""
    i, taken = 1, []
    while i < len(steps_at):
        d, a = steps_at[i]
        taken.append((d, a))
        i += a + 1
    return taken


def project(walks, t_target: float, t_draft: float | None, r) -> dict:
    """Effective ms/token of the walks (one per prompt): n-gram when t_draft is None."""
    cost, tokens, steps, accepted = 0.0, 0, 0, 0
    for taken in walks:
        previous = 0
        for d, a in taken:
            cost += t_target * r(1 + d) if d else t_target
            if t_draft is not None and d:
                cost += t_draft * (r(previous + 1) + d - 1)
            previous = a
            tokens += a + 1
            steps += 1
            accepted += a
    ms = cost / max(tokens, 1)
    return {"ms_per_token": ms, "speedup": t_target / ms, "steps": steps,
            "accepted_per_step": accepted / max(steps, 1)}  # fmt: skip


def verdict(rows: dict, workload: str) -> None:
    """The line that answers the question: best n-gram k against best draft-model k."""
    best = {}
    for kind in ("ngram", "draft"):
        mine = [(v["ms_per_token"], n) for n, v in rows.items() if n.startswith(kind)]
        if mine:
            best[kind] = min(mine)
    if len(best) == 2:
        (ngram_ms, ngram), (draft_ms, drafted) = best["ngram"], best["draft"]
        pays = "PAYS" if draft_ms < ngram_ms else "does not pay"
        log(f"  verdict: best {ngram} {ngram_ms:.3f} ms/token, best {drafted} {draft_ms:.3f}: "
            f"the draft model {pays} on {workload}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="target model (.nanoqwen, or .gguf: packed to /tmp)")
    p.add_argument("draft", help="draft model, the same tokenizer")
    p.add_argument("--workload", choices=WORKLOADS, default="edit")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--ks", default=DEFAULT_KS, help="draft lengths to project")
    p.add_argument("--ngram", default="1:3", help="n-gram sizes MIN:MAX")
    p.add_argument("--verify-cost", default=DEFAULT_VERIFY_COST,
                   help="verify step ms by rows, M:ms,...: ratios to M = 1")  # fmt: skip
    p.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ks = sorted({int(k) for k in args.ks.split(",")})
    n_min, n_max = (int(x) for x in args.ngram.split(":"))
    r = cost_ratio(args.verify_cost)
    prompts = build(args.workload, args.requests, args.seed)
    res: dict = {}

    def open_model(path):
        return LLM(packed(path), backend=args.backend, max_context=MAX_CONTEXT)

    def target_part():
        with open_model(args.target) as llm:
            ids = [llm.prepare(**q.prepare_args()) for q in prompts]
            out = plain_runs(llm, ids, args.gen_len)
            return {"ids": ids, **out, "vocab": llm.config.vocab_size, "model": llm.model_name}

    target = run_part("target", res, target_part)

    def draft_part():
        with open_model(args.draft) as llm:
            ids = [llm.prepare(**q.prepare_args()) for q in prompts]
            if ids != target["ids"]:
                raise RuntimeError("the draft's tokenizer makes other prompt ids: no drafting")
            out = plain_runs(llm, ids, args.gen_len)
            acc = draft_model_acceptance(llm, ids, target["tokens"], args.gen_len, max(ks))
            return {"ms_per_token": out["ms_per_token"], "accepted": acc, "model": llm.model_name}

    drafted = run_part("draft", res, draft_part) if target else None

    def ngram_part():
        return {k: ngram_acceptance(target["ids"], target["tokens"], args.gen_len, k, n_min,
                                    n_max) for k in ks}  # fmt: skip

    ngrams = run_part("ngram", res, ngram_part) if target else None

    def project_part():
        t_t = target["ms_per_token"]
        rows = {"plain": {"ms_per_token": t_t, "speedup": 1.0}}
        for k in ks:
            if ngrams:
                rows[f"ngram k={k}"] = project([walk(a) for a in ngrams[k]], t_t, None, r)
            if drafted:
                at = draft_steps(target["ids"], drafted["accepted"], args.gen_len, k)
                rows[f"draft k={k}"] = project([walk(a) for a in at], t_t,
                                               drafted["ms_per_token"], r)  # fmt: skip
        return rows

    rows = run_part("project", res, project_part) if target else None
    failed = [name for name in ("target", "draft", "ngram", "project") if res.get(name) is None]
    log("")
    log(f"RESULT draft-model vs n-gram, workload {args.workload}, {args.requests} prompts, "
        f"gen {args.gen_len}, verify cost r(M) from {args.verify_cost}")  # fmt: skip
    if target:
        log(f"  target {target['model']}: {target['ms_per_token']:.3f} ms/token plain")
    if drafted:
        log(f"  draft  {drafted['model']}: {drafted['ms_per_token']:.3f} ms/token plain")
    if rows:
        log(f"  {'mode':12} {'acc/step':>9} {'ms/token':>9} {'speed-up':>9}")
        for name, row in rows.items():
            acc = row.get("accepted_per_step", 0.0)
            log(f"  {name:12} {acc:9.2f} {row['ms_per_token']:9.3f} {row['speedup']:8.2f}x")
        verdict(rows, args.workload)
    log(f"  failed parts: {', '.join(failed) or 'none'}")
    if args.json:
        keep = {"target_ms_per_token": target and target["ms_per_token"],
                "draft_ms_per_token": drafted and drafted["ms_per_token"], "rows": rows,
                "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps(keep, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
