"""bench --concurrency: throughput and latency of N streams decoded together, offline.

For each N, N requests of --prompt-len random ids and --gen-len tokens each (greedy, no stop
id: EOS is ignored so every stream generates gen_len tokens) are submitted at once to a
nanoqwen.batching.Scheduler over the backend, which is stepped until all are done; each token
is stamped when its step returns (the host has it then: tokens are read back every step).

    aggregate tokens/s   N * gen_len / (last token - submission)
    TTFT                 submission -> a stream's first token; p50 and p99 over the N streams
                         (queueing behind the other prompts' chunks included)
    ITL                  gaps between a stream's consecutive tokens: p50 of the streams' medians
                         (the steady per-stream latency) and p99 of every gap of every stream
                         (the stalls a chunked prefill or a preemption causes)

Prompts are fresh random ids per run, so the prefix cache serves nothing. An untimed warm-up
run of each N (same prompt length, 4 tokens) comes first: the cuda backend captures its graphs
per batch size on first use.
"""

from __future__ import annotations

import time

import numpy as np

from ..batching import DEFAULT_PREFILL_CHUNK, Scheduler
from ..sampling import SamplingParams
from .bench import require_matplotlib

WARMUP_TOKENS = 4


def _percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def run_level(backend, n: int, prompt_len: int, gen_len: int, prefill_chunk: int,
              rng: np.random.Generator) -> dict:  # fmt: skip
    """One timed run of `n` streams (module docstring); the row of the result's `levels`."""
    sched = Scheduler(backend, min(n, backend.max_batch or 1), prefill_chunk)  # 0: solo only
    vocab = backend.config.vocab_size
    params = SamplingParams(max_tokens=gen_len)
    start = time.perf_counter()
    seqs = [sched.add(rng.integers(0, vocab, prompt_len).tolist(), params) for _ in range(n)]
    stamps: dict = {seq: [] for seq in seqs}
    steps = 0
    while sched.has_work:
        events = sched.step()
        now = time.perf_counter()
        steps += 1
        for event in events:
            if event.token is not None:
                stamps[event.seq].append(now)
    end = time.perf_counter()
    ttft = [1e3 * (s[0] - start) for s in stamps.values()]
    gaps = [1e3 * np.diff(s) for s in stamps.values()]
    medians = [float(np.median(g)) for g in gaps if g.size]
    every = np.concatenate(gaps) if gaps else np.zeros(0)
    return {
        "concurrency": n,
        "max_batch": sched.max_batch,
        "tokens_per_s": n * gen_len / (end - start),
        "per_stream_tokens_per_s": gen_len / (end - start),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "itl_p50_ms": _percentile(medians, 50),
        "itl_p99_ms": _percentile(every, 99),
        "wall_s": end - start,
        "steps": steps,
        "preemptions": sched.preemptions,
    }


def run_concurrency(backend, levels, prompt_len: int, gen_len: int,
                    prefill_chunk: int = DEFAULT_PREFILL_CHUNK, seed: int = 0,
                    warmup: bool = True) -> dict:  # fmt: skip
    """Every level of `levels` (module docstring); the result JSON."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in levels:
        if warmup:
            run_level(backend, n, prompt_len, min(gen_len, WARMUP_TOKENS), prefill_chunk, rng)
        rows.append(run_level(backend, n, prompt_len, gen_len, prefill_chunk, rng))
        if backend.block_manager.pages_held:
            raise AssertionError(f"{backend.block_manager.pages_held} KV pages still held")
    return {
        "workload": "concurrency",
        "backend": backend.name,
        "model": backend.config.name,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "prefill_chunk": prefill_chunk,
        "max_context": backend.max_context,
        "kv_pages": backend.block_manager.num_pages,
        "levels": rows,
    }


def print_concurrency(res: dict) -> None:
    print(f"{res['backend']}  model {res['model']}  prompt {res['prompt_len']}  gen "
          f"{res['gen_len']}  prefill chunk {res['prefill_chunk']}  "
          f"kv pages {res['kv_pages']}")  # fmt: skip
    head = ("N", "tok/s", "tok/s/stream", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "preempt")
    print("  ".join(f"{h:>12}" for h in head))
    for r in res["levels"]:
        cells = (r["concurrency"], r["tokens_per_s"], r["per_stream_tokens_per_s"],
                 r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"],
                 r["preemptions"])  # fmt: skip
        print("  ".join(f"{c:>12}" if isinstance(c, int) else f"{c:>12.2f}" for c in cells))
    print("(latencies in ms)")


def plot_concurrency(res: dict, path: str, title: str | None = None) -> None:
    """Aggregate tokens/s and per-stream ITL (p50, p99) against N into `path` (PNG: Agg);
    res["levels"] rows need concurrency, tokens_per_s, itl_p50_ms and itl_p99_ms."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = res["levels"]
    n = [r["concurrency"] for r in rows]
    fig = Figure(figsize=(11, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.plot(n, [r["tokens_per_s"] for r in rows], marker="o")
    left.set_ylabel("aggregate generated tokens/s")
    left.set_ylim(bottom=0)
    right.plot(n, [r["itl_p50_ms"] for r in rows], marker="o", label="p50 of stream medians")
    right.plot(n, [r["itl_p99_ms"] for r in rows], marker=".", ls="--", label="p99 of all gaps")
    right.set_ylabel("per-stream inter-token latency (ms)")
    right.set_ylim(bottom=0)
    right.legend(loc="upper left")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("concurrent streams N")
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"{res['backend']}  model {res['model']}  prompt {res['prompt_len']}  "
                 f"gen {res['gen_len']}: continuous batching by N")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
