"""Serve a .nanoqwen model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (with
`suffix`: fill-in-the-middle), streamed (server-sent events) or not. One engine thread runs
one generation at a time; other requests wait in a bounded queue and get 429 when it is full.
A request body over --max-body-bytes is refused with 413 before it is read, and a prompt too
long for the context is refused after tokenizing about a context's worth of it. Special-token
text in a raw /v1/completions prompt (`<|fim_prefix|>` ...) becomes the control tokens, as
in vLLM and llama.cpp (--special-tokens text keeps it text); chat message contents never do.
The server binds to loopback unless --host says otherwise. After a sticky CUDA error it answers
the request in flight with a 500, reports 503 on /health, and exits non-zero so that a
supervisor restarts it. SIGTERM / Ctrl-C shut it down gracefully.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .generate import add_backend_arguments, add_special_tokens_argument, open_llm

HELP = "serve a model over an OpenAI-compatible HTTP API"
API_KEY_ENV = "NANOQWEN_API_KEY"
GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish when the server stops


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the .nanoqwen model file to serve")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 exposes the server to the network (use --api-key)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health; ${API_KEY_ENV} "
        "is used when this is not given (it keeps the key out of the process list)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; more get 429",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted, in bytes; larger ones get 413 before they are "
        "read. None = 4 MiB: any prompt a 32k context fits, JSON-escaped, with room to spare",
    )
    add_special_tokens_argument(p, "raw /v1/completions prompts")
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn log level (info logs one line per request)",
    )
    add_backend_arguments(p)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server import Worker, create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    llm = open_llm(args.file, args)
    worker = Worker(llm, args.max_queue)
    try:
        app = create_app(
            llm,
            worker,
            api_key=api_key,
            special_tokens=args.special_tokens,
            max_body_bytes=args.max_body_bytes,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)
        # On a fatal device error (worker thread): uvicorn's loop polls should_exit every
        # 0.1 s and shuts down gracefully, so the failed request still gets its 500 answer.
        worker.on_fatal = lambda exc: setattr(server, "should_exit", True)
        worker.start()
        key_note = " (API key required)" if api_key else ""
        print(
            f"nanoqwen serve: {llm.model_name} on http://{args.host}:{args.port}/v1{key_note}",
            file=sys.stderr,
        )
        # uvicorn shuts down gracefully on SIGTERM, restores the previous handler and re-raises
        # the signal: with the default handler the process would die before `finally` closes
        # the engine (CUDA buffers, pinned memory). Exit 128 + SIGTERM after cleaning up.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        server.run()
    finally:
        worker.stop()
        llm.close()
    if worker.fatal is not None:
        raise worker.fatal  # the CLI prints it and exits non-zero
    return 0
