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

Backends: `ReferenceBackend(speculative=SpeculativeConfig(...))` runs both rules as they are
here, drawing from a torch generator; `engine.CudaBackend(speculative=...)` runs both inside
its one-graph loop (engine/speculate.py; speculate.cu's sample_rows for the sampled rule, with
counter-based randoms from the seed: the same tokens as the reference in distribution, not
draw for draw). Both keep the last generation's SpecStats in `spec_stats`.

Where it is exposed: `LLM(..., speculative=...)` and the `--speculate {off,ngram}`, `--spec-k`,
`--spec-ngram MIN:MAX` flags of generate, chat, serve and demo (`resolve` turns them into a
SpeculativeConfig; DEFAULT_SPECULATE is the default of all of them); bench's edit, fim and
chat workloads take --spec-k and --spec-ngram. The statistics (SpecStats) reach generate's
stats line, the server's usage and /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .cuda.registry import MAX_ROWS
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


class SpeculativeError(NanoqwenError, ValueError):
    """Speculative decoding parameters out of range."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup); k draft tokens at most per step, in
    [1, MAX_DRAFT_TOKENS]; n-gram sizes n_min..n_max tried longest first, 1 <= n_min <= n_max."""

    # n-grams of 3+ tokens: single-token matches also draft on open-ended chat, where the
    # drafts are rarely accepted and each verify step costs more than a decode step. K at its
    # most: an edit copies runs longer than a few tokens, and the verify step's cost grows
    # little with its rows. The measured choices are in docs/EXPERIMENTS.md (Speculative
    # decoding).
    method: str = "ngram"
    k: int = MAX_DRAFT_TOKENS
    n_min: int = 3
    n_max: int = 5

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


@dataclass
class SpecStats:
    """One generation's speculation: `steps` decode steps after the prefill, `drafted` draft
    tokens verified, `accepted` of them kept by the acceptance rule (before a stop id or
    max_tokens cuts the step's tokens)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted

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
        """One line for a stats line: drafted, accepted, mean tokens a step."""
        return (
            f"speculative: {self.drafted} drafted, {self.accepted} accepted "
            f"({100 * self.acceptance:.0f}%), {self.tokens_per_step:.2f} tokens a step"
        )


def parse_ngram(text: str) -> tuple[int, int]:
    """ "MIN:MAX" (or one size "N") -> (n_min, n_max); the range is checked by
    SpeculativeConfig."""
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi if sep else lo)
    except ValueError:
        raise SpeculativeError(f"n-gram sizes must be MIN:MAX, e.g. 1:3; got {text!r}") from None


def resolve(
    speculative: SpeculativeConfig | str | None, k: int | None = None, ngram: str | None = None
) -> SpeculativeConfig | None:
    """The SpeculativeConfig of a --speculate value (or LLM's `speculative=`): None for "off"
    or None, a config as given, or a method name with `k` and `ngram` ("MIN:MAX") over the
    config's defaults."""
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
    return SpeculativeConfig(speculative, base.k if k is None else k, n_min, n_max)


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
