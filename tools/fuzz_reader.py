"""Long fuzz run of the .nanoqwen reader (the CI version is tests/test_fileformat_fuzz.py).

    python tools/fuzz_reader.py --cases 200000 --seed 1

Writes one small valid file, then for each case mutates its preamble, header bytes or header
JSON (wrong types, huge/negative numbers, dropped/added keys, values copied from elsewhere),
opens it, and counts: accepted (then every tensor view must lie inside the file), refused
with a NanoqwenError, or anything else (a bug: printed with its case, exit status 1).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from nanoqwen.config import ModelConfig  # noqa: E402
from nanoqwen.errors import NanoqwenError  # noqa: E402
from nanoqwen.fileformat import (  # noqa: E402
    PREAMBLE_SIZE,
    NanoqwenFile,
    TokenizerSpec,
    _encode_header,
    _pack_preamble,
    write_nanoqwen,
)

CONFIG = ModelConfig("fuzz", 300, 128, 256, 2, 2, 1, 64)
NUMBERS = [0, 1, -1, 40, 4095, 4096, 4097, 2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**64, 10**40]
BYTES = b'{}[]",:-0123456789eE.tfn\\ \x00\xff'


def make_base(path: Path, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    tensors = []
    for name, (dtype, shape) in CONFIG.tensor_shapes().items():
        if dtype == "uint32":
            tensors.append((name, rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)))
        else:
            tensors.append((name, rng.standard_normal(shape).astype(np.float16)))
    tok = TokenizerSpec('{"model": {"vocab": {}}}', "{{ m }}", {"im_end": 299}, (299,))
    write_nanoqwen(path, CONFIG, tensors, tok)
    return path.read_bytes()


def random_value(r: random.Random, depth: int = 0):
    kind = r.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return r.random() < 0.5
    if kind == 2:
        return r.choice(NUMBERS) + r.choice([0, 0, 1, -1])
    if kind == 3:
        return r.uniform(-1e300, 1e300)
    if kind == 4:
        return "".join(chr(r.randrange(0x20, 0x3000)) for _ in range(r.randrange(8)))
    if kind == 5:
        return r.choice(["float16", "uint32", "lm_head", "final_norm", "offset"])
    if kind == 6:
        return [random_value(r, depth + 1) for _ in range(r.randrange(4))]
    return {str(r.randrange(9)): random_value(r, depth + 1) for _ in range(r.randrange(4))}


def json_paths(node, prefix=()):
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        yield (*prefix, key)
        yield from json_paths(child, (*prefix, key))


def mutate_json(r: random.Random, header: dict) -> None:
    paths = list(json_paths(header))
    *parents, key = r.choice(paths)
    parent = header
    for step in parents:
        parent = parent[step]
    action = r.randrange(5)
    if action == 0 and type(parent[key]) is int:
        parent[key] += r.choice([-4096, -1, 1, 4096, 1 << 32])
    elif action == 1:
        del parent[key]
    elif action == 2:
        source = header
        for step in r.choice(paths):
            source = source[step]
        parent[key] = json.loads(json.dumps(source))
    elif action == 3 and isinstance(parent, dict):
        parent[r.choice(["name", "extra", "offset", "blob"])] = random_value(r)
    else:
        parent[key] = random_value(r)


def make_case(r: random.Random, base: bytes, offset: int, header: dict) -> tuple[bytes, bytes]:
    """(preamble, header bytes) of one mutated file."""
    kind = r.randrange(3)
    if kind == 0:  # preamble fields and bits
        pre = bytearray(base[:PREAMBLE_SIZE])
        for _ in range(r.randrange(1, 3)):
            if r.random() < 0.5:
                at, fmt = r.choice([(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<I")])
                value = r.choice([v for v in NUMBERS if v >= 0]) + r.choice([0, 1])
                struct.pack_into(fmt, pre, at, value % (1 << (8 * struct.calcsize(fmt))))
            else:
                pre[r.randrange(PREAMBLE_SIZE)] ^= 1 << r.randrange(8)
        return bytes(pre), base[offset:]
    if kind == 1:  # header bytes, checksum fixed up or not
        raw = bytearray(base[offset:])
        for _ in range(r.randrange(1, 4)):
            at = r.randrange(len(raw))
            op = r.randrange(4)
            if op == 0:
                raw[at] ^= 1 << r.randrange(8)
            elif op == 1:
                raw.insert(at, r.choice(BYTES))
            elif op == 2:
                del raw[at]
            else:
                raw[at] = r.choice(BYTES)
        fix = r.random() < 0.8
        return (_pack_preamble(offset, bytes(raw)) if fix else base[:PREAMBLE_SIZE]), bytes(raw)
    tree = json.loads(json.dumps(header))
    for _ in range(r.randrange(1, 4)):
        mutate_json(r, tree)
    encoded = _encode_header(tree)
    return _pack_preamble(offset, encoded), encoded


def run_case(path: Path, offset: int, pre: bytes, header: bytes, trace: bool) -> str:
    with open(path, "r+b") as f:
        f.write(pre)
        f.seek(offset)
        f.write(header)
        f.truncate()
    size = offset + len(header)
    if trace:
        tracemalloc.start()
    try:
        opened = NanoqwenFile(path)
    except NanoqwenError:
        return "refused"
    finally:
        if trace:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < size + (256 << 10), f"open allocated {peak} bytes ({size}-byte file)"
    with opened as f:
        for info in f.tensors.values():
            assert info.offset + info.nbytes <= size and f.tensor(info.name).nbytes == info.nbytes
    return "accepted"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases", type=int, default=200_000, help="mutated files to open (default 200000)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--seconds", type=float, default=0, help="stop after this long; 0 = no limit (default 0)"
    )
    p.add_argument(
        "--trace-memory",
        action="store_true",
        default=False,
        help="check peak allocation per open (slow; default off)",
    )
    args = p.parse_args(argv)
    r = random.Random(args.seed)
    counts = {"accepted": 0, "refused": 0, "other": 0}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.nanoqwen"
        base = make_base(path, args.seed)
        offset = struct.unpack_from("<Q", base, 16)[0]
        header = json.loads(base[offset:])
        for case in range(args.cases):
            if args.seconds and time.monotonic() - start > args.seconds:
                break
            pre, raw = make_case(r, base, offset, header)
            try:
                counts[run_case(path, offset, pre, raw, args.trace_memory)] += 1
            except Exception:
                counts["other"] += 1
                print(f"case {case}: preamble {pre.hex()} header {raw[:300]!r}", file=sys.stderr)
                traceback.print_exc()
    total = sum(counts.values())
    print(
        f"{total} cases in {time.monotonic() - start:.0f} s (seed {args.seed}): "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    return 1 if counts["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
