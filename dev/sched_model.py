"""The scheduler and server under a stand-in engine with the GPU's measured step costs (CPU host).

    python3 -m nanoqwen.cli pack --synthetic tiny -o /tmp/tiny.nanoqwen
    PYTHONPATH=. python3 dev/sched_model.py /tmp/tiny.nanoqwen [--levels 1,8,16] \
        [--requests 64] [--max-tokens 128] [--prompt-tokens 512] [--distinct] \
        [--prefill-chunk N] [--record-512 JSON] [--record-concurrency JSON] \
        [--prefill-scale F] [--chunk-min-ms MS] [--real LOAD_JSON] [--json OUT.json]

`nanoqwen serve FILE --max-batch 16` runs in a child process as the CLI runs it, its LLM a
`nanoqwen.harness.paced.PacedLLM` whose StepCosts come from the GPU records:

    prefill    a chunk of at most 16 ids costs a decode step of as many rows (the cuda
               backend runs it as rows of its batch step); a longer one, and a lone request's
               prompt, t tokens cost t x (TTFT / prompt tokens) of --record-512 (bench at 512:
               the prefill is bound by the GEMMs' compute there), at least one decode step of
               one row (a pass over the weights) or --chunk-min-ms; --prefill-scale F
               multiplies the rate (a hypothesis: the GPU path's prefill at this workload's
               lengths costs F times the record's)
    decode     a step of B rows costs the per-stream ITL p50 of --record-concurrency at N = B
               (bench --concurrency, offline: the step and the scheduler's host work),
               interpolated between the measured N

and dev/load_test.py's clients load it as they load the GPU host's server: --levels clients,
--requests in all, each streaming --max-tokens, a prompt of --prompt-tokens token ids (the load
test's own; --distinct: drawn afresh for each request, as on the GPU host).
The result is what scheduling and serving alone give when the GPU does its measured work and
nothing else. Beside the load test's record on the GPU (--real, dev/load_test.py --out JSON of
the same workload), the gap is the GPU path's own (work the records' steady states do not
have: odd chunk lengths, first launches, host work the step does not hide), not the
scheduler's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import load_test  # noqa: E402 (dev/ is not a package)
import server_overhead  # noqa: E402

from nanoqwen.cuda.registry import MAX_ROWS  # noqa: E402 (the stand-in's --max-batch)

SERVE = "--serve"  # argv[1] of the server process; argv[2:] the costs (JSON), file, port, chunk
PORT = 8021
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def costs_from_records(
    record_512: Path,
    record_concurrency: Path,
    rows: int,
    scale: float,
    chunk_min_s: float | None = None,
):
    """StepCosts of the module docstring from a bench JSON at 512 and a --concurrency JSON
    (a prefill's least cost: chunk_min_s, else a decode step of one row)."""
    from nanoqwen.harness.paced import StepCosts

    bench = json.loads(record_512.read_text())
    levels = json.loads(record_concurrency.read_text())["levels"]
    n = [lv["concurrency"] for lv in levels]
    itl = [lv["itl_p50_ms"] / 1e3 for lv in levels]
    decode = tuple(float(v) for v in np.interp(np.arange(1, rows + 1), n, itl))
    least = decode[0] if chunk_min_s is None else chunk_min_s
    return StepCosts(scale * bench["ttft_ms"] / 1e3 / bench["prompt_len"], least, decode)


def serve(costs_json: str, file: str, port: int, chunk: int) -> int:
    """`nanoqwen serve FILE` as the CLI runs it, its LLM a PacedLLM with these costs."""
    from nanoqwen import cli
    from nanoqwen.commands import serve as serve_command
    from nanoqwen.harness.paced import PacedLLM, StepCosts

    c = json.loads(costs_json)
    costs = StepCosts(c["prefill_token_s"], c["prefill_min_s"], tuple(c["decode_s"]))
    rows = len(costs.decode_s)
    serve_command.open_llm = lambda path, args, max_batch=None: PacedLLM(
        path, costs, "sleep", max_batch=max_batch or rows
    )
    argv = ["serve", file, "--port", str(port), "--max-batch", str(rows)]
    argv += ["--log-level", "warning"] + (["--prefill-chunk", str(chunk)] if chunk else [])
    return cli.main(argv)


def server(costs, file: str, port: int, chunk: int) -> subprocess.Popen:
    """Start the stand-in server in a child process; returns once it accepts connections."""
    argv = [sys.executable, __file__, SERVE, json.dumps(asdict(costs)), file, str(port), str(chunk)]
    return server_overhead.spawn(argv, port)


def row(summary: dict) -> dict:
    """The figures compared: wall, TTFT p50/p90/p99, per-stream ITL, aggregate tokens/s."""
    ttft, itl = summary["ttft_s"], summary["itl_s"]
    return {
        "n": summary["concurrency"],
        "wall_s": summary["wall_s"],
        "ttft_p50_ms": 1e3 * ttft["p50"],
        "ttft_p90_ms": 1e3 * ttft["p90"],
        "ttft_p99_ms": 1e3 * ttft["p99"],
        "itl_ms": 1e3 * itl["p50_of_stream_medians"],
        "tokens_per_s": summary["throughput_tokens_per_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("file", help="a .nanoqwen file: its tokenizer and config (no weights used)")
    ap.add_argument("--levels", default="1,8,16", help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=64, help="requests in all, each level")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="a prompt's token ids")
    ap.add_argument("--distinct", action="store_true", help="load_test --distinct")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="serve's (0: its default)")
    ap.add_argument("--record-512", type=Path, default=RESULTS / "h200_7b_synthetic_512.json")
    ap.add_argument("--record-concurrency", type=Path,
                    default=RESULTS / "h200_7b_synthetic_concurrency.json")  # fmt: skip
    ap.add_argument("--prefill-scale", type=float, default=1.0, help="the prefill rate times F")
    ap.add_argument(
        "--chunk-min-ms",
        type=float,
        default=None,
        help="the least cost of a prefill past 16 ids (default: a decode step of one row)",
    )
    ap.add_argument("--real", type=Path, help="the GPU host's load test JSON, set beside")
    ap.add_argument("--port", type=int, default=PORT, help="the stand-in server's port")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    chunk_min = None if args.chunk_min_ms is None else args.chunk_min_ms / 1e3
    costs = costs_from_records(args.record_512, args.record_concurrency, MAX_ROWS,
                               args.prefill_scale, chunk_min)  # fmt: skip
    print(f"costs: prefill {1e3 * costs.prefill_token_s:.4f} ms a token (at least "
          f"{1e3 * costs.prefill_min_s:.3f} ms), decode ms by rows "
          f"{', '.join(f'{1e3 * s:.2f}' for s in costs.decode_s)}")  # fmt: skip
    real = {}
    if args.real:
        real = {lv["concurrency"]: row(lv) for lv in json.loads(args.real.read_text())["levels"]}
    load = ["--url", f"http://127.0.0.1:{args.port}", "--endpoint", "completions",
            "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
            "--prompt-tokens", str(args.prompt_tokens)] + (["--distinct"] if args.distinct
                                                           else [])  # fmt: skip
    rows = []
    proc = server(costs, args.file, args.port, args.prefill_chunk)
    try:
        asyncio.run(load_test.run_load(load_test.parse_args([*load, "--requests", "2"]), 1))
        for n in levels:
            la = load_test.parse_args([*load, "--concurrency", str(n)])
            summary = load_test.summarize(asyncio.run(load_test.run_load(la, n)), la, n)
            if summary["outcomes"] != {"200": args.requests}:
                raise RuntimeError(f"N={n}: outcomes {summary['outcomes']}")
            rows.append(row(summary))
    finally:
        proc.terminate()
        proc.wait(60)
    cols = ("wall_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_ms", "tokens_per_s")
    print(f"{'N':>3} {'':6} " + " ".join(f"{c:>12}" for c in cols))
    for r in rows:
        for name, got in (("model", r), ("real", real.get(r["n"]))):
            if got:
                print(f"{r['n']:>3} {name:6} " + " ".join(f"{got[c]:12.2f}" for c in cols))
    if args.json:
        out = {"command": " ".join(sys.argv), "costs": asdict(costs), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SERVE:
        costs_json, model, port, chunk = sys.argv[2:6]
        sys.exit(serve(costs_json, model, int(port), int(chunk)))
    sys.exit(main())
