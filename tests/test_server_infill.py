"""llama.cpp's /infill (and /props) on `nanoqwen serve`, as llama.vim and llama.vscode use them.

One server per module (tiny synthetic model, reference backend, an API key as both editors can
send one). Requests are shaped exactly as the editors send them (llama.vim: curl with
`Content-Type: application/json` and a compact json_encode body; llama.vscode: axios), and the
checks read what they read: llama.vim's quick `"content":"` test on the raw body and its
flattened `response_fields` keys, llama.vscode's array for n_cmpl > 1. The prompt is checked
against `Tokenizer.fim_prompt` and against the repo-level layout written out by hand here.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

from nanoqwen.fileformat import NanoqwenFile  # noqa: E402
from nanoqwen.server.llamacpp import InfillRequest, InfillStops, infill_prompt, select  # noqa: E402
from nanoqwen.tokenizer import Tokenizer  # noqa: E402

KEY = "sk-infill-test"
VIM_FIELDS = [
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


@pytest.fixture(scope="module")
def server(serve, tiny_model):
    proc = serve(tiny_model, "--api-key", KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    with NanoqwenFile(tiny_model) as f:
        return Tokenizer.from_file(f)


def vim_post(server, body: dict, timeout: float = 60) -> httpx.Response:
    """As llama.vim sends it: curl --request POST --header 'Content-Type: application/json'
    --header 'Authorization: Bearer KEY' --data @- (Vim's json_encode is compact)."""
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {KEY}",
        "User-Agent": "curl/8.5.0",
        "Accept": "*/*",
    }
    data = json.dumps(body, separators=(",", ":"))
    return httpx.post(server.url + "/infill", content=data, headers=headers, timeout=timeout)


def vim_fim(prefix: str, middle: str, suffix: str, extra=(), **over) -> dict:
    """llama.vim's FIM request (autoload/llama.vim, llama#fim), n_predict lowered for the CPU."""
    body = {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": list(extra),
        "prompt": middle,
        "n_predict": 6,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 250,
        "response_fields": VIM_FIELDS,
        "model": "",  # llama.vim always sends model_fim, "" unless configured
    }
    return body | over


def vscode_post(server, body: dict) -> httpx.Response:
    headers = {
        "Accept": "application/json, text/plain, */*",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {KEY}",
        "User-Agent": "axios/1.8.4",
    }
    return httpx.post(server.url + "/infill", json=body, headers=headers, timeout=60)


def vscode_fim(prefix: str, suffix: str, prompt: str, chunks: list, n_predict=5) -> dict:
    """llama.vscode's createRequestPayload(false, ...) with its defaults (n_cmpl 3)."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": chunks,
        "prompt": prompt,
        "n_predict": n_predict,
        "n_cmpl": 3,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "n_indent": 4,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 500,
    }


def sse_events(text: str) -> list[dict]:
    """llama.cpp's stream: `data: {json}` events, and no [DONE]."""
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b[len("data: ") :]) for b in blocks]


# llama.vim -------------------------------------------------------------------------------------


def test_llama_vim_fim_request(server, tokenizer):
    prefix, middle, suffix = "def area(r):\n", "    return ", "\n\nprint(area(2))\n"
    chunk = {"text": "import math\n", "time": 1730000000.0, "filename": "geometry.py"}
    r = vim_post(server, vim_fim(prefix, middle, suffix, [chunk]))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    # llama.vim's quick checks on the raw body before it decodes it.
    assert re.match(r"^\s*{", r.text) and re.search(r'"content"\s*:"', r.text)
    out = r.json()
    assert set(out) == set(VIM_FIELDS), "response_fields flattens to the named paths"
    assert isinstance(out["content"], str) and out["truncated"] is False
    assert out["tokens_cached"] == 0
    assert 1 <= out["timings/predicted_n"] <= 6
    assert out["timings/prompt_ms"] > 0 and out["timings/predicted_per_second"] >= 0
    expected = (
        tokenizer.repo_name("myproject")
        + tokenizer.repo_file("geometry.py", "import math\n")
        + tokenizer.repo_file("filename")
        + tokenizer.fim_prompt(prefix + middle, suffix)
    )
    assert out["timings/prompt_n"] == len(expected)


