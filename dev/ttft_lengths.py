"""Time to first token by prompt length on one engine (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/ttft_lengths.py FILE --lengths 512,530,576 [--runs 5]

For each length, `nanoqwen bench`'s measurement (harness.bench.run_bench: random ids, generate()
called -> first token on the host) with 2 tokens generated, median of --runs after 2 warm-ups,
one engine for every length: what a prompt's odd length costs the prefill (docs/PERFORMANCE.md,
Prompt lengths and the GEMM tiles). Run the script from another tree (PYTHONPATH) to compare
versions on one machine.
"""

from __future__ import annotations

import argparse

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.bench import run_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model")
    ap.add_argument("--lengths", required=True, help="prompt lengths, comma list")
    ap.add_argument("--runs", type=int, default=5, help="timed runs a length (after 2 warm-ups)")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    e = CudaBackend(NanoqwenFile(args.file), max_context=max(lengths) + 16)
    for n in lengths:
        r = run_bench(e, n, 2, warmup=2, runs=args.runs)
        print(f"ttft L={n:5d} {r['ttft_ms']:8.2f} ms", flush=True)
    e.close()


if __name__ == "__main__":
    main()
