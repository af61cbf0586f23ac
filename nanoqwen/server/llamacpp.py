"""llama.cpp's server API, for editor fill-in-the-middle clients (llama.vim, llama.vscode) and
the clients of its own completion endpoint (Continue's and Tabby's llama.cpp providers).

    POST /infill       input_prefix, input_suffix, input_extra, prompt -> content (+ stats)
    POST /completion   prompt -> content (+ stats); /completions is its alias, as in llama.cpp
    POST /tokenize     content -> tokens (with_pieces: {id, piece} each)
    POST /detokenize   tokens -> content
    GET  /props        n_ctx and the default sampling settings (llama.vscode reads n_ctx)

/completion's `prompt` is text (special-token text becomes the control tokens unless the server
runs with --special-tokens text, as for a raw /v1/completions prompt), token ids, or both mixed
([12, "text", 34]); a list of strings, which llama.cpp reads as several prompts, is a 400. Its
other fields, response and stream are /infill's, described below.

(/health already answers {"status": "ok"}, which is what llama.vscode reads from it.)

The /infill prompt. `prompt` continues `input_prefix` (llama.vim sends the cursor line's text
before the cursor; llama.cpp's format_prompt_infill puts it there too, though its README says
"after FIM_MID"), so the FIM prompt is `tokenizer.fim_prompt(input_prefix + prompt,
input_suffix)`: the two are encoded as one text (llama.cpp joins two encodings), and
special-token text in any field stays text (llama.cpp parses it in `prompt`). With
`input_extra` chunks it is Qwen2.5-Coder's repo-level prompt, laid out as llama.cpp's server
lays it out:

    <|repo_name|>myproject\\n <|file_sep|>{filename}\\n{text} (each chunk)
    <|file_sep|>filename\\n <|fim_prefix|>...<|fim_suffix|>...<|fim_middle|>

("myproject" and "filename" are llama.cpp's fixed names; a chunk without a filename is "tmp").
Without chunks there is no repo header, so the prompt is exactly `fim_prompt`. Chunks are
dropped oldest first (llama.vim's ring buffer sends the oldest first) until the prompt leaves
`n_predict` tokens free (UNBOUNDED_ROOM when n_predict is -1); `truncated` says some were
dropped. The prefix and suffix are never cut: a FIM core that does not fit is a 400.

The fields of both, each honoured, accepted as a pure hint, or refused (400) unless neutral:

    honoured  n_predict (-1: until the context; 0: a warm-up, the prompt prefilled into the
              prefix cache and nothing returned;
              max_tokens is its fallback), stream, temperature, top_k (<= 0: off), top_p,
              seed (-1 and 4294967295: random), stop (empty strings skipped), samplers (which
              of top_k / top_p / temperature apply: a chain without "temperature" samples at
              1.0, as llama.cpp does), n_indent and t_max_predict_ms (llama.cpp's stopping
              rules, below), n_cmpl (<= MAX_COMPLETIONS completions, decoded together;
              seeded, completion j draws from seed + j; a JSON array answers n_cmpl > 1),
              return_tokens, response_fields, timings_per_token, model (must name the
              served model when given)
    hints     cache_prompt (the prefix cache is always on: tokens_cached says what it served),
              t_max_prompt_ms (llama.cpp ignores it too), id_slot (-1 or 0: one slot),
              the "infill" sampler (llama.cpp's EOG/prefix-merging sampler: both editors
              always send it; sampling here is top_k/top_p/temperature only), n_keep and
              post_sampling_probs (only meaningful with context shift / n_probs)
    neutral   min_p 0, typical_p 1, repeat_penalty 1, presence_penalty 0, frequency_penalty 0,
              mirostat 0, dry_multiplier 0, xtc_probability 0, top_n_sigma -1, n_probs 0,
              ignore_eos false, grammar/json_schema absent, logit_bias and lora empty; any
              other sampler name in `samplers` is refused

Stopping rules from llama.cpp's server: with n_indent > 0, a line after the first newline whose
indentation is below n_indent (a blank line counts as 0, as in llama.cpp) stops the completion,
cut at its first non-blank character; with t_max_predict_ms > 0, a newline generated after that
many milliseconds of generation stops it. Both report stop_type "limit".

The response carries llama.cpp's fields (content, tokens, stop, model, tokens_predicted,
tokens_evaluated, stop_type and the older stopped_eos / stopped_word / stopped_limit,
stopping_word, truncated, timings, generation_settings, ...); a stream is SSE `data: {...}`
events, text events with stop false then a final event with stop true and the statistics, and
no `data: [DONE]` (llama.cpp sends none on its own endpoints). Errors are {"error": {"code",
"message", "type"}} with llama.cpp's types; a context overflow also gives n_prompt_tokens and
n_ctx. Timings are the front end's wall clock (see `compat.Run`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import chain
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import __version__
from ..errors import ContextError, NanoqwenError
from ..sampling import SamplingParams
from ..tokenizer import StopMatcher, TooManyTokens
from .app import ClientGone, JobStream, Service, choice_params, job_events
from .compat import (
    BadBody,
    Run,
    field_names,
    null_means_default,
    only_neutral,
    parse_body,
    refuse_unless_empty,
)
from .protocol import APIError, sse
from .worker import Job

REPO_NAME = "myproject"  # llama.cpp's names in the repo-level prompt
CURRENT_FILE = "filename"
CHUNK_FILE = "tmp"
UNBOUNDED_ROOM = 512  # tokens kept free of input_extra when n_predict is -1
MAX_COMPLETIONS = 4  # n_cmpl; llama.cpp's limit is its slot count
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's spellings of "random"
SAMPLERS = ("top_k", "top_p", "temperature")  # the sampler chain this server implements
HINT_SAMPLERS = ("infill",)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95}  # llama.cpp's defaults
NEUTRAL = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "n_probs": 0,
    "ignore_eos": False,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "unavailable_error",  # llama.cpp has no queue limit; the nearest of its types
    500: "server_error",
    503: "unavailable_error",
}


class LlamaError(Exception):
    """An error answered as llama.cpp's server answers: {"error": {"code", "message", "type"}}."""

    def __init__(
        self, status: int, message: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        kind = extra.pop("type", None) or ERROR_TYPES.get(status, "server_error")
        self.error = {"code": status, "message": message, "type": kind, **extra}
        self.headers = headers or {}

    @classmethod
    def context(cls, message: str, prompt_tokens: int, n_ctx: int) -> LlamaError:
        return cls(
            400,
            message,
            type="exceed_context_size_error",
            n_prompt_tokens=prompt_tokens,
            n_ctx=n_ctx,
        )

    @classmethod
    def from_api(cls, exc: APIError, prompt_tokens: int, n_ctx: int) -> LlamaError:
        """The server's OpenAI-shaped error (queue full, engine down, context) in this shape."""
        error = exc.body["error"]
        if error["code"] == "context_length_exceeded":
            return cls.context(error["message"], prompt_tokens, n_ctx)
        return cls(exc.status, error["message"], headers=exc.headers)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error}, status_code=self.status, headers=self.headers)


