"""Speculative decoding by prompt lookup: the drafting rule and the acceptance rule, host-side.

A decode step normally feeds one token and gets one. With speculation it feeds the last token
plus up to K draft tokens guessed from the token history, verifies them all in one forward over
1 + K rows, and keeps the agreeing prefix plus the model's own next token: 1 to K + 1 tokens a
step for one pass over the weights. The drafts come from an n-gram lookup (vLLM's "ngram",
transformers' prompt_lookup_num_tokens, llama.cpp's lookup decoding): code and chat replies
repeat what the prompt or the reply already says.

This module is the oracle of the rules. The reference backend runs them as they are here, and
a CUDA kernel is to mirror them exactly, so each is stated to the token:

Drafting (`draft`), over the history h = prompt + generated tokens (h[-1] is the token the step
feeds, not yet in the KV cache):
  - n-gram sizes are tried from n_max down to n_min; the first size with a match wins (longer
    contexts predict better). A size n needs len(h) >= n + 1.
  - a match of size n is a start j with h[j : j + n] == h[-n:] and j + n <= len(h) - 1, so that
    at least one token follows it (the suffix itself is never a match).
  - the draft is h[j + n : j + n + limit], limit = min(K, the caller's cap), so a match close
    to the end of the history drafts fewer tokens. Of several matches the one with the longest
    draft wins, and of those the most recent (the largest j): the most recent match whose
    draft is a full `limit` tokens, else the earliest match. Recency because the nearest
    repetition is the likeliest to continue; length first because inside a loop of period P
    (a repeated line, a model repeating itself) the most recent match overlaps the suffix and
    drafts only P tokens, where an earlier lap drafts K. Equivalently: maximize
    min(limit, len(h) - j - n) * len(h) + j over the matches (a max-reduction for a kernel).
  - no match of any size: no draft, and the step is the plain one-token step (adaptive K).
  - the caller's cap (`step_limit`) is min(max_tokens - emitted - 1, capacity - len(h) - 1):
    the step emits at most limit + 1 tokens, so it never passes max_tokens, and the history
    (and the KV slots of the fed rows) never pass the context capacity.
  - the prefill step carries no drafts: drafting starts with the first decode step, whose
    history already ends with the first sampled token.

Acceptance (`accept`), given the target's logits at the 1 + d positions of the step (row i
predicts the token after feeding h[-1] and drafts[:i]):
  - greedy: accept drafts[i] while it equals the argmax of row i (lowest id on ties, as
    nanoqwen.sampling); the first disagreeing row's argmax, or row d's if all agree, is the
    model's next token. The result equals non-speculative greedy decoding token for token.
  - sampled: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with a
    deterministic draft, q = a point mass on drafts[i]. With p the target's processed
    distribution at row i (nanoqwen.sampling.probabilities: temperature, top-k, top-p exactly
    as sample() applies them), accept drafts[i] when u < p(drafts[i]), u uniform in [0, 1);
    on rejection draw from (p - q)+ normalized, i.e. p with drafts[i] removed and
    renormalized, and stop. If all d are accepted, draw one more token with sample() from row
    d. Each emitted token is then distributed exactly as sample() would have drawn it.
  - with no drafts it is exactly sample() on row 0: a step without a match consumes the
    generator as the plain step does.

Backoff (`Backoff`): on text that does not repeat (chat) most drafts that are found are
rejected, and each costs a verify step where a decode step would do. The engine verifies a
fixed 1 + K rows whatever d is (engine/speculate.py), at 1.97x the decode step at K 15 (real
1.5B on an H200: 1352 against 687 us, benchmarks/results/h200_1.5b_real_verify_step.json); a
step that accepts a drafts emits a + 1 tokens for that cost, so it loses about one decode step
at a = 0, breaks even at a = 1 and gains from a = 2 on. Hence the rule:
  - a verify step that accepted no draft (a = 0, before the stop-id / max_tokens cut) is a
    failure. A partial rejection is not, whatever accepted / drafted is: a >= 1 pays for the
    step, and the step's cost does not grow with d, so a low fraction (1 of 15) costs nothing
    a full one (1 of 1) does not.
  - `fails` counts the failures since the last step that accepted a draft (which sets it and
    skip to 0). After a failure skip = 0 while fails <= grace, else
    min(cap, 2^(fails - grace - 1)): at grace 1, cap 16, failures in a row drop 0, 1, 2, 4, 8,
    16, 16, .. matches.
  - while skip > 0, a step whose lookup found drafts drops them (and skip -= 1): it runs as
    the plain decode step, counted in SpecStats.skipped. Steps without a match leave skip
    alone: skip counts dropped drafts, not steps, because matches on such text are sparse
    (chat on the 1.5B: 908 draft tokens found in 1928 steps, several a match), and a skip
    measured in steps would run out between two matches and drop none.
  - a step without drafts (none found, or dropped) changes nothing; cap = 0 turns the backoff
    off.
Why a grace of one failure: dropping a match that would fail saves 0.97 of a step, dropping one
that would be accepted loses its a - 0.97, several steps where speculation pays (edit and fim
on the 1.5B accept 2.18 and 1.68 drafts a step over all their steps, drafting or not). So a drop
pays only where the next match is far likelier to fail than to be accepted: after failures in a
row (chat), not after one failure between acceptances (an edit that departs from the original,
then copies again; a fill-in whose first draft token is wrong). dev/spec_backoff_walk.py
projects the settings (docs/EXPERIMENTS.md, Speculative decoding).
The device keeps skip and fails in the decode state words SPEC_SKIP and SPEC_FAILS
(registry.StateWord): draft_ngram drops the drafts, the accept kernels update the words, so the
one-graph loop needs no host round trip. Greedy output is unchanged (drafts never change the
greedy tokens). Sampling stays exact: whether a step drafts depends on skip, a function of the
earlier steps' outcomes (their tokens and their uniforms), never of the uniforms this step's
acceptance tests and draws use (fresh ones: speculate.cu's counters STEP + r). Speculative
sampling emits each token with the target's distribution for any draft fixed before the step's
uniforms are drawn, and a step without drafts is the plain sample(); only a choice that looked
at the step's own draws (draft when u will accept) would bias it.

Backends: `ReferenceBackend(speculative=SpeculativeConfig(...))` runs both rules as they are
here, drawing from a torch generator; `engine.CudaBackend(speculative=...)` runs both inside
its one-graph loop (engine/speculate.py; speculate.cu's sample_rows for the sampled rule, with
counter-based randoms from the seed: the same tokens as the reference in distribution, not
draw for draw). Both keep the last generation's SpecStats in `spec_stats`.

Where it is exposed: `LLM(..., speculative=...)` and the `--speculate {off,ngram}`, `--spec-k`,
`--spec-ngram MIN:MAX`, `--spec-backoff CAP` flags of generate, chat, serve and demo (`resolve`
turns them into a SpeculativeConfig; DEFAULT_SPECULATE is the default of all of them); bench's
edit, fim and chat workloads take --spec-k, --spec-ngram and --spec-backoff. The statistics
(SpecStats) reach generate's stats line, the server's usage and /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .cuda.registry import BACKOFF_MAX_FAILS, BACKOFF_MAX_SHIFT, MAX_ROWS
from .errors import NanoqwenError
from .sampling import SamplingParams, probabilities, sample

if TYPE_CHECKING:
    import torch

METHODS = ("ngram",)
SPECULATE_CHOICES = ("off", *METHODS)
# The default of --speculate and of LLM(speculative=...). Off: n-gram speculation is to be on by
# default only once it never loses to plain decoding on any workload (bench --workload chat).
DEFAULT_SPECULATE = "off"
# The verify step runs 1 + K rows, at most the multi-token step's MAX_ROWS: up to 16 activation
# rows an INT4 GEMM stays memory-bound, one read of the weights serving every row (Marlin,
# Frantar et al. 2024).
MAX_DRAFT_TOKENS = MAX_ROWS - 1
MAX_BACKOFF = 1 << BACKOFF_MAX_SHIFT  # the backoff's largest cap
MAX_BACKOFF_GRACE = 8  # its largest grace (failures forgiven before it drops drafts)


class SpeculativeError(NanoqwenError, ValueError):
    """Speculative decoding parameters out of range."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup); k draft tokens at most per step, in
    [1, MAX_DRAFT_TOKENS]; n-gram sizes n_min..n_max tried longest first, 1 <= n_min <= n_max;
    backoff_cap: the most found drafts a run of fully rejected steps makes the sequence drop
    (Backoff), in [0, MAX_BACKOFF], 0 = no backoff; backoff_grace: the failures in a row it
    forgives before it drops any, in [0, MAX_BACKOFF_GRACE]."""

    # n-grams of 3+ tokens: single-token matches also draft on open-ended chat, where the
    # drafts are rarely accepted and each verify step costs more than a decode step. K at its
    # most: an edit copies runs longer than a few tokens, and the verify step's cost grows
    # little with its rows. The measured choices are in docs/EXPERIMENTS.md (Speculative
    # decoding).
    method: str = "ngram"
    k: int = MAX_DRAFT_TOKENS
    n_min: int = 3
    n_max: int = 5
    # Failures in a row drop 0, 1, 2, 4, 8, 16 matches: a cap of 16 keeps a verify step every
    # 17 matches on text that never repeats (about 6% of them, at a decode step's loss each)
    # and lets one accepted draft bring drafting back at once. The grace: module docstring.
    backoff_cap: int = 16
    backoff_grace: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise SpeculativeError(
                f"k (draft tokens per step) must be in [1, {MAX_DRAFT_TOKENS}], got {self.k}"
            )
        if self.n_min < 1:
            raise SpeculativeError(f"n_min must be >= 1, got {self.n_min}")
        if self.n_max < self.n_min:
            raise SpeculativeError(f"n_max ({self.n_max}) must be >= n_min ({self.n_min})")
        if not 0 <= self.backoff_cap <= MAX_BACKOFF:
            raise SpeculativeError(
                f"backoff_cap must be in [0, {MAX_BACKOFF}], got {self.backoff_cap}"
            )
        if not 0 <= self.backoff_grace <= MAX_BACKOFF_GRACE:
            raise SpeculativeError(
                f"backoff_grace must be in [0, {MAX_BACKOFF_GRACE}], got {self.backoff_grace}"
            )


@dataclass
class SpecStats:
    """One generation's speculation: `steps` decode steps after the prefill, `drafted` draft
    tokens verified, `accepted` of them kept by the acceptance rule (before a stop id or
    max_tokens cuts the step's tokens), `skipped` steps whose found drafts the backoff dropped
    (run as plain decode steps)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    skipped: int = 0

    def add(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.skipped += other.skipped

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a decode step emitted: 1 + the accepted drafts a step (1.0 with no
        step)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    @property
    def acceptance(self) -> float:
        """accepted / drafted (0.0 with nothing drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        """One line for a stats line: drafted, accepted, mean tokens a step, skipped steps."""
        return (
            f"speculative: {self.drafted} drafted, {self.accepted} accepted "
            f"({100 * self.acceptance:.0f}%), {self.tokens_per_step:.2f} tokens a step, "
            f"{self.skipped} skipped"
        )


@dataclass
class Backoff:
    """One sequence's drafting backoff (module docstring): `skip` found drafts still to drop,
    `fails` fully rejected verify steps since the last accepted draft (saturating at
    registry.BACKOFF_MAX_FAILS). The device's decode state words SPEC_SKIP and SPEC_FAILS
    hold the same two numbers."""

    skip: int = 0
    fails: int = 0

    def gate(self, drafts: list[int]) -> list[int]:
        """The step's drafts: `drafts` (the lookup's), or none while skipping, which uses
        one skip when there was something to drop."""
        if drafts and self.skip:
            self.skip -= 1
            return []
        return drafts

    def update(self, drafted: int, accepted: int, config: SpeculativeConfig) -> None:
        """After a step that verified `drafted` drafts and accepted `accepted` of them
        (before the cuts): a failure counts, and past config.backoff_grace failures sets a
        skip doubling up to config.backoff_cap; any acceptance clears both; a step without
        drafts changes nothing."""
        if not drafted:
            return
        self.fails = 0 if accepted else min(self.fails + 1, BACKOFF_MAX_FAILS)
        over = self.fails - config.backoff_grace
        shift = min(over - 1, BACKOFF_MAX_SHIFT)
        self.skip = min(config.backoff_cap, 1 << shift) if over > 0 else 0


def parse_ngram(text: str) -> tuple[int, int]:
    """ "MIN:MAX" (or one size "N") -> (n_min, n_max); the range is checked by
    SpeculativeConfig."""
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi if sep else lo)
    except ValueError:
        raise SpeculativeError(f"n-gram sizes must be MIN:MAX, e.g. 1:3; got {text!r}") from None


def resolve(
    speculative: SpeculativeConfig | str | None,
    k: int | None = None,
    ngram: str | None = None,
    backoff_cap: int | None = None,
) -> SpeculativeConfig | None:
    """The SpeculativeConfig of a --speculate value (or LLM's `speculative=`): None for "off"
    or None, a config as given, or a method name with `k`, `ngram` ("MIN:MAX") and
    `backoff_cap` over the config's defaults."""
    if speculative is None or isinstance(speculative, SpeculativeConfig):
        return speculative
    if speculative not in SPECULATE_CHOICES:
        raise SpeculativeError(
            f"speculate must be one of {', '.join(SPECULATE_CHOICES)}, got {speculative!r}"
        )
    if speculative == "off":
        return None
    base = SpeculativeConfig(speculative)
    n_min, n_max = parse_ngram(ngram) if ngram else (base.n_min, base.n_max)
    return SpeculativeConfig(
        speculative,
        base.k if k is None else k,
        n_min,
        n_max,
        base.backoff_cap if backoff_cap is None else backoff_cap,
    )


def step_limit(max_new: int, step: int, length: int, capacity: int) -> int:
    """The caller's cap on a step's drafts (module docstring): `step` tokens generated of
    `max_new`, a history of `length` tokens in a context of `capacity` positions. Below 1:
    no drafts. speculate.cu's draft_ngram computes the same from the decode state."""
    return min(max_new - step - 1, capacity - length - 1)


def cut(kept: list[int], left: int, stop_ids) -> tuple[list[int], bool]:
    """A step's emitted tokens: `kept` (accept's) cut to the `left` tokens max_tokens allows,
    then after the first stop id; and whether a stop id ended it."""
    kept = kept[:left]
    stop = next((i for i, t in enumerate(kept) if t in stop_ids), None)
    return (kept, False) if stop is None else (kept[: stop + 1], True)


def draft(history: Sequence[int], config: SpeculativeConfig, limit: int | None = None) -> list[int]:
    """The draft tokens for the step after `history` (module docstring): at most
    min(config.k, limit), possibly none."""
    limit = config.k if limit is None else min(config.k, limit)
    h = np.asarray(history, dtype=np.int64)
    if limit <= 0:
        return []
    for n in range(config.n_max, config.n_min - 1, -1):
        if len(h) < n + 1:
            continue
        # windows[j] = h[j : j + n] for j = 0 .. len(h) - 1 - n: every start followed by a token.
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
        hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + limit <= len(h)]
            start = int(full[-1] if full.size else hits[0]) + n
            return h[start : start + limit].tolist()
    return []


def accept(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens a step emits: the accepted prefix of `drafts` and one token of the target's
    (module docstring). logits: float32 [len(drafts) + 1, V] on the CPU; row i is the
    target's prediction after drafts[:i]."""
    import torch

    d = len(drafts)
    if logits.ndim != 2 or logits.shape[0] != d + 1:
        raise SpeculativeError(
            f"accept: expected logits [{d + 1}, V] for {d} drafts, got {tuple(logits.shape)}"
        )
    if params.greedy:
        targets = torch.argmax(logits, dim=1).tolist()  # first maximal index per row
        agree = 0
        while agree < d and drafts[agree] == targets[agree]:
            agree += 1
        return [*drafts[:agree], targets[agree]]
    for i, token in enumerate(drafts):
        p = probabilities(logits[i], params)
        u = float(torch.rand((), generator=generator))
        if u < float(p[token]):
            continue
        # Rejected, so p(token) < 1 and the rest of p has mass: (p - q)+ is p without token.
        p[token] = 0.0
        return [*drafts[:i], int(torch.multinomial(p, 1, generator=generator))]
    return [*drafts, sample(logits[d], params, generator)]
