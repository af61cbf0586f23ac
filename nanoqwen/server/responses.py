"""OpenAI's Responses API, POST /v1/responses: what Codex CLI and the OpenAI Agents SDK speak.

A request carries its conversation as `input` items, after the stored conversation of
`previous_response_id` when it names one. Responses made with `store` (true unless the request
says false, as in OpenAI's API) are kept in memory (`ResponseStore`: lost on restart, the least
recently used dropped past STORE_CHARS), for previous_response_id, for GET and DELETE
/v1/responses/{id} and for GET /v1/responses/{id}/input_items (the request's own `input`
items, each with its id: the client's, else one made here; pages of `limit` 1..100 (20) in
`order` asc or desc (desc), from the item after `after`; `include` adds nothing, as no item
here has the extras it names); a response id not (or no longer) stored is a 400 (404 on the
GETs and DELETE).
What needs OpenAI's other state (`conversation` objects, `item_reference` items,
`background` responses) is a 400. Agents that resend their history, as Codex does, need none
of it (Codex sends store false).

Input. A string is one user message. Items are messages (role user, assistant, system or
developer; content a string or `input_text` / `output_text` parts), `function_call` (an earlier
call of the model's) and `function_call_output` (its answer, naming the `call_id` of a call
before it, here or in the stored conversation). They become the chat template's messages:
`instructions` first as a system message, developer as system, each call joined to the
assistant message before it (as the model wrote them: text, then `<tool_call>` blocks), each
output a `tool` message. Other item types (images, files, reasoning, built-in tools' calls)
are a 400 naming the item.

Tools. Function tools, flat as this API writes them (not under `function`), and namespaces of
them, whose functions the model sees beside the others (a call of one comes back with its
`namespace`). Built-in tools (web_search, file_search, code_interpreter, shell, apply_patch, mcp
and the rest: `BUILT_IN_TOOLS`) are left out of the prompt, since the model can call none of
them, rather than refused: Codex CLI sends web_search with every request. Custom (freeform)
tools are a 400.

The fields, each honoured, accepted as metadata, or refused (400) unless at the value that asks
for nothing, as in /v1/chat/completions (schemas.py):
  honoured     model, input, instructions (each request's own: a stored conversation does
               not carry them), previous_response_id, store, max_output_tokens, temperature,
               top_p, top_k (an extension, as on the chat endpoint), stream, tools,
               tool_choice (none, auto, required, or a function), parallel_tool_calls,
               metadata (echoed)
  metadata     user, safety_identifier, prompt_cache_key, prompt_cache_retention,
               service_tier, stream_options, client_metadata, max_tool_calls (it bounds
               built-in tools' calls: there are none), include (except logprobs), reasoning
               with no effort or "none" (its summary: there is no reasoning to summarize)
  unsupported  conversation, prompt, background, top_logprobs, any reasoning effort (this
               model does not reason), text.format other than text, truncation "auto"

Output. The reply's text is parsed for tool calls as on the chat endpoint (nanoqwen.tool_calls):
text becomes `message` items with one `output_text` part, each call a `function_call` item, in
the order the model wrote them. A reply stopped by `max_output_tokens` (or the context's end)
has status "incomplete" with incomplete_details.reason "max_output_tokens".

Streaming: server-sent events, each `event: <type>` and its JSON with `type` and
`sequence_number`: response.created, response.in_progress, then per message item
output_item.added, content_part.added, output_text.delta ..., output_text.done,
content_part.done, output_item.done; per call output_item.added, one
function_call_arguments.delta (calls are parsed whole), function_call_arguments.done,
output_item.done; last response.completed or response.incomplete. No `[DONE]` follows, as
OpenAI sends none on this endpoint. A failure after the first event ends the stream with
response.failed, its `error` set; before it, the request gets its HTTP status (500/503).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..sampling import SamplingParams
from ..tool_calls import CLOSE, NoToolCalls, ToolCall, ToolCallParser
from .app import ClientGone, JobStream, Service, job_events, validation_error
from .compat import field_names
from .protocol import APIError, sse
from .schemas import (
    MAX_TOOLS,
    FunctionCall,
    FunctionDef,
    FunctionName,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolPlan,
    check_tool_choice,
    neutral,
    plan_tools,
)

PLAIN_TEXT = {"format": {"type": "text"}}  # the `text` setting that asks for nothing
FORGOTTEN = (  # why a stored response may be missing
    "responses are kept in this server's memory, with store true, until it restarts or needs "
    "the room"
)
STORE_CHARS = 64 * 2**20  # the stored responses' JSON text (ResponseStore), oldest dropped first


def _joined(parts: list[TextPart]) -> str:
    return "".join(p.text for p in parts)


def _string_as_part(value: Any) -> Any:
    """A text field's string as its one part (a `mode="before"` validator): the field then has
    one type, so a bad part is reported as itself, not beside "not a string"."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class TextPart(BaseModel):
    """A text part of a message: input_text, or output_text in an earlier reply's message."""

    model_config = ConfigDict(strict=True, extra="ignore")  # annotations, logprobs
    type: Literal["input_text", "output_text"]
    text: str

    def listed(self) -> dict[str, Any]:
        """As the input items' listing writes the part (an output_text with its annotations)."""
        part: dict[str, Any] = {"type": self.type, "text": self.text}
        return part | {"annotations": []} if self.type == "output_text" else part


class MessageItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # status
    id: str | None = None
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart]

    _parts = field_validator("content", mode="before")(_string_as_part)


class FunctionCallItem(FunctionCall):
    """A call the model made in an earlier turn (`arguments`: JSON text of an object)."""

    model_config = ConfigDict(strict=True, extra="ignore")  # status
    id: str | None = None
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # status
    id: str | None = None
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[TextPart]

    _parts = field_validator("output", mode="before")(_string_as_part)


def _item_type(value: Any) -> str | None:
    # A message may leave out its type (OpenAI's "easy input message").
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="item_type",
        custom_error_message=(
            "must be an object of type message, function_call or function_call_output (this "
            "server reads text only, takes no item references and runs no built-in tools)"
        ),
    ),
]


class FunctionTool(BaseModel):
    """A function tool as the Responses API writes it: flat, not under `function`."""

    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; the reply is not constrained to the schema

    def as_chat_tool(self) -> Tool:
        fields = self.model_dump(exclude={"type"}, exclude_none=True)
        return Tool(type="function", function=FunctionDef(**fields))


class NamespaceTool(BaseModel):
    """Function tools grouped under a name; the model sees them as plain functions, and a call
    of one comes back with the group's name in `namespace` (how the client dispatches it)."""

    model_config = ConfigDict(strict=True)
    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=MAX_TOOLS)


# Tools that OpenAI runs itself, or whose calls are items of their own rather than function
# calls: a model served here can call none of them, so they are left out of its prompt (the
# response still lists them, as sent). Codex CLI, for one, always sends web_search.
BUILT_IN_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "computer", "computer_use_preview",
    "mcp", "tool_search", "programmatic_tool_calling", "local_shell", "shell", "apply_patch",
})  # fmt: skip


class BuiltInTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # echoed whole
    type: str


def _tool_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return "built-in" if kind in BUILT_IN_TOOLS else kind


ToolIn = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[BuiltInTool, Tag("built-in")],
    Discriminator(
        _tool_kind,
        custom_error_type="tool_type",
        custom_error_message=(
            "must be a function tool, a namespace of function tools, or a built-in tool (left "
            "out: the model calls functions only); custom tools are not supported"
        ),
    ),
]