def test_llama_vim_warmup_request_does_no_generation(server):
    """The ring-buffer update: n_predict 0, response_fields [""] (llama.cpp answers {})."""
    chunk = {"text": "x = 1\n" * 20, "time": 1730000000.0, "filename": "a.py"}
    body = {
        "id_slot": 0,
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": [chunk],
        "prompt": "",
        "n_predict": 0,
        "temperature": 0.0,
        "samplers": [],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 1,
        "t_max_predict_ms": 1,
        "response_fields": [""],
        "model": "",
    }
    r = vim_post(server, body)
    assert r.status_code == 200 and r.json() == {}
    health = server.wait_idle()
    assert health["running"] == 0 and health["kv_pages_in_use"] == 0


# llama.vscode ----------------------------------------------------------------------------------


def test_llama_vscode_fim_request_with_three_completions(server):
    chunks = [{"text": "def helper():\n    pass\n", "time": 1730000000000, "filename": "/w/u.py"}]
    r = vscode_post(server, vscode_fim("class A:\n", "\n", "    def ", chunks))
    assert r.status_code == 200
    results = r.json()
    assert isinstance(results, list) and [x["index"] for x in results] == [0, 1, 2]
    for x in results:
        assert isinstance(x["content"], str) and x["stop"] is True and x["model"] == "tiny"
        assert 1 <= x["tokens_predicted"] <= 5 and x["stop_type"] in ("eos", "word", "limit")
        assert x["timings"]["predicted_n"] == x["tokens_predicted"]
        assert x["generation_settings"]["samplers"] == ["top_k", "top_p"]
        assert x["generation_settings"]["temperature"] == 1.0, "no temperature sampler: T = 1"


def test_seeded_completions_are_those_of_successive_seeds(server):
    # n_cmpl's completions are decoded together; seeded, completion j is what seed + j gives.
    body = vim_fim("x = ", "", "\n", n_predict=8, temperature=2.0, top_k=0, top_p=1.0,
                   samplers=["temperature"], n_indent=0, t_max_predict_ms=0)  # fmt: skip
    together = [x["content"] for x in vim_post(server, body | {"n_cmpl": 3, "seed": 11}).json()]
    alone = [vim_post(server, body | {"seed": 11 + j}).json()["content"] for j in range(3)]
    assert together == alone and len(set(alone)) > 1


def test_llama_vscode_prepare_request(server, tokenizer):
    """updateExtraContext: createRequestPayload(true, "", "", chunks, "", ...)."""
    chunks = [{"text": f"v{i} = {i}\n", "time": i, "filename": f"/w/m{i}.py"} for i in range(3)]
    body = {
        "id_slot": 0,
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": chunks,
        "prompt": "",
        "n_predict": 0,
        "samplers": [],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1,
    }
    out = vscode_post(server, body).json()
    assert out["content"] == "" and out["tokens_predicted"] == 0 and out["stop_type"] == "limit"
    files = "".join(f"<|file_sep|>/w/m{i}.py\nv{i} = {i}\n" for i in range(3))
    prompt = f"<|repo_name|>myproject\n{files}<|file_sep|>filename\n"
    prompt += "<|fim_prefix|><|fim_suffix|><|fim_middle|>"
    assert out["prompt"] == prompt
    assert out["tokens_evaluated"] == len(tokenizer.encode(prompt, allow_special=True))


