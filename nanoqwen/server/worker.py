"""The engine worker: one thread owns the LLM and decodes every admitted request together.

Requests become `Job`s in a bounded FIFO (`queue.Queue(maxsize=max_queue)`); a full queue is
refused at once (`QueueFull` -> HTTP 429) rather than letting latency grow without bound. The
worker thread moves queued jobs into the LLM's `Batch` (nanoqwen.llm, over the scheduler of
nanoqwen.batching) while fewer than `max_batch` are in it, runs one batch step (cancellations,
admissions, a bounded prefill chunk, one decode step for every running sequence) and hands the
step's `Delta`s to their jobs' event loop through `loop.call_soon_threadsafe`, so the HTTP
handlers await results without ever blocking the event loop, and the engine is never touched by
two threads. A step's events go in one call per event loop (`post_all`), not one per event:
the calls are made on the engine thread between two steps, where nothing hides their cost, and
the loop is woken once a step and runs the step's deliveries together. With `max_batch` 1 it
runs one generation at a time, as a batch-1 server does.

Cancellation: the handler sets `job.cancelled` (client disconnected, response torn down). The
worker checks it before every step and cancels the job's sequence, which the step then frees
(KV pages released, slot freed) before it runs anything. A job cancelled while still queued is
skipped.

Shutdown has two steps so that the server can drain: `drain` takes no more jobs and fails the
queued ones with `EngineDown` (HTTP 503) while the running ones go on; `abort_running` then
ends those with `EngineDown` too, so their clients get an error rather than silence. A lock
orders `drain` against the thread taking a job: once `drain` returns, no new job starts.

A `DeviceError` (sticky CUDA failure) is fatal: `on_fatal` (called on the worker thread)
tells the server to shut down so that a supervisor can restart the process, every running job
gets the error, every queued job is failed with `EngineDown`, and later submissions are
refused. Any other exception of a step (an engine bug) fails the batch's jobs with it (HTTP
500) and the worker goes on with an empty batch.
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


class Arrival:
    """A wait on an event loop for the next event of one or more jobs, or for another reason
    to look (a done-callback's `wake`, e.g. of the client's disconnect): a future made for each
    wait, resolved by the callback that delivers an event, so the waiting task resumes in the
    next loop iteration."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None  # the wait, if one is on

    def wake(self, *_: Any) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        self._future = self._loop.create_future()
        try:
            await self._future
        finally:
            self._future = None


class Job:
    """One generation request: prompt ids and params in, events out on its event loop.

    Events are `Delta`s, then `DONE`, or an exception instance if the generation failed. The
    worker thread `post`s each one; on the loop it lands in `events` and wakes `arrival`, which
    the one consumer waits on (`app.group_events`, which gives the jobs of a request one
    Arrival). `submitted_at` and `started_at` (time.monotonic(); the latter set by the
    worker thread when the job leaves the queue) give its queue wait.
    """

    def __init__(
        self, ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.ids = list(ids)
        self.params = params
        self.events: deque[Any] = deque()  # delivered, not yet taken by the consumer
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.arrival = Arrival(loop)
        self._loop = loop

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, exc: BaseException) -> None:
        """End the job with `exc` as its last event (any thread); the generation stops."""
        self.cancel()
        self.post(exc)

    def post(self, event: Any) -> None:
        """Called from the worker thread: deliver `event` on the job's event loop."""
        post_all([(self, event)])

    def _deliver(self, event: Any) -> None:
        self.events.append(event)
        self.arrival.wake()


