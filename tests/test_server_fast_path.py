"""What the streamed first chunk's fast path changed still answers as before.

`FastRoutes` (valid generation requests without FastAPI's request machinery) against the same
app built without it (`create_app(fast_routes=False)`), over the tiny model in process: the
same status, headers and body for malformed, oversized, unauthorized and unknown-model
requests, for refusals the handler makes (context, engine down) and for valid ones. And
`Reply.chunk`'s byte templates against the envelope rendered as JSON, byte for byte.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from nanoqwen.llm import LLM  # noqa: E402
from nanoqwen.server import Worker, create_app  # noqa: E402
from nanoqwen.server.protocol import Reply, sse  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "sk-fast"
JSON = {"content-type": "application/json"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
CHAT |= {"temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "def f(", "max_tokens": 3, "temperature": 0}
MAX_BODY = 4096


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(tiny_model, backend="reference", max_context=256)
    yield llm
    llm.close()


def _exchange(llm, requests, *, drained: bool = False, **options):
    """Each (method, path, body bytes, headers) sent to the app with and without FastRoutes
    (`options`: create_app's); the (status, headers, body) pairs."""

    async def main():
        worker = Worker(llm, max_queue=2)
        worker.start()
        if drained:
            worker.drain()  # the engine takes no more work: 503
        answers = []
        for request in requests:
            pair = []
            for fast in (True, False):
                app = create_app(llm, worker, max_body_bytes=MAX_BODY, fast_routes=fast, **options)
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    method, path, content, headers = request
                    r = await client.request(method, path, content=content, headers=headers)
                    pair.append((r.status_code, _stable_headers(r.headers), r.content))
            answers.append(pair)
        worker.stop()
        return answers

    return asyncio.run(main())


def _stable_headers(headers) -> dict:
    return {k: v for k, v in headers.items() if k != "x-request-id"}


def _post(path: str, body, headers=JSON) -> tuple:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ("POST", path, content, headers)


MALFORMED = [
    b"",
    b'{"model": "tiny", "prompt": ',
    b"[1, 2]",
    b"null",
    b'"text"',
    b"\xff\xfe{}",
    b"[" * 3000 + b"]" * 3000,  # deeper than json's recursion limit? either way the same answer
    json.dumps({"model": "tiny"}).encode(),  # no prompt / messages
    json.dumps(COMPLETION | {"temperature": 5}).encode(),
    json.dumps(COMPLETION | {"max_tokens": "3"}).encode(),  # strict: a string is not a number
    json.dumps(COMPLETION | {"n": 0}).encode(),
    json.dumps(COMPLETION | {"stop": ["a"] * 5}).encode(),
    json.dumps(COMPLETION | {"prompt": [[]]}).encode(),
    json.dumps(COMPLETION | {"prompt": [1, 2], "suffix": "x"}).encode(),
    json.dumps(COMPLETION | {"model": "other"}).encode(),  # 404
    json.dumps(COMPLETION | {"max_tokens": 10_000}).encode(),  # the context check: 400
    json.dumps(COMPLETION | {"prompt": "x " * 300}).encode(),  # the prompt cannot fit
    json.dumps(COMPLETION | {"prompt": [10**9]}).encode(),  # a token id out of the vocabulary
    json.dumps(CHAT | {"messages": []}).encode(),
    json.dumps(CHAT | {"messages": [{"role": "tool", "content": "x"}]}).encode(),
    json.dumps(CHAT | {"model": "other"}).encode(),
    json.dumps(CHAT | {"tools": [{"type": "function"}]}).encode(),
    json.dumps(CHAT | {"max_completion_tokens": 10_000}).encode(),
    json.dumps(COMPLETION | {"prompt": "x" * MAX_BODY}).encode(),  # 413
]
CONTENT_TYPES = [
    {},
    {"content-type": "text/plain"},
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "application/json; charset=utf-8"},
    {"content-type": "Application/JSON"},
    {"content-type": "application/vnd.api+json"},
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_refusals_are_the_slow_paths(llm, path):
    requests = [_post(path, body) for body in MALFORMED]
    for headers in CONTENT_TYPES:
        requests.append(_post(path, COMPLETION if "chat" not in path else CHAT, headers))
    requests += [("GET", path, b"", {}), _post(path + "/", CHAT), _post(path + "x", CHAT)]
    statuses = set()
    for request, (fast, slow) in zip(requests, _exchange(llm, requests), strict=True):
        _assert_same(fast, slow, request)
        statuses.add(fast[0])
    assert statuses >= {400, 404, 405, 413}, statuses


def test_api_key_and_engine_down_are_the_slow_paths(llm):
    requests = [
        _post("/v1/completions", COMPLETION),
        _post("/v1/chat/completions", CHAT, JSON | {"authorization": "Bearer wrong"}),
    ]
    for fast, slow in _exchange(llm, requests, api_key=KEY):
        assert fast == slow and fast[0] == 401
    auth = JSON | {"authorization": f"Bearer {KEY}"}
    requests = [_post("/v1/completions", COMPLETION, auth), _post("/v1/chat/completions", CHAT)]
    for fast, slow in _exchange(llm, requests, drained=True, api_key=KEY):
        assert fast[0] in (401, 503) and fast == slow


@pytest.mark.parametrize("stream", [False, True])
def test_valid_requests_get_the_same_answer(llm, stream):
    requests = [
        _post("/v1/completions", COMPLETION | {"stream": stream}),
        _post("/v1/completions", COMPLETION | {"suffix": ")\n", "stream": stream}),
        _post("/v1/chat/completions", CHAT | {"stream": stream}),
    ]
    for request, (fast, slow) in zip(requests, _exchange(llm, requests), strict=True):
        assert fast[0] == 200
        _assert_same(fast, slow, request)


def _assert_same(fast: tuple, slow: tuple, request: tuple) -> None:
    assert fast[0] == slow[0], request
    if fast[0] != 200:
        assert fast[1] == slow[1], request
        assert fast[2] == slow[2], request
    else:  # ids, timestamps and prefix-cache hits differ from request to request
        assert _without_ids(fast[2]) == _without_ids(slow[2]), request


def _without_ids(body: bytes) -> list:
    events = body.split(b"\n\n")[:-1] if body.startswith(b"data: ") else [body]
    out = []
    for event in events:
        data = event.removeprefix(b"data: ")
        if data != b"[DONE]":
            data = json.loads(data)
            data.pop("id"), data.pop("created")
            data.get("usage", {}).pop("prompt_tokens_details", None)
        out.append(data)
    return out


def test_valid_requests_skip_fastapis_routes(llm):
    async def main(fast: bool) -> list[int]:
        worker = Worker(llm, max_queue=2)
        worker.start()
        app = create_app(llm, worker, fast_routes=fast)
        app.router.routes = [r for r in app.router.routes if not r.path.endswith("completions")]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            statuses = [
                (await client.post("/v1/completions", json=COMPLETION)).status_code,
                (await client.post("/v1/chat/completions", json=CHAT)).status_code,
                (await client.post("/v1/completions", json={"model": "tiny"})).status_code,
            ]
        worker.stop()
        return statuses

    assert asyncio.run(main(True)) == [200, 200, 404]  # an invalid body goes on to the router
    assert asyncio.run(main(False)) == [404, 404, 404]


def test_fast_requests_are_counted_under_their_route(llm):
    async def main():
        worker = Worker(llm, max_queue=2)
        worker.start()
        transport = httpx.ASGITransport(app=create_app(llm, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(
                "/v1/completions", json=COMPLETION, headers={"x-request-id": "r1"}
            )
            assert r.status_code == 200 and r.headers["x-request-id"] == "r1"
            metrics = (await client.get("/metrics")).text
        worker.stop()
        return metrics

    line = 'nanoqwen_http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0'
    assert line in asyncio.run(main()).splitlines()


# The chunk templates -------------------------------------------------------------------------
TEXTS = ["", "x", "def f(x):\n\treturn 'é' + \"\\\\\"", "\u2028\x00\x1f", "😀 \ud800"]


@pytest.mark.parametrize("chat", [False, True])
def test_chunk_templates_are_the_envelope_as_json(chat):
    reply = Reply(chat=chat, model='m "@" ["@"] \\', prompt_tokens=[3, 4])
    for index in (0, 1, 17):
        for text in TEXTS:
            assert reply.chunk(index, text) == _oracle(reply, index, text, None, False)
        for reason in ("stop", "length"):
            assert reply.chunk(index, None, reason) == _oracle(reply, index, None, reason, False)
    assert reply.chunk(0, "", role=True) == _oracle(reply, 0, "", None, True)


def _oracle(reply: Reply, index: int, text, finish_reason, role: bool) -> bytes:
    """The chunk as the envelope's dict, through `sse`."""
    if reply.chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    object_ = "chat.completion.chunk" if reply.chat else "text_completion"
    envelope = {"id": reply.id, "object": object_, "created": reply.created}
    envelope |= {"model": reply.model, "system_fingerprint": None, "choices": [choice]}
    return sse(envelope)
