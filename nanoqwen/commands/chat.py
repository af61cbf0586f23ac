"""Chat with a .nanoqwen model: a multi-turn session on stdin/stdout.

Each input line is one user message; the answer streams back and the whole history goes into
the next prompt. `/reset` forgets the history, `/exit` (or end of input) quits. Works with a
pipe on stdin (no prompt is printed then), so sessions can be scripted.
"""

from __future__ import annotations

import argparse
import sys

from .generate import add_sampling_arguments, open_llm, sampling_params, stream_to_stdout

HELP = "interactive multi-turn chat (/reset, /exit)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .nanoqwen model file")
    p.add_argument("--system", default=None, help="system message for the whole session")
    add_sampling_arguments(p)


def _read_line(interactive: bool) -> str | None:
    """The next user line, or None at end of input."""
    if interactive:
        sys.stdout.write(">>> ")
        sys.stdout.flush()
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def _answer(llm, history: list[dict[str, str]], params) -> str | None:
    """Stream the reply to `history`; None if it did not fit (the history is left alone)."""
    from ..errors import ContextError

    try:
        ids = llm.prepare(messages=history)
        llm.check_fits(len(ids), params.max_tokens)
    except ContextError as exc:
        print(f"nanoqwen: {exc}; /reset to start over", file=sys.stderr)
        return None
    try:
        text, _ = stream_to_stdout(llm, ids, params)
    except KeyboardInterrupt:  # Ctrl-C stops this answer, not the session
        print("\nnanoqwen: answer interrupted", file=sys.stderr)
        return None
    return text


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    with open_llm(args.file, args) as llm:
        history = list(system)
        while (line := _read_line(interactive)) is not None:
            command = line.strip()
            if command == "/exit":
                break
            if command == "/reset":
                history = list(system)
                print("nanoqwen: history cleared", file=sys.stderr)
                continue
            if not command:
                continue
            reply = _answer(llm, [*history, {"role": "user", "content": line}], params)
            if reply is not None:
                history += [
                    {"role": "user", "content": line},
                    {"role": "assistant", "content": reply},
                ]
    return 0
