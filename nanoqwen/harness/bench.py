"""benchmark_e2e: TTFT, steady-state inter-token latency, tokens/s, achieved bandwidth.

Protocol (config/nanoqwen.yaml, benchmark): batch 1, a random prompt of `prompt_len` ids,
`gen_len` generated tokens with no stop ids (every run is full length), `warmup` runs then
`runs` timed runs. TTFT: generate() called -> first token on the host (the prompt's prefill
plus the first sample). ITL: gaps between tokens arriving on the host (median over all gaps of
all runs) and, as a cross-check, the decode wall time / (gen_len - 1); per position, the
median over runs of gap i, the decode step at position prompt_len + i (`itl_by_position_ms`).
SM clocks (`sm_mhz`): a thread reads the SM clock every 5 ms (Gpu.sm_clock_mhz); per run the
mean over its TTFT and over its decode, the medians over runs recorded (None without NVML).
An H200 holds its 700 W limit by lowering the clock, so a long compute-bound prefill runs below
the top clock and a figure is read with the clock it ran at (docs/PERFORMANCE.md).
Bytes per token: every weight once (ModelConfig.weight_bytes_per_token) + the K/V read at the
mean context. Achieved TB/s is bytes per token / ITL, against a device-to-device copy measured
in the same process.

`kernel_breakdown` (bench --kernels): one decode step at position prompt_len, recorded launch
by launch (CudaBackend.record_decode_step), each launch timed alone (a CUDA graph of `reps`
copies of it, events around the graph, median of `timed` launches), aggregated by label,
against the whole step timed the same way. `plot_itl` (bench --plot) draws itl_by_position_ms.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import subprocess
import threading
import time

import numpy as np

from ..config import PAGE_TOKENS
from ..cuda.registry import kv_token_bytes
from ..errors import NanoqwenError

COPY_BYTES = 2 << 30


def default_max_context(prompt_len: int, gen_len: int, limit: int | None = None) -> int:
    """prompt_len + gen_len rounded up to a whole KV page, at most `limit` (the model's
    max_position_embeddings; a run that does not fit then fails the engine's context check)."""
    n = -(-(prompt_len + gen_len) // PAGE_TOKENS) * PAGE_TOKENS
    return min(n, limit) if limit else n


def copy_bandwidth(gpu, nbytes: int = COPY_BYTES, reps: int = 10) -> float:
    """(read + write) bytes / second of cuMemcpyDtoD on `gpu`'s stream, median of `reps`."""
    a, b = gpu.alloc(nbytes, "copy src"), gpu.alloc(nbytes, "copy dst")
    times = []
    for _ in range(reps + 1):
        e0 = gpu.record()
        gpu.copy_d2d(b.ptr, a.ptr, nbytes)
        e1 = gpu.record()
        e1.sync()
        times.append((e1 - e0) / 1e3)  # ms -> s
    a.free(), b.free()
    return 2 * nbytes / float(np.median(times[1:]))


def commit_id() -> str:
    """The tree a record was measured on: $NANOQWEN_COMMIT when set (a copy of the tree whose
    own git is stale, as on a lent GPU host that receives the working files only), else `git
    describe` of the current directory."""
    if os.environ.get("NANOQWEN_COMMIT"):
        return os.environ["NANOQWEN_COMMIT"]
    try:
        cmd = ["git", "describe", "--always", "--dirty=+dirty"]  # +dirty: uncommitted changes
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip() or (
            "uncommitted"
        )
    except Exception:
        return "unknown"


def itl_by_position(gap_runs) -> list[float]:
    """Per-position median (over runs) of the inter-token gaps, in ms. `gap_runs`: one sequence
    of gen_len - 1 gaps (seconds) per timed run; element i is the step at prompt_len + i."""
    runs = [np.asarray(g, dtype=np.float64) for g in gap_runs]
    if not runs or runs[0].size == 0:
        return []
    if any(g.shape != runs[0].shape for g in runs):
        raise ValueError("every run must have the same number of gaps")
    return [float(v) for v in 1e3 * np.median(np.stack(runs), axis=0)]


class ClockSampler:
    """The GPU's SM clock every `period` seconds on a daemon thread while the block runs:
    `mean(t0, t1)` over a window of time.perf_counter() stamps (a window of a few periods
    holds a few samples)."""

    def __init__(self, gpu, period: float = 0.005):
        self.gpu, self.period = gpu, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sm clock")

    def __enter__(self) -> ClockSampler:
        if self.gpu.sm_clock_mhz() is not None:  # none without NVML: record nothing
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            mhz = self.gpu.sm_clock_mhz()
            if mhz is not None:
                self.samples.append((time.perf_counter(), mhz))

    def mean(self, t0: float, t1: float) -> float | None:
        """Mean clock over [t0, t1]; the sample nearest the window when none fell inside;
        None without samples."""
        inside = [mhz for t, mhz in self.samples if t0 <= t <= t1]
        if inside:
            return statistics.fmean(inside)
        if not self.samples:
            return None
        mid = (t0 + t1) / 2
        return float(min(self.samples, key=lambda s: abs(s[0] - mid))[1])


def _median_clock(clocks: ClockSampler, spans) -> float | None:
    """Median over (t0, t1) spans of the mean clock in each; None without samples."""
    return float(np.median([clocks.mean(*s) for s in spans])) if clocks.samples else None


def run_bench(engine, prompt_len: int, gen_len: int, warmup: int, runs: int, seed: int = 0) -> dict:
    from ..sampling import SamplingParams

    if gen_len < 2 or runs < 1:
        raise ValueError("benchmark_e2e needs gen_len >= 2 and runs >= 1")
    cfg = engine.config
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=gen_len)
    gap_runs, windows = [], []  # windows: (called, first token, last token) of each timed run
    with ClockSampler(engine.gpu) as clocks:
        for r in range(warmup + runs):
            ids = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
            t0 = time.perf_counter()
            stamps = []
            for _ in engine.generate(ids, params, frozenset()):
                stamps.append(time.perf_counter())
            if len(stamps) != gen_len:
                raise RuntimeError(f"run {r}: {len(stamps)} tokens, expected {gen_len}")
            if r >= warmup:
                gap_runs.append(np.diff(stamps))
                windows.append((t0, stamps[0], stamps[-1]))
    ttfts = [t1 - t0 for t0, t1, _ in windows]
    decode_walls = [(t2 - t1) / (gen_len - 1) for _, t1, t2 in windows]
    sm_mhz = {  # None without NVML (no samples)
        "ttft": _median_clock(clocks, [(t0, t1) for t0, t1, _ in windows]),
        "decode": _median_clock(clocks, [(t1, t2) for _, t1, t2 in windows]),
    }
    itl = float(np.median(np.concatenate(gap_runs)))
    kv = cfg.num_layers * kv_token_bytes(cfg, engine.kernels.geometry) * (prompt_len + gen_len / 2)
    head = getattr(getattr(engine, "file", None), "lm_head", "float16")  # int8: half the head
    bpt = cfg.weight_bytes_per_token(head) + int(kv)
    memory = engine.memory()  # before the copy test's 4 GiB of buffers
    copy = copy_bandwidth(engine.gpu)
    return {
        "gpu": engine.gpu.name,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": cfg.name,
        "k_cache": engine.k_cache,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "max_context": engine.max_context,
        "warmup": warmup,
        "runs": runs,
        "ttft_ms": 1e3 * float(np.median(ttfts)),
        "itl_ms": 1e3 * itl,
        "itl_wall_ms": 1e3 * float(np.median(decode_walls)),
        "tokens_per_s": 1.0 / itl,
        "bytes_per_token": bpt,
        "achieved_tb_s": bpt / itl / 1e12,
        "copy_tb_s": copy / 1e12,
        "itl_by_position_ms": itl_by_position(gap_runs),
        "sm_mhz": sm_mhz,
        "memory": memory,
    }


def run_prefix_bench(
    engine, prefix_len: int, new_len: int, gen_len: int, warmup: int, runs: int, seed: int = 0
) -> dict:
    """The prefix workload (bench --workload prefix): an editor resending a file, a chat
    resending its conversation. Each request is one fixed random prefix of `prefix_len` ids
    plus `new_len` fresh ones. Warm: the request before it (the same prefix, other new ids)
    left the prefix in the cache, so only the new tokens (and the prefix's partial last page)
    are prefilled; timed after a warm request (steady editing: ttft_warm) and right after the
    cold request that filled the cache (ttft_warm_after_cold: the GPU has just run a long
    prefill). Cold: a request after the cache was cleared (every token prefilled). TTFT
    medians of `runs` after `warmup`, and whether the warm request and the same request cold
    give the same greedy tokens (gen_len each)."""
    from ..sampling import SamplingParams

    if runs < 1 or new_len < 1 or gen_len < 1:
        raise ValueError("the prefix workload needs runs, new_len and gen_len >= 1")
    vocab = engine.config.vocab_size
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    params = SamplingParams(max_tokens=gen_len)

    def request():
        """A fresh request (new ids after the prefix): its ids, TTFT, tokens, cached tokens."""
        ids = prefix + rng.integers(0, vocab, new_len).tolist()
        return (ids, *timed(ids))

    def timed(ids):
        t0 = time.perf_counter()
        tokens = []
        for token in engine.generate(ids, params, frozenset()):
            if not tokens:
                ttft = time.perf_counter() - t0
            tokens.append(token)
        return ttft, tokens, engine.cached_tokens

    ttft = {"cold": [], "warm": [], "warm_after_cold": []}
    cached, same = [], []
    for r in range(warmup + runs):
        engine.kv.pages.clear_cache()
        request()  # cold: the prefix into the cache
        _, t_after_cold, _, _ = request()
        ids, t_warm, warm_tokens, hit = request()
        engine.kv.pages.clear_cache()
        t_cold, cold_tokens, _ = timed(ids)
        if r >= warmup:
            ttft["cold"].append(t_cold)
            ttft["warm"].append(t_warm)
            ttft["warm_after_cold"].append(t_after_cold)
            cached.append(hit)
            same.append(cold_tokens == warm_tokens)
    return {
        "gpu": engine.gpu.name,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": engine.config.name,
        "workload": "prefix",
        "prefix_len": prefix_len,
        "new_len": new_len,
        "gen_len": gen_len,
        "max_context": engine.max_context,
        "warmup": warmup,
        "runs": runs,
        "ttft_cold_ms": 1e3 * float(np.median(ttft["cold"])),
        "ttft_warm_ms": 1e3 * float(np.median(ttft["warm"])),
        "ttft_warm_after_cold_ms": 1e3 * float(np.median(ttft["warm_after_cold"])),
        "cached_tokens": int(np.median(cached)),
        "identical_tokens": all(same),
        "memory": engine.memory(),
    }


def print_prefix_result(res: dict) -> None:
    print(f"{res['gpu']}  model {res['model']}  prefix {res['prefix_len']} + {res['new_len']} "
          f"new tokens, gen {res['gen_len']}")  # fmt: skip
    print(f"  ttft cold      {res['ttft_cold_ms']:10.3f} ms")
    print(
        f"  ttft warm      {res['ttft_warm_ms']:10.3f} ms  ({res['cached_tokens']} cached tokens)"
    )
    print(f"  ttft warm after the cold request {res['ttft_warm_after_cold_ms']:.3f} ms")
    print(f"  warm tokens identical to cold: {res['identical_tokens']}")


def print_result(res: dict) -> None:
    print(f"{res['gpu']}  model {res['model']}  K cache {res['k_cache']}  "
          f"prompt {res['prompt_len']}  gen {res['gen_len']}")  # fmt: skip
    for k in ("ttft_ms", "itl_ms", "itl_wall_ms", "tokens_per_s", "achieved_tb_s", "copy_tb_s"):
        print(f"  {k:14} {res[k]:10.3f}")
    mhz = res.get("sm_mhz") or {}
    if mhz.get("ttft") is not None:
        print(f"  SM clock: {mhz['ttft']:.0f} MHz in the TTFT, {mhz['decode']:.0f} in the decode")
    if "memory" in res:
        m, gb = res["memory"], 1e9
        print(
            f"  memory: device used {m['device_used'] / gb:.3f} GB = weights "
            f"{m['weights'] / gb:.3f} + KV {m['kv_cache'] / gb:.3f} + workspace "
            f"{m['workspace'] / gb:.3f} GB ({m['unaccounted_pct']:+.1f}% unaccounted)"
        )


def save(res: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")


# -- bench --kernels ----------------------------------------------------------------------------
def _row(label, count, seconds, nbytes, step_s) -> dict:
    return {
        "label": label,
        "count": count,
        "us": 1e6 * seconds,
        "bytes": nbytes,
        "tb_s": nbytes / seconds / 1e12 if nbytes and seconds > 0 else None,
        "share_pct": 100.0 * seconds / step_s if step_s > 0 else None,
    }


def aggregate_kernels(timed, step_s: float) -> dict:
    """Aggregate one step's launches by label.

    timed   (label, seconds per launch, bytes per launch; 0 = unknown) for every launch of one
            step, in launch order
    step_s  the whole step's time (seconds)

    Returns {"rows": [...] (per label, slowest first), "sum_of_kernels": row, "whole_step": row,
    "overhead_us": whole step - sum of kernels, "unknown_bytes": labels without bytes}. A row:
    label, count (launches per step), us (per step), bytes (per step; None if unknown), tb_s
    (bytes / time; None if unknown), share_pct (of the whole step).
    """
    by: dict[str, list] = {}
    for label, seconds, nbytes in timed:
        acc = by.setdefault(label, [0, 0.0, 0, False])
        acc[0] += 1
        acc[1] += seconds
        acc[2] += int(nbytes)
        acc[3] |= not nbytes  # any launch of the label with unknown bytes
    rows = [
        _row(label, n, s, None if unknown else b, step_s)
        for label, (n, s, b, unknown) in by.items()
    ]
    rows.sort(key=lambda r: -r["us"])  # stable: ties keep launch order
    total_s = sum(s for _, s, _ in timed)
    known = sum(int(b) for _, _, b in timed)
    unknown = [label for label, acc in by.items() if acc[3]]
    return {
        "rows": rows,
        "sum_of_kernels": _row("sum of kernels", len(timed), total_s, known or None, step_s),
        "whole_step": _row("whole step (graph)", None, step_s, known or None, step_s),
        "overhead_us": 1e6 * (step_s - total_s),
        "unknown_bytes": unknown,
    }


def format_kernels(k: dict) -> str:
    """The --kernels table (text)."""

    def fmt(v, width, spec, unit=None):
        return f"{'-':>{width}}" if v is None else format(v / unit if unit else v, f"{width}{spec}")

    head = (f"decode step at position {k.get('pos', '?')} (context {k.get('context', '?')}): "
            f"each launch timed alone in a graph of {k.get('reps', '?')} "
            f"(median of {k.get('timed', '?')} launches)")  # fmt: skip
    width = max([len(r["label"]) for r in k["rows"]] + [len("whole step (graph)")])
    lines = [head, f"  {'kernel':{width}} {'n':>5} {'us/step':>10} {'MB/step':>10} "
                   f"{'TB/s':>7} {'share':>7}"]  # fmt: skip
    rule = "  " + "-" * (width + 44)
    rows = [*k["rows"], None, k["sum_of_kernels"], k["whole_step"]]
    for r in rows:
        if r is None:
            lines.append(rule)
            continue
        lines.append(
            f"  {r['label']:{width}} {fmt(r['count'], 5, 'd')} {r['us']:10.2f} "
            f"{fmt(r['bytes'], 10, '.2f', 1e6)} {fmt(r['tb_s'], 7, '.3f')} "
            f"{fmt(r['share_pct'], 6, '.1f')}%"
        )
    step = k["whole_step"]["us"]
    pct = 100.0 * k["overhead_us"] / step if step > 0 else 0.0
    lines.append(f"  launch/dependency overhead (whole step - sum): {k['overhead_us']:.2f} us "
                 f"({pct:.1f}%)")  # fmt: skip
    if k.get("unknown_bytes"):
        lines.append(f"  bytes unknown (-): {', '.join(k['unknown_bytes'])}; TB/s of the sums "
                     "counts the known bytes only")  # fmt: skip
    return "\n".join(lines)


def time_graph(gpu, body, reps: int, timed: int = 5, reset=None) -> float:
    """Seconds per body(stream_like) call: one CUDA graph of `reps` calls, launched once to
    warm up and `timed` times between timing events (median). `reset()` runs before each
    launch, outside the events (e.g. re-uploading the decode state)."""
    with gpu.guard("bench --kernels: time graph"):
        gb = gpu.graph_builder()
        for _ in range(reps):
            body(gb)
        graph = gb.end_building().complete()
        try:
            graph.upload(gpu.stream)
            times = []
            for i in range(timed + 1):
                if reset is not None:
                    reset()
                e0 = gpu.record()
                graph.launch(gpu.stream)
                e1 = gpu.record()
                e1.sync()
                if i:  # the first launch warms up
                    times.append((e1 - e0) / 1e3)  # ms -> s
        finally:
            with contextlib.suppress(Exception):
                graph.close()
            with contextlib.suppress(Exception):
                gb.close()
    return float(np.median(times)) / reps


def launch_times(gpu, trace, replay, reps: int, timed: int = 5, reset=None) -> list[float]:
    """Seconds of each launch of `trace` (Launches of one step, in order): one graph per label
    holding that label's launches of the whole step (each layer's own weights, as in the step:
    a repeated single launch would be served from L2), `reps` times over (time_graph); a
    launch's time is the graph's over the label's launch count. replay(launch, stream)
    enqueues a launch again (Launcher.replay)."""
    groups: dict[str, list] = {}
    for ln in trace:
        groups.setdefault(ln.label, []).append(ln)
    per_launch = {}
    for label, lns in groups.items():

        def body(s, lns=lns) -> None:
            for ln in lns:
                replay(ln, stream=s)

        per_launch[label] = time_graph(gpu, body, reps, timed, reset) / len(lns)
    return [per_launch[ln.label] for ln in trace]


# The operation a launch label stands for, across the decode step's kernels ("gemv down"), the
# multi-row step's ("gemv_rows down", "attention_rows", "lm_head_rows") and the prefill GEMM's
# ("gemm down"): compare_steps puts the steps' labels of one operation on one row.
_LABEL_PREFIXES = ("gemv_rows ", "gemv ", "gemm ")
_LABEL_SUFFIXES = ("_rows",)
STEP_OPS = ("embed", "qkv", "attention", "o", "gate_up", "down", "lm_head", "sample")


def step_op(label: str) -> str:
    """The operation of launch label `label` ("gemv_rows down" -> "down", "attention_rows" ->
    "attention"); a label of none of the known forms is its own operation."""
    for p in _LABEL_PREFIXES:
        if label.startswith(p):
            return label[len(p) :]
    for s in _LABEL_SUFFIXES:
        if label.endswith(s):
            return label[: -len(s)]
    return label


def compare_steps(columns: dict[str, dict]) -> str:
    """Steps side by side by operation (text): columns maps a name ("decode", "M=8") to
    aggregate_kernels' dict of that step. Each cell: microseconds a step summed over the
    operation's launches (every layer) and the ratio to the first column's; an operation a
    step does not launch prints "-". Below them the sums of kernels, the whole steps and the
    launch/dependency overhead (whole - sum), then each operation's labels."""
    names = list(columns)
    by_op: dict[str, dict[str, float]] = {}
    labels: dict[str, list[str]] = {}
    for name, k in columns.items():
        for r in k["rows"]:
            op = step_op(r["label"])
            by_op.setdefault(op, {})
            by_op[op][name] = by_op[op].get(name, 0.0) + r["us"]
            labels.setdefault(op, []).append(r["label"])
    order = [op for op in STEP_OPS if op in by_op] + [op for op in by_op if op not in STEP_OPS]
    base = names[0]

    def cell(us, ref) -> str:
        if us is None:
            return f"{'-':>16}"
        ratio = f"{us / ref:5.2f}x" if ref else f"{'':6}"
        return f"{us:9.1f} {ratio}"

    def line(label, values: dict) -> str:
        ref = values.get(base)
        return f"  {label:20}" + "".join(cell(values.get(n), ref) for n in names)

    lines = [f"  {'us a step':20}" + "".join(f"{n:>16}" for n in names)]
    lines += [line(op, by_op[op]) for op in order]
    lines.append("  " + "-" * (20 + 16 * len(names)))
    lines.append(line("sum of kernels", {n: k["sum_of_kernels"]["us"] for n, k in columns.items()}))
    lines.append(line("whole step (graph)", {n: k["whole_step"]["us"] for n, k in columns.items()}))
    lines.append(line("overhead", {n: k["overhead_us"] for n, k in columns.items()}))
    for op in order:
        distinct = dict.fromkeys(labels[op])
        lines.append(f"  {op}: {' | '.join(distinct)}")
    return "\n".join(lines)


def kernel_breakdown(engine, pos: int, reps: int = 20, timed: int = 5) -> dict:
    """Per-kernel times of one decode step of `engine` (a CudaBackend, idle) at position `pos`.

    Each label's launches (e.g. the 28 layers' "gemv down") are timed together in one graph,
    `reps` times over, so every launch reads its own weights as in the step; a launch's time
    is the graph's over the launch count. The decode state (token 1, position pos, max_new
    huge) is set before the recording and before every timed graph launch: the sampler
    advances it (position, step, ring slot), so a graph of `reps` samplers writes ring slots
    0..reps-1 and the whole-step graph (sampler included) runs positions pos .. pos + reps -
    1. pos is clamped so that fits max_context. Returns aggregate_kernels' dict plus pos,
    context, reps, timed (graph launches per median), launches ((label, seconds, bytes) for
    every launch of the step, in order) and pdl.
    """
    from ..engine.decode_loop import DecodeState

    k, gpu = engine.kernels, engine.gpu
    reps = max(1, min(reps, engine.max_context - 1))
    pos = max(0, min(pos, engine.max_context - 1 - reps))
    state = DecodeState(token=1, pos=pos, max_new=1 << 30)

    def reset() -> None:
        engine.set_decode_state(state)

    reset()
    trace = engine.record_decode_step()
    seconds = launch_times(gpu, trace, k.replay, reps, timed, reset)
    step_s = time_graph(gpu, lambda s: engine.decode_step(s), reps, timed, reset)
    reset()
    launches = [(ln.label, t, ln.nbytes + ln.per_token * (pos + 1))
                for ln, t in zip(trace, seconds, strict=True)]  # fmt: skip
    res = aggregate_kernels(launches, step_s)
    res.update(pos=pos, context=pos + 1, reps=reps, timed=timed, launches=launches,
               pdl=bool(k.pdl))  # fmt: skip
    return res


# -- bench --plot -------------------------------------------------------------------------------
def require_matplotlib() -> None:
    """Fail early (before a long benchmark) when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise NanoqwenError(
            f"--plot needs matplotlib ({exc}); install it: pip install matplotlib "
            "(or the 'bench' extra)"
        ) from None


def plot_itl(res: dict, path: str) -> None:
    """Draw itl_by_position_ms against position (prompt_len + i) into `path` (PNG: Agg)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    y = np.asarray(res["itl_by_position_ms"], dtype=np.float64)
    x = res["prompt_len"] + np.arange(y.size)
    fig = Figure(figsize=(9, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(x, y, lw=1.0, marker=".", ms=3, label=f"median over {res.get('runs', '?')} runs")
    ax.axhline(res["itl_ms"], color="C1", ls="--", lw=1.2,
               label=f"median ITL {res['itl_ms']:.3f} ms")  # fmt: skip
    ax.set_title(f"{res.get('gpu', '?')}  model {res.get('model', '?')}  prompt "
                 f"{res['prompt_len']}  gen {res.get('gen_len', y.size + 1)}: inter-token "
                 "latency by position")  # fmt: skip
    ax.set_xlabel("position of the token the decode step consumes (context = position + 1)")
    ax.set_ylabel("inter-token latency (ms)")
    top = float(np.nanmax(y)) if y.size else res["itl_ms"]
    ax.set_ylim(0, 1.15 * max(top, res["itl_ms"]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
