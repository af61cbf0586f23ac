"""Where a request's time to first token goes, layer by layer (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/first_token.py FILE.nanoqwen [--tokens 46] [--runs 30]
        [--server] [--routes fast|fastapi|both] [--json OUT.json] [--backend reference]

The same prompt (a piece of real Python source, cut to --tokens tokens by the model's
tokenizer) through each layer, warm, median of --runs after 5 warm-ups, greedy:

    engine     CudaBackend.generate(ids) -> its first token on the host (what bench times)
    stream     LLM.stream(ids) -> its first Delta (the front end's checks, stop matcher and
               detokenizer on top of the engine)
    prepare    LLM.prepare(prompt text) + LLM.stream -> first Delta (tokenization added)
    server     (--server) `nanoqwen serve` in a subprocess, a raw socket client: POST
               /v1/completions stream=true with the prompt text -> the first `data:` event
               with text, and the same for /v1/chat/completions (its prompt is the template's,
               so it is not compared with the engine row); `server_over_stream` is the
               completion's time over the stream row: what the server adds. --routes says
               which path serves the generation requests: `fast` (the default, as served:
               nanoqwen/server/fast_routes.py), `fastapi` (FastAPI's routes alone,
               create_app(fast_routes=False)), or `both`: one server after the other, the
               second's rows suffixed `_fastapi` (a server that fails leaves the other's rows)

and one instrumented engine run: the host's clock when the first and the last prefill kernel
were enqueued and when the token arrived (the launch cost the GPU cannot hide at a short
prompt).

Each request's response is read to its end before the next is sent, so every request finds
the engine idle (a client that hung up after its first chunk would leave the engine finishing
a decode step, and the next request would wait for it).

--instant swaps the backend's generate (under LLM.stream, and under a lone request in the
server's batch, which decodes solo through it), in this process and in the server's, for one
whose first token is ready at once (then a token every INSTANT_STEP_S, waited for as the cuda
backend waits): the engine row is then nothing, the stream rows the front end alone and the
server rows the server's own cost. The script also runs on the CPU, the engine then the
reference backend:

    python3 -m nanoqwen.cli pack --synthetic tiny -o /tmp/tiny.nanoqwen
    PYTHONPATH=. python3 dev/first_token.py /tmp/tiny.nanoqwen --backend reference --server \\
        --instant
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams

WARMUP = 5
GEN_TOKENS = 16  # each request asks for this many; only the first is timed
# The instant engine's decode step, and its wait as the cuda backend waits for a token: a
# sleep of POLL_S between looks at the host ring (nanoqwen/engine/decode_loop.py).
INSTANT_STEP_S = 5e-3
POLL_S = 20e-6
# argv[1] of the server process that --server starts: `nanoqwen serve` with the options in
# argv[2] ("instant", "fastapi": comma-separated, or "-") and serve's arguments after them.
SERVE = "--serve"


def prompt_text(llm: LLM, tokens: int) -> tuple[str, list[int]]:
    """A prefix of a real source file that encodes to exactly `tokens` ids (or fewer when the
    tokenizer merges across the cut: then the ids of the text as cut)."""
    import json.decoder as source_module

    source = inspect.getsource(source_module)
    ids = llm.tokenizer.encode(source)[:tokens]
    text = llm.tokenizer.decode(ids)
    return text, llm.tokenizer.encode(text)


def median_ms(fn, runs: int) -> float:
    """The median milliseconds of a call of `fn`."""

    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    return median_of(timed, runs)


def median_of(measure, runs: int) -> float:
    """The median of the values `measure()` returns, after WARMUP calls not kept."""
    values = [measure() for _ in range(WARMUP + runs)]
    return statistics.median(values[WARMUP:])


def first_of(iterator) -> None:
    """Take the first item of a generation's iterator, then cancel it (close)."""
    try:
        next(iterator)
    finally:
        iterator.close()


def first_text(stream) -> None:
    """Take a stream's deltas up to the first with text (the detokenizer holds back bytes of
    an unfinished character: a synthetic model's random tokens often are), then cancel it:
    what the server's first chunk with text waits for."""
    try:
        for delta in stream:
            if delta.text or delta.finish_reason:
                return
    finally:
        stream.close()


