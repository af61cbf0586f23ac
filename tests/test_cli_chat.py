"""`nanoqwen chat` on a terminal: prompt_toolkit's keys (Enter sends, Alt-Enter / Ctrl-J a new
line, a bracketed paste is one message, Ctrl-C drops the line, Ctrl-D quits), the history kept
in the cache across sessions, and the whole process on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from nanoqwen.commands.chat import HISTORY_FILE, session, terminal_reader
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # what a terminal wraps a paste in
ENTER, ALT_ENTER, CTRL_C, CTRL_D = "\r", "\x1b\r", "\x03", "\x04"
CODE = "def is_prime(n):\r    return n > 1 and all(n % d for d in range(2, n))\r"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def keys(cache):
    """(send, read): type into a pipe, read the messages a terminal_reader makes of it."""
    with create_pipe_input() as pipe:
        yield pipe.send_text, terminal_reader(input=pipe, output=DummyOutput())


def test_enter_sends_and_alt_enter_or_ctrl_j_break_the_line(keys):
    send, read = keys
    send("hello" + ENTER)
    assert read() == "hello"
    send("a" + ALT_ENTER + "b\nc" + ENTER)  # "\n" is Ctrl-J
    assert read() == "a\nb\nc"


def test_a_pasted_block_is_one_message(keys):
    send, read = keys
    send(PASTE_START + CODE + PASTE_END + ENTER + "next" + ENTER)
    assert read() == CODE.replace("\r", "\n")
    assert read() == "next"


def test_ctrl_c_drops_the_line_and_ctrl_d_quits(keys):
    send, read = keys
    send("half a thought" + CTRL_C + "whole" + ENTER)
    assert read() == "whole"
    send(CTRL_D)
    assert read() is None


def test_history_survives_the_session(cache, keys):
    send, read = keys
    send("first" + ENTER + "second" + ENTER)
    assert (read(), read()) == ("first", "second")
    assert (cache / HISTORY_FILE).is_file()
    with create_pipe_input() as pipe:
        again = terminal_reader(input=pipe, output=DummyOutput())
        pipe.send_text("\x1b[A\x1b[A" + ENTER)  # Up twice: the message before the last
        assert again() == "first"


def test_session_sends_a_paste_as_one_turn(tiny_model, keys, monkeypatch):
    send, read = keys
    seen: list[list[dict]] = []
    prepare = LLM.prepare

    def spy(self, prompt=None, **kw):
        seen.append([dict(m) for m in kw["messages"]])
        return prepare(self, prompt, **kw)

    monkeypatch.setattr(LLM, "prepare", spy)
    send(PASTE_START + CODE + PASTE_END + ENTER + "/reset" + ENTER + "hi" + ENTER + CTRL_D)
    with LLM(tiny_model, backend="reference", max_context=512) as llm:
        session(llm, read, "be brief", SamplingParams(max_tokens=2))
    assert [[m["role"] for m in p] for p in seen] == [["system", "user"], ["system", "user"]]
    assert [p[-1]["content"] for p in seen] == [CODE.replace("\r", "\n"), "hi"]


# the process on a terminal -------------------------------------------------------------------


class Terminal:
    """`nanoqwen chat` with stdin and stdout on a pseudo-terminal and stderr on a pipe."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        cmd = [sys.executable, "-m", "nanoqwen.cli", *argv]
        self.proc = subprocess.Popen(
            cmd, stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env, text=True
        )
        os.close(slave)
        self.screen, self.err = bytearray(), []
        threading.Thread(target=self._read_screen, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read_screen(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the process closed the terminal
                return
            if not data:
                return
            self.screen += data

    def wait(self, what, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, f"timed out: {bytes(self.screen)!r} {self.err}"
            time.sleep(0.05)

    def prompts(self) -> int:
        """Prompts shown so far: each one turns bracketed paste on as it starts."""
        return self.screen.count(b"\x1b[?2004h")

    def answers(self) -> int:
        return sum("generated" in line for line in self.err)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


def test_chat_on_a_terminal_edits_pastes_and_keeps_history(tiny_model, tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO), "NANOQWEN_CACHE": str(tmp_path)}
    env |= {"OMP_NUM_THREADS": "1", "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    argv = ["chat", str(tiny_model), "--max-tokens", "3", "--backend", "reference"]
    term = Terminal(argv, env)
    try:
        term.wait(lambda: term.prompts() == 1)
        term.type(PASTE_START + CODE + PASTE_END + ENTER)
        term.wait(lambda: term.answers() == 1 and term.prompts() == 2)
        term.type("second" + ALT_ENTER + "line" + ENTER)
        term.wait(lambda: term.answers() == 2 and term.prompts() == 3)
        term.type(CTRL_D)
        assert term.proc.wait(timeout=30) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)
    history = (tmp_path / HISTORY_FILE).read_text()
    pasted = "".join(f"+{line}\n" for line in CODE.split("\r")[:-1]) + "+\n"
    assert pasted in history and "+second\n+line\n" in history
    assert "Traceback" not in "".join(term.err)
