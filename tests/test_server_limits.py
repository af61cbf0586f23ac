"""`nanoqwen serve` bounds its input: a real server process on the tiny model (reference backend,
context 4096, the default 4 MiB body limit), and a second one with a small limit and
`--special-tokens text`.

A body over the limit is a 413 with an OpenAI error object before it is read (declared
Content-Length) or as soon as the count passes the limit (chunked); a prompt far past the
context is refused after tokenizing about a context's worth of it, off the event loop, so
/health keeps answering within 100 ms while maximal requests are refused one after another,
and the server's memory barely moves.
"""

from __future__ import annotations

import json
import socket
import sysconfig
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

LIMIT = 4 * 2**20  # the server's default --max-body-bytes
HEALTH_BOUND_S = 0.1
FIM = "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>"


@pytest.fixture(scope="module")
def server(serve, tiny_model):
    proc = serve(tiny_model)
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log.read_text(), proc.log.read_text()


@pytest.fixture(scope="module")
def small(serve, tiny_model):
    proc = serve(tiny_model, "--max-body-bytes", "2000", "--special-tokens", "text")
    yield proc
    proc.stop()


def source_code(n: int) -> str:
    """n characters of the standard library's Python sources (repeated as needed)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    return (text * (n // len(text) + 1))[:n]


def maximal_body() -> bytes:
    """A completion request just under the limit: a prompt of ~4 MiB of code (~1000x the
    context of the byte-level tiny model)."""
    target = LIMIT - 512
    prompt = source_code(LIMIT)
    while len(data := json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1})) > target:
        prompt = prompt[: target - len(data)]  # a character is at least one byte of JSON
    return (data + " " * (target - len(data))).encode()  # JSON allows trailing whitespace


def test_health_answers_while_maximal_prompts_are_refused(server):
    data = maximal_body()
    hwm_before = _status_kib(server, "VmHWM")
    latencies: list[float] = []
    results: list[tuple[int, dict, float]] = []
    busy = threading.Event()

    def refuse_several() -> None:
        with httpx.Client(timeout=60) as c:
            for _ in range(8):
                start = time.perf_counter()
                r = c.post(
                    server.url + "/v1/completions",
                    content=data,
                    headers={"Content-Type": "application/json"},
                )
                results.append((r.status_code, r.json(), time.perf_counter() - start))
        busy.clear()

    busy.set()
    sender = threading.Thread(target=refuse_several)
    sender.start()
    with httpx.Client(timeout=30) as c:
        while busy.is_set():
            start = time.perf_counter()
            assert c.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    sender.join()
    for status, body, _ in results:
        assert status == 400, body
        assert body["error"]["code"] == "context_length_exceeded"
        assert body["error"]["param"] == "prompt"
        assert "longer than 4095 tokens" in body["error"]["message"]
    assert len(results) == 8 and len(latencies) >= 8
    # One poll may lose its core to another process on a shared runner (measured here: the
    # slowest ~40-100 ms, the rest under 40); the code before the bound kept every poll
    # during a refusal waiting ~6 s.
    slowest = sorted(latencies)[-5:]
    assert slowest[-2] < HEALTH_BOUND_S and slowest[-1] < 3 * HEALTH_BOUND_S, slowest
    # On the code before the bound each refusal tokenized all 4 MiB: seconds, ~1 GB of ids.
    assert max(t for *_, t in results) < 2.0, [round(t, 2) for *_, t in results]
    assert _status_kib(server, "VmHWM") - hwm_before < 200 * 1024


def test_declared_oversized_body_is_refused_unread(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 52428800\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(head + b'{"model": "tiny", "prompt": "')  # and not one byte more
        status, headers, body = _read_response(s)
    assert status == 413 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "52428800 bytes" in error["message"] and f"limit is {LIMIT}" in error["message"]


def test_chunked_oversized_body_is_refused_while_it_streams(server):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(50):
            sent += 2**20
            yield b"x" * 2**20

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "more than" in r.json()["error"]["message"]
    assert sent < 50 * 2**20  # the server answered before the client sent it all
    assert server.health()["status"] == "ok"


def test_body_at_the_limit_is_read(server):
    data = maximal_body()
    r = httpx.post(
        server.url + "/v1/completions",
        content=data + b" " * (LIMIT - len(data)),  # exactly the limit: JSON allows the spaces
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_limit_and_special_tokens_are_configurable(small, server):
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(small.url + "/v1/completions", json=ok | {"prompt": "x" * 2000}, timeout=30)
    assert r.status_code == 413 and "limit is 2000 bytes" in r.json()["error"]["message"]

    def prompt_tokens(url: str, prompt: str) -> int:
        r = httpx.post(url + "/v1/completions", json=ok | {"prompt": prompt}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    parsed, as_text = prompt_tokens(server.url, FIM), prompt_tokens(small.url, FIM)
    assert as_text == parsed - 3 + len("<|fim_prefix|><|fim_suffix|><|fim_middle|>")


def _status_kib(server, key: str) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} line")


def _read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536) or b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body
