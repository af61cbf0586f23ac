"""LLM: the Python API over any backend, used by the CLI and the server.

    llm = LLM("model.nanoqwen")                 # backend "auto": cuda on sm_90, else reference
    ids = llm.prepare(messages=[{"role": "user", "content": "Write is_prime(n)."}])
    for delta in llm.stream(ids, SamplingParams(max_tokens=128)):
        print(delta.text, end="", flush=True)

The front end owns everything around the token ids: the tokenizer and chat template
(`prepare`, which stops tokenizing once a prompt cannot fit the context), the context check,
detokenization that never splits a UTF-8 sequence, and stop strings (text that might start one
is held back). A backend only turns prompt ids into
generated ids (nanoqwen/backend.py). Generation stops on the tokenizer's EOS ids ("stop"),
on a user stop string ("stop"), or after `max_tokens` ("length").

Speculative decoding (`speculative=`: "off", "ngram" or a SpeculativeConfig; nanoqwen.speculative)
is the backend's: the tokens are the same for greedy requests, only faster. The last delta of a
generation carries its SpecStats, and `spec_totals` sums them over the LLM's life (/metrics).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from .backend import DEFAULT_CONTEXT, check_fits, check_max_context, check_prompt
from .batching import DEFAULT_PREFILL_CHUNK, Scheduler
from .config import ModelConfig
from .errors import ContextError, NanoqwenError
from .sampling import SamplingParams
from .speculative import DEFAULT_SPECULATE, SpecStats, SpeculativeConfig, resolve
from .tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer, TooManyTokens

BACKENDS = ("auto", "cuda", "reference")
# How a raw prompt's special-token text is encoded: "parse" makes `<|fim_prefix|>` etc. the
# control tokens (as vLLM and llama.cpp do), "text" keeps it as text (nanoqwen/tokenizer.py).
SPECIAL_TOKENS = ("parse", "text")


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed completion. The last one has finish_reason "stop" or "length".
    The first one carries `cached_tokens`: the prompt's tokens whose K/V came from the prefix
    cache (0 on every other delta, so summing over deltas counts them once). With speculation
    the last one carries the generation's SpecStats (None on every other delta, and always
    without speculation)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    cached_tokens: int = 0
    speculative: SpecStats | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache


def _cuda_available() -> tuple[bool, str]:
    """(usable, reason): an sm_90 GPU with our CUDA runtime importable."""
    try:
        from .cuda.device import sm90_available
    except ImportError as exc:
        return False, f"CUDA runtime not importable: {exc}"
    if not sm90_available():
        return False, "no sm_90 GPU found"
    return True, "sm_90 GPU found"


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend name, reason) for a `--backend` value."""
    if requested not in BACKENDS:
        raise NanoqwenError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested == "reference":
        return "reference", "requested"
    usable, reason = _cuda_available()
    if requested == "cuda" and not usable:
        raise NanoqwenError(
            f"backend 'cuda' needs an NVIDIA Hopper GPU (sm_90) and the cuda extras ({reason}); "
            "use --backend reference to run on the CPU"
        )
    return ("cuda" if usable else "reference"), reason


def context_size(requested: int | None, backend: str, config: ModelConfig) -> int:
    """The positions a backend allocates: `requested` (checked against the model), else the
    backend's default capped by the model's max_position_embeddings."""
    if requested is None:
        return min(DEFAULT_CONTEXT[backend], config.max_position_embeddings)
    return check_max_context(requested, config)


