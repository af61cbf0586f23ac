"""Per-request telemetry as a pure ASGI middleware: a request id, metrics, one log line.

It wraps the whole application, so it covers every route (also ones added later) and the
answers that the middlewares inside it give (a 401, a CORS preflight). It sees only ASGI
messages and never buffers a body: streams pass through as they are. For each HTTP request:

- the request id is the client's `x-request-id` when that is 1-128 characters of
  [A-Za-z0-9._:/+=@-] (anything else could forge log lines or bloat headers), else a fresh
  uuid4 hex; the response echoes it in `x-request-id`;
- a `RequestRecord` goes into the scope (`record_of`), and `app.group_events` fills in the
  generation's figures as its deltas arrive (tokens, queue wait, time to first token);
- at the end the request is counted by method, route template and status, its duration is
  observed, and one line is logged on the `nanoqwen.server` logger:

      POST /v1/completions 200 id=6f1c... client=127.0.0.1:50312 prompt_tokens=8
      completion_tokens=16 queue_s=0.000 ttft_s=0.021 total_s=0.412

  (one line; `-` for what a request did not have). A request whose client left before the
  end (`client_gone`, set by `group_events`) or whose body never finished is logged with
  `incomplete`.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any
from urllib.parse import quote

from starlette.routing import Match

from .metrics import Metrics

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
RECORD_KEY = "nanoqwen.record"  # the scope key of the request's RequestRecord

log = logging.getLogger("nanoqwen.server")


class RequestRecord:
    """What one HTTP request measured; `on_delta` also feeds the token metrics as they come."""

    def __init__(self, request_id: str, metrics: Metrics) -> None:
        self.id = request_id
        self.started = time.monotonic()
        self.prompt_tokens: int | None = None  # set with the first delta
        self.completion_tokens = 0
        self.queue_s: float | None = None
        self.ttft_s: float | None = None
        self.client_gone = False
        self._last_token: float | None = None
        self._metrics = metrics

    def on_delta(self, job: Any, delta: Any) -> None:
        """Account for one delta of `job` (a `worker.Job`), as it reaches the event loop."""
        now, m = time.monotonic(), self._metrics
        if self.ttft_s is None:
            self.ttft_s = now - self.started
            self.prompt_tokens = len(job.ids)
            self.queue_s = job.started_at - job.submitted_at  # set before the job's first delta
            m.time_to_first_token.observe(self.ttft_s)
            m.queue_wait.observe(self.queue_s)
            m.prompt_tokens.inc(self.prompt_tokens)
        if delta.token_ids:
            if self._last_token is not None:
                m.inter_token_latency.observe(now - self._last_token)
            self._last_token = now
            self.completion_tokens += len(delta.token_ids)
            m.generation_tokens.inc(len(delta.token_ids))


def record_of(scope: dict[str, Any]) -> RequestRecord:
    """The RequestRecord that `RequestTelemetry` put into this request's scope."""
    return scope[RECORD_KEY]


def request_id(scope: dict[str, Any]) -> str:
    given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER.encode(), b"")
    text = given.decode("latin-1")
    return text if REQUEST_ID.fullmatch(text) else uuid.uuid4().hex


def route_template(scope: dict[str, Any]) -> str:
    """The path template of the route this request matches ("unmatched" for none): a metric
    label must not take one value per URL. Matched here rather than read from the routing's
    scope keys, so that requests answered before routing (401, preflight) are labelled too."""
    partial = None
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route.path
        if match is Match.PARTIAL and partial is None:
            partial = route.path  # the path matched, the method did not (405)
    return partial or "unmatched"


def _field(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class RequestTelemetry:
    """Request id, metrics and the log line of every HTTP request (see the module docstring)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id(scope), self.metrics)
        scope[RECORD_KEY] = record
        header = (REQUEST_ID_HEADER.encode(), record.id.encode())
        status: int | None = None
        complete = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message = message | {"headers": [*message.get("headers", ()), header]}
            elif message["type"] == "http.response.body":
                complete = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # No status: the app raised before answering, and the server answers 500.
            ended = complete and not record.client_gone
            self._finish(scope, record, status or 500, ended or status is None)

    def _finish(
        self, scope: dict[str, Any], record: RequestRecord, status: int, complete: bool
    ) -> None:
        total = time.monotonic() - record.started
        route = route_template(scope)
        self.metrics.requests.labels(scope["method"], route, str(status)).inc()
        self.metrics.request_duration.labels(route).observe(total)
        client = scope.get("client")
        generated = record.prompt_tokens is not None
        log.info(
            "%s %s %d id=%s client=%s prompt_tokens=%s completion_tokens=%s queue_s=%s "
            "ttft_s=%s total_s=%.3f%s",
            scope["method"],
            quote(scope["path"]),  # percent-encoded again: a decoded newline cannot forge a line
            status,
            record.id,
            f"{client[0]}:{client[1]}" if client else "-",
            _field(record.prompt_tokens, "d"),
            _field(record.completion_tokens if generated else None, "d"),
            _field(record.queue_s, ".3f"),
            _field(record.ttft_s, ".3f"),
            total,
            "" if complete else " incomplete",
        )
