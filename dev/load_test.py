#!/usr/bin/env python3
"""Load generator for `nanoqwen serve` (or any OpenAI-compatible server).

    python3 dev/load_test.py --url http://127.0.0.1:8000 --concurrency 6 --requests 60 \
        --max-tokens 64 [--api-key KEY] [--endpoint chat|completions] [--json]

`concurrency` clients each send streamed requests one after another until `requests` have
been sent in all. Every request ends in exactly one outcome: its HTTP status (200, 429, 503,
...), "timeout", or the name of a transport error, so nothing can hang or go missing
unnoticed. For the successful ones it reports latency percentiles (request sent -> [DONE]),
time to first streamed event (the server sends its first event once the first token exists,
so this is the time to first token as a client sees it), per-request decode speed (completion
tokens from the usage chunk over the time after the first event) and aggregate throughput.
A 429 (queue full) is retried after its Retry-After up to --retries times (default 0: counted,
not retried, which measures how often the queue was full); `retries` reports how many were.

Only needs httpx. Prints a table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0


def request_body(args: argparse.Namespace, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": args.max_tokens, "stream": True}
    common |= {"temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        return "/v1/chat/completions", common | {
            "messages": [{"role": "user", "content": args.prompt}]
        }
    return "/v1/completions", common | {"prompt": args.prompt}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    first: float | None = None
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
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    except httpx.TimeoutException:
        return Result("timeout", time.perf_counter() - start)
    except httpx.HTTPError as exc:
        return Result(type(exc).__name__, time.perf_counter() - start)
    end = time.perf_counter()
    ttft = None if first is None else first - start
    return Result("200", end - start, ttft, tokens, 0.0 if first is None else end - first)


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


async def run_load(args: argparse.Namespace) -> Run:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        path, body = request_body(args, model)
        run, remaining = Run(), iter(range(args.requests))
        start = time.perf_counter()

        async def client_loop() -> None:
            for _ in remaining:  # the shared iterator hands out the requests
                run.results.append(await with_retries(client, path, body, args.retries))

        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        run.wall_s = time.perf_counter() - start
    return run


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def summarize(run: Run, args: argparse.Namespace) -> dict:
    ok = [r for r in run.results if r.outcome == "200"]
    decode = [
        r.completion_tokens / r.decode_s for r in ok if r.decode_s > 0 and r.completion_tokens
    ]
    total_tokens = sum(r.completion_tokens for r in ok)
    return {
        "url": args.url,
        "endpoint": args.endpoint,
        "concurrency": args.concurrency,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="API")
    p.add_argument("--concurrency", type=int, default=6, help="clients sending in parallel")
    p.add_argument("--requests", type=int, default=60, help="requests in all")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--prompt", default=PROMPT, help="prompt (chat: the user message)")
    p.add_argument("--retries", type=int, default=0, help="retries of a 429 (after Retry-After)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request read timeout, s")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = summarize(asyncio.run(run_load(args)), args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    lost = args.requests - sum(summary["outcomes"].values())
    return 0 if lost == 0 and set(summary["outcomes"]) <= {"200", "429", "503"} else 1


if __name__ == "__main__":
    sys.exit(main())
