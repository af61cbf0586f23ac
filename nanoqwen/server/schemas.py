"""Request bodies of the OpenAI-compatible API, validated with pydantic before any engine work.

Models are strict (a string is not a number, a number is not a string) and follow OpenAI's
ranges: temperature in [0, 2], top_p in [0, 1] (0 keeps only the most probable token: greedy),
at most 4 stop strings; null means "default", as in OpenAI's API. `prompt` takes OpenAI's four
forms: a string, a list of strings, a list of token ids, a list of token-id lists (at most
MAX_PROMPTS prompts, `n` choices each). `max_tokens` has no upper bound here: the context check
(`LLM.check_fits`) names the limit.

Every field of OpenAI's chat and completions requests is one of three kinds:
  honoured     model, messages, prompt, suffix, max_tokens, max_completion_tokens, temperature,
               top_p, seed, stop, stream, stream_options.include_usage, tools, tool_choice,
               parallel_tool_calls, n (each prompt's choices decoded together; seeded, choice
               j draws from seed + j);
  metadata     user, metadata, store, service_tier, safety_identifier, prompt_cache_key,
               prompt_cache_options, prompt_cache_retention, stream_options.include_obfuscation:
               accepted, change nothing;
  unsupported  best_of, echo, logprobs, top_logprobs, logit_bias, presence_penalty,
               frequency_penalty, response_format, functions, function_call (the deprecated
               form of tools), audio, modalities, prediction, moderation, reasoning_effort,
               verbosity, web_search_options: accepted only at the value that asks for nothing
               (`neutral`), any other value is a 400 naming the field.

So a request never silently gets less than it asked for. Fields OpenAI does not have are
ignored, as OpenAI clients send extras freely; top_k is our one extension (vLLM has it too).

Tools (nanoqwen.tool_calls: the format, the parser). A chat may carry the assistant's earlier
calls (`tool_calls`, arguments as JSON text) and their answers (`tool` messages). Given
`tools`, the template lists them and the reply's calls come back parsed; tool_choice "none"
leaves them out of the prompt, "required" and a named function start the reply inside a call
(`ToolPlan.prefix`), and a named function or parallel_tool_calls false ends the reply at the
first call's closing tag (one call, as OpenAI returns then).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..sampling import SamplingParams
from ..tool_calls import CLOSE, NoToolCalls, ToolCallParser, forced_prefix

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 32  # prompts of one completion request (LangChain's OpenAI LLM sends 20 at once)
MAX_CHOICES = 128  # n, as OpenAI bounds it (the queue's size bounds it further: app.Service)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

StopString = Annotated[str, Field(min_length=1)]


def neutral(*accepted: Any) -> Any:
    """The type of an OpenAI field this server cannot honour: only null (absent) and the
    `accepted` values, which ask for nothing, pass; anything else is refused by name."""
    shown = " or ".join([*(json.dumps(v) for v in accepted), "null"])

    def check(value: Any) -> Any:
        # json.dumps tells apart what == does not: true from 1, 1.0 from 1.
        if not any(json.dumps(value, sort_keys=True) == json.dumps(v) for v in accepted):
            raise PydanticCustomError(
                "unsupported",
                "not supported by this server; only {accepted} is accepted",
                {"accepted": shown},
            )
        return value

    return Annotated[Any, AfterValidator(check)]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule
MAX_TOOLS = 128  # OpenAI's limit on a request's tools


class FunctionCall(BaseModel):
    """A call an earlier assistant turn made: `arguments` is the JSON text of an object."""

    model_config = ConfigDict(strict=True)
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            ok = isinstance(json.loads(value), dict)
        except ValueError:
            ok = False
        if not ok:
            raise PydanticCustomError("arguments_json", "must be the JSON text of an object")
        return value


class ToolCallIn(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call it answers (the template does not show it)

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only assistant messages make tool calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "content_missing", "is required (null only beside an assistant's tool_calls)"
            )
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The {role, content[, tool_calls]} dict the chat template takes; `developer` is
        OpenAI's new name for `system`, text parts are joined, and calls carry their
        arguments as objects (the template writes them as JSON)."""
        role = "system" if self.role == "developer" else self.role
        if self.content is None or isinstance(self.content, str):
            content = self.content or ""
        else:
            content = "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                for c in self.tool_calls
            ]
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True)
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None  # accepted; the reply is not constrained to the schema


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: NamedFunction


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the generation: the definitions the template lists
    (None: none), the reply's forced start, and whether the reply ends at the first call."""

    tools: list[dict[str, Any]] | None = None
    prefix: str = ""
    single: bool = False

    @property
    def parses(self) -> bool:
        """Whether the reply's calls are parsed out of its text."""
        return self.tools is not None

    def parser(self) -> ToolCallParser | NoToolCalls:
        """What splits one reply's text into content and calls (without tools: all content)."""
        if not self.parses:
            return NoToolCalls()
        names = frozenset(t["function"]["name"] for t in self.tools)
        return ToolCallParser(names, self.prefix, self.single)


NO_TOOLS = ToolPlan()


