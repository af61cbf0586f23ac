"""Where the time to first token goes (run on an sm_90 GPU).

    PYTHONPATH=. python3 tools/ttft_profile.py FILE.nanoqwen [--prompt-len 512] [--runs 10]
        [--ablate]

For the prefill as built, without PDL (PrefillKernels.pdl; the decode kernels it shares keep
theirs) and with its last layer over every token (the engine takes the last token alone
there): the TTFT as `nanoqwen bench` takes it (generate() called -> first token on the host,
median of `runs` after 3 warm-ups), then one instrumented run: a CUDA event after every
launch (so launches no longer overlap) and the host's clock at each enqueue. Printed: the
host's time to its first launch, to its last and to the token; the GPU span from the first
event to the last; and per kernel label the launches and the sum of event deltas (the kernel
plus any gap before it). --ablate adds the TTFT with each label's launches skipped in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.sampling import SamplingParams

PHASES = ("embed", "rmsnorm", "rope_kv", "lm_head", "sample")


def configure(engine, pdl: bool, last_only: bool) -> None:
    """Prefill PDL on or off; generation's prefill with its last layer for the last token
    only (as built) or for every token (CudaBackend._prefill_hidden's last_only)."""
    engine._prefill.pdl = pdl
    engine.__dict__.pop("_prefill_hidden", None)
    if not last_only:
        whole = type(engine)._prefill_hidden
        engine._prefill_hidden = lambda ids, last_only=False: whole(engine, ids, False)


def ttft_ms(engine, ids, runs: int, warmup: int = 3) -> float:
    params = SamplingParams(max_tokens=1)
    times = []
    for r in range(warmup + runs):
        t0 = time.perf_counter()
        for _ in engine.generate(ids, params, frozenset()):
            t1 = time.perf_counter()
        if r >= warmup:
            times.append(1e3 * (t1 - t0))
    return statistics.median(times)


def targets(engine) -> list:
    """(object, method, label of a call) of every launcher the prefill calls."""
    cfg = engine.config
    out = [(engine.k, n, lambda a, kw, n=n: n) for n in PHASES]
    out += [
        (engine.k, "gemv", lambda a, kw: f"gemv {a[0]}"),
        (engine.k, "attention", lambda a, kw: "decode attention"),
        (engine._prefill, "gemm", lambda a, kw: gemm_label(cfg, a[6], a[7], kw.get("swiglu"))),
        (engine._prefill, "attention", lambda a, kw: "attention"),
    ]
    return out


def ablated_ttft_ms(engine, ids, runs: int, labels) -> dict[str, float]:
    """TTFT with each label's launches skipped in turn (wrong tokens, timing only): what
    that label costs inside the prefill, overlap and gaps included. Skipping also changes the
    data the later kernels see, which moves their time (the GEMMs draw more power on some
    data), so read it beside the instrumented table."""
    out = {}
    for skip in labels:
        for obj, name, label in targets(engine):
            orig = getattr(obj, name)

            def f(*a, _orig=orig, _label=label, _skip=skip, **kw):
                if _label(a, kw) != _skip:
                    _orig(*a, **kw)

            setattr(obj, name, f)
        try:
            out[skip] = ttft_ms(engine, ids, runs, warmup=1)
        finally:
            for obj, name, _ in targets(engine):
                delattr(obj, name)
    return out


def gemm_label(cfg, N: int, K: int, swiglu: bool) -> str:
    if swiglu:
        return "gemm gate_up"
    if K == cfg.intermediate_size:
        return "gemm down"
    return "gemm qkv" if N == cfg.q_size + 2 * cfg.kv_size else "gemm o"


def instrumented_run(engine, ids) -> dict:
    """One generate(max_tokens=1) with an event and a host stamp after every launch."""
    from cuda.core import EventOptions

    gpu, opts = engine.gpu, EventOptions(timing_enabled=True)
    marks = []  # (label, host seconds, event)

    host = []  # (what, host seconds when it returned) of the host-side steps before launches
    wrapped = []

    def wrap(obj, name, label, event=True):
        orig = getattr(obj, name)

        def f(*a, **kw):
            out = orig(*a, **kw)
            if event:
                ev = gpu.stream.record(options=opts)
                marks.append((label(a, kw), time.perf_counter(), ev))
            else:
                host.append((name, time.perf_counter()))
            return out

        setattr(obj, name, f)
        wrapped.append((obj, name))

    for obj, name, label in targets(engine):
        wrap(obj, name, label)
    for name in ("_check_ids", "_init_state", "_prefill_buffers"):
        wrap(engine, name, None, event=False)
    try:
        t0 = time.perf_counter()
        for _ in engine.generate(ids, SamplingParams(max_tokens=1), frozenset()):
            t_end = time.perf_counter()
    finally:
        for obj, name in wrapped:
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
        "per_label": dict(per),
        "host_ms": [(what, 1e3 * (t - t0)) for what, t in host],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ablate", action="store_true", help="TTFT with each label skipped")
    args = ap.parse_args()
    engine = CudaBackend(NanoqwenFile(args.file), max_context=args.prompt_len + 64)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, engine.config.vocab_size, args.prompt_len).tolist()
    variants = {  # name: (prefill PDL, last layer for the last token only)
        "as built": (True, True),
        "prefill without PDL": (False, True),
        "whole last layer": (True, False),
    }
    times = defaultdict(list)
    for _ in range(2):  # interleaved: the machine drifts
        for name, (pdl, last_only) in variants.items():
            configure(engine, pdl, last_only)
            times[name].append(ttft_ms(engine, ids, args.runs))
    for name, ms in times.items():
        print(f"TTFT {name:<20} " + " / ".join(f"{t:.3f}" for t in ms) + " ms")
    configure(engine, True, True)
    if args.ablate:
        r = instrumented_run(engine, ids)
        base = ttft_ms(engine, ids, args.runs)
        print(f"ablation: TTFT {base:.3f} ms with every launch; without one label:")
        for label, ms in ablated_ttft_ms(engine, ids, args.runs, sorted(r["per_label"])).items():
            print(f"  {label:<16} {ms:8.3f} ms  (it costs {base - ms:6.3f})")
    configure(engine, False, True)
    ttft_ms(engine, ids, 1, warmup=1)
    r = instrumented_run(engine, ids)
    print(
        f"instrumented (prefill pdl=0, an event after each launch): first launch at "
        f"{r['first_launch_ms']:.3f} ms, last at {r['last_launch_ms']:.3f}, token at "
        f"{r['token_ms']:.3f}; GPU span first -> last event {r['gpu_span_ms']:.3f} ms"
    )
    print(
        "host steps (ms after generate() was called): "
        + ", ".join(f"{what} {ms:.3f}" for what, ms in r["host_ms"])
    )
    print(f"{'label':<16} {'launches':>8} {'ms':>8} {'us each':>8}")
    for label, (n, ms) in sorted(r["per_label"].items(), key=lambda kv: -kv[1][1]):
        print(f"{label:<16} {n:>8} {ms:>8.3f} {1e3 * ms / n:>8.1f}")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
