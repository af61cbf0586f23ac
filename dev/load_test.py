#!/usr/bin/env python3
"""Load generator for `nanoqwen serve` (or any OpenAI-compatible server).

    python3 dev/load_test.py --url http://127.0.0.1:8000 --concurrency 6 --requests 60 \
        --max-tokens 64 [--api-key KEY] [--endpoint chat|completions] [--json]
    python3 dev/load_test.py --concurrency 1,2,4,8,16,32 --requests 64 --max-tokens 128 \
        --json --out load.json --plot load.png      # one run per N, against N
    python3 dev/load_test.py --endpoint completions --prompt-tokens 512 [--distinct] ...
                                                    # prompts of exactly 512 token ids

`concurrency` clients each send streamed requests one after another until `requests` have
been sent in all (per level, with a list of levels: the batching curve of a server started
with --max-batch at least the largest N and --max-queue large enough). Every request ends in
exactly one outcome: its HTTP status (200, 429, 503, ...), "timeout", or the name of a
transport error, so nothing can hang or go missing unnoticed. For the successful ones it
reports latency percentiles (request sent -> [DONE]), time to first streamed event (the server
sends its first event once the first token exists, so this is the time to first token as a
client sees it), per-request decode speed (completion tokens from the usage chunk over the
time after the first event), per-stream inter-token latency (the gaps between a stream's
consecutive events, one a token: p50 of the streams' medians, p99 of every gap) and
aggregate throughput.
A 429 (queue full) is retried after its Retry-After up to --retries times (default 0: counted,
not retried, which measures how often the queue was full); `retries` reports how many were.

Only needs httpx (--plot also matplotlib and nanoqwen). Prints a table, or one JSON object
with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


@dataclass
class Result:
    outcome: str  # "200", "429", ..., "timeout", or a transport error's class name
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    decode_s: float = 0.0
    retries: int = 0
    retry_after_s: float = 0.0  # the server's Retry-After on a 429
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token events


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0


# --prompt-tokens draws ids below this: byte tokens in every vocabulary served here (Qwen's
# first 256 ids, the synthetic packs' byte-level ones), none of them special.
PROMPT_ID_RANGE = 256


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids drawn by `seed` (the same ids for the same seed)."""
    rng = random.Random(seed)
    return [rng.randrange(PROMPT_ID_RANGE) for _ in range(n)]


