"""Serve a .nanoqwen model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions (with
`suffix`: fill-in-the-middle), streamed (server-sent events) or not. One engine thread runs
one generation at a time; other requests wait in a bounded queue and get 429 when it is full.
The server binds to loopback unless --host says otherwise. After a sticky CUDA error it answers
the request in flight with a 500, reports 503 on /health, and exits non-zero so that a
supervisor restarts it. SIGTERM / Ctrl-C shut it down gracefully.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from .argtypes import int_range, port
from .generate import add_backend_arguments, open_llm

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
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on (1..65535)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health; ${API_KEY_ENV} "
        "is used when this is not given (it keeps the key out of the process list)",
    )
    p.add_argument(
        "--max-queue",
        type=int_range(1),
        default=16,
        help="requests that may wait behind the running one; more get 429",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn log level (info logs one line per request)",
    )
    add_backend_arguments(p)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket on host:port, before the model loads: a port in use, a privileged
    port or an unknown host fails in a second, not after the load. Connections that arrive
    while the model loads wait in the backlog and are answered once it is up."""
    from ..errors import NanoqwenError

    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise NanoqwenError(f"cannot resolve --host {host}: {exc.strerror}") from None
    try:
        return socket.create_server(address, family=family)  # SO_REUSEADDR, as uvicorn binds
    except OSError as exc:
        raise NanoqwenError(
            f"cannot listen on {host}:{port}: {os.strerror(exc.errno)}; choose another --port"
        ) from None


def run(args: argparse.Namespace) -> int:
    with listen(args.host, args.port) as sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from ..server import Worker, create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    llm = open_llm(args.file, args)
    worker = Worker(llm, args.max_queue)
    try:
        app = create_app(llm, worker, api_key=api_key)
        config = uvicorn.Config(
            app,
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
        server.run(sockets=[sock])
    finally:
        worker.stop()
        llm.close()
    if worker.fatal is not None:
        raise worker.fatal  # the CLI prints it and exits non-zero
    return 0