class _Text:
    """One generation's token ids -> Deltas: the one home of the stopping and detokenizing
    rules (module docstring), for `LLM.stream` and `Batch` alike."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: frozenset[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(params.stop)
        self.stop_ids, self.max_tokens, self.count = stop_ids, params.max_tokens, 0

    def feed(self, token: int, cached: int = 0) -> Delta:
        """The delta of the next generated token; its finish_reason ends the generation."""
        self.count += 1
        if token in self.stop_ids:  # EOS: ends the text, adds none
            return Delta(self._flush("")[0], (token,), "stop", cached)
        text, stopped = self.matcher.feed(self.detok.feed_one(token))
        if not stopped and self.count == self.max_tokens:
            text, stopped = self._flush(text)
            return Delta(text, (token,), "stop" if stopped else "length", cached)
        return Delta(text, (token,), "stop" if stopped else None, cached)

    def end(self) -> Delta:
        """The final delta of a generation the backend ended without a finishing token."""
        return Delta(self._flush("")[0], (), "length")

    def _flush(self, text: str) -> tuple[str, bool]:
        """`text` plus everything held back, at the end of the generation."""
        tail, stopped = self.matcher.feed(self.detok.finish())
        return text + tail + self.matcher.finish(), stopped


class Batch:
    """Generations of one LLM decoded together: a Scheduler (nanoqwen.batching) over the
    backend, each sequence's tokens turned into Deltas by the same rules as `LLM.stream`. A
    stop string ends a sequence here, on the host: it is cancelled, so the next step frees
    it. Speculative decoding runs while a sequence decodes alone (the scheduler's solo
    stretches); a sequence's last delta carries what its drafts did, as `stream`'s does."""

    def __init__(self, llm: LLM, scheduler: Scheduler) -> None:
        self.llm, self.scheduler = llm, scheduler
        self._text: dict[Any, _Text] = {}  # nanoqwen.batching.Sequence -> its text

    def add(self, ids: Sequence[int], params: SamplingParams):
        """Queue a generation; its handle (a nanoqwen.batching.Sequence). ContextError when
        it cannot fit the context."""
        seq = self.scheduler.add(ids, params, self.llm._stop_ids)
        self._text[seq] = _Text(self.llm.tokenizer, self.llm._stop_ids, params)
        return seq

    def cancel(self, seq) -> None:
        """Stop `seq`: no more deltas; the next step frees its pages and slot."""
        self.scheduler.cancel(seq)
        if self._text.pop(seq, None) is not None:
            self._count_spec(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[tuple[Any, Delta]]:
        """One scheduler step: (handle, delta) for each sequence that got a token; a delta
        with a finish_reason is its sequence's last."""
        out = []
        for event in self.scheduler.step():
            text = self._text.get(event.seq)
            if text is None or event.finish == "cancelled":
                continue
            if event.token is None:  # a backend's generate() that ended on its own
                delta = text.end()
            else:
                cached = event.seq.cached_tokens if len(event.seq.tokens) == 1 else 0
                delta = text.feed(event.token, cached)
            if delta.finish_reason:
                del self._text[event.seq]
                if not event.finish:  # a stop string: the scheduler does not know it
                    self.scheduler.cancel(event.seq)
                delta = dataclasses.replace(delta, speculative=self._count_spec(event.seq))
            out.append((event.seq, delta))
        return out

    def _count_spec(self, seq) -> SpecStats | None:
        """seq's SpecStats (None if it never drafted), added to the LLM's spec_totals."""
        if seq.spec is not None:
            self.llm.spec_totals.add(seq.spec)
        return seq.spec

    def clear(self) -> None:
        """Drop every generation now (engine failure, shutdown): pages and slots freed."""
        for seq in self.scheduler.clear():
            if self._text.pop(seq, None) is not None:
                self._count_spec(seq)


