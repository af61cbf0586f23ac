"""Where the time to first token goes (run on an sm_90 GPU).

    PYTHONPATH=. python3 dev/ttft_profile.py FILE.nanoqwen [--prompt-len 512] [--runs 10]
        [--ablate] [--cached N] [--timeline]

For the prefill as built, without PDL (engine.prefill_kernels.pdl; the decode kernels it
shares keep theirs) and with its last layer over every token (engine.forward
.last_token_shortcut off; as built the last layer takes the last token alone): the TTFT as
`nanoqwen bench` takes it (generate() called -> first token on the host, median of `runs`
after 3 warm-ups), then one instrumented run: a timing event after every launch (the
launchers' on_launch hook; launches then no longer overlap) and the host's clock at each
enqueue. Printed: the host's time to its first launch, to its last and to the token; the GPU
span from the first event to the last; and per kernel label the launches and the sum of event
deltas (the kernel plus any gap before it). --ablate adds the TTFT with each label's launches
skipped in turn (each launcher's `launch` replaced on the instance for the run).
--timeline adds the kernels of one request as built (PDL on, no events between launches) from
the CUDA profiling interface (torch.profiler's CUPTI trace): per label the kernels' own time and
the gaps before them (a kernel's start minus the previous kernel's end; negative where PDL
overlaps them), and the GPU span from the first kernel's start to the last one's end.
--cached N profiles a warm prefix-cache request instead (bench --workload prefix): every
request is one fixed N-token prefix, which the request before left in the cache, and
`prompt-len` fresh tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch.profiler

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.sampling import SamplingParams


def configure(engine, pdl: bool, last_only: bool) -> None:
    """Prefill PDL on or off; generation's prefill with its last layer for the last token
    only (as built) or for every token."""
    engine.prefill_kernels.pdl = pdl
    engine.forward.last_token_shortcut = last_only


def launchers(engine) -> tuple:
    return engine.kernels, engine.prefill_kernels


def label_of(label: str) -> str:
    """A launch's label for the tables: the launcher's (the engine names each prefill GEMM by
    its projection), the decode attention (the last layer's, for the last token) named as
    such."""
    return "decode attention" if label == "attention" else label


def ttft_ms(engine, prompt, runs: int, warmup: int = 3) -> float:
    """prompt(): the ids of the next request."""
    params = SamplingParams(max_tokens=1)
    times = []
    for r in range(warmup + runs):
        ids = prompt()
        t0 = time.perf_counter()
        for _ in engine.generate(ids, params, frozenset()):
            t1 = time.perf_counter()
        if r >= warmup:
            times.append(1e3 * (t1 - t0))
    return statistics.median(times)


@contextlib.contextmanager
def skipping(engine, skip: str):
    """Every launch labelled `skip` is dropped while the block runs (wrong tokens, timing
    only)."""
    for launcher in launchers(engine):

        def launch(key, grid, *args, _launch=launcher.launch, **kw):
            if label_of(kw.get("label") or key) != skip:
                _launch(key, grid, *args, **kw)

        launcher.launch = launch
    try:
        yield
    finally:
        for launcher in launchers(engine):
            del launcher.launch  # the class's method again


def ablated_ttft_ms(engine, prompt, runs: int, labels) -> dict[str, float]:
    """TTFT with each label's launches skipped in turn: what that label costs inside the
    prefill, overlap and gaps included. Skipping also changes the data the later kernels see,
    which moves their time (the GEMMs draw more power on some data), so read it beside the
    instrumented table."""
    out = {}
    for skip in labels:
        with skipping(engine, skip):
            out[skip] = ttft_ms(engine, prompt, runs, warmup=1)
    return out


def instrumented_run(engine, ids) -> dict:
    """One generate(max_tokens=1) with an event and a host stamp after every launch, and a
    host stamp after each host-side step before the launches."""
    gpu = engine.gpu
    marks = []  # (label, host seconds, event)
    host = []  # (what, host seconds when it returned)

    def mark(launch) -> None:
        marks.append((label_of(launch.label), time.perf_counter(),
                      gpu.record()))  # fmt: skip

    def stamped(call, name: str):
        def f(*a, **kw):
            out = call(*a, **kw)
            host.append((name, time.perf_counter()))
            return out

        return f

    steps = ((engine.kv.pages, "admit"), (engine.kv.pages, "reserve"),
             (engine.loop, "stage_pages"), (engine.loop, "begin"),
             (engine.loop, "stage_ids"))  # fmt: skip
    for obj, name in steps:
        setattr(obj, name, stamped(getattr(obj, name), name))
    for launcher in launchers(engine):
        launcher.on_launch = mark
    try:
        t0 = time.perf_counter()
        for _ in engine.generate(ids, SamplingParams(max_tokens=1), frozenset()):
            t_end = time.perf_counter()
    finally:
        for launcher in launchers(engine):
            launcher.on_launch = None
        for obj, name in steps:
            delattr(obj, name)
    per = defaultdict(lambda: [0, 0.0])
    for (_, _, e0), (label, _, e1) in zip(marks, marks[1:], strict=False):
        per[label][0] += 1
        per[label][1] += e1 - e0  # ms
    return {
        "first_launch_ms": 1e3 * (marks[0][1] - t0),
        "last_launch_ms": 1e3 * (marks[-1][1] - t0),
        "token_ms": 1e3 * (t_end - t0),
        "gpu_span_ms": marks[-1][2] - marks[0][2],
        "labels": sorted({label for label, _, _ in marks}),
        "per_label": dict(per),
        "host_ms": [(what, 1e3 * (t - t0)) for what, t in host],
    }


def timeline(engine, ids) -> dict:
    """One generate(max_tokens=1) as built under a CUPTI trace: every kernel's start and end
    on the GPU, matched in order with the launches' labels."""
    labels = []
    for launcher in launchers(engine):
        launcher.on_launch = lambda launch: labels.append(label_of(launch.label))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in engine.generate(ids, SamplingParams(max_tokens=1), frozenset()):
                pass
    finally:
        for launcher in launchers(engine):
            launcher.on_launch = None
    with tempfile.NamedTemporaryFile(suffix=".json") as t:
        prof.export_chrome_trace(t.name)
        trace = json.load(open(t.name))
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") == "kernel"
    )
    # Every kernel of a request is a launcher's, in launch order (the names printed beside each
    # label show the match).
    if len(kernels) < len(labels):
        raise RuntimeError(f"{len(kernels)} kernels traced for {len(labels)} launches")
    per = defaultdict(lambda: [0, 0.0, 0.0, set()])  # launches, kernel us, gap us, names
    prev_end = kernels[0][0]
    for label, (start, end, name) in zip(labels, kernels, strict=False):
        per[label][0] += 1
        per[label][1] += end - start
        per[label][2] += start - prev_end
        per[label][3].add(name.split("<")[0].split("(")[0])
        prev_end = end
    return {"span_ms": (kernels[-1][1] - kernels[0][0]) / 1e3, "per_label": dict(per)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ablate", action="store_true", help="TTFT with each label skipped")
    ap.add_argument(
        "--cached", type=int, default=0, metavar="N", help="warm: N cached + prompt-len new"
    )
    ap.add_argument("--timeline", action="store_true", help="kernels and gaps from a CUPTI trace")
    args = ap.parse_args()
    f = NanoqwenFile(args.file)
    # Room for the cached prefix, a few requests' tails and the generated token.
    limit = f.config.max_position_embeddings
    engine = CudaBackend(f, max_context=min(args.cached + 4 * args.prompt_len + 64, limit))
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    prefix = rng.integers(0, vocab, args.cached).tolist()

    def prompt() -> list[int]:
        """A fresh random tail after the prefix (none without --cached): a repeated cold prompt
        would find its own pages in the prefix cache and time a warm request."""
        return prefix + rng.integers(0, vocab, args.prompt_len).tolist()

    ttft_ms(engine, prompt, 1, warmup=0)  # with --cached: the prefix into the cache
    variants = {  # name: (prefill PDL, last layer for the last token only)
        "as built": (True, True),
        "prefill without PDL": (False, True),
        "whole last layer": (True, False),
    }
    times = defaultdict(list)
    for _ in range(2):  # interleaved: the machine drifts
        for name, (pdl, last_only) in variants.items():
            configure(engine, pdl, last_only)
            times[name].append(ttft_ms(engine, prompt, args.runs))
    for name, ms in times.items():
        print(f"TTFT {name:<20} " + " / ".join(f"{t:.3f}" for t in ms) + " ms")
    configure(engine, True, True)
    if args.ablate:
        labels = instrumented_run(engine, prompt())["labels"]
        base = ttft_ms(engine, prompt, args.runs)
        print(f"ablation: TTFT {base:.3f} ms with every launch; without one label:")
        for label, ms in ablated_ttft_ms(engine, prompt, args.runs, labels).items():
            print(f"  {label:<18} {ms:8.3f} ms  (it costs {base - ms:6.3f})")
    if args.timeline:
        timeline(engine, prompt())  # the profiler's own first-use costs
        t = timeline(engine, prompt())
        print(f"timeline (as built, CUPTI): GPU span {t['span_ms']:.3f} ms")
        print(
            f"{'label':<18} {'launches':>8} {'kernel ms':>9} {'gaps ms':>8} {'us each':>8}  kernel"
        )
        for label, (n, k_us, g_us, names) in sorted(
            t["per_label"].items(), key=lambda kv: -kv[1][1]
        ):
            print(
                f"{label:<18} {n:>8} {k_us / 1e3:>9.3f} {g_us / 1e3:>8.3f} {k_us / n:>8.1f}  "
                + ",".join(sorted(names))
            )
    configure(engine, False, True)
    ttft_ms(engine, prompt, 1, warmup=1)
    r = instrumented_run(engine, prompt())
    print(
        f"instrumented (prefill pdl=0, an event after each launch): first launch at "
        f"{r['first_launch_ms']:.3f} ms, last at {r['last_launch_ms']:.3f}, token at "
        f"{r['token_ms']:.3f}; GPU span first -> last event {r['gpu_span_ms']:.3f} ms"
    )
    print(
        "host steps (ms after generate() was called): "
        + ", ".join(f"{what} {ms:.3f}" for what, ms in r["host_ms"])
    )
    print(f"{'label':<18} {'launches':>8} {'ms':>8} {'us each':>8}")
    for label, (n, ms) in sorted(r["per_label"].items(), key=lambda kv: -kv[1][1]):
        print(f"{label:<18} {n:>8} {ms:>8.3f} {1e3 * ms / n:>8.1f}")
    engine.close()
    f.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