class Chunk(BaseModel):
    """One `input_extra` entry: a piece of another file the editor thinks is relevant."""

    model_config = ConfigDict(strict=True, extra="ignore")
    text: str
    filename: str = CHUNK_FILE

    _nulls = model_validator(mode="before")(null_means_default)


class LlamaRequest(BaseModel):
    """The fields /infill and /completion share: sampling, stopping, and the response's form."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = ""
    n_predict: int = Field(default=-1, ge=-1)
    max_tokens: int = Field(default=-1, ge=-1)
    stream: bool = False
    temperature: float = Field(default=DEFAULTS["temperature"], ge=0.0)
    top_k: int = DEFAULTS["top_k"]
    top_p: float = Field(default=DEFAULTS["top_p"], ge=0.0, le=1.0)
    seed: int = Field(default=-1, ge=-1, lt=2**63)
    stop: str | list[str] = []
    samplers: list[str] | None = None
    n_indent: int = Field(default=0, ge=0)
    t_max_predict_ms: float = Field(default=0, ge=0)
    n_cmpl: int = Field(default=1, ge=1, le=MAX_COMPLETIONS)
    return_tokens: bool = False
    response_fields: list[str] = []
    timings_per_token: bool = False
    # Hints (module docstring).
    cache_prompt: bool = True
    t_max_prompt_ms: float = 0
    id_slot: int = Field(default=-1, ge=-1, le=0)
    # Refused unless neutral.
    min_p: float = NEUTRAL["min_p"]
    typical_p: float = NEUTRAL["typical_p"]
    repeat_penalty: float = NEUTRAL["repeat_penalty"]
    presence_penalty: float = NEUTRAL["presence_penalty"]
    frequency_penalty: float = NEUTRAL["frequency_penalty"]
    mirostat: int = NEUTRAL["mirostat"]
    dry_multiplier: float = NEUTRAL["dry_multiplier"]
    xtc_probability: float = NEUTRAL["xtc_probability"]
    top_n_sigma: float = NEUTRAL["top_n_sigma"]
    n_probs: int = NEUTRAL["n_probs"]
    ignore_eos: bool = NEUTRAL["ignore_eos"]
    grammar: str = ""
    json_schema: Any = None
    logit_bias: list[Any] | dict[str, Any] = []
    lora: list[Any] = []

    # What Service.sampling names in its errors.
    prompt_field: ClassVar[str]
    max_tokens_field: ClassVar[str] = "n_predict"

    _nulls = model_validator(mode="before")(null_means_default)

    _neutral = only_neutral(NEUTRAL)

    _grammar = refuse_unless_empty("grammar", "the output cannot be constrained")
    _json_schema = refuse_unless_empty("json_schema", "the output cannot be constrained")
    _logit_bias = refuse_unless_empty("logit_bias", "logits are not biased")
    _lora = refuse_unless_empty("lora", "the model has no adapters")

    @field_validator("samplers")
    @classmethod
    def _known_samplers(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if name not in SAMPLERS + HINT_SAMPLERS:
                raise ValueError(
                    f"sampler {name!r} is not supported by this server; it samples with "
                    f"{', '.join(SAMPLERS)} (and accepts 'infill' as a hint)"
                )
        return value

    @property
    def predict(self) -> int:
        """n_predict, else max_tokens (llama.cpp's fallback): -1 until the context, 0 none."""
        return self.n_predict if "n_predict" in self.model_fields_set else self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)

    @property
    def applied_samplers(self) -> tuple[str, ...]:
        """The samplers that apply; llama.cpp's default chain has all three."""
        given = SAMPLERS if self.samplers is None else self.samplers
        return tuple(name for name in SAMPLERS if name in given)

    def requested_max_tokens(self) -> int | None:
        return self.predict if self.predict > 0 else None

    def sampled(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) as the sampler chain applies them."""
        applied = self.applied_samplers
        temperature = self.temperature if "temperature" in applied else 1.0
        top_k = max(self.top_k, 0) if "top_k" in applied else 0
        top_p = self.top_p if "top_p" in applied else 1.0
        if top_p == 0.0:  # keeps only the most probable token: greedy
            return 0.0, top_k, 1.0
        return temperature, top_k, top_p

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        temperature, top_k, top_p = self.sampled()
        return SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=None if self.seed in RANDOM_SEEDS else self.seed,
            max_tokens=max_tokens,
            stop=self.stops,
        )

    def settings(self, max_tokens: int) -> dict[str, Any]:
        """`generation_settings`: the parameters as applied."""
        temperature, top_k, top_p = self.sampled()
        return {
            "n_predict": self.predict,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": self.seed,
            "stop": list(self.stops),
            "samplers": list(self.applied_samplers),
            "n_indent": self.n_indent,
            "t_max_predict_ms": self.t_max_predict_ms,
            "stream": self.stream,
        }


class InfillRequest(LlamaRequest):
    input_prefix: str
    input_suffix: str
    input_extra: list[Chunk] = []
    prompt: str = ""

    prompt_field: ClassVar[str] = "input_prefix"

    def prompt_ids(self, llm: Any, special_tokens: str) -> tuple[list[int], bool]:
        """(prompt ids, whether input_extra chunks were dropped); special-token text in every
        field stays text, as in llama.cpp's infill (the module docstring)."""
        return infill_prompt(llm.tokenizer, self, llm.max_context)


