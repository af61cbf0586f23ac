"""The FastAPI application: routes, validation, streaming and error mapping.

Every request is bounded and validated before it reaches the engine queue: a body over the
limit is a 413 before it is read (limits.py), then pydantic, the model name (404 if not
served), tokenization and `LLM.check_fits` (400), so a bad request costs no GPU work and always
gets an OpenAI error object. A short prompt is tokenized on the event loop (less than the
thread hop costs); a longer one in the thread pool, the tokenizer releasing the GIL, and
tokenization stops once a prompt cannot fit the context (`LLM.prepare`): a huge prompt never
stalls the event loop or other requests. A raw /v1/completions prompt's
special-token text (`<|fim_prefix|>` ...) becomes control tokens unless the server runs with
`--special-tokens text`; chat message contents never do. Only the worker thread runs the
engine.

A request gets `n` choices per prompt (a completion request may list several prompts): each
prompt's n choices are jobs queued together, so the batch decodes them together; the prompts
run one after another (`Choices`), so a request holds at most n places in the queue.

Streaming: the handler waits for the first delta before it answers, so a failure before the
first token still gets its HTTP status (500/503); later failures become an error event, then
`data: [DONE]`. `job_events` awaits the client's disconnect (ASGI `http.disconnect`) beside
the job's events, so a request whose client left is cancelled at once, streamed or not, tokens
flowing or not; `JobStream` also cancels the job however its response ends.

Every request passes `RequestTelemetry` (request id, metrics, one log line; middleware.py),
then CORS when origins are configured, then the body limit, then the API key. /health and
/metrics need no key. The llama.cpp (/infill) and Ollama (/api/*) routes reuse `Service`,
`job_events` and `JobStream` with their own bodies and error shapes (llamacpp.py, ollama.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import ContextError, DeviceError, NanoqwenError, ToolsError
from ..sampling import SamplingParams
from ..tokenizer import TooManyTokens
from .auth import BearerAuth
from .compat import field_path
from .fast_routes import FastRoutes
from .limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .middleware import REQUEST_ID_HEADER, RequestTelemetry, record_of
from .protocol import SSE_DONE, APIError, Reply, sse
from .schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    field_names,
)
from .worker import DONE, EngineDown, Job, QueueFull, Worker

OPEN_PATHS = ("/health", "/metrics")  # served without the API key
RETRY_AFTER_S = 1  # Retry-After on a 429 (queue full)
INLINE_TOKENIZE_CHARS = 4096  # prompts up to this many characters are tokenized on the loop
FIELD_NAMES = field_names()
# FastAPI's native OpenTelemetry (0.16x: the `telemetry` option) looks up three global
# providers on every request, 8 us (2-core CPU, hot); the server has its own metrics and log
# line (middleware.py).
NO_OTEL = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class JobStream(StreamingResponse):
    """A streamed response (server-sent events unless `media_type` says otherwise, e.g.
    Ollama's NDJSON) that cancels its work (a Job, or the Choices of a request) however the
    response ends.

    Its body comes from `job_events`, which already races every wait against the client's
    disconnect, so the response only sends: under ASGI spec 2.3 (uvicorn's) Starlette's
    StreamingResponse would also start a task group with a second disconnect listener, a
    task spawn and a loop iteration before the first byte.
    """

    def __init__(
        self,
        work: Job | Choices,
        content: AsyncIterator[bytes],
        media_type: str = "text/event-stream",
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type=media_type, headers=headers)
        self.work = work

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        finally:
            self.work.cancel()


def engine_error(exc: BaseException) -> APIError:
    """The HTTP answer for a failure reported by the worker."""
    if isinstance(exc, EngineDown):
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    code = "device_error" if isinstance(exc, DeviceError) else "internal_error"
    return APIError(500, f"generation failed: {exc}", type="server_error", code=code)


async def job_events(request: Request, job: Job) -> AsyncIterator[Any]:
    """The job's deltas as they arrive (`group_events` of the one job)."""
    async for _, delta in group_events(request, [job]):
        yield delta


async def group_events(request: Request, jobs: list[Job]) -> AsyncIterator[tuple[int, Any]]:
    """(index in `jobs`, delta) for the jobs of one request, as their deltas arrive; raises
    APIError on a failure, ClientGone on disconnect.

    Call it once the request body has been read: a task then awaits the ASGI receive channel,
    whose next message is `http.disconnect`, and its end wakes the wait for an event, so a
    disconnect is seen the moment it happens, tokens flowing or not. The jobs share one
    Arrival, so one wait serves them all. Every job is cancelled however the iteration ends,
    and each delta is accounted in the request's record (metrics, the log line).
    """
    record = record_of(request.scope)
    arrival = jobs[0].arrival
    for job in jobs[1:]:
        job.arrival = arrival  # events already delivered wait in the jobs' own deques
    gone = asyncio.ensure_future(_disconnected(request.receive))
    gone.add_done_callback(arrival.wake)
    live = list(enumerate(jobs))
    try:
        while live:
            if gone.done():
                record.client_gone = True
                raise ClientGone
            for entry in live:  # the first job with an event waiting
                if entry[1].events:
                    break
            else:
                await arrival.wait()
                continue
            i, job = entry
            event = job.events.popleft()
            if event is DONE:
                live.remove(entry)
            elif isinstance(event, BaseException):
                raise engine_error(event)
            else:
                record.on_delta(job, event)
                yield i, event
    finally:
        for job in jobs:
            job.cancel()
        gone.cancel()


async def _disconnected(receive: Any) -> None:
    """Returns once the client has gone (ASGI `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Choices:
    """The jobs of one request: each prompt's `n` choices queued at once (decoded together, as
    the batch takes them), the prompts one after another: the first prompt's at once (a full
    queue is a 429 before any answer), each next prompt's when the previous ones end. Choice
    `j` of prompt `p` has index p * n + j, as in OpenAI's API."""

    def __init__(
        self,
        service: Service,
        request: Request,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
    ) -> None:
        self.service, self.request, self.n = service, request, n
        self.todo = list(zip(prompts, params, strict=True))
        self.jobs = self._submit(*self.todo[0])

    def _submit(self, ids: list[int], params: SamplingParams) -> list[Job]:
        jobs: list[Job] = []
        try:
            for j in range(self.n):
                jobs.append(self.service.submit(ids, choice_params(params, j)))
        except APIError:
            for job in jobs:  # skipped by the worker: all of a prompt's choices or none
                job.cancel()
            raise
        return jobs

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, delta) as they come; raises as `group_events` does."""
        for p, (ids, params) in enumerate(self.todo):
            if p:
                self.jobs = self._submit(ids, params)
            async for j, delta in group_events(self.request, self.jobs):
                yield p * self.n + j, delta

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice `j`'s params: a seeded request's choices draw from seeds seed, seed + 1, ...
    (the same choices again for the same seed, not one choice n times)."""
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**63)


