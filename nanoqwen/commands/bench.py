"""Benchmark the CUDA engine end to end (benchmark_e2e): TTFT (the prompt's prefill + first
token), inter-token latency, tokens/s, achieved TB/s against a device-to-device copy measured in
the same run. --kernels adds a per-kernel table of one decode step, --plot draws inter-token
latency by position, --baseline transformers times Hugging Face transformers (bf16, random
weights of the same shapes) on the same GPU in the same run, after our engine is closed.

--workload prefix: the prefix cache's case (an editor resending a file, a chat its
conversation): TTFT of a --prompt-len prefix + --new-len new tokens with the prefix cached by
the request before (a warm one, and the cold one that filled the cache), against the same
request cold, and whether both give the same tokens.

--workload edit|fim|chat: speculative decoding against plain decoding on real prompts built
from the Python standard library's source (nanoqwen/harness/workloads.py): --requests prompts,
each generated plain then speculative (--spec-k, --spec-ngram, --spec-backoff) on the same
--backend (the reference too), greedy or sampled (--temperature, --top-k, --top-p): effective
tokens/s and ms/token of each, the speed-up, accepted drafts a step, and (greedy) whether the
outputs are token-identical (nanoqwen/harness/spec_bench.py).

--workload verify: the verify step of speculative decoding (one pass over the weights for M
tokens) timed by its rows (--rows) beside the decode step, at context --prompt-len: us a step,
the ratio to M = 1 and to the decode step, ms a token if all M were accepted
(nanoqwen/harness/verify_bench.py).

--concurrency 1,2,4,8,16,32: continuous batching offline, in process: for each N, N streams of
--prompt-len random ids and --gen-len tokens submitted together to the scheduler
(nanoqwen.batching) on --backend (any: the reference too): aggregate tokens/s, per-stream
inter-token latency and TTFT p50/p99 by N; --plot draws tokens/s and ITL against N
(nanoqwen/harness/concurrency.py)."""

import sys

from .argtypes import int_range
from .generate import add_k_cache_argument, add_speculative_arguments

HELP = "benchmark the CUDA engine (needs an sm_90 GPU), or speculation on real prompts"
BASELINES = ("transformers",)
SPEC_WORKLOADS = ("edit", "fim", "chat")  # nanoqwen.harness.workloads.WORKLOADS
WORKLOADS = ("e2e", "prefix", *SPEC_WORKLOADS, "verify")


def concurrency_levels(text: str) -> list[int]:
    """--concurrency: comma-separated stream counts, each >= 1, e.g. 1,2,4,8."""
    import argparse

    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4,8, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"every level must be >= 1, got {text!r}")
    return levels


def verify_rows(text: str) -> list[int]:
    """--rows: comma-separated verify-step row counts, each in 1..16, e.g. 1,2,4,8,16."""
    import argparse

    from ..cuda.registry import MAX_ROWS

    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,16, got {text!r}") from None
    if not rows or min(rows) < 1 or max(rows) > MAX_ROWS:
        raise argparse.ArgumentTypeError(f"every row count must lie in 1..{MAX_ROWS}, got {text!r}")
    return rows


