"""The .nanoqwen writer and reader: round trips, atomic writes, and every refusal.

Small configs (tied and untied), fresh random tensors each run. Headers are forged through
`forge`, which re-encodes with the writer's own `_encode_header` / `_pack_preamble`, so a
forged file differs from a written one only in what the test changed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from nanoqwen.errors import FormatError
from nanoqwen.fileformat import (
    ALIGNMENT,
    FORMAT_VERSION,
    PREAMBLE_SIZE,
    QUANT,
    NanoqwenFile,
    TokenizerSpec,
    _encode_header,
    _pack_preamble,
    write_nanoqwen,
)


def forge(files, path: Path, mutate: Callable[[dict], object]) -> None:
    """Rewrite the header of a valid file in place after `mutate(header)`."""
    data = path.read_bytes()
    offset, header = files.read_header(data)
    mutate(header)
    encoded = _encode_header(header)
    path.write_bytes(_pack_preamble(offset, encoded) + data[PREAMBLE_SIZE:offset] + encoded)


def patch(path: Path, offset: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    path.write_bytes(bytes(data))


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(FormatError) as info:
        NanoqwenFile(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def model(files, tmp_path) -> Path:
    path = tmp_path / "m.nanoqwen"
    files.write_model(path)
    return path


# Round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
def test_round_trip(files, tmp_path, tied, with_tokenizer):
    config = files.TIED if tied else files.UNTIED
    tokenizer = files.TOKENIZER if with_tokenizer else None
    path = tmp_path / "m.nanoqwen"
    tensors = files.write_model(path, config, tokenizer)
    with NanoqwenFile(path) as f:
        assert (f.version, f.layout_id, f.quant) == (FORMAT_VERSION, 1, QUANT)
        assert f.config == config and f.tokenizer == tokenizer
        assert f.file_size == path.stat().st_size
        assert f.metadata["source"] == "test" and "created" in f.metadata
        assert list(f.tensors) == list(config.tensor_shapes())
        for name, want in tensors.items():
            got = f.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes(), name
            assert not got.flags.writeable and f.tensors[name].offset % ALIGNMENT == 0
            with pytest.raises(ValueError):
                got.flat[0] = 0
        f.verify()
        if config.tie_word_embeddings:
            with pytest.raises(FormatError, match="tied embeddings"):
                f.tensor("lm_head")
        with pytest.raises(FormatError, match="no tensor 'layers.7.input_norm'"):
            f.tensor("layers.7.input_norm")


def test_views_outlive_close(model):
    f = NanoqwenFile(model)
    view = f.tensor("embed_tokens")
    first = view.copy()
    f.close()
    f.close()
    assert np.array_equal(view, first)
    with pytest.raises(ValueError, match="closed"):
        f.tensor("embed_tokens")


def test_progress_bar_names_tensors(files, tmp_path, capsys):
    path = tmp_path / "m.nanoqwen"
    write_nanoqwen(
        path,
        files.UNTIED,
        files.random_tensors(files.UNTIED, np.random.default_rng()).items(),
        None,
        progress=True,
    )
    assert "B/s" in capsys.readouterr().err
    NanoqwenFile(path).verify(progress=True)


# Checksums --------------------------------------------------------------------------------
def test_verify_names_every_corrupt_tensor(model):
    rng = np.random.default_rng()
    with NanoqwenFile(model) as f:
        victims = sorted(rng.choice(list(f.tensors), size=2, replace=False))
        spots = [f.tensors[v].offset + int(rng.integers(f.tensors[v].nbytes)) for v in victims]
    data = bytearray(model.read_bytes())
    for spot in spots:
        data[spot] ^= 1 << int(rng.integers(8))
    model.write_bytes(bytes(data))
    with NanoqwenFile(model) as f:  # open does not read tensor data
        with pytest.raises(FormatError, match="mismatch in 2 region") as info:
            f.verify()
    for victim in victims:
        assert f"tensor {victim} " in str(info.value)


def test_corrupt_tokenizer_blob_refused_at_open(files, model):
    offset, header = files.read_header(model.read_bytes())
    blob = header["tokenizer"]["blob"]
    patch(model, blob["offset"] + blob["nbytes"] // 2, b"\xff")
    refused(model, "tokenizer blob checksum")


def test_corrupt_header_byte_refused(files, model):
    offset, _ = files.read_header(model.read_bytes())
    patch(model, offset + 30, b"#")
    refused(model, "header checksum")


def test_tokenizer_blob_must_be_utf8(files, model):
    offset, header = files.read_header(model.read_bytes())
    blob = header["tokenizer"]["blob"]
    patch(model, blob["offset"], b"\xc3\x28")
    forge(files, model, lambda h: h["tokenizer"]["blob"].update(crc32=_crc_at(model, blob)))
    refused(model, "not valid UTF-8 at byte 0")


def _crc_at(path: Path, blob: dict) -> int:
    import zlib

    return zlib.crc32(path.read_bytes()[blob["offset"] : blob["offset"] + blob["nbytes"]])


# Preamble ---------------------------------------------------------------------------------
def test_wrong_magic(model):
    patch(model, 0, b"GGUF")
    refused(model, "not a .nanoqwen file")


def test_unknown_version_says_how_to_regenerate(model):
    patch(model, 8, struct.pack("<I", 2))
    refused(model, "format version 2", "reads version(s) 1", "nanoqwen pack")


def test_unknown_layout_says_how_to_regenerate(model):
    patch(model, 12, struct.pack("<I", 7))
    refused(model, "layout_id 7", "nanoqwen pack")


@pytest.mark.parametrize(
    "offset_len",
    [(1 << 64) - 1, 1 << 40, 0, 8],
    ids=["offset-u64-max", "offset-huge", "offset-zero", "offset-in-preamble"],
)
def test_absurd_header_offset(model, offset_len):
    patch(model, 16, struct.pack("<Q", offset_len))
    refused(model, "header")


@pytest.mark.parametrize("length", [(1 << 64) - 1, 1 << 62, 1 << 27, 0])
def test_absurd_header_length(model, length):
    patch(model, 24, struct.pack("<Q", length))
    refused(model, "header")


def test_trailing_bytes_and_reserved_field(model):
    data = model.read_bytes()
    model.write_bytes(data + b"\0")
    refused(model, "header ends at")
    model.write_bytes(data[:36] + b"\1\0\0\0" + data[40:])
    refused(model, "reserved")


def test_truncated_at_every_boundary(files, model):
    data = model.read_bytes()
    with NanoqwenFile(model) as f:
        ends = {0, 7, PREAMBLE_SIZE - 1, PREAMBLE_SIZE, ALIGNMENT}
        for t in f.tensors.values():
            ends |= {t.offset, t.offset + 1, t.offset + t.nbytes}
    header_offset, _ = files.read_header(data)
    ends |= {header_offset, header_offset + 1, (header_offset + len(data)) // 2, len(data) - 1}
    for end in sorted(ends):
        model.write_bytes(data[:end])
        with pytest.raises(FormatError):
            NanoqwenFile(model)


def test_not_a_file(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        NanoqwenFile(tmp_path / "absent.nanoqwen")
    with pytest.raises(FormatError, match="not a regular file"):
        NanoqwenFile(tmp_path)


# Forged headers ---------------------------------------------------------------------------
def _entry(header: dict, name: str) -> dict:
    return next(e for e in header["tensors"] if e["name"] == name)


def _set(name: str, **fields) -> Callable[[dict], None]:
    return lambda h: _entry(h, name).update(fields)


FORGERIES = {
    "offset-past-eof": (
        _set("final_norm", offset=1 << 40),
        "tensor final_norm: offset 1099511627776",
    ),
    "misaligned": (_set("layers.1.up_proj.scales", offset=ALIGNMENT + 16), "not 4096-aligned"),
    "wrong-shape": (_set("layers.0.k_proj.qweight", shape=[64, 15]), "expects uint32 [64, 16]"),
    "wrong-dtype": (_set("final_norm", dtype="uint32"), "tensor final_norm: uint32 [128]"),
    "bad-dtype": (
        _set("final_norm", dtype="bfloat16"),
        "is not one of float16, uint32, int8, float32",
    ),
    "wrong-nbytes": (_set("final_norm", nbytes=255), "nbytes 255 != 256"),
    "string-offset": (_set("lm_head", offset="4096"), "offset must be an integer, got a string"),
    "bool-nbytes": (_set("lm_head", nbytes=True), "nbytes must be an integer, got a boolean"),
    "negative": (_set("lm_head", offset=-4096), "outside [0"),
    "huge-int": (_set("lm_head", offset=10**400), "401-digit number"),
    "float-crc": (_set("lm_head", crc32=1.5), "crc32 must be an integer, got a number"),
    "shape-not-list": (_set("lm_head", shape={"a": 1}), "shape must be an array"),
    "zero-dim": (_set("lm_head", shape=[0, 128]), "shape entry = 0"),
    "missing": (lambda h: h["tensors"].pop(5), "missing from the tensor table"),
    "extra": (
        lambda h: h["tensors"].append({**h["tensors"][0], "name": "layers.9.extra"}),
        "tensor layers.9.extra: not part of config",
    ),
    "duplicate": (lambda h: h["tensors"].append(h["tensors"][3]), "listed twice"),
    "entry-key": (_set("final_norm", dtype2=1), "unknown field(s) dtype2"),
    "entry-not-object": (lambda h: h["tensors"].insert(0, [1, 2]), "must be an object"),
    "tensors-null": (lambda h: h.update(tensors=None), "tensors must be an array, got null"),
    "config-type": (lambda h: h["config"].update(hidden_size="128"), "config.hidden_size"),
    "config-bool": (lambda h: h["config"].update(num_layers=True), "config.num_layers"),
    "config-invalid": (lambda h: h["config"].update(num_kv_heads=3), "not a multiple"),
    "config-unknown": (lambda h: h["config"].update(rope_scaling=2), "unknown model config"),
    "config-huge-layers": (lambda h: h["config"].update(num_layers=(1 << 31) - 1), "tensors, the"),
    "quant-bits": (lambda h: h["quant"].update(bits=8), "quant bits is 8;"),
    "quant-bool": (lambda h: h["quant"].update(layout_id=True), "quant layout_id is True"),
    "top-key": (lambda h: h.pop("metadata"), "header lacks metadata"),
    "metadata-type": (lambda h: h["metadata"].update(x=1), "must be a string"),
    "eos-out-of-vocab": (lambda h: h["tokenizer"].update(eos_token_ids=[300]), "outside [0, 299]"),
    "eos-type": (lambda h: h["tokenizer"].update(eos_token_ids="299"), "must be an array"),
    "special-type": (lambda h: h["tokenizer"]["special_tokens"].update(x=[1]), "x'] must be"),
    "template-type": (lambda h: h["tokenizer"].update(chat_template=3), "chat_template must"),
    "blob-past-eof": (lambda h: h["tokenizer"]["blob"].update(nbytes=1 << 30), "runs past end"),
    "blob-in-tensor": (lambda h: h["tokenizer"]["blob"].update(offset=ALIGNMENT), "overlaps"),
}


@pytest.mark.parametrize("mutate, fragment", FORGERIES.values(), ids=FORGERIES.keys())
def test_forged_header_refused(files, model, mutate, fragment):
    NanoqwenFile(model).close()  # the unforged file opens
    forge(files, model, mutate)
    refused(model, fragment)


def test_overlapping_tensors_named(files, model):
    def overlap(header):
        _entry(header, "layers.0.o_proj.qweight")["offset"] = _entry(header, "lm_head")["offset"]

    forge(files, model, overlap)
    message = refused(model, "overlaps")
    assert "layers.0.o_proj.qweight" in message and "lm_head" in message


@pytest.mark.parametrize(
    "text, fragment",
    [
        (b'{"config": NaN}', "non-finite"),
        (b'{"a": 1e999}', "non-finite"),
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b'{"a": "\\ud800"}', "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[]", "header must be an object, got an array"),
    ],
    ids=["nan", "inf", "dup-key", "surrogate", "deep", "long-int", "not-utf8", "array"],
)
def test_malformed_header_json(files, model, text, fragment):
    offset, _ = files.read_header(model.read_bytes())
    data = model.read_bytes()
    model.write_bytes(_pack_preamble(offset, text) + data[PREAMBLE_SIZE:offset] + text)
    refused(model, fragment)


# Writer refusals and atomicity ------------------------------------------------------------
def _with(tensors: dict, name: str, value) -> list:
    return [(n, value if n == name else a) for n, a in tensors.items()]


def _bad_streams(tensors: dict) -> dict:
    norm = tensors["final_norm"]
    nan_at = norm.copy()
    nan_at[17] = np.nan
    inf_at = tensors["lm_head"].copy()
    inf_at[299, 3] = -np.inf
    return {
        "unknown": ([*tensors.items(), ("layers.0.mlp", norm)], "'layers.0.mlp' is not part"),
        "duplicate": ([*tensors.items(), ("final_norm", norm)], "final_norm: given twice"),
        "missing": (list(tensors.items())[:-2], "2 tensor(s) missing: final_norm, lm_head"),
        "float32": (_with(tensors, "final_norm", norm.astype(np.float32)), "dtype float32"),
        "big-endian": (_with(tensors, "final_norm", norm.astype(">f2")), "final_norm: dtype >f2"),
        "shape": (_with(tensors, "final_norm", norm[:-1]), "shape (127,), expected (128,)"),
        "list": (_with(tensors, "final_norm", norm.tolist()), "expected a numpy array"),
        "nan": (_with(tensors, "final_norm", nan_at), "final_norm: non-finite value nan at [17]"),
        "inf": (_with(tensors, "lm_head", inf_at), "lm_head: non-finite value -inf at [299, 3]"),
    }


@pytest.mark.parametrize(
    "case",
    ["unknown", "duplicate", "missing", "float32", "big-endian", "shape", "list", "nan", "inf"],
)
@pytest.mark.parametrize("existing", [True, False], ids=["over-old", "fresh"])
def test_writer_refuses_and_leaves_no_trace(files, tmp_path, case, existing):
    path = tmp_path / "m.nanoqwen"
    old = _old_file(files, path) if existing else None
    stream, fragment = _bad_streams(files.random_tensors(files.UNTIED, np.random.default_rng()))[
        case
    ]
    with pytest.raises(FormatError) as info:
        write_nanoqwen(path, files.UNTIED, stream, files.TOKENIZER)
    assert fragment in str(info.value)
    _assert_untouched(tmp_path, path, old)


@pytest.mark.parametrize("error", [RuntimeError("source went away"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [True, False], ids=["over-old", "fresh"])
def test_iterator_raising_midway_leaves_no_trace(files, tmp_path, error, existing):
    path = tmp_path / "m.nanoqwen"
    old = _old_file(files, path) if existing else None
    tensors = files.random_tensors(files.UNTIED, np.random.default_rng())
    cut = int(np.random.default_rng().integers(1, len(tensors)))

    def stream():
        for i, item in enumerate(tensors.items()):
            if i == cut:
                raise error
            yield item

    with pytest.raises(type(error)):
        write_nanoqwen(path, files.UNTIED, stream(), files.TOKENIZER)
    _assert_untouched(tmp_path, path, old)


def _old_file(files, path: Path) -> bytes:
    """A valid file at `path` (the one a failed write over it must leave as it was)."""
    files.write_model(path)
    return path.read_bytes()


def _assert_untouched(directory: Path, path: Path, old: bytes | None) -> None:
    assert sorted(os.listdir(directory)) == ([path.name] if old is not None else [])
    if old is not None:
        assert path.read_bytes() == old


def test_writer_checks_tokenizer(files, tmp_path):
    tensors = files.random_tensors(files.UNTIED, np.random.default_rng()).items()
    bad = TokenizerSpec("{}", None, {"im_end": 300}, (299,))
    with pytest.raises(FormatError, match="special token 'im_end' = 300 is outside"):
        write_nanoqwen(tmp_path / "m.nanoqwen", files.UNTIED, tensors, bad)
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_atomically(files, tmp_path):
    path = tmp_path / "m.nanoqwen"
    files.write_model(path, files.UNTIED)
    tensors = files.write_model(path, files.TIED, None)
    with NanoqwenFile(path) as f:
        assert f.config == files.TIED and f.tokenizer is None
        assert f.tensor("embed_tokens").tobytes() == tensors["embed_tokens"].tobytes()
    assert os.listdir(tmp_path) == [path.name]


# nanoqwen inspect -------------------------------------------------------------------------
@pytest.fixture
def cli(monkeypatch):
    from nanoqwen import cli

    monkeypatch.setattr(cli, "COMMANDS", ("inspect",))  # independent of the other commands
    return cli


def test_inspect_text(files, cli, model, capsys):
    assert cli.main(["inspect", str(model)]) == 0
    out = capsys.readouterr().out
    assert "layout_id 1" in out and "INT4 symmetric, group 128" in out
    assert "vocab 3, " in out and "chat template yes" in out and "eos [299, 297]" in out
    assert "tensors     41: float16 x27" in out and "uint32 x14" in out
    assert "per layer   2 x " in out and "source=test" in out
    assert f"({files.UNTIED.weight_bytes_per_token():,} bytes)" in out


def test_inspect_json_verify(files, cli, model, capsys):
    assert cli.main(["inspect", str(model), "--json", "--verify"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["verified"] is True and summary["file_size"] == model.stat().st_size
    assert summary["config"] == files.UNTIED.to_dict() and len(summary["tensors"]) == 41
    assert summary["tensor_bytes"] == sum(t["nbytes"] for t in summary["tensors"])
    assert summary["tokenizer"]["vocab_size"] == 3
    assert "B/s" in captured.err  # the progress bar


def test_inspect_verify_fails_on_corruption(files, cli, model, capsys):
    offset, header = files.read_header(model.read_bytes())
    entry = _entry(header, "layers.1.down_proj.qweight")
    last = entry["offset"] + entry["nbytes"] - 1
    patch(model, last, bytes([model.read_bytes()[last] ^ 0x5A]))  # always a different byte
    assert cli.main(["inspect", str(model)]) == 0  # the header is fine
    assert cli.main(["inspect", str(model), "--verify"]) == 2
    assert "tensor layers.1.down_proj.qweight (stored" in capsys.readouterr().err


def test_inspect_bad_file_exits_2(cli, tmp_path, capsys):
    (tmp_path / "x.nanoqwen").write_bytes(b"NANOQWEN" + bytes(100))
    assert cli.main(["inspect", str(tmp_path / "x.nanoqwen")]) == 2
    assert "format version 0 is not supported" in capsys.readouterr().err
