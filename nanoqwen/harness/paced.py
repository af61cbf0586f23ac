"""A stand-in engine that takes a fixed time per step, for timing the host path around it.

`PacedLLM` is the real `nanoqwen.llm.LLM` front end of a model file (its tokenizer, `prepare`,
the scheduler of `batch()`, the detokenizer and stop strings) over `PacedBackend`, which has
the batch primitives (nanoqwen.batching) and `generate` but no model: each call of
`prefill_chunk`, `decode_launch` and each token of `generate` queues a step of what
`StepCosts` says it costs on a stand-in device that runs its steps one after the other, waits
for it where a GPU backend waits, and hands out the next ids of a fixed piece of text (so
every token decodes to text, none is an EOS). A server or a benchmark over it pays everything
a GPU-backed one pays except the GPU's work. With one flat cost a step (`StepCosts.flat`), its
per-token latency minus that cost is the host's cost that the step does not hide
(dev/server_overhead.py); with a GPU's measured costs (a prefill by its tokens, a decode step
by its rows), its latencies are what the scheduler and the server would give if the GPU did
that work and nothing else (dev/sched_model.py).

How it waits (`wait`) brackets how a GPU backend waits for its step:

    sleep   time.sleep: the GIL is released, as the cuda backend's cuStreamSynchronize releases
            it if cuda.bindings calls the driver without the GIL; the server's event loop runs
            during the step
    block   libc usleep called with the GIL held (ctypes.PyDLL): a binding that blocks in the
            driver without releasing the GIL; nothing else in the process runs during the step
    spin    a busy loop on the clock in Python, the GIL held: the event loop gets the GIL only
            at the interpreter's switch interval (worker.SWITCH_INTERVAL_S), and the engine
            thread waits as long to get it back
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..config import PAGE_TOKENS, ModelConfig
from ..kv_pages import BlockManager, KVStats
from ..llm import LLM
from ..sampling import SamplingParams
from ..speculative import SpecStats

# What the stand-in "generates", cycled: code, so a token stream reads like a completion.
TEXT = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"
WAITS = ("sleep", "block", "spin")


@dataclass(frozen=True)
class StepCosts:
    """Seconds a step takes: a prefill of t tokens max(prefill_min_s, t * prefill_token_s) (a
    pass over the weights at least, else bound by the GEMMs' compute); a decode step of B rows
    decode_s[B - 1] (decode_s[-1] past its end)."""

    prefill_token_s: float
    prefill_min_s: float
    decode_s: tuple[float, ...]

    @classmethod
    def flat(cls, step_s: float) -> StepCosts:
        """Every step `step_s`, whatever its tokens and rows."""
        return cls(0.0, step_s, (step_s,))

    def prefill(self, tokens: int) -> float:
        return max(self.prefill_min_s, tokens * self.prefill_token_s)

    def decode(self, rows: int) -> float:
        return self.decode_s[min(rows, len(self.decode_s)) - 1]


class PacedStep(NamedTuple):
    """PacedBackend's queued decode step (backend.Pending): its tokens are known at once and
    handed out when the stand-in device has run it."""

    backend: PacedBackend
    seqs: list
    values: list[int]
    ends: float  # perf_counter seconds

    def tokens(self) -> list[int]:
        self.backend.wait_until(self.ends)
        return self.values


class PacedBackend:
    """The batch primitives and generate() over a KV pool of pages only: every step waits its
    `costs` (module docstring) and yields `text_ids` in turn from each sequence's position."""

    name = "paced"
    speculative = None
    cached_tokens = 0  # no prefix is served from a cache: every prompt is "prefilled"

    def __init__(self, config: ModelConfig, max_context: int, max_batch: int, costs: StepCosts,
                 wait: str, text_ids: Sequence[int]) -> None:  # fmt: skip
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {', '.join(WAITS)}, got {wait!r}")
        self.config, self.max_context, self.max_batch = config, max_context, max_batch
        self.costs, self.wait, self.text_ids = costs, wait, list(text_ids)
        self._usleep = ctypes.PyDLL(None).usleep  # PyDLL: the call keeps the GIL
        # Room for every slot's whole context: the stand-in never preempts.
        self.block_manager = BlockManager(max_batch * -(-max_context // PAGE_TOKENS))
        self.spec_stats = SpecStats()
        # The stand-in device runs its queued steps one after the other: `_free_at` is when the
        # last one ends (perf_counter seconds). `gaps` holds, for each step queued, how long
        # the device had sat idle before it (the engine thread's work between two steps that
        # no queued step hid), `waits` how long each wait for a step's result took (a sleep
        # overshoots its cost by the OS's wake-up latency). `take_times` empties both.
        self.gaps: list[float] = []
        self.waits: list[float] = []
        self._free_at: float | None = None

    def take_times(self) -> tuple[list[float], list[float]]:
        """(gaps, waits) since the last call; the next gap starts at the next step's queueing."""
        times, self.gaps, self.waits, self._free_at = (self.gaps, self.waits), [], [], None
        return times

    def _queue(self, step_s: float) -> float:
        """Queue a step of `step_s` on the stand-in device; returns when it ends."""
        now = time.perf_counter()
        if self._free_at is not None:
            self.gaps.append(max(0.0, now - self._free_at))
        self._free_at = max(now, self._free_at or now) + step_s
        return self._free_at

    def wait_until(self, until: float) -> None:
        """Wait for the step that ends at `until` (perf_counter seconds)."""
        start = time.perf_counter()
        if self.wait == "sleep":
            time.sleep(max(0.0, until - start))
        elif self.wait == "block":
            self._usleep(max(0, round((until - start) * 1e6)))
        else:
            while time.perf_counter() < until:
                pass
        end = time.perf_counter()
        self.waits.append(end - start)
        if self._free_at == until:  # nothing queued behind it: the device is free when seen
            self._free_at = end

    def _token(self, generated: int) -> int:
        return self.text_ids[generated % len(self.text_ids)]

    def prefill_chunk(self, seq, end: int, sample: bool) -> int | None:
        """A chunk of at most max_batch ids costs a decode step of as many rows (the cuda
        backend runs it as rows of its batch step), a longer one its prefill cost."""
        t = end - seq.kv_len
        self.wait_until(self._queue(self.costs.decode(t) if t <= self.max_batch
                               else self.costs.prefill(t)))  # fmt: skip
        seq.kv_len = end
        return self._token(len(seq.tokens)) if sample else None

    def decode_launch(self, seqs: list, after=None) -> PacedStep:
        """A decode step queued behind the last one (it waits at tokens(), as the cuda
        backend's does)."""
        ends = self._queue(self.costs.decode(len(seqs)))
        for seq in seqs:
            seq.kv_len += 1
        draw = int(after is not None)  # `after`'s token is not in seq.tokens yet
        return PacedStep(self, list(seqs), [self._token(len(s.tokens) + draw) for s in seqs], ends)

    def release_slot(self, seq) -> None:
        pass

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        """One token per decode step of one row after the prompt's prefill, to max_tokens; its
        pages held while it runs, as a backend's are."""
        table = self.block_manager.admit(prompt_ids)
        try:
            self.block_manager.reserve(table, len(prompt_ids) + params.max_tokens)
            self.wait_until(self._queue(self.costs.prefill(len(prompt_ids))))
            for i in range(params.max_tokens):
                if i:
                    self.wait_until(self._queue(self.costs.decode(1)))
                yield self._token(i)
        finally:
            self.block_manager.release(table)

    @property
    def kv_pages_in_use(self) -> int:
        return self.block_manager.pages_held

    @property
    def kv_stats(self) -> KVStats:
        return self.block_manager.stats

    def close(self) -> None:
        pass


class PacedLLM(LLM):
    """LLM over a model file's tokenizer and front end, its engine a `PacedBackend`."""

    def __init__(self, path: str | os.PathLike, costs: StepCosts | float, wait: str = "sleep",
                 max_batch: int = 16, max_context: int | None = None) -> None:  # fmt: skip
        """costs: the stand-in's StepCosts, or one flat cost a step in seconds."""
        costs = costs if isinstance(costs, StepCosts) else StepCosts.flat(costs)
        self._paced = (costs, wait)
        # The reference backend's context rule; `_open_backend` below builds the stand-in.
        super().__init__(path, "reference", max_context, speculative="off", max_batch=max_batch)
        self.backend_name = self.backend_reason = "paced"

    def _open_backend(self) -> PacedBackend:
        costs, wait = self._paced
        ids = [t for t in self.tokenizer.encode(TEXT) if t not in self.tokenizer.eos_token_ids]
        return PacedBackend(self.config, self.max_context, self._max_batch, costs, wait, ids)
