"""HF and GGUF converters: one set of float weights written as an HF checkpoint (fp32, and bf16
+ fp16 shards behind an index) and as GGUF (F32, F16) must pack to identical tensors; bad
sources must be refused with ConvertError naming the tensor, leaving no (or the old) output.
Tokenizer sections: rebuilt from GGUF-style metadata, the synthetic byte-level one, the HF
directory reader; and, opt-in when the real Qwen2.5-Coder files are cached, the real vocabulary
("Hello, world!" -> [9707, 11, 1879, 0])."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from nanoqwen.config import ModelConfig
from nanoqwen.convert import hf, load_tokenizer, pack_source
from nanoqwen.convert.gguf import read_gguf
from nanoqwen.convert.hf import read_hf
from nanoqwen.convert.names import logical_shapes, source_names, to_stored
from nanoqwen.convert.tokenizers import (
    CHATML_TEMPLATE,
    QWEN25_ADDED_TOKENS,
    _bytes_to_unicode,
    byte_level_spec,
    spec_from_gguf_fields,
    spec_from_hf_dir,
)
from nanoqwen.errors import ConvertError
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.paths import cache_dir

VOCAB = 151936  # a file with the tokenizer needs the specials' real ids 151643..151664
# Small vocabularies where no tokenizer is written: GGUFReader parses ~150k token strings in
# ~10 s, so only one test file carries the full vocabulary.
CFG = ModelConfig("t", 384, 128, 256, 2, 2, 1, 64, tie_word_embeddings=False)
TIED = ModelConfig("t", 256, 128, 256, 1, 2, 1, 64, tie_word_embeddings=True)
BIG = ModelConfig("t", VOCAB, 128, 128, 1, 2, 1, 64, tie_word_embeddings=False)


def grid_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """float32 weights k/1024 with |k| < 256: exact in bf16, fp16 and fp32 alike."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in logical_shapes(config).items():
        if name == "lm_head" and config.tie_word_embeddings:
            continue
        out[name] = (rng.integers(-255, 256, size=shape) / 1024).astype(np.float32)
    return out


def _by_source(config, source, weights):
    for src, logical in source_names(config, source).items():
        if logical in weights:
            yield src, weights[logical]


def write_hf(directory: Path, config, weights, dtypes=("float32",), tokenizer=False) -> Path:
    """config.json, one shard per dtype (an index when several), tokenizer files."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf()))
    items = list(_by_source(config, "hf", weights))
    weight_map, count = {}, len(dtypes)
    for i, dtype in enumerate(dtypes):
        name = (
            "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        )
        shard = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in items[i::count]}
        save_file(shard, str(directory / name))
        weight_map |= dict.fromkeys(shard, name)
    if count > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if tokenizer:
        spec = byte_level_spec()
        (directory / "tokenizer.json").write_text(spec.tokenizer_json)
        cfg = {"chat_template": spec.chat_template, "eos_token": "<|im_end|>"}
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


def gguf_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level vocabulary padded to VOCAB, with the
    Qwen2.5 specials at their real ids (control 3 / user-defined 4) and [PAD] fill (5)."""
    chars = _bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + ["ĠĠ", "in", "Ġt"]
    tokens += [f"[UNUSED{i}]" for i in range(len(tokens), 151643)]
    types = [1] * len(tokens)
    for _, text, special in QWEN25_ADDED_TOKENS:
        tokens.append(text)
        types.append(3 if special else 4)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    types += [5] * (VOCAB - len(types))
    return tokens, ["Ġ Ġ", "i n", "Ġ t"], types


