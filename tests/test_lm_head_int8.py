"""The opt-in int8 lm_head (`pack --lm-head int8`) on the CPU: the row quantizer, the file
format (new tensors, the optional header field, old files still load), the pack paths (tied,
untied, re-pack of a .nanoqwen), the reference's dequantization, the memory plan, and the
refusal of speculation over an int8 head. The kernel's compile (no spills, every preset) is
test_kernels_compile's `nanoqwen kernels` test; dev/lm_head_int8.py checks it on a GPU."""

import json
import struct
import zlib

import numpy as np
import pytest

from nanoqwen.config import preset
from nanoqwen.convert import _int8_head, pack_source, pack_synthetic
from nanoqwen.engine.weights import check_speculation_head, weight_bytes
from nanoqwen.errors import FormatError, NanoqwenError
from nanoqwen.fileformat import NanoqwenFile, write_nanoqwen
from nanoqwen.quant import Q8_MAX, QuantError, dequantize_rows_int8, quantize_rows_int8


def _tensors(config, rng, lm_head="float16"):
    out = {}
    for name, (dtype, shape) in config.tensor_shapes(lm_head).items():
        if dtype == "uint32":
            out[name] = rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
        elif dtype == "int8":
            out[name] = rng.integers(-Q8_MAX, Q8_MAX + 1, size=shape, dtype=np.int8)
        else:
            out[name] = (rng.standard_normal(shape) * 3).astype(dtype)
    return out


# -- the quantizer -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 128), (3, 896), (17, 3584)])
def test_row_quantizer_bounds(shape):
    rng = np.random.default_rng()
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2, (shape[0], 1))).astype(np.float16)
    q, scale = quantize_rows_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (shape[0],)
    assert np.abs(q.astype(np.int32)).max() <= Q8_MAX
    back = dequantize_rows_int8(q, scale)
    err = np.abs(back - w.astype(np.float32))
    # Round to nearest: half a step, plus float32 rounding of w / scale near a tie.
    assert (err <= scale[:, None] * (0.5 + 1e-5)).all()
    # Each row's largest magnitude lands on +-127 exactly.
    top = np.abs(w.astype(np.float32)).argmax(axis=1)
    assert (np.abs(q[np.arange(shape[0]), top]) == Q8_MAX).all()


def test_row_quantizer_zero_row_and_bad_input():
    w = np.zeros((2, 128), np.float16)
    w[1, 5] = -1.0
    q, scale = quantize_rows_int8(w)
    assert scale[0] == 0 and not q[0].any() and q[1, 5] == -Q8_MAX
    with pytest.raises(QuantError, match="non-finite"):
        quantize_rows_int8(np.full((1, 128), np.inf, np.float32))
    with pytest.raises(QuantError, match="2-D"):
        quantize_rows_int8(np.zeros(128, np.float32))


# -- the file format ----------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_int8_file_round_trip(tmp_path, files, tied):
    cfg = files.TIED if tied else files.UNTIED
    tensors = _tensors(cfg, np.random.default_rng(), "int8")
    path = tmp_path / "m.nanoqwen"
    write_nanoqwen(path, cfg, tensors.items(), files.TOKENIZER, lm_head="int8")
    _, header = files.read_header(path.read_bytes())
    assert header["lm_head"] == "int8"
    with NanoqwenFile(path) as f:
        f.verify()
        assert f.lm_head == "int8" and "lm_head" not in f.tensors
        assert "embed_tokens" in f.tensors  # the lookup's fp16 table, tied or not
        assert f.tensor("lm_head.q8").dtype == np.int8
        assert f.tensor("lm_head.scale").shape == (cfg.vocab_size,)
        for name, array in tensors.items():
            np.testing.assert_array_equal(f.tensor(name), array)
        with pytest.raises(FormatError, match="an int8 head: lm_head.q8"):
            f.tensor("lm_head")


