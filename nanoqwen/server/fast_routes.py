"""The OpenAI generation routes without FastAPI's request machinery, for valid requests.

POST /v1/completions and /v1/chat/completions carry every editor keystroke (FIM) and chat
turn, and FastAPI's own path for them (route matching over every route, the exception and
exit-stack middlewares, reading the body through `Request`, solving the dependencies,
binding the body) costs more on the way to the first streamed chunk than our handler's
work. `FastRoutes` is the innermost ASGI middleware: for a request to one of those two paths
whose body is a JSON object that its pydantic model accepts, it calls the same `Service`
handler that the FastAPI route calls and sends its response. Every other request, and every
one of those whose body fails anywhere (not JSON, a Content-Type other than
application/json, a field the model refuses), goes on to FastAPI with its body replayed, so
the refusals of a body (the 400s of `validation_error`) have one home; 405, 404 for other
paths and the middlewares' 413 and 401 never reach here.

The parse is FastAPI's: `json.loads` of the body, then the model's validation in python
mode (strict, `model_validate`), so a body passes here exactly when FastAPI would bind it.
An `APIError` from the handler (unknown model, context, queue full, engine down) is
answered as the app's handler answers it; any other exception propagates to the app's error
middleware, as it would from the route. tests/test_server_fast_path.py compares both paths
request by request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from .limits import replay
from .protocol import APIError

Handler = Callable[[Any, Request], Awaitable[Response]]
JSON_TYPE = b"application/json"


class FastRoutes:
    """Serve POST `routes` (path -> (body model, handler)) for valid bodies; pass the rest to
    `app` (module docstring)."""

    def __init__(self, app: Any, routes: dict[str, tuple[type[BaseModel], Handler]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = None
        # A root_path would make the routing strip a prefix first: leave such scopes to it.
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        model, handler = route
        message = await receive()
        body = parse(scope, message, model)
        if body is None:
            await self.app(scope, replay(message, receive), send)
            return
        try:
            response = await handler(body, Request(scope, receive))
        except APIError as exc:
            response = exc.response()
        await response(scope, receive, send)


def parse(scope: dict[str, Any], message: dict[str, Any], model: type[BaseModel]) -> Any:
    """The body of a one-message request as `model`, or None where FastAPI should answer:
    a body in several messages, a Content-Type other than application/json (parameters
    aside), a body that is not JSON or that the model refuses."""
    if message["type"] != "http.request" or message.get("more_body", False):
        return None
    # FastAPI reads the first Content-Type header; its JSON test on a value of exactly
    # application/json is this one (+json types and the rest go to FastAPI).
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    if content_type.split(b";", 1)[0].strip().lower() != JSON_TYPE:
        return None
    try:
        return model.model_validate(json.loads(message["body"]))
    except Exception:  # not JSON, refused, or nested past the recursion limit: FastAPI says how
        return None