class CompletionRequest(LlamaRequest):
    """/completion: `prompt` is text, token ids, or both mixed ([12, "text", 34]), one prompt
    a request (llama.cpp reads a list of strings or of lists as several prompts)."""

    prompt: str | list[int | str]

    prompt_field: ClassVar[str] = "prompt"

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int | str]) -> str | list[int | str]:
        if isinstance(value, list) and not any(isinstance(piece, int) for piece in value):
            raise ValueError(
                "a list of strings is several prompts, which this server does not take in one "
                "request: send each as its own, or mix the strings with token ids"
            )
        return value

    def prompt_ids(self, llm: Any, special_tokens: str) -> tuple[list[int], bool]:
        """(prompt ids, False): text as `LLM.prepare` encodes a raw prompt (special-token text
        parsed unless the server runs with --special-tokens text, as in llama.cpp), token ids
        as given."""
        if isinstance(self.prompt, str):
            return llm.prepare(self.prompt, special_tokens=special_tokens), False
        ids: list[int] = []
        for piece in self.prompt:
            if isinstance(piece, int):
                ids.append(piece)
            elif piece:
                ids += llm.prepare(piece, special_tokens=special_tokens)
        return llm.prepare(ids), False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    content: str
    add_special: bool = False  # a hint: Qwen2.5 has no BOS to add
    parse_special: bool = True  # special-token text becomes the control tokens (llama.cpp's)
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int] = []


