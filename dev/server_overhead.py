"""The server's host cost per token under concurrency, over a stand-in engine (CPU or GPU host).

    python3 -m nanoqwen.cli pack --synthetic tiny -o /tmp/tiny.nanoqwen
    PYTHONPATH=. python3 dev/server_overhead.py /tmp/tiny.nanoqwen [--step-ms 3] \
        [--levels 1,4,8,16] [--max-tokens 128] [--rounds 3] [--wait sleep,block,spin] \
        [--profile DIR] [--gil-check] [--json OUT.json]

The engine is `nanoqwen.harness.paced.PacedLLM`: the model file's tokenizer and the real LLM
front end (scheduler, detokenizer, stop strings) over a backend whose every step takes
--step-ms and does nothing else. For each --wait kind (`sleep` releases the GIL during the
step, as the cuda backend's stream sync does if cuda.bindings releases it; `block` holds it in
a blocking C call, as a binding that does not; `spin` holds it in a Python loop) and each N:

    scheduler N streams through the bare Scheduler stepped in a loop (bench --concurrency's
              measurement): per-stream ITL
    offline   the same through `LLM.batch()` (the server's engine loop: the text front end
              added, no HTTP)
    online    `nanoqwen serve` (the CLI's own path: uvicorn on a loopback port, the engine
              worker, the app) in a child process over the same stand-in, dev/load_test.py's
              clients in this process: N clients, each streaming --rounds completions of
              --max-tokens one after another; per-stream ITL (p50 of the streams' medians),
              p99 of every gap, TTFT p50

and the host's cost per step that the step does not hide: the mean ITL minus --step-ms, offline
(the scheduler and the text) and online (that plus the server); their difference is the
server's. Beside them, from the server process: the stand-in's median gap before a step (how
long its device sat idle: the engine thread's host work that no queued step hid, GIL waits
included; 0 while the scheduler runs one step behind) and wait (a sleep overshoots; with `block`
it also holds the wait for the GIL once the C call returns), and the CPU time of the event
loop thread per token and of the engine thread per step.

The server runs in its own process, as `nanoqwen serve` does under dev/load_test.py on the
GPU host: clients in the server's process would take the GIL from its event loop and engine
thread. An in-process httpx.ASGITransport would skip uvicorn's protocol and the socket writes,
which are part of the cost measured.

--gil-check (GPU host): first, does the batch step's wait release the GIL? The host waits for
a step in the sync of a fence recorded after it (`Gpu.fence`, cuda.core's Event.sync); a host
function on the stream (libc's usleep, run by the driver's own thread) keeps it busy
GIL_CHECK_MS while another Python thread counts, and the count rate during the sync is printed
beside the rate during a time.sleep: about the same, the bindings release the GIL (read the
`sleep` rows); near zero, they hold it (read the `block` rows).

--profile DIR: the server process also runs cProfile in its event loop thread and in the
engine thread, and writes DIR/{loop,engine}_<wait>.pstats at exit (the figures are then not
comparable: the profiler slows Python code several times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import load_test  # noqa: E402 (dev/ is not a package)

GIL_CHECK_MS = 20
# argv[1] of the server process: `nanoqwen serve` over the stand-in; argv[2:8] are the step
# in seconds, the wait kind, the profile directory ("-": none), the model file, the port and
# the file where a SIGUSR1 writes the stand-in's step times since the last one (JSON).
SERVE = "--serve"
PORT = 8019
PROMPT = "def f(x):\n    return x + 1\n\n" * 8  # 216 tokens of the byte-level tokenizer


def serve(step_s: float, wait: str, profile: str, file: str, port: int, times: str) -> int:
    """`nanoqwen serve FILE` as the CLI runs it, its LLM a PacedLLM; SIGUSR1 writes the
    stand-in's (gaps, waits) since the last SIGUSR1 to `times`."""
    from nanoqwen import cli
    from nanoqwen.commands import serve as serve_command
    from nanoqwen.harness.paced import PacedLLM

    opened = []

    def open_paced(path, args, max_batch=None):
        opened.append(PacedLLM(path, step_s, wait, max_batch=max_batch or 16))
        return opened[-1]

    def write_times(*_) -> None:  # on the main thread, between two bytecodes of the loop
        (engine,) = [t for t in threading.enumerate() if t.name == "nanoqwen-engine"]
        gaps, waits = opened[0].backend.take_times()
        cpu = {"loop": time.thread_time(),
               "engine": time.clock_gettime(time.pthread_getcpuclockid(engine.ident))}  # fmt: skip
        Path(times + ".tmp").write_text(json.dumps({"gaps": gaps, "waits": waits, "cpu": cpu}))
        Path(times + ".tmp").replace(times)  # whole or not there

    signal.signal(signal.SIGUSR1, write_times)
    serve_command.open_llm = open_paced
    argv = ["serve", file, "--port", str(port), "--max-batch", "16", "--log-level", "warning"]
    if profile == "-":
        return cli.main(argv)
    return profiled(lambda: cli.main(argv), Path(profile), wait)


