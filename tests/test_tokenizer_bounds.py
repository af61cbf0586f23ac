"""Bounded tokenization: chunked encoding gives the ids of one encoding of the whole text, a text
past the limit costs about a limit's worth of work, and encoding lets other threads run.

The oracle is the `tokenizers` library encoding the whole text at once. The tokenizer under
test is a real BPE (merges trained here on the standard library's sources, so tokens span
letters, spaces, newlines and punctuation) with Qwen2's NFC + split regex pre-tokenizer and
the Qwen2.5 added tokens; the real Qwen2.5 tokenizer is checked too when a packed model is
found (conftest `real_model`). Chunks are made tiny so that every text is cut many times.
"""

from __future__ import annotations

import json
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nanoqwen.tokenizer as tokenizer_module
from nanoqwen.convert.tokenizers import (
    CHATML_TEMPLATE,
    QWEN2_SPLIT_REGEX,
    QWEN25_ADDED_TOKENS,
    bpe_tokenizer_json,
    make_spec,
)
from nanoqwen.errors import TokenizerError
from nanoqwen.tokenizer import Tokenizer, TooManyTokens

STDLIB = Path(sysconfig.get_paths()["stdlib"])

# Pieces that stress the pre-tokenizer: whitespace and newline runs (incl. Unicode spaces),
# contractions, digits, punctuation, non-ASCII letters and digits, combining marks that NFC
# composes, CJK, emoji, and special-token text.
PIECES = [
    *"abcXYZ019_-+*/=<>|()[]{}.,;:!?#@$%&'\"\\`~^",
    " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n    ", "\x0b", "\x0c",
    "\n \n", " \n\n  ", "\t\n\t", "  \r\n  ",
    "\x1c", "\x85", "\xa0", "\u2003", "\u3000", "\u2028",
    "'s", "'re", "'LL", "don't", "x1", "1x", "12345", "3.14",
    "é", "e\u0301", "a\u0308", "\u1100\u1161\u11a8", "ß", "ñ", "Ω", "٣", "²", "Ⅻ",
    "世界", "こんにちは", "😀", "👍🏽",
    "def f(x):\n    return x\n", "<|im_end|>", "<|fim_prefix|>", "</tool_call>",
]  # fmt: skip


def _sources(count: int) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[:count]]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    bpe = HFTokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator([*_sources(40), "".join(PIECES) * 20], trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    n = len(model["vocab"])
    added = [(n + i, text, special) for i, (_, text, special) in enumerate(QWEN25_ADDED_TOKENS)]
    text = bpe_tokenizer_json(model["vocab"], merges, added, "trained")
    return Tokenizer.from_spec(make_spec(text, CHATML_TEMPLATE, "trained"))


@pytest.fixture(scope="module")
def real(real_model) -> Tokenizer:
    from nanoqwen.fileformat import NanoqwenFile

    with NanoqwenFile(real_model) as f:
        return Tokenizer.from_file(f)


def whole(tok: Tokenizer, text: str, special: bool = False) -> list[int]:
    """The oracle: `tokenizers` encoding the text in one call."""
    hf = tok._full if special else tok._plain
    return hf.encode(text, add_special_tokens=False).ids


class Calls:
    """Counts what reaches the underlying encoder: calls and characters."""

    def __init__(self, tok: Tokenizer) -> None:
        self.calls = self.chars = 0
        self._encode = tok._encode_run

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        self.chars += len(text)
        return self._encode(text)


@contextmanager
def chunked(tok: Tokenizer, chunk: int) -> Iterator[Calls]:
    """CHUNK_CHARS set to `chunk`, and the encoder's calls counted."""
    calls = Calls(tok)
    with (
        mock.patch.object(tokenizer_module, "CHUNK_CHARS", chunk),
        mock.patch.object(tok, "_encode_run", calls),
    ):
        yield calls


texts = st.lists(st.sampled_from(PIECES), max_size=80).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=texts, chunk=st.integers(1, 24), special=st.booleans())
def test_chunked_ids_equal_whole_text_ids(tok, text, chunk, special):
    with chunked(tok, chunk):
        assert tok.encode(text, allow_special=special, limit=10**9) == whole(tok, text, special)