def test_health_and_props_as_llama_vscode_reads_them(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    props = httpx.get(server.url + "/props", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert props["total_slots"] == 1 and props["model_alias"] == "tiny"


# The prompt --------------------------------------------------------------------------------------


def test_fim_prompt_equals_tokenizer_fim_prompt(server, tokenizer):
    prefix, middle, suffix = "for i in range(", "1", "):\n    pass\n"
    out = vim_post(server, vim_fim(prefix, middle, suffix, response_fields=[])).json()
    ids = tokenizer.fim_prompt(prefix + middle, suffix)
    assert out["tokens_evaluated"] == len(ids)
    assert out["prompt"] == tokenizer.decode(ids)
    assert out["prompt"] == f"<|fim_prefix|>{prefix}{middle}<|fim_suffix|>{suffix}<|fim_middle|>"


def test_oldest_chunks_are_dropped_to_leave_room(server):
    """4096 context, n_predict 0 (512 tokens kept free): of four 1011-token chunks (one byte a
    token), the newest three fit beside the 26 tokens of header, current file and FIM."""
    chunks = [{"text": f"# {i}\n" + "y" * 1000, "filename": f"f{i}.py"} for i in range(4)]
    out = vim_post(server, vim_fim("a", "", "b", chunks, n_predict=0, response_fields=[])).json()
    assert out["truncated"] is True and "# 0\n" not in out["prompt"]
    positions = [out["prompt"].index(f"# {i}\n") for i in (1, 2, 3)]
    assert positions == sorted(positions), "the kept chunks keep their order"
    assert out["tokens_evaluated"] == 3 * 1011 + 26


def test_special_token_text_in_fields_stays_text(server):
    out = vim_post(server, vim_fim("<|fim_middle|>", "", "", n_predict=0, response_fields=[]))
    assert out.json()["tokens_evaluated"] == len(b"<|fim_middle|>") + 3


# Generation controls and the response ------------------------------------------------------------


# The stopping rules of llama.vim's requests depend on timing: off where texts are compared.
UNTIMED = {"n_indent": 0, "t_max_predict_ms": 0, "response_fields": []}


def test_stop_word_and_tokens(server):
    body = vim_fim("def f(", "", "):\n", n_predict=8, temperature=0.0, **UNTIMED)
    body |= {"samplers": ["temperature"], "return_tokens": True}
    greedy = vim_post(server, body).json()
    assert greedy["stop_type"] == "limit" and greedy["stopped_limit"] is True
    assert len(greedy["tokens"]) == greedy["tokens_predicted"] == 8
    text = greedy["content"]
    word = text[len(text) // 3 :][:3]
    cut = vim_post(server, body | {"stop": ["\x00", word, ""]}).json()
    assert cut["content"] == text[: text.index(word)]
    assert (cut["stop_type"], cut["stopped_word"], cut["stopping_word"]) == ("word", True, word)
    assert cut["stopped_eos"] is False and cut["stopped_limit"] is False


def test_seeded_stream_matches_the_whole_response(server):
    body = vim_fim("x = [", "", "]\n", n_predict=6, seed=42, **UNTIMED)
    body["samplers"] = ["top_k", "top_p", "temperature"]
    whole = vim_post(server, body).json()
    r = vim_post(server, body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *parts, final = sse_events(r.text)
    assert all(p["stop"] is False and p["content"] for p in parts)
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert final["stop"] is True and final["content"] == ""
    assert final["tokens_predicted"] == whole["tokens_predicted"]
    assert final["timings"]["predicted_n"] == whole["tokens_predicted"]


def test_response_fields_select_nested_values(server):
    fields = ["content", "timings/prompt_n", "generation_settings/top_k", "no/such/path"]
    out = vim_post(server, vim_fim("a", "", "b", response_fields=fields, n_predict=2)).json()
    assert set(out) == {"content", "timings/prompt_n", "generation_settings/top_k"}
    assert out["generation_settings/top_k"] == 40 and out["timings/prompt_n"] == 5


# Errors, in llama.cpp's shape ------------------------------------------------------------------

BAD = [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": ""}, "input_suffix"),
    ({"input_prefix": 5, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": "x"}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict"),
    ({"input_prefix": "", "input_suffix": "", "samplers": ["min_p"]}, "samplers"),
    ({"input_prefix": "", "input_suffix": "", "min_p": 0.05}, "min_p"),
    ({"input_prefix": "", "input_suffix": "", "repeat_penalty": 1.1}, "repeat_penalty"),
    ({"input_prefix": "", "input_suffix": "", "grammar": "root ::= x"}, "grammar"),
    ({"input_prefix": "", "input_suffix": "", "lora": [{"id": 0, "scale": 0.5}]}, "lora"),
    ({"input_prefix": "", "input_suffix": "", "n_cmpl": 5}, "n_cmpl"),
    ({"input_prefix": "", "input_suffix": "", "id_slot": 2}, "id_slot"),
    ({"input_prefix": "", "input_suffix": "", "temperature": "hot"}, "temperature"),
    ({"input_prefix": "", "input_suffix": "", "n_cmpl": 2, "stream": True}, "n_cmpl"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f for _, f in BAD])
def test_bad_request_is_a_llama_cpp_400(server, body, field):
    r = vim_post(server, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"code", "message", "type"}
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b"nul"])
def test_malformed_body_is_a_llama_cpp_400(server, raw):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/infill", content=raw, headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_context_overflow_and_unknown_model(server):
    r = vim_post(server, vim_fim("y" * 5000, "", "", n_predict=4))
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "exceed_context_size_error"
    # Tokenizing stops past the context, so the count is a lower bound (llama.cpp's is exact).
    assert error["n_prompt_tokens"] >= error["n_ctx"] == 4096
    r = vim_post(server, vim_fim("a", "", "b", model="qwen2.5-coder:7b"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key_is_required(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "", "input_suffix": ""})
    assert r.status_code == 401


# Cancellation ----------------------------------------------------------------------------------


def test_stream_cancelled_when_the_client_goes(server):
    body = vim_fim("a", "", "b", n_predict=3000, stream=True, **UNTIMED)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/infill", json=body, headers=headers, timeout=60) as r:
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix("data: "))["stop"] is False
    health = server.wait_idle(timeout=10)
    assert (health["running"], health["kv_pages_in_use"]) == (0, 0), health


# The stopping rules and response_fields, directly ------------------------------------------------


@pytest.mark.parametrize(
    "pieces,kept,stopped_at",
    [
        (["    x = 1\n", "    y = 2\n", "z = 3\n"], "    x = 1\n    y = 2\n", 2),
        (["if a:\n  ", "  b\n", "c"], "if a:\n    b\n", 2),
        (["x\n", "\n", "    y"], "x\n", 1),  # a blank line is below any indentation
        (["abc", "def\n      ", "g\n  h"], "abcdef\n      g\n  ", 2),
        (["first line at 0\n", "      deeper\n", "    same\n"], None, None),
    ],
)
def test_n_indent_cuts_at_the_first_dedented_line(pieces, kept, stopped_at):
    stops = InfillStops(n_indent=4, t_max_predict_ms=0)
    for i, piece in enumerate(pieces):
        _, stopped = stops.feed(piece, generating_s=0.0)
        if stopped:
            assert (i, stops.text) == (stopped_at, kept)
            return
    assert stopped_at is None and stops.text == "".join(pieces)


def test_t_max_predict_ms_stops_at_a_newline_after_the_limit():
    stops = InfillStops(n_indent=0, t_max_predict_ms=100)
    assert stops.feed("a\n", generating_s=0.05) == ("a\n", False)  # a newline, but in time
    assert stops.feed("b", generating_s=0.2) == ("b", False)  # late, but no newline
    assert stops.feed("c\nd", generating_s=0.2) == ("c\nd", True)


def test_select_flattens_paths_like_llama_cpp():
    result = {"content": "x", "timings": {"prompt_n": 3}, "n": 0}
    assert select(result, []) is result
    assert select(result, ["timings/prompt_n", "content", "timings/x", ""]) == {
        "timings/prompt_n": 3,
        "content": "x",
    }


def test_infill_prompt_keeps_the_fim_core_whole(tokenizer):
    core = tokenizer.fim_prompt("ab", "c")
    body = InfillRequest(input_prefix="a", prompt="b", input_suffix="c", n_predict=10)
    assert infill_prompt(tokenizer, body, max_context=64) == (core, False)
    chunks = [{"text": "z" * 40, "filename": "big.py"}]
    body = InfillRequest(
        input_prefix="a", prompt="b", input_suffix="c", n_predict=10, input_extra=chunks
    )
    assert infill_prompt(tokenizer, body, max_context=64) == (core, True), "no chunk fits: none"
    ids, truncated = infill_prompt(tokenizer, body, max_context=200)
    assert not truncated and ids[-len(core) :] == core
    assert tokenizer.decode(ids[: -len(core)]) == (
        "<|repo_name|>myproject\n<|file_sep|>big.py\n" + "z" * 40 + "<|file_sep|>filename\n"
    )


# /completion, /tokenize, /detokenize (llama.cpp's own completion API) --------------------------


def llama_post(server, path: str, body: dict) -> httpx.Response:
    """As Continue's llama.cpp provider sends it (fetch, JSON, a Bearer key)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_completion_is_the_openai_completion_of_the_same_prompt(server, tokenizer):
    # Continue's llama.cpp provider: prompt, stream, n_predict and its sampling fields.
    body = {"prompt": "def f(", "n_predict": 6, "temperature": 0, "stop": ["\n\n"]}
    whole = llama_post(server, "/completion", body).json()
    streamed = sse_events(llama_post(server, "/completions", body | {"stream": True}).text)
    openai = llama_post(server, "/v1/completions", {"model": "tiny", "prompt": "def f(",
                                                    "max_tokens": 6, "temperature": 0,
                                                    "stop": ["\n\n"]}).json()  # fmt: skip
    text = openai["choices"][0]["text"]
    assert whole["content"] == text == "".join(e["content"] for e in streamed[:-1])
    assert whole["tokens_evaluated"] == len(tokenizer.encode("def f(")) == 6
    assert whole["tokens_predicted"] == openai["usage"]["completion_tokens"]
    assert streamed[-1]["stop"] is True and streamed[-1]["content"] == ""
    assert whole["prompt"] == "def f(" and whole["stop_type"] in ("limit", "word", "eos")


def test_completion_prompt_forms(server, tokenizer):
    def greedy(prompt) -> dict:
        r = llama_post(server, "/completion", {"prompt": prompt, "n_predict": 4, "top_k": 1})
        assert r.status_code == 200, r.text
        return r.json()

    ids = tokenizer.encode("x = 1\n")
    text = greedy("x = 1\n")
    assert greedy(ids)["content"] == text["content"]
    assert greedy([ids[0], "", *ids[1:]])["content"] == text["content"]  # "" adds nothing
    mixed = greedy([*tokenizer.encode("x = "), "1\n"])
    assert mixed["tokens_evaluated"] == len(tokenizer.encode("x = ")) + len(tokenizer.encode("1\n"))
    # Special-token text in the prompt becomes the control tokens, as in llama.cpp.
    fim = greedy("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>")
    assert fim["tokens_evaluated"] == len(tokenizer.fim_prompt("a", "b")) == 5


@pytest.mark.parametrize(
    "body,says",
    [
        ({"prompt": ["a", "b"]}, "several prompts"),
        ({"prompt": [10**9]}, "outside"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "a", "repeat_penalty": 1.1}, "repeat_penalty"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_is_a_llama_cpp_400(server, body, says):
    r = llama_post(server, "/completion", body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_tokenize_and_detokenize(server, tokenizer):
    text = "def f():\n    return 'é'  <|fim_prefix|>"
    ids = llama_post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == tokenizer.encode(text, allow_special=True)
    plain = llama_post(server, "/tokenize", {"content": text, "parse_special": False}).json()
    assert plain["tokens"] == tokenizer.encode(text) != ids
    assert llama_post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}
    pieces = llama_post(server, "/tokenize", {"content": "é", "with_pieces": True}).json()
    # The tiny model's byte-level vocabulary splits "é" into two bytes, neither whole UTF-8.
    assert pieces["tokens"] == [{"id": i, "piece": list(tokenizer.token_bytes(i))}
                                for i in tokenizer.encode("é")]  # fmt: skip
    assert b"".join(bytes(p["piece"]) for p in pieces["tokens"]) == "é".encode()
    r = llama_post(server, "/detokenize", {"tokens": [1, -1]})
    assert r.status_code == 400 and "-1" in r.json()["error"]["message"]
