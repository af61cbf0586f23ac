"""`nanoqwen serve` shutting down, a real server process per test (tiny model, reference backend).

SIGTERM / Ctrl-C drain the server: queued requests and new ones get a JSON 503 at once, the
running stream finishes within the grace period (--shutdown-grace) or then ends with an error
event and `data: [DONE]`, at once on a second signal; the process exits 0 with no traceback in
its log. The servers run one generation at a time (--max-batch 1), so that requests wait in the
queue behind the running one.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

ONE_AT_A_TIME = ("--max-batch", "1")
LONG = 3000  # tokens: about a minute of work for the tiny model if nobody stops it


def completion(max_tokens: int, stream: bool) -> dict:
    body = {"model": "tiny", "prompt": "def f():", "max_tokens": max_tokens, "stream": stream}
    return body | {"temperature": 0.0}  # greedy: the tiny model never stops early


class Client(threading.Thread):
    """One request on its own thread: `status` and the body `text` as they arrive, `ended_at`
    (time.monotonic()) once the response has ended."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.answered = threading.Event()  # the first bytes of the body are in
        self.status, self.text, self.ended_at = 0, "", 0.0
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=60) as r:
                self.status = r.status_code
                for text in r.iter_text():
                    self.text += text
                    self.answered.set()
        finally:
            self.ended_at = time.monotonic()
            self.answered.set()

    def outcome(self) -> tuple[int, dict]:
        self.join(30)
        assert not self.is_alive(), "request still open"
        return self.status, json.loads(self.text) if self.status != 200 else {}


def start_busy(proc, queued: int) -> tuple[Client, list[Client]]:
    """A long stream running and `queued` requests (one streamed) waiting behind it."""
    stream = Client(proc.url, "/v1/completions", completion(LONG, stream=True))
    assert stream.answered.wait(30) and stream.status == 200
    waiting = [
        Client(proc.url, "/v1/completions", completion(4, stream=i == 0)) for i in range(queued)
    ]
    deadline = time.monotonic() + 10
    while proc.health()["queue_depth"] < queued:
        assert time.monotonic() < deadline, proc.health()
        time.sleep(0.01)
    return stream, waiting


def assert_shutting_down_503(status: int, body: dict) -> None:
    assert status == 503, body
    assert body["error"]["code"] == "engine_unavailable", body
    assert "shutting down" in body["error"]["message"]


def assert_clean_exit(proc, timeout: float) -> None:
    code = proc.proc.wait(timeout=timeout)
    log = proc.log.read_text()
    assert code == 0 and "Traceback" not in log, log


def stream_ended_by_shutdown(stream: Client, sse_events) -> None:
    stream.join(30)
    *chunks, error, done = sse_events(stream.text)
    assert done == "[DONE]" and chunks and all("choices" in c for c in chunks)
    assert_shutting_down_503(503, error)


def test_sigterm_drains_then_ends_the_stream_after_the_grace(serve, tiny_model, sse_events):
    grace = 1.0
    proc = serve(tiny_model, "--shutdown-grace", str(grace), "--log-level", "info", *ONE_AT_A_TIME)
    stream, waiting = start_busy(proc, queued=3)
    signalled = time.monotonic()  # before the signal: the server's grace starts after it
    proc.proc.send_signal(signal.SIGTERM)
    for client in waiting:  # failed by the drain at once, streamed or not
        assert_shutting_down_503(*client.outcome())
        assert client.ended_at - signalled < grace / 2
    late = httpx.post(proc.url + "/v1/completions", json=completion(4, stream=False), timeout=10)
    assert_shutting_down_503(late.status_code, late.json())
    assert late.headers["content-type"] == "application/json"
    stream_ended_by_shutdown(stream, sse_events)
    assert grace <= stream.ended_at - signalled < grace + 2
    assert_clean_exit(proc, timeout=10)


def test_ctrl_c_lets_the_running_stream_finish(serve, tiny_model, sse_events):
    proc = serve(
        tiny_model, *ONE_AT_A_TIME
    )  # the default grace (5 s) covers 48 tokens of the tiny model
    body = completion(48, stream=True) | {"stream_options": {"include_usage": True}}
    stream = Client(proc.url, "/v1/completions", body)
    assert stream.answered.wait(30)
    proc.proc.send_signal(signal.SIGINT)
    stream.join(30)
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 48
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert_clean_exit(proc, timeout=10)


def test_a_second_signal_ends_the_stream_at_once(serve, tiny_model, sse_events):
    proc = serve(tiny_model, "--shutdown-grace", "60", *ONE_AT_A_TIME)
    stream, _ = start_busy(proc, queued=0)
    proc.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert stream.is_alive(), "the grace period did not hold the stream"
    proc.proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    stream_ended_by_shutdown(stream, sse_events)
    assert stream.ended_at - second < 2
    assert_clean_exit(proc, timeout=10)
