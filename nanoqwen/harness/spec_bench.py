"""`nanoqwen bench --workload edit|fim|chat`: speculative against plain decoding, greedy or
sampled.

Protocol: the workload's prompts (nanoqwen.harness.workloads: real stdlib source, seeded), each
generated up to `gen_len` tokens (the tokenizer's EOS ends one early), greedily or with the
given sampling parameters (prompt i seeded with i, in both modes), first by a plain
backend, then by a speculative one of the same kind and file (each opened alone, so a backend
that builds its decode graph for its configuration at load is measured as it serves). Each
mode first runs `warmup` untimed generations of the first prompt, then every prompt `runs`
times. A generation's decode time is first token -> last token on the host (the prefill and
its first token are the same work in both modes, so they are left out); ms/token is the sum
over the prompts of the median decode time over runs, divided by the sum of their decode tokens
(tokens - 1), and effective tokens/s is its inverse. The speed-up is plain ms/token over
speculative ms/token. Acceptance: the speculative backend's SpecStats summed over the timed
generations. Identity (greedy only: sampled modes draw other tokens from the same
distributions, so their replies, and their lengths, differ): each prompt's speculative tokens
against its plain tokens; on a mismatch, the first differing index, and with a `margin`
function (dev/spec_workloads.py --margins: the float32 reference's logits) how far apart the two
tokens there are, in logit stds: the verify step and the decode step round differently, so a
reply may part from the plain one where its top two are a near-tie.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from ..sampling import SamplingParams
from ..speculative import SpecStats, SpeculativeConfig
from .bench import commit_id
from .workloads import Prompt


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length mismatch counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def timed_generation(backend, ids: list[int], params: SamplingParams, stop_ids):
    """(tokens, decode seconds: first token -> last token) of one generation."""
    tokens, first = [], None
    for token in backend.generate(ids, params, stop_ids):
        tokens.append(token)
        first = first or time.perf_counter()
    return tokens, time.perf_counter() - first


def run_mode(llm, prompts: list[Prompt], sampling: SamplingParams, warmup: int,
             runs: int) -> dict:  # fmt: skip
    """One mode over every prompt (`sampling` with prompt i's seed i): per prompt its prompt
    ids, tokens, median decode seconds; and the summed SpecStats (zeros without
    speculation)."""
    backend = llm.backend
    stop_ids = frozenset(llm.tokenizer.eos_token_ids)
    ids = [llm.prepare(**p.prepare_args()) for p in prompts]
    for _ in range(warmup):
        timed_generation(backend, ids[0], replace(sampling, seed=0), stop_ids)
    stats, rows = SpecStats(), []
    for i, prompt_ids in enumerate(ids):
        params = replace(sampling, seed=i)
        seconds, tokens = [], None
        for _ in range(runs):
            tokens, s = timed_generation(backend, prompt_ids, params, stop_ids)
            seconds.append(s)
            if llm.speculative:
                stats.add(backend.spec_stats)
        rows.append({"ids": prompt_ids, "tokens": tokens,
                     "decode_s": statistics.median(seconds)})  # fmt: skip
    return {"rows": rows, "stats": stats}


def _rate(rows: list[dict]) -> tuple[float, float]:
    """(ms/token, tokens/s) over the decode tokens of every row."""
    tokens = sum(len(r["tokens"]) - 1 for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    ms = 1e3 * seconds / tokens if tokens else float("nan")
    return ms, (1e3 / ms if tokens and seconds else float("nan"))


def run_spec_bench(
    open_llm: Callable[[SpeculativeConfig | None], object],
    workload: str,
    prompts: list[Prompt],
    spec: SpeculativeConfig,
    gen_len: int,
    warmup: int = 1,
    runs: int = 1,
    sampling: SamplingParams | None = None,
    margin: Callable[[list[int], int, int], float] | None = None,
) -> dict:
    """The workload plain (open_llm(None)) then speculative (open_llm(spec)), greedy or with
    `sampling`'s temperature, top-k and top-p; the result dict (module docstring;
    `print_spec_result` shows it). margin(ids, a, b): |logit a - logit b| / std of the logits
    after ids, for a greedy mismatch (None: not measured)."""
    sampling = replace(sampling or SamplingParams(), max_tokens=gen_len, stop=())
    modes = {}
    for name, config in (("plain", None), ("speculative", spec)):
        llm = open_llm(config)
        try:
            modes[name] = run_mode(llm, prompts, sampling, warmup, runs)
            backend, model = llm.backend_name, llm.model_name
        finally:
            llm.close()
    plain, fast = modes["plain"], modes["speculative"]
    per_prompt, mismatch = [], None
    for i, (p, a, b) in enumerate(zip(prompts, plain["rows"], fast["rows"], strict=True)):
        diff = first_difference(a["tokens"], b["tokens"]) if sampling.greedy else None
        split = None  # the margin where a greedy reply parts, when measured
        if diff is not None and margin and diff < min(len(a["tokens"]), len(b["tokens"])):
            split = margin(a["ids"] + a["tokens"][:diff], a["tokens"][diff], b["tokens"][diff])
        if diff is not None and mismatch is None:
            mismatch = {"prompt": i, "index": diff, "margin": split}
        per_prompt.append({
            "source": p.source, "prompt_tokens": len(a["ids"]),
            "tokens": len(a["tokens"]), "speculative_tokens": len(b["tokens"]),
            "plain_decode_s": a["decode_s"], "speculative_decode_s": b["decode_s"],
            "identical": diff is None if sampling.greedy else None, "split_margin": split,
        })  # fmt: skip
    plain_ms, plain_rate = _rate(plain["rows"])
    spec_ms, spec_rate = _rate(fast["rows"])
    stats = fast["stats"]
    return {
        "workload": workload,
        "backend": backend,
        "model": model,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "prompts": len(prompts),
        "gen_len": gen_len,
        "warmup": warmup,
        "runs": runs,
        "speculative": {
            "method": spec.method,
            "k": spec.k,
            "n_min": spec.n_min,
            "n_max": spec.n_max,
            "backoff_cap": spec.backoff_cap,
            "backoff_grace": spec.backoff_grace,
        },  # fmt: skip
        "sampling": {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
        },  # fmt: skip
        "plain_ms_per_token": plain_ms,
        "plain_tokens_per_s": plain_rate,
        "speculative_ms_per_token": spec_ms,
        "speculative_tokens_per_s": spec_rate,
        "speedup": plain_ms / spec_ms,
        "acceptance": {
            "steps": stats.steps,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "skipped": stats.skipped,
            "accepted_per_step": stats.accepted / stats.steps if stats.steps else 0.0,
            "tokens_per_step": stats.tokens_per_step,
            "rate": stats.acceptance,
        },
        "identical": mismatch is None if sampling.greedy else None,  # None: not comparable
        "first_difference": mismatch,
        "per_prompt": per_prompt,
    }


def print_spec_result(res: dict) -> None:
    s, a = res["speculative"], res["acceptance"]
    print(f"workload {res['workload']}  backend {res['backend']}  model {res['model']}  "
          f"{res['prompts']} prompts  gen {res['gen_len']}  runs {res['runs']}  "
          f"{s['method']} k={s['k']} n={s['n_min']}:{s['n_max']} "
          f"backoff={s['backoff_cap']}:{s['backoff_grace']}")  # fmt: skip
    smp = res["sampling"]
    if smp["temperature"] > 0:
        print(f"  sampled: temperature {smp['temperature']} top-k {smp['top_k']} "
              f"top-p {smp['top_p']}, prompt i seeded with i")  # fmt: skip
    print(f"  {'mode':12} {'ms/token':>10} {'tokens/s':>10}")
    print(f"  {'plain':12} {res['plain_ms_per_token']:10.3f} {res['plain_tokens_per_s']:10.1f}")
    print(f"  {'speculative':12} {res['speculative_ms_per_token']:10.3f} "
          f"{res['speculative_tokens_per_s']:10.1f}")  # fmt: skip
    print(f"  speed-up {res['speedup']:.2f}x; {a['accepted_per_step']:.2f} accepted drafts a "
          f"step ({a['tokens_per_step']:.2f} tokens a step; {a['accepted']} of {a['drafted']} "
          f"drafted, {a['steps']} steps, {a['skipped']} skipped)")  # fmt: skip
    if res["identical"] is None:
        print("  outputs identical: not compared (sampled: other draws, the same distributions)")
    elif res["identical"]:
        print("  outputs identical: yes")
    else:
        d = res["first_difference"]
        where = f"prompt {d['prompt']} differs from token {d['index']}"
        splits = [p["split_margin"] for p in res["per_prompt"] if p["split_margin"] is not None]
        if splits:
            where += (
                f"; top-2 margins where replies part: {', '.join(f'{m:.4f}' for m in splits)} std"
            )
        print(f"  outputs identical: NO ({where})")
