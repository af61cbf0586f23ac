"""OpenAI's Responses API (/v1/responses), in process, over a fake LLM that writes a scripted
reply: the conversation the input items make, the output items the reply makes (whole and as
the stream events the official client's accumulator checks), and the 400s of what it cannot
do."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it
openai = pytest.importorskip("openai")

from test_server_fake import FakeLLM  # noqa: E402
from test_server_tools import CALL, ScriptedLLM  # noqa: E402

from nanoqwen.server import Worker, create_app  # noqa: E402
from nanoqwen.server.responses import Conversation, ResponseStore  # noqa: E402
from nanoqwen.tool_calls import CLOSE, forced_prefix  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"type": "function", "name": "now"},
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


async def _serve(llm, use):
    worker = Worker(llm, max_queue=4)
    worker.start()
    transport = httpx.ASGITransport(app=create_app(llm, worker))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await use(http)
    finally:
        worker.stop()


def post(llm, body: dict) -> httpx.Response:
    body = {"model": "fake", **body}
    return asyncio.run(_serve(llm, lambda http: http.post("/v1/responses", json=body)))


def sdk(llm, use):
    """`use(client)` with the official async client over the in-process app."""

    async def run(http):
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        return await use(client)

    return asyncio.run(_serve(llm, run))


def events(r: httpx.Response) -> list[dict]:
    """The stream's events; each `event:` line names its data's type."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == "event: " + event["type"]
            out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_text_reply_whole_and_streamed_through_the_client() -> None:
    pieces = ["def add(a, b):", "\n    return a + b", "\n"]

    async def both(client):
        whole = await client.responses.create(model="fake", input="add?", max_output_tokens=9)
        async with client.responses.stream(model="fake", input="add?") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        return whole, deltas, final

    whole, deltas, final = sdk(ScriptedLLM(pieces), both)
    assert whole.status == final.status == "completed" and whole.object == "response"
    assert whole.output_text == final.output_text == "".join(pieces) == "".join(deltas)
    (item,) = final.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and final.id.startswith("resp_")
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3, 3, 6)
    assert usage.input_tokens_details.cached_tokens == 0
    assert whole.max_output_tokens == 9 and whole.store is True


def test_text_and_calls_become_items_in_order() -> None:
    llm = ScriptedLLM(["Let me check.", "\n", CALL[:20], CALL[20:], "\n", CALL])

    async def stream(client):
        async with client.responses.stream(model="fake", input="Paris?", tools=TOOLS) as s:
            return await s.get_final_response()

    for response in (post(llm, {"input": "Paris?", "tools": TOOLS}).json(), sdk(llm, stream)):
        if not isinstance(response, dict):
            response = response.model_dump()
        message, *calls = response["output"]
        assert response["status"] == "completed"
        assert message["content"][0]["text"] == "Let me check."
        assert [c["type"] for c in calls] == ["function_call", "function_call"]
        assert calls[0]["call_id"] != calls[1]["call_id"]
        for call in calls:
            assert call["name"] == "get_weather" and call["status"] == "completed"
            assert json.loads(call["arguments"]) == {"city": "Paris"}
    prompt, params = llm.seen[0]
    assert prompt["tools"] == CHAT_TOOLS and prompt["reply_prefix"] == "" and params.stop == ()


def test_stream_events_of_a_call() -> None:
    r = post(ScriptedLLM(["Sure.", CALL]), {"input": "x", "tools": TOOLS, "stream": True})
    seen = events(r)
    assert [e["type"] for e in seen] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = seen[-2]["item"]
    assert seen[8]["item"]["arguments"] == "" and seen[9]["delta"] == call["arguments"]
    assert seen[10]["name"] == "get_weather" and seen[-1]["response"]["output"][1] == call
    assert seen[0]["response"]["status"] == "in_progress" and seen[0]["response"]["usage"] is None
    assert "[DONE]" not in r.text


def test_max_output_tokens_makes_an_incomplete_response() -> None:
    llm = ScriptedLLM(["a", "b", "c", "d"])
    body = post(llm, {"input": "x", "max_output_tokens": 2}).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "ab"
    seen = events(post(llm, {"input": "x", "max_output_tokens": 2, "stream": True}))
    assert seen[-1]["type"] == "response.incomplete" and seen[-1]["response"]["usage"]
    assert seen[-2]["item"]["status"] == "incomplete"