def test_old_style_file_loads_as_fp16(tmp_path, files):
    """A float16 head writes no header field: its files are byte for byte what builds before
    the field wrote, and such a file reads with lm_head float16."""
    path = tmp_path / "old.nanoqwen"
    files.write_model(path)
    _, header = files.read_header(path.read_bytes())
    assert set(header) == {"config", "quant", "tensors", "tokenizer", "metadata"}
    with NanoqwenFile(path) as f:
        assert f.lm_head == "float16" and f.tensor("lm_head").dtype == np.float16


def _rewrite_header(path, edit):
    """Apply `edit` to the header dict of the file at `path` (preamble patched to match)."""
    data = bytearray(path.read_bytes())
    offset, length = struct.unpack_from("<QQ", data, 16)
    header = json.loads(data[offset : offset + length])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    data[offset:] = blob
    struct.pack_into("<QQI", data, 16, offset, len(blob), zlib.crc32(blob))
    path.write_bytes(bytes(data))


def test_header_field_is_checked(tmp_path, files):
    path = tmp_path / "m.nanoqwen"
    files.write_model(path)
    _rewrite_header(path, lambda h: h.update(lm_head="float16"))  # explicit default: fine
    with NanoqwenFile(path) as f:
        assert f.lm_head == "float16"
    _rewrite_header(path, lambda h: h.update(lm_head="int8"))  # table still has the fp16 head
    with pytest.raises(FormatError, match="tensor lm_head"):
        NanoqwenFile(path)
    for bad in ("bfloat16", 8, None):
        _rewrite_header(path, lambda h, bad=bad: h.update(lm_head=bad))
        with pytest.raises(FormatError, match="header lm_head"):
            NanoqwenFile(path)


def test_writer_refuses_a_mismatched_head(tmp_path, files):
    tensors = _tensors(files.UNTIED, np.random.default_rng())  # fp16 head
    with pytest.raises(FormatError, match="lm_head"):
        write_nanoqwen(tmp_path / "x.nanoqwen", files.UNTIED, tensors.items(), None,
                       lm_head="int8")  # fmt: skip
    with pytest.raises(FormatError, match="not one of"):
        write_nanoqwen(tmp_path / "x.nanoqwen", files.UNTIED, tensors.items(), None,
                       lm_head="int4")  # fmt: skip


# -- packing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_int8_head_stream(files, tied):
    """The pack stream: the fp16 head (or, tied, the embedding, kept) quantized in its place."""
    cfg = files.TIED if tied else files.UNTIED
    src = _tensors(cfg, np.random.default_rng())
    if tied:
        src["lm_head"] = src["embed_tokens"]  # a tied source may carry it; it is dropped
    out = dict(_int8_head(cfg, src.items()))
    assert set(out) == set(cfg.tensor_shapes("int8"))
    head = src["embed_tokens" if tied else "lm_head"]
    q, scale = quantize_rows_int8(head)
    np.testing.assert_array_equal(out["lm_head.q8"], q)
    np.testing.assert_array_equal(out["lm_head.scale"], scale)
    np.testing.assert_array_equal(out["embed_tokens"], src["embed_tokens"])