FIELD_NAMES = field_names(InfillRequest, CompletionRequest, Chunk, TokenizeRequest,
                          DetokenizeRequest)  # fmt: skip


def infill_prompt(tokenizer: Any, body: InfillRequest, max_context: int) -> tuple[list[int], bool]:
    """(prompt ids, whether input_extra chunks were dropped): see the module docstring."""
    # Bounded like every prompt: tokenizing stops past the context (TooManyTokens, a 400).
    core = tokenizer.fim_prompt(body.input_prefix + body.prompt, body.input_suffix,
                                limit=max_context - 1)  # fmt: skip
    if not body.input_extra:
        return core, False
    head, tail = tokenizer.repo_name(REPO_NAME), tokenizer.repo_file(CURRENT_FILE)
    files = [tokenizer.repo_file(c.filename, c.text) for c in body.input_extra]
    room = body.predict if body.predict > 0 else UNBOUNDED_ROOM
    budget = max_context - room - len(core) - len(head) - len(tail)
    kept: list[list[int]] = []
    for ids in reversed(files):  # the newest chunks are the last ones
        if len(ids) > budget:
            break
        kept.append(ids)
        budget -= len(ids)
    if not kept:
        return core, True
    return [*head, *chain.from_iterable(reversed(kept)), *tail, *core], len(kept) < len(files)


