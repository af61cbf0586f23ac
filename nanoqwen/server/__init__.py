"""OpenAI-compatible HTTP API over one `LLM` (FastAPI + uvicorn), served by `nanoqwen serve`.

    app.py       routes (/health, /v1/models, /v1/chat/completions, /v1/completions), streaming
    limits.py    the request-body limit (ASGI middleware, 413 before the body is read)
    schemas.py   request bodies (pydantic, strict, OpenAI's ranges and fields)
    protocol.py  OpenAI wire format: error objects, response bodies, SSE chunks
    auth.py      Bearer API key (ASGI middleware, constant-time compare)
    worker.py    the single engine thread and its bounded queue (batch 1)

Importing this package imports FastAPI; the engine and the rest of the CLI never do.
"""

from .app import create_app
from .worker import Worker

__all__ = ["Worker", "create_app"]
