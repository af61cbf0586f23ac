"""What the llama.cpp- and Ollama-compatible endpoints share: reading a request body into a
strict model, and the record of one generation (its token ids and wall-clock marks).

These endpoints read the body themselves instead of letting FastAPI bind it: their clients send
JSON whatever the Content-Type says (Ollama's documented `curl -d`, which is form-encoded), and
each protocol answers a bad body in its own error shape, not with OpenAI's error object.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, field_validator

Body = TypeVar("Body", bound=BaseModel)


class BadBody(Exception):
    """The request body is missing, not JSON, or fails its model; the message says where."""


def field_names(*models: type[BaseModel]) -> frozenset[str]:
    """The field names of `models`: what a validation error's location may name (the rest of a
    location are list indices and pydantic's union-member tags such as "list[str]")."""
    return frozenset(name for model in models for name in model.model_fields)


def parse_body(raw: bytes, model: type[Body], names: frozenset[str]) -> Body:
    """`raw` validated into `model`, or BadBody naming the first problem and its field."""
    if not raw.strip():
        raise BadBody("missing request body: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadBody(_describe(exc.errors(), names)) from None


def _describe(errors: list[Any], names: frozenset[str]) -> str:
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
    path = field_path(first["loc"], names)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "model_type" and not path:
        return "request body must be a JSON object"
    if not path:  # a rule across fields (a model validator): its message names them
        return message
    others = {field_path(e["loc"], names) for e in errors} - {path}
    more = f" (and {len(others)} more problems)" if others else ""
    return f"{path}: {message}{more}"


def field_path(loc: Iterable[Any], names: frozenset[str]) -> str:
    """A validation error's location as a field path, ("body", "messages", 0, "str",
    "content") -> "messages[0].content": field names and list indices kept."""
    parts = [p for p in loc if isinstance(p, int) or p in names]
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def null_means_default(data: Any) -> Any:
    """Drop the keys whose value is null (a `model_validator(mode="before")` body): both llama.cpp
    and Ollama read an explicit null as "not given"."""
    if isinstance(data, dict):
        return {key: value for key, value in data.items() if value is not None}
    return data


def refuse_unless_empty(name: str, reason: str) -> Any:
    """A field validator (assign it in the model's body) that refuses any non-empty value of
    the field `name`, a feature this server does not implement, saying why."""

    def check(cls: Any, value: Any) -> Any:
        if value:
            raise ValueError(f"{name} is not supported by this server: {reason}")
        return value

    return field_validator(name)(classmethod(check))


def only_neutral(neutral: dict[str, Any]) -> Any:
    """A field validator (assign it in the model's body) for the fields named in `neutral`,
    knobs this server does not implement: each is accepted at its neutral value only."""

    def check(cls: Any, value: Any, info: Any) -> Any:
        if value != neutral[info.field_name]:
            raise ValueError(
                f"{info.field_name} is not supported by this server; only "
                f"{neutral[info.field_name]!r} is accepted"
            )
        return value

    return field_validator(*neutral)(classmethod(check))


class Run:
    """One job's generated token ids, its finish reason and its wall-clock marks.

    Times are what the HTTP front end sees (time.perf_counter): `prompt_seconds` runs from the
    submission to the first delta, so it holds the queue wait, the prefill and the first token;
    `eval_seconds` runs from the first delta to the last.
    """

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.submitted = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # of prompt_tokens, served from the prefix cache

    def add(self, delta: Any) -> None:
        """Account for one `Delta(text, token_ids, finish_reason, cached_tokens)` from
        `LLM.stream`."""
        self.cached_tokens += delta.cached_tokens
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
        self.token_ids += delta.token_ids
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def generated(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_seconds(self) -> float:
        return (self.first or time.perf_counter()) - self.submitted

    @property
    def eval_seconds(self) -> float:
        return 0.0 if self.first is None or self.last is None else self.last - self.first