def profiled(main, out: Path, wait: str) -> int:
    """Run `main` with cProfile on this thread (the event loop) and on the engine thread."""
    import cProfile

    from nanoqwen.server import worker

    out.mkdir(parents=True, exist_ok=True)
    serve_thread = worker.Worker._serve

    def engine(self) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            serve_thread(self)
        finally:
            prof.disable()
            prof.dump_stats(out / f"engine_{wait}.pstats")

    worker.Worker._serve = engine
    prof = cProfile.Profile()
    prof.enable()
    try:
        return main()
    finally:
        prof.disable()
        prof.dump_stats(out / f"loop_{wait}.pstats")


def gil_check() -> dict:
    """Python steps per second on another thread while this one waits in a fence's sync and
    in time.sleep (module docstring)."""
    import ctypes

    from cuda.bindings import driver

    from nanoqwen.cuda.device import Gpu, check

    gpu = Gpu()
    usleep = driver.CUhostFn(ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value)
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    def synced() -> None:
        check(driver.cuLaunchHostFunc(gpu.stream.handle, usleep, GIL_CHECK_MS * 1000), "host fn")
        gpu.fence().sync()

    thread = threading.Thread(target=counter)
    thread.start()
    rates = {}
    try:
        for name, wait in (("sync", synced), ("sleep", lambda: time.sleep(GIL_CHECK_MS / 1e3))):
            start, before = time.perf_counter(), count[0]
            wait()
            rates[name] = (count[0] - before) / (time.perf_counter() - start)
    finally:
        stop.set()
        thread.join()
    verdict = "released" if rates["sync"] > 0.3 * rates["sleep"] else "HELD"
    print(f"GIL check: another thread ran {rates['sync']:.3g} steps/s during a fence's sync, "
          f"{rates['sleep']:.3g} during time.sleep: the GIL is {verdict}", flush=True)  # fmt: skip
    return rates | {"verdict": verdict}


def offline(file: str, step_s: float, wait: str, n: int, max_tokens: int, rounds: int,
            text: bool = True) -> dict:  # fmt: skip
    """`n` streams of `max_tokens` stepped together `rounds` times through LLM.batch() (text:
    the server's engine loop without the server) or through the bare Scheduler (bench
    --concurrency's loop): per-stream ITL (p50 over the streams of every round of each
    stream's median gap, and of its mean gap) and the stand-in's median gap and wait."""
    from nanoqwen.batching import Scheduler
    from nanoqwen.harness.paced import PacedLLM
    from nanoqwen.sampling import SamplingParams

    medians, means = [], []
    with PacedLLM(file, step_s, wait, max_batch=16) as llm:
        ids, params = llm.prepare(PROMPT), SamplingParams(max_tokens=max_tokens)
        stops = frozenset(llm.tokenizer.eos_token_ids)
        for _ in range(rounds):
            if text:
                batch = llm.batch(n)
                stamps: dict = {batch.add(ids, params): [] for _ in range(n)}
            else:
                batch = Scheduler(llm.backend, n)
                stamps = {batch.add(ids, params, stops): [] for _ in range(n)}
            while batch.has_work:
                out = batch.step()
                now = time.perf_counter()
                for event in out:  # (seq, delta) or the scheduler's Event(seq, token, finish)
                    if text or event.token is not None:
                        stamps[event[0]].append(now)
            for s in stamps.values():
                gaps = [b - a for a, b in zip(s, s[1:], strict=False)]
                medians.append(statistics.median(gaps))
                means.append(statistics.fmean(gaps))
        gaps, waits = llm.backend.take_times()
    itl = {"itl_ms": 1e3 * statistics.median(medians)}
    itl["itl_mean_ms"] = 1e3 * statistics.median(means)
    return itl | step_times(gaps, waits)