def post_all(events: list[tuple[Job, Any]]) -> None:
    """Deliver each (job, event) on its job's event loop, in order: one call_soon_threadsafe
    per loop (module docstring). A job whose loop is closed (the server is gone, nobody is
    listening) is cancelled."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Any]]] = {}
    for job, event in events:
        by_loop.setdefault(job._loop, []).append((job, event))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, pairs)
        except RuntimeError:
            for job, _ in pairs:
                job.cancel()


def _deliver_all(events: list[tuple[Job, Any]]) -> None:
    for job, event in events:
        job._deliver(event)


class Worker:
    """The single engine thread, its bounded queue of pending jobs and its batch."""

    def __init__(
        self,
        llm: Any,
        max_queue: int,
        on_fatal: Callable[[DeviceError], None] | None = None,
        max_batch: int | None = None,
    ) -> None:
        """max_batch: jobs decoded together (None: the backend's max_batch)."""
        if max_queue < 1:
            raise NanoqwenError(f"max_queue must be >= 1, got {max_queue}")
        self.llm = llm
        self.max_queue = max_queue
        self.fatal: DeviceError | None = None
        self.on_fatal = on_fatal
        self._batch = llm.batch(max_batch)
        self.max_batch = self._batch.scheduler.max_batch
        self._pending: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._jobs: dict[Any, Job] = {}  # its sequence -> a job taken from the queue, not ended
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
        """Jobs taken from the queue and not ended (decoding, prefilling or preempted)."""
        return len(self._jobs)

    @property
    def scheduled(self) -> tuple[int, int, int, int]:
        """(sequences admitted or decoding solo, sequences waiting for admission, preemptions
        so far, moves between solo and the batch so far) of the batch's scheduler; waiting
        counts preempted ones, not the queue."""
        s = self._batch.scheduler
        return s.active, len(s.waiting), s.preemptions, s.solo_moves

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise EngineDown / QueueFull without queueing it."""
        if not self.alive:
            raise EngineDown(self._down_message())
        try:
            self._pending.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"request queue is full ({self.max_queue} waiting)") from None

    def drain(self) -> None:
        """Take no more jobs and fail the queued ones with EngineDown; running ones go on."""
        with self._lock:
            self._stopping = True
        self._fail_pending(EngineDown(self._down_message()))

    def abort_running(self) -> None:
        """End the running jobs now with EngineDown (call after `drain`)."""
        for job in list(self._jobs.values()):  # a snapshot: the thread may change the dict
            job.fail(EngineDown(self._down_message()))

    def stop(self, timeout: float = 10.0) -> None:
        """Drain, end the running jobs, and join the thread."""
        self.drain()
        self.abort_running()
        self._pending.put(None)  # wakes the thread; the queue was just drained
        self._thread.join(timeout)

    # The worker thread -----------------------------------------------------------------
    def _serve(self) -> None:
        while self._take(block=not self._batch.has_work):
            for seq, job in list(self._jobs.items()):
                if job.cancelled.is_set():
                    self._batch.cancel(seq)  # freed by the step below
                    del self._jobs[seq]
            if self._batch.has_work:
                self._step()
        self._batch.clear()

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the batch while it has room, waiting for the first one when
        `block` (nothing to step); False on stop()'s wake-up."""
        while len(self._jobs) < self.max_batch:
            try:
                job = self._pending.get(block=block)
            except queue.Empty:
                return True
            block = False
            if job is None:
                return False
            with self._lock:
                refused = self.fatal is not None or self._stopping
            if refused:
                job.post(EngineDown(self._down_message()))
            elif not job.cancelled.is_set():
                job.started_at = time.monotonic()
                try:
                    self._jobs[self._batch.add(job.ids, job.params)] = job
                except Exception as exc:  # checked by the handler already: an engine bug
                    job.post(exc)
        return True

    def _step(self) -> None:
        try:
            out = self._batch.step()
        except DeviceError as exc:
            self._die(exc)
            return
        except Exception as exc:  # an engine bug must not kill the worker: answer 500
            self._fail_running(exc)
            return
        events: list[tuple[Job, Any]] = []
        for seq, delta in out:
            job = self._jobs.get(seq)
            if job is None or job.cancelled.is_set():
                continue  # cancelled: the next round frees it
            events.append((job, delta))
            if delta.finish_reason:
                events.append((job, DONE))
                del self._jobs[seq]
        post_all(events)

    def _fail_running(self, exc: BaseException) -> None:
        """Every job in the batch gets `exc`; the batch is emptied (pages and slots freed)."""
        jobs = list(self._jobs.values())
        self._jobs.clear()
        post_all([(job, exc) for job in jobs])
        self._batch.clear()

    def _die(self, exc: DeviceError) -> None:
        # on_fatal before the posts: whoever receives one of them finds the shutdown begun
        # (tests/test_server_fake.py checked on_fatal once it had the queued job's EngineDown,
        # and failed when the worker thread had not got that far).
        self.fatal = exc
        if self.on_fatal is not None:
            self.on_fatal(exc)
        self._fail_running(exc)
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
