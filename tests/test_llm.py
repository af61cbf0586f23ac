"""LLM end to end on the tiny synthetic model (reference backend), and the streaming rules
(EOS, stop strings, UTF-8, lengths) on a scripted backend whose token ids we choose."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from nanoqwen.errors import ContextError, NanoqwenError, TokenizerError
from nanoqwen.llm import LLM, Completion, Delta
from nanoqwen.sampling import SamplingParams
from nanoqwen.tokenizer import TooManyTokens

CHAT = [{"role": "user", "content": "Write is_prime(n) in Python."}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from nanoqwen.convert import pack_synthetic

    path = tmp_path_factory.mktemp("tiny") / "tiny.nanoqwen"
    pack_synthetic("tiny", path, seed=0, progress=False)
    return path


@pytest.fixture(scope="module")
def llm(tiny_path):
    with LLM(tiny_path, backend="reference", max_context=256) as model:
        yield model


# The real reference backend -------------------------------------------------------------------


def test_properties(llm, tiny_path):
    assert llm.backend_name == "reference"
    assert llm.config.name == "tiny"
    assert llm.max_context == 256
    assert llm.model_name == "tiny"
    assert llm.kv_pages_in_use == 0
    with LLM(tiny_path, backend="reference") as default:
        assert default.max_context == 4096


def test_prepare_kinds(llm):
    assert llm.prepare(prompt="ab") == [ord("a"), ord("b")]
    assert llm.prepare(messages=CHAT) == llm.tokenizer.encode_chat(CHAT)
    sp = llm.tokenizer.special_tokens
    fim = [sp["fim_prefix"], ord("a"), sp["fim_suffix"], ord("b"), sp["fim_middle"]]
    assert llm.prepare(fim=("a", "b")) == fim
    with pytest.raises(NanoqwenError, match="exactly one"):
        llm.prepare(prompt="a", fim=("a", "b"))
    with pytest.raises(NanoqwenError, match="exactly one"):
        llm.prepare()
    with pytest.raises(ContextError, match="empty"):
        llm.prepare(prompt="")
    with pytest.raises(TokenizerError):
        llm.prepare(prompt="\udcff")


FIM_RAW = "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>"


def test_raw_prompt_special_tokens_parse_or_text(llm):
    fim = llm.prepare(fim=("def add(a, b):\n", "\n    return c"))
    assert llm.prepare(prompt=FIM_RAW) == fim  # the default, as vLLM and llama.cpp
    assert llm.prepare(prompt=FIM_RAW, special_tokens="parse") == fim
    assert llm.prepare(prompt=FIM_RAW, special_tokens="text") == llm.tokenizer.encode(FIM_RAW)
    assert len(llm.prepare(prompt=FIM_RAW, special_tokens="text")) > len(fim) + 30
    # Chat contents and FIM parts stay text whatever the raw-prompt setting.
    chat = [{"role": "user", "content": FIM_RAW}]
    assert llm.prepare(messages=chat, special_tokens="parse") == llm.tokenizer.encode_chat(chat)
    fim_prefix = llm.tokenizer.special_tokens["fim_prefix"]
    assert llm.prepare(fim=(FIM_RAW, "")).count(fim_prefix) == 1
    with pytest.raises(NanoqwenError, match="special_tokens must be one of parse, text"):
        llm.prepare(prompt="a", special_tokens="allow")


def test_prepare_token_ids(llm):
    assert llm.prepare(prompt=[1, 2, 3]) == [1, 2, 3]
    assert llm.prepare(prompt=(ord("a"),)) == llm.prepare(prompt="a")
    with pytest.raises(ContextError, match="outside"):
        llm.prepare(prompt=[1, llm.config.vocab_size])
    with pytest.raises(ContextError, match="empty"):
        llm.prepare(prompt=[])
    with pytest.raises(NanoqwenError, match="token ids"):
        llm.prepare(prompt=[1, True])
    with pytest.raises(NanoqwenError, match="token ids"):
        llm.prepare(prompt=[1.0])


@pytest.mark.parametrize(
    "kind",
    [
        {"prompt": "x" * 100_000},
        {"prompt": [7] * 256},
        {"messages": [{"role": "user", "content": "y" * 300}]},
        {"fim": ("a" * 200, "b" * 60)},
    ],
    ids=["text", "ids", "chat", "fim"],
)
def test_prompt_past_the_context_is_refused_early(llm, kind):
    with pytest.raises(
        TooManyTokens, match="longer than 255 tokens, so .* exceeds the context of 256"
    ):
        llm.prepare(**kind)


def test_prompt_that_just_fits_is_prepared(llm):
    assert len(llm.prepare(prompt="x" * 255)) == 255


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-45, max_tokens=6),
        SamplingParams(temperature=1e-38, max_tokens=6),
        SamplingParams(temperature=1e-6, max_tokens=6),
        SamplingParams(temperature=1.0, top_p=1e-45, max_tokens=6),
        SamplingParams(temperature=1.0, top_p=0.0, max_tokens=6),
    ],
)
def test_degenerate_sampling_on_the_reference_backend_is_greedy(llm, params):
    ids = llm.prepare(prompt="def f(")
    assert llm.generate(ids, params) == llm.generate(ids, SamplingParams(max_tokens=6))


def test_generate_command_special_tokens_option(tiny_path, capsys):
    from nanoqwen.cli import main

    counts = {}
    for mode in ("parse", "text"):
        argv = ["generate", str(tiny_path), "-p", FIM_RAW, "--backend", "reference"]
        assert main([*argv, "--max-tokens", "1", "--special-tokens", mode]) == 0
        counts[mode] = int(capsys.readouterr().err.split("prompt ")[1].split(" tokens")[0])
    assert counts["text"] == counts["parse"] - 3 + len("<|fim_prefix|><|fim_suffix|><|fim_middle|>")


def test_greedy_is_deterministic_and_runs_to_length(llm):
    ids = llm.prepare(messages=CHAT)
    params = SamplingParams(max_tokens=12)
    first, second = llm.generate(ids, params), llm.generate(ids, params)
    assert isinstance(first, Completion)
    # The second reuses the first's prompt pages (prefix cache): the same completion.
    assert second.cached_tokens > 0 == first.cached_tokens
    assert dataclasses.replace(second, cached_tokens=0) == first
    assert first.prompt_tokens == len(ids)
    assert first.finish_reason == "length" and first.completion_tokens == 12
    assert len(first.token_ids) == 12
    assert llm.kv_pages_in_use == 0


def test_stream_matches_generate(llm):
    ids = llm.prepare(prompt="def f():")
    params = SamplingParams(max_tokens=9)
    deltas = list(llm.stream(ids, params))
    assert all(isinstance(d, Delta) for d in deltas)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length"
    out = llm.generate(ids, params)
    assert tuple(t for d in deltas for t in d.token_ids) == out.token_ids
    assert "".join(d.text for d in deltas) == out.text


def test_seed_reproducibility(llm):
    ids = llm.prepare(prompt="x = ")

    def sample(seed: int) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=6)
        return llm.generate(ids, params).token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_context_error_names_both_numbers(llm):
    with pytest.raises(ContextError, match=r"prompt of 250 tokens \+ max_tokens 7 = 257 exceeds"):
        llm.check_fits(250, 7)
    with pytest.raises(ContextError, match="context of 256 tokens"):
        llm.stream([65] * 200, SamplingParams(max_tokens=57))
    llm.check_fits(200, 56)


def test_closing_a_stream_early_frees_kv_pages(llm):
    stream = llm.stream(llm.prepare(prompt="a" * 40), SamplingParams(max_tokens=50))
    assert len(next(stream).token_ids) == 1
    assert llm.kv_pages_in_use == 3  # the 40-token prompt fills three 16-token pages
    stream.close()
    assert llm.kv_pages_in_use == 0


def test_bad_backend_and_context(tiny_path):
    with pytest.raises(NanoqwenError, match="unknown backend"):
        LLM(tiny_path, backend="tpu")
    with pytest.raises(ContextError, match="max_context 40000"):
        LLM(tiny_path, backend="reference", max_context=40000)


def test_cuda_without_sm90_is_refused(tiny_path, monkeypatch):
    import nanoqwen.llm as llm_module

    monkeypatch.setattr(llm_module, "_cuda_available", lambda: (False, "no sm_90 GPU found"))
    with pytest.raises(NanoqwenError, match="needs an NVIDIA Hopper GPU"):
        LLM(tiny_path, backend="cuda")
    with LLM(tiny_path, backend="auto") as auto:
        assert (auto.backend_name, auto.backend_reason) == ("reference", "no sm_90 GPU found")


def test_closed_llm_refuses_work(tiny_path):
    model = LLM(tiny_path, backend="reference", max_context=64)
    model.close()
    model.close()  # idempotent
    with pytest.raises(NanoqwenError, match="closed"):
        model.stream([65], SamplingParams(max_tokens=1))


# Streaming rules on a scripted backend ----------------------------------------------------------


class ScriptedBackend:
    """Yields a fixed list of token ids, honouring stop_ids and max_tokens like a backend."""

    name = "reference"
    cached_tokens = 0  # no prefix cache

    def __init__(self, script: list[int]):
        self.script = script
        self.pages = 0

    @property
    def kv_pages_in_use(self) -> int:
        return self.pages

    def generate(self, prompt_ids, params, stop_ids) -> Iterator[int]:
        self.pages = 1
        try:
            for n, token in enumerate(self.script[: params.max_tokens], start=1):
                yield token
                if token in stop_ids or n == params.max_tokens:
                    return
        finally:
            self.pages = 0

    def close(self) -> None:
        pass


@pytest.fixture
def scripted(tiny_path, monkeypatch):
    """scripted(token ids) -> an LLM whose backend yields exactly those ids."""
    opened = []

    def make(script: list[int]) -> LLM:
        monkeypatch.setattr(LLM, "_open_backend", lambda self: ScriptedBackend(script))
        model = LLM(tiny_path, backend="reference", max_context=64)
        opened.append(model)
        return model

    yield make
    for model in opened:
        model.close()


def test_eos_ends_with_stop_and_is_not_text(scripted):
    model = scripted([])
    im_end, endoftext = model.tokenizer.eos_token_ids
    model = scripted([*b"ok", im_end, *b"never"])
    out = model.generate([1], SamplingParams(max_tokens=10))
    assert (out.text, out.token_ids, out.finish_reason) == ("ok", (111, 107, im_end), "stop")
    assert model.generate([1], SamplingParams(max_tokens=2)).finish_reason == "length"
    eot = scripted([endoftext]).generate([1], SamplingParams(max_tokens=5))
    assert (eot.text, eot.completion_tokens, eot.finish_reason) == ("", 1, "stop")


def test_stop_string_across_tokens_cuts_before_it(scripted):
    model = scripted([*b"return a + b\n\ndef g"])
    deltas = list(model.stream([1], SamplingParams(max_tokens=30, stop=("\n\n", "zz"))))
    assert "".join(d.text for d in deltas) == "return a + b"
    assert deltas[-1].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in deltas) == len(b"return a + b\n\n")
    assert model.kv_pages_in_use == 0


def test_held_back_text_is_released_at_the_end(scripted):
    model = scripted([*b"abc\n"])
    out = model.generate([1], SamplingParams(max_tokens=4, stop=("\n\n",)))
    assert (out.text, out.finish_reason) == ("abc\n", "length")


def test_split_emoji_never_streams_broken_utf8(scripted):
    model = scripted([*"é😀".encode(), *b"!"])
    deltas = list(model.stream([1], SamplingParams(max_tokens=7)))
    assert [d.text for d in deltas] == ["", "é", "", "", "", "😀", "!"]
    assert [d.token_ids for d in deltas] == [(t,) for t in "é😀!".encode()]
    assert deltas[-1].finish_reason == "length"
    truncated = scripted([*"😀".encode()[:3]]).generate([1], SamplingParams(max_tokens=3))
    assert truncated.text == "\ufffd"


def test_stream_close_cancels_the_backend(scripted):
    model = scripted([*b"abcdef"])
    stream = model.stream([1], SamplingParams(max_tokens=6))
    assert next(stream).text == "a"
    assert model.kv_pages_in_use == 1
    stream.close()
    assert model.kv_pages_in_use == 0