class InfillStops:
    """llama.cpp's infill stopping rules on the generated text: n_indent and t_max_predict_ms."""

    def __init__(self, n_indent: int, t_max_predict_ms: float) -> None:
        self.n_indent = n_indent
        self.t_max_s = t_max_predict_ms / 1e3
        self.text = ""
        self._scan = 0  # where to look for the next newline
        self._line: int | None = None  # start of the line whose indentation is undecided

    def feed(self, text: str, generating_s: float) -> tuple[str, bool]:
        """(the part of `text` to keep, stopped) after `generating_s` seconds of generation."""
        start = len(self.text)
        self.text += text
        cut = self._dedent() if self.n_indent > 0 else None
        if cut is not None:
            self.text = self.text[:cut]
            return self.text[start:], True
        timed_out = self.t_max_s > 0 and "\n" in text and generating_s > self.t_max_s
        return text, timed_out

    def _dedent(self) -> int | None:
        """Where to cut: the first non-blank character of a line, after the first newline,
        indented less than n_indent; None while no such line has appeared."""
        while True:
            if self._line is None:
                newline = self.text.find("\n", self._scan)
                if newline < 0:
                    self._scan = len(self.text)
                    return None
                self._line = newline + 1
            pos = self._line
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos == len(self.text):
                return None  # only blanks so far: the indentation is not known yet
            if pos - self._line < self.n_indent:
                return pos
            self._scan, self._line = pos, None


class Completion:
    """One completion as it is generated: the run, the kept text, how it stopped."""

    def __init__(self, body: LlamaRequest, prompt_tokens: int, max_tokens: int) -> None:
        self.run = Run(prompt_tokens)
        self.max_tokens = max_tokens
        self.stops = InfillStops(body.n_indent, body.t_max_predict_ms)
        self.limited = False  # stopped by n_indent or t_max_predict_ms

    def add(self, delta: Any) -> str:
        self.run.add(delta)
        text, self.limited = self.stops.feed(delta.text, self.run.eval_seconds)
        return text

    @property
    def text(self) -> str:
        return self.stops.text


