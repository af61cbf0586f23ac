"""OpenAI tool calling on /v1/chat/completions, in process, over a fake LLM that writes a
scripted reply: what the request asks of the prompt (tools, the forced start, the stop at the
first call) and how the reply's calls come back, whole and streamed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

from test_server_fake import FakeBatch, FakeLLM  # noqa: E402

from nanoqwen.errors import ToolsError  # noqa: E402
from nanoqwen.llm import Delta  # noqa: E402
from nanoqwen.server import Worker, create_app  # noqa: E402
from nanoqwen.tool_calls import CLOSE, OPEN, forced_prefix  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'


class ScriptedLLM(FakeLLM):
    """Every generation writes `pieces` (one delta each), then stops ("stop"; "length" when
    max_tokens ends it first); `prepare` records its tool arguments."""

    def __init__(self, pieces: list[str], tool_support: bool = True) -> None:
        super().__init__()
        self.pieces = pieces
        self.tool_support = tool_support

    def prepare(self, prompt=None, *, messages=None, fim=None, special_tokens="parse",
                tools=None, reply_prefix="") -> list[int]:  # fmt: skip
        if tools and not self.tool_support:
            raise ToolsError("this model's chat template has no tool support")
        self._prompt = {"messages": messages, "tools": tools, "reply_prefix": reply_prefix}
        return [1, 2, 3]

    def batch(self, max_batch: int | None = None) -> FakeBatch:
        self.batches.append(ScriptedBatch(self, max_batch or 4))
        return self.batches[-1]


class ScriptedBatch(FakeBatch):
    def step(self) -> list:
        self.live = [s for s in self.live if not s.cancelled]
        out = []
        for seq in list(self.live):
            text = self.llm.pieces[seq.count]
            seq.count += 1
            if seq.count == seq.params.max_tokens:
                reason = "length"
            else:
                reason = "stop" if seq.count == len(self.llm.pieces) else None
            out.append((seq, Delta(text, (100 + seq.count,), reason)))
            if reason:
                self.live.remove(seq)
        return out


def chat(llm: ScriptedLLM, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    async def main() -> httpx.Response:
        worker = Worker(llm, max_queue=4)
        worker.start()
        transport = httpx.ASGITransport(app=create_app(llm, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(path, json={"model": "fake", **body})
        worker.stop()
        return r

    return asyncio.run(main())


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def test_reply_with_text_and_a_call_comes_back_parsed() -> None:
    llm = ScriptedLLM(["Let me check.", "\n", CALL[:20], CALL[20:]])
    r = chat(llm, {"messages": ASK, "tools": TOOLS, "max_tokens": 50})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt, params = llm.seen[0]
    assert prompt["tools"] == TOOLS and prompt["reply_prefix"] == ""
    assert CLOSE not in params.stop  # parallel calls allowed: the reply runs on


def test_calls_alone_have_null_content_and_plain_replies_no_tool_calls() -> None:
    r = chat(ScriptedLLM([CALL, "\n", CALL]), {"messages": ASK, "tools": TOOLS, "max_tokens": 9})
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 2
    assert message["tool_calls"][0]["id"] != message["tool_calls"][1]["id"]
    r = chat(ScriptedLLM(["It is ", "sunny."]), {"messages": ASK, "tools": TOOLS})
    (choice,) = r.json()["choices"]
    assert choice["message"]["content"] == "It is sunny." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_streamed_calls_arrive_whole_with_their_index() -> None:
    llm = ScriptedLLM(["Sure.", "\n" + CALL[:9], CALL[9:] + "\n", CALL])
    r = chat(llm, {"messages": ASK, "tools": TOOLS, "stream": True, "max_tokens": 50})
    chunks = events(r)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    text = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert text == "Sure."
    assert [c["index"] for c in calls] == [0, 1]
    assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_reply_cut_by_max_tokens_finishes_with_length() -> None:
    llm = ScriptedLLM([CALL[:30], CALL[30:]])
    r = chat(llm, {"messages": ASK, "tools": TOOLS, "max_tokens": 1})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == CALL[:30] and "tool_calls" not in choice["message"]


def test_tool_choice_shapes_the_prompt_and_the_stop() -> None:
    llm = ScriptedLLM([' {"city": "Paris"}}\n'])  # after the named prefix, to the stop
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 9}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(llm, {**body, "tool_choice": named})
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt, params = llm.seen[-1]
    assert prompt["reply_prefix"] == forced_prefix("get_weather") and CLOSE in params.stop

    llm = ScriptedLLM(['now", "arguments": {}}\n', CLOSE])
    r = chat(llm, {**body, "tool_choice": "required"})
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "now"
    assert llm.seen[-1][0]["reply_prefix"] == forced_prefix()

    llm = ScriptedLLM(["no calls"])
    chat(llm, {**body, "tool_choice": "none"})
    assert llm.seen[-1][0]["tools"] is None  # "none": the tools stay out of the prompt

    llm = ScriptedLLM([CALL])
    chat(llm, {**body, "parallel_tool_calls": False})
    prompt, params = llm.seen[-1]
    assert prompt["reply_prefix"] == "" and CLOSE in params.stop and params.stop[-1] == CLOSE


def test_history_with_calls_and_answers_reaches_the_template() -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22C"}]},
    ]  # fmt: skip
    llm = ScriptedLLM(["It is 22C."])
    r = chat(llm, {"messages": history, "tools": TOOLS})
    assert r.json()["choices"][0]["message"]["content"] == "It is 22C."
    messages = llm.seen[0][0]["messages"]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert messages[2] == {"role": "tool", "content": "22C"}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice", "not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
         "pattern"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "function"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "is required"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]",
         "only assistant"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "JSON text of an object"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(body, param, message) -> None:
    r = chat(ScriptedLLM(["x"]), {"messages": ASK, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_model_without_tool_support_refuses_tools_by_name() -> None:
    r = chat(ScriptedLLM(["x"], tool_support=False), {"messages": ASK, "tools": TOOLS})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools" and "no tool support" in r.text


# Ollama's /api/chat: the same parsing, Ollama's shapes -----------------------------------------


def test_ollama_chat_returns_calls_with_object_arguments() -> None:
    llm = ScriptedLLM(["Checking.", "\n" + CALL])
    r = chat(llm, {"messages": ASK, "tools": TOOLS, "stream": False}, "/api/chat")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["done"] is True and out["done_reason"] == "stop"
    assert out["message"]["content"] == "Checking."
    assert out["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert llm.seen[0][0]["tools"] == TOOLS


def test_ollama_chat_streams_a_call_in_a_chunk_and_takes_calls_in_history() -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22C", "tool_name": "get_weather"},
    ]  # fmt: skip
    llm = ScriptedLLM([CALL[:15], CALL[15:], "\nDone."])
    r = chat(llm, {"messages": history, "tools": TOOLS}, "/api/chat")
    lines = [json.loads(x) for x in r.text.splitlines()]
    calls = [c for x in lines for c in x["message"].get("tool_calls", ())]
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert "".join(x["message"]["content"] for x in lines) == "Done."
    assert lines[-1]["done"] is True
    messages = llm.seen[0][0]["messages"]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}