class Reasoning(BaseModel):
    """Accepted because agent clients send it on every request; this model does not reason, so
    only an effort that asks for none passes (a summary of no reasoning is empty)."""

    model_config = ConfigDict(strict=True, extra="ignore")  # summary, generate_summary
    effort: Literal["none"] | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # an extension, as on /v1/chat/completions; 0 = off
    stream: bool = False
    tools: list[ToolIn] = Field(default=[], max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = Field(default={}, max_length=16)
    user: str | None = None
    include: list[str] = []
    store: bool = True
    previous_response_id: str | None = None
    conversation: neutral() = None
    prompt: neutral() = None
    background: neutral(False) = None
    top_logprobs: neutral(0) = None
    reasoning: Reasoning | None = None
    text: neutral({}, PLAIN_TEXT, PLAIN_TEXT | {"verbosity": "medium"}) = None
    truncation: neutral("disabled") = None

    # What Service.prepare and Service.sampling name in their errors.
    prompt_field: ClassVar[str] = "input"
    max_tokens_field: ClassVar[str] = "max_output_tokens"

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # OpenAI reads an explicit null as "not given".
        return {key: value for key, value in data.items() if value is not None}

    @field_validator("input", mode="before")
    @classmethod
    def _input_forms(cls, value: Any) -> Any:
        if isinstance(value, str):  # one user message
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("input_form", "must be a string or a list of input items")
        return value

    @field_validator("include")
    @classmethod
    def _no_logprobs(cls, value: list[str]) -> list[str]:
        if any("logprobs" in entry for entry in value):
            raise PydanticCustomError("unsupported", "no log-probabilities are computed here")
        return value

    @field_validator("tools")
    @classmethod
    def _one_function_a_name(cls, tools: list[Any]) -> list[Any]:
        names = [f.name for f in _functions(tools)]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise PydanticCustomError(
                "tool_name_twice",
                "function {name} is defined twice (namespaces share one set of names here)",
                {"name": twice[0]},
            )
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, value: Any, info: Any) -> Any:
        named = value.name if isinstance(value, FunctionChoice) else None
        names = [f.name for f in _functions(info.data.get("tools") or [])]
        check_tool_choice(value, named, names)
        return value

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        tools = [f.as_chat_tool() for f in _functions(self.tools)]
        return plan_tools(tools, choice, self.parallel_tool_calls)

    @functools.cached_property
    def namespaces(self) -> dict[str, str]:
        """The namespace of each function defined in one."""
        return {f.name: t.name for t in self.tools if isinstance(t, NamespaceTool) for f in t.tools}

    def dialogue(self, previous: Conversation | None) -> Conversation:
        """The stored conversation `previous` (of previous_response_id) with this request's
        input items after it, as the chat template's messages (the module docstring: Input);
        APIError when a function_call_output answers no call made before it."""
        messages = list(previous.messages) if previous else []
        calls = set(previous.calls) if previous else set()
        for index, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _joined(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"name": item.name, "arguments": json.loads(item.arguments)}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                # A new dict: the one before may belong to a stored conversation.
                last = messages[-1]
                messages[-1] = last | {"tool_calls": [*last.get("tool_calls", []), call]}
                calls.add(item.call_id)
            elif item.call_id in calls:
                messages.append({"role": "tool", "content": _joined(item.output)})
            else:
                raise APIError(
                    400,
                    f"input: item {index} answers call_id {item.call_id!r}, which no "
                    "function_call before it made",
                    param="input",
                )
        return Conversation(tuple(messages), frozenset(calls))

    def listed_items(self) -> tuple[dict[str, Any], ...]:
        """The input items as GET /v1/responses/{id}/input_items lists them: each with its id
        (the client's, else a new one) and status completed, a message's parts as sent."""
        out = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"id": item.id or _id("msg"), "type": "message", "role": item.role,
                            "status": "completed",
                            "content": [p.listed() for p in item.content]})  # fmt: skip
            elif isinstance(item, FunctionCallItem):
                out.append({"id": item.id or _id("fc"), "type": "function_call",
                            "call_id": item.call_id, "name": item.name,
                            "arguments": item.arguments, "status": "completed"})  # fmt: skip
            else:
                out.append({"id": item.id or _id("fco"), "type": "function_call_output",
                            "call_id": item.call_id, "output": _joined(item.output),
                            "status": "completed"})  # fmt: skip
        return tuple(out)

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=max_tokens,
            stop=(CLOSE,) if self.tool_plan.single else (),  # the reply ends at its first call
        )

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
            "tools": [t.model_dump() for t in self.tools],
            "top_p": self.top_p,
            "user": self.user,
        }


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A conversation as the chat template takes it (instructions aside: they are each
    request's own) and the call ids made in it, which later function_call_outputs answer."""

    messages: tuple[dict[str, Any], ...]
    calls: frozenset[str]


@dataclasses.dataclass
class Stored:
    response: dict[str, Any]
    conversation: Conversation  # with the response's own output last
    items: tuple[dict[str, Any], ...]  # the request's input items, listed (listed_items)
    chars: int  # what it holds, as JSON text: its share of the store's budget


class ResponseStore:
    """The responses made with `store` (OpenAI's default), for previous_response_id and GET /
    DELETE /v1/responses/{id}: in this process's memory, so gone on restart, and the least
    recently used dropped once they hold more than `max_chars` of JSON text."""

    def __init__(self, max_chars: int = STORE_CHARS) -> None:
        self.max_chars = max_chars
        self._held: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._chars = 0

    def put(self, response: dict[str, Any], conversation: Conversation,
            items: tuple[dict[str, Any], ...]) -> None:  # fmt: skip
        chars = sum(len(json.dumps(part)) for part in (response, conversation.messages, items))
        self.delete(response["id"])
        self._held[response["id"]] = Stored(response, conversation, items, chars)
        self._chars += chars
        while self._chars > self.max_chars and len(self._held) > 1:
            self._chars -= self._held.popitem(last=False)[1].chars

    def get(self, response_id: str) -> Stored | None:
        stored = self._held.get(response_id)
        if stored is not None:
            self._held.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._held.pop(response_id, None)
        if stored is not None:
            self._chars -= stored.chars
        return stored is not None


def _functions(tools: list[Any]) -> list[FunctionTool]:
    """The function tools the model is shown: those of the request and of its namespaces."""
    out = []
    for tool in tools:
        if isinstance(tool, FunctionTool):
            out.append(tool)
        elif isinstance(tool, NamespaceTool):
            out += tool.tools
    return out


FIELD_NAMES = field_names(ResponsesRequest, MessageItem, TextPart, FunctionCallItem,
                          FunctionCallOutputItem, FunctionTool, NamespaceTool, Reasoning,
                          FunctionChoice)  # fmt: skip


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    """One response: its output items as the reply's deltas come, and the stream events they
    make (`start`, `add` and `fail` return them; a non-streamed request drops them). At its
    end the response and its conversation go to `store` (None: the request said store
    false)."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        prompt_tokens: int,
        conversation: Conversation,
        store: ResponseStore | None,
    ) -> None:
        self.id = _id("resp")
        self.conversation, self.store = conversation, store
        self.items = body.listed_items() if store is not None else ()
        self.created_at = int(time.time())
        self.model = model
        self.echo = body.echo()
        self.namespaces = body.namespaces
        self.parser: ToolCallParser | NoToolCalls = body.tool_plan.parser()
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_tokens = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the message item being written
        self.pieces: list[str] = []  # its text so far, joined into it when it closes
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.error: dict[str, str] | None = None
        self.sequence = 0

    def event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + type_.encode() + b"\n" + sse(payload)

    def start(self) -> list[bytes]:
        response = self.response()
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def add(self, delta: Any) -> list[bytes]:
        """Account for one `Delta` of the reply; its events."""
        self.cached_tokens += delta.cached_tokens
        self.output_tokens += len(delta.token_ids)
        events = []
        for piece in self.parser.push(delta.text, delta.finish_reason is not None):
            if isinstance(piece, str):
                events += self._text(piece)
            else:
                events += self._close_message("completed") + self._call(piece)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def fail(self, error: APIError) -> bytes:
        """The last event of a stream whose generation failed."""
        self.status = "failed"
        if self.message is not None:  # what the open message holds so far
            self.message["content"][0]["text"] = "".join(self.pieces)
        message = error.body["error"]
        self.error = {"code": message["code"] or "server_error", "message": message["message"]}
        return self.event("response.failed", response=self.response())

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self.message is None:
            self.message = {"id": _id("msg"), "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []}  # fmt: skip
            events.append(self._added(self.message))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.message["content"].append(part)
            events.append(self.event("response.content_part.added", part=part, **self._at()))
        self.pieces.append(text)
        events.append(self.event("response.output_text.delta", delta=text, logprobs=[],
                                 **self._at()))  # fmt: skip
        return events

    def _close_message(self, status: str) -> list[bytes]:
        if self.message is None:
            return []
        part = self.message["content"][0]
        part["text"] = "".join(self.pieces)
        self.pieces = []
        events = [
            self.event("response.output_text.done", text=part["text"], logprobs=[], **self._at()),
            self.event("response.content_part.done", part=part, **self._at()),
        ]
        self.message["status"] = status
        events.append(self._done(self.message))
        self.message = None
        return events

    def _call(self, call: ToolCall) -> list[bytes]:
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call.id, "name": call.name}  # fmt: skip
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        at = {"item_id": item["id"], "output_index": len(self.output)}
        events = [
            self._added(item),
            self.event("response.function_call_arguments.delta", delta=call.arguments, **at),
            self.event(
                "response.function_call_arguments.done",
                arguments=call.arguments,
                name=call.name,
                **at,
            ),  # fmt: skip
        ]
        item |= {"arguments": call.arguments, "status": "completed"}
        return [*events, self._done(item)]

    def _added(self, item: dict[str, Any]) -> bytes:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1,
                          item=item)  # fmt: skip

    def _done(self, item: dict[str, Any]) -> bytes:
        return self.event("response.output_item.done", output_index=self.output.index(item),
                          item=item)  # fmt: skip

    def _at(self) -> dict[str, Any]:
        """Where the message being written stands: its id, output index and (only) part."""
        index = self.output.index(self.message)
        return {"item_id": self.message["id"], "output_index": index, "content_index": 0}

    def _finish(self, finish_reason: str) -> list[bytes]:
        if finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        events = self._close_message(self.status)
        response = self.response()
        if self.store is not None:
            self.store.put(response, self._with_reply(), self.items)
        return [*events, self.event(f"response.{self.status}", response=response)]

    def _with_reply(self) -> Conversation:
        """The conversation with this reply after it, as the model wrote it: one assistant
        message, its text and then its calls."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [i for i in self.output if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"name": c["name"], "arguments": json.loads(c["arguments"])}
                                     for c in calls]  # fmt: skip
        ids = {c["call_id"] for c in calls}
        return Conversation((*self.conversation.messages, message), self.conversation.calls | ids)

    def response(self) -> dict[str, Any]:
        """The response object as it stands (whole after the last `add`)."""
        done = self.status in ("completed", "incomplete")
        usage = None
        if done:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": self.output,
            "reasoning": {"effort": None, "summary": None},
            "text": PLAIN_TEXT | {"verbosity": "medium"},
            "top_logprobs": 0,
            "truncation": "disabled",
            "usage": usage,
            **self.echo,
        }


