"""The .nanoqwen file: one writer (`write_nanoqwen`) beside one reader (`NanoqwenFile`).

Layout (all integers little-endian):

    [0, 40)          preamble: magic b"NANOQWEN", version u32, layout_id u32,
                     header_offset u64, header_len u64, header_crc32 u32, reserved u32 (0)
    [4096, ...)      tensors, in `ModelConfig.tensor_shapes()` order, each at a 4096-aligned
                     offset (zero padding between them)
    [..., ...)       tokenizer.json as UTF-8 (4096-aligned), when the file carries a tokenizer
    [header_offset, EOF)   header: UTF-8 JSON (config, quant params, tensor table, tokenizer
                     fields, metadata, and "lm_head": "int8" for an int8 head only: a file
                     without it has the fp16 head); it ends exactly at the end of the file

Why the header sits at the end: the writer streams tensors of a 7B model (~4.5 GB) one at a
time, each to an offset it knows up front from the config, and a tensor's checksum is known
only once it has been written. Writing the header last means no size guess and no second pass;
the preamble, patched last, points at it. Writes go to a temp file that is renamed into place,
so a reader never sees a half-written file.

Why 4096-byte alignment: a page. Any tensor can be mmapped, `cudaHostRegister`ed or read with
O_DIRECT on its own, and 16-byte vector loads and 128-byte cache lines come for free. The cost
is at most 4 KiB of padding per tensor: ~2 MiB over the ~540 tensors of a 7B file (0.05%).

Why CRC32 (zlib) per tensor: checksums here catch disk and transfer corruption, not an
adversary. Measured on this 2-core Xeon @ 2.8 GHz over 1 GiB in 16 MiB chunks (Python 3.11,
zlib 1.2.13): crc32 0.31-0.36 s (~3 GiB/s), adler32 0.42 s, sha1 0.69 s, sha256 0.94-1.07 s,
blake2b 1.45 s. CRC32 adds ~1.5 s to packing a 4.5 GB file and verifying is bound by the disk,
not the hash. The header has its own CRC32 in the preamble, so a flipped bit in an offset is
caught at open; tensor checksums are checked by `verify()` (a full read), not at open.

The reader trusts nothing: every header number is type- and range-checked before it is used,
no allocation is sized by a header number beyond the header itself (which must fit in the
file), and every region (preamble, tensors, tokenizer, header) must lie inside the file without
overlapping another.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import secrets
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .config import GROUP_SIZE, ConfigError, ModelConfig
from .errors import FormatError
from .quant import LAYOUT_VALUE_SHUFFLE, LM_HEAD_FORMATS

MAGIC = b"NANOQWEN"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
SUPPORTED_LAYOUTS = (LAYOUT_VALUE_SHUFFLE,)
ALIGNMENT = 4096
MAX_HEADER_BYTES = 64 << 20  # a 32B header is ~0.3 MiB; anything near this is garbage

_PREAMBLE = struct.Struct("<8sIIQQII")  # magic, version, layout, hdr offset, hdr len, crc, 0
PREAMBLE_SIZE = _PREAMBLE.size  # 40
_DTYPES = {
    "float16": np.dtype("<f2"),
    "uint32": np.dtype("<u4"),
    "int8": np.dtype("i1"),
    "float32": np.dtype("<f4"),
}
_DTYPE_NAMES = ", ".join(_DTYPES)
_CHUNK = 32 << 20  # bytes hashed / written / checked per step
_REGENERATE = "re-pack the model with `nanoqwen pack`"
_U63 = (1 << 63) - 1
_I31 = (1 << 31) - 1


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything the tokenizer needs, so one .nanoqwen file is self-contained.

    tokenizer_json: the Hugging Face tokenizer.json text (stored as a checksummed blob).
    chat_template: the jinja2 chat template, or None. special_tokens: name -> id (keys in
    docs/DESIGN.md). eos_token_ids: every id generation stops on.
    """

    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, int]
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: dtype (float16, uint32, or int8 / float32: an int8 lm_head),
    C-order shape, byte offset of its
    first element in the file, size in bytes, CRC32 of those bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class QuantParams:
    """The weight quantization a file declares; the defaults are all this build reads."""

    bits: int = 4
    group_size: int = GROUP_SIZE
    symmetric: bool = True
    scale_dtype: str = "float16"
    layout_id: int = LAYOUT_VALUE_SHUFFLE


