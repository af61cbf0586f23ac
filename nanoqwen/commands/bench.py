"""Benchmark the CUDA engine end to end (benchmark_e2e): TTFT, inter-token latency, tokens/s,
achieved TB/s against a device-to-device copy measured in the same run."""

HELP = "benchmark the CUDA engine (needs an sm_90 GPU)"


def add_arguments(p) -> None:
    p.add_argument("file", help=".nanoqwen model file")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (random ids)")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    p.add_argument("--runs", type=int, default=10, help="timed runs")
    p.add_argument("--max-context", type=int, default=4096, help="KV cache positions")
    p.add_argument("--json", default=None, help="write the result JSON here")


def run(args) -> int:
    from ..bench import print_result, run_bench, save
    from ..engine import CudaBackend
    from ..fileformat import NanoqwenFile

    with NanoqwenFile(args.file) as f:
        engine = CudaBackend(f, max_context=args.max_context)
        try:
            res = run_bench(engine, args.prompt_len, args.gen_len, args.warmup, args.runs)
        finally:
            engine.close()
    print_result(res)
    if args.json:
        save(res, args.json)
    return 0