def test_input_items_become_the_chat_messages() -> None:
    llm = ScriptedLLM(["ok"])
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Paris "},
                {"type": "input_text", "text": "weather?"},
            ],
        },  # fmt: skip
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },  # fmt: skip
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "id": "fc_1",
            "status": "completed",
        },  # fmt: skip
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "noon"}],
        },  # fmt: skip
    ]
    r = post(llm, {"input": items, "instructions": "You are a helper.", "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert llm.seen[0][0]["messages"] == [
        {"role": "system", "content": "You are a helper."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Paris"}},
                {"name": "now", "arguments": {}},
            ],
        },  # fmt: skip
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "noon"},
    ]
    post(llm, {"input": [items[3], items[5]]})  # a call with no text before it
    assert llm.seen[1][0]["messages"][0] == {"role": "assistant", "content": "", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]}  # fmt: skip
    post(llm, {"input": "Hi", "tools": TOOLS, "tool_choice": "none"})
    assert llm.seen[2][0] == {"messages": [{"role": "user", "content": "Hi"}], "tools": None,
                              "reply_prefix": ""}  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "parallel", "prefix", "single"),
    [
        ("required", True, forced_prefix(), False),
        ("required", False, forced_prefix(), True),
        ({"type": "function", "name": "now"}, True, forced_prefix("now"), True),
        ("auto", False, "", True),
    ],
)
def test_tool_choice_forces_and_bounds_the_calls(choice, parallel, prefix, single) -> None:
    llm = ScriptedLLM(['"now", "arguments": {}}\n' + CLOSE])
    body = {"input": "x", "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    r = post(llm, body)
    assert r.status_code == 200, r.text
    prompt, params = llm.seen[0]
    assert prompt["reply_prefix"] == prefix and (CLOSE in params.stop) == single
    assert r.json()["tool_choice"] == choice and r.json()["parallel_tool_calls"] == parallel


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "at least 1"),
        ({"input": 3}, "input", "a string or a list of input items"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "function_call_output"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item references"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "input_text",
        ),  # fmt: skip
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "developer"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input",
            "call_id 'c9'",
        ),  # fmt: skip
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            "object",
        ),  # fmt: skip
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "'none'"),
        ({"text": {"format": {"type": "json_object"}}}, "text", "not supported"),
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "log-probabilities"),
        ({"tools": [{"type": "custom", "name": "patch"}]}, "tools[0]", "custom tools are not"),
        (
            {"tools": [*TOOLS, {"type": "namespace", "name": "n", "tools": TOOLS[1:]}]},
            "tools",
            "function now is defined twice",
        ),  # fmt: skip
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}},
            "tool_choice",
            "not among the tools",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "5000"),
        ({"temperature": "hot"}, "temperature", "valid number"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_the_field(body, param, says) -> None:
    r = post(FakeLLM(), {"input": "x"} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_bad_bodies_and_models() -> None:
    async def send(http):
        return [
            await http.post("/v1/responses", content=b"{nope"),
            await http.post("/v1/responses", json=[1]),
            await http.post("/v1/responses", json={"model": "other", "input": "x"}),
        ]

    not_json, not_object, wrong_model = asyncio.run(_serve(FakeLLM(), send))
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]
    assert wrong_model.status_code == 404
    assert wrong_model.json()["error"]["code"] == "model_not_found"


def test_engine_failure_before_and_after_the_first_event() -> None:
    r = post(FakeLLM(fail_at=0), {"input": "x", "max_output_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["code"] == "device_error"
    seen = events(post(FakeLLM(fail_at=2), {"input": "x", "max_output_tokens": 5, "stream": True}))
    assert seen[-1]["type"] == "response.failed"
    failed = seen[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "device_error"
    assert "cudaErrorIllegalAddress" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "xx"  # what came before the failure


def test_namespaces_are_functions_and_built_in_tools_are_left_out() -> None:
    # What Codex CLI sends: functions, a namespace of them, and web_search.
    agents = {"type": "namespace", "name": "agents", "description": "Sub-agents",
              "tools": [{"type": "function", "name": "spawn", "strict": False,
                         "parameters": {"type": "object"}, "defer_loading": True}]}  # fmt: skip
    search = {"type": "web_search", "external_web_access": False}
    spawn = CALL.replace("get_weather", "spawn")
    llm = ScriptedLLM([spawn, "\n", CALL])
    body = {"input": "x", "tools": [TOOLS[0], agents, search], "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "client_metadata": {"k": "v"}}  # fmt: skip
    r = post(llm, body)
    assert r.status_code == 200, r.text
    names = [t["function"]["name"] for t in llm.seen[0][0]["tools"]]
    assert names == ["get_weather", "spawn"]
    first, second = r.json()["output"]
    assert (first["name"], first["namespace"]) == ("spawn", "agents")
    assert second["name"] == "get_weather" and "namespace" not in second
    assert [t["type"] for t in r.json()["tools"]] == ["function", "namespace", "web_search"]
    assert r.json()["tools"][2] == search
    choice = {"type": "function", "name": "spawn"}
    r = post(ScriptedLLM([" {}}"]), body | {"tool_choice": choice})
    assert r.json()["output"][0]["namespace"] == "agents"


def test_previous_response_id_continues_a_stored_conversation() -> None:
    llm = ScriptedLLM(["Checking.", CALL])

    async def talk(http):
        async def send(body):
            r = await http.post("/v1/responses", json={"model": "fake", "tools": TOOLS} | body)
            assert r.status_code == 200, r.text
            return r.json()

        first = await send({"input": "Paris?", "instructions": "Be brief."})
        call = first["output"][1]
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        second = await send({"input": [answer], "previous_response_id": first["id"],
                             "instructions": "Answer in French."})  # fmt: skip
        third = await send({"input": "And Rome?", "previous_response_id": second["id"],
                            "store": False})  # fmt: skip
        got = await http.get(f"/v1/responses/{second['id']}")
        gone = [await http.get(f"/v1/responses/{third['id']}")]
        deleted = await http.delete(f"/v1/responses/{first['id']}")
        gone += [
            await http.get(f"/v1/responses/{first['id']}"),
            await http.delete(f"/v1/responses/{first['id']}"),
            await http.post(
                "/v1/responses",
                json={"model": "fake", "input": "x", "previous_response_id": third["id"]},
            ),
        ]
        return first, second, got, deleted, gone  # fmt: skip

    first, second, got, deleted, gone = asyncio.run(_serve(llm, talk))
    assistant = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    }
    assert [p["messages"] for p, _ in llm.seen] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
        # Instructions are each request's own; the stored turn and its call come before.
        [{"role": "system", "content": "Answer in French."},
         {"role": "user", "content": "Paris?"}, assistant, {"role": "tool", "content": "sunny"}],
        [{"role": "user", "content": "Paris?"}, assistant, {"role": "tool", "content": "sunny"},
         assistant, {"role": "user", "content": "And Rome?"}],
    ]  # fmt: skip
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    assert got.status_code == 200 and got.json() == second
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert [r.status_code for r in gone] == [404, 404, 404, 400]
    assert gone[3].json()["error"]["code"] == "previous_response_not_found"


def test_the_store_drops_the_least_recently_used_past_its_budget() -> None:
    def response(n: int) -> dict:
        return {"id": f"resp_{n}", "output": "x" * 100}

    talk = Conversation(({"role": "user", "content": "hi"},), frozenset())
    items = ({"id": "msg_1", "type": "message"},)
    size = sum(len(json.dumps(part)) for part in (response(0), talk.messages, items))
    store = ResponseStore(max_chars=3 * size)  # three entries' shares
    for n in range(3):
        store.put(response(n), talk, items)
    assert store.get("resp_0").response == response(0)  # now the most recently used
    store.put(response(3), talk, items)  # a fourth: the least recently used (resp_1) goes
    assert [store.get(f"resp_{n}") is not None for n in range(4)] == [True, False, True, True]
    assert store.delete("resp_3") and not store.delete("resp_3")


def test_input_items_are_listed_in_pages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "noon"}]}  # fmt: skip
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "It is noon."}]}
    asked = {"id": "msg_a", "role": "developer", "content": "Time?"}
    body = {"model": "fake", "tools": TOOLS, "input": [asked, call, answer, said]}

    async def use(client):
        first = await client.responses.create(**body)
        whole = await client.responses.input_items.list(first.id, order="asc")
        # The official client pages with `after` = each page's last id, newest first.
        paged = [item.id async for item in client.responses.input_items.list(first.id, limit=1)]
        again = await client.responses.input_items.list(first.id, order="asc")
        untold = await client.responses.create(**body | {"store": False})
        http = client._client
        get = [
            await http.get(f"http://t/v1/responses/{first.id}/input_items", params=q)
            for q in ({"limit": 3}, {"limit": 2, "after": whole.data[1].id, "order": "asc"},
                      {"limit": 0}, {"limit": 101}, {"limit": "x"}, {"order": "up"},
                      {"after": "msg_nope"})
        ]  # fmt: skip
        get.append(await http.get(f"http://t/v1/responses/{untold.id}/input_items"))
        return whole, paged, again, get

    whole, paged, again, get = sdk(ScriptedLLM(["Done."]), use)
    listed = [item.model_dump(exclude_none=True) for item in whole.data]
    fc, fco, msg = (item["id"] for item in listed[1:])
    assert listed == [
        {"id": "msg_a", "type": "message", "role": "developer", "status": "completed",
         "content": [{"type": "input_text", "text": "Time?"}]},
        {"id": fc, "type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}",
         "status": "completed"},
        {"id": fco, "type": "function_call_output", "call_id": "c1", "output": "noon",
         "status": "completed"},
        {"id": msg, "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "It is noon.", "annotations": []}]},
    ]  # fmt: skip
    assert fc.startswith("fc_") and fco.startswith("fco_") and msg.startswith("msg_")
    assert whole.first_id == "msg_a" and whole.last_id == msg and not whole.has_more
    assert paged == [msg, fco, fc, "msg_a"]  # ids made once, when the response was stored
    assert [item.id for item in again.data] == [item["id"] for item in listed]
    page = get[0].json()
    assert [i["id"] for i in page["data"]] == [msg, fco, fc] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (msg, fc)
    page = get[1].json()
    assert [i["id"] for i in page["data"]] == [fco, msg] and page["has_more"] is False
    bad = [r.json()["error"]["param"] for r in get[2:7]]
    assert [r.status_code for r in get[2:7]] == [400] * 5
    assert bad == ["limit", "limit", "limit", "order", "after"]
    assert get[7].status_code == 404  # store false: nothing kept
