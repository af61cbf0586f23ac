"""Real weights onto the GPU host, which reaches no package registry and takes at most 64 MiB
of carried files a call: the pinned GGUF (nanoqwen.fetch) in chunks, one device call each.

    python3 dev/stage_real.py prepare 1.5b        here: fetch, split into CHUNK-byte parts
                                                  under .carry/real/1.5b/, print the calls
    python3 dev/stage_real.py receive 1.5b NN     there, one call a part, carrying only
                                                  .carry/real/1.5b/part.NN: into /tmp/real/1.5b
    python3 dev/stage_real.py join 1.5b           there: join, check size and sha256 (a bad part
                                                  fails loudly), pack to /tmp/real/1.5b.nanoqwen

The host keeps /tmp between calls only while it stays warm (about 30 s after a call), so the
calls go back to back; the last part is small enough to travel with the wheels of the call
that joins (`join --with-last`). Parts are plain byte ranges: `cat` in order is the GGUF.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from nanoqwen.fetch import MODELS, fetch_model, join

CHUNK = 60 << 20  # bytes a part: the call's 64 MiB less the tree and a margin
HERE = Path(".carry/real")  # the project's .gitignore ignores /.carry/
THERE = Path("/tmp/real")


def parts_of(model: str) -> int:
    return -(-MODELS[model].size // CHUNK)


def prepare(model: str) -> None:
    gguf = fetch_model(model)
    out = HERE / model
    out.mkdir(parents=True, exist_ok=True)
    n = parts_of(model)
    with open(gguf, "rb") as f:
        for i in range(n):
            part = out / f"part.{i:02d}"
            data = f.read(CHUNK)
            if not part.exists() or part.stat().st_size != len(data):
                part.write_bytes(data)
    print(f"{gguf.name}: {n} parts in {out}/. Device calls, back to back:")
    for i in range(n - 1):
        print(f"  carry [{str(out / f'part.{i:02d}')!r}]  "
              f"python3 dev/stage_real.py receive {model} {i:02d}")  # fmt: skip
    print(f"  carry [{str(out / f'part.{n - 1:02d}')!r}, ...]  "
          f"python3 dev/stage_real.py join {model} --with-last")  # fmt: skip


def receive(model: str, index: str) -> None:
    src = HERE / model / f"part.{index}"
    dst = THERE / model / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst.with_name(dst.name + ".tmp"))
    dst.with_name(dst.name + ".tmp").replace(dst)
    have = sorted(p.name for p in dst.parent.glob("part.??"))
    print(f"{dst}: {dst.stat().st_size} bytes; {len(have)} of {parts_of(model)} parts there")


def join_there(model: str, with_last: bool) -> None:
    n = parts_of(model)
    if with_last:
        receive(model, f"{n - 1:02d}")
    parts = [THERE / model / f"part.{i:02d}" for i in range(n)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: the host was released between calls; "
                 "send every part again, back to back")  # fmt: skip
    source = MODELS[model]
    gguf = THERE / source.filename
    join(parts, gguf, source)  # raises on a size or sha256 mismatch
    print(f"{gguf}: {source.size} bytes, sha256 {source.sha256[:16]}... verified")
    from nanoqwen.convert import pack_source

    print(pack_source(gguf, THERE / f"{model}.nanoqwen", progress=False).line())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    for verb in ("prepare", "receive", "join"):
        p = sub.add_parser(verb)
        p.add_argument("model", choices=sorted(MODELS))
        if verb == "receive":
            p.add_argument("index", help="the part's two digits")
        if verb == "join":
            p.add_argument("--with-last", action="store_true", help="receive the last part too")
    args = ap.parse_args()
    if args.verb == "prepare":
        prepare(args.model)
    elif args.verb == "receive":
        receive(args.model, args.index)
    else:
        join_there(args.model, args.with_last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
