"""Tokenizer sections: rebuilt from GGUF-style metadata, the synthetic byte-level one, the HF
directory reader; and, opt-in when the real Qwen2.5-Coder files are cached, the real vocabulary
("Hello, world!" -> [9707, 11, 1879, 0])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_convert import CFG, gguf_vocab, grid_weights, write_gguf
from tokenizers import Tokenizer

from nanoqwen.convert import load_tokenizer
from nanoqwen.convert.gguf import read_gguf
from nanoqwen.convert.tokenizers import (
    CHATML_TEMPLATE,
    byte_level_spec,
    spec_from_gguf_fields,
    spec_from_hf_dir,
)
from nanoqwen.errors import ConvertError

CACHE = Path("/root/.cache/nanoqwen")
REAL_GGUF = CACHE / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
REAL_PACKED = CACHE / "qwen2.5-coder-0.5b-instruct.nanoqwen"
MIXED = "def f(x):\n    return x**2  # 平方 — café 🎉\n\n\t<|im_start|>user\nhi<|im_end|>\n"
QWEN_SPECIALS = {
    "bos": 151643, "pad": 151643, "endoftext": 151643, "im_start": 151644, "im_end": 151645,
    "fim_prefix": 151659, "fim_middle": 151660, "fim_suffix": 151661, "fim_pad": 151662,
    "repo_name": 151663, "file_sep": 151664,
}  # fmt: skip


def gguf_fields(**overrides) -> dict:
    tokens, merges, types = gguf_vocab()
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    return fields | overrides


@pytest.fixture(scope="module")
def gguf_tok():
    spec = spec_from_gguf_fields(gguf_fields(), "test.gguf")
    return spec, Tokenizer.from_str(spec.tokenizer_json)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("in", [257]),  # merge "i n"
        (" t", [258]),  # merge "Ġ t"
        ("  t", [32, 258]),  # the split regex keeps one space apart before " t"
        ("    x", [256, 32, 32, 120]),  # "   " (\s+(?!\S)) -> ĠĠ Ġ, then " x" -> Ġ x
        ("<|im_start|>in<|im_end|>", [151644, 257, 151645]),
        ("é", [195, 169]),  # NFC, then UTF-8 bytes
        ("e\u0301", [195, 169]),  # decomposed é normalizes to the same bytes
    ],
)
def test_gguf_metadata_tokenizer_encodes(gguf_tok, text, ids):
    assert gguf_tok[1].encode(text).ids == ids


def test_gguf_metadata_tokenizer_specials_and_roundtrip(gguf_tok):
    spec, tok = gguf_tok
    assert spec.special_tokens == QWEN_SPECIALS
    assert spec.eos_token_ids == (151645, 151643)
    assert spec.chat_template == CHATML_TEMPLATE
    assert tok.decode(tok.encode(MIXED).ids, skip_special_tokens=False) == MIXED
    assert tok.token_to_id("[PAD151700]") is None  # type-5 fill is not a token
    assert tok.token_to_id("<tool_call>") == 151657


def test_gguf_metadata_refused():
    with pytest.raises(ConvertError, match=r"'llama'/'qwen2' is not the Qwen2"):
        spec_from_gguf_fields(gguf_fields(**{"tokenizer.ggml.model": "llama"}), "x.gguf")
    tokens, _, types = gguf_vocab()
    with pytest.raises(ConvertError, match="151936 tokens but 151935 token types"):
        spec_from_gguf_fields(gguf_fields(**{"tokenizer.ggml.token_type": types[:-1]}), "x.gguf")
    gap = [5 if i == 300 else t for i, t in enumerate(types)]
    with pytest.raises(ConvertError, match=r"regular token ids are not exactly 0\.\.151641"):
        spec_from_gguf_fields(gguf_fields(**{"tokenizer.ggml.token_type": gap}), "x.gguf")


def test_gguf_file_tokenizer_metadata_is_read(tmp_path):
    """A GGUF whose small vocabulary lacks the specials: parsed, then refused by name."""
    path = write_gguf(tmp_path / "m.gguf", CFG, grid_weights(CFG, 0), tokenizer=False)
    assert read_gguf(path)[1] is None
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.add_token_types([1, 1])
    for stage in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        stage()
    w.close()
    with pytest.raises(ConvertError, match=r"t\.gguf: tokenizer lacks the special token"):
        load_tokenizer(tmp_path / "t.gguf")


def test_byte_level_spec_for_synthetic_models():
    spec = byte_level_spec()
    tok = Tokenizer.from_str(spec.tokenizer_json)
    assert spec.special_tokens == QWEN_SPECIALS and spec.eos_token_ids == (151645, 151643)
    assert tok.encode("ab  c").ids == [97, 98, 32, 32, 99]
    assert tok.encode("x   ").ids == [120, 256, 32]
    assert tok.decode(tok.encode(MIXED).ids, skip_special_tokens=False) == MIXED
    assert tok.decode([104, 300, 105]) == "h[300]i"  # placeholders decode visibly
    assert tok.get_vocab_size() == 151665


def test_hf_dir_tokenizer(tmp_path):
    spec = byte_level_spec()
    (tmp_path / "tokenizer.json").write_text(spec.tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    assert spec_from_hf_dir(tmp_path).chat_template == "T"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    assert spec_from_hf_dir(tmp_path).eos_token_ids == (151645,)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ConvertError, match="tokenizer_config.json: invalid JSON"):
        spec_from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ConvertError, match="tokenizer does not load"):
        spec_from_hf_dir(tmp_path)
    with pytest.raises(ConvertError, match="no tokenizer.json"):
        spec_from_hf_dir(tmp_path / "none")


def _check_real(spec) -> None:
    tok = Tokenizer.from_str(spec.tokenizer_json)
    assert tok.encode("Hello, world!").ids == [9707, 11, 1879, 0]
    assert tok.decode(tok.encode(MIXED).ids, skip_special_tokens=False) == MIXED
    assert spec.special_tokens == QWEN_SPECIALS and spec.eos_token_ids == (151645, 151643)
    assert "<|im_start|>" in spec.chat_template


@pytest.mark.skipif(not REAL_PACKED.is_file(), reason=f"{REAL_PACKED} not packed")
def test_real_vocabulary_in_packed_file():
    _check_real(load_tokenizer(REAL_PACKED))


@pytest.mark.slow
@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"{REAL_GGUF} not cached")
def test_real_vocabulary_from_gguf():
    _check_real(load_tokenizer(REAL_GGUF))