class LLM:
    """A loaded .nanoqwen model with its tokenizer, on one backend: one stream at a time with
    `stream` / `generate`, many with `batch`."""

    def __init__(
        self,
        path: str | os.PathLike,
        backend: str = "auto",
        max_context=None,
        progress=False,
        speculative: SpeculativeConfig | str | None = DEFAULT_SPECULATE,
        max_batch: int | None = None,
        k_cache: str | None = None,
    ):
        """progress: show the reference backend's load progress (a bar per layer) on stderr;
        speculative: "off" (or None), "ngram" (SpeculativeConfig's defaults) or a
        SpeculativeConfig; max_batch: the reference backend's batch slots (None: its
        default; the cuda backend sizes its own); k_cache: the cuda backend's K cache
        format (registry.K_CACHE; None: its default; the reference keeps K in float32)."""
        from .fileformat import NanoqwenFile

        self.speculative = resolve(speculative)
        self.spec_totals = SpecStats()  # over every generation, cancelled ones included
        self.backend_name, self.backend_reason = choose_backend(backend)
        self.path = Path(path)
        self._file = NanoqwenFile(self.path)
        try:
            self.config: ModelConfig = self._file.config
            self.tokenizer = Tokenizer.from_file(self._file)
            self.max_context = context_size(max_context, self.backend_name, self.config)
            self._progress, self._max_batch, self._k_cache = progress, max_batch, k_cache
            self._backend = self._open_backend()
        except BaseException:
            self._file.close()
            raise
        self._stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.model_name = str(self._file.metadata.get("model_name") or self.path.stem)

    def _open_backend(self):
        if self.backend_name == "cuda":
            try:
                from .engine import CudaBackend
            except ImportError as exc:
                raise NanoqwenError(
                    f"the cuda backend cannot be loaded ({exc}); use --backend reference"
                ) from None
            # Without speculation or a K cache format the plain constructor call: any engine
            # takes it.
            extra = {"speculative": self.speculative} if self.speculative else {}
            if self._k_cache:
                extra["k_cache"] = self._k_cache
            return CudaBackend(self._file, max_context=self.max_context, **extra)
        from .reference import ReferenceBackend

        batch = {} if self._max_batch is None else {"max_batch": self._max_batch}
        return ReferenceBackend(self._file, max_context=self.max_context, progress=self._progress,
                                speculative=self.speculative, **batch)  # fmt: skip

    # Prompts -----------------------------------------------------------------------------
    def prepare(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        fim: tuple[str, str] | None = None,
        special_tokens: str = "parse",
        tools: Sequence[dict[str, Any]] | None = None,
        reply_prefix: str = "",
    ) -> list[int]:
        """Prompt token ids from exactly one of: a raw prompt (text, or token ids checked
        against the vocabulary), chat messages, (prefix, suffix). With messages, `tools` and
        `reply_prefix` go to `Tokenizer.encode_chat` (function definitions the template lists;
        the reply's forced start).

        `special_tokens` (SPECIAL_TOKENS) says how a raw text prompt's special-token text is
        encoded; message contents and FIM prefix/suffix always stay text. A prompt that
        cannot fit the context with one token to generate is a TooManyTokens (ContextError),
        raised once tokenization passes max_context - 1 ids (the rest is never encoded).
        """
        given = [x is not None for x in (prompt, messages, fim)]
        if sum(given) != 1:
            raise NanoqwenError("prepare() takes exactly one of prompt=, messages=, fim=")
        if (tools or reply_prefix) and messages is None:
            raise NanoqwenError("tools= and reply_prefix= go with messages=")
        if special_tokens not in SPECIAL_TOKENS:
            raise NanoqwenError(
                f"special_tokens must be one of {', '.join(SPECIAL_TOKENS)}, got {special_tokens!r}"
            )
        limit = self.max_context - 1
        too_long = TooManyTokens(
            limit,
            f"the prompt is longer than {limit} tokens, so with a token to generate it exceeds "
            f"the context of {self.max_context} tokens",
        )
        try:
            if isinstance(prompt, str):
                allow = special_tokens == "parse"
                ids = self.tokenizer.encode(prompt, allow_special=allow, limit=limit)
            elif prompt is not None:
                if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                    raise NanoqwenError("prompt= must be a string or a sequence of token ids")
                ids = check_prompt(prompt, self.config.vocab_size).tolist()
            elif messages is not None:
                ids = self.tokenizer.encode_chat(
                    list(messages), tools=tools, reply_prefix=reply_prefix, limit=limit
                )
            else:
                if not (isinstance(fim, tuple | list) and len(fim) == 2):
                    raise NanoqwenError("fim= must be a (prefix, suffix) pair of strings")
                ids = self.tokenizer.fim_prompt(*fim, limit=limit)
        except TooManyTokens:
            raise too_long from None
        if len(ids) > limit:  # token ids given as such
            raise too_long
        if not ids:
            raise ContextError("the prompt is empty: it encodes to 0 tokens")
        return ids

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        check_fits(prompt_len, max_tokens, self.max_context)

    # Generation --------------------------------------------------------------------------
    def stream(self, ids: Sequence[int], params: SamplingParams) -> Iterator[Delta]:
        """Generate from prompt ids: one Delta per generated token; see the module docstring.

        A delta's text may be empty (an incomplete UTF-8 sequence or a possible stop string
        is held back), so the consumer gets control after every decode step. Checks happen
        here, before the first delta is asked for. Closing the returned iterator early
        cancels the backend generation (its KV pages are freed).
        """
        self._require_open()
        self.check_fits(len(ids), params.max_tokens)
        tokens = self._backend.generate(list(ids), params, self._stop_ids)
        return self._deltas(tokens, _Text(self.tokenizer, self._stop_ids, params))

    def batch(self, max_batch: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK
              ) -> Batch:  # fmt: skip
        """Many generations at once over the backend's batch primitives (nanoqwen.batching):
        the server's engine loop. max_batch: sequences decoded together (default and most:
        the backend's; 1: one after the other, each through the single-stream loop)."""
        self._require_open()
        return Batch(self, Scheduler(self._backend, max_batch, prefill_chunk))

    def _deltas(self, tokens: Generator[int], text: _Text) -> Iterator[Delta]:
        counted = False

        def last(delta: Delta) -> Delta:
            """The final delta, with the generation's SpecStats: the backend's iterator is
            closed first, so a backend that settles its statistics at the end has done so."""
            nonlocal counted
            tokens.close()
            counted = True
            return dataclasses.replace(delta, speculative=self._count_spec())

        try:
            for count, token in enumerate(tokens, start=1):
                delta = text.feed(token, self._backend.cached_tokens if count == 1 else 0)
                if delta.finish_reason:
                    yield last(delta)
                    return
                yield delta
            yield last(text.end())  # a backend that ended early on its own
        finally:
            tokens.close()
            if not counted:  # cancelled: the steps it ran still count in spec_totals
                self._count_spec()

    def _count_spec(self) -> SpecStats | None:
        """The finished generation's SpecStats (a copy), added to spec_totals; None without
        speculation."""
        if not self.speculative or self._backend is None:
            return None
        stats = dataclasses.replace(self._backend.spec_stats)
        self.spec_totals.add(stats)
        return stats

    def generate(self, ids: Sequence[int], params: SamplingParams) -> Completion:
        """The whole completion at once (same stopping rules as `stream`)."""
        text: list[str] = []
        token_ids: list[int] = []
        finish, cached = "length", 0
        for delta in self.stream(ids, params):
            text.append(delta.text)
            token_ids += delta.token_ids
            finish = delta.finish_reason or finish
            cached += delta.cached_tokens
        return Completion("".join(text), tuple(token_ids), len(ids), len(token_ids), finish,
                          cached)  # fmt: skip

    # Lifetime ----------------------------------------------------------------------------
    @property
    def backend(self):
        """The open backend (nanoqwen.backend.Backend): token ids in, token ids out, for
        benchmarks that time the engine without the text around it."""
        self._require_open()
        return self._backend

    @property
    def kv_pages_in_use(self) -> int:
        return 0 if self._backend is None else self._backend.kv_pages_in_use

    @property
    def kv_stats(self):
        """The KV pool and the prefix cache (nanoqwen.kv_pages.KVStats), or None when closed."""
        return None if self._backend is None else self._backend.kv_stats

    def _require_open(self) -> None:
        if self._backend is None:
            raise NanoqwenError("this LLM is closed")

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None
            self._file.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