def instant(llm: LLM) -> LLM:
    """`llm` with a backend whose first token is ready at once: the backend's `generate`
    (what LLM.stream and a lone request in the server's batch decode through) yields the
    prompt's ids over again, the first at once and each next one a decode step later; the
    tokenizer, checks and text front end stay as they are."""

    def generate(ids, params: SamplingParams, stop_ids):
        ids = list(ids)
        for i in range(params.max_tokens):
            if i:
                step_end = time.perf_counter() + INSTANT_STEP_S
                while time.perf_counter() < step_end:
                    time.sleep(POLL_S)
            yield ids[i % len(ids)]

    llm.backend.generate = generate
    return llm


def run_server(options: list[str], argv: list[str]) -> int:
    """`nanoqwen serve ARGV` as the CLI runs it, over the `instant` engine ("instant" in
    `options`) and with FastAPI's routes alone ("fastapi")."""
    from nanoqwen import cli, server
    from nanoqwen.commands import serve

    if "instant" in options:
        open_llm = serve.open_llm
        serve.open_llm = lambda *args, **kwargs: instant(open_llm(*args, **kwargs))
    if "fastapi" in options:
        server.create_app = functools.partial(server.create_app, fast_routes=False)
    return cli.main(["serve", *argv])


def engine_layers(llm: LLM, text: str, ids: list[int], runs: int) -> dict:
    params = SamplingParams(max_tokens=GEN_TOKENS)
    backend, stops = llm._backend, frozenset(llm.tokenizer.eos_token_ids)
    out = {
        "engine_ms": median_ms(lambda: first_of(backend.generate(ids, params, stops)), runs),
        "stream_ms": median_ms(lambda: first_text(llm.stream(ids, params)), runs),
        "prepare_stream_ms": median_ms(
            lambda: first_text(llm.stream(llm.prepare(prompt=text), params)), runs
        ),
        "prepare_ms": median_ms(lambda: llm.prepare(prompt=text), runs),
    }
    out.update(instrumented(backend, ids, params, stops))
    if hasattr(backend, "kernels"):
        out.update(launch_cost_us(backend))
    return out


def instrumented(backend, ids, params, stops) -> dict:
    """Host stamps: the first and last prefill launch, the token (one run, after warm-ups)."""
    stamps: list[float] = []
    names = ("kernels", "prefill_kernels")  # the cuda backend's launchers
    launchers = [getattr(backend, n) for n in names if hasattr(backend, n)]
    for launcher in launchers:
        launcher.on_launch = lambda launch: stamps.append(time.perf_counter())
    try:
        t0 = time.perf_counter()
        first_of(backend.generate(ids, params, stops))
        t1 = time.perf_counter()
    finally:
        for launcher in launchers:
            launcher.on_launch = None
    if not stamps:  # the reference backend launches nothing of ours
        return {"launches": 0, "token_ms_instrumented": 1e3 * (t1 - t0)}
    return {
        "launches": len(stamps),
        "first_launch_ms": 1e3 * (stamps[0] - t0),
        "last_launch_ms": 1e3 * (stamps[-1] - t0),
        "token_ms_instrumented": 1e3 * (t1 - t0),
    }