def add_arguments(p) -> None:
    from ..harness import load_protocol

    protocol = load_protocol()["benchmark"]  # the defaults: config/nanoqwen.yaml
    p.add_argument("file", help=".nanoqwen model file")
    p.add_argument("--workload", choices=WORKLOADS, default="e2e",
                   help="e2e: benchmark_e2e; prefix: warm against cold TTFT; edit, fim, chat: "
                   "speculative against plain greedy on stdlib prompts; verify: the verify "
                   "step by its rows beside the decode step")  # fmt: skip
    p.add_argument("--rows", type=verify_rows, default=None, metavar="M,M,...",
                   help="verify workload: the row counts timed (default 1,2,4,8,16)")  # fmt: skip
    p.add_argument("--concurrency", type=concurrency_levels, default=None, metavar="N,N,...",
                   help="batched streams at each of these concurrencies (replaces --workload; "
                   "any --backend)")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int_range(1), default=None,
                   help="--concurrency: prompt tokens prefilled per scheduler step "
                   "(default: nanoqwen.batching's)")  # fmt: skip
    p.add_argument("--requests", type=int_range(1), default=8,
                   help="edit/fim/chat: prompts of the workload")  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=0, help="edit/fim/chat: which prompts; verify: its random ids"
    )
    p.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto",
                   help="edit/fim/chat: the backend (e2e and prefix need cuda)")  # fmt: skip
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="edit/fim/chat: sample both modes at this temperature (0: greedy)",
    )
    p.add_argument(
        "--top-k", type=int_range(0), default=0, help="edit/fim/chat: with --temperature"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="edit/fim/chat: with --temperature")
    add_speculative_arguments(p, method=False)
    add_k_cache_argument(p)
    p.add_argument("--new-len", type=int_range(1), default=64,
                   help="prefix workload: new tokens after the --prompt-len prefix")  # fmt: skip
    p.add_argument("--prompt-len", type=int_range(1), default=protocol["prompt_len"],
                   help="prompt tokens (random ids)")  # fmt: skip
    p.add_argument("--gen-len", type=int_range(2), default=protocol["gen_len"],
                   help="generated tokens per run")  # fmt: skip
    p.add_argument("--warmup", type=int_range(0), default=protocol["warmup"],
                   help="untimed runs first")  # fmt: skip
    p.add_argument("--runs", type=int_range(1), default=protocol["runs"], help="timed runs")
    p.add_argument(
        "--max-context",
        type=int_range(1),
        default=None,
        help="KV cache positions; default: prompt-len + gen-len rounded up to a 16-token page "
        "(--concurrency: that times the largest N, at most the model's positions)",
    )
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also time each kernel of one decode step at position prompt-len "
        "(table: us, bytes, TB/s, share of the step; JSON key 'kernels')",
    )
    p.add_argument("--kernel-reps", type=int_range(1), default=20,
                   help="--kernels and the verify workload: steps per timing graph")  # fmt: skip
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="draw inter-token latency against position into this PNG (needs matplotlib)",
    )
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        default=None,
        help="also run this baseline (bf16, same shapes, same GPU) and print the "
        "ratio; skipped with a message when not importable",
    )
    p.add_argument("--baseline-warmup", type=int_range(0), default=1, help="untimed baseline runs")
    p.add_argument("--baseline-runs", type=int_range(1), default=3, help="timed baseline runs")


def run(args) -> int:
    from ..errors import NanoqwenError

    if args.rows and (args.concurrency or args.workload != "verify"):
        raise NanoqwenError("--rows belongs to the verify workload")
    if args.concurrency:
        return _concurrency(args)
    if args.workload in SPEC_WORKLOADS:
        return _speculative(args)
    if args.backend == "reference":
        raise NanoqwenError(f"--workload {args.workload} times the cuda engine: no --backend "
                            "reference (edit, fim and chat take it)")  # fmt: skip
    if args.baseline:
        from ..harness import import_torch_first

        import_torch_first()  # the transformers baseline runs after the engine's kernels build
    from ..engine import CudaBackend
    from ..fileformat import NanoqwenFile
    from ..harness.bench import (
        default_max_context,
        format_kernels,
        kernel_breakdown,
        plot_itl,
        print_result,
        require_matplotlib,
        run_bench,
        save,
    )

    if args.workload == "prefix":
        return _prefix(args)
    if args.workload == "verify":
        return _verify(args)
    if args.plot:
        require_matplotlib()  # before minutes of benchmarking, not after
    with NanoqwenFile(args.file) as f:
        cfg = f.config
        max_context = args.max_context or default_max_context(
            args.prompt_len, args.gen_len, cfg.max_position_embeddings
        )
        engine = CudaBackend(f, max_context=max_context, k_cache=args.k_cache)
        try:
            res = run_bench(engine, args.prompt_len, args.gen_len, args.warmup, args.runs)
            if args.kernels:
                res["kernels"] = kernel_breakdown(engine, args.prompt_len, args.kernel_reps)
        finally:
            engine.close()
    print_result(res)
    if "kernels" in res:
        print(format_kernels(res["kernels"]))
    if args.plot:
        plot_itl(res, args.plot)
        print(f"plot: {args.plot}")
    rc = 0
    if args.baseline:
        from ..harness.baseline import bench_baseline, print_baseline

        res["baseline"] = bench_baseline(
            cfg, res, warmup=args.baseline_warmup, runs=args.baseline_runs
        )
        print_baseline(res["baseline"])
        if "error" in res["baseline"]:
            print(f"nanoqwen bench: baseline failed: {res['baseline']['error']}", file=sys.stderr)
            rc = 1
    if args.json:
        save(res, args.json)
    return rc


def _on_engine(args, context: int, extra: int, bench) -> dict:
    """bench(engine) on a CudaBackend over args.file whose KV cache holds context + extra
    positions (--max-context, else default_max_context's pages of them), closed after; a cache
    too short for them is refused before the engine is built."""
    from ..engine import CudaBackend
    from ..errors import NanoqwenError
    from ..fileformat import NanoqwenFile
    from ..harness.bench import default_max_context

    if args.kernels or args.plot or args.baseline:
        raise NanoqwenError("--kernels, --plot and --baseline belong to the e2e workload")
    with NanoqwenFile(args.file) as f:
        limit = f.config.max_position_embeddings
        max_context = args.max_context or default_max_context(context, extra, limit)
        if context + extra > max_context:
            raise NanoqwenError(f"a KV cache of {max_context} positions (--max-context, at most "
                                f"the model's) is shorter than the {context} + {extra} this "
                                "workload needs")  # fmt: skip
        engine = CudaBackend(f, max_context=max_context, k_cache=args.k_cache)
        try:
            return bench(engine)
        finally:
            engine.close()


