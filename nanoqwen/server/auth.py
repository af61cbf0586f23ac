"""Bearer-token authentication as a plain ASGI middleware.

It runs before routing and body parsing, so an unauthenticated client learns nothing about the
request it sent (not even whether its JSON parsed), and it never wraps response streams. The
key is compared with `hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hmac
from typing import Any

from .protocol import APIError


class BearerAuth:
    """Require `Authorization: Bearer <api_key>` on every HTTP path except `open_paths`."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    def authorized(self, scope: dict[str, Any]) -> bool:
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the token is compared in constant time.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "missing or incorrect API key: send 'Authorization: Bearer <key>'"
        error = APIError(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)