def check_tool_choice(choice: Any, named: str | None, names: list[str]) -> None:
    """A tool_choice that forces a call needs tools, a named one (`named`) among them ("auto"
    without tools, which some clients always send, asks for nothing)."""
    if choice not in ("none", "auto") and not names:
        raise PydanticCustomError("tool_choice_tools", "needs tools")
    if named is not None and named not in names:
        raise PydanticCustomError(
            "tool_choice_name", "names {name}, which is not among the tools", {"name": named}
        )


def plan_tools(
    tools: list[Tool] | None, choice: str | NamedToolChoice | None = None, parallel: bool = True
) -> ToolPlan:
    """A request's tools as the generation takes them (module docstring: Tools); `choice`
    None is "auto"."""
    if not tools or choice == "none":
        return NO_TOOLS
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedToolChoice):
        return ToolPlan(dumped, forced_prefix(choice.function.name), single=True)
    return ToolPlan(dumped, forced_prefix() if choice == "required" else "", not parallel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False  # OpenAI's default: no usage chunk


class GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # an extension (vLLM has it too); 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: tuple[StopString, ...] = ()
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: neutral(0, 0.0) = None
    frequency_penalty: neutral(0, 0.0) = None
    logit_bias: neutral({}) = None

    prompt_field: ClassVar[str]  # the field that carries the prompt, for error messages

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI treats an explicit null like an absent field, and many clients send them.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        # One string, or a list of strings: say so plainly rather than report both union arms.
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list):
            raise PydanticCustomError(
                "stop_type",
                "must be a string or a list of at most {most} strings",
                {"most": MAX_STOP_STRINGS},
            )
        if len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError(
                "too_many_stops",
                "at most {most} stop strings are supported, got {got}",
                {"most": MAX_STOP_STRINGS, "got": len(value)},
            )
        return tuple(value)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
        )


class ChatRequest(GenerationRequest):
    prompt_field = "messages"
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: neutral(False) = None
    top_logprobs: neutral(0) = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: neutral([]) = None
    function_call: neutral("none") = None
    response_format: neutral({"type": "text"}) = None
    audio: neutral() = None
    modalities: neutral(["text"]) = None
    prediction: neutral() = None
    moderation: neutral() = None
    reasoning_effort: neutral("none") = None
    verbosity: neutral("medium") = None
    web_search_options: neutral() = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, value: Any, info: Any) -> Any:
        tools = info.data.get("tools") or []
        named = value.function.name if isinstance(value, NamedToolChoice) else None
        check_tool_choice(value, named, [t.function.name for t in tools])
        return value

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        params = super().sampling_params(max_tokens)
        if self.tool_plan.single:  # the reply ends where its first call does
            return dataclasses.replace(params, stop=(*params.stop, CLOSE))
        return params

    def requested_max_tokens(self) -> int | None:
        # The newer name wins when both are given, as in OpenAI's API.
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


def _is_id(x: Any) -> bool:
    return type(x) is int  # not bool: strict, like every other field


class CompletionRequest(GenerationRequest):
    prompt_field = "prompt"
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None  # given: fill-in-the-middle between each prompt and suffix
    echo: neutral(False) = None
    best_of: neutral(1) = None
    logprobs: neutral() = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, value: Any) -> Any:
        # Checked here to name the four forms, where the union would report each arm's error.
        if isinstance(value, str) or (
            isinstance(value, list) and value and all(map(_is_id, value))
        ):
            return value
        forms = (
            isinstance(value, list)
            and value
            and (
                all(isinstance(p, str) for p in value)
                or all(isinstance(p, list) and p and all(map(_is_id, p)) for p in value)
            )
        )
        if not forms:
            raise PydanticCustomError(
                "prompt_form",
                "must be a string, a list of strings, a list of token ids or a list of "
                "non-empty token-id lists",
            )
        if len(value) > MAX_PROMPTS:
            raise PydanticCustomError(
                "too_many_prompts",
                "at most {most} prompts per request, got {got}",
                {"most": MAX_PROMPTS, "got": len(value)},
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix_needs_text(cls, value: str | None, info: Any) -> str | None:
        prompt = info.data.get("prompt")
        if value is not None and isinstance(prompt, list) and not isinstance(prompt[0], str):
            raise PydanticCustomError("suffix_ids", "goes with text prompts, not token ids")
        return value

    def prepare_args(self) -> list[tuple[str, dict[str, Any]]]:
        """(param, `LLM.prepare` keyword arguments) for each prompt, in choice order."""
        if isinstance(self.prompt, str) or _is_id(self.prompt[0]):
            prompts = [("prompt", self.prompt)]
        else:
            prompts = [(f"prompt[{i}]", p) for i, p in enumerate(self.prompt)]
        if self.suffix is None:
            return [(param, {"prompt": p}) for param, p in prompts]
        return [(param, {"fim": (p, self.suffix)}) for param, p in prompts]


def field_names() -> frozenset[str]:
    """Every field name of the request models: what a validation error's location may name
    (the rest of a location are list indices and pydantic's union-member tags)."""
    models = (ChatRequest, CompletionRequest, Message, TextPart, StreamOptions, ToolCallIn,
              FunctionCall, Tool, FunctionDef, NamedToolChoice, NamedFunction)  # fmt: skip
    return frozenset(name for model in models for name in model.model_fields)
