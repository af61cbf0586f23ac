"""benchmark_e2e: TTFT, steady-state inter-token latency, tokens/s, achieved bandwidth.

Protocol (config/nanoqwen.yaml, benchmark): batch 1, a random prompt of `prompt_len` ids,
`gen_len` generated tokens with no stop ids (every run is full length), `warmup` runs then
`runs` timed runs. TTFT: generate() called -> first token on the host. ITL: gaps between
tokens arriving on the host (median over all gaps of all runs) and, as a cross-check, the
decode wall time / (gen_len - 1). Bytes per token: every weight once
(ModelConfig.weight_bytes_per_token) + the K/V read at the mean context. Achieved TB/s is
bytes per token / ITL, against a device-to-device copy measured in the same process.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import time

import numpy as np

COPY_BYTES = 2 << 30


def copy_bandwidth(gpu, nbytes: int = COPY_BYTES, reps: int = 10) -> float:
    """(read + write) bytes / second of cuMemcpyDtoD on `gpu`'s stream, median of `reps`."""
    from cuda.core import EventOptions

    a, b = gpu.alloc(nbytes, "copy src"), gpu.alloc(nbytes, "copy dst")
    times = []
    opts = EventOptions(timing_enabled=True)
    for _ in range(reps + 1):
        e0 = gpu.stream.record(options=opts)
        gpu.copy_d2d(b.ptr, a.ptr, nbytes)
        e1 = gpu.stream.record(options=opts)
        e1.sync()
        times.append((e1 - e0) / 1e3)  # ms -> s
    a.free(), b.free()
    return 2 * nbytes / float(np.median(times[1:]))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "uncommitted"  # fmt: skip
    except Exception:
        return "unknown"


def run_bench(engine, prompt_len=512, gen_len=128, warmup=3, runs=10, seed=0) -> dict:
    from .sampling import SamplingParams

    cfg = engine.config
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=gen_len)
    ttfts, gaps, decode_walls = [], [], []
    for r in range(warmup + runs):
        ids = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
        t0 = time.perf_counter()
        stamps = []
        for _ in engine.generate(ids, params, frozenset()):
            stamps.append(time.perf_counter())
        if len(stamps) != gen_len:
            raise RuntimeError(f"run {r}: {len(stamps)} tokens, expected {gen_len}")
        if r >= warmup:
            ttfts.append(stamps[0] - t0)
            gaps += list(np.diff(stamps))
            decode_walls.append((stamps[-1] - stamps[0]) / (gen_len - 1))
    itl = float(np.median(gaps))
    kv = cfg.num_layers * 2 * cfg.kv_size * 2 * (prompt_len + gen_len / 2)
    bpt = cfg.weight_bytes_per_token() + int(kv)
    copy = copy_bandwidth(engine.gpu)
    return {
        "gpu": engine.gpu.name,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": cfg.name,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "warmup": warmup,
        "runs": runs,
        "graph_mode": engine.graph_mode,
        "ttft_ms": 1e3 * float(np.median(ttfts)),
        "itl_ms": 1e3 * itl,
        "itl_wall_ms": 1e3 * float(np.median(decode_walls)),
        "tokens_per_s": 1.0 / itl,
        "bytes_per_token": bpt,
        "achieved_tb_s": bpt / itl / 1e12,
        "copy_tb_s": copy / 1e12,
    }


def print_result(res: dict) -> None:
    print(f"{res['gpu']}  model {res['model']}  prompt {res['prompt_len']}  gen {res['gen_len']}")
    for k in ("ttft_ms", "itl_ms", "itl_wall_ms", "tokens_per_s", "achieved_tb_s", "copy_tb_s"):
        print(f"  {k:14} {res[k]:10.3f}")


def save(res: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
