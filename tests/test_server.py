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


def test_responses_api_greedy_is_the_chat_reply(client):
    # The same conversation through /v1/responses and /v1/chat/completions: the same prompt.
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_tokens=6, temperature=0,
    )  # fmt: skip
    whole = client.responses.create(
        model="tiny", instructions="Be brief.", input=CHAT[0]["content"], max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    with client.responses.stream(
        model="tiny", instructions="Be brief.", input=CHAT, max_output_tokens=6, temperature=0
    ) as stream:
        seen = list(stream)
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    streamed = seen[-1].response  # response.completed, or response.incomplete at the limit
    assert seen[-1].type == "response." + streamed.status
    text = chat.choices[0].message.content
    assert whole.output_text == streamed.output_text == "".join(deltas) == text
    assert whole.usage.input_tokens == streamed.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    finished = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert whole.status == streamed.status == finished


def test_responses_are_stored_for_the_next_turn(client):
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=3)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(
        model="tiny", input="More", previous_response_id=first.id, max_output_tokens=3
    )
    # The second prompt holds the first turn and its reply: more tokens, the first's cached.
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)


def test_n_choices_decode_together(server, client):
    # Greedy: n copies of the one reply; usage counts the prompt once, every choice's tokens.
    one = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    three = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, n=3
    )
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    # Seeded: choice j is what seed + j gives alone; the same request gives the same choices.
    def sampled(**kw) -> list[str]:
        out = client.completions.create(model="tiny", prompt="def f(", max_tokens=12,
                                        temperature=2.0, **kw)  # fmt: skip
        return [c.text for c in out.choices]

    seeded = sampled(seed=7, n=3)
    assert seeded == sampled(seed=7, n=3) == [sampled(seed=7 + j)[0] for j in range(3)]
    assert len(set(seeded)) > 1
    # Several prompts: choice p * n + j.
    out = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=3, n=2,
                                    temperature=0)  # fmt: skip
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] != texts[2] == texts[3]
    # Streamed: each choice's chunks carry its index, a role first and a finish last.
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0, n=2, stream=True
    )
    by_choice: dict[int, list] = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            by_choice[c.index].append(c)
    for chunks in by_choice.values():
        assert chunks[0].delta.role == "assistant" and chunks[-1].finish_reason is not None
        text = "".join(c.delta.content or "" for c in chunks)
        assert text == "".join(one.choices[0].message.content)[: len(text)]
    assert server.health()["running"] == 0


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
    body["stream_options"] = {"include_usage": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == usage["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4 + 1 + 3
    assert usage["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_without_usage_unless_asked(server, sse_events, path, options):
    # OpenAI's default: no usage chunk (clients reading chunk.choices[0] break on `choices: []`).
    body = {"model": "tiny", "messages": CHAT, "prompt": "a", "max_tokens": 2, "stream": True}
    if options is not None:
        body["stream_options"] = options
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all(e["choices"] and "usage" not in e for e in events[:-1])


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
    "model": [5, [], {"id": "tiny"}, True, None],  # a name not served is a 404 (below)
    "max_tokens": [-1, 0, "5", 1.5, True, [4], 10**9, 2**70, 4096, -(10**9)],
    "temperature": [-0.1, 2.01, "hot", True, [1], {}, 1e308, "0.5"],
    "top_p": [-0.5, 1.5, "x", False, [0.5], 1.0001],
    "top_k": [-1, 1.5, "x"],
    "seed": [-1, 2**63, "x", 1.5, True, [1]],
    "stop": ["", [""], ["a"] * 5, 5, [5], {"a": 1}, [None], ["a", 1]],
    "n": [129, 0, "1", -1, True, 1.0, 17],  # 17: more than the server queues (--max-queue 16)
    "stream": ["yes", 1, [True]],
    "stream_options": ["x", {"include_usage": "yes"}, [1], {"include_usage": 1}],
    "presence_penalty": [0.5, -1],
    "frequency_penalty": [1, "x"],
    "logit_bias": [{"50256": -100}, {"1": 5}, "x"],
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
        "top_logprobs": [1, 20],
        "tools": [
            [{"type": "function"}],
            [{"type": "retrieval", "function": {"name": "f"}}],
            [{"type": "function", "function": {"name": "a b"}}],
            [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
            {"type": "function", "function": {"name": "f"}},
        ],
        "tool_choice": ["any", "required", {"type": "function", "function": {"name": "f"}}],
        "parallel_tool_calls": ["no", 0],
        "functions": [[{"name": "f"}]],
        "function_call": ["auto", {"name": "f"}],
        "response_format": [{"type": "json_object"}, {"type": "json_schema"}, "text"],
        "audio": [{"voice": "alloy", "format": "wav"}],
        "modalities": [["text", "audio"], ["audio"]],
        "prediction": [{"type": "content", "content": "x"}],
        "moderation": [{"model": "omni-moderation-latest"}],
        "reasoning_effort": ["low", "high"],
        "verbosity": ["low", "high"],
        "web_search_options": [{}],
    },
    "completion": {
        "prompt": [
            "",
            5,
            {"text": "a"},
            True,
            "x" * 5000,
            [],
            [[]],
            [""],
            ["a", 1],
            [[1], "a"],
            [1.5],
            [True],
            [-1],
            [2**40],
            ["a"] * 33,
            [[1, 2], [3, -4]],
            [1] * 5000,
        ],
        "suffix": [5, ["a"], {}],
        "echo": [True, "no"],
        "best_of": [2, 0],
        "logprobs": [1, True, 0],
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
CONTENT_TYPES = [
    None,  # no header: FastAPI does not read the body as JSON
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
    headers = {"Content-Type": content_type} if content_type else {}
    r = http.post(ROUTES[route][0], content=body, headers=headers)
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
    assert r.headers["allow"] == "POST"
    r = http.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_still_serving_after_invalid_requests(server, client):
    out = client.completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert server.wait_idle()["kv_pages_in_use"] == 0


# OpenAI conformance ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-4o", "", "TINY", "tiny "])
@pytest.mark.parametrize("route", ["chat", "completion"])
def test_unknown_model_is_404(http, client, route, name):
    path, ok = ROUTES[route]
    r = http.post(path, json=ok | {"model": name})
    assert r.status_code == 404, r.text
    assert r.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=name, prompt="a", max_tokens=1)


@pytest.mark.parametrize(
    "content_type, says",
    [(None, "no Content-Type header"), ("text/plain", "Content-Type 'text/plain'")],
)
def test_content_type_problem_is_named(http, content_type, says):
    headers = {"Content-Type": content_type} if content_type else {}
    r = http.post("/v1/completions", content=json.dumps(COMPLETION_OK).encode(), headers=headers)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and says in message and "application/json" in message, message


def test_too_many_stop_strings_says_so(http):
    r = http.post("/v1/completions", json=COMPLETION_OK | {"stop": list("abcde")})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stop"
    assert error["message"] == "stop: at most 4 stop strings are supported, got 5"


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"50256": -100}),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_unsupported_field_is_named(http, field, value):
    r = http.post("/v1/chat/completions", json=CHAT_OK | {field: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field
    assert error["message"].startswith(f"{field}: not supported by this server; only ")


def test_neutral_and_metadata_fields_are_accepted(http):
    extras = {
        "user": "u-1",
        "metadata": {"team": "x"},
        "store": True,
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": [],
        "parallel_tool_calls": True,
        "logprobs": False,
        "top_logprobs": 0,
        "modalities": ["text"],
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "stream_options": {"include_usage": False, "include_obfuscation": False},
    }
    r = http.post("/v1/chat/completions", json=CHAT_OK | extras)
    assert r.status_code == 200, r.text
    extras = {"user": "u", "echo": False, "best_of": 1, "logit_bias": {}, "n": 1}
    r = http.post("/v1/completions", json=COMPLETION_OK | extras)
    assert r.status_code == 200, r.text


def _greedy(http, prompt, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0} | fields
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "prompts",
    [["def f(", "x = 1\n", "import os"], [[100, 101, 102], [65]], [[33, 34, 35]]],
    ids=["strings", "id-lists", "one-id-list"],
)
def test_several_prompts_give_one_choice_each(http, prompts):
    out = _greedy(http, prompts)
    singles = [_greedy(http, p) for p in prompts]
    assert [c["index"] for c in out["choices"]] == list(range(len(prompts)))
    assert [c["text"] for c in out["choices"]] == [s["choices"][0]["text"] for s in singles]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(s["usage"][key] for s in singles)


def test_token_id_prompt_is_the_same_as_its_text(http):
    assert (
        _greedy(http, [ord(c) for c in "def f("])["choices"] == _greedy(http, "def f(")["choices"]
    )


def test_several_prompts_stream_each_choice_in_turn(http, sse_events):
    prompts = ["def f(", "x = 1\n"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = sse_events(http.post("/v1/completions", json=body).text)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    indexes = [c["choices"][0]["index"] for c in chunks]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    for i, p in enumerate(prompts):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert (
            "".join(c["text"] for c in mine) == _greedy(http, p, max_tokens=4)["choices"][0]["text"]
        )
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8


def test_langchain_style_list_prompt_through_the_client(client):
    out = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
    assert [c.index for c in out.choices] == [0, 1]


def test_raw_fim_prompt_is_the_suffix_request(http):
    raw = "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>"
    fim = _greedy(http, "def add(a, b):\n", suffix="\n    return c")
    out = _greedy(http, raw)
    # 3 control tokens, 15 bytes, then "\n", "  ", " ", " return c" (byte-level: 12 tokens).
    assert out["usage"]["prompt_tokens"] == fim["usage"]["prompt_tokens"] == 3 + 15 + 12
    assert out["choices"] == fim["choices"]


def test_chat_contents_never_become_control_tokens(http):
    def prompt_tokens(content: str) -> int:
        body = CHAT_OK | {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]

    # Byte-level vocabulary: as text the special token costs one token per byte.
    assert prompt_tokens("<|fim_prefix|>x") == prompt_tokens("<|fim_prefiy|>x")


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-45},
        {"temperature": 1e-40},
        {"temperature": 1e-38},
        {"temperature": 1e-6},
        {"temperature": 1.0, "top_p": 1e-45},
        {"temperature": 1.0, "top_p": 1e-46},
        {"temperature": 2.0, "top_p": 1e-7},
        {"temperature": 1.0, "top_p": 0},
        {"temperature": 5e-324},
    ],
)
def test_degenerate_sampling_is_greedy(http, sampling):
    out = _greedy(http, "def f(", **sampling)
    assert out["choices"] == _greedy(http, "def f(")["choices"]


def test_suffix_goes_with_each_text_prompt(http):
    out = _greedy(http, ["def f(", "x = "], suffix="\n")
    assert [c["text"] for c in out["choices"]] == [
        _greedy(http, p, suffix="\n")["choices"][0]["text"] for p in ("def f(", "x = ")
    ]
    r = http.post("/v1/completions", json=COMPLETION_OK | {"prompt": [1, 2], "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_leaving_a_several_prompt_stream_cancels_its_job(server, http):
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 3000, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = r.iter_lines()  # kept: dropping it would close the connection now
        assert next(lines).startswith("data: ")
        assert server.health()["running"] == 1
    health = server.wait_idle(timeout=5.0)
    assert (health["running"], health["queue_depth"], health["kv_pages_in_use"]) == (0, 0, 0)
