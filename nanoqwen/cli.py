"""The `nanoqwen` command: a thin argparse front over nanoqwen/commands/*.py.

Each subcommand lives in its own module with `HELP`, `add_arguments(parser)` and
`run(args) -> int`. Modules import heavy dependencies (torch, CUDA, the HTTP stack) inside
`run`, so `nanoqwen --help` and `nanoqwen inspect` stay fast and dependency-free.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

COMMANDS = (
    "pack",
    "inspect",
    "generate",
    "chat",
    "demo",
    "kernels",
    "memory",
    "validate",
    "bench",
    "serve",
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="nanoqwen",
        description="INT4 Qwen2.5-Coder inference on NVIDIA Hopper.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nanoqwen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"nanoqwen.commands.{name}")
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _reader_left() -> int:
    """stdout's reader closed the pipe (`nanoqwen generate ... | head`): exit quietly.

    As Python's signal docs advise ("Note on SIGPIPE"): catch BrokenPipeError and point stdout
    at /dev/null, so the interpreter's final flush cannot raise it again. SIGPIPE stays ignored
    (not SIG_DFL): `serve` would otherwise die whenever a client's socket closes mid-write.
    The status is 128 + SIGPIPE = 141, what a shell reports for `cat` or `yes` ended by the
    same pipe, so a `set -o pipefail` script reads nanoqwen as any Unix tool; it cannot be
    mistaken for 1 (a check failed: bench, validate) or 2 (an error).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:  # on any outcome: a closed pipe must show here, not in the exit-time flush
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_left()


def _dispatch(argv: list[str] | None) -> int:
    from .errors import NanoqwenError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except NanoqwenError as exc:
        print(f"nanoqwen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nanoqwen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