def write_gguf(path: Path, config, weights, dtype=np.float32, tokenizer=False) -> Path:
    """A qwen2 GGUF file: 2-D tensors as `dtype` (F32/F16), 1-D as F32, with a tokenizer
    (the vocabulary of `gguf_vocab`) when asked."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if tokenizer:
        tokens, merges, types = gguf_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_eos_token_id(151645)
        w.add_chat_template(byte_level_spec().chat_template)
    for name, array in _by_source(config, "gguf", weights):
        w.add_tensor(name, array.astype(dtype) if array.ndim == 2 else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def stored(stream) -> dict[str, np.ndarray]:
    return {name: array for name, array in stream}


def expected_stored(weights) -> dict[str, np.ndarray]:
    out = {}
    for name, array in weights.items():
        out |= dict(to_stored(name, array, name))
    return out


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def weights():
    return grid_weights(CFG, seed=1)


def test_hf_and_gguf_pack_identical_tensors(tmp_path, weights):
    want = expected_stored(weights)
    assert set(want) == set(CFG.tensor_shapes())
    config, tok, stream = read_hf(write_hf(tmp_path / "fp32", CFG, weights, tokenizer=True))
    assert config == ModelConfig(**{**CFG.to_dict(), "name": "fp32"})
    assert_same(stored(stream), want)
    for dtypes in [("bfloat16", "float16", "float32"), ("bfloat16",)]:
        directory = write_hf(tmp_path / "-".join(dtypes), CFG, weights, dtypes)
        assert_same(stored(read_hf(directory, False)[2]), want)
    for dtype in (np.float32, np.float16):
        path = write_gguf(tmp_path / f"m-{np.dtype(dtype).name}.gguf", CFG, weights, dtype)
        config, gtok, stream = read_gguf(path)
        assert config == ModelConfig(**{**CFG.to_dict(), "name": path.stem})
        assert_same(stored(stream), want)
        assert gtok is None
    assert tok.eos_token_ids == (151645, 151643)


@pytest.mark.slow
def test_gguf_with_tokenizer_packs_like_hf(tmp_path):
    """A full-vocabulary GGUF (~30 s: GGUFReader parses 152k strings); its tokenizer section
    equals the HF directory's. Fast coverage: the tokenizer-section tests below."""
    weights = grid_weights(BIG, seed=3)
    path = write_gguf(tmp_path / "m.gguf", BIG, weights, np.float16, tokenizer=True)
    summary = pack_source(path, tmp_path / "g.nanoqwen", progress=False)
    assert summary.tensors == len(BIG.tensor_shapes())
    assert summary.bytes == (tmp_path / "g.nanoqwen").stat().st_size
    pack_source(
        write_hf(tmp_path / "hf", BIG, weights, tokenizer=True),
        tmp_path / "h.nanoqwen",
        progress=False,
    )
    with NanoqwenFile(tmp_path / "g.nanoqwen") as g, NanoqwenFile(tmp_path / "h.nanoqwen") as h:
        g.verify()
        assert g.metadata["source_format"] == "gguf" and h.metadata["source_format"] == "hf"
        assert g.config == ModelConfig(**{**BIG.to_dict(), "name": "m"})
        assert g.tokenizer.special_tokens == h.tokenizer.special_tokens
        assert g.tokenizer.eos_token_ids == h.tokenizer.eos_token_ids == (151645, 151643)
        assert g.tokenizer.chat_template == h.tokenizer.chat_template
        for name in BIG.tensor_shapes():
            np.testing.assert_array_equal(g.tensor(name), h.tensor(name), err_msg=name)


def test_tied_model_drops_identical_lm_head_and_refuses_different(tmp_path):
    w = grid_weights(TIED, seed=2)
    same = write_hf(tmp_path / "same", TIED, {**w, "lm_head": w["embed_tokens"].copy()})
    assert "lm_head" not in stored(read_hf(same, False)[2])
    lm_head = w["embed_tokens"].copy()
    lm_head[7, 3] += 1 / 1024
    other = write_hf(tmp_path / "other", TIED, {**w, "lm_head": lm_head})
    with pytest.raises(ConvertError, match="lm_head differs from embed_tokens"):
        stored(read_hf(other, False)[2])
    gguf_tied = read_gguf(write_gguf(tmp_path / "tied.gguf", TIED, w))[0]
    assert gguf_tied.tie_word_embeddings  # no output.weight in the file


