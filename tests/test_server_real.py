"""`nanoqwen serve` on real Qwen2.5-Coder weights (the real_model fixture; the cuda backend on
an sm_90 GPU, else the reference): fill-in-the-middle the four ways editors ask for it gives
one and the same greedy completion, and a sensible one.

    OpenAI      /v1/completions with prompt + suffix
    raw         /v1/completions with the special-token text Tabby, Continue and llm-ls build
    llama.cpp   /infill with input_prefix + input_suffix (llama.vim, llama.vscode)
    Ollama      /api/generate with prompt + suffix (Continue, Twinny)

and a chat request that resends the previous turn is served partly from the prefix cache
(usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def server(serve, real_model):
    proc = serve(real_model, "--backend", "auto", "--max-context", "4096")
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


def test_fill_in_the_middle_is_the_same_every_way(server):
    model = server.health()["model"]
    greedy = {"temperature": 0, "max_tokens": 16}
    with httpx.Client(base_url=server.url, timeout=300) as http:
        openai = http.post(
            "/v1/completions", json={"model": model, "prompt": PREFIX, "suffix": SUFFIX} | greedy
        ).json()["choices"][0]["text"]
        raw_prompt = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
        raw = http.post(
            "/v1/completions", json={"model": model, "prompt": raw_prompt} | greedy
        ).json()["choices"][0]["text"]
        infill = http.post(
            "/infill",
            json={
                "input_prefix": PREFIX,
                "input_suffix": SUFFIX,
                "n_predict": 16,
                "temperature": 0,
                "samplers": ["temperature"],
            },  # fmt: skip
        ).json()["content"]
        ollama = http.post(
            "/api/generate",
            json={
                "model": model,
                "prompt": PREFIX,
                "suffix": SUFFIX,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 16},
            },  # fmt: skip
        ).json()["response"]
    assert "return a + b" in openai, openai
    assert raw == infill == ollama == openai


def test_a_resent_conversation_is_served_from_the_prefix_cache(server):
    model = server.health()["model"]
    turn = [{"role": "user", "content": "Write a Python function is_prime(n)."}]
    with httpx.Client(base_url=server.url, timeout=300) as http:
        first = http.post(
            "/v1/chat/completions", json={"model": model, "messages": turn, "max_tokens": 48}
        ).json()
        turn += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Now add type hints."},
        ]
        second = http.post(
            "/v1/chat/completions", json={"model": model, "messages": turn, "max_tokens": 8}
        ).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // 16 * 16 - 16, second["usage"]
