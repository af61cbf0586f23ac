"""Ollama's API (docs/api.md of github.com/ollama/ollama), for Continue, Tabby, Twinny, Open WebUI.

    POST /api/generate   prompt; suffix -> fill-in-the-middle; system; raw
    POST /api/chat       messages
    GET  /api/tags, GET /api/ps, POST /api/show, GET|HEAD /api/version

Model names: the served model id, alone or with Ollama's default tag ("tiny", "tiny:latest");
any other name is a 404 {"error": "model 'x' not found"}, as Ollama answers.

Prompts. /api/generate with a non-empty `suffix` is `tokenizer.fim_prompt(prompt, suffix)`, the
ids /v1/completions makes of the same prompt and suffix; without one, `prompt` is the user turn
of the model's chat template, after `system` when given; `raw` sends `prompt` as is. An empty
prompt without a suffix (or /api/chat without messages) asks Ollama to load the model: it is
always loaded here, so the answer is {"done": true, "done_reason": "load"} at once.

The fields, each honoured, accepted as a pure hint, or refused (400):

    honoured  stream (default true), raw, system, suffix, tools and messages' tool_calls
              (/api/chat), and the options temperature, top_k (<= 0: off), top_p, seed (-1:
              random), num_predict (<= 0: until the context, as in Ollama), stop
    hints     keep_alive (the model stays loaded), truncate (a prompt that does not fit is
              refused, never cut), shift (generation stops at the end of the context), the
              load-time options num_ctx (the context is --max-context), num_batch, num_gpu,
              main_gpu, num_thread, use_mmap, num_keep, and unknown options (Ollama skips
              those too)
    refused   format ("json" or a schema: the output cannot be constrained), template,
              context, images, think (true or a level: no thinking mode),
              logprobs, top_logprobs; raw with system or suffix, and system with suffix (Ollama
              drops them silently); the options min_p, typical_p, repeat_penalty,
              presence_penalty, frequency_penalty unless neutral (0, 1, 1, 0, 0)

Defaults are Ollama's: temperature 0.8, top_k 40, top_p 0.9, num_predict -1.

Tools as /v1/chat/completions takes them (nanoqwen.tool_calls), in Ollama's shapes: a call's
arguments are an object, a reply's calls come as message.tool_calls (a streamed call in a
chunk of its own, whole), done_reason stays "stop", and /api/show lists the "tools" capability
when the model's template renders tools (Continue reads it).

Streams are NDJSON (application/x-ndjson), one object per line: text chunks with done false,
then the final object with done true, done_reason ("stop" or "length"), prompt_eval_count,
eval_count and the durations in nanoseconds: total_duration from the request's arrival,
load_duration 0 (the model is resident), prompt_eval_duration and eval_duration as
`compat.Run` measures them. A failure after the first line is an {"error": "..."} line.
Statuses follow this server's rules (400 bad input, 429 + Retry-After when the queue is full,
503 when the engine is down), where Ollama itself answers 503 to a full queue.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import __version__
from ..fileformat import PREAMBLE_SIZE
from ..sampling import SamplingParams
from ..tool_calls import NoToolCalls, ToolCallParser
from .app import ClientGone, JobStream, Service, job_events
from .compat import (
    BadBody,
    Run,
    field_names,
    null_means_default,
    only_neutral,
    parse_body,
    refuse_unless_empty,
)
from .protocol import APIError
from .schemas import MAX_TOOLS, NO_TOOLS, FunctionDef, Tool, ToolPlan, plan_tools

# The Ollama release whose API this module follows; clients gate features on /api/version.
OLLAMA_VERSION = "0.12.0"
DEFAULT_TAG = "latest"
NDJSON = "application/x-ndjson"
NEUTRAL = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# How the prompt is built, in Ollama's template language (Continue looks for `.Suffix` to know
# that the model fills in the middle); the chat branch is the model's ChatML template in short.
TEMPLATE = (
    "{{- if .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>"
    "{{- else }}{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n{{ end }}"
)
FOREVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: the model is never unloaded


class OllamaError(Exception):
    """An error answered as Ollama answers: {"error": "..."} with the status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}

    @classmethod
    def from_api(cls, exc: APIError) -> OllamaError:
        return cls(exc.status, exc.body["error"]["message"], exc.headers)

    def response(self) -> JSONResponse:
        return JSONResponse({"error": str(self)}, status_code=self.status, headers=self.headers)


