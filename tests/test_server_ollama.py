"""Ollama's API on `nanoqwen serve`, through the `ollama` client, litellm, and raw HTTP.

One server per module (tiny synthetic model, reference backend, no API key, as Ollama has
none). The ollama client generates with a suffix (fill-in-the-middle) and chats, streamed and
not, lists, shows and reports running models, and gets Ollama's errors; litellm drives the
same server as "ollama/<id>", "ollama_chat/<id>" and "openai/<id>"; raw requests check the
NDJSON framing, the load answers, and that a stream whose client leaves is cancelled.
"""

from __future__ import annotations

import json
from datetime import datetime

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it
ollama = pytest.importorskip("ollama")

from nanoqwen.fileformat import NanoqwenFile  # noqa: E402
from nanoqwen.tokenizer import Tokenizer  # noqa: E402

CHAT = [{"role": "user", "content": "Write is_prime(n)."}]
# litellm's own types trip a pydantic warning when it builds them; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning")


@pytest.fixture(scope="module")
def server(serve, tiny_model):
    proc = serve(tiny_model)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    with NanoqwenFile(tiny_model) as f:
        return Tokenizer.from_file(f)


@pytest.fixture(scope="module")
def litellm():
    # No network: the cost map shipped in the package (read at import), no telemetry.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        module = pytest.importorskip("litellm")
        module.telemetry = False
        yield module


def ndjson(text: str) -> list[dict]:
    assert text.endswith("\n")
    return [json.loads(line) for line in text[:-1].split("\n")]


def check_final(out, prompt_tokens: int) -> None:
    assert out.done is True and out.done_reason in ("stop", "length")
    assert out.prompt_eval_count == prompt_tokens and out.eval_count >= 1
    assert out.total_duration >= out.prompt_eval_duration + out.eval_duration > 0
    assert out.load_duration == 0
    assert datetime.fromisoformat(out.created_at).tzinfo is not None


# The ollama client ---------------------------------------------------------------------------


def test_list_show_ps_version(server, client, tiny_model):
    (model,) = client.list().models
    assert model.model == "tiny:latest" and model.size == tiny_model.stat().st_size
    assert len(model.digest) == 64 and model.details.family == "qwen2"
    show = client.show("tiny")
    assert ".Suffix" in show.template and {"insert", "tools"} <= set(show.capabilities)
    assert show.modelinfo["qwen2.context_length"] == 4096 and show.parameters == "num_ctx 4096"
    assert show.details.quantization_level == "INT4"
    (running,) = client.ps().models
    assert running.name == "tiny:latest" and running.context_length == 4096
    for method in ("GET", "HEAD"):
        r = httpx.request(method, server.url + "/api/version")
        assert r.status_code == 200
    assert httpx.get(server.url + "/api/version").json()["version"].count(".") == 2


def test_generate_with_suffix_is_fim(client, tokenizer):
    prefix, suffix = "def compute_gcd(a, b):", "    return result"
    out = client.generate(
        model="tiny", prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": 5}
    )
    check_final(out, len(tokenizer.fim_prompt(prefix, suffix)))
    assert out.eval_count <= 5 and isinstance(out.response, str)


def test_generate_with_suffix_matches_openai_suffix(server, client):
    fim = {"prompt": "x = ", "suffix": "\n"}
    out = client.generate(model="tiny:latest", options={"num_predict": 1}, **fim)
    body = {"model": "tiny", "max_tokens": 1} | fim
    usage = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert out.prompt_eval_count == usage["prompt_tokens"] == 4 + 1 + 3


def test_generate_streamed_matches_whole(client):
    kw = {"model": "tiny", "prompt": "Hello", "options": {"seed": 3, "num_predict": 6}}
    whole = client.generate(**kw)
    parts = list(client.generate(stream=True, **kw))
    *chunks, final = parts
    assert all(c.done is False and c.response for c in chunks)
    assert "".join(c.response for c in chunks) == whole.response
    assert final.response == "" and final.eval_count == whole.eval_count
    check_final(final, whole.prompt_eval_count)


def test_generate_raw_and_system(client, tokenizer):
    raw = client.generate(model="tiny", prompt="abc", raw=True, options={"num_predict": 1})
    assert raw.prompt_eval_count == 3
    plain = client.generate(model="tiny", prompt="abc", options={"num_predict": 1})
    system = client.generate(
        model="tiny", prompt="abc", system="Be brief.", options={"num_predict": 1}
    )
    user = [{"role": "user", "content": "abc"}]
    assert plain.prompt_eval_count == len(tokenizer.encode_chat(user))
    sys_user = [{"role": "system", "content": "Be brief."}, *user]
    assert system.prompt_eval_count == len(tokenizer.encode_chat(sys_user))


