"""Speculative sampling in the cuda backend against its plain loop on the same engine (sm_90
GPU): the generated tokens' distribution, drafts accepted, a step without drafts drawing
exactly as the plain loop, seeded reruns reproduced, greedy unchanged.

    PYTHONPATH=. python3 dev/speculate_sampled_check.py [--runs 1500] [--k 4] [--backoff 16]
        [--grace 0]

The model: the tiny preset's synthetic weights (seed 0, packed into a temporary directory)
with final_norm scaled by SCALE, which scales every logit. The synthetic models point at one
token (the tied preset: t -> t ^ 1) by ~10 logit stds, so near temperature 1 the unscaled
model samples its argmax; scaled, the partner keeps about half the mass (measured with the
reference on the prompt below: 0.85 at T 1.0 gives p(top) ~0.5, 0.4 at T 0.8 / top-k 50 /
top-p 0.95 ~0.6 over ~43 kept tokens). The prompt alternates a token and its partner, so the
n-gram lookup drafts from the first step and half the drafts are accepted.

- identical: random 12-token prompts, 4 tokens each (no 3-gram can repeat, so no drafts):
  the speculative loop's no-draft branch (sample_rows at d = 0, the same counter) must give
  the plain loop's tokens exactly, for --seeds seeds; and a seeded speculative rerun of the
  alternating prompt (with drafts) its first run's tokens.
- distribution: per setting, --runs seeded generations of POSITIONS + 1 tokens on each loop
  (disjoint seeds); at each position 1..POSITIONS a two-sample chi-square test of homogeneity
  (tokens drawn at least MIN_CELL times pooled in their own cells, the rest in one) at
  significance ALPHA / tests (Bonferroni). The speculative runs must have accepted drafts
  and, with --backoff > 0, dropped some (spec_stats: a step after a fully rejected one ran
  without its drafts, so the backoff's gate is under test too; --grace 0 by default, so that
  it acts within the positions compared), and position 1 must not be degenerate (the top token
  under DEGENERATE).
- greedy: the alternating prompt and a random one, greedy: speculative == plain, drafts
  accepted on the alternating one.
RESULT line last: PASS when every part passes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from nanoqwen.config import preset
from nanoqwen.convert.synthetic import synthetic_tensors
from nanoqwen.convert.tokenizers import byte_level_spec
from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile, write_nanoqwen
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import SpecStats, SpeculativeConfig

# Generated positions compared (token 0 is the prefill's, the same code in both). 8: the backoff
# drops drafts only where a lookup matches after a fully rejected step, which the first four
# positions rarely hold (reference backend, grace 0, 60 runs: 0 dropped at 4 positions, 6 at 8).
POSITIONS = 8
ALPHA = 0.01  # the whole distribution part's significance
MIN_CELL = 10  # pooled draws a token needs for its own chi-square cell
DEGENERATE = 0.95  # a position whose top token takes more than this tests too little
PARTNER = 4242  # the alternating prompt: PARTNER, PARTNER ^ 1, ...
# (final_norm scale, parameters): the settings compared.
SETTINGS = [
    (0.85, SamplingParams(temperature=1.0)),
    (0.4, SamplingParams(temperature=0.8, top_k=50, top_p=0.95)),
]


def pack(path: Path, scale: float) -> None:
    """The tiny preset's synthetic model with final_norm * scale."""
    config = preset("tiny")

    def tensors():
        for name, t in synthetic_tensors(config, 0):
            if name == "final_norm":
                t = (t.astype(np.float32) * scale).astype(np.float16)
            yield name, t

    meta = {"source": f"synthetic:tiny, final_norm x {scale}", "source_format": "synthetic"}
    write_nanoqwen(path, config, tensors(), byte_level_spec(), meta)


def generate(e: CudaBackend, ids, params: SamplingParams, speculate: bool):
    """(tokens, spec_stats) of one generation, on the speculative or the plain loop."""
    saved = e.speculative
    e.speculative = saved if speculate else None
    try:
        out = list(e.generate(ids, params, frozenset()))
        return out, e.spec_stats
    finally:
        e.speculative = saved


def alternating() -> list[int]:
    return [PARTNER, PARTNER ^ 1] * 6


def identical(e: CudaBackend, params: SamplingParams, seeds: int, log) -> bool:
    rng = np.random.default_rng(0)
    same = drafted = 0
    for s in range(seeds):
        ids = rng.integers(0, e.config.vocab_size, 12).tolist()
        p = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                           top_p=params.top_p, seed=s, max_tokens=4)  # fmt: skip
        plain, _ = generate(e, ids, p, False)
        spec, st = generate(e, ids, p, True)
        same += plain == spec
        drafted += st.drafted
    p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       seed=12345, max_tokens=32)  # fmt: skip
    first, st = generate(e, alternating(), p, True)
    again, _ = generate(e, alternating(), p, True)
    good = same == seeds and drafted == 0 and first == again and st.accepted > 0
    log(f"identical: no-draft replies equal to plain {same}/{seeds} ({drafted} drafted); "
        f"seeded rerun with drafts equal {first == again} ({st.summary()})  "
        f"{'ok' if good else 'FAIL'}")  # fmt: skip
    return good


