"""The contract between the front end (LLM, CLI, server) and a compute backend.

Two backends implement it: `reference` (PyTorch, CPU or any torch device; the oracle) and
`cuda` (our kernels, CUDA graphs, sm_90a). The front end owns tokenization, stop strings and
detokenization; a backend only turns token ids into token ids (and, for validation, logits).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from .config import ModelConfig
from .sampling import SamplingParams


class Backend(Protocol):
    name: str  # "reference" or "cuda"
    config: ModelConfig
    max_context: int  # prompt + generated tokens must fit in this many positions

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        """Yield generated token ids, one per decode step.

        Stops after yielding a token in `stop_ids` or after `params.max_tokens` tokens. The
        caller checks `len(prompt_ids) + params.max_tokens <= max_context` first (raising
        ContextError); the backend re-checks. Closing the iterator early (generator.close(),
        or dropping it) cancels the generation within one decode step and frees its KV pages.
        One generation at a time per backend (batch 1).
        """
        ...

    @property
    def kv_pages_in_use(self) -> int:
        """16-token KV pages currently held (0 when no generation runs): leak checks use it."""
        ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits: float32 [T, vocab], row t predicts token t+1."""
        ...

    def close(self) -> None: ...
