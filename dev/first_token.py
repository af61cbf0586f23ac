"""Where a request's time to first token goes, layer by layer (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/first_token.py FILE.nanoqwen [--tokens 46] [--runs 30]
        [--server] [--json OUT.json]

The same prompt (a piece of real Python source, cut to --tokens tokens by the model's
tokenizer) through each layer, warm, median of --runs after 5 warm-ups, greedy:

    engine     CudaBackend.generate(ids) -> its first token on the host (what bench times)
    stream     LLM.stream(ids) -> its first Delta (the front end's checks, stop matcher and
               detokenizer on top of the engine)
    prepare    LLM.prepare(prompt text) + LLM.stream -> first Delta (tokenization added)
    server     (--server) `nanoqwen serve` in a subprocess, a raw socket client: POST
               /v1/completions stream=true with the prompt text -> the first `data:` event
               with text, and the same for /v1/chat/completions (its prompt is the template's,
               so it is not compared with the engine row)

and one instrumented engine run: the host's clock when the first and the last prefill kernel
were enqueued and when the token arrived (the launch cost the GPU cannot hide at a short
prompt).
"""

from __future__ import annotations

import argparse
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


def prompt_text(llm: LLM, tokens: int) -> tuple[str, list[int]]:
    """A prefix of a real source file that encodes to exactly `tokens` ids (or fewer when the
    tokenizer merges across the cut: then the ids of the text as cut)."""
    import json.decoder as source_module

    source = inspect.getsource(source_module)
    ids = llm.tokenizer.encode(source)[:tokens]
    text = llm.tokenizer.decode(ids)
    return text, llm.tokenizer.encode(text)


def median_ms(fn, runs: int) -> float:
    times = []
    for r in range(WARMUP + runs):
        t0 = time.perf_counter()
        fn()
        if r >= WARMUP:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def first_of(iterator) -> None:
    """Take the first item of a generation's iterator, then cancel it (close)."""
    try:
        next(iterator)
    finally:
        iterator.close()


def engine_layers(llm: LLM, text: str, ids: list[int], runs: int) -> dict:
    params = SamplingParams(max_tokens=GEN_TOKENS)
    backend, stops = llm._backend, frozenset(llm.tokenizer.eos_token_ids)
    out = {
        "engine_ms": median_ms(lambda: first_of(backend.generate(ids, params, stops)), runs),
        "stream_ms": median_ms(lambda: first_of(llm.stream(ids, params)), runs),
        "prepare_stream_ms": median_ms(
            lambda: first_of(llm.stream(llm.prepare(prompt=text), params)), runs
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
    to the first SSE event carrying text."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(head + payload)
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"{path}: stream ended before any text: {buf[-500:]!r}")
            buf += chunk
            for line in buf.split(b"\n"):
                if line.startswith(b"data: {") and _has_text(line[6:]):
                    return 1e3 * (time.perf_counter() - t0)


def _has_text(event: bytes) -> bool:
    try:
        choice = json.loads(event)["choices"][0]
    except (ValueError, KeyError, IndexError):
        return False
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


def server_layers(
    file: str, model: str, text: str, runs: int, port: int, ctx: int, backend: str
) -> dict:
    cmd = [sys.executable, "-m", "nanoqwen.cli", "serve", file, "--port", str(port),
           "--backend", backend, "--max-context", str(ctx), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd)
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
            "server_completion_ms": median_ms(
                lambda: http_first_text_ms(port, "/v1/completions", completion), runs
            ),
            "server_chat_ms": median_ms(
                lambda: http_first_text_ms(port, "/v1/chat/completions", chat), runs
            ),
        }
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--tokens", type=int, default=46)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="cuda", help="reference: a CPU smoke run of the script")
    args = ap.parse_args()
    ctx = 4096
    llm = LLM(args.file, backend=args.backend, max_context=ctx)
    text, ids = prompt_text(llm, args.tokens)
    res = {"file": Path(args.file).name, "prompt_tokens": len(ids)}
    res.update(engine_layers(llm, text, ids, args.runs))
    model = llm.model_name
    llm.close()
    if args.server:
        res.update(server_layers(args.file, model, text, args.runs, args.port, ctx, args.backend))
    print(f"{res['file']}: prompt {res['prompt_tokens']} tokens, {res['launches']} launches")
    for key, value in res.items():
        if key.endswith(("_ms", "_us")):
            print(f"  {key:<24} {value:8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
