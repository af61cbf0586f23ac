"""OpenAI wire format: error objects, completion bodies and server-sent-event chunks.

One `Reply` per request accumulates deltas, `n` choices per prompt (a chat has one prompt; a
completion request one per prompt it lists), each with its `index`, and renders either the
whole response (`chat.completion` / `text_completion`, usage summed over the choices) or the
stream chunks (`chat.completion.chunk` / `text_completion`, each carrying its choice's index),
the same id and `created` on every chunk; a usage chunk with `choices: []` only when
`stream_options.include_usage` asks for it (OpenAI's default is none: clients that read
`chunk.choices[0]` break on it), then `data: [DONE]`.

A chat with tools (`ToolPlan.parses`) passes each choice's text through a ToolCallParser:
content goes out as text, each call as a `tool_calls` entry (streamed whole, in one chunk, once
its block closes: OpenAI clients add up argument fragments, and one fragment is a valid
stream), and a reply that made calls and stopped finishes with "tool_calls".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.responses import JSONResponse

from ..speculative import SpecStats
from ..tool_calls import NoToolCalls, ToolCall, ToolCallParser
from .schemas import NO_TOOLS, ToolPlan

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
    """One choice of a reply: its content and tool calls so far, completion tokens, finish
    reason, and what splits its text into the two."""

    def __init__(self, parser: ToolCallParser | NoToolCalls) -> None:
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.parser = parser


class Reply:
    """The response to one chat (`chat=True`) or text completion request; `prompt_tokens`
    holds one count per prompt, each prompt has `n` choices (indices p * n + j), and the usage
    counts each prompt once, as OpenAI's does; `tools` (a chat with tools): each choice's text
    is parsed for calls by a parser of its own."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        prompt_tokens: Sequence[int],
        n: int = 1,
        tools: ToolPlan | None = None,
    ) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = n
        self.prompt_tokens = sum(prompt_tokens)
        self.cached_tokens = 0  # of prompt_tokens, served from the prefix cache
        self.speculative: SpecStats | None = None  # summed over the choices; None: not on
        tools = tools or NO_TOOLS
        self.choices = [Choice(tools.parser()) for _ in range(len(prompt_tokens) * n)]
        # A stream chunk's bytes around its one choice: the envelope rendered once with a
        # placeholder list (an unescaped ["@"] can only be structure), so `chunk` renders just
        # the choice, a tenth of json.dumps over the whole envelope per token.
        object_ = "chat.completion.chunk" if chat else "text_completion"
        head, tail = sse(self._envelope(object_, ["@"])).split(b'["@"]')
        self._frame = (head + b"[", b"]" + tail)

    def add(self, index: int, delta: Any) -> list[str | ToolCall]:
        """Account for one `Delta(text, token_ids, finish_reason, cached_tokens)` of choice
        `index`; returns what it adds to the reply: content text and completed calls."""
        if index % self.n == 0:  # a prompt's cached tokens: those of its first choice
            self.cached_tokens += delta.cached_tokens
        if delta.speculative is not None:
            self.speculative = self.speculative or SpecStats()
            self.speculative.add(delta.speculative)
        choice = self.choices[index]
        choice.completion_tokens += len(delta.token_ids)
        pieces = choice.parser.push(delta.text, delta.finish_reason is not None)
        for piece in pieces:
            (choice.text if isinstance(piece, str) else choice.calls).append(piece)
        if delta.finish_reason is not None:
            called = choice.calls and delta.finish_reason == "stop"
            choice.finish_reason = "tool_calls" if called else delta.finish_reason
        return pieces

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
                message = {"role": "assistant", "content": text, "refusal": None}
                if c.calls:  # OpenAI: content null when the reply is calls alone
                    message["content"] = text or None
                    message["tool_calls"] = [_call_json(call) for call in c.calls]
                content = {"message": message}
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

    def call_chunk(self, index: int, call: ToolCall) -> bytes:
        """The stream event of choice `index`'s `call` (added), whole; its `index` there is its
        position among the choice's calls."""
        entry = {"index": self.choices[index].calls.index(call)} | _call_json(call)
        delta = json.dumps({"tool_calls": [entry]}, separators=(",", ":")).encode()
        choice = b'{"index":%d,"delta":%b,"logprobs":null,"finish_reason":null}' % (index, delta)
        return self._frame[0] + choice + self._frame[1]

    def usage_chunk(self) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(object_, []) | {"usage": self.usage})


def _call_json(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI writes it in a message or a stream delta."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