def step_times(gaps: list[float], waits: list[float]) -> dict:
    """The stand-in's median gap between steps (the engine thread's host work) and wait."""
    return {"gap_ms": 1e3 * statistics.median(gaps), "wait_ms": 1e3 * statistics.median(waits)}


def online(n: int, max_tokens: int, rounds: int, port: int) -> dict:
    """dev/load_test.py's run at one level against the server on `port`: ITL (as `offline`)
    and TTFT as the clients see them. The mean gap is the steadier figure: a client that
    falls behind reads several events at once, and its median gap collapses."""
    args = load_test.parse_args([
        "--url", f"http://127.0.0.1:{port}", "--endpoint", "completions", "--concurrency", str(n),
        "--requests", str(n * rounds), "--max-tokens", str(max_tokens), "--prompt", PROMPT,
    ])  # fmt: skip
    run = asyncio.run(load_test.run_load(args, n))
    summary = load_test.summarize(run, args, n)
    if summary["outcomes"] != {"200": n * rounds}:
        raise RuntimeError(f"N={n}: outcomes {summary['outcomes']}")
    return {
        "itl_ms": 1e3 * summary["itl_s"]["p50_of_stream_medians"],
        "itl_mean_ms": 1e3 * statistics.median(statistics.fmean(r.gaps_s) for r in run.results),
        "itl_p99_ms": 1e3 * summary["itl_s"]["p99_of_gaps"],
        "ttft_p50_ms": 1e3 * summary["ttft_s"]["p50"],
        "tokens_per_s": summary["throughput_tokens_per_s"],
    }


def server(step_s: float, wait: str, profile: str, file: str, port: int, times: Path
           ) -> subprocess.Popen:  # fmt: skip
    """Start the stand-in server in a child process; returns once it accepts connections."""
    argv = [sys.executable, __file__, SERVE, str(step_s), wait, profile, file, str(port)]
    return spawn([*argv, str(times)], port)


def spawn(argv: list[str], port: int) -> subprocess.Popen:
    """Start a server process; returns once it accepts connections on `port`."""
    proc = subprocess.Popen(argv)
    deadline = time.time() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("the stand-in server did not start") from None
            time.sleep(0.2)


