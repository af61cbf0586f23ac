"""Chat with a .nanoqwen model: a multi-turn session on stdin/stdout.

Each message is one user turn; the answer streams back and the whole history goes into the
next prompt. `/reset` forgets the history, `/exit` (or end of input) quits.

On a terminal the input line is edited with prompt_toolkit, as in coding-assistant CLIs: Enter
sends the message, Alt-Enter (or Esc then Enter) or Ctrl-J starts a new line, and a block
pasted into the terminal stays one message, newlines and all (bracketed paste). Up and Down
walk the history of earlier sessions, kept in chat_history in $NANOQWEN_CACHE (default
~/.cache/nanoqwen). Ctrl-C discards the message being typed (or stops the answer being
written), Ctrl-D on an empty line quits.

From a pipe (scripts, tests) each input line is one message and no prompt is printed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .generate import add_sampling_arguments, open_llm, sampling_params, stream_to_stdout

HELP = "interactive multi-turn chat (/reset, /exit; Enter sends, Alt-Enter: new line)"
HISTORY_FILE = "chat_history"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .nanoqwen model file")
    p.add_argument("--system", default=None, help="system message for the whole session")
    add_sampling_arguments(p)


def _read_lines() -> str | None:
    """The next line of a piped stdin, or None at end of input."""
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


def terminal_reader(input=None, output=None) -> Callable[[], str | None]:
    """A reader of messages typed (or pasted) on a terminal; None at end of input.

    `input` / `output` are prompt_toolkit's (the terminal when None): tests drive the same
    key bindings through a pipe input.
    """
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    from ..paths import cache_dir

    keys = KeyBindings()

    @keys.add("enter")
    def _send(event) -> None:
        event.current_buffer.validate_and_handle()

    @keys.add("escape", "enter")  # what Alt-Enter sends
    @keys.add("c-j")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    history = cache_dir()
    history.mkdir(parents=True, exist_ok=True)
    session = PromptSession(
        history=FileHistory(history / HISTORY_FILE),
        multiline=True,  # pasted newlines stay in the buffer; Enter is rebound to send
        key_bindings=keys,
        prompt_continuation="... ",
        input=input,
        output=output,
    )

    def read() -> str | None:
        while True:
            try:
                return session.prompt(">>> ")
            except KeyboardInterrupt:  # Ctrl-C: drop what was typed, ask again
                continue
            except EOFError:  # Ctrl-D on an empty line
                return None

    return read


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


def session(llm, read: Callable[[], str | None], system: str | None, params) -> None:
    """The chat loop: messages from `read` until it returns None or /exit."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while (message := read()) is not None:
        command = message.strip()
        if command == "/exit":
            break
        if command == "/reset":
            history = list(start)
            print("nanoqwen: history cleared", file=sys.stderr)
            continue
        if not command:
            continue
        reply = _answer(llm, [*history, {"role": "user", "content": message}], params)
        if reply is not None:
            history += [
                {"role": "user", "content": message},
                {"role": "assistant", "content": reply},
            ]


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    on_terminal = sys.stdin.isatty() and sys.stdout.isatty()
    read = terminal_reader() if on_terminal else _read_lines
    with open_llm(args.file, args, params.max_tokens) as llm:
        session(llm, read, args.system, params)
    return 0