@pytest.mark.parametrize(
    ("name", "index", "value", "message"),
    [
        ("layers.1.up_proj", (5, 9), np.nan, r"model\.layers\.1\.mlp\.up_proj\.weight"),
        ("layers.0.post_attn_norm", (3,), np.inf, r"post_attention_layernorm.*non-finite"),
        ("final_norm", (0,), 1e6, r"model\.norm\.weight.*overflows float16"),
    ],
)
def test_bad_value_names_tensor_and_writes_nothing(tmp_path, weights, name, index, value, message):
    bad = {**weights, name: weights[name].copy()}
    bad[name][index] = value
    directory = write_hf(tmp_path / "bad", CFG, bad)
    out = tmp_path / "out.nanoqwen"
    with pytest.raises(ConvertError, match=message):
        pack_source(directory, out, progress=False, with_tokenizer=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temp file left behind


def test_missing_and_misshaped_tensors(tmp_path, weights):
    partial = {k: v for k, v in weights.items() if k != "layers.1.v_proj.bias"}
    with pytest.raises(ConvertError, match=r"1 tensor\(s\) missing.*layers\.1\.self_attn\.v_proj"):
        read_hf(write_hf(tmp_path / "missing", CFG, partial), False)
    wrong = {**weights, "layers.0.o_proj": weights["layers.0.o_proj"].T.copy()}
    wrong["layers.0.o_proj"] = np.zeros((128, 256), np.float32)
    with pytest.raises(ConvertError, match=r"o_proj.*shape \(128, 256\), expected \(128, 128\)"):
        stored(read_hf(write_hf(tmp_path / "shape", CFG, wrong), False)[2])
    with pytest.raises(ConvertError, match=r"blk\.0\.attn_output\.weight.*shape"):
        stored(read_gguf(write_gguf(tmp_path / "shape.gguf", CFG, wrong))[2])


def test_extra_tensor_and_wrong_model_type(tmp_path, weights):
    directory = write_hf(tmp_path / "m", CFG, weights)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ConvertError, match=r"unexpected tensor.*model\.layers\.1\."):
        read_hf(directory, False)
    (directory / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConvertError, match="model_type is 'llama'"):
        read_hf(directory, False)
    with pytest.raises(ConvertError, match="no such file or directory"):
        pack_source(tmp_path / "nowhere", tmp_path / "o.nanoqwen", progress=False)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConvertError, match="not a Hugging Face checkpoint directory or a .gguf"):
        pack_source(tmp_path / "notes.txt", tmp_path / "o.nanoqwen", progress=False)


def test_corrupt_safetensors_header(tmp_path, weights):
    directory = write_hf(tmp_path / "m", CFG, weights)
    shard = directory / "model.safetensors"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(data[: len(data) // 2])  # truncated: offsets run past the end
    with pytest.raises(ConvertError, match=r"model\.safetensors: tensor .* do not hold shape"):
        read_hf(directory, False)
    shard.write_bytes((2**40).to_bytes(8, "little") + bytes(data[8:100]))
    with pytest.raises(ConvertError, match="bad safetensors header length"):
        read_hf(directory, False)


def test_interrupted_pack_leaves_old_output(tmp_path, weights, monkeypatch):
    directory = write_hf(tmp_path / "m", CFG, weights)
    out = tmp_path / "out.nanoqwen"
    pack_source(directory, out, progress=False, with_tokenizer=False)
    before = out.read_bytes()
    calls = []
    real = hf.read_tensor

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(hf, "read_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack_source(directory, out, progress=False, with_tokenizer=False)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out.nanoqwen"]


def test_hf_stream_holds_one_source_tensor_at_a_time(tmp_path, weights, monkeypatch):
    directory = write_hf(tmp_path / "m", CFG, weights, ("bfloat16", "float16"))
    live: list[weakref.ref] = []
    real = hf.read_tensor

    def tracked(*args):
        gc.collect()
        assert not [r for r in live if r() is not None], "an earlier source tensor is alive"
        array = real(*args)
        live.append(weakref.ref(array))
        return array

    monkeypatch.setattr(hf, "read_tensor", tracked)
    names = [name for name, _ in read_hf(directory, False)[2]]
    assert len(live) == len(weights) and len(names) == len(CFG.tensor_shapes())


# Tokenizer sections ----------------------------------------------------------------------------
CACHE = cache_dir()
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