def test_chat_and_chat_stream(client, tokenizer):
    options = {"num_predict": 4, "seed": 11, "stop": ["\x00"]}
    whole = client.chat(model="tiny", messages=CHAT, options=options)
    assert whole.message.role == "assistant" and isinstance(whole.message.content, str)
    check_final(whole, len(tokenizer.encode_chat(CHAT)))
    parts = list(client.chat(model="tiny", messages=CHAT, options=options, stream=True))
    assert parts[-1].done is True and all(p.done is False for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_unknown_model_is_a_404(client):
    for call in (
        lambda: client.generate(model="llama3.2", prompt="x"),
        lambda: client.chat(model="tiny:7b", messages=CHAT),
        lambda: client.show("qwen2.5-coder"),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404 and "not found" in info.value.error


@pytest.mark.parametrize(
    "extra,word",
    [
        ({"format": "json"}, "format"),
        ({"format": {"type": "object"}}, "format"),
        ({"think": True}, "think"),
        ({"images": ["aGk="]}, "images"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2]}, "context"),
        ({"raw": True, "system": "s"}, "raw"),
        ({"suffix": "x", "system": "s"}, "system"),
        ({"options": {"min_p": 0.1}}, "min_p"),
        ({"options": {"repeat_penalty": 1.1}}, "repeat_penalty"),
        ({"options": {"temperature": "hot"}}, "temperature"),
        ({"options": {"num_predict": 5000}}, "context"),
    ],
)
def test_refused_generate_fields_are_400(server, extra, word):
    r = httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": "p"} | extra)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert word in r.json()["error"]


def test_refused_chat_fields_are_400(client):
    tool = {"type": "function", "function": {"name": "no spaces", "parameters": {"type": "object"}}}
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="tiny", messages=CHAT, tools=[tool])
    assert info.value.status_code == 400 and "tools" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert info.value.status_code == 400 and "role" in info.value.error


def test_hints_are_accepted(client):
    options = {"num_ctx": 2048, "num_thread": 4, "use_mmap": True, "num_predict": 1}
    options |= {"min_p": 0.0, "repeat_penalty": 1.0, "some_future_option": 1}
    out = client.generate(model="tiny", prompt="x", options=options, keep_alive="30m")
    assert out.done is True


# Raw HTTP ------------------------------------------------------------------------------------


def test_ndjson_stream_framing(server):
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 3}}
    r = httpx.post(server.url + "/api/generate", json=body, timeout=60)  # stream: default true
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    *chunks, final = ndjson(r.text)
    assert all(set(c) == {"model", "created_at", "response", "done"} for c in chunks)
    assert final["done"] is True and final["done_reason"] == "length"
    assert final["eval_count"] == 3 and final["model"] == "tiny"
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int)


def test_curl_form_content_type_is_read_as_json(server):
    """Ollama's documented `curl -d '{...}'` sends application/x-www-form-urlencoded."""
    body = json.dumps(
        {"model": "tiny", "prompt": "x", "stream": False, "options": {"num_predict": 1}}
    )
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(server.url + "/api/generate", content=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["done"] is True


def test_load_requests_answer_at_once(server):
    r = httpx.post(server.url + "/api/generate", json={"model": "tiny"})
    assert r.json()["done_reason"] == "load" and r.json()["response"] == ""
    r = httpx.post(
        server.url + "/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0}
    )
    assert r.json()["done_reason"] == "load" and r.json()["message"]["content"] == ""


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"model": 5}', b'{"prompt": "x"}'])
def test_malformed_bodies_are_400(server, raw):
    r = httpx.post(server.url + "/api/generate", content=raw)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_stream_cancelled_when_the_client_goes(server):
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 3000}}
    with httpx.stream("POST", server.url + "/api/chat", json=body | {"messages": CHAT}) as r:
        assert json.loads(next(r.iter_lines()))["done"] is False
    health = server.wait_idle(timeout=10)
    assert (health["running"], health["kv_pages_in_use"]) == (0, 0), health


# litellm -------------------------------------------------------------------------------------


def test_litellm_ollama_and_openai(server, litellm):
    messages = [{"role": "user", "content": "hi"}]
    for model, base in [
        ("ollama/tiny", server.url),
        ("ollama_chat/tiny", server.url),
        ("openai/tiny", server.url + "/v1"),
    ]:
        out = litellm.completion(
            model=model, api_base=base, api_key="none", messages=messages, max_tokens=3
        )
        assert isinstance(out.choices[0].message.content, str), model
        assert 1 <= out.usage.completion_tokens <= 3 and out.usage.prompt_tokens > 0, model
    chunks = list(
        litellm.completion(
            model="ollama_chat/tiny",
            api_base=server.url,
            messages=messages,
            max_tokens=3,
            stream=True,
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(litellm.NotFoundError):
        litellm.completion(model="ollama/llama3", api_base=server.url, messages=messages)