@settings(max_examples=200, deadline=None)
@given(text=texts, chunk=st.integers(1, 24), limit=st.integers(0, 60))
def test_limit_refuses_exactly_the_texts_past_it(tok, text, chunk, limit):
    expected = whole(tok, text, True)
    with chunked(tok, chunk):
        if len(expected) <= limit:
            assert tok.encode(text, allow_special=True, limit=limit) == expected
        else:
            with pytest.raises(TooManyTokens, match=f"more than {limit} tokens"):
                tok.encode(text, allow_special=True, limit=limit)


def test_standard_library_sources_chunked(tok):
    for text in _sources(150):
        with chunked(tok, 96) as calls:
            assert tok.encode(text, limit=10**9) == whole(tok, text), text[:80]
        assert calls.calls > len(text) // 200  # cut many times: the test is not vacuous


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=texts, chunk=st.integers(1, 24))
def test_real_tokenizer_random_text(real, text, chunk):
    with chunked(real, chunk):
        assert real.encode(text, allow_special=True, limit=10**9) == whole(real, text, True)


@pytest.mark.slow
def test_real_tokenizer_chunked(real):
    for text in [*_sources(300), "".join(PIECES) * 50]:
        with chunked(real, 128):
            assert real.encode(text, allow_special=True, limit=10**9) == whole(real, text, True)


def test_text_far_past_the_limit_costs_about_the_limit(tok):
    text = "".join(_sources(400))[: 4 * 2**20]
    with chunked(tok, tokenizer_module.CHUNK_CHARS) as calls:
        with pytest.raises(TooManyTokens):
            tok.encode(text, limit=4000)
    # 4000 tokens are ~15k characters of code; at most one chunk is encoded past them.
    assert calls.chars < 3 * tokenizer_module.CHUNK_CHARS < len(text) / 50


def test_character_count_bound_refuses_without_encoding(tok):
    limit = 10
    longest = tok._max_token_chars * tokenizer_module.NFC_MAX_MERGE * limit
    with chunked(tok, 16) as calls:
        with pytest.raises(TooManyTokens):
            tok.encode("ab" * longest, limit=limit)
    assert calls.calls == 0


def test_nfc_merges_at_most_four_characters():
    import sys
    import unicodedata

    longest = max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(sys.maxunicode + 1)
        if not 0xD800 <= c < 0xE000
    )
    assert longest == tokenizer_module.NFC_MAX_MERGE


def test_chat_and_fim_are_bounded(tok):
    messages = [{"role": "user", "content": "x = 1\n" * 5000}]
    full = tok.encode_chat(messages)
    assert tok.encode_chat(messages, limit=len(full)) == full
    with pytest.raises(TooManyTokens):
        tok.encode_chat(messages, limit=len(full) - 1)
    fim = tok.fim_prompt("a = 1\n" * 3000, "b = 2\n" * 3000)
    assert tok.fim_prompt("a = 1\n" * 3000, "b = 2\n" * 3000, limit=len(fim)) == fim
    with pytest.raises(TooManyTokens):
        tok.fim_prompt("a = 1\n" * 3000, "b = 2\n" * 3000, limit=len(fim) - 1)


def test_other_pre_tokenizers_are_encoded_whole(tok):
    gpt2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    spec = json.loads(tok._plain.to_str()) | {"pre_tokenizer": gpt2 | {"use_regex": True}}
    other = Tokenizer(json.dumps(spec), None, {}, ())
    assert not other._cuttable
    text = "def f(x):\n    return x\n" * 200
    with chunked(other, 16) as calls:
        assert other.encode(text, limit=10**9) == whole(other, text)
    assert calls.calls == 1


def test_encoding_lets_other_threads_run(tok):
    text = "".join(_sources(400))[: 2**20]
    done = threading.Event()

    def encode() -> None:
        tok.encode(text)  # no limit: one call of about a second
        done.set()

    worker = threading.Thread(target=encode)
    gaps, last = [], time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    # `tokenizers`' encode() holds the GIL for the whole call: this loop would stall for it.
    assert len(gaps) > 20 and max(gaps) < 0.1, (len(gaps), max(gaps))


def test_lone_surrogate_far_into_the_text_is_found(tok):
    text = "é" * (tokenizer_module.SCAN_WINDOW + 5) + "\udcff"
    with pytest.raises(TokenizerError, match=f"position {tokenizer_module.SCAN_WINDOW + 5}"):
        tok.encode(text)
