"""The `nanoqwen` process as a shell sees it: exit status and stderr when stdout's reader goes
away, when a flag or a port is wrong (before any model loads or any download starts), when a
GGUF or a checkpoint directory is passed where a .nanoqwen belongs; the torch threads and the
load progress of the reference backend."""

from __future__ import annotations

import fcntl
import os
import pty
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from nanoqwen.cli import main

REPO = Path(__file__).resolve().parents[1]
SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def cli_env(tmp_path: Path) -> dict[str, str]:
    """The CLI's environment: this tree's nanoqwen, a private cache, pip kept off the network
    (a demo that wrongly got past its checks fails offline instead of downloading)."""
    env = os.environ | {"PYTHONPATH": str(REPO), "NANOQWEN_CACHE": str(tmp_path / "cache")}
    return env | {"PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1"}


def nanoqwen(tmp_path: Path, *argv: str, stdin: str = "", timeout: float = 120, **kw):
    cmd = [sys.executable, "-m", "nanoqwen.cli", *argv]
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("env", cli_env(tmp_path))
    done = subprocess.run(
        cmd, input=stdin, stderr=subprocess.PIPE, text=True, timeout=timeout, **kw
    )
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    return done


# stdout's reader went away -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, stdin",
    [
        (["generate", "{model}", "-p", "x", "--max-tokens", "50", "--backend", "reference"], ""),
        (["chat", "{model}", "--max-tokens", "20", "--backend", "reference"], "hi\nmore\n"),
        (["inspect", "--json", "{model}"], ""),
        (["pack", "--synthetic", "tiny", "-o", "{tmp}/t.nanoqwen", "--no-progress"], ""),
    ],
    ids=["generate", "chat", "inspect-json", "pack"],
)
def test_a_closed_stdout_ends_quietly_with_141(tiny_model, tmp_path, argv, stdin):
    argv = [a.format(model=tiny_model, tmp=tmp_path) for a in argv]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write to stdout fails
    try:
        done = nanoqwen(tmp_path, *argv, stdin=stdin, stdout=write)
    finally:
        os.close(write)
    assert done.returncode == SIGPIPE_STATUS, done.stderr


def test_generate_piped_into_head_stops_quietly(tiny_model, tmp_path):
    cmd = f"{sys.executable} -m nanoqwen.cli generate {tiny_model} -p x --max-tokens 300 "
    cmd += "--backend reference | head -c 1 >/dev/null; echo ${PIPESTATUS[0]} >&2"
    done = subprocess.run(
        ["bash", "-c", cmd], env=cli_env(tmp_path), stderr=subprocess.PIPE, text=True, timeout=120
    )
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == str(SIGPIPE_STATUS), done.stderr


# serve: the port and the flags, before the model loads -------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "99999"], "argument --port: must be in 1..65535, got 99999"),
        (["--max-queue", "-1"], "argument --max-queue: must be >= 1, got -1"),
    ],
)
def test_serve_refuses_bad_flags_before_loading(tiny_model, tmp_path, flags, message):
    done = nanoqwen(tmp_path, "serve", str(tiny_model), "--backend", "reference", *flags)
    assert done.returncode == 2 and message in done.stderr
    assert "loading" not in done.stderr


