"""The contract between the front end (LLM, CLI, server) and a compute backend.

Two backends implement it: `reference` (PyTorch, CPU or any torch device; the oracle) and
`cuda` (our kernels, CUDA graphs, sm_90a). The front end owns tokenization, stop strings and
detokenization; a backend only turns token ids into token ids (and, for validation, logits).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from .config import ModelConfig
from .errors import ContextError
from .kv_pages import BlockManager, KVStats
from .sampling import SamplingParams
from .speculative import SpecStats, SpeculativeConfig

# Positions a backend holds when not told: the cuda engine sizes its KV pool for the model's
# usual 32k; the reference keeps float32 weights and KV in CPU memory.
DEFAULT_CONTEXT = {"cuda": 32768, "reference": 4096}


def check_max_context(max_context: int, config: ModelConfig) -> int:
    """A backend's context size: 1 .. the model's max_position_embeddings."""
    limit = config.max_position_embeddings
    if not 0 < max_context <= limit:
        raise ContextError(
            f"max_context {max_context} must be in [1, {limit}] (the model's "
            "max_position_embeddings)"
        )
    return max_context


def check_prompt(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Prompt ids -> int64 [T]: refuses an empty prompt and ids outside the vocabulary."""
    ids = np.asarray(token_ids if isinstance(token_ids, list | np.ndarray) else list(token_ids),
                     dtype=np.int64)  # fmt: skip
    if ids.ndim != 1 or ids.size == 0:
        raise ContextError("empty prompt: at least one token id is needed")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ContextError(f"token id {int(ids[at])} at index {at} outside [0, {vocab_size})")
    return ids


def check_fits(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """prompt + max_tokens must fit the context."""
    total = prompt_tokens + max_tokens
    if total > max_context:
        raise ContextError(
            f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {total} exceeds "
            f"the context of {max_context} tokens"
        )


class Pending(Protocol):
    """A decode step that Backend.decode_launch queued: its sequences (in the order given) and,
    once it has run, one token each."""

    seqs: list

    def tokens(self) -> list[int]:
        """The step's tokens in `seqs`' order; waits for the step (the first call)."""
        ...


class Ready(NamedTuple):
    """A Pending step computed at its launch (the backends without a device queue)."""

    seqs: list
    values: list[int]

    def tokens(self) -> list[int]:
        return self.values

    def fed(self, seq) -> int:
        """The token this step sampled for `seq`: what a step launched after it feeds."""
        return self.values[self.seqs.index(seq)]


class Backend(Protocol):
    name: str  # "reference" or "cuda"
    config: ModelConfig
    max_context: int  # prompt + generated tokens must fit in this many positions
    # Prompt tokens of the current (or last) generation whose K/V came from the prefix cache
    # instead of the prefill: a multiple of 16, at most the prompt's full pages before its last
    # token; 0 on a cold prefill and before the first generation.
    cached_tokens: int
    speculative: SpeculativeConfig | None  # drafts in generate() (None: one token a step)
    spec_stats: SpecStats  # the current (or last) generate()'s speculation

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        """Yield generated token ids, one per decode step.

        Stops after yielding a token in `stop_ids` or after `params.max_tokens` tokens.
        check_prompt and check_fits run at the call (ContextError), before the first token
        is asked for. Closing the iterator early (generator.close(),
        or dropping it) cancels the generation within one decode step and releases its KV
        pages (those completely written stay in the prefix cache, unreferenced).
        One generate() at a time per backend; speculative drafts run here only, never in
        decode_launch.
        """
        ...

    @property
    def kv_pages_in_use(self) -> int:
        """16-token KV pages currently held (0 when no generation runs; cached pages are not
        held): leak checks use it."""
        ...

    @property
    def kv_stats(self) -> KVStats:
        """The KV pool and the prefix cache: pages held / cached / free, tokens looked up and
        hit, evictions."""
        ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits: float32 [T, vocab], row t predicts token t+1."""
        ...

    # Continuous batching (nanoqwen.batching drives these; its docstring states the rules).
    max_batch: int  # most sequences in one decode step

    @property
    def block_manager(self) -> BlockManager:
        """The backend's KV pool: the scheduler admits, reserves, commits and releases."""
        ...

    def prefill_chunk(self, seq, end: int, sample: bool) -> int | None:
        """ids[seq.kv_len:end] into seq.table's pages, kv_len = end; with `sample` the next
        token (draw number len(seq.tokens) of the sequence), else None."""
        ...

    def decode_launch(self, seqs: list, after: Pending | None = None) -> Pending:
        """Queue one decode step for each sequence, kv_len += 1 at the call; its tokens come
        from the returned step's tokens(), one per sequence, each what it gets alone. Without
        `after` each feeds its last id at position kv_len (== len(ids) - 1). With `after`, a
        step queued before and not yet read (at most that one), `seqs` are some of its
        sequences in its order, each still waiting for the token `after` samples for it: that
        token is fed at kv_len (== len(ids)), drawn as draw number len(seq.tokens) + 1. So the
        host reads step k while step k + 1 runs (nanoqwen.batching: one step behind)."""
        ...

    def release_slot(self, seq) -> None:
        """The sequence left the batch: forget its per-slot state."""
        ...

    def close(self) -> None: ...