def _prefix(args) -> int:
    from ..harness.bench import print_prefix_result, run_prefix_bench, save

    res = _on_engine(args, args.prompt_len + args.new_len, args.gen_len,
                     lambda e: run_prefix_bench(e, args.prompt_len, args.new_len, args.gen_len,
                                                args.warmup, args.runs))  # fmt: skip
    print_prefix_result(res)
    if args.json:
        save(res, args.json)
    return 0 if res["identical_tokens"] else 1


def _verify(args) -> int:
    from ..harness.bench import save
    from ..harness.verify_bench import (
        DEFAULT_ROWS,
        VerifyStep,
        print_verify_result,
        run_verify_bench,
    )

    rows = args.rows or list(DEFAULT_ROWS)
    res = _on_engine(args, args.prompt_len, VerifyStep.ROWS,
                     lambda e: run_verify_bench(e, rows, args.prompt_len, args.kernel_reps,
                                                args.seed))  # fmt: skip
    print_verify_result(res)
    if args.json:
        save(res, args.json)
    return 0


def _speculative(args) -> int:
    from ..errors import NanoqwenError
    from ..harness.bench import save
    from ..harness.spec_bench import print_spec_result, run_spec_bench
    from ..harness.workloads import build
    from ..llm import LLM
    from ..sampling import SamplingParams
    from .generate import speculative_config

    if args.kernels or args.plot or args.baseline:
        raise NanoqwenError("--kernels, --plot and --baseline belong to the e2e workload")
    spec = speculative_config(args, method="ngram")
    prompts = build(args.workload, args.requests, args.seed)

    def open_llm(config):
        return LLM(args.file, backend=args.backend, max_context=args.max_context,
                   speculative=config, k_cache=args.k_cache)  # fmt: skip

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    res = run_spec_bench(open_llm, args.workload, prompts, spec, args.gen_len, args.warmup,
                         args.runs, sampling)  # fmt: skip
    print_spec_result(res)
    if args.json:
        save(res, args.json)
    return 0 if res["identical"] is not False else 1


def _concurrency(args) -> int:
    import shlex

    from ..batching import DEFAULT_PREFILL_CHUNK
    from ..errors import NanoqwenError
    from ..fileformat import NanoqwenFile
    from ..harness.bench import default_max_context, save
    from ..harness.concurrency import plot_concurrency, print_concurrency, run_concurrency
    from ..llm import choose_backend

    if args.kernels or args.baseline or args.workload != "e2e":
        raise NanoqwenError("--concurrency takes no --kernels, --baseline or --workload")
    if args.plot:
        from ..harness.bench import require_matplotlib

        require_matplotlib()
    name, _ = choose_backend(args.backend)
    with NanoqwenFile(args.file) as f:
        # Room for every stream of the largest N at once, so that the pool (sized by the
        # context on both backends) does not preempt unless the model's positions cap it.
        limit = f.config.max_position_embeddings
        per_stream = default_max_context(args.prompt_len, args.gen_len, limit)
        max_context = args.max_context or min(max(args.concurrency) * per_stream, limit)
        if name == "cuda":
            from ..engine import CudaBackend

            backend = CudaBackend(f, max_context=max_context, k_cache=args.k_cache)
        else:
            from ..reference import ReferenceBackend

            backend = ReferenceBackend(f, max_context=max_context,
                                       max_batch=max(args.concurrency))  # fmt: skip
        try:
            res = run_concurrency(backend, args.concurrency, args.prompt_len, args.gen_len,
                                  args.prefill_chunk or DEFAULT_PREFILL_CHUNK, args.seed,
                                  warmup=args.warmup > 0)  # fmt: skip
        finally:
            backend.close()
    # The run's command with every setting spelled out (defaults included): it reproduces it.
    res["command"] = shlex.join([
        "nanoqwen", "bench", args.file, "--backend", name,
        "--concurrency", ",".join(map(str, args.concurrency)),
        "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
        "--prefill-chunk", str(res["prefill_chunk"]), "--max-context", str(max_context),
        "--seed", str(args.seed), "--warmup", str(args.warmup),
    ])  # fmt: skip
    print_concurrency(res)
    if args.plot:
        plot_concurrency(res, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        save(res, args.json)
    return 0