class Options(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    temperature: float = Field(default=0.8, ge=0.0)
    top_k: int = 40
    top_p: float = Field(default=0.9, ge=0.0, le=1.0)
    seed: int = Field(default=-1, ge=-1, lt=2**63)
    num_predict: int = -1
    stop: str | list[str] = []  # empty strings are skipped
    min_p: float = NEUTRAL["min_p"]
    typical_p: float = NEUTRAL["typical_p"]
    repeat_penalty: float = NEUTRAL["repeat_penalty"]
    presence_penalty: float = NEUTRAL["presence_penalty"]
    frequency_penalty: float = NEUTRAL["frequency_penalty"]

    _nulls = model_validator(mode="before")(null_means_default)

    _neutral = only_neutral(NEUTRAL)


class OllamaRequest(BaseModel):
    """Fields shared by /api/generate and /api/chat."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(min_length=1)
    stream: bool = True
    options: Options = Options()
    format: str | dict[str, Any] = ""
    keep_alive: str | float | None = None
    think: bool | str = False
    truncate: bool = True
    shift: bool = True
    logprobs: bool = False
    top_logprobs: int = 0

    # What Service.submit names in its errors.
    max_tokens_field: ClassVar[str] = "options.num_predict"

    _nulls = model_validator(mode="before")(null_means_default)
    _format = refuse_unless_empty("format", "the output cannot be constrained to JSON")
    _logprobs = refuse_unless_empty("logprobs", "no log-probabilities are computed")
    _top_logprobs = refuse_unless_empty("top_logprobs", "no log-probabilities are computed")

    @field_validator("think")
    @classmethod
    def _no_thinking(cls, value: bool | str) -> bool | str:
        if value is not False:
            raise ValueError("this model has no thinking mode; send think false or leave it out")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.options.num_predict if self.options.num_predict > 0 else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        o = self.options
        stop = (o.stop,) if isinstance(o.stop, str) else tuple(o.stop)
        return SamplingParams(
            temperature=0.0 if o.top_p == 0.0 else o.temperature,  # top_p 0 keeps one token
            top_k=max(o.top_k, 0),
            top_p=o.top_p if o.top_p > 0.0 else 1.0,
            seed=None if o.seed == -1 else o.seed,
            max_tokens=max_tokens,
            stop=tuple(s for s in stop if s),
        )


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    raw: bool = False
    template: str = ""
    context: list[int] = []
    images: list[str] = []

    prompt_field: ClassVar[str] = "prompt"

    _template = refuse_unless_empty("template", "prompts use the model's own template")
    _context = refuse_unless_empty("context", "send the conversation to /api/chat")
    _images = refuse_unless_empty("images", "the model reads text only")

    @model_validator(mode="after")
    def _combinations(self) -> GenerateRequest:
        if self.raw and (self.system or self.suffix):
            raise ValueError(
                "raw mode does not support system or suffix: a raw prompt is sent as is"
            )
        if self.system and self.suffix:
            raise ValueError("system is not used with suffix: fill-in-the-middle has no turns")
        return self

    def prompt_arguments(self) -> dict[str, Any]:
        """The `LLM.prepare` arguments for this request."""
        if self.suffix:
            return {"fim": (self.prompt, self.suffix)}
        if self.raw:
            return {"prompt": self.prompt}
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"messages": [*system, {"role": "user", "content": self.prompt}]}


class CallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    function: CallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] = []
    tool_calls: list[ToolCall] = []

    _nulls = model_validator(mode="before")(null_means_default)
    _images = refuse_unless_empty("images", "the model reads text only")

    def as_template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        return message


class ChatRequest(OllamaRequest):
    messages: list[ChatMessage] = []
    tools: list[Tool] = Field(default=[], max_length=MAX_TOOLS)

    prompt_field: ClassVar[str] = "messages"

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools)  # Ollama has no tool_choice: "auto"


class ShowRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = ""
    name: str = ""  # the older spelling, still sent by Continue and litellm


FIELD_NAMES = field_names(GenerateRequest, ChatRequest, ChatMessage, Options, ShowRequest,
                          ToolCall, CallFunction, Tool, FunctionDef)  # fmt: skip


def rfc3339(seconds: float | None = None) -> str:
    when = datetime.now(UTC) if seconds is None else datetime.fromtimestamp(seconds, UTC)
    return when.isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


class ModelFacts:
    """What /api/tags, /api/ps and /api/show say about the served file, read on first use."""

    def __init__(self, service: Service) -> None:
        llm = service.llm
        path = Path(llm.path)
        stat = path.stat()
        with open(path, "rb") as f:
            preamble = f.read(PREAMBLE_SIZE)
        config = llm.config
        params = parameter_count(config)
        self.name = f"{service.model}:{DEFAULT_TAG}"
        self.size = stat.st_size
        self.modified_at = rfc3339(stat.st_mtime)
        # The preamble holds the header's CRC32, and the header every tensor's CRC32: hashing
        # it identifies the weights without reading gigabytes.
        self.digest = hashlib.sha256(preamble).hexdigest()
        self.details = {
            "parent_model": "",
            "format": "nanoqwen",
            "family": "qwen2",
            "families": ["qwen2"],
            "parameter_size": human_count(params),
            "quantization_level": "INT4",
        }
        self.model_info = {
            "general.architecture": "qwen2",
            "general.parameter_count": params,
            # The context this server serves (--max-context), the limit requests meet.
            "qwen2.context_length": llm.max_context,
            "qwen2.embedding_length": config.hidden_size,
            "qwen2.feed_forward_length": config.intermediate_size,
            "qwen2.block_count": config.num_layers,
            "qwen2.attention.head_count": config.num_heads,
            "qwen2.attention.head_count_kv": config.num_kv_heads,
            "qwen2.rope.freq_base": config.rope_theta,
        }
        self.context = llm.max_context
        self.on_gpu = llm.backend_name == "cuda"
        self.tools = llm.tokenizer.supports_tools

    def entry(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }


def parameter_count(config: Any) -> int:
    """Weights of the model: each uint32 word of an INT4 projection packs 8; scales are not
    parameters; a tied model's lm_head is its embedding."""
    total = 0
    for name, (dtype, shape) in config.tensor_shapes().items():
        if name.endswith(".scales"):
            continue
        count = 8 if dtype == "uint32" else 1
        for d in shape:
            count *= d
        total += count
    return total


def human_count(n: int) -> str:
    """Ollama's spelling of a parameter count: "1.5B", "494M"."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


class OllamaReply:
    """The response objects of one /api/generate (`chat` False) or /api/chat request."""

    def __init__(self, model: str, chat: bool, started: float) -> None:
        self.model = model  # echoed as the client spelled it, as Ollama does
        self.chat = chat
        self.started = started

    def _with(self, text: str, calls: list[Any] = (), **fields: Any) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_call_json(call) for call in calls]
            content: dict[str, Any] = {"message": message}
        else:
            content = {"response": text}
        return {"model": self.model, "created_at": rfc3339(), **content, **fields}

    def chunk(self, text: str, calls: list[Any] = ()) -> dict[str, Any]:
        return self._with(text, calls, done=False)

    def loaded(self) -> dict[str, Any]:
        return self._with("", done=True, done_reason="load")

    def final(self, run: Run, text: str, calls: list[Any] = ()) -> dict[str, Any]:
        return self._with(
            text,
            calls,
            done=True,
            done_reason=run.finish_reason or "stop",
            total_duration=ns(time.perf_counter() - self.started),
            load_duration=0,
            prompt_eval_count=run.prompt_tokens,
            prompt_eval_duration=ns(run.prompt_seconds),
            eval_count=run.generated,
            eval_duration=ns(run.eval_seconds),
        )


def _call_json(call: Any) -> dict[str, Any]:
    """A parsed call (nanoqwen.tool_calls.ToolCall) in Ollama's shape: arguments an object."""
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def line(payload: dict[str, Any]) -> bytes:
    """One NDJSON line (compact JSON; non-ASCII kept as UTF-8, as Go's encoder writes it)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def add_ollama_routes(app: FastAPI, service: Service) -> None:
    """Register the /api/* routes (and OllamaError's handler) on `app`."""

    @functools.cache  # read on first use: the file does not change while it is served
    def model_facts() -> ModelFacts:
        return ModelFacts(service)

    def check_model(name: str) -> None:
        if name not in (service.model, f"{service.model}:{DEFAULT_TAG}"):
            raise OllamaError(404, f"model '{name}' not found")

    async def read(request: Request, model: type[Any]) -> Any:
        try:
            return parse_body(await request.body(), model, FIELD_NAMES)
        except BadBody as exc:
            raise OllamaError(400, str(exc)) from None

    @app.exception_handler(OllamaError)
    async def on_ollama_error(request: Request, exc: OllamaError) -> JSONResponse:
        return exc.response()

    @app.get("/api/version")
    @app.head("/api/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION, "nanoqwen": __version__}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [model_facts().entry()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        f = model_facts()
        loaded = {"expires_at": FOREVER, "size_vram": f.size if f.on_gpu else 0}
        return {"models": [f.entry() | loaded | {"context_length": f.context}]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await read(request, ShowRequest)
        name = body.model or body.name
        if not name:
            raise OllamaError(400, "model is required")
        check_model(name)
        f = model_facts()
        return {
            "modelfile": f"# Modelfile of a model served by nanoqwen\nFROM {f.name}\n",
            "parameters": f"num_ctx {f.context}",
            "template": TEMPLATE,
            "details": f.details,
            "model_info": f.model_info,
            "capabilities": ["completion", "insert", *(["tools"] if f.tools else [])],
            "modified_at": f.modified_at,
        }

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        started = time.perf_counter()
        body = await read(request, GenerateRequest)
        check_model(body.model)
        reply = OllamaReply(body.model, chat=False, started=started)
        if not body.prompt and not body.suffix:
            return JSONResponse(reply.loaded())
        return await respond(request, service, body, body.prompt_arguments(), reply)

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        started = time.perf_counter()
        body = await read(request, ChatRequest)
        check_model(body.model)
        reply = OllamaReply(body.model, chat=True, started=started)
        if not body.messages:
            return JSONResponse(reply.loaded())
        messages = [m.as_template_message() for m in body.messages]
        plan = body.tool_plan
        prompt = {"messages": messages} | ({"tools": plan.tools} if plan.parses else {})
        return await respond(request, service, body, prompt, reply, plan)


async def respond(
    request: Request,
    service: Service,
    body: Any,
    prompt: dict[str, Any],
    reply: OllamaReply,
    tools: ToolPlan = NO_TOOLS,
) -> Response:
    """Tokenize, queue, and answer: one JSON object, or NDJSON lines as the tokens come."""
    try:
        ids = await service.prepare(body.prompt_field, **prompt)
        job = service.submit(ids, service.sampling(body, ids, None))
    except APIError as exc:
        raise OllamaError.from_api(exc) from None
    run = Run(len(ids))
    events = job_events(request, job)
    parser = tools.parser()
    try:
        if body.stream:
            first = await anext(events, None)  # errors before the first token keep a status
            if first is not None:
                run.add(first)
            body_lines = ndjson_body(reply, run, first, events, parser)
            return JobStream(job, body_lines, media_type=NDJSON)
        text, calls = [], []
        async for delta in events:
            run.add(delta)
            for piece in parser.push(delta.text, delta.finish_reason is not None):
                (text if isinstance(piece, str) else calls).append(piece)
    except APIError as exc:
        raise OllamaError.from_api(exc) from None
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(reply.final(run, "".join(text), calls))


async def ndjson_body(
    reply: OllamaReply,
    run: Run,
    first: Any,
    events: AsyncIterator[Any],
    parser: ToolCallParser | NoToolCalls,
) -> AsyncIterator[bytes]:
    """Text and call chunks, then the final object; `first` is already accounted in `run`."""
    try:
        delta = first
        while delta is not None:
            for piece in parser.push(delta.text, delta.finish_reason is not None):
                chunk = reply.chunk(piece) if isinstance(piece, str) else reply.chunk("", [piece])
                yield line(chunk)
            delta = await anext(events, None)
            if delta is not None:
                run.add(delta)
        yield line(reply.final(run, ""))
    except APIError as exc:  # the status line is gone: report the failure as a line
        yield line({"error": exc.body["error"]["message"]})
    except ClientGone:
        return
    finally:
        await events.aclose()