def test_repack_and_reference(tmp_path, tiny_model):
    """Re-pack the tiny (tied) model with an int8 head: every other tensor is copied; the
    reference's head is the dequantized int8 one and its embedding stays the fp16 table."""
    torch = pytest.importorskip("torch")
    from nanoqwen.reference import ReferenceBackend

    out = tmp_path / "tiny-int8.nanoqwen"
    summary = pack_source(tiny_model, out, progress=False, lm_head="int8")
    assert summary.tensors == len(preset("tiny").tensor_shapes("int8"))
    with NanoqwenFile(tiny_model) as a, NanoqwenFile(out) as b:
        assert b.lm_head == "int8" and b.metadata["lm_head"] == "int8"
        for name in a.tensors:
            np.testing.assert_array_equal(a.tensor(name), b.tensor(name))
        q, scale = b.tensor("lm_head.q8"), b.tensor("lm_head.scale")
        want_q, want_scale = quantize_rows_int8(a.tensor("embed_tokens"))
        np.testing.assert_array_equal(q, want_q)
        np.testing.assert_array_equal(scale, want_scale)
        ref = ReferenceBackend(b, max_context=32)
        want = torch.from_numpy(dequantize_rows_int8(q, scale))
        assert torch.equal(ref.model.lm_head.float().cpu(), want)
        embed = torch.from_numpy(a.tensor("embed_tokens").astype(np.float32))
        assert torch.equal(ref.model.embed_tokens.float().cpu(), embed)
    with pytest.raises(NanoqwenError, match="its head is int8"):
        pack_source(out, tmp_path / "again.nanoqwen", progress=False, lm_head="int8")
    with pytest.raises(NanoqwenError, match="an output other than the source"):
        pack_source(tiny_model, tiny_model, progress=False, lm_head="int8")


def test_pack_synthetic_int8(tmp_path):
    out = tmp_path / "s.nanoqwen"
    pack_synthetic("tiny", out, seed=1, progress=False, lm_head="int8")
    with NanoqwenFile(out) as f:
        assert f.lm_head == "int8"
        f.verify()


def test_pack_cli_flag(tmp_path, tiny_model, capsys):
    from nanoqwen.cli import main

    out = tmp_path / "cli.nanoqwen"
    assert main(["pack", str(tiny_model), "-o", str(out), "--lm-head", "int8",
                 "--no-progress"]) == 0  # fmt: skip
    assert main(["inspect", str(out)]) == 0
    assert "lm_head     int8 rows" in capsys.readouterr().out


# -- the engine's side --------------------------------------------------------------------------
def test_memory_plan_and_bytes_per_token():
    """Untied (7B): the head's V x H fp16 bytes become V x H int8 + 4 V. Tied (0.5B): the int8
    head is a buffer beside the embedding, and the step reads it instead of the fp16 table."""
    c7, c05 = preset("7b"), preset("0.5b")
    vh = c7.vocab_size * c7.hidden_size
    saved = weight_bytes(c7) - weight_bytes(c7, "int8")
    assert 0 <= vh - 4 * c7.vocab_size - saved < 2 * (2 << 20)  # allocations round to 2 MiB
    assert c7.weight_bytes_per_token() - c7.weight_bytes_per_token("int8") == (
        vh - 4 * c7.vocab_size
    )
    vh = c05.vocab_size * c05.hidden_size
    assert weight_bytes(c05, "int8") > weight_bytes(c05) + vh
    assert c05.weight_bytes_per_token() - c05.weight_bytes_per_token("int8") == (
        vh - 4 * c05.vocab_size
    )


def test_speculation_refuses_an_int8_head():
    check_speculation_head("float16")
    with pytest.raises(NanoqwenError, match="speculative decoding needs the fp16 lm_head"):
        check_speculation_head("int8")


def _byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm(x, y, s): result byte i is byte (s >> 4 i) & 7 of the 8 bytes y:x."""
    pool = (y << 32) | x
    return sum(((pool >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_kernel_int8_to_float_trick():
    """decode_misc.cu dot_q8x8: byte `lo` of a word of int8 values, sign bit flipped, permuted
    into the low byte of 2^23 (selector 0x7650 + lo), minus 2^23 + 128, is the signed byte."""
    for value in range(-128, 128):
        for lo in range(4):
            word = (value & 0xFF) << (8 * lo) | (0x5A << (8 * ((lo + 1) % 4)))  # a neighbour
            bits = _byte_perm(word ^ 0x80808080, 0x4B000000, 0x7650 + lo)
            f = struct.unpack("<f", struct.pack("<I", bits))[0]
            assert np.float32(f) - np.float32(8388608 + 128) == value