QUANT = QuantParams()


# Encoding shared by the writer and tests that forge headers ----------------------------------
def _encode_header(header: dict[str, Any]) -> bytes:
    """The header dict -> the UTF-8 JSON bytes stored in the file."""
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _pack_preamble(
    header_offset: int,
    header: bytes,
    version: int = FORMAT_VERSION,
    layout_id: int = LAYOUT_VALUE_SHUFFLE,
) -> bytes:
    """The 40-byte preamble for a header of these bytes stored at `header_offset`."""
    crc = zlib.crc32(header)
    return _PREAMBLE.pack(MAGIC, version, layout_id, header_offset, len(header), crc, 0)


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _DTYPES[dtype].itemsize


def _crc(buffer: Any, progress: Any = None) -> int:
    """CRC32 of a 1-D uint8 buffer, in chunks (ticking a tqdm bar when given)."""
    crc = 0
    for start in range(0, len(buffer), _CHUNK):
        chunk = buffer[start : start + _CHUNK]
        crc = zlib.crc32(chunk, crc)
        if progress is not None:
            progress.update(len(chunk))
    return crc


# Writer ---------------------------------------------------------------------------------
def write_nanoqwen(
    path: str | os.PathLike[str],
    config: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    tokenizer: TokenizerSpec | None,
    metadata: dict[str, str] | None = None,
    progress: bool = False,
    lm_head: str = "float16",
) -> None:
    """Write a .nanoqwen file atomically, streaming `tensors` (in any order).

    Each (name, array) must be one of `config.tensor_shapes(lm_head)` with exactly that dtype
    (float16, uint32, int8 or float32, little-endian) and shape; float tensors must be
    finite. Peak memory is one tensor. On any error the temp file is removed and an existing
    `path` is untouched. `lm_head` "int8" adds the header field `"lm_head": "int8"`; a float16
    head writes no such field, so its file reads in builds that predate the field.
    """
    if lm_head not in LM_HEAD_FORMATS:
        raise FormatError(f"lm_head format {lm_head!r} is not one of {', '.join(LM_HEAD_FORMATS)}")
    plan = {
        name: (dtype, shape, _nbytes(dtype, shape))
        for name, (dtype, shape) in config.tensor_shapes(lm_head).items()
    }
    offsets, offset = {}, ALIGNMENT
    for name, (_, _, nbytes) in plan.items():
        offsets[name], offset = offset, _align(offset + nbytes)
    tok_fields, blob = None, None
    if tokenizer is not None:  # checked up front, by the reader's own rules
        tok_fields = _tokenizer_fields(tokenizer, config.vocab_size)
        blob = tokenizer.tokenizer_json.encode("utf-8")
    data_end = offset + (len(blob) if blob is not None else 0)
    meta = {"created": datetime.now(UTC).isoformat(timespec="seconds")}
    meta |= {"nanoqwen_version": __version__, **(metadata or {})}
    _check_metadata(meta)
    from tqdm import tqdm

    with (
        _atomic_file(Path(path)) as f,
        tqdm(total=data_end - ALIGNMENT, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        f.truncate(data_end)
        table = _write_tensors(f, tensors, plan, offsets, bar)
        header = {"config": config.to_dict(), "quant": QUANT.__dict__.copy(), "tensors": table}
        if lm_head != "float16":
            header["lm_head"] = lm_head
        header["tokenizer"] = tok_fields
        if blob is not None:
            bar.set_postfix_str("tokenizer", refresh=False)
            f.seek(offset)
            f.write(blob)
            bar.update(len(blob))
            tok_fields["blob"] = {"offset": offset, "nbytes": len(blob), "crc32": zlib.crc32(blob)}
        header["metadata"] = meta
        encoded = _encode_header(header)
        f.seek(data_end)
        f.write(encoded)
        f.seek(0)
        f.write(_pack_preamble(data_end, encoded))


def _write_tensors(f, tensors, plan, offsets, bar) -> list[dict[str, Any]]:
    """Place each arriving tensor at its offset; return the tensor table in config order."""
    crcs: dict[str, int] = {}
    for item in tensors:
        name, array = item
        if name not in plan:
            raise FormatError(f"tensor {name!r} is not part of this model config")
        if name in crcs:
            raise FormatError(f"tensor {name}: given twice")
        dtype, shape, nbytes = plan[name]
        flat = _checked_bytes(name, array, dtype, shape)
        bar.set_postfix_str(name, refresh=False)
        f.seek(offsets[name])
        crc = 0
        for start in range(0, nbytes, _CHUNK):
            chunk = flat[start : start + _CHUNK]
            if dtype in ("float16", "float32"):
                size = _DTYPES[dtype].itemsize
                _check_finite(name, chunk.view(_DTYPES[dtype]), start // size, shape)
            crc = zlib.crc32(chunk, crc)
            f.write(memoryview(chunk))
            bar.update(len(chunk))
        crcs[name] = crc
    missing = [name for name in plan if name not in crcs]
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if missing[5:] else "")
        raise FormatError(f"{len(missing)} tensor(s) missing: {listed}")
    return [
        {
            "name": n,
            "dtype": d,
            "shape": list(s),
            "offset": offsets[n],
            "nbytes": b,
            "crc32": crcs[n],
        }
        for n, (d, s, b) in plan.items()
    ]


def _checked_bytes(name: str, array: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array's bytes as a flat uint8 view (a copy only if it was not C-contiguous)."""
    if not isinstance(array, np.ndarray):
        raise FormatError(f"tensor {name}: expected a numpy array, got {type(array).__name__}")
    if array.dtype != _DTYPES[dtype]:
        raise FormatError(f"tensor {name}: dtype {array.dtype}, expected {dtype} little-endian")
    if array.shape != shape:
        raise FormatError(f"tensor {name}: shape {array.shape}, expected {shape}")
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _check_finite(name: str, values: np.ndarray, first: int, shape: tuple[int, ...]) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        index = tuple(int(i) for i in np.unravel_index(first + int(bad[0]), shape))
        raise FormatError(f"tensor {name}: non-finite value {values[bad[0]]} at {list(index)}")


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """Yield a temp file beside `path`; on success fsync, rename over `path`, fsync the dir.
    On any exception (KeyboardInterrupt included) the temp file is deleted."""
    directory = path.parent
    tmp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise FormatError(f"cannot create {tmp}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "r+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise FormatError(f"writing {path}: {exc.strerror or exc}") from exc
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# Validation shared by writer and reader -------------------------------------------------
def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    names |= {int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _int(value: Any, where: str, lo: int = 0, hi: int = _U63) -> int:
    if type(value) is not int:
        raise FormatError(f"{where} must be an integer, got {_kind(value)}")
    if not lo <= value <= hi:
        shown = str(value) if abs(value) < 10**30 else f"a {len(str(value))}-digit number"
        raise FormatError(f"{where} = {shown} is outside [{lo}, {hi}]")
    return value


def _object(value: Any, keys: set[str], where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise FormatError(f"{where} must be an object, got {_kind(value)}")
    missing, extra = sorted(keys - value.keys()), sorted(value.keys() - keys)
    if missing:
        raise FormatError(f"{where} lacks {', '.join(missing)}")
    if extra:
        raise FormatError(f"{where} has unknown field(s) {', '.join(x[:40] for x in extra[:5])}")
    return value


def _str_map(value: Any, where: str, values: type) -> None:
    """Check that `value` is a dict of str -> `values` (str or int)."""
    if type(value) is not dict:
        raise FormatError(f"{where} must be an object, got {_kind(value)}")
    for key, item in value.items():
        if type(key) is not str:
            raise FormatError(f"{where}: key {key!r} must be a string, got {_kind(key)}")
        if type(item) is not values:
            want = "a string" if values is str else "an integer"
            raise FormatError(f"{where}[{key[:40]!r}] must be {want}, got {_kind(item)}")


def _check_metadata(meta: Any) -> None:
    _str_map(meta, "metadata", str)


def _tokenizer_fields(spec: TokenizerSpec, vocab_size: int) -> dict[str, Any]:
    """Check a TokenizerSpec's small fields; return them as header JSON (without the blob)."""
    if type(spec.tokenizer_json) is not str:
        raise FormatError(f"tokenizer_json must be a string, got {_kind(spec.tokenizer_json)}")
    if spec.chat_template is not None and type(spec.chat_template) is not str:
        raise FormatError(
            f"tokenizer chat_template must be a string or null, got {_kind(spec.chat_template)}"
        )
    _str_map(spec.special_tokens, "tokenizer special_tokens", int)
    for key, token in spec.special_tokens.items():
        _int(token, f"tokenizer special token {key[:40]!r}", 0, vocab_size - 1)
    if type(spec.eos_token_ids) not in (tuple, list):
        raise FormatError(
            f"tokenizer eos_token_ids must be an array, got {_kind(spec.eos_token_ids)}"
        )
    for token in spec.eos_token_ids:
        _int(token, "tokenizer eos_token_ids entry", 0, vocab_size - 1)
    return {
        "chat_template": spec.chat_template,
        "special_tokens": dict(spec.special_tokens),
        "eos_token_ids": list(spec.eos_token_ids),
    }


# Reader ---------------------------------------------------------------------------------
def _reject(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text[:40]}")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key[:40]!r}")
        obj[key] = value
    return obj


def _decode_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, no lone surrogates."""
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_constant=_reject,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # lone surrogates in strings
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"header is not valid JSON: {str(exc)[:200]}") from None
    return value


def _parse_config(value: Any) -> ModelConfig:
    """Type-check every field (ints in [1, 2**31)) before ModelConfig validates the values."""
    if type(value) is not dict:
        raise FormatError(f"header config must be an object, got {_kind(value)}")
    fields = {f.name: f.type for f in ModelConfig.__dataclass_fields__.values()}
    data = dict(value)
    for name, item in value.items():
        kind = fields.get(name)
        where = f"config.{name[:40]}"
        if kind == "int":
            _int(item, where, 1, _I31)
        elif kind == "float":
            if type(item) not in (int, float):
                raise FormatError(f"{where} must be a number, got {_kind(item)}")
            data[name] = float(item)
        elif kind in ("str", "bool") and type(item) is not {"str": str, "bool": bool}[kind]:
            raise FormatError(f"{where} must be a {kind}, got {_kind(item)}")
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as exc:
        raise FormatError(f"header config: {exc}") from None


def _parse_quant(value: Any, layout_id: int) -> QuantParams:
    quant = _object(value, set(QUANT.__dict__), "header quant")
    for key, want in QUANT.__dict__.items():
        got = quant[key]
        if type(got) is not type(want) or got != want:
            raise FormatError(
                f"quant {key} is {repr(got)[:40]}; this build reads only {want!r} ({_REGENERATE})"
            )
    if layout_id != QUANT.layout_id:
        raise FormatError(f"quant layout_id {QUANT.layout_id} != preamble layout_id {layout_id}")
    return QUANT


_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes", "crc32"}
_TOKENIZER_KEYS = {"chat_template", "special_tokens", "eos_token_ids", "blob"}


def _parse_entry(i: int, entry: Any) -> TensorInfo:
    """One tensor table entry, type- and range-checked (not yet against the config)."""
    e = _object(entry, _ENTRY_KEYS, f"tensor table entry {i}")
    if type(e["name"]) is not str:
        raise FormatError(f"tensor table entry {i}: name must be a string, got {_kind(e['name'])}")
    where = f"tensor {e['name'][:80]}"
    if type(e["dtype"]) is not str or e["dtype"] not in _DTYPES:
        raise FormatError(f"{where}: dtype {str(e['dtype'])[:40]!r} is not one of {_DTYPE_NAMES}")
    if type(e["shape"]) is not list or not 1 <= len(e["shape"]) <= 4:
        raise FormatError(f"{where}: shape must be an array of 1 to 4 integers")
    shape = tuple(_int(d, f"{where}: shape entry", 1, _I31) for d in e["shape"])
    return TensorInfo(
        name=e["name"],
        dtype=e["dtype"],
        shape=shape,
        offset=_int(e["offset"], f"{where}: offset"),
        nbytes=_int(e["nbytes"], f"{where}: nbytes"),
        checksum=_int(e["crc32"], f"{where}: crc32", 0, 0xFFFFFFFF),
    )


def _tensor_count(config: ModelConfig, lm_head: str) -> int:
    """len(config.tensor_shapes(lm_head)) without building it (num_layers may be absurd)."""
    d = config.to_dict()
    one = len(ModelConfig.from_dict({**d, "num_layers": 1}).tensor_shapes(lm_head))
    two = len(ModelConfig.from_dict({**d, "num_layers": 2}).tensor_shapes(lm_head))
    return one + (config.num_layers - 1) * (two - one)


def _parse_lm_head(value: Any) -> str:
    """The optional header field "lm_head" (absent: float16, as in files before it)."""
    if type(value) is not str or value not in LM_HEAD_FORMATS:
        raise FormatError(
            f"header lm_head {str(value)[:40]!r} is not one of {', '.join(LM_HEAD_FORMATS)} "
            f"({_REGENERATE})"
        )
    return value


def _parse_tensors(value: Any, config: ModelConfig, lm_head: str) -> dict[str, TensorInfo]:
    """The tensor table: exactly the config's tensors (for this lm_head format), each with its
    dtype, shape and size."""
    if type(value) is not list:
        raise FormatError(f"header tensors must be an array, got {_kind(value)}")
    table: dict[str, TensorInfo] = {}
    for i, entry in enumerate(value):
        info = _parse_entry(i, entry)
        if info.name in table:
            raise FormatError(f"tensor {info.name}: listed twice in the tensor table")
        table[info.name] = info
    expected_count = _tensor_count(config, lm_head)
    if expected_count > len(table) + 64:  # bound what tensor_shapes() below allocates
        raise FormatError(
            f"config {config.name} has {expected_count} tensors, the table lists {len(table)}"
        )
    expected = config.tensor_shapes(lm_head)
    for name in table.keys() - expected.keys():
        raise FormatError(f"tensor {name[:80]}: not part of config {config.name}")
    for name, (dtype, shape) in expected.items():
        info = table.get(name)
        if info is None:
            raise FormatError(f"tensor {name}: missing from the tensor table")
        if (info.dtype, info.shape) != (dtype, shape):
            raise FormatError(
                f"tensor {name}: {info.dtype} {list(info.shape)} in the table, "
                f"config {config.name} expects {dtype} {list(shape)}"
            )
        if info.nbytes != _nbytes(dtype, shape):
            raise FormatError(f"tensor {name}: nbytes {info.nbytes} != {_nbytes(dtype, shape)}")
        if info.offset % ALIGNMENT:
            raise FormatError(f"tensor {name}: offset {info.offset} is not {ALIGNMENT}-aligned")
    return {name: table[name] for name in expected}


def _check_regions(regions: list[tuple[str, int, int]], file_size: int) -> None:
    """(label, offset, nbytes) regions must lie inside the file and not overlap."""
    for label, offset, nbytes in regions:
        if offset + nbytes > file_size:
            raise FormatError(
                f"{label}: offset {offset} + size {nbytes} runs past end of file ({file_size})"
            )
    ordered = sorted(regions, key=lambda r: (r[1], r[1] + r[2]))
    for (a, a_off, a_size), (b, b_off, b_size) in zip(ordered, ordered[1:], strict=False):
        if a_off + a_size > b_off:
            raise FormatError(
                f"{a} [{a_off}, {a_off + a_size}) overlaps {b} [{b_off}, {b_off + b_size})"
            )


class NanoqwenFile:
    """A validated, memory-mapped .nanoqwen file.

    Opening checks the preamble, the header checksum and every header field against the
    config, the file's bounds and each other; tensor checksums are checked by `verify()`.
    `tensor(name)` returns read-only zero-copy numpy views into the mapping. `lm_head` is the
    head's format: "float16" (also every file without the optional header field) or "int8".
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise FormatError(f"{self.path}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            self.file_size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{self.path}: not a regular file")
            if self.file_size < PREAMBLE_SIZE:
                raise FormatError(
                    f"{self.path}: {self.file_size} bytes is shorter than the "
                    f"{PREAMBLE_SIZE}-byte preamble; not a .nanoqwen file"
                )
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self._load()
        except FormatError as exc:
            self.close()
            raise FormatError(f"{self.path}: {exc}") from None
        except BaseException:
            self.close()
            raise

    # Loading ------------------------------------------------------------------------------
    def _load(self) -> None:
        fields = _PREAMBLE.unpack_from(self._mm, 0)
        magic, self.version, self.layout_id, header_offset, header_len, header_crc, zero = fields
        if magic != MAGIC:
            raise FormatError(f"not a .nanoqwen file (magic {magic!r}, expected {MAGIC!r})")
        if self.version not in SUPPORTED_VERSIONS:
            raise FormatError(
                f"format version {self.version} is not supported; this build reads version(s) "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}: {_REGENERATE}"
            )
        if self.layout_id not in SUPPORTED_LAYOUTS:
            raise FormatError(
                f"weight layout_id {self.layout_id} is not supported; this build reads "
                f"layout_id(s) {', '.join(map(str, SUPPORTED_LAYOUTS))}: {_REGENERATE}"
            )
        if zero:
            raise FormatError(f"preamble reserved field is {zero}, expected 0")
        header = self._read_header(header_offset, header_len, header_crc)
        if type(header) is dict and "lm_head" in header:
            header = dict(header)
            self.lm_head = _parse_lm_head(header.pop("lm_head"))
        else:
            self.lm_head = "float16"
        top = _object(header, {"config", "quant", "tensors", "tokenizer", "metadata"}, "header")
        self.config = _parse_config(top["config"])
        self.quant = _parse_quant(top["quant"], self.layout_id)
        _check_metadata(top["metadata"])
        self.metadata: dict[str, str] = top["metadata"]
        self.tensors = _parse_tensors(top["tensors"], self.config, self.lm_head)
        regions = [("preamble", 0, PREAMBLE_SIZE), ("header", header_offset, header_len)]
        regions += [(f"tensor {t.name}", t.offset, t.nbytes) for t in self.tensors.values()]
        self._blob: tuple[int, int, int] | None = None
        if top["tokenizer"] is not None:
            blob = _object(top["tokenizer"], _TOKENIZER_KEYS, "header tokenizer")["blob"]
            blob = _object(blob, {"offset", "nbytes", "crc32"}, "tokenizer blob")
            where = "tokenizer blob"
            self._blob = (
                _int(blob["offset"], f"{where} offset"),
                _int(blob["nbytes"], f"{where} nbytes"),
                _int(blob["crc32"], f"{where} crc32", 0, 0xFFFFFFFF),
            )
            regions.append((where, *self._blob[:2]))
        _check_regions(regions, self.file_size)
        self.tokenizer = self._load_tokenizer(top["tokenizer"])

    def _read_header(self, offset: int, length: int, crc: int) -> Any:
        size = self.file_size
        if not 0 < length <= MAX_HEADER_BYTES:
            raise FormatError(f"header length {length} is outside [1, {MAX_HEADER_BYTES}]")
        if offset < PREAMBLE_SIZE or offset + length > size:
            raise FormatError(
                f"header: offset {offset} + size {length} runs past end of file ({size}) "
                f"or into the preamble; the file may be truncated"
            )
        if offset + length != size:
            raise FormatError(f"header ends at {offset + length}, the file at {size}")
        data = self._mm[offset : offset + length]
        if zlib.crc32(data) != crc:
            raise FormatError(f"header checksum {zlib.crc32(data):08x} != {crc:08x} (corrupt)")
        return _decode_json(data)

    def _load_tokenizer(self, fields: dict[str, Any] | None) -> TokenizerSpec | None:
        """Decode the checksummed tokenizer.json blob and check the small fields."""
        if fields is None:
            return None
        offset, nbytes, crc = self._blob
        data = self._mm[offset : offset + nbytes]
        if zlib.crc32(data) != crc:
            raise FormatError(f"tokenizer blob checksum {zlib.crc32(data):08x} != {crc:08x}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(
                f"tokenizer blob is not valid UTF-8 at byte {exc.start}: {exc.reason}"
            ) from None
        eos = fields["eos_token_ids"]
        if type(eos) is not list:
            raise FormatError(f"tokenizer eos_token_ids must be an array, got {_kind(eos)}")
        spec = TokenizerSpec(text, fields["chat_template"], fields["special_tokens"], tuple(eos))
        _tokenizer_fields(spec, self.config.vocab_size)
        return spec

    # Access -------------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """Read-only zero-copy view of one tensor: its dtype and shape."""
        info = self.tensors.get(name)
        if info is None:
            hint = ""
            if name == "lm_head":
                hint = (" (an int8 head: lm_head.q8 and lm_head.scale)" if self.lm_head == "int8"
                        else " (tied embeddings: read embed_tokens)")  # fmt: skip
            raise FormatError(f"{self.path}: no tensor {name!r} in this file{hint}")
        dtype = _DTYPES[info.dtype]
        view = np.frombuffer(self._open(), dtype, math.prod(info.shape), info.offset)
        return view.reshape(info.shape)

    def verify(self, progress: bool = False) -> None:
        """Check the CRC32 of every tensor and the tokenizer blob (reads the whole file)."""
        from tqdm import tqdm

        regions = [
            (f"tensor {t.name}", t.offset, t.nbytes, t.checksum) for t in self.tensors.values()
        ]
        if self._blob is not None:
            regions.append(("tokenizer blob", *self._blob))
        bad = []
        total = sum(r[2] for r in regions)
        with (
            memoryview(self._open()) as view,
            tqdm(total=total, unit="B", unit_scale=True, disable=not progress) as bar,
        ):
            for label, offset, nbytes, want in regions:
                bar.set_postfix_str(label, refresh=False)
                got = _crc(view[offset : offset + nbytes], bar)
                if got != want:
                    bad.append(f"{label} (stored {want:08x}, computed {got:08x})")
        if bad:
            raise FormatError(
                f"{self.path}: checksum mismatch in {len(bad)} region(s): {'; '.join(bad)}"
            )

    def _open(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"{self.path}: file is closed")
        return self._mm

    def close(self) -> None:
        """Unmap the file. Views from `tensor()` that are still alive keep the mapping."""
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # live views: unmapped when they go
                mm.close()

    def __enter__(self) -> NanoqwenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NanoqwenFile({str(self.path)!r}, config={self.config.name!r})"
