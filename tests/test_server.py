"""`nanoqwen serve` as a real process on the tiny synthetic model (reference backend, CPU).

One server per module, with an API key: the official `openai` client and raw HTTP (httpx) get
well-formed chat, completion and fill-in-the-middle responses, streamed and not, with usage;
the key is enforced everywhere but /health; ~200 invalid requests, generated field by field,
each get a 400 with an OpenAI error object, and the server serves a valid request afterwards.
The tiny model's texts mean nothing (random weights, byte-level vocabulary): these tests check
the protocol, token counts and sampling controls (seed, stop), not content.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it
openai = pytest.importorskip("openai")

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Write is_prime(n)."}]


@pytest.fixture(scope="module")
def server(serve, tiny_model):
    proc = serve(tiny_model, "--api-key", KEY)
    yield proc
    # SIGTERM drains the server and closes the engine; the process exits 0.
    assert proc.stop() == 0, proc.log.read_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


# Well-formed requests --------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "nanoqwen"
    health = server.health()
    assert health["engine_alive"] is True and health["backend"] == "reference"
    assert (health["running"], health["queue_depth"], health["kv_pages_in_use"]) == (0, 0, 0)


def test_chat_completion(client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, seed=1)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == "tiny" and abs(out.created - time.time()) < 60
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = out.usage
    assert usage.prompt_tokens > 5 and 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_completion_tokens=5,
        temperature=0.7,
        top_p=0.9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 5


def test_completion_and_fim(client):
    plain = client.completions.create(model="tiny", prompt="def f(", max_tokens=4, stop="\n")
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    assert plain.usage.prompt_tokens == len(b"def f(")
    assert plain.choices[0].finish_reason in ("stop", "length")
    fim = client.completions.create(model="tiny", prompt="def f(", suffix="):", max_tokens=4)
    # Byte-level tokenizer: <|fim_prefix|> 6 bytes <|fim_suffix|> 2 bytes <|fim_middle|>.
    assert fim.usage.prompt_tokens == 6 + 2 + 3
    assert isinstance(fim.choices[0].text, str)


def test_completion_stream_raw_sse(server, sse_events):
    body = {"model": "tiny", "prompt": "x = ", "suffix": "\n", "max_tokens": 3, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == usage["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4 + 1 + 3
    assert usage["usage"]["completion_tokens"] >= 1


def test_stream_without_usage_when_declined(server, sse_events):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": False}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])


def test_seed_and_stop_are_honoured(client):
    def text(**kw) -> tuple[str, str]:
        out = client.completions.create(model="tiny", prompt="def f():", max_tokens=8, **kw)
        return out.choices[0].text, out.choices[0].finish_reason

    seeded = text(temperature=1.0, seed=1234)
    assert text(temperature=1.0, seed=1234) == seeded
    greedy, finish = text(temperature=0.0)
    assert finish == "length" and len(greedy) >= 4, "the tiny model should print its ids"
    stop = greedy[len(greedy) // 2 :][:2]
    cut, finish = text(temperature=0.0, stop=["\x00", stop])
    assert (cut, finish) == (greedy[: greedy.index(stop)], "stop")


def test_nulls_mean_defaults(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": None, "stop": None}
    body |= {"n": None, "seed": None, "stream": None, "user": "someone"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


# API key ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Basic {KEY}"},
    ],
    ids=["missing", "wrong", "no-scheme", "longer", "basic"],
)
@pytest.mark.parametrize(
    "method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/nowhere")]
)
def test_api_key_required(server, headers, method, path):
    r = httpx.request(method, server.url + path, headers=headers, content=b"{", timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_health_needs_no_key_and_wrong_key_fails_in_client(server):
    assert httpx.get(server.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# Invalid requests ------------------------------------------------------------------------------

CHAT_OK = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
COMPLETION_OK = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
ROUTES = {
    "chat": ("/v1/chat/completions", CHAT_OK),
    "completion": ("/v1/completions", COMPLETION_OK),
}
MSG = {"role": "user", "content": "x"}

# field -> wrong values, for both endpoints
SHARED_WRONG = {
    "model": ["gpt-4o", "", 5, [], {"id": "tiny"}, True, "TINY", None],
    "max_tokens": [-1, 0, "5", 1.5, True, [4], 10**9, 2**70, 4096, -(10**9)],
    "temperature": [-0.1, 2.01, "hot", True, [1], {}, 1e308, "0.5"],
    "top_p": [-0.5, 1.5, "x", False, [0.5], 1.0001],
    "top_k": [-1, 1.5, "x"],
    "seed": [-1, 2**63, "x", 1.5, True, [1]],
    "stop": ["", [""], ["a"] * 5, 5, [5], {"a": 1}, [None], ["a", 1]],
    "n": [2, 0, "1", -1],
    "stream": ["yes", 1, [True]],
    "stream_options": ["x", {"include_usage": "yes"}, [1], {"include_usage": 1}],
    "presence_penalty": [0.5, -1],
    "frequency_penalty": [1, "x"],
}
ROUTE_WRONG = {
    "chat": {
        "messages": [
            [],
            "hi",
            [{}],
            [{"role": "user"}],
            [{"content": "x"}],
            [{"role": "robot", "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            ["hi"],
            [None],
            [MSG, 7],
            {"role": "user", "content": "x"},
        ],
        "max_completion_tokens": [-1, 0, "x", 10**9],
        "logprobs": [True, "yes"],
        "tools": [[{"type": "function", "function": {"name": "f"}}]],
    },
    "completion": {
        "prompt": ["", 5, ["a", "b"], [1, 2], {"text": "a"}, True, "x" * 5000],
        "suffix": [5, ["a"], {}],
        "echo": [True, "no"],
        "best_of": [2, 0],
        "logprobs": [1, True],
    },
}
REQUIRED = {"chat": ["model", "messages"], "completion": ["model", "prompt"]}
MALFORMED_BODIES = [
    b"",
    b"{",
    b'{"model": "tiny",}',
    b"nul",
    b"[1, 2]",
    b'"a string"',
    b"42",
    b'{"model": "tiny"',
    b"\xff\xfe{}",
    b'{"model": "tiny", "prompt": "a", "messages": [], "temperature": NaN}',
]
# A body without a Content-Type is read as JSON (FastAPI's rule), so it is not among these.
CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "application/octet-stream",
]


def invalid_cases() -> list:
    """(route, field, body bytes, content type) for every kind of wrongness."""
    cases = []
    for route, (_, ok) in ROUTES.items():
        wrong = SHARED_WRONG | ROUTE_WRONG[route]
        for field, values in wrong.items():
            for i, value in enumerate(values):
                body = json.dumps(ok | {field: value}).encode()
                cases.append(
                    pytest.param(route, field, body, "application/json", id=f"{route}-{field}-{i}")
                )
        for field in REQUIRED[route]:
            body = json.dumps({k: v for k, v in ok.items() if k != field}).encode()
            cases.append(
                pytest.param(route, field, body, "application/json", id=f"{route}-no-{field}")
            )
        for i, body in enumerate(MALFORMED_BODIES):
            cases.append(
                pytest.param(route, None, body, "application/json", id=f"{route}-malformed-{i}")
            )
        for kind in CONTENT_TYPES:
            body = json.dumps(ok).encode()
            cases.append(pytest.param(route, None, body, kind, id=f"{route}-content-type-{kind}"))
        overflow = ok | {"max_tokens": 4000}
        if route == "chat":
            overflow["messages"] = [{"role": "user", "content": "y" * 100}]
        else:
            overflow["prompt"] = "y" * 100
        body = json.dumps(overflow).encode()
        cases.append(
            pytest.param(route, "max_tokens", body, "application/json", id=f"{route}-overflow")
        )
    return cases


CASES = invalid_cases()


def test_there_are_about_200_invalid_cases():
    assert len(CASES) >= 190


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.mark.parametrize("route,field,body,content_type", CASES)
def test_invalid_request_gets_400(http, route, field, body, content_type):
    r = http.post(ROUTES[route][0], content=body, headers={"Content-Type": content_type})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if field is not None:
        assert (error["param"] or "").split("[")[0].split(".")[0] == field, error


def test_context_overflow_message_names_both_numbers(http):
    r = http.post("/v1/completions", json=COMPLETION_OK | {"prompt": "abc", "max_tokens": 4094})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert (
        "3 tokens" in error["message"] and "4094" in error["message"] and "4096" in error["message"]
    )


def test_not_found_and_wrong_method_are_error_objects(http):
    r = http.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = http.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_still_serving_after_invalid_requests(server, client):
    out = client.completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert server.wait_idle()["kv_pages_in_use"] == 0