def measure(args: argparse.Namespace, wait: str) -> list[dict]:
    """Every level, online then offline, over one server with this wait kind."""
    step_s, rows = args.step_ms / 1e3, []
    times = Path(tempfile.mkdtemp()) / "times.json"
    proc = server(step_s, wait, args.profile or "-", args.file, args.port, times)

    def served_times() -> dict:
        """The server's stand-in step times and its threads' CPU seconds so far."""
        times.unlink(missing_ok=True)
        proc.send_signal(signal.SIGUSR1)
        while not times.exists():
            time.sleep(0.01)
        return json.loads(times.read_text())

    try:
        online(1, 8, 1, args.port)  # warm-up: the first request imports and compiles
        for n in args.levels:
            row = {"wait": wait, "step_ms": args.step_ms, "n": n}
            before = served_times()["cpu"]
            served = online(n, args.max_tokens, args.rounds, args.port)
            after = served_times()
            served |= step_times(after["gaps"], after["waits"])
            # CPU the threads spent per token and per step: the loop's is the server's work
            # (HTTP included), the engine's (with `sleep`) its host work without GIL waits.
            tokens = n * args.rounds * args.max_tokens
            served["loop_cpu_us_per_token"] = 1e6 * (after["cpu"]["loop"] - before["loop"]) / tokens
            served["engine_cpu_ms_per_step"] = (
                1e3 * (after["cpu"]["engine"] - before["engine"]) / (len(after["waits"]) or 1)
            )
            alone = offline(args.file, step_s, wait, n, args.max_tokens, args.rounds)
            bare = offline(args.file, step_s, wait, n, args.max_tokens, args.rounds, text=False)
            row |= {f"online_{k}": v for k, v in served.items()}
            row |= {f"offline_{k}": v for k, v in alone.items()}
            row |= {f"scheduler_{k}": v for k, v in bare.items()}
            row["host_offline_ms"] = row["offline_itl_mean_ms"] - args.step_ms
            row["host_online_ms"] = row["online_itl_mean_ms"] - args.step_ms
            row["server_ms"] = row["online_itl_mean_ms"] - row["offline_itl_mean_ms"]
            print_row(row)
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def print_row(r: dict) -> None:
    print(f"{r['wait']:>5} step {r['step_ms']:.2f} ms N={r['n']:<2} ITL p50/mean scheduler "
          f"{r['scheduler_itl_ms']:.3f}/{r['scheduler_itl_mean_ms']:.3f} offline "
          f"{r['offline_itl_ms']:.3f}/{r['offline_itl_mean_ms']:.3f} online "
          f"{r['online_itl_ms']:.3f}/{r['online_itl_mean_ms']:.3f} (p99 "
          f"{r['online_itl_p99_ms']:.2f}) | host/step offline {r['host_offline_ms']:+.3f} online "
          f"{r['host_online_ms']:+.3f} server {r['server_ms']:+.3f} | TTFT p50 "
          f"{r['online_ttft_p50_ms']:.1f} | engine gap scheduler {r['scheduler_gap_ms']:.3f} "
          f"offline {r['offline_gap_ms']:.3f} online "
          f"{r['online_gap_ms']:.3f}, wait {r['offline_wait_ms']:.3f}/{r['online_wait_ms']:.3f} "
          f"| CPU loop {r['online_loop_cpu_us_per_token']:.1f} us/token, engine "
          f"{r['online_engine_cpu_ms_per_step']:.3f} ms/step (ms unless said)",
          flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("file", help="a .nanoqwen file: its tokenizer and config (no weights used)")
    ap.add_argument("--step-ms", type=float, default=3.0, help="the stand-in's time per step")
    ap.add_argument("--levels", default="1,4,8,16", help="concurrent streaming clients")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client and level")
    ap.add_argument(
        "--wait", default="sleep,block,spin", help="how the step waits: sleep, block, spin"
    )
    ap.add_argument("--port", type=int, default=PORT, help="the stand-in server's port")
    ap.add_argument("--profile", default=None, metavar="DIR", help="cProfile the server")
    ap.add_argument("--gil-check", action="store_true",
                    help="GPU host: does cuStreamSynchronize release the GIL (first)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    out: dict = {"command": " ".join(sys.argv)}
    if args.gil_check:
        try:
            out["gil_check"] = gil_check()
        except Exception as exc:  # a diagnostic: the rows below are still worth having
            print(f"GIL check failed: {exc!r}", file=sys.stderr)
            out["gil_check"] = {"error": repr(exc)}
    out["rows"] = [row for wait in args.wait.split(",") for row in measure(args, wait)]
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SERVE:
        step, kind, profile_dir, model, port, times_file = sys.argv[2:8]
        sys.exit(serve(float(step), kind, profile_dir, model, int(port), times_file))
    sys.exit(main())