def request_body(args: argparse.Namespace, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": args.max_tokens, "stream": True}
    common |= {"temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        return "/v1/chat/completions", common | {
            "messages": [{"role": "user", "content": args.prompt}]
        }
    prompt = prompt_ids(args.prompt_tokens, 0) if args.prompt_tokens else args.prompt
    return "/v1/completions", common | {"prompt": prompt}


def distinct(body: dict, i: int, start: float) -> dict:
    """`body` with a prompt of its own: no page of it is in the server's prefix cache, so
    every request pays its whole prefill. Text starts with the request's tag; token ids
    (--prompt-tokens) are drawn afresh, as many as before."""
    tag = f"[request {i} of run {start:.6f}]\n"
    if "prompt" in body and isinstance(body["prompt"], list):
        return body | {"prompt": prompt_ids(len(body["prompt"]), hash((i, start)))}
    if "prompt" in body:
        return body | {"prompt": tag + body["prompt"]}
    (message,) = body["messages"]
    return body | {"messages": [message | {"content": tag + message["content"]}]}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    first: float | None = None
    stamps: list[float] = []  # arrival of each event that carries a choice (a token)
    tokens = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result = Result(str(response.status_code), time.perf_counter() - start)
                result.retry_after_s = float(response.headers.get("retry-after", 1))
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                first = first or time.perf_counter()
                data = line[len("data: ") :]
                if data != "[DONE]":
                    event = json.loads(data)
                    if "error" in event:
                        return Result("stream-error", time.perf_counter() - start)
                    if event.get("choices"):
                        stamps.append(time.perf_counter())
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    except httpx.TimeoutException:
        return Result("timeout", time.perf_counter() - start)
    except httpx.HTTPError as exc:
        return Result(type(exc).__name__, time.perf_counter() - start)
    end = time.perf_counter()
    ttft = None if first is None else first - start
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    decode = 0.0 if first is None else end - first
    return Result("200", end - start, ttft, tokens, decode, gaps_s=gaps)


async def with_retries(client: httpx.AsyncClient, path: str, body: dict, retries: int) -> Result:
    """`one_request`, sent again after the server's Retry-After while it answers 429."""
    attempt = 0
    while True:
        result = await one_request(client, path, body)
        if result.outcome != "429" or attempt == retries:
            result.retries = attempt
            return result
        attempt += 1
        await asyncio.sleep(result.retry_after_s)


async def run_load(args: argparse.Namespace, concurrency: int) -> Run:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        path, body = request_body(args, model)
        run, remaining = Run(), iter(range(args.requests))
        start = time.perf_counter()

        async def client_loop() -> None:
            for i in remaining:  # the shared iterator hands out the requests
                sent = distinct(body, i, start) if args.distinct else body
                run.results.append(await with_retries(client, path, sent, args.retries))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        run.wall_s = time.perf_counter() - start
    return run


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def summarize(run: Run, args: argparse.Namespace, concurrency: int) -> dict:
    ok = [r for r in run.results if r.outcome == "200"]
    medians = [statistics.median(r.gaps_s) for r in ok if r.gaps_s]
    every = sorted(g for r in ok for g in r.gaps_s)
    decode = [
        r.completion_tokens / r.decode_s for r in ok if r.decode_s > 0 and r.completion_tokens
    ]
    total_tokens = sum(r.completion_tokens for r in ok)
    return {
        "url": args.url,
        "endpoint": args.endpoint,
        "concurrency": concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "outcomes": dict(Counter(r.outcome for r in run.results)),
        "retries": sum(r.retries for r in run.results),
        "wall_s": run.wall_s,
        "latency_s": percentiles([r.latency_s for r in ok]),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "completion_tokens": total_tokens,
        "decode_tokens_per_s_median": statistics.median(decode) if decode else None,
        "throughput_tokens_per_s": total_tokens / run.wall_s if run.wall_s else None,
        "itl_s": {
            "p50_of_stream_medians": statistics.median(medians) if medians else None,
            "p99_of_gaps": every[min(len(every) - 1, int(0.99 * len(every)))] if every else None,
        },
    }


def print_table(summary: dict) -> None:
    print(f"{summary['requests']} requests, {summary['concurrency']} clients -> {summary['url']}")
    print(
        f"outcomes: {summary['outcomes']} after {summary['retries']} retries of 429s, "
        f"wall {summary['wall_s']:.2f} s"
    )
    for name in ("latency_s", "ttft_s"):
        p = summary[name]
        if p:
            cells = "  ".join(f"{k} {v * 1000:8.1f} ms" for k, v in p.items())
            print(f"{name:>10}: {cells}")
    decode, rate = summary["decode_tokens_per_s_median"], summary["throughput_tokens_per_s"]
    if decode:
        print(f"decode (median per request): {decode:.1f} tokens/s")
    if rate:
        print(f"throughput: {rate:.1f} completion tokens/s ({summary['completion_tokens']} tokens)")
    itl = summary["itl_s"]
    if itl["p50_of_stream_medians"] is not None:
        print(f"inter-token: p50 of stream medians {1e3 * itl['p50_of_stream_medians']:.1f} ms, "
              f"p99 of gaps {1e3 * itl['p99_of_gaps']:.1f} ms")  # fmt: skip


def plot(levels: list[dict], path: str, url: str) -> None:
    """Aggregate tokens/s and per-stream ITL against N: bench --concurrency's plot."""
    from nanoqwen.harness.concurrency import plot_concurrency

    rows = [{"concurrency": s["concurrency"], "tokens_per_s": s["throughput_tokens_per_s"] or 0.0,
             "itl_p50_ms": 1e3 * (s["itl_s"]["p50_of_stream_medians"] or 0.0),
             "itl_p99_ms": 1e3 * (s["itl_s"]["p99_of_gaps"] or 0.0)} for s in levels]  # fmt: skip
    plot_concurrency({"levels": rows}, path, f"{url}: online load by N")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="API")
    p.add_argument("--concurrency", default="6",
                   help="parallel clients; a comma list (1,2,4,8) runs each in turn")  # fmt: skip
    p.add_argument("--requests", type=int, default=60, help="requests in all")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--prompt", default=PROMPT, help="prompt (chat: the user message)")
    p.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                   help="completions: a prompt of exactly N token ids instead of --prompt's "
                   "text (a text's token count depends on the model's tokenizer: the synthetic "
                   "packs' is byte-level)")  # fmt: skip
    p.add_argument("--distinct", action="store_true",
                   help="start each prompt with the request's own tag (--prompt-tokens: draw "
                   "its ids afresh), so none is served from the prefix cache (default: the "
                   "same prompt every time)")  # fmt: skip
    p.add_argument("--retries", type=int, default=0, help="retries of a 429 (after Retry-After)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request read timeout, s")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="draw tokens/s and ITL against the concurrency levels (needs matplotlib "
                   "and nanoqwen importable)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency: expected integers like 1,2,4, got {args.concurrency!r}")
    if min(args.levels) < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be >= 1")
    if args.prompt_tokens < 0 or (args.prompt_tokens and args.endpoint != "completions"):
        p.error("--prompt-tokens: a count >= 1, with --endpoint completions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [summarize(asyncio.run(run_load(args, n)), args, n) for n in args.levels]
    out = levels[0] if len(levels) == 1 else {"command": " ".join(sys.argv), "levels": levels}
    if args.json:
        print(json.dumps(out))
    else:
        for summary in levels:
            print_table(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot(levels, args.plot, args.url)
    ok = {"200", "429", "503"}
    return 0 if all(args.requests == sum(s["outcomes"].values()) and set(s["outcomes"]) <= ok
                    for s in levels) else 1  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
