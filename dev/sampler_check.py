"""The device sampler (nanoqwen/kernels/sampler.cuh) on an sm_90 GPU: its kept set against
sampling.probabilities and against the rule by brute force, its draws against p, and
sample_finish timed.

    PYTHONPATH=. python3 dev/sampler_check.py [--out /tmp/sampler_check] [--draws 20000]

decode_misc.cu is compiled through nanoqwen.cuda.jit with the 1.5B's header and a probe kernel
appended that writes kept_set's tp, so the kept set itself is compared.

Parts (a failure in one is logged and the others still run):
1. kept: fresh random rows (V 151936, 4097, 1000; random normal, model-like peaked, ties at
   the k-th value, few distinct values, all equal) under the SETTINGS; the kernel's kept set
   (logit >= tp) must be the brute-force rule's (ties at a threshold kept, fixed-point masses,
   tests/test_speculate_sampled.py's exact_rule), except a top-p boundary token whose prefix
   mass is within 1e-5 of top_p (exp2f against numpy's exp2); on rows without ties the
   normalised weights must match sampling.probabilities to rtol 1e-4, atol 1e-7.
2. draws: --draws launches of sample_finish on one model-like row per setting (the STEP
   counter advancing, so every draw takes a fresh uniform): nothing outside p's support, and
   Pearson's chi-square under its 1e-3 critical value (cells expecting < 5 pooled).
3. time: sample_finish at V = 151936 on a model-like and a random-normal row,
   per setting: the median over 5 batches of 50 (argmax key restore + sample_finish), minus
   the restore alone; CUDA events behind a spin kernel (dev/prefill_check.py time_ms).
RESULT line last: PASS when parts 1 and 2 pass (the timings are a record, not a gate).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch
from prefill_check import time_ms

from nanoqwen.config import preset
from nanoqwen.cuda import jit, registry
from nanoqwen.harness.gpu_script import gpu_session, run_part
from nanoqwen.sampling import SamplingParams, probabilities

F = np.float32
LOG2E = F(1.4426950408889634)
MASS_SCALE = 2.0**40  # sampler.cuh's kMassScale
THREADS = registry.DEFAULT_GEOMETRY.sample_threads  # kSampleThreads: both kernels' block
SETTINGS = {
    "k50_p0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "p0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "k40": SamplingParams(temperature=1.0, top_k=40),
    "k1500_p0.9": SamplingParams(temperature=1.2, top_k=1500, top_p=0.9),
    "p0.5_t0.3": SamplingParams(temperature=0.3, top_p=0.5),
    "t1.0": SamplingParams(temperature=1.0),
}
TIMED = ("k50_p0.95", "p0.95", "t1.0")
PROBE = """
extern "C" __global__ void __launch_bounds__(kSampleThreads, 1)
kept_probe(const float* logits, int V, float temp, int top_k, float top_p, float* tp) {
  float m = -3.0e38f;
  __shared__ float red[kSampleThreads / kWarp];
  for (int i = threadIdx.x; i < V; i += kSampleThreads) m = fmaxf(m, logits[i]);
  m = warp_max(m);
  if (threadIdx.x % kWarp == 0) red[threadIdx.x / kWarp] = m;
  __syncthreads();
  for (int w = 0; w < kSampleThreads / kWarp; ++w) m = fmaxf(m, red[w]);
  const KeptSet s = kept_set(logits, V, m, temp, top_k, top_p);
  if (threadIdx.x == 0) *tp = s.tp;
}
"""


def build():
    text = (jit.KERNEL_DIR / registry.MISC).read_text()
    c = jit.compile_module(registry.MISC, ["sample_finish", "kept_probe"],
                           registry.header(preset("1.5b")), source=text + PROBE)  # fmt: skip
    return c.kernel("sample_finish"), c.kernel("kept_probe")


# -- the rule by brute force (tests/test_speculate_sampled.py's exact_rule) --------------------
def order_keys(x: np.ndarray) -> np.ndarray:
    b = np.asarray(x, F).view(np.uint32)
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def mass_weights(values: np.ndarray, m, inv_t) -> np.ndarray:
    w = np.exp2((values - m) * inv_t * LOG2E).astype(F).astype(np.float64) * MASS_SCALE
    return np.floor(w).astype(np.uint64)


def exact_tp(logits: np.ndarray, p: SamplingParams) -> tuple[float, float]:
    """(tp, the prefix mass fraction before tp's first token: how close the cut was)."""
    vals = np.sort(logits)[::-1]
    m, inv_t = F(vals[0]), F(1) / F(p.temperature)
    tk = vals[p.top_k - 1] if 0 < p.top_k < len(logits) else F(-3.0e38)
    if p.top_p >= 1:
        return float(tk), 1.0
    inside = vals[vals >= tk]
    cum = np.cumsum(mass_weights(inside, m, inv_t), dtype=np.uint64)
    target = math.ceil(float(F(p.top_p)) * float(cum[-1]))
    j = int(np.flatnonzero(cum >= np.uint64(target))[0])
    first = int(np.flatnonzero(inside == inside[j])[0])
    before = float(cum[first - 1]) / float(cum[-1]) if first else 0.0
    return float(inside[j]), before


def rows(rng, v: int) -> dict[str, np.ndarray]:
    normal = (rng.standard_normal(v) * rng.uniform(1.0, 3.0)).astype(F)
    peaked = model_like(rng, v)
    ties = normal.copy()
    ties[rng.choice(v, min(v, 200), replace=False)] = np.sort(normal)[-min(v, 40)]
    few = rng.choice(np.array([-3.0, 0.5, 2.25, 7.0], F), v).astype(F)
    return {"normal": normal, "model_like": peaked, "ties_at_k": ties, "few_values": few,
            "all_equal": np.full(v, F(1.5))}  # fmt: skip


def model_like(rng, v: int) -> np.ndarray:
    """A spread of logits (std 2.5) with 30 tokens lifted by 6-14: a peaked LM step."""
    x = (rng.standard_normal(v) * 2.5).astype(F)
    top = rng.choice(v, 30, replace=False)
    x[top] += rng.uniform(6, 14, 30).astype(F)
    return x


def check_kept(probe, gpu, log) -> bool:
    rng = np.random.default_rng()
    tp_dev = torch.empty(1, device="cuda")
    bad = checked = near = 0
    for v in (151936, 4097, 1000):
        for name, logits in rows(rng, v).items():
            x = torch.from_numpy(logits).cuda()
            for sname, p in SETTINGS.items():
                args = (int(x.data_ptr()), np.int32(v), np.float32(p.temperature),
                        np.int32(p.top_k), np.float32(p.top_p), int(tp_dev.data_ptr()))  # fmt: skip
                gpu.launch(probe, (1, 1, 1), (THREADS, 1, 1), *args)
                got_tp = float(tp_dev.cpu()[0])
                want_tp, before = exact_tp(logits, p)
                checked += 1
                kept, want = logits >= F(got_tp), logits >= F(want_tp)
                if not np.array_equal(kept, want):
                    diff = np.flatnonzero(kept != want)
                    one_value = np.unique(logits[diff]).size == 1
                    if one_value and abs(before - p.top_p) < 1e-5:
                        near += 1
                        continue
                    bad += 1
                    log(f"  kept set differs: V {v} {name} {sname}: tp {got_tp} vs {want_tp}, "
                        f"{diff.size} tokens")  # fmt: skip
                    continue
                if name in ("normal", "model_like"):
                    m, inv_t = F(logits.max()), F(1) / F(p.temperature)
                    w = np.where(kept, np.exp2((logits - m) * inv_t * LOG2E), 0).astype(np.float64)
                    ref = probabilities(torch.from_numpy(logits), p).double().numpy()
                    if (ref > 0).sum() != kept.sum() and abs(before - p.top_p) < 1e-5:
                        near += 1  # float32 cumsum against fixed point at the cut
                        continue
                    if not np.allclose(w / w.sum(), ref, rtol=1e-4, atol=1e-7):
                        bad += 1
                        log(f"  p differs from sampling.probabilities: V {v} {name} {sname}")
    log(f"kept: {checked} rows x settings, {bad} wrong, {near} boundary ties within 1e-5  "
        f"{'ok' if bad == 0 else 'FAIL'}")  # fmt: skip
    return bad == 0


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty: the chi-square quantile at 1 - 1e-3 (z the normal's)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


class Finish:
    """sample_finish on one row: logits, its argmax key (restored before each launch: the
    kernel zeroes it), the state words and a device ring of tokens."""

    def __init__(self, gpu, kernel, logits: np.ndarray, p: SamplingParams, ring: int):
        self.gpu, self.kernel, self.v = gpu, kernel, len(logits)
        self.x = torch.from_numpy(logits).cuda()
        i = int(np.argmax(logits))
        b = int(order_keys(logits[i : i + 1])[0])
        key = (b << 32) | (0xFFFFFFFF - i)
        self.key0 = torch.tensor([key - (1 << 64) if key >= 1 << 63 else key], dtype=torch.int64,
                                 device="cuda")  # fmt: skip
        self.key = torch.empty_like(self.key0)
        self.ring = torch.zeros(ring, dtype=torch.int32, device="cuda")
        st = np.zeros(registry.STATE_WORDS, np.int32)
        st[registry.StateWord.MAX_NEW] = ring
        st[registry.StateWord.TOP_K] = p.top_k
        st[registry.StateWord.TEMP] = np.float32(p.temperature).view(np.int32)
        st[registry.StateWord.TOP_P] = np.float32(p.top_p).view(np.int32)
        seed = int(np.random.default_rng().integers(0, 2**62))
        st[registry.StateWord.SEED_LO] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
        st[registry.StateWord.SEED_HI] = np.uint32(seed >> 32).view(np.int32)
        self.state0 = torch.from_numpy(st).cuda()
        self.state = self.state0.clone()

    def restore_key(self) -> None:
        self.key.copy_(self.key0)

    def __call__(self) -> None:
        self.restore_key()
        ptrs = [int(t.data_ptr()) for t in (self.x, self.key, self.state, self.ring)]
        # host_ring, cancel: none; cond: no graph loop
        self.gpu.launch(self.kernel, (1, 1, 1), (THREADS, 1, 1), *ptrs, 0, 0, np.uint64(0),
                        np.int32(self.v))  # fmt: skip

    def reset(self) -> None:
        self.state.copy_(self.state0)


def check_draws(kernel, gpu, draws: int, log) -> bool:
    rng = np.random.default_rng()
    good = True
    for sname in ("k50_p0.95", "p0.95", "k40"):
        p = SETTINGS[sname]
        logits = model_like(rng, 151936)
        f = Finish(gpu, kernel, logits, p, draws)
        for _ in range(draws):
            f()
        tokens = f.ring.cpu().numpy()
        q = probabilities(torch.from_numpy(logits), p).double().numpy()
        counts = np.bincount(tokens, minlength=len(q))
        outside = int(counts[q == 0].sum())
        small = (q > 0) & (draws * q < 5)
        obs = [*counts[(q > 0) & ~small]] + ([counts[small].sum()] if small.any() else [])
        exp = draws * np.array([*q[(q > 0) & ~small]] + ([q[small].sum()] if small.any() else []))
        chi2 = float(((np.array(obs) - exp) ** 2 / exp).sum())
        crit = chi2_critical(max(1, len(exp) - 1))
        ok = outside == 0 and len(exp) >= 2 and chi2 < crit
        good &= ok
        log(f"draws {sname}: {draws} draws, {int((q > 0).sum())} kept tokens, {len(exp)} cells, "
            f"chi2 {chi2:.1f} (critical {crit:.1f}), outside p {outside}  "
            f"{'ok' if ok else 'FAIL'}")  # fmt: skip
    return good


def timings(kernel, gpu, log) -> bool:
    rng = np.random.default_rng()
    log(f"{'row':>11} {'setting':>10} {'us':>9}")
    for row in ("model_like", "normal"):
        logits = model_like(rng, 151936) if row == "model_like" else (
            rng.standard_normal(151936) * 2.0).astype(F)  # fmt: skip
        for sname in TIMED:
            f = Finish(gpu, kernel, logits, SETTINGS[sname], 1 << 16)
            f.reset()
            both = time_ms(gpu, f, reps=5, batch=50)
            alone = time_ms(gpu, f.restore_key, reps=5, batch=50)
            log(f"{row:>11} {sname:>10} {1e3 * (both - alone):9.1f}")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/sampler_check", help="log directory")
    ap.add_argument("--draws", type=int, default=20000, help="draws a setting in part 2")
    args = ap.parse_args()
    results: dict = {}
    with gpu_session(args.out, "sampler_check.log") as (gpu, log):
        finish, probe = build()
        run_part("kept", results, log, lambda: check_kept(probe, gpu, log))
        run_part("draws", results, log, lambda: check_draws(finish, gpu, args.draws, log))
        run_part("time", results, log, lambda: timings(finish, gpu, log))
        for name, ok in results.items():
            log(f"{name}: {'ok' if ok else 'FAIL'}")
        passed = all(results.values())
        log(f"RESULT {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
