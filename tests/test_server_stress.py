"""`nanoqwen serve` under abuse: disconnects, a full queue, load, and a fatal device error.

A real server process on the tiny model (reference backend, `--max-queue 5 --max-batch 2`).
Clients that leave mid-request (before the first byte, or after a few events) must leave no
generation running and no KV page held; a burst larger than the batch and the queue gets clean
429s; the load generator (6 streaming clients, 60 requests) sees every request end in
200/429/503 with the server's RSS flat across the run; a backend raising DeviceError gets its
request a 500 and makes the process exit non-zero.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import pytest

MAX_QUEUE = 5  # 6 load clients fit (up to 2 decoding + 5 waiting); a burst of 12 does not
MAX_BATCH = 2
RSS_GROWTH_BOUND_KIB = 24 * 1024  # across 60 loaded requests, after a warm-up run
CHAT = [{"role": "user", "content": "hi"}]

FAULTY_LAUNCH = """
import sys
from nanoqwen.errors import DeviceError
from nanoqwen.llm import Batch

def step(self):
    raise DeviceError("injected cudaErrorIllegalAddress (sticky)")

Batch.step = step
from nanoqwen.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def server(serve, tiny_model):
    proc = serve(tiny_model, "--max-queue", str(MAX_QUEUE), "--max-batch", str(MAX_BATCH))
    yield proc
    proc.stop()
    assert "Traceback" not in proc.log.read_text(), proc.log.read_text()


def body(route: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    if route == "chat":
        payload = {"model": "tiny", "messages": CHAT}
        path = "/v1/chat/completions"
    else:
        payload, path = {"model": "tiny", "prompt": "def f():"}, "/v1/completions"
    return path, payload | {"max_tokens": max_tokens, "stream": stream, "temperature": 1.0}


def disconnect_early(url: str, rng: random.Random) -> None:
    """One streamed request abandoned at a random point: after a random time (before or after
    the response starts) or after a random number of SSE lines, whichever comes first."""
    path, payload = body(rng.choice(["chat", "completion"]), rng.randint(8, 400), stream=True)
    keep = rng.randint(0, 6)
    try:
        with httpx.stream("POST", url + path, json=payload, timeout=rng.uniform(0.01, 0.1)) as r:
            assert r.status_code == 200, r.read()
            for i, _ in enumerate(r.iter_lines()):
                if i >= keep:
                    break
    except httpx.TimeoutException:
        pass


def test_a_disconnect_cancels_a_long_generation(server):
    path, payload = body("chat", 3000, stream=True)  # minutes of work if nobody cancels it
    payload["temperature"] = 0.0  # greedy: the tiny model never emits EOS from this prompt
    with httpx.stream("POST", server.url + path, json=payload, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: dropping it would close the connection now
        assert next(lines).startswith("data: ")
        assert server.health()["running"] == 1
    left = time.monotonic()
    health = server.wait_idle(timeout=5.0)
    assert (health["running"], health["kv_pages_in_use"]) == (0, 0), health
    print(f"\ncancelled {time.monotonic() - left:.3f} s after the disconnect")


def test_100_random_disconnects_leave_nothing_running(server):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(100):
        disconnect_early(server.url, rng)
    health = server.wait_idle(timeout=5.0)
    assert (health["running"], health["queue_depth"], health["kv_pages_in_use"]) == (0, 0, 0), (
        f"seed {seed}: {health}"
    )


def test_burst_beyond_the_queue_gets_429(server):
    async def burst() -> list[httpx.Response]:
        path, payload = body("completion", 24, stream=False)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post(path, json=payload) for _ in range(12)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) <= MAX_BATCH + MAX_QUEUE  # MAX_QUEUE waiting behind the batch
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] >= 1
    assert server.wait_idle()["kv_pages_in_use"] == 0


def run_load(url: str, requests: int, clients: int = 6, retries: int = 30) -> tuple[Counter, float]:
    """`clients` clients each send streamed completions one after another until `requests` were
    sent in all; a 429 is sent again after its Retry-After, up to `retries` times (a finished
    client may re-send before the queue moves on). Every request ends in one outcome: its last
    HTTP status or the name of a transport error. Returns (outcome counts, slowest seconds)."""
    path, payload = body("completion", 4, stream=True)
    payload["temperature"] = 0.8
    outcomes: Counter = Counter()
    slowest, left = 0.0, [requests]

    async def send(client: httpx.AsyncClient) -> tuple[str, float]:
        try:
            async with client.stream("POST", path, json=payload) as r:
                async for _ in r.aiter_lines():
                    pass
                return str(r.status_code), float(r.headers.get("retry-after", 0))
        except httpx.HTTPError as exc:
            return type(exc).__name__, 0.0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal slowest
        while left[0] > 0:
            left[0] -= 1
            t0 = time.monotonic()
            for attempt in range(retries + 1):
                outcome, wait = await send(client)
                if outcome != "429" or attempt == retries:
                    break
                await asyncio.sleep(wait)
            outcomes[outcome] += 1
            slowest = max(slowest, time.monotonic() - t0)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(*(worker(client) for _ in range(clients)))

    asyncio.run(main())
    return outcomes, slowest


def test_load_completes_and_rss_is_flat(server):
    run_load(server.url, 6)  # warm-up: allocator pools, lazy imports, code paths
    before = server.rss_kib()
    outcomes, slowest = run_load(server.url, 60)
    after = server.rss_kib()
    assert sum(outcomes.values()) == 60 and set(outcomes) <= {"200", "429", "503"}, outcomes
    assert outcomes.get("200", 0) >= 54 and slowest < 60
    assert after - before < RSS_GROWTH_BOUND_KIB, (before, after)
    print(f"\nload: {dict(outcomes)}, slowest {slowest:.2f} s\nRSS {before} -> {after} KiB")
    assert server.wait_idle()["kv_pages_in_use"] == 0


def test_device_error_answers_500_and_exits_nonzero(serve, tiny_model):
    proc = serve(tiny_model, launch=("-c", FAULTY_LAUNCH))
    try:
        path, payload = body("chat", 4, stream=True)
        r = httpx.post(proc.url + path, json=payload, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "device_error"
        assert "injected" in r.json()["error"]["message"]
        code = proc.proc.wait(timeout=30)
    finally:
        proc.stop()
    assert code != 0 and "injected cudaErrorIllegalAddress" in proc.log.read_text()
