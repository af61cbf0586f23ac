"""OpenAI wire format: error objects, completion bodies and server-sent-event chunks.

One `Reply` per request accumulates deltas, one choice per prompt (a chat has one; a
completion request one per prompt it lists, each with its `index`), and renders either the
whole response (`chat.completion` / `text_completion`, usage summed over the choices) or the
stream chunks (`chat.completion.chunk` / `text_completion`, each carrying its choice's index),
the same id and `created` on every chunk; a usage chunk with `choices: []` only when
`stream_options.include_usage` asks for it (OpenAI's default is none: clients that read
`chunk.choices[0]` break on it), then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from ..speculative import SpecStats

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


def _json(text: str) -> bytes:
    """A string as JSON, escaped as `sse` escapes it (ASCII only)."""
    return json.dumps(text).encode()


class Choice:
    """One choice of a reply: its text so far, completion tokens and finish reason."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None


class Reply:
    """The response to one chat (`chat=True`) or text completion request; `prompt_tokens`
    holds one count per choice."""

    def __init__(self, *, chat: bool, model: str, prompt_tokens: Sequence[int]) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = sum(prompt_tokens)
        self.cached_tokens = 0  # of prompt_tokens, served from the prefix cache
        self.speculative: SpecStats | None = None  # summed over the choices; None: not on
        self.choices = [Choice() for _ in prompt_tokens]
        # A stream chunk's bytes around its one choice: the envelope rendered once with a
        # placeholder list (an unescaped ["@"] can only be structure), so `chunk` renders just
        # the choice, a tenth of json.dumps over the whole envelope per token.
        object_ = "chat.completion.chunk" if chat else "text_completion"
        head, tail = sse(self._envelope(object_, ["@"])).split(b'["@"]')
        self._frame = (head + b"[", b"]" + tail)

    def add(self, index: int, delta: Any) -> None:
        """Account for one `Delta(text, token_ids, finish_reason, cached_tokens)` of choice
        `index`."""
        self.cached_tokens += delta.cached_tokens
        if delta.speculative is not None:
            self.speculative = self.speculative or SpecStats()
            self.speculative.add(delta.speculative)
        choice = self.choices[index]
        choice.completion_tokens += len(delta.token_ids)
        choice.text.append(delta.text)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason

    @property
    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; with speculation also `speculative` (drafted_tokens,
        accepted_tokens, steps), a field OpenAI's clients keep as an extra."""
        completion = sum(c.completion_tokens for c in self.choices)
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.speculative is not None:
            s = self.speculative
            usage["speculative"] = {"drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
                                    "steps": s.steps}  # fmt: skip
        return usage

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
        choices = []
        for index, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                content = {"message": {"role": "assistant", "content": text, "refusal": None}}
            else:
                content = {"text": text}
            tail = {"logprobs": None, "finish_reason": c.finish_reason}
            choices.append({"index": index} | content | tail)
        object_ = "chat.completion" if self.chat else "text_completion"
        return self._envelope(object_, choices) | {"usage": self.usage}

    def chunk(
        self, index: int, text: str | None, finish_reason: str | None = None, role: bool = False
    ) -> bytes:
        """One stream event of choice `index`: new text, or (text None) its `finish_reason`."""
        end = b"null" if finish_reason is None else _json(finish_reason)
        if self.chat:
            delta = [b'"role":"assistant"'] if role else []
            if text is not None:
                delta.append(b'"content":' + _json(text))
            choice = b'{"index":%d,"delta":{%b},"logprobs":null,"finish_reason":%b}' % (
                index,
                b",".join(delta),
                end,
            )
        else:
            choice = b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":%b}' % (
                index,
                _json(text or ""),
                end,
            )
        return self._frame[0] + choice + self._frame[1]

    def usage_chunk(self) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(object_, []) | {"usage": self.usage})
