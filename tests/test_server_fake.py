"""The server's engine worker and failure paths, in process, over a scripted fake LLM.

The fake LLM counts the tokens it produces and the KV pages it holds, so the tests can check
that a cancelled job stops within one decode step and frees its pages, that a full queue is
refused, and that a DeviceError fails the request with a 500, /health with a 503, fails the
queued requests, and asks the server to shut down.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

from nanoqwen.errors import ContextError, DeviceError  # noqa: E402
from nanoqwen.kv_pages import KVStats  # noqa: E402
from nanoqwen.llm import Delta  # noqa: E402
from nanoqwen.sampling import SamplingParams  # noqa: E402
from nanoqwen.server import Worker, create_app  # noqa: E402
from nanoqwen.server.worker import DONE, EngineDown, Job, QueueFull, post_all  # noqa: E402
from nanoqwen.speculative import SpecStats  # noqa: E402


class FakeLLM:
    """Its batch yields one Delta per token per running generation every `step_s`; raises
    DeviceError at token `fail_at` of a generation."""

    model_name = "fake"
    backend_name = "fake"
    max_context = 4096

    def __init__(self, step_s: float = 0.0, fail_at: int | None = None) -> None:
        self.step_s = step_s
        self.fail_at = fail_at
        self.produced = 0
        self.kv_stats = KVStats(pages=64, held=0, cached=0, free=64, lookup_tokens=0,
                                hit_tokens=0, evictions=0)  # fmt: skip
        self.spec_totals = SpecStats()
        self.gate = threading.Event()  # every generation waits for it before its first token
        self.gate.set()
        self.seen: list[tuple[dict, SamplingParams]] = []  # (prepare's arguments, params)
        self._prompt: dict = {}
        self.batches: list[FakeBatch] = []

    @property
    def kv_pages_in_use(self) -> int:
        return sum(b.pages for b in self.batches)

    def prepare(self, prompt=None, *, messages=None, fim=None, special_tokens="parse") -> list[int]:
        self._prompt = {"prompt": prompt, "messages": messages, "fim": fim}
        return [1, 2, 3]

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_context:
            raise ContextError(f"{prompt_len} + {max_tokens} > {self.max_context}")

    def batch(self, max_batch: int | None = None) -> FakeBatch:
        self.batches.append(FakeBatch(self, max_batch or 4))
        return self.batches[-1]


class FakeSeq:
    def __init__(self, ids, params: SamplingParams) -> None:
        self.ids, self.params, self.count, self.cancelled = ids, params, 0, False


class FakeBatch:
    """nanoqwen.llm.Batch's surface: every sequence gets a token a step; a cancelled one is
    dropped (its pages freed) at the start of the next step."""

    def __init__(self, llm: FakeLLM, max_batch: int) -> None:
        self.llm = llm
        self.scheduler = SimpleNamespace(max_batch=max_batch, active=0, waiting=[],
                                         preemptions=0, solo_moves=0)  # fmt: skip
        self.live: list[FakeSeq] = []

    @property
    def pages(self) -> int:
        return sum(1 + len(s.ids) // 16 for s in self.live)

    @property
    def has_work(self) -> bool:
        return bool(self.live)

    def add(self, ids, params: SamplingParams) -> FakeSeq:
        self.llm.seen.append((self.llm._prompt, params))
        self.live.append(FakeSeq(ids, params))
        self.scheduler.active = len(self.live)
        return self.live[-1]

    def cancel(self, seq: FakeSeq) -> None:
        seq.cancelled = True

    def clear(self) -> None:
        self.live.clear()

    def step(self) -> list[tuple[FakeSeq, Delta]]:
        self.live = [s for s in self.live if not s.cancelled]
        self.scheduler.active = len(self.live)
        if not self.live:
            return []
        self.llm.gate.wait()
        time.sleep(self.llm.step_s)
        out = []
        for seq in list(self.live):
            if seq.count == self.llm.fail_at:
                raise DeviceError("cudaErrorIllegalAddress (sticky)")
            seq.count += 1
            self.llm.produced += 1
            last = seq.count == seq.params.max_tokens
            out.append((seq, Delta("x", (99 + seq.count,), "length" if last else None)))
            if last:
                self.live.remove(seq)
        return out


async def _next(job: Job, timeout: float = 5.0):
    """The job's next event, taken as app.group_events takes it: waited for on its Arrival."""

    async def take():
        while not job.events:
            await job.arrival.wait()
        return job.events.popleft()

    return await asyncio.wait_for(take(), timeout)