def chi2_homogeneity(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of the two samples' token counts: tokens seen
    MIN_CELL times in both together have their own cell, the rest share one (merged into the
    smallest cell when it is itself under MIN_CELL: every expected count stays >= ~5)."""
    tokens, counts = np.unique(np.array(a + b), return_counts=True)
    big = tokens[counts >= MIN_CELL].tolist()
    if not big:
        return 0.0, 0, 1.0
    if counts[counts < MIN_CELL].sum() < MIN_CELL:
        other = big[int(np.argmin(counts[counts >= MIN_CELL]))]
    else:
        other = -1
    cell = {t: i for i, t in enumerate(sorted(set(big) | {other}))}
    obs = np.zeros((2, len(cell)))
    for row, xs in enumerate((a, b)):
        for x in xs:
            obs[row, cell.get(x, cell[other])] += 1
    expected = obs.sum(1, keepdims=True) * obs.sum(0, keepdims=True) / obs.sum()
    stat = float(((obs - expected) ** 2 / expected).sum())
    df = len(cell) - 1
    if df == 0:
        return stat, 0, 1.0
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
    return stat, df, p


def distribution(e: CudaBackend, params: SamplingParams, runs: int, log) -> bool:
    tag = f"T {params.temperature} top-k {params.top_k} top-p {params.top_p}"
    base = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "max_tokens": POSITIONS + 1}  # fmt: skip
    samples: dict[bool, list[list[int]]] = {False: [], True: []}
    stats = SpecStats()
    for speculate in (False, True):
        for s in range(runs):
            seed = s + (10**6 if speculate else 0)  # disjoint: independent samples
            out, st = generate(e, alternating(), SamplingParams(seed=seed, **base), speculate)
            samples[speculate].append(out)
            if speculate:
                stats.add(st)
    alpha = ALPHA / (POSITIONS * len(SETTINGS))
    # ~half of the drafts are accepted; a first step that accepts none drops the next drafts
    good = stats.accepted >= runs // 4 and (stats.skipped > 0) == (e.speculative.backoff_cap > 0)
    log(f"distribution {tag}: {runs} runs a loop, {stats.summary()}")
    for i in range(1, POSITIONS + 1):
        a = [o[i] for o in samples[False] if len(o) > i]
        b = [o[i] for o in samples[True] if len(o) > i]
        stat, df, p = chi2_homogeneity(a, b)
        top = np.unique(a + b, return_counts=True)[1].max() / len(a + b)
        ok = p >= alpha and (i > 1 or top <= DEGENERATE)
        good &= ok
        log(f"  position {i}: chi2 {stat:8.2f}, df {df:3d}, p {p:.4f} (alpha {alpha:.5f}), "
            f"top token {100 * top:.0f}%  {'ok' if ok else 'FAIL'}")  # fmt: skip
    return good


def greedy(e: CudaBackend, log) -> bool:
    rng = np.random.default_rng(1)
    good = True
    for name, ids in (("alternating", alternating()),
                      ("random", rng.integers(0, e.config.vocab_size, 12).tolist())):  # fmt: skip
        p = SamplingParams(temperature=0.0, max_tokens=32)
        plain, _ = generate(e, ids, p, False)
        spec, st = generate(e, ids, p, True)
        ok = plain == spec and (name != "alternating" or st.accepted > 0)
        good &= ok
        log(f"greedy {name}: identical {plain == spec}, {st.summary()}  {'ok' if ok else 'FAIL'}")
    return good


def check_setting(n: int, scale: float, params: SamplingParams, args, tmp: str, res: dict):
    """Every part of one setting on its own engine (the greedy part on the first)."""
    path = Path(tmp) / f"tiny-{scale}.nanoqwen"
    pack(path, scale)
    e = CudaBackend(NanoqwenFile(path), max_context=256, prefix_caching=False,
                    speculative=SpeculativeConfig(k=args.k, backoff_cap=args.backoff,
                                                  backoff_grace=args.grace))  # fmt: skip
    try:
        print(f"tiny, final_norm x {scale}, K {args.k}, backoff cap {args.backoff} grace "
              f"{args.grace}")  # fmt: skip
        run_part(f"identical{n}", res, print, lambda: identical(e, params, args.seeds, print))
        run_part(f"distribution{n}", res, print, lambda: distribution(e, params, args.runs, print))
        if n == 0:
            run_part("greedy", res, print, lambda: greedy(e, print))
    finally:
        e.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1500, help="generations a loop and setting")
    ap.add_argument("--seeds", type=int, default=50, help="seeds of the no-draft identity")
    ap.add_argument("--k", type=int, default=4, help="draft tokens a step at most")
    ap.add_argument("--backoff", type=int, default=SpeculativeConfig().backoff_cap,
                    help="the backoff's cap (0: none)")  # fmt: skip
    ap.add_argument("--grace", type=int, default=0, help="the backoff's grace")
    args = ap.parse_args()
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (scale, params) in enumerate(SETTINGS):
            check_setting(n, scale, params, args, tmp, res)
    verdict = all(bool(v) for v in res.values())
    print("parts: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in res.items()))
    print(f"RESULT {'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
