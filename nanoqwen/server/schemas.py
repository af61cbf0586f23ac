"""Request bodies of the OpenAI-compatible API, validated with pydantic before any engine work.

Models are strict (a string is not a number, a number is not a string) and follow OpenAI's
ranges: temperature in [0, 2], top_p in [0, 1] (0 keeps only the most probable token: greedy),
at most 4 stop strings; null means "default", as in OpenAI's API. Unknown fields are ignored,
as OpenAI clients send extras freely; the fields we know but cannot honour (n > 1, logprobs,
echo, best_of > 1, penalties, tools) are accepted only at their neutral value, so a request
never silently gets something it did not ask for. `max_tokens` has no upper bound here: the
context check (`LLM.check_fits`) names the limit.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import SamplingParams

MAX_STOP_STRINGS = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

StopString = Annotated[str, Field(min_length=1)]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        """The {role, content} dict the chat template takes; `developer` is OpenAI's new name
        for `system`, and text parts are joined."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        return {"role": role, "content": "".join(part.text for part in self.content)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = True


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
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Literal[1] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    prompt_field: ClassVar[str]  # the field that carries the prompt, for error messages

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI treats an explicit null like an absent field, and many clients send them.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported by this server; only 0 is accepted")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is None or self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=0.0 if self.top_p == 0.0 else self.temperature,
            top_k=self.top_k,
            top_p=self.top_p if self.top_p > 0.0 else 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
        )


class ChatRequest(GenerationRequest):
    prompt_field = "messages"
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Literal[False] = False
    tools: Annotated[list[object], Field(max_length=0)] | None = None

    def requested_max_tokens(self) -> int | None:
        # The newer name wins when both are given, as in OpenAI's API.
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(GenerationRequest):
    prompt_field = "prompt"
    prompt: str
    suffix: str | None = None  # given: fill-in-the-middle between prompt and suffix
    echo: Literal[False] = False
    best_of: Literal[1] = 1
    logprobs: None = None


def field_names() -> frozenset[str]:
    """Every field name of the request models: what a validation error's location may name
    (the rest of a location are list indices and pydantic's union-member tags)."""
    models = (ChatRequest, CompletionRequest, Message, TextPart, StreamOptions)
    return frozenset(name for model in models for name in model.model_fields)
