"""Generate one completion from a .nanoqwen model, streaming the text to stdout.

The prompt is a raw completion prompt (-p, `-p -` reads stdin; special-token text in it such
as <|fim_prefix|> becomes the control token unless --special-tokens text), one chat message
through the model's ChatML template (--chat, optionally with --system), or a
fill-in-the-middle request (--fim-prefix / --fim-suffix). The backend picked and a statistics
line go to stderr, so stdout holds only the generated text.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .argtypes import int_range

HELP = "generate a completion (raw prompt, one chat message, or fill-in-the-middle)"


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate, chat and demo: backend, context and sampling."""
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; None = random")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop string, repeatable; the text ends before it",
    )
    add_backend_arguments(p)


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("auto", "cuda", "reference"),
        default="auto",
        help="auto: cuda on an sm_90 GPU, else the PyTorch reference on the CPU",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context positions to allocate; None = 4096 on reference, 32768 on cuda",
    )
    p.add_argument(
        "--threads",
        type=int_range(1),
        default=None,
        help="torch threads of the reference backend; None = $OMP_NUM_THREADS if set, else "
        "the physical cores - 1 (at least 1): a thread that shares its core stalls every op",
    )
    add_k_cache_argument(p)
    add_speculative_arguments(p)


def add_k_cache_argument(p: argparse.ArgumentParser) -> None:
    """--k-cache: the cuda backend's K cache format (nanoqwen.cuda.registry.K_CACHE)."""
    from ..cuda.registry import DEFAULT_K_CACHE, K_CACHE

    p.add_argument(
        "--k-cache",
        choices=tuple(K_CACHE),
        default=DEFAULT_K_CACHE,
        help="cuda backend: the K cache's format. fp16x2 keeps each key as an fp16 (hi, lo) "
        "pair, exact to ~22 bits (the default: fp16 keys were the largest rounding left); fp16 "
        "takes 2/3 of the KV memory and attention's bytes, for long contexts and big batches",
    )


def add_speculative_arguments(p: argparse.ArgumentParser, method: bool = True) -> None:
    """--speculate (when `method`), --spec-k, --spec-ngram, --spec-backoff:
    nanoqwen.speculative.resolve's inputs."""
    from ..speculative import (
        DEFAULT_SPECULATE,
        MAX_BACKOFF,
        MAX_DRAFT_TOKENS,
        SPECULATE_CHOICES,
        SpeculativeConfig,
    )

    base = SpeculativeConfig()
    if method:
        p.add_argument(
            "--speculate",
            choices=SPECULATE_CHOICES,
            default=DEFAULT_SPECULATE,
            help="speculative decoding: 'ngram' drafts tokens by prompt lookup (n-grams of the "
            "prompt and reply) and verifies them in one step; greedy output is unchanged",
        )
    p.add_argument(
        "--spec-k",
        type=int_range(1, MAX_DRAFT_TOKENS),
        default=base.k,
        help="speculation: most draft tokens verified a step",
    )
    p.add_argument(
        "--spec-ngram",
        default=f"{base.n_min}:{base.n_max}",
        metavar="MIN:MAX",
        help="speculation: n-gram sizes to look up, longest first",
    )
    p.add_argument(
        "--spec-backoff",
        type=int_range(0, MAX_BACKOFF),
        default=base.backoff_cap,
        metavar="CAP",
        help="speculation: after 2, 3, 4, .. steps in a row that accepted no draft, drop the "
        "next 1, 2, 4, .. found drafts (doubling up to CAP, reset by any accepted draft); "
        "0 = never",
    )


def speculative_config(args: argparse.Namespace, method: str | None = None):
    """The SpeculativeConfig the flags ask for (None: off); `method` overrides --speculate."""
    from ..speculative import resolve

    return resolve(method or args.speculate, args.spec_k, args.spec_ngram, args.spec_backoff)


def add_special_tokens_argument(p: argparse.ArgumentParser, what: str) -> None:
    """--special-tokens: how `what` encode special-token text (LLM.prepare's special_tokens)."""
    p.add_argument(
        "--special-tokens",
        choices=("parse", "text"),
        default="parse",
        help=f"{what}: 'parse' makes special-token text such as <|fim_prefix|> the control "
        "token (as vLLM and llama.cpp do), 'text' keeps it text; chat messages are always text",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .nanoqwen model file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", default=None, help="raw prompt text ('-' reads stdin)")
    source.add_argument("--chat", default=None, metavar="MESSAGE", help="one user chat message")
    source.add_argument("--fim-prefix", default=None, help="code before the gap (FIM)")
    p.add_argument("--fim-suffix", default="", help="code after the gap (with --fim-prefix)")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_special_tokens_argument(p, "raw prompts (-p)")
    add_sampling_arguments(p)


def sampling_params(args: argparse.Namespace):
    from ..sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )


def require_packed(path) -> None:
    """Refuse what `nanoqwen pack` converts (a GGUF file, a Hugging Face checkpoint directory
    or one of its .safetensors files), naming the command that packs it."""
    from ..errors import NanoqwenError

    given = Path(path)
    if given.suffix.lower() == ".gguf":
        kind, source = "a GGUF file", given
        out = given.with_suffix(".nanoqwen")
    elif given.suffix.lower() == ".safetensors" or given.is_dir():
        kind = "a directory" if given.is_dir() else "a safetensors file"
        source = given.resolve() if given.is_dir() else given.resolve().parent
        out = source.with_name(source.name + ".nanoqwen")
    else:
        return
    done = f" ({out} exists already: pass that)" if out.exists() else ""
    raise NanoqwenError(
        f"{given} is {kind}, not a .nanoqwen model: pack it first: nanoqwen pack "
        f"{shlex.quote(str(source))} -o {shlex.quote(str(out))}{done}"
    )


def open_llm(path, args: argparse.Namespace, max_tokens: int | None = None,
             max_batch: int | None = None):  # fmt: skip
    """Load the model, saying on stderr which backend (and how many threads) it gets, with a
    load progress bar when stderr is a terminal. A `max_tokens` that leaves no room for a
    prompt in the context fails before the load (it reads only the file's header);
    max_batch: the reference backend's batch slots (LLM's)."""
    from ..backend import check_fits
    from ..errors import NanoqwenError
    from ..fileformat import NanoqwenFile
    from ..llm import LLM, choose_backend, context_size

    require_packed(path)
    speculative = speculative_config(args)  # a bad --spec-ngram fails before the load
    backend, reason = choose_backend(args.backend)
    if max_tokens is not None:
        with NanoqwenFile(path) as f:
            check_fits(1, max_tokens, context_size(args.max_context, backend, f.config))
    if backend == "reference":
        try:
            from ..reference import set_threads
        except ImportError as exc:
            raise NanoqwenError(
                f"the reference backend needs PyTorch ({exc}): pip install 'nanoqwen[reference]'"
            ) from None
        threads = set_threads(args.threads)
        reason += f", {threads} torch thread{'s' * (threads > 1)}"
    if speculative:
        reason += f", speculative {speculative.method} k={speculative.k}"
    print(f"nanoqwen: backend {backend} ({reason}); loading {path}", file=sys.stderr)
    start = time.perf_counter()
    llm = LLM(path, backend=backend, max_context=args.max_context, progress=sys.stderr.isatty(),
              speculative=speculative, max_batch=max_batch, k_cache=args.k_cache)  # fmt: skip
    print(f"nanoqwen: loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return llm


def stream_to_stdout(llm, ids, params) -> tuple[str, str]:
    """Stream a completion to stdout (flushed per delta); stats on stderr. (text, finish)."""
    start = time.perf_counter()
    first = None  # when the first token arrived (prefill + one step)
    count, parts, finish, cached, spec = 0, [], "length", 0, None
    for delta in llm.stream(ids, params):
        first = first or time.perf_counter()
        count += len(delta.token_ids)
        cached += delta.cached_tokens
        spec = delta.speculative or spec
        parts.append(delta.text)
        finish = delta.finish_reason or finish
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    end = time.perf_counter()
    text = "".join(parts)
    if text and not text.endswith("\n"):
        sys.stdout.write("\n")
    first = first or end
    rate = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    print(
        f"nanoqwen: prompt {len(ids)} tokens ({cached} cached), generated {count} tokens in "
        f"{end - start:.2f} s "
        f"(first after {first - start:.2f} s, then {rate:.1f} tokens/s), finish {finish}"
        + (f"; {spec.summary()}" if spec else ""),
        file=sys.stderr,
    )
    return text, finish


def _prompt_ids(llm, args: argparse.Namespace) -> list[int]:
    if args.fim_prefix is not None:
        return llm.prepare(fim=(args.fim_prefix, args.fim_suffix))
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        return llm.prepare(messages=[*messages, {"role": "user", "content": args.chat}])
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return llm.prepare(prompt=prompt, special_tokens=args.special_tokens)


def _check_combinations(args: argparse.Namespace) -> None:
    from ..errors import NanoqwenError

    if args.system is not None and args.chat is None:
        raise NanoqwenError("--system goes with --chat")
    if args.fim_suffix and args.fim_prefix is None:
        raise NanoqwenError("--fim-suffix goes with --fim-prefix")


def run(args: argparse.Namespace) -> int:
    _check_combinations(args)
    params = sampling_params(args)
    with open_llm(args.file, args, params.max_tokens) as llm:
        ids = _prompt_ids(llm, args)
        stream_to_stdout(llm, ids, params)
    return 0
