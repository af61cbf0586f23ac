"""Shared fixtures: the kernel cache, the tiny synthetic model, small .nanoqwen files, and a
`nanoqwen serve` process.

Module-level helpers here are reached through fixtures (`files`, `serve`, `sse_events`), so
that no test module imports another.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nanoqwen.config import ModelConfig
from nanoqwen.fileformat import TokenizerSpec, write_nanoqwen
from nanoqwen.harness import import_torch_first
from nanoqwen.paths import cache_dir

import_torch_first()  # GPU tests take the reference after an engine has built its kernels

REPO = Path(__file__).resolve().parents[1]
CLI = ("-m", "nanoqwen.cli")


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (modules of tiny-model tests take it with `pytestmark`):
    tiny models do microsecond matmuls, waking a second OpenMP thread costs more than the work,
    and on a busy 2-core CI box two threads made the reference tests 15x slower than one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    """A kernel cache of this test session (NANOQWEN_CACHE from here on): each kernel compiles
    once per session, and never from a stale cache of another checkout."""
    path = tmp_path_factory.getbasetemp() / "kcache"
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOQWEN_CACHE", str(path))
    mp.delenv("NANOQWEN_NO_COMPILE", raising=False)
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny synthetic model (seed 0; byte-level tokenizer with the Qwen2.5 specials)."""
    from nanoqwen.convert import pack_synthetic

    path = tmp_path_factory.mktemp("tiny") / "tiny.nanoqwen"
    pack_synthetic("tiny", path, seed=0, progress=False)
    return path


@pytest.fixture(scope="session")
def real_model() -> Path:
    """A packed real Qwen2.5-Coder file: NANOQWEN_REAL_MODEL, or the 0.5B that `nanoqwen demo
    --model 0.5b` packs into the cache; the test is skipped without one."""
    default = cache_dir() / "qwen2.5-coder-0.5b-instruct.nanoqwen"
    path = Path(os.environ.get("NANOQWEN_REAL_MODEL") or default)
    if not path.is_file():
        pytest.skip(f"no real model at {path} (NANOQWEN_REAL_MODEL)")
    return path


# -- small .nanoqwen files (the reader's tests) ------------------------------------------------
UNTIED = ModelConfig("t", 300, 128, 256, 2, 2, 1, 64)
TIED = ModelConfig("t-tied", 301, 256, 384, 3, 4, 2, 64, tie_word_embeddings=True)
TOKENIZER = TokenizerSpec(
    tokenizer_json=json.dumps({"model": {"vocab": {"a": 0, "é": 1, "Ġ𝄞": 2}}}, ensure_ascii=False),
    chat_template="{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
    special_tokens={"endoftext": 297, "im_start": 298, "im_end": 299},
    eos_token_ids=(299, 297),
)


def random_tensors(config: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random tensors of every name/dtype/shape the config lists."""
    out = {}
    for name, (dtype, shape) in config.tensor_shapes().items():
        if dtype == "uint32":
            out[name] = rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
        else:
            out[name] = (rng.standard_normal(shape) * 3).astype(np.float16)
    return out


def write_model(path: Path, config=UNTIED, tokenizer=TOKENIZER, seed=None) -> dict:
    """Write a valid file with tensors in a random order; return the tensors."""
    rng = np.random.default_rng(seed)
    tensors = random_tensors(config, rng)
    order = list(tensors.items())
    rng.shuffle(order)
    write_nanoqwen(path, config, order, tokenizer, {"source": "test"})
    return tensors


def read_header(data: bytes) -> tuple[int, dict]:
    """(header_offset, header dict) of a valid file's bytes."""
    offset, length = struct.unpack_from("<QQ", data, 16)
    return offset, json.loads(data[offset : offset + length])


@pytest.fixture(scope="session")
def files() -> SimpleNamespace:
    """Small configs (UNTIED, TIED), a TOKENIZER, and random_tensors / write_model /
    read_header for files of them."""
    return SimpleNamespace(UNTIED=UNTIED, TIED=TIED, TOKENIZER=TOKENIZER,
                           random_tensors=random_tensors, write_model=write_model,
                           read_header=read_header)  # fmt: skip


# -- nanoqwen serve as a real process ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python <launch> serve MODEL --port P --backend reference ...` with its log in a file."""

    def __init__(self, model: Path, log: Path, *args: str, launch: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launch = launch or CLI
        cmd = [sys.executable, *launch, "serve", str(model), "--port", str(self.port)]
        cmd += ["--backend", "reference", "--log-level", "warning", *args]
        # One torch thread: the tiny model's ops are too small to split, and CI has 2 cores.
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Until /health answers 200; if it never does (or the wait is interrupted), the
        process is stopped before the error propagates."""
        try:
            self._poll_health(timeout)
        except BaseException:
            self.stop()
            raise

    def _poll_health(self, timeout: float) -> None:
        import httpx  # the serve tests' dependency only: a GPU image may lack it

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log.read_text()}")

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=5.0).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """/health once nothing runs or waits and every KV page is free."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            idle = (health["running"], health["queue_depth"], health["kv_pages_in_use"]) == (
                0,
                0,
                0,
            )
            if idle or time.monotonic() > deadline:
                return health
            time.sleep(0.02)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server ignored SIGTERM:\n{self.log.read_text()}") from None


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body, with "[DONE]" kept as a string; checks the framing."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="session")
def serve(tmp_path_factory):
    """serve(model, *args, launch=()) -> a healthy ServerProcess (reference backend), its log
    under the session's temp dir; stopped at the end of the session if still running."""
    started: list[ServerProcess] = []

    def start(model: Path, *args: str, launch: tuple[str, ...] = ()) -> ServerProcess:
        log = tmp_path_factory.mktemp("serve") / "serve.log"
        proc = ServerProcess(model, log, *args, launch=launch)
        started.append(proc)
        proc.wait_healthy()
        return proc

    yield start
    for proc in started:
        if proc.proc.poll() is None:
            proc.stop()


@pytest.fixture(scope="session", name="sse_events")
def sse_events_fixture():
    return sse_events