def launch_cost_us(backend, n: int = 400) -> dict:
    """Host microseconds a launch of one small kernel (rmsnorm over 46 rows), by layer of the
    launch path: the launcher (spec lookup, on_launch), Gpu.launch (config cache, argument
    conversion), cuda.core's launch with everything prepared."""
    import numpy as np
    from cuda.core import LaunchConfig, launch

    k, gpu, f = backend.kernels, backend.gpu, backend.forward
    b, w = f.scratch(64), backend.weights.layers[0].input_norm
    spec, kernel = k.specs["rmsnorm"], k.kernels["rmsnorm"]
    grid = (-(-46 // k.geometry.norm_rows), 1, 1)
    args = (b["x"], w, b["h"], np.int32(46))
    cfg = LaunchConfig(grid=grid, block=spec.threads, shmem_size=spec.smem,
                       programmatic_stream_serialization=True)  # fmt: skip
    raw = [np.uint64(a) if isinstance(a, int) else a for a in args]
    paths = {
        "launcher": lambda: k.rmsnorm(b["x"], w, b["h"], 46),
        "gpu_launch": lambda: gpu.launch(
            kernel, grid, spec.threads, *args, smem=spec.smem, pdl=True
        ),  # fmt: skip
        "cuda_core_launch": lambda: launch(gpu.stream, cfg, kernel, *raw),
    }
    out = {}
    for name, fn in paths.items():
        for _ in range(2):  # the second pass is the one kept
            gpu.sync("launch cost")
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dt = time.perf_counter() - t0
            gpu.sync("launch cost")
        out[f"launch_{name}_us"] = 1e6 * dt / n
    return out


def http_first_text_ms(port: int, path: str, body: dict) -> float:
    """POST `body` as a stream request over a fresh connection; ms from the first byte sent
    to the first SSE event carrying text. The rest of the response is read (not timed)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(head + payload)
        buf, first = b"", None
        while chunk := sock.recv(65536):
            buf += chunk
            if first is None and any(
                line.startswith(b"data: {") and _has_text(line[6:]) for line in buf.split(b"\n")
            ):
                first = 1e3 * (time.perf_counter() - t0)
    if first is None:
        raise RuntimeError(f"{path}: the stream ended without text: {buf[-500:]!r}")
    return first


def _has_text(event: bytes) -> bool:
    try:
        choice = json.loads(event)["choices"][0]
    except (ValueError, KeyError, IndexError):
        return False
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


def server_layers(
    file: str, model: str, text: str, runs: int, port: int, ctx: int, backend: str,
    options: list[str],
) -> dict:  # fmt: skip
    args = [file, "--port", str(port), "--backend", backend, "--max-context", str(ctx),
            "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, __file__, SERVE, ",".join(options) or "-", *args])
    try:
        deadline = time.time() + 300
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        common = {"model": model, "max_tokens": GEN_TOKENS, "temperature": 0, "stream": True}
        completion = common | {"prompt": text}
        chat = common | {"messages": [{"role": "user", "content": text}]}
        return {
            "server_completion_ms": median_of(
                lambda: http_first_text_ms(port, "/v1/completions", completion), runs
            ),
            "server_chat_ms": median_of(
                lambda: http_first_text_ms(port, "/v1/chat/completions", chat), runs
            ),
        }
    finally:
        proc.terminate()
        proc.wait(60)


def served(args: argparse.Namespace, model: str, text: str, ctx: int, stream_ms: float) -> dict:
    """The server rows of each --routes path, the `fastapi` ones suffixed."""
    paths = {"fast": ["fast"], "fastapi": ["fastapi"], "both": ["fast", "fastapi"]}[args.routes]
    out = {}
    for path in paths:
        options = ["instant"] * args.instant + ["fastapi"] * (path == "fastapi")
        suffix = "_fastapi" if args.routes == "both" and path == "fastapi" else ""
        try:
            rows = server_layers(
                args.file, model, text, args.runs, args.port, ctx, args.backend, options
            )
        except Exception as exc:  # one server's failure must not hide the other's rows
            print(f"server ({path} routes) failed: {exc!r}", file=sys.stderr)
            continue
        rows["server_over_stream_ms"] = rows["server_completion_ms"] - stream_ms
        out.update({key.replace("_ms", f"{suffix}_ms"): value for key, value in rows.items()})
    if {"server_completion_ms", "server_completion_fastapi_ms"} <= out.keys():
        for kind in ("completion", "chat"):
            fast, slow = out[f"server_{kind}_ms"], out[f"server_{kind}_fastapi_ms"]
            out[f"fast_routes_gain_{kind}_ms"] = slow - fast
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=46)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--server", action="store_true")
    ap.add_argument(
        "--routes",
        choices=("fast", "fastapi", "both"),
        default="fast",
        help="the server's path for generation requests (module docstring)",
    )
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="cuda", help="reference: a CPU run of the script")
    ap.add_argument(
        "--instant",
        action="store_true",
        help="LLM.stream and the server over an engine whose first token is ready at once "
        "(the engine row stays the real one): the server's own cost alone",
    )
    args = ap.parse_args()
    ctx = 4096
    if args.backend == "reference":
        from nanoqwen.reference import set_threads

        set_threads(None)  # the torch threads `nanoqwen serve` gives the reference backend
    llm = LLM(args.file, backend=args.backend, max_context=ctx)
    if args.instant:
        instant(llm)
    text, ids = prompt_text(llm, args.tokens)
    res = {"file": Path(args.file).name, "prompt_tokens": len(ids)}
    res.update(engine_layers(llm, text, ids, args.runs))
    model = llm.model_name
    llm.close()
    if args.server:
        res.update(served(args, model, text, ctx, res["stream_ms"]))
    print(f"{res['file']}: prompt {res['prompt_tokens']} tokens, {res['launches']} launches")
    for key, value in res.items():
        if key.endswith(("_ms", "_us")):
            print(f"  {key:<32} {value:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [SERVE]:
        raise SystemExit(run_server(sys.argv[2].split(","), sys.argv[3:]))
    raise SystemExit(main())