async def _wait_idle(worker: Worker, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while worker.running or worker.queue_depth:
        assert time.monotonic() < deadline, "worker did not become idle"
        await asyncio.sleep(0.002)


def test_job_runs_to_done_with_every_delta() -> None:
    async def main() -> None:
        llm = FakeLLM()
        worker = Worker(llm, max_queue=2)
        worker.start()
        job = Job([1, 2], SamplingParams(max_tokens=7), asyncio.get_running_loop())
        worker.submit(job)
        events = [await _next(job) for _ in range(8)]
        assert [e.token_ids for e in events[:7]] == [(100 + i,) for i in range(7)]
        assert events[6].finish_reason == "length" and events[7] is DONE
        await _wait_idle(worker)
        assert llm.kv_pages_in_use == 0
        worker.stop()

    asyncio.run(main())


def test_cancel_stops_within_one_decode_step_and_frees_pages() -> None:
    async def main() -> None:
        llm = FakeLLM(step_s=0.003)
        worker = Worker(llm, max_queue=2)
        worker.start()
        job = Job([1] * 40, SamplingParams(max_tokens=100_000), asyncio.get_running_loop())
        worker.submit(job)
        for _ in range(5):
            await _next(job)
        assert llm.kv_pages_in_use == 3
        job.cancel()
        produced_at_cancel = llm.produced
        await _wait_idle(worker)
        assert llm.produced - produced_at_cancel <= 1, "more than one step after cancel"
        assert llm.kv_pages_in_use == 0
        worker.stop()

    asyncio.run(main())


def test_full_queue_is_refused_and_cancelled_queued_job_is_skipped() -> None:
    async def main() -> None:
        llm = FakeLLM()
        llm.gate.clear()  # the first job holds the engine until the gate opens
        worker = Worker(llm, max_queue=2, max_batch=1)
        worker.start()
        loop = asyncio.get_running_loop()
        jobs = [Job([1], SamplingParams(max_tokens=2), loop) for _ in range(3)]
        worker.submit(jobs[0])
        while not worker.running:
            await asyncio.sleep(0.001)
        worker.submit(jobs[1])
        worker.submit(jobs[2])
        assert worker.queue_depth == 2
        with pytest.raises(QueueFull, match="2 waiting"):
            worker.submit(Job([1], SamplingParams(max_tokens=2), loop))
        jobs[1].cancel()
        llm.gate.set()
        assert [await _next(jobs[2]) for _ in range(3)][-1] is DONE
        assert not jobs[1].events
        assert llm.produced == 4  # jobs 0 and 2 only
        worker.stop()

    asyncio.run(main())


def test_device_error_is_fatal_for_job_queue_and_worker() -> None:
    async def main() -> None:
        llm = FakeLLM(fail_at=2)
        llm.gate.clear()
        fatal: list[DeviceError] = []
        worker = Worker(llm, max_queue=4, on_fatal=fatal.append, max_batch=1)
        worker.start()
        loop = asyncio.get_running_loop()
        first, queued = (Job([1], SamplingParams(max_tokens=9), loop) for _ in range(2))
        worker.submit(first)
        while not worker.running:
            await asyncio.sleep(0.001)
        worker.submit(queued)
        llm.gate.set()
        events = [await _next(first) for _ in range(3)]
        assert isinstance(events[2], DeviceError)
        assert isinstance(await _next(queued), EngineDown)
        assert len(fatal) == 1 and not worker.alive
        with pytest.raises(EngineDown, match="restarting"):
            worker.submit(Job([1], SamplingParams(max_tokens=1), loop))
        worker.stop()

    asyncio.run(main())


def test_app_device_error_answers_500_then_health_503() -> None:
    async def main() -> None:
        llm = FakeLLM(fail_at=1)
        fatal: list[DeviceError] = []
        worker = Worker(llm, max_queue=4, on_fatal=fatal.append)
        worker.start()
        transport = httpx.ASGITransport(app=create_app(llm, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).json()["engine_alive"] is True
            body = {"model": "fake", "prompt": "hi", "max_tokens": 5}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "device_error"
            assert "sticky" in r.json()["error"]["message"]
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["engine_alive"] is False
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert len(fatal) == 1
        worker.stop()

    asyncio.run(main())


def test_app_stream_error_after_first_token_is_an_error_event() -> None:
    async def main() -> None:
        llm = FakeLLM(fail_at=3)
        worker = Worker(llm, max_queue=4)
        worker.start()
        transport = httpx.ASGITransport(app=create_app(llm, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "fake", "prompt": "hi", "max_tokens": 9, "stream": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            events = [line for line in r.text.split("\n\n") if line]
            assert len(events) == 5  # three text chunks, the error event, [DONE]
            assert '"code":"device_error"' in events[-2] and events[-1] == "data: [DONE]"
        worker.stop()


def test_drain_fails_the_queue_and_abort_ends_the_running_job() -> None:
    async def main() -> None:
        llm = FakeLLM(step_s=0.003)
        worker = Worker(llm, max_queue=4, max_batch=1)
        worker.start()
        loop = asyncio.get_running_loop()
        running, queued = (Job([1], SamplingParams(max_tokens=100_000), loop) for _ in range(2))
        worker.submit(running)
        await _next(running)
        worker.submit(queued)
        worker.drain()
        assert isinstance(await _next(queued), EngineDown) and not worker.alive
        with pytest.raises(EngineDown, match="shutting down"):
            worker.submit(Job([1], SamplingParams(max_tokens=1), loop))
        produced = llm.produced
        await asyncio.sleep(0.05)
        assert worker.running and llm.produced > produced + 3, "drain stopped the running job"
        worker.abort_running()
        produced = llm.produced
        while not isinstance(event := await _next(running), EngineDown):
            assert event.text == "x"  # deltas already on their way, then the error
        await _wait_idle(worker)
        assert llm.produced - produced <= 1 and llm.kv_pages_in_use == 0
        worker.stop()

    asyncio.run(main())


async def _post_then_leave(app, path: str, body: dict, leave: asyncio.Event) -> list[dict]:
    """Call the ASGI app as a server would for a client that sends `body` and disconnects
    once `leave` is set; returns the messages the app sent."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": None,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode())],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": payload, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_disconnect_cancels_a_non_streamed_request_while_tokens_flow() -> None:
    async def main() -> None:
        llm = FakeLLM(step_s=0.002)  # a token every 2 ms: the handler is never idle for long
        worker = Worker(llm, max_queue=1)
        worker.start()
        app = create_app(llm, worker)
        body = {"model": "fake", "prompt": "hi", "max_tokens": 4000}
        leave = asyncio.Event()
        task = asyncio.ensure_future(_post_then_leave(app, "/v1/completions", body, leave))
        while llm.produced < 50:
            assert not task.done(), task.result()
            await asyncio.sleep(0.002)
        produced_at_leave = llm.produced
        leave.set()
        sent = await asyncio.wait_for(task, 5)
        await _wait_idle(worker)
        assert sent[0]["status"] == 499, sent
        assert llm.produced - produced_at_leave <= 2 and llm.kv_pages_in_use == 0
        worker.stop()

    asyncio.run(main())

    asyncio.run(main())


PLUMBING = [
    (
        "/v1/completions",
        {"prompt": "p", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": "x"},
        {"prompt": "p", "messages": None, "fim": None},
        SamplingParams(0.5, 5, 0.9, 7, 16, ("x",)),  # 16: OpenAI's completions default
    ),
    (
        "/v1/completions",
        {"prompt": "a", "suffix": "b", "max_tokens": 3, "stop": ["x", "y"], "top_p": 0},
        {"prompt": None, "messages": None, "fim": ("a", "b")},
        SamplingParams(0.0, 0, 1.0, None, 3, ("x", "y")),  # top_p 0: only the top token
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "developer", "content": [{"type": "text", "text": "s"}]}]},
        {"prompt": None, "messages": [{"role": "system", "content": "s"}], "fim": None},
        SamplingParams(1.0, 0, 1.0, None, 4096 - 3, ()),  # chat default: the rest of the context
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "u"}],
            "max_tokens": 9,
            "max_completion_tokens": 2,
        },
        {"prompt": None, "messages": [{"role": "user", "content": "u"}], "fim": None},
        SamplingParams(1.0, 0, 1.0, None, 2, ()),
    ),
]


@pytest.mark.parametrize("path,fields,prompt,params", PLUMBING)
def test_request_fields_reach_prepare_and_sampling_params(path, fields, prompt, params) -> None:
    async def main() -> None:
        llm = FakeLLM()
        worker = Worker(llm, max_queue=1)
        worker.start()
        transport = httpx.ASGITransport(app=create_app(llm, worker))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(path, json={"model": "fake"} | fields)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == params.max_tokens
        assert llm.seen == [(prompt, params)]
        worker.stop()

    asyncio.run(main())


async def _until_done(job: Job) -> list:
    events = [await _next(job)]
    while events[-1] is not DONE:
        events.append(await _next(job))
    return events


def test_jobs_share_the_batch_and_a_cancel_leaves_the_others_running() -> None:
    async def main() -> None:
        llm = FakeLLM(step_s=0.002)
        worker = Worker(llm, max_queue=4, max_batch=3)
        worker.start()
        loop = asyncio.get_running_loop()
        jobs = [Job([1] * 20, SamplingParams(max_tokens=n), loop) for n in (30, 400, 30, 30)]
        for job in jobs:
            worker.submit(job)
        first = [await _next(job) for job in jobs[:3]]  # three decode together
        assert all(e.token_ids == (100,) for e in first) and worker.scheduled[0] == 3
        assert not jobs[3].events and worker.running == 3  # the fourth waits for a place
        jobs[1].cancel()
        for job in (jobs[0], jobs[2]):
            assert len(await _until_done(job)) == 29 + 1  # the other 29 deltas and DONE
        events = await _until_done(jobs[3])  # took the cancelled job's place
        assert [e.token_ids for e in events[:-1]] == [(100 + i,) for i in range(30)]
        await _wait_idle(worker)
        assert llm.kv_pages_in_use == 0 and llm.produced < 30 * 3 + 60
        worker.stop()

    asyncio.run(main())


class StubLoop:
    """An event loop's call_soon_threadsafe, recorded; `closed` raises as a closed loop does."""

    def __init__(self, closed: bool = False) -> None:
        self.calls: list[tuple] = []
        self.closed = closed

    def call_soon_threadsafe(self, callback, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((callback, args))

    def run(self) -> None:
        for callback, args in self.calls:
            callback(*args)


def test_post_all_makes_one_call_per_loop_in_order_and_cancels_on_a_closed_loop() -> None:
    loops = [StubLoop(), StubLoop(), StubLoop(closed=True)]
    a, b, c, gone = (Job([1], SamplingParams(), loop) for loop in (*loops[:2], loops[0], loops[2]))
    deltas = [Delta(str(i), (i,)) for i in range(5)]
    post_all([(a, deltas[0]), (b, deltas[1]), (gone, deltas[2]), (a, deltas[3]), (c, deltas[4]),
              (a, DONE)])  # fmt: skip
    assert [len(loop.calls) for loop in loops[:2]] == [1, 1]
    assert not a.events, "delivered before the loop ran the callback"
    for loop in loops[:2]:
        loop.run()
    assert list(a.events) == [deltas[0], deltas[3], DONE]
    assert list(b.events) == [deltas[1]] and list(c.events) == [deltas[4]]
    assert gone.cancelled.is_set() and not gone.events and not a.cancelled.is_set()
    post_all([])
    assert [len(loop.calls) for loop in loops[:2]] == [1, 1]


def test_a_step_posts_its_events_in_one_call() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        calls = []  # the engine thread's wake-ups of this loop
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        llm = FakeLLM(step_s=0.002)
        worker = Worker(llm, max_queue=4, max_batch=3)
        batch, steps = llm.batches[0], []  # the number of deltas of each step
        step = batch.step
        batch.step = lambda: steps.append(len(out := step())) or out
        worker.start()
        jobs = [Job([1], SamplingParams(max_tokens=n), loop) for n in (4, 6, 6)]
        for job in jobs:
            worker.submit(job)
        for job, n in zip(jobs, (4, 6, 6), strict=True):
            events = await _until_done(job)
            assert [e.token_ids for e in events[:-1]] == [(100 + i,) for i in range(n)]
        await _wait_idle(worker)
        assert sum(steps) == 16 and max(steps) > 1
        assert len(calls) == sum(1 for n in steps if n), "one call a step, not one per event"
        worker.stop()

    asyncio.run(main())