def items_page(items: tuple[dict[str, Any], ...], query: Any) -> dict[str, Any]:
    """The page of a stored response's input items that the query asks for (the module
    docstring: its limit, order and after), as OpenAI's list object; APIError (400) naming a
    bad parameter."""
    limit = query.get("limit", "20")
    if not (limit.isdecimal() and 1 <= int(limit) <= 100):
        raise APIError(400, f"limit: must be an integer from 1 to 100, got {limit!r}",
                       param="limit")  # fmt: skip
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be asc or desc, got {order!r}", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise APIError(400, f"after: no input item {query['after']!r} in this response",
                           param="after")  # fmt: skip
        start = ids.index(query["after"]) + 1
    page = ordered[start : start + int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + len(page) < len(ordered),
    }


def add_responses_routes(app: FastAPI, service: Service) -> None:
    """Register /v1/responses (POST; GET and DELETE of a stored response, GET of its input
    items) on `app`."""
    store = ResponseStore()

    def stored(response_id: str) -> Stored:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r}: {FORGOTTEN}",
                           param="response_id", code="not_found")  # fmt: skip
        return found

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        try:
            body = ResponsesRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            content_type = request.headers.get("content-type")
            raise validation_error(
                RequestValidationError(exc.errors()), content_type, FIELD_NAMES
            ) from None
        service.check_model(body.model)
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise APIError(
                    400,
                    f"previous_response_id: no stored response {body.previous_response_id!r}: "
                    f"{FORGOTTEN}",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        conversation = body.dialogue(previous.conversation if previous else None)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        plan = body.tool_plan
        prompt: dict[str, Any] = {"messages": [*system, *conversation.messages]}
        if plan.parses:
            prompt |= {"tools": plan.tools, "reply_prefix": plan.prefix}
        ids = await service.prepare("input", **prompt)
        job = service.submit(ids, service.sampling(body, ids, None))
        keep = store if body.store else None
        reply = ResponseReply(body, service.model, len(ids), conversation, keep)
        events = job_events(request, job)
        try:
            if body.stream:
                first = await anext(events, None)  # errors before the first token keep a status
                return JobStream(job, stream_body(reply, first, events))
            async for delta in events:
                reply.add(delta)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(reply.response())

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id).response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> JSONResponse:
        return JSONResponse(items_page(stored(response_id).items, request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def stream_body(
    reply: ResponseReply, first: Any, events: AsyncIterator[Any]
) -> AsyncIterator[bytes]:
    """The SSE body (the module docstring: Streaming); one body message a delta."""
    try:
        out = b"".join(reply.start())
        delta = first
        while delta is not None:
            out += b"".join(reply.add(delta))
            yield out
            out = b""
            delta = await anext(events, None)
    except APIError as exc:  # the status line is gone: report the failure as an event
        yield reply.fail(exc)
    except ClientGone:
        return
    finally:
        await events.aclose()
