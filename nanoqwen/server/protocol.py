"""OpenAI wire format: error objects, completion bodies and server-sent-event chunks.

One `Reply` per request accumulates deltas and renders either the whole response
(`chat.completion` / `text_completion`) or the stream chunks (`chat.completion.chunk` /
`text_completion`), the same id and `created` on every chunk, then a usage chunk with
`choices: []` as OpenAI sends with `stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from starlette.responses import JSONResponse

SSE_DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Reply:
    """The response to one chat (`chat=True`) or text completion request."""

    def __init__(self, *, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text: list[str] = []
        self.finish_reason: str | None = None

    def add(self, delta: Any) -> None:
        """Account for one `Delta(text, token_ids, finish_reason)` from `LLM.stream`."""
        self.completion_tokens += len(delta.token_ids)
        self.text.append(delta.text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def body(self) -> dict[str, Any]:
        """The whole non-streamed response, after the last `add`."""
        text = "".join(self.text)
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None}
            out = self._envelope(
                "chat.completion", [choice | {"finish_reason": self.finish_reason}]
            )
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            out = self._envelope(
                "text_completion", [choice | {"finish_reason": self.finish_reason}]
            )
        return out | {"usage": self.usage}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, role: bool = False
    ) -> bytes:
        """One stream event: new text, or (text None) the final choice with `finish_reason`."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return sse(self._envelope("text_completion", [choice]))

    def usage_chunk(self) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(object_, []) | {"usage": self.usage})
