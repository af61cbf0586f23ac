"""Speculative greedy decoding in the cuda backend end to end, against the plain loop on the same
engine (sm_90 GPU): token-identical replies, then the accepted tokens a step and the speed.

    PYTHONPATH=. python3 dev/speculate_e2e.py FILE [--requests 4] [--max-tokens 128] [--k 4]

One CudaBackend(speculative=SpeculativeConfig(k)) without prefix caching (so both runs of a
prompt prefill it the same way). Prompts with repetition, as code assistants see them: "rewrite
this function with type hints" over a stdlib function's source (inspect.getsource, a different
function each request), "add a docstring" over another, and a repeated-line prompt; chat
template when the file has a tokenizer, else its UTF-8 bytes + 100 as ids (a synthetic pack).

- check: each prompt greedy through the plain loop (engine.speculative = None for that call,
  the same engine) and the speculative loop; the replies must be token-identical. Where they
  differ, the first differing position and the plain path's top-2 logit margin there (over the
  logits' std, from engine.logits) are printed: the verify step rounds differently from the
  decode step (dev/verify_step.py), so a near-tie may flip; a margin above TIE is a FAIL.
- sampled: a seeded sampled request runs the speculative sampled graph (steps counted, pages
  freed) and its rerun with the same seed gives the same tokens (counter-based randoms);
  dev/speculate_sampled_check.py tests its distribution.
- cancel: a speculative generation closed after 5 tokens frees its pages, and the next reply
  is still the plain one.
- time: each prompt's decode rate (tokens after the first over the seconds after the first
  token) for both loops, the median of --repeats runs, with spec_stats: mean accepted drafts
  and tokens a step. RESULT table last.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import statistics
import sys
import time

import numpy as np

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import SpeculativeConfig
from nanoqwen.tokenizer import Tokenizer

TIE = 0.05  # logit stds: a top-2 margin under this is a near-tie (dev/verify_step.py's)


def stdlib_sources() -> list[str]:
    """Functions of a few lines to a page, from modules every Python has (frozen ones, such as
    posixpath, have no source and are skipped)."""
    import fnmatch
    import json.encoder
    import shutil
    import textwrap

    funcs = [textwrap.dedent, shutil.copyfileobj, json.encoder.py_encode_basestring,
             fnmatch.translate, textwrap.indent, shutil.which]  # fmt: skip
    out = []
    for f in funcs:
        with contextlib.suppress(OSError, TypeError):
            out.append(inspect.getsource(f))
    return out


def prompts(n: int) -> list[tuple[str, str]]:
    """(name, user message): code to rewrite, and a repeated-line request."""
    srcs = stdlib_sources()
    out = []
    for i in range(n):
        if i % 3 == 2:
            line = "assert parse_row(row) == expected_rows[i], f'row {i} differs'\n"
            out.append((f"repeat{i}", "Continue this test file for 40 more lines:\n\n" + line * 12))
        else:
            verb = ("rewrite this function with type hints", "add a docstring to this function")
            src, verb = srcs[i % len(srcs)], verb[i % 2]
            out.append((f"{verb.split()[0]}{i}", f"Please {verb}:\n\n```python\n{src}```\n"))
    return out


def encode(file, tok, text: str) -> tuple[list[int], frozenset[int]]:
    if tok is None:
        return [b + 100 for b in text.encode()], frozenset()
    return tok.encode_chat([{"role": "user", "content": text}]), frozenset(tok.eos_token_ids)


def run(e: CudaBackend, ids, stop, max_tokens: int, speculate: bool, params=None):
    """(tokens, seconds after the first token, spec_stats) of one generation."""
    saved = e.speculative
    e.speculative = saved if speculate else None
    try:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out, t_first = [], 0.0
        for tok in e.generate(ids, params, stop):
            out.append(tok)
            if len(out) == 1:
                t_first = time.perf_counter()
        return out, time.perf_counter() - t_first, e.spec_stats
    finally:
        e.speculative = saved


def margin_at(e: CudaBackend, ids, plain, i: int) -> float:
    """The plain reply's top-2 margin at token i, in logit stds (teacher-forced)."""
    row = e.logits(list(ids) + plain[:i])[-1]
    top2 = np.sort(row)[-2:]
    return float((top2[1] - top2[0]) / row.std())


def check(e, cases, max_tokens, log) -> bool:
    ok = True
    for name, ids, stop in cases:
        plain, _, _ = run(e, ids, stop, max_tokens, False)
        spec, _, st = run(e, ids, stop, max_tokens, True)
        if plain == spec:
            log(f"check {name:10s}: {len(spec)} tokens identical, {st.steps} steps, "
                f"{st.drafted} drafted, {st.accepted} accepted  ok")  # fmt: skip
            ok &= st.steps > 0 or len(spec) <= 1
            continue
        pairs = zip(plain, spec, strict=False)
        i = next((j for j, (a, b) in enumerate(pairs) if a != b), min(len(plain), len(spec)))
        m = margin_at(e, ids, plain, i) if i < len(plain) else float("nan")
        tie = m < TIE
        ok &= tie
        log(f"check {name:10s}: differ at token {i} of {len(plain)}/{len(spec)} (plain "
            f"{plain[i:i + 1]}, spec {spec[i:i + 1]}), top-2 margin {m:.4f} std "
            f"{'near-tie' if tie else 'FAIL'}")  # fmt: skip
    return ok


def sampled(e, cases, log) -> bool:
    _, ids, stop = cases[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=1)
    out, _, st = run(e, ids, stop, 32, True, params)
    again, _, _ = run(e, ids, stop, 32, True, params)
    good = len(out) >= 1 and st.steps > 0 and e.kv_pages_in_use == 0 and again == out
    log(f"sampled: {len(out)} tokens, spec_stats {st}, seeded rerun identical {again == out}  "
        f"{'ok' if good else 'FAIL'}")  # fmt: skip
    return good


def cancel(e, cases, max_tokens, log) -> bool:
    _, ids, stop = cases[-1]
    it = e.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), stop)
    head = list(itertools.islice(it, 5))
    it.close()
    freed = e.kv_pages_in_use == 0
    plain, _, _ = run(e, ids, stop, max_tokens, False)
    again, _, _ = run(e, ids, stop, max_tokens, True)
    good = freed and head == plain[:5] and again == plain
    log(f"cancel: closed after 5, pages freed {freed}, head {head == plain[:5]}, next reply "
        f"identical {again == plain}  {'ok' if good else 'FAIL'}")  # fmt: skip
    return good


def timing(e, cases, max_tokens, repeats, log) -> list[dict]:
    rows = []
    for name, ids, stop in cases:
        r = {"name": name, "prompt": len(ids)}
        for mode in ("plain", "spec"):
            rates, st, n = [], None, 0
            for _ in range(repeats):
                out, secs, st = run(e, ids, stop, max_tokens, mode == "spec")
                n = len(out)
                rates.append((n - 1) / secs if n > 1 and secs > 0 else float("nan"))
            r[mode] = statistics.median(rates)
            r["tokens"] = n
        r["acc_step"] = st.accepted / max(st.steps, 1)
        r["tok_step"] = (r["tokens"] - 1) / max(st.steps, 1)
        rows.append(r)
        log(f"time {name:10s}: plain {r['plain']:7.1f} tok/s, spec {r['spec']:7.1f} tok/s, "
            f"{r['tok_step']:.2f} tokens a step")  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model")
    ap.add_argument("--requests", type=int, default=4, help="prompts (every third repeats a line)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens a reply at most")
    ap.add_argument("--k", type=int, default=4, help="draft tokens a step at most")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs a prompt and loop")
    args = ap.parse_args()
    f = NanoqwenFile(args.file)
    tok = Tokenizer.from_file(f) if f.tokenizer is not None else None
    e = CudaBackend(f, max_context=4096, prefix_caching=False,
                    speculative=SpeculativeConfig(k=args.k))  # fmt: skip
    cases = [(n, *encode(f, tok, text)) for n, text in prompts(args.requests)]
    print(f"{e.config.name}, K {args.k}, prompts {[len(c[1]) for c in cases]} tokens")
    res: dict = {}
    run_part("check", res, print, lambda: check(e, cases, args.max_tokens, print))
    run_part("sampled", res, print, lambda: sampled(e, cases, print))
    run_part("cancel", res, print, lambda: cancel(e, cases, args.max_tokens, print))
    run_part("time", res, print, lambda: timing(e, cases, args.max_tokens, args.repeats, print))
    if res["time"]:
        print(f"\nspeculative greedy, {e.config.name}, K {args.k} (decode tok/s, median of "
              f"{args.repeats})")  # fmt: skip
        print("  prompt      tokens  plain tok/s  spec tok/s  speedup  accepted/step  tokens/step")
        for r in res["time"]:
            print(
                f"  {r['name']:10s} {r['tokens']:6d} {r['plain']:12.1f} {r['spec']:11.1f} "
                f"{r['spec'] / r['plain']:8.2f} {r['acc_step']:14.2f} {r['tok_step']:12.2f}"
            )
    verdict = {k: bool(res[k]) for k in ("check", "sampled", "cancel", "time")}
    print("RESULT " + " ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in verdict.items()))
    e.close()
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
