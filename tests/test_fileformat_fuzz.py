"""Fuzz the .nanoqwen reader: mutated preambles, header bytes and header JSON.

Every case must either open (and then every tensor view lies inside the file, and verify()
either passes or raises FormatError) or raise a NanoqwenError. Any other exception fails, and
so does an open whose peak Python allocation exceeds the file size plus a small constant: no
header number may size an allocation.

Each test runs NANOQWEN_FUZZ_CASES cases when that is set, its CI count (300 preambles, 800
header byte edits, 1000 header JSON mutations) otherwise; the long run:

    NANOQWEN_FUZZ_CASES=200000 python -m pytest -q tests/test_fileformat_fuzz.py
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoqwen.errors import NanoqwenError
from nanoqwen.fileformat import PREAMBLE_SIZE, NanoqwenFile, _encode_header, _pack_preamble

SLACK = 256 << 10  # bytes beyond the file size an open may allocate (JSON objects, tables)


def fuzz_settings(ci_cases: int) -> settings:
    """`ci_cases` examples, or NANOQWEN_FUZZ_CASES when set."""
    cases = int(os.environ.get("NANOQWEN_FUZZ_CASES") or ci_cases)
    return settings(max_examples=cases, deadline=None, suppress_health_check=[HealthCheck.too_slow])


INTERESTING = [0, 1, -1, 7, 40, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63]
INTERESTING += [2**64 - 1, 2**64, 10**30, -(2**63)]


@dataclass(frozen=True)
class Base:
    """A valid small file (`data`, header at `offset`) and a scratch copy at `path`."""

    path: Path
    data: bytes = field(repr=False)
    offset: int


@pytest.fixture(scope="module")
def base(tmp_path_factory, files) -> Base:
    path = tmp_path_factory.mktemp("fuzz") / "case.nanoqwen"
    files.write_model(path, files.UNTIED, files.TOKENIZER)
    data = path.read_bytes()
    return Base(path, data, files.read_header(data)[0])


def check(base: Base, preamble: bytes, header: bytes) -> bool:
    """Open the base file with this preamble and header; True if it was accepted.

    Only the preamble and header of the scratch file are rewritten (the data region stays).
    Fails on any non-nanoqwen exception, or if the open's peak allocation exceeds the file
    size plus SLACK.
    """
    with open(base.path, "r+b") as f:
        f.write(preamble)
        f.seek(base.offset)
        f.write(header)
        f.truncate()
    size = base.offset + len(header)
    tracemalloc.start()
    try:
        opened = NanoqwenFile(base.path)
    except NanoqwenError:
        return False
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < size + SLACK, f"open allocated {peak} bytes for a {size}-byte file"
    with opened as f:
        for info in f.tensors.values():
            assert 0 <= info.offset and info.offset + info.nbytes <= size
            assert f.tensor(info.name).nbytes == info.nbytes
        try:
            f.verify()
        except NanoqwenError:
            pass
    return True


# Preamble ---------------------------------------------------------------------------------
FIELDS = {"version": (8, "<I"), "layout": (12, "<I"), "offset": (16, "<Q"), "length": (24, "<Q")}
FIELDS |= {"crc": (32, "<I"), "reserved": (36, "<I")}
u64 = st.one_of(
    st.sampled_from([v for v in INTERESTING if 0 <= v < 2**64]), st.integers(0, 2**64 - 1)
)


@fuzz_settings(300)
@given(
    edits=st.lists(st.tuples(st.sampled_from(sorted(FIELDS)), u64), max_size=3),
    flips=st.lists(st.integers(0, PREAMBLE_SIZE * 8 - 1), max_size=3),
)
def test_fuzz_preamble(base, edits, flips):
    pre = bytearray(base.data[:PREAMBLE_SIZE])
    for name, value in edits:
        at, fmt = FIELDS[name]
        struct.pack_into(fmt, pre, at, value % (1 << (8 * struct.calcsize(fmt))))
    for bit in flips:
        pre[bit // 8] ^= 1 << (bit % 8)
    accepted = check(base, bytes(pre), base.data[base.offset :])
    assert accepted == (bytes(pre) == base.data[:PREAMBLE_SIZE])


# Header bytes -----------------------------------------------------------------------------
edit = st.tuples(
    st.sampled_from(["flip", "insert", "delete", "set"]),
    st.floats(0, 1, exclude_max=True),
    st.sampled_from(list(b'{}[]",:-0123456789eE.tfn\\ \x00\xff')),
)


@fuzz_settings(800)
@given(edits=st.lists(edit, min_size=1, max_size=4), fix_preamble=st.booleans())
def test_fuzz_header_bytes(base, edits, fix_preamble):
    header = bytearray(base.data[base.offset :])
    for kind, where, byte in edits:
        at = int(where * len(header))
        if kind == "flip":
            header[at] ^= 1 << (byte % 8)
        elif kind == "insert":
            header.insert(at, byte)
        elif kind == "delete" and len(header) > 1:
            del header[at]
        else:
            header[at] = byte
    pre = _pack_preamble(base.offset, bytes(header)) if fix_preamble else base.data[:PREAMBLE_SIZE]
    check(base, pre, bytes(header))


# Header JSON ------------------------------------------------------------------------------
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INTERESTING),
        st.integers(),
        st.integers(-(10**300), 10**300),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.sampled_from(["float16", "uint32", "embed_tokens", "lm_head", "layers.0.q_proj.bias"]),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def paths(node, prefix=()) -> list[tuple]:
    """Every path (tuple of keys/indices) to a node of a JSON tree, the root excluded."""
    children = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    out = []
    for key, child in children:
        out.append((*prefix, key))
        out.extend(paths(child, (*prefix, key)))
    return out


def mutate(header, draw) -> None:
    """One JSON-level mutation at a random path: replace, nudge, drop, or add."""
    target = draw(st.sampled_from(paths(header)))
    parent = header
    for key in target[:-1]:
        parent = parent[key]
    key, old = target[-1], parent[target[-1]]
    kind = draw(st.sampled_from(["replace", "nudge", "drop", "add", "copy"]))
    if kind == "nudge" and type(old) is int:
        parent[key] = old + draw(st.sampled_from([-4096, -1, 1, 2, 4096, 1 << 32]))
    elif kind == "drop":
        del parent[key]
    elif kind == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["name", "offset", "extra", "blob", "bits"]))] = draw(
            json_values
        )
    elif kind == "add" and isinstance(parent, list):
        parent.insert(key, draw(json_values))
    elif kind == "copy":  # a value from elsewhere in the header: plausible but wrong
        source = header
        for step in draw(st.sampled_from(paths(header))):
            source = source[step]
        parent[key] = json.loads(json.dumps(source))
    else:
        parent[key] = draw(json_values)


@fuzz_settings(1000)
@given(data=st.data(), count=st.integers(1, 4))
def test_fuzz_header_json(files, base, data, count):
    _, header = files.read_header(base.data)
    for _ in range(count):
        mutate(header, data.draw)
    encoded = _encode_header(header)
    check(base, _pack_preamble(base.offset, encoded), encoded)


def test_fuzz_harness_accepts_the_valid_file(files, base):
    assert check(base, base.data[:PREAMBLE_SIZE], base.data[base.offset :])
    _, header = files.read_header(base.data)
    encoded = _encode_header(header)
    assert encoded == base.data[base.offset :]  # the forged encoding is the writer's
    assert check(base, _pack_preamble(base.offset, encoded), encoded)
    assert not check(base, b"NANOQWEM" + base.data[8:PREAMBLE_SIZE], encoded)
