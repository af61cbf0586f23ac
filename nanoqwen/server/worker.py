"""The engine worker: one thread owns the LLM and runs one generation at a time (batch 1).

Requests become `Job`s in a bounded FIFO (`queue.Queue(maxsize=max_queue)`); a full queue is
refused at once (`QueueFull` -> HTTP 429) rather than letting latency grow without bound. The
worker thread pops a job, iterates `llm.stream(ids, params)` and hands every `Delta` to the
job's event loop through `loop.call_soon_threadsafe`, so the HTTP handlers await results
without ever blocking the event loop, and the engine is never touched by two threads.

Cancellation: the handler sets `job.cancelled` (client disconnected, response torn down). The
worker checks it after every delta, i.e. between decode steps, and closes the stream iterator,
which frees the generation's KV pages. A job cancelled while still queued is skipped.

Shutdown has two steps so that the server can drain: `drain` takes no more jobs and fails the
queued ones with `EngineDown` (HTTP 503) while the running one goes on; `abort_running` then
ends that one with `EngineDown` too, so its client gets an error rather than silence. A lock
orders `drain` against the thread picking its next job: once `drain` returns, no new job starts.

A `DeviceError` (sticky CUDA failure) is fatal: `on_fatal` (called on the worker thread)
tells the server to shut down so that a supervisor can restart the process, the job gets the
error, every queued job is failed with `EngineDown`, and later submissions are refused.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DeviceError, NanoqwenError
from ..sampling import SamplingParams

# The GIL switch interval while a worker runs (Python's default is 5 ms). When the engine
# thread holds the GIL (the reference backend's forward, the cuda backend's prefill launches),
# the event loop waits up to one interval each time it needs the GIL back, and sending a first
# chunk needs it several times.
SWITCH_INTERVAL_S = 2e-4


class QueueFull(NanoqwenError):
    """The bounded request queue is full; the client should retry later."""


class EngineDown(NanoqwenError):
    """The engine hit a sticky device error (or is shutting down) and takes no more work."""


class Done:
    """End-of-job marker posted after the last delta of a generation that ran to its end."""


DONE = Done()


class Job:
    """One generation request: prompt ids and params in, events out on its event loop.

    Events are `Delta`s, then `DONE`, or an exception instance if the generation failed. The
    worker thread `post`s each one; on the loop it lands in `events` and ends the wait of
    `next`, the one consumer: a future of the job's own, resolved by the callback that delivers
    the event, so the consumer's task resumes in the next loop iteration. `submitted_at` and
    `started_at` (time.monotonic(); the latter set by the worker thread when the job leaves
    the queue) give its queue wait.
    """

    def __init__(
        self, ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.ids = list(ids)
        self.params = params
        self.events: deque[Any] = deque()  # delivered, not yet taken by `next`
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self._loop = loop
        self._arrival: asyncio.Future[None] | None = None  # the wait of `next`, if one is on

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, exc: BaseException) -> None:
        """End the job with `exc` as its last event (any thread); the generation stops."""
        self.cancel()
        self.post(exc)

    def post(self, event: Any) -> None:
        """Called from the worker thread: deliver `event` on the job's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            self.cancel()

    def _deliver(self, event: Any) -> None:
        self.events.append(event)
        self.wake()

    def wake(self, *_: Any) -> None:
        """End the wait of `next` (on the loop): an event arrived, or its caller has another
        reason to look (a done-callback, e.g. of the client's disconnect)."""
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    async def next(self) -> Any:
        """The next event, waited for on the job's loop; None when `wake` ended the wait with
        no event delivered."""
        if not self.events:
            self._arrival = self._loop.create_future()
            try:
                await self._arrival
            finally:
                self._arrival = None
            if not self.events:
                return None
        return self.events.popleft()


class Worker:
    """The single engine thread and its bounded queue of pending jobs."""

    def __init__(
        self, llm: Any, max_queue: int, on_fatal: Callable[[DeviceError], None] | None = None
    ) -> None:
        if max_queue < 1:
            raise NanoqwenError(f"max_queue must be >= 1, got {max_queue}")
        self.llm = llm
        self.max_queue = max_queue
        self.fatal: DeviceError | None = None
        self.on_fatal = on_fatal
        self._pending: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running: Job | None = None
        self._stopping = False
        self._lock = threading.Lock()  # orders drain() against the thread starting a job
        self._thread = threading.Thread(target=self._serve, name="nanoqwen-engine", daemon=True)

    # Called from the event loop --------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; the interpreter's switch interval becomes
        SWITCH_INTERVAL_S (process-wide)."""
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.fatal is None and not self._stopping and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._pending.qsize()

    @property
    def running(self) -> int:
        return int(self._running is not None)

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise EngineDown / QueueFull without queueing it."""
        if not self.alive:
            raise EngineDown(self._down_message())
        try:
            self._pending.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"request queue is full ({self.max_queue} waiting)") from None

    def drain(self) -> None:
        """Take no more jobs and fail the queued ones with EngineDown; the running one goes on."""
        with self._lock:
            self._stopping = True
        self._fail_pending(EngineDown(self._down_message()))

    def abort_running(self) -> None:
        """End the running job now with EngineDown (call after `drain`)."""
        job = self._running  # read once: the thread may clear it meanwhile
        if job is not None:
            job.fail(EngineDown(self._down_message()))

    def stop(self, timeout: float = 10.0) -> None:
        """Drain, end the running job, and join the thread."""
        self.drain()
        self.abort_running()
        self._pending.put(None)  # wakes the thread; the queue was just drained
        self._thread.join(timeout)

    # The worker thread -----------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._pending.get()
            if job is None:
                return
            with self._lock:
                refused = self.fatal is not None or self._stopping
                if not refused and not job.cancelled.is_set():
                    self._running = job
            if refused:
                job.post(EngineDown(self._down_message()))
            elif self._running is job:
                job.started_at = time.monotonic()
                try:
                    self._generate(job)
                finally:
                    self._running = None

    def _generate(self, job: Job) -> None:
        stream = None
        try:
            stream = self.llm.stream(job.ids, job.params)
            for delta in stream:
                if job.cancelled.is_set():
                    return  # the finally closes the stream: KV pages are freed now
                job.post(delta)
            job.post(DONE)
        except DeviceError as exc:
            self._die(job, exc)
        except Exception as exc:  # an engine bug must not kill the worker: answer 500
            job.post(exc)
        finally:
            if stream is not None:
                stream.close()

    def _die(self, job: Job, exc: DeviceError) -> None:
        # on_fatal before the posts: whoever receives one of them finds the shutdown begun
        # (tests/test_server_fake.py checked on_fatal once it had the queued job's EngineDown,
        # and failed when the worker thread had not got that far).
        self.fatal = exc
        if self.on_fatal is not None:
            self.on_fatal(exc)
        job.post(exc)
        self._fail_pending(EngineDown(self._down_message()))

    def _fail_pending(self, exc: EngineDown) -> None:
        while True:
            try:
                job = self._pending.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.post(exc)

    def _down_message(self) -> str:
        if self.fatal is not None:
            return f"the engine failed and is restarting: {self.fatal}"
        return "server is shutting down"
