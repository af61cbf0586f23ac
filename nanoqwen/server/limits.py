"""The request-body limit: a body over `max_bytes` is refused with 413 before the app sees it.

ASGI middleware, outside FastAPI's body parsing: a declared Content-Length over the limit is
answered at once, without reading a byte of the body; a body without one (chunked) is counted
as it streams in and refused as soon as the count passes the limit. Either way at most
`max_bytes` (plus one network chunk) is ever held, where FastAPI alone would buffer, parse
and tokenize a body of any size. The body that passes is handed to the app as one message.

DEFAULT_MAX_BODY_BYTES: a 32k-token context is about 100-200 KB of source code, and JSON can
escape every byte of it to six (`\\u00e9`), so 4 MiB holds any prompt that can fit with room
to spare, while a body that size parses in ~30 ms and a few of them at once fit in memory.
"""

from __future__ import annotations

from typing import Any

from .protocol import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class BodyLimit:
    """Refuse a request body over `max_bytes` with 413 and an OpenAI error object."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {size} bytes")
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay(body, receive), send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, size: str) -> None:
        error = APIError(
            413,
            f"request body too large: {size}, the limit is {self.max_bytes} bytes "
            "(nanoqwen serve --max-body-bytes)",
            code="request_too_large",
            headers={"Connection": "close"},  # the unread rest of the body is not awaited
        )
        await error.response()(scope, receive, send)


def replay(message: dict[str, Any], receive: Any) -> Any:
    """A receive callable that yields `message` (already received), then defers to `receive`
    (which reports the client's disconnect)."""
    pending = [message]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay
