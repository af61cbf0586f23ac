"""Tool calls in Qwen2.5's format: what the model writes to call a function, and how a reply's
text is split, as it streams, into content and calls.

Given tools, Qwen2.5's chat template lists them in the system turn and asks for each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call, any number of them, possibly after some text (the Hermes format; vLLM's
`hermes` parser and llama.cpp's Qwen handler read the same). `<tool_call>` and `</tool_call>` are
single tokens of Qwen2.5's vocabulary, decoded to that text. The Coder models often write the
same object as a fenced block instead (```json ... ```; docs/EXPERIMENTS.md, Server), which
llama.cpp reads as a call too. A fenced block is a call only when it names one of the
request's tools: otherwise it is the JSON a coding answer shows.

`ToolCallParser` takes a reply's text deltas and gives back pieces: content text, passed on at
once, and `ToolCall`s, each when its block closes. Held back meanwhile: a tail that may begin an
opening marker, whitespace that may only separate text from a call (and so is dropped), and an
open block. A block that is not a JSON object with a string "name" and an object "arguments"
stays content, as written: the client sees what the model said, not a call it did not make. At
the end an unclosed block (the reply stopped at max_tokens, or at `CLOSE` taken as a stop
string) is parsed the same way.

`forced_prefix` is the start of a reply that must call a tool (OpenAI's tool_choice "required",
or a named function): the prompt ends with it, so the model continues inside a block, and the
parser starts from it (`ToolCallParser(prefix)`), since the reply's text does not repeat it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
# (opening marker, closing marker, whether the call must name a known tool)
_FORMS = ((OPEN, CLOSE, False), (FENCE_OPEN, FENCE_CLOSE, True))


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is the JSON text of an object (OpenAI's wire form)."""

    id: str
    name: str
    arguments: str


def forced_prefix(name: str | None = None) -> str:
    """The reply's start that forces a call: of any tool (None), or of function `name`. It
    runs into the call's JSON, up to the name, since a model that would not call a tool may
    end a bare "<tool_call>\n" at once (docs/EXPERIMENTS.md, Server); and it stops before a
    space, which the model writes with what follows as one token (' {"', not ' ' then '{"')."""
    if name is None:
        return f'{OPEN}\n{{"name": "'
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments":'


def parse_call(body: str, names: frozenset[str] | None = None) -> ToolCall | None:
    """The call a block's text (between its markers) makes, or None when it is not one (or,
    with `names`, when it names none of them)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict) or (names is not None and value["name"] not in names):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], text)


def _open_tail(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of an opening marker."""
    for n in range(min(max(len(f[0]) for f in _FORMS) - 1, len(text)), 0, -1):
        if any(f[0].startswith(text[-n:]) and len(f[0]) > n for f in _FORMS):
            return n
    return 0


class ToolCallParser:
    """A reply's text in, content and calls out (the module docstring). `names`: the request's
    tools (a fenced block must name one); `prefix`: the reply's forced start, which the prompt
    already holds (`forced_prefix`); `single`: the reply makes one call at most, later ones
    are dropped (a `CLOSE` stop string ends the reply at the first tagged call, but not at a
    fenced one)."""

    def __init__(
        self, names: frozenset[str] = frozenset(), prefix: str = "", single: bool = False
    ) -> None:
        self._names = names
        self._single = single
        self._pending = ""  # text not yet given out
        self._blank = 0  # outside a block: the whitespace that _pending starts with
        self._form: tuple[str, str, bool] | None = None  # the open block's markers
        self._after_call = False  # whitespace right after a call is dropped
        self._gap = ""  # the whitespace before the open block: content again if it is no call
        self._scanned = 0  # the open block's text already searched for its closing marker
        self.calls = 0  # calls given out so far
        if prefix:
            if not prefix.startswith(OPEN):
                raise ValueError(f"a forced prefix starts with {OPEN!r}, got {prefix!r}")
            self._pending, self._form = prefix[len(OPEN) :], _FORMS[0]

    def feed(self, text: str) -> list[str | ToolCall]:
        """The pieces that `text`, appended to the reply, completes."""
        self._pending += text
        out: list[str | ToolCall] = []
        while True:
            if self._form is not None:
                closing = self._form[1]
                end = self._pending.find(closing, self._scanned)
                if end < 0:  # next time, look only where the new text can complete it
                    self._scanned = max(0, len(self._pending) - len(closing) + 1)
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(closing) :]
                self._scanned = self._blank = 0
                self._close(body, closing, out)
                continue
            # A marker cannot start inside the held whitespace, so each search and strip
            # starts past it: a long run of whitespace costs each delta only its own length.
            blank = self._blank
            found = [(i, f) for f in _FORMS if (i := self._pending.find(f[0], blank)) >= 0]
            if found:
                start, form = min(found, key=lambda x: x[0])
                text = self._pending[:start].rstrip()
                self._content(text, out)
                self._gap = self._pending[len(text) : start]
                self._pending, self._form = self._pending[start + len(form[0]) :], form
                continue
            # Keep a possible opening marker's start and the whitespace before it.
            keep = _open_tail(self._pending)
            tail = self._pending[blank : len(self._pending) - keep].rstrip()
            text = self._pending[:blank] + tail if tail else ""
            self._content(text, out)
            self._pending = self._pending[len(text) :]
            self._blank = len(self._pending) - keep
            return out

    def push(self, text: str, done: bool) -> list[str | ToolCall]:
        """`feed`, and at the reply's end (`done`) `finish` too: one delta's pieces."""
        out = self.feed(text)
        return out + self.finish() if done else out

    def finish(self) -> list[str | ToolCall]:
        """The pieces left at the reply's end: an unclosed block parsed, held text given out
        (whitespace only where no call was made: a plain reply keeps its text whole)."""
        out: list[str | ToolCall] = []
        if self._form is not None:
            self._close(self._pending, "", out)
        elif self.calls == 0:
            self._content(self._pending, out)
        else:
            self._content(self._pending.strip(), out)
        self._pending, self._blank = "", 0
        return out

    def _close(self, body: str, marker: str, out: list[str | ToolCall]) -> None:
        """The open block ends (`marker`: its closing marker as written, "" at the reply's
        end)."""
        opening, _, strict = self._form
        self._form = None
        call = parse_call(body, self._names if strict else None)
        if call is None:
            self._content(self._gap + opening + body + marker, out)
            return
        if not (self._single and self.calls):
            out.append(call)
        self.calls += 1
        self._after_call = True

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            out.append(text)
            self._after_call = False


class NoToolCalls:
    """`ToolCallParser.push` for a reply without tools: its text is all content, as it comes."""

    def push(self, text: str, done: bool) -> list[str | ToolCall]:
        return [text] if text else []