def test_serve_on_a_taken_port_fails_before_loading_and_never_announces(tiny_model, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = ["serve", str(tiny_model), "--port", str(port), "--backend", "reference"]
        done = nanoqwen(tmp_path, *argv)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "loading" not in done.stderr and "http://" not in done.stderr


def test_serve_names_a_host_it_cannot_resolve(tiny_model, capsys):
    assert main(["serve", str(tiny_model), "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert "cannot resolve --host no-such-host.invalid" in err and "loading" not in err


def test_serve_announces_its_url_after_the_load(tiny_model, serve):
    server = serve(tiny_model)
    log = server.log.read_text()
    assert log.index("nanoqwen: loaded in") < log.index(f"on http://127.0.0.1:{server.port}/v1")


# flags refused while parsing, whatever the command --------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "M", "--port", "0"], "--port: must be in 1..65535, got 0"),
        (["serve", "M", "--port", "http"], "--port: expected an integer, got 'http'"),
        (["serve", "M", "--threads", "0"], "--threads: must be >= 1, got 0"),
        (["generate", "M", "-p", "x", "--threads", "0"], "--threads: must be >= 1, got 0"),
        (["chat", "M", "--threads", "-2"], "--threads: must be >= 1, got -2"),
        (["demo", "--threads", "0"], "--threads: must be >= 1, got 0"),
        (["inspect", "M", "--largest", "-1"], "--largest: must be >= 0, got -1"),
        (["validate", "M", "--prompts", "0"], "--prompts: must be >= 1, got 0"),
        (["validate", "M", "--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["bench", "M", "--runs", "0"], "--runs: must be >= 1, got 0"),
        (["bench", "M", "--gen-len", "1"], "--gen-len: must be >= 2, got 1"),
    ],
)
def test_numeric_flags_are_checked_while_parsing(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_max_tokens_beyond_the_context_fails_before_loading(tiny_model, tmp_path, capsys):
    argv = ["--max-tokens", "200", "--max-context", "200"]
    message = "max_tokens 200 = 201 exceeds the context of 200"
    done = nanoqwen(tmp_path, "generate", str(tiny_model), "-p", "x", *argv)
    assert done.returncode == 2 and message in done.stderr and "loading" not in done.stderr
    assert main(["chat", str(tiny_model), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "loading" not in err


# a model that is not packed yet --------------------------------------------------------------


def test_a_gguf_gets_the_pack_command(tmp_path, capsys):
    gguf = tmp_path / "qwen-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    hint = f"{gguf} is a GGUF file, not a .nanoqwen model: pack it first: nanoqwen pack {gguf} "
    hint += f"-o {tmp_path / 'qwen-q4_k_m.nanoqwen'}"
    done = nanoqwen(tmp_path, "generate", str(gguf), "-p", "x")
    assert done.returncode == 2 and hint in done.stderr
    assert main(["chat", str(gguf)]) == 2
    assert hint in capsys.readouterr().err
    assert main(["serve", str(gguf), "--port", str(free_port())]) == 2
    assert hint in capsys.readouterr().err


def test_a_checkpoint_directory_gets_the_pack_command(tmp_path, capsys):
    ckpt = tmp_path / "Qwen2.5-Coder-1.5B-Instruct"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    packed = tmp_path / "Qwen2.5-Coder-1.5B-Instruct.nanoqwen"
    hint = f"pack it first: nanoqwen pack {ckpt} -o {packed}"
    assert main(["chat", str(ckpt)]) == 2
    assert f"is a directory, not a .nanoqwen model: {hint}" in capsys.readouterr().err
    packed.write_bytes(b"")
    assert main(["generate", str(ckpt / "model.safetensors"), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert f"is a safetensors file, not a .nanoqwen model: {hint} ({packed} exists" in err


# demo: every flag checked before the download ------------------------------------------------


def test_demo_refuses_a_bad_flag_before_downloading(tmp_path):
    done = nanoqwen(tmp_path, "demo", "--max-tokens", "-1")
    assert done.returncode == 2 and "max_tokens must be >= 1, got -1" in done.stderr
    assert not (tmp_path / "cache").exists()  # nothing fetched, not even the cache made


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["--max-tokens", "5000"], "max_tokens 5000 = 5001 exceeds the context of 4096"),
        (["--max-context", "40000"], "max_context 40000 must be in [1, 32768]"),
        (["--max-context", "0"], "max_context 0 must be in [1, 32768]"),
    ],
)
def test_demo_checks_every_flag_before_downloading(tmp_path, capsys, monkeypatch, flags, message):
    from nanoqwen import fetch

    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))

    def no_download(model):
        raise AssertionError(f"demo started downloading {model} with {flags}")

    monkeypatch.setattr(fetch, "fetch_model", no_download)
    assert main(["demo", "--backend", "reference", *flags]) == 2
    assert message in capsys.readouterr().err


# threads and the load progress of the reference backend --------------------------------------


def test_threads_flag_sets_torch_threads(tiny_model, tmp_path):
    argv = ["generate", str(tiny_model), "-p", "x", "--max-tokens", "2", "--backend", "reference"]
    done = nanoqwen(tmp_path, *argv, "--threads", "3")
    assert done.returncode == 0 and "(requested, 3 torch threads)" in done.stderr


def test_default_threads_leave_a_core_free(monkeypatch):
    from nanoqwen import reference

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for torch_default, expected in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(reference, "_TORCH_THREADS", torch_default)
        assert reference.default_threads() == expected
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(reference, "_TORCH_THREADS", 2)  # torch follows the variable
    assert reference.default_threads() == 2


def _stderr_on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe): (status, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    cmd = [sys.executable, "-m", "nanoqwen.cli", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    reader = threading.Thread(target=_drain, args=(master, chunks))
    reader.start()
    proc.stdout.read()
    rc = proc.wait(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    return rc, b"".join(chunks).decode(errors="replace")


def _drain(fd: int, chunks: list[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: every writer of the terminal is gone
            return
        if not data:
            return
        chunks.append(data)


def test_load_progress_on_a_terminal_only(tiny_model, tmp_path):
    argv = ["generate", str(tiny_model), "-p", "x", "--max-tokens", "2", "--backend", "reference"]
    rc, err = _stderr_on_a_terminal(argv, cli_env(tmp_path))
    assert rc == 0 and "(requested, 1 torch thread)" in err  # the default: $OMP_NUM_THREADS
    assert "loading tiny (0.1 GiB of float32)" in err and "2/2" in err and "layer" in err
    done = nanoqwen(tmp_path, *argv)  # stderr a pipe: the lines, no bar
    assert done.returncode == 0 and "loading " in done.stderr and "loaded in" in done.stderr
    assert "GiB of float32" not in done.stderr
