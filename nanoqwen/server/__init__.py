"""OpenAI-compatible HTTP API over one `LLM` (FastAPI + uvicorn), served by `nanoqwen serve`.

    app.py         routes (/health, /metrics, /v1/models, /v1/chat/completions,
                   /v1/completions), streaming
    responses.py   OpenAI's Responses API, /v1/responses (Codex CLI, the Agents SDK)
    llamacpp.py    llama.cpp's /infill, /completion, /tokenize, /detokenize, /props
    ollama.py      Ollama's /api/* (Continue, Twinny, Open WebUI)
    compat.py      what llamacpp and ollama share: body parsing, the generation record
    fast_routes.py valid OpenAI generation requests without FastAPI's request machinery
    limits.py      the request-body limit (ASGI middleware, 413 before the body is read)
    schemas.py     request bodies (pydantic, strict, OpenAI's ranges and fields)
    protocol.py    OpenAI wire format: error objects, response bodies, SSE chunks
    auth.py        Bearer API key (ASGI middleware, constant-time compare)
    middleware.py  request id, per-request metrics and log line (ASGI middleware)
    metrics.py     Prometheus metrics on the server's own registry (GET /metrics)
    worker.py      the single engine thread, its bounded queue and its batch
    shutdown.py    the drain on SIGTERM / Ctrl-C (a uvicorn.Server subclass)

Importing this package imports FastAPI; the engine and the rest of the CLI never do.
"""

from .app import create_app
from .worker import Worker

__all__ = ["Worker", "create_app"]