async def pieces(completion: Completion, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """(text, token ids) per delta, after the stopping rules; closing it cancels the job."""
    try:
        async for delta in events:
            text = completion.add(delta)
            yield text, delta.token_ids
            if completion.limited:
                return
    finally:
        await events.aclose()


class LlamaReply:
    """The response bodies of one /infill or /completion request, llama.cpp's fields."""

    def __init__(self, service: Service, body: LlamaRequest, ids: list[int], truncated: bool):
        self.service = service
        self.body = body
        self.ids = ids
        self.truncated = truncated

    def error(self, exc: APIError) -> LlamaError:
        return LlamaError.from_api(exc, len(self.ids), self.service.llm.max_context)

    def partial(self, index: int, completion: Completion, text: str, token_ids: Any) -> bytes:
        event = {
            "index": index,
            "content": text,
            "tokens": list(token_ids) if self.body.return_tokens else [],
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": completion.run.generated,
            "tokens_evaluated": len(self.ids),
        }
        if self.body.timings_per_token:
            event["timings"] = timings(completion.run)
        return sse(event)

    def final(self, index: int, completion: Completion | None, streamed: bool) -> dict[str, Any]:
        """The result object (the last event of a stream, whose text was already sent);
        `completion` None: n_predict 0, nothing generated."""
        run = completion.run if completion else Run(0)
        stop, word = self._stop(completion) if completion else ("limit", "")
        text = completion.text if completion else ""
        out = {
            "index": index,
            "content": "" if streamed else text,
            "tokens": run.token_ids if self.body.return_tokens and not streamed else [],
            "id_slot": 0,
            "stop": True,
            "model": self.service.model,
            "tokens_predicted": run.generated,
            "tokens_evaluated": len(self.ids),
            "generation_settings": self.body.settings(completion.max_tokens if completion else 0),
            "prompt": self.service.llm.tokenizer.decode(self.ids),
            "has_new_line": "\n" in text,
            "truncated": self.truncated,
            "stop_type": stop,
            "stopped_eos": stop == "eos",
            "stopped_word": stop == "word",
            "stopped_limit": stop == "limit",
            "stopping_word": word,
            "tokens_cached": run.cached_tokens,
            "timings": timings(run),
        }
        return select(out, self.body.response_fields)

    def _stop(self, completion: Completion) -> tuple[str, str]:
        """(stop_type, stopping_word) of a finished completion."""
        run = completion.run
        if completion.limited or run.finish_reason == "length":
            return "limit", ""
        if run.finish_reason != "stop":
            return "none", ""
        eos = self.service.llm.tokenizer.eos_token_ids
        if run.token_ids and run.token_ids[-1] in eos:
            return "eos", ""
        return "word", stopping_word(self.service.llm.tokenizer.decode(run.token_ids), self.body)


def stopping_word(text: str, body: LlamaRequest) -> str:
    """The stop string that ended `text`: StopMatcher's cut is where it starts, and of the stops
    starting there the shortest completes first."""
    cut, _ = StopMatcher(body.stops).feed(text)
    starting = [s for s in body.stops if text.startswith(s, len(cut))]
    return min(starting, key=len) if starting else ""


def timings(run: Run) -> dict[str, Any]:
    prompt_ms, predicted_ms = run.prompt_seconds * 1e3, run.eval_seconds * 1e3
    prompt_n, predicted_n = (run.prompt_tokens if run.first else 0), run.generated
    return {
        "cache_n": 0,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_n and prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


def select(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: only the named values, each under its "a/b" path as a
    flat key; a path that names nothing is left out. No paths: the whole result."""
    if not paths:
        return result
    out = {}
    for path in paths:
        value: Any = result
        for key in path.split("/"):
            if not (isinstance(value, dict) and key in value):
                break
            value = value[key]
        else:
            out[path] = value
    return out


def add_llamacpp_routes(app: FastAPI, service: Service) -> None:
    """Register /infill and /props (and LlamaError's handler) on `app`."""

    @app.exception_handler(LlamaError)
    async def on_llama_error(request: Request, exc: LlamaError) -> JSONResponse:
        return exc.response()

    @app.get("/props")
    async def props() -> dict[str, Any]:
        params = {"n_predict": -1, "seed": -1, "samplers": list(SAMPLERS), **DEFAULTS}
        return {
            "default_generation_settings": {"n_ctx": service.llm.max_context, "params": params},
            "total_slots": 1,
            "model_alias": service.model,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"nanoqwen {__version__}",
        }

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        return await respond(request, await prepare(request, service, InfillRequest))

    @app.post("/completion")
    @app.post("/completions")  # llama.cpp's alias
    async def completion(request: Request) -> Response:
        return await respond(request, await prepare(request, service, CompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = read(await request.body(), TokenizeRequest)
        tokenizer = service.llm.tokenizer
        ids = await run_in_threadpool(
            tokenizer.encode, body.content, allow_special=body.parse_special
        )
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": piece(tokenizer.token_bytes(i))} for i in ids]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = read(await request.body(), DetokenizeRequest)
        vocab = service.llm.config.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise LlamaError(400, f"tokens: token id {bad[0]} is outside [0, {vocab})")
        return {"content": service.llm.tokenizer.decode(body.tokens)}


def read(raw: bytes, model: type[Any]) -> Any:
    """The body validated into `model`, or a LlamaError 400 naming the problem."""
    try:
        return parse_body(raw, model, FIELD_NAMES)
    except BadBody as exc:
        raise LlamaError(400, str(exc)) from None


def piece(data: bytes) -> str | list[int]:
    """A token's text as /tokenize's with_pieces gives it: a string, or its bytes when they are
    not whole UTF-8 (a byte-level token inside a character), as llama.cpp gives them."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def respond(request: Request, reply: LlamaReply) -> Response:
    """Generate the reply's completions and answer: one result, an array of n_cmpl results,
    or a stream."""
    if reply.body.predict == 0:
        await warm_up(request, reply)
        return JSONResponse(reply.final(0, None, streamed=False))
    if reply.body.stream:
        return await stream(request, reply)
    # The n_cmpl completions are queued together, so the batch decodes them together (llama.vscode
    # asks for 3 with every request); each is read in turn, the later ones' deltas waiting in
    # their jobs.
    submitted: list[tuple[Completion, Job, AsyncIterator[Any]]] = []
    try:
        for index in range(reply.body.n_cmpl):
            submitted.append(submit(request, reply, index))
        results = []
        for index, (completion, _, parts) in enumerate(submitted):
            try:
                async for _ in parts:
                    pass
            except APIError as exc:
                raise reply.error(exc) from None
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            results.append(reply.final(index, completion, streamed=False))
    finally:
        for _, job, _ in submitted:
            job.cancel()  # those not read to their end: a failure, a refusal, a client gone
    return JSONResponse(results[0] if len(results) == 1 else results)


async def prepare(request: Request, service: Service, model: type[LlamaRequest]) -> LlamaReply:
    """The validated request and its prompt ids (tokenized in the thread pool), or LlamaError."""
    body = read(await request.body(), model)
    if body.model and body.model != service.model:
        message = f"model {body.model!r} is not served here; this server serves {service.model!r}"
        raise LlamaError(404, message)
    if body.stream and body.n_cmpl > 1:
        raise LlamaError(400, "n_cmpl > 1 is served without streaming only")
    llm = service.llm
    try:
        ids, truncated = await run_in_threadpool(body.prompt_ids, llm, service.special_tokens)
    except TooManyTokens as exc:  # tokenizing stopped past the context: a lower bound
        raise LlamaError.context(str(exc), exc.limit + 1, llm.max_context) from None
    except NanoqwenError as exc:
        raise LlamaError(400, str(exc)) from None
    if body.predict == 0:  # a warm-up: the prompt is prefilled for the cache (warm_up)
        try:
            llm.check_fits(len(ids), 1)
        except ContextError as exc:
            raise LlamaError.context(str(exc), len(ids), llm.max_context) from None
    return LlamaReply(service, body, ids, truncated)


async def warm_up(request: Request, reply: LlamaReply) -> None:
    """n_predict 0 (llama.vim sends its context chunks so): the prompt's K/V go into the
    prefix cache, so the completion requests that follow prefill only what they add. One
    greedy token is sampled and dropped (the engine's generation unit)."""
    try:
        job = reply.service.submit(reply.ids, SamplingParams(max_tokens=1))
        async for _ in job_events(request, job):
            pass
    except APIError as exc:
        raise reply.error(exc) from None
    except ClientGone:
        return


def submit(
    request: Request, reply: LlamaReply, index: int = 0
) -> tuple[Completion, Job, AsyncIterator[Any]]:
    """Queue completion `index` of the reply's prompt: its record, its job, and its pieces."""
    ids, service = reply.ids, reply.service
    try:
        params = choice_params(service.sampling(reply.body, ids, None), index)
        job = service.submit(ids, params)
    except APIError as exc:
        raise reply.error(exc) from None
    completion = Completion(reply.body, len(ids), job.params.max_tokens)
    return completion, job, pieces(completion, job_events(request, job))


async def stream(request: Request, reply: LlamaReply) -> Response:
    """SSE events; the first piece is awaited first, so a failure before it keeps its status."""
    completion, job, parts = submit(request, reply)
    try:
        first = await anext(parts, None)
    except APIError as exc:
        raise reply.error(exc) from None
    except ClientGone:
        return Response(status_code=499)
    return JobStream(job, stream_body(reply, completion, first, parts))


async def stream_body(
    reply: LlamaReply, completion: Completion, first: Any, parts: AsyncIterator[Any]
) -> AsyncIterator[bytes]:
    try:
        part = first
        while part is not None:
            text, token_ids = part
            if text:
                yield reply.partial(0, completion, text, token_ids)
            part = await anext(parts, None)
        yield sse(reply.final(0, completion, streamed=True))
    except APIError as exc:  # the status line is gone: report the failure as an event
        yield sse({"error": reply.error(exc).error})
    except ClientGone:
        return
    finally:
        await parts.aclose()
