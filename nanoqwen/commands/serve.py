"""Serve a .nanoqwen model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (with
`suffix`: fill-in-the-middle), POST /v1/responses, streamed (server-sent events) or not; and
llama.cpp's /infill, /completion, /tokenize and /detokenize, and Ollama's /api/*
(nanoqwen/server). One engine thread decodes up to --max-batch requests together (continuous
batching, nanoqwen.batching); other requests wait in a bounded queue and get 429 when it is
full.
A request body over --max-body-bytes is refused with 413 before it is read, and a prompt too
long for the context is refused after tokenizing about a context's worth of it. Special-token
text in a raw /v1/completions prompt (`<|fim_prefix|>` ...) becomes the control tokens, as
in vLLM and llama.cpp (--special-tokens text keeps it text); chat message contents never do.
The server binds to loopback unless --host says otherwise. After a sticky CUDA error it answers
the request in flight with a 500, reports 503 on /health, and exits non-zero so that a
supervisor restarts it. SIGTERM / Ctrl-C drain it: new and queued requests get a 503, the
running one gets --shutdown-grace seconds to finish (then its stream ends with an error event
and [DONE]), and the process exits 0 (nanoqwen/server/shutdown.py).

Operations: GET /metrics (Prometheus text format; like /health it needs no API key: it holds
only aggregate counts, no request content, and scrapers usually carry no application
credentials), an `x-request-id` on every response and one log line per request (at
--log-level info), --served-model-name, --cors-origin.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import socket
import sys

from .argtypes import int_range, port
from .generate import add_backend_arguments, add_special_tokens_argument, open_llm

HELP = "serve a model over an OpenAI-compatible HTTP API"
API_KEY_ENV = "NANOQWEN_API_KEY"
GRACEFUL_SHUTDOWN_S = 5.0  # --shutdown-grace's default
# After the drain, uvicorn's own shutdown waits this long for responses still being written.
FLUSH_S = 2.0
CORS_ORIGIN = re.compile(r"https?://[^/\s]+")  # what a browser sends: scheme://host[:port]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the .nanoqwen model file to serve")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 exposes the server to the network (use --api-key)",
    )
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on (1..65535)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics; "
        f"${API_KEY_ENV} "
        "is used when this is not given (it keeps the key out of the process list)",
    )
    p.add_argument(
        "--max-queue",
        type=int_range(1),
        default=16,
        help="requests that may wait behind the running batch; more get 429",
    )
    p.add_argument(
        "--max-batch",
        type=int_range(1),
        default=None,
        help="requests decoded together (continuous batching; a request alone keeps the "
        "single-stream loop); None = the backend's max_batch (cuda: 16, reference: 8); 1 runs "
        "one generation at a time",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_range(1),
        default=None,
        help="largest request body accepted, in bytes; larger ones get 413 before they are "
        "read. None = 4 MiB: any prompt a 32k context fits, JSON-escaped, with room to spare",
    )
    add_special_tokens_argument(p, "raw /v1/completions prompts")
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="log level (info logs one line per request, with its x-request-id and timings)",
    )
    p.add_argument(
        "--served-model-name",
        type=_model_name,
        default=None,
        metavar="NAME",
        help="the model id that /v1/models reports and requests must name "
        "(default: the model name in the file, else the file's stem)",
    )
    p.add_argument(
        "--cors-origin",
        type=_cors_origin,
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (e.g. http://localhost:3000; '*' for any), "
        "repeatable; CORS is off without it",
    )
    p.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=GRACEFUL_SHUTDOWN_S,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, how long the running request may take to finish before its "
        "stream is ended with an error event",
    )
    add_backend_arguments(p)


def _model_name(text: str) -> str:
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is empty or has spaces or control characters")
    return text


def _cors_origin(text: str) -> str:
    if text != "*" and not CORS_ORIGIN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an origin: give scheme://host[:port] without a path or a "
            "trailing slash (what a browser sends), or '*'"
        )
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _log_config(level: str) -> dict:
    """uvicorn's logging set-up plus the `nanoqwen` loggers (the request lines) on stderr."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    logger = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    config["loggers"]["nanoqwen"] = logger
    return config


def listen(host: str, port: int) -> socket.socket:
    """The listening socket on host:port, before the model loads: a port in use, a privileged
    port or an unknown host fails in a second, not after the load. Connections that arrive
    while the model loads wait in the backlog and are answered once it is up."""
    from ..errors import NanoqwenError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise NanoqwenError(f"cannot resolve --host {host}: {exc.strerror}") from None
    # The protocol number matters: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # is IPPROTO_TCP, and socket.create_server's is 0. Without it Nagle holds back every small
    # write (an SSE chunk, a response body after its headers) until the client's delayed ACK,
    # tens of milliseconds.
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
        sock.listen()
        return sock
    except OSError as exc:
        sock.close()
        raise NanoqwenError(
            f"cannot listen on {host}:{port}: {os.strerror(exc.errno)}; choose another --port"
        ) from None


def run(args: argparse.Namespace) -> int:
    with listen(args.host, args.port) as sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from ..server import Worker, create_app
    from ..server.shutdown import GracefulServer

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    llm = open_llm(args.file, args, max_batch=args.max_batch)
    try:
        worker = Worker(llm, args.max_queue, max_batch=args.max_batch)
    except BaseException:
        llm.close()
        raise
    if llm.speculative and worker.max_batch > 1:
        print("nanoqwen serve: speculative decoding runs while a request decodes alone; "
              f"up to {worker.max_batch} decode together one token a step "
              "(--max-batch 1 keeps the drafts always)", file=sys.stderr)  # fmt: skip
    try:
        app = create_app(
            llm,
            worker,
            api_key=api_key,
            model_name=args.served_model_name,
            cors_origins=tuple(args.cors_origin),
            special_tokens=args.special_tokens,
            max_body_bytes=args.max_body_bytes,
        )
        config = uvicorn.Config(
            app,
            log_level=args.log_level,
            log_config=_log_config(args.log_level),
            access_log=False,  # RequestTelemetry logs each request, with more in the line
            timeout_graceful_shutdown=FLUSH_S,
        )
        server = GracefulServer(config, worker, args.shutdown_grace)
        # On a fatal device error (worker thread): uvicorn's loop polls should_exit every
        # 0.1 s and shuts down gracefully, so the failed request still gets its 500 answer.
        worker.on_fatal = lambda exc: setattr(server, "should_exit", True)
        worker.start()
        key_note = " (API key required)" if api_key else ""
        print(
            f"nanoqwen serve: {args.served_model_name or llm.model_name} on "
            f"http://{args.host}:{args.port}/v1{key_note}",
            file=sys.stderr,
        )
        server.run(sockets=[sock])  # returns after a drain on SIGTERM / Ctrl-C (or a fatal error)
    finally:
        worker.stop()
        llm.close()
    if worker.fatal is not None:
        raise worker.fatal  # the CLI prints it and exits non-zero
    return 0