def _text_chars(value: Any) -> int:
    """Characters of the text in a prompt argument (str, FIM pair, chat messages, token ids)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_chars(v) for v in value)
    return 0


class Service:
    """The request path shared by the two generation endpoints."""

    def __init__(
        self, llm: Any, worker: Worker, model: str | None = None, special_tokens: str = "parse"
    ) -> None:
        self.llm = llm
        self.worker = worker
        self.model = model or llm.model_name
        self.special_tokens = special_tokens
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    async def prepare(self, param: str, **prompt: Any) -> list[int]:
        """Prompt ids; a prompt refused is a 400 naming `param`. A short prompt is tokenized
        right here (tens of microseconds, less than the hop to a thread and back, which an
        editor's every request would pay), a longer one in the thread pool so the event loop
        keeps serving (the tokenizer releases the GIL: nanoqwen.tokenizer)."""
        try:
            if _text_chars(prompt) <= INLINE_TOKENIZE_CHARS:
                return self.llm.prepare(**prompt, special_tokens=self.special_tokens)
            return await run_in_threadpool(
                self.llm.prepare, **prompt, special_tokens=self.special_tokens
            )
        except TooManyTokens as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ToolsError as exc:
            raise APIError(400, str(exc), param="tools") from None
        except NanoqwenError as exc:
            raise APIError(400, str(exc), param=param) from None

    def sampling(
        self, body: GenerationRequest, ids: list[int], default_max_tokens: int | None
    ) -> SamplingParams:
        """The params of one prompt after the context check (400); default None: the rest of
        the context."""
        if default_max_tokens is None:
            default_max_tokens = self.llm.max_context - len(ids)
        max_tokens = body.requested_max_tokens() or max(1, default_max_tokens)
        try:
            self.llm.check_fits(len(ids), max_tokens)
            return body.sampling_params(max_tokens)
        except ContextError as exc:
            # Name the prompt when it cannot fit even alone, else the completion budget.
            too_long = len(ids) >= self.llm.max_context
            param = body.prompt_field if too_long else body.max_tokens_field
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except NanoqwenError as exc:
            raise APIError(400, str(exc)) from None

    def submit(self, ids: list[int], params: SamplingParams) -> Job:
        """Queue a job (or 429/503)."""
        job = Job(ids, params, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            raise APIError(
                429, str(exc), type="rate_limit_error", code="queue_full", headers=headers
            ) from None
        except EngineDown as exc:
            raise engine_error(exc) from None
        return job

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        self.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        plan = body.tool_plan
        prompt: dict[str, Any] = {"messages": messages}
        if plan.parses:
            prompt |= {"tools": plan.tools, "reply_prefix": plan.prefix}
        ids = await self.prepare("messages", **prompt)
        return await self.respond(request, body, [ids], None)  # default: the rest

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        self.check_model(body.model)
        prompts = [await self.prepare(param, **args) for param, args in body.prepare_args()]
        return await self.respond(request, body, prompts, COMPLETIONS_DEFAULT_MAX_TOKENS)

    async def respond(
        self,
        request: Request,
        body: GenerationRequest,
        prompts: list[list[int]],
        default_max_tokens: int | None,
    ) -> Response:
        """Check every prompt, then generate a choice for each and answer (or stream) them."""
        params = [self.sampling(body, ids, default_max_tokens) for ids in prompts]
        if body.n > self.worker.max_queue:
            raise APIError(400, f"n: {body.n} choices are more than this server queues at once "
                           f"({self.worker.max_queue}, --max-queue)", param="n")  # fmt: skip
        chat = isinstance(body, ChatRequest)
        tools = body.tool_plan if chat else None
        reply = Reply(chat=chat, model=self.model, prompt_tokens=[len(ids) for ids in prompts],
                      n=body.n, tools=tools)  # fmt: skip
        choices = Choices(self, request, prompts, params, body.n)
        events = choices.events()
        try:
            if body.stream:
                first = await anext(events, None)  # errors before the first token keep a status
                return JobStream(choices, stream_body(reply, first, events, body.include_usage))
            async for index, delta in events:
                reply.add(index, delta)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        return JSONResponse(reply.body())


async def stream_body(
    reply: Reply, first: Any, events: AsyncIterator[Any], include_usage: bool
) -> AsyncIterator[bytes]:
    """The SSE body: role chunk (chat), then per choice its text and tool call chunks and its
    finish chunk, the usage chunk if asked for, [DONE]. The events of one delta go out as one
    body message (one socket write), the role chunk with the first delta's."""
    try:
        out = b""
        if reply.chat:  # each choice's first chunk gives its role
            out = b"".join(reply.chunk(i, "", role=True) for i in range(len(reply.choices)))
        item = first
        while item is not None:
            index, delta = item
            for piece in reply.add(index, delta):
                is_text = isinstance(piece, str)
                out += reply.chunk(index, piece) if is_text else reply.call_chunk(index, piece)
            if delta.finish_reason is not None:
                out += reply.chunk(index, None, reply.choices[index].finish_reason)
            if out:
                yield out
                out = b""
            item = await anext(events, None)
        if include_usage:
            yield reply.usage_chunk()
        yield SSE_DONE
    except APIError as exc:  # the status line is gone: report the failure as an event
        yield sse(exc.body)
        yield SSE_DONE
    except ClientGone:
        return
    finally:
        await events.aclose()  # no await inside: safe even when the task is being cancelled


def validation_error(
    exc: RequestValidationError, content_type: str | None, names: frozenset[str] = FIELD_NAMES
) -> APIError:
    """FastAPI's 422 as OpenAI's 400: the first problem, with the offending field as `param`
    (`names`: the field names of the request's models, which a location may hold).

    FastAPI reads a body as JSON only under a JSON Content-Type; any other body fails as "not
    an object", which would mislead when the body is JSON: the Content-Type is named instead.
    """
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "cannot parse")
        return APIError(400, f"request body is not valid JSON: {reason}")
    path = field_path(first["loc"], names)
    if not path and first["type"] != "missing" and not _is_json(content_type):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type header"
        return APIError(
            400, f"the request has {got}: send the JSON body with 'Content-Type: application/json'"
        )
    if not path:
        if first["type"] == "missing":
            return APIError(400, "request body is missing: send a JSON object")
        return APIError(400, f"request body must be a JSON object: {first['msg']}")
    others = {field_path(e["loc"], names) for e in errors} - {path}
    more = f" (and {len(others)} more problems)" if others else ""
    return APIError(400, f"{path}: {first['msg']}{more}", param=path)


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: application/json or application/*+json, parameters aside."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def create_app(
    llm: Any,
    worker: Worker,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    cors_origins: tuple[str, ...] = (),
    special_tokens: str = "parse",
    max_body_bytes: int | None = None,
    fast_routes: bool = True,
) -> FastAPI:
    """The ASGI app over a started `worker` that owns `llm` (an `nanoqwen.llm.LLM`).

    `model_name` is the id clients see and must send (default: `llm.model_name`);
    `cors_origins` turns on CORS for those browser origins ("*": any); `special_tokens`: how
    raw completion prompts encode special-token text (`LLM.prepare`); `max_body_bytes`: the
    largest request body taken (None: limits.DEFAULT_MAX_BODY_BYTES); `fast_routes`: valid
    generation requests skip FastAPI's request machinery (fast_routes.py; False: FastAPI serves
    them too, the same answers a little later, for comparisons).
    """
    app = FastAPI(title="nanoqwen", docs_url=None, redoc_url=None, openapi_url=None, **NO_OTEL)
    service = Service(llm, worker, model_name, special_tokens)
    metrics = Metrics(worker, llm)
    # add_middleware puts each one outside the ones before it: the key is checked last, after
    # the body limit and after CORS has answered preflights (a browser sends them without
    # credentials); the telemetry outside them all counts and logs every answer, 413 and 401
    # included. FastRoutes, inside them all, sees only requests that passed.
    if fast_routes:
        routes = {
            "/v1/chat/completions": (ChatRequest, service.chat),
            "/v1/completions": (CompletionRequest, service.completions),
        }
        app.add_middleware(FastRoutes, routes=routes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, open_paths=OPEN_PATHS)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # OpenAI's JS SDK sends many x-stainless-* headers
            expose_headers=[REQUEST_ID_HEADER],
        )
    app.add_middleware(RequestTelemetry, metrics=metrics)
    _add_error_handlers(app)
    _add_info_routes(app, service, metrics)
    _add_generation_routes(app, service)
    # The other protocols build on Service and JobStream, so they import this module.
    from .llamacpp import add_llamacpp_routes
    from .ollama import add_ollama_routes
    from .responses import add_responses_routes

    add_responses_routes(app, service)
    add_llamacpp_routes(app, service)
    add_ollama_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carries e.g. the Allow header of a 405.
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {exc}", type="server_error").response()


def _prefix_cache(stats: Any) -> dict[str, Any]:
    """/health's view of the KV pool and the prefix cache (nanoqwen.kv_pages.KVStats)."""
    rate = stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else 0.0
    return {"pages": stats.pages, "cached_pages": stats.cached, "hit_rate": round(rate, 4)}


def _add_info_routes(app: FastAPI, service: Service, metrics: Metrics) -> None:
    def card() -> dict[str, Any]:
        return {
            "id": service.model,
            "object": "model",
            "created": service.created,
            "owned_by": "nanoqwen",
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        worker, alive = service.worker, service.worker.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "engine_alive": alive,
            "model": service.model,
            "backend": service.llm.backend_name,
            "queue_depth": worker.queue_depth,
            "max_queue": worker.max_queue,
            "running": worker.running,
            "kv_pages_in_use": service.llm.kv_pages_in_use if alive else None,
            "prefix_cache": _prefix_cache(service.llm.kv_stats) if alive else None,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != service.model:
            raise APIError(
                404, f"model {model_id!r} not found", param="model", code="model_not_found"
            )
        return card()


def _add_generation_routes(app: FastAPI, service: Service) -> None:
    # FastRoutes serves valid bodies of these two without FastAPI; these routes answer the rest.
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        return await service.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await service.completions(body, request)
