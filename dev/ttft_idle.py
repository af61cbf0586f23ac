"""What a request pays for the time before it (run on an sm_90 GPU): the TTFT split into the
host's time to the first launch and the GPU's span, after nothing, after 1 s of sleep, after
1 s of the host spinning, and after 1 s of sleep with a small GPU operation 20 ms before.

    PYTHONPATH=. python3 dev/ttft_idle.py FILE.nanoqwen [--prompt-len 512] [--runs 12]

Each row: 3 + `runs` requests (generate(max_tokens=1) on fresh random ids, as `nanoqwen bench`
takes its TTFT), medians of the timed ones: host ms from the call to the first launch, GPU ms
from an event after the first launch to one after the sampler's (the last launch before the
token), the host ms at the sampler's launch, the TTFT, and the mean SM clock over the request.
The back-to-back row runs first and last: the machine drifts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from nanoqwen.engine import CudaBackend
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.bench import ClockSampler
from nanoqwen.sampling import SamplingParams

MODES = ("back to back", "sleep 1 s", "spin 1 s", "sleep 1 s, a memset 20 ms before",
         "back to back")  # fmt: skip


def wait(mode: str, engine) -> None:
    if mode.startswith("sleep"):
        time.sleep(1.0)
    elif mode.startswith("spin"):
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0:
            pass
    if "memset" in mode:
        engine.gpu.memset(engine.forward.key, 0, 8)  # lm_head's argmax key rests at zero
        engine.gpu.sync("memset")
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=12)
    args = ap.parse_args()
    f = NanoqwenFile(args.file)
    engine = CudaBackend(f, max_context=4 * args.prompt_len + 64)
    rng = np.random.default_rng(0)
    params, marks = SamplingParams(max_tokens=1), {}

    def first_launch(launch) -> None:
        if "first" not in marks:
            marks["first"], marks["e0"] = time.perf_counter(), engine.gpu.record()

    sample = engine.loop.sample

    def sample_marked(*a, **kw) -> None:
        sample(*a, **kw)
        marks["last"], marks["e1"] = time.perf_counter(), engine.gpu.record()

    engine.kernels.on_launch = first_launch
    engine.loop.sample = sample_marked

    def request() -> tuple[float, ...]:
        marks.clear()
        ids = rng.integers(0, engine.config.vocab_size, args.prompt_len).tolist()
        t0 = time.perf_counter()
        for _ in engine.generate(ids, params, frozenset()):
            t1 = time.perf_counter()
        host_ms = [1e3 * (t - t0) for t in (marks["first"], marks["last"], t1)]
        return host_ms[0], marks["e1"] - marks["e0"], host_ms[1], host_ms[2], t0, t1

    print(f"{'before each request':<34} {'to 1st launch':>13} {'GPU span':>9} {'sampler at':>10} "
          f"{'TTFT':>8} {'SM MHz':>7}")  # fmt: skip
    with ClockSampler(engine.gpu, period=0.002) as clocks:
        for mode in MODES:
            rows = []
            for r in range(3 + args.runs):
                wait(mode, engine)
                *times, t0, t1 = request()
                if r >= 3:
                    rows.append((*times, clocks.mean(t0, t1) or float("nan")))
            m = [statistics.median(c) for c in zip(*rows, strict=True)]
            print(f"{mode:<34} {m[0]:>13.3f} {m[1]:>9.3f} {m[2]:>10.3f} {m[3]:>8.3f} {m[4]:>7.0f}")
    engine.close()
    f.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
