"""CPU (no GPU): speculative sampling on the device (speculate.cu's sample_rows and
accept_sampled over sampler.cuh, which sample_finish shares), emulated in numpy line by line in
float32 (the thresholds' selection in exact integers), against nanoqwen.speculative's rule: the
kept set's thresholds against the rule by brute force on every route of the selection and on
adversarial rows, the kept set's p against sampling.probabilities,
the accept / reject decisions for given uniforms, the residual draw's distribution, whole steps
over counter-based randoms keeping each emitted token's distribution, the counters never
reused; and the launchers' arguments. dev/speculate_sampled_check.py runs the kernels on a GPU
against the plain loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from chisquare import assert_distribution

from nanoqwen.config import preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.jit import KERNEL_DIR
from nanoqwen.cuda.speculate import SpeculateKernels
from nanoqwen.errors import NanoqwenError
from nanoqwen.sampling import SamplingParams, probabilities
from nanoqwen.speculative import SpeculativeConfig

THREADS = registry.DEFAULT_GEOMETRY.sample_threads  # kSampleThreads
CANDIDATES = registry.DEFAULT_GEOMETRY.sample_candidates  # kSampleCandidates
BINS, DIGIT_BITS = 2048, 11  # sampler.cuh's kSelectBins, kDigitBits
MASS_SCALE = 2.0**40  # kMassScale
FLOOR_NATS = 32.0  # kMassFloorNats
ACCEPT_COUNTER = 1 << 32  # sampler.cuh's kAcceptCounter
F = np.float32
LOG2E = F(1.4426950408889634)
MASK64 = (1 << 64) - 1


# -- sampler.cuh, emulated ---------------------------------------------------------------------
def uniform01(seed: int, counter: int) -> float:
    """splitmix64 of (seed, counter), the top 24 bits as a float in [0, 1) (exact in float32)."""
    z = (seed + 0x9E3779B97F4A7C15 * (counter + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return float(F(z >> 40) * F(1.0 / 16777216.0))


def order_keys(x: np.ndarray) -> np.ndarray:
    """order_key: float32 -> uint32, monotone."""
    b = np.asarray(x, F).view(np.uint32)
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def key_values(k: np.ndarray) -> np.ndarray:
    """key_value: uint32 -> float32 (key 0: a NaN)."""
    k = np.asarray(k, np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(F)


def mass_weights(logits: np.ndarray, m, inv_t) -> np.ndarray:
    """mass_weight: exp2f(...) * 2^40 truncated, uint64 (NaN -> 0, as cvt.rzi does)."""
    w = np.exp2((logits - m) * inv_t * LOG2E).astype(F).astype(np.float64) * MASS_SCALE
    return np.floor(np.nan_to_num(w, nan=0.0)).astype(np.uint64)


def mass_target(top_p: F, z: int) -> int:
    """ceil(top_p * Z) in double, as mass_target."""
    return math.ceil(float(top_p) * float(z))


def first_reaching(w: np.ndarray, base: int, target: int) -> int:
    """find_crossing: the first item where base + the inclusive prefix of w reaches target."""
    hit = np.flatnonzero(base + np.cumsum(w, dtype=np.uint64) >= np.uint64(target))
    return int(hit[0]) if hit.size else -1


def candidates(keys: np.ndarray, klow: int) -> np.ndarray:
    """gather_candidates: the keys >= klow sorted descending (ids ascending among ties)."""
    return np.sort(keys[keys >= klow])[::-1]


def select_key(keys, logits, m, inv_t, mass: bool, target: int, top_p, klo: int, cap: int):
    """select_key: (K or None, the sorted candidates or None, the target used)."""
    khi = int(order_keys(np.array([m]))[0])
    s = max(0, (khi - klo).bit_length() - DIGIT_BITS)
    fw = mass_weights(logits, m, inv_t) if mass else np.ones(len(keys), np.uint64)
    above_w = above_n = 0
    while True:
        inside = (keys >= klo) & (keys <= khi)
        bins = (khi - keys[inside].astype(np.int64)) >> s
        count = np.bincount(bins, minlength=BINS).astype(np.uint64)
        weight = np.zeros(BINS, np.uint64)
        np.add.at(weight, bins, fw[inside])
        if target == 0:
            target = mass_target(top_p, int(weight.sum(dtype=np.uint64)))
        b = first_reaching(weight, above_w, target)
        before_n = int(count[:b].sum())
        if above_n + before_n + int(count[b]) <= cap:
            klow = max(klo, khi - ((b + 1) << s) + 1, 0)
            return None, candidates(keys, klow), target
        if s == 0:
            return khi - b, None, target
        above_w += int(weight[:b].sum(dtype=np.uint64))
        above_n += before_n
        khi -= b << s
        klo = max(klo, khi - ((1 << s) - 1), 0)
        s = max(0, s - DIGIT_BITS)


def local_maxima(keys: np.ndarray) -> np.ndarray:
    """local_maxima: thread t's largest key among ids t, t + THREADS, ..., sorted descending
    (threads without ids: key 0)."""
    per = -(-len(keys) // THREADS)
    padded = np.zeros(per * THREADS, np.uint32)
    padded[: len(keys)] = keys
    return np.sort(padded.reshape(per, THREADS).max(axis=0))[::-1]


def thresholds(logits: np.ndarray, params: SamplingParams, cap: int = CANDIDATES):
    """kept_set's (tk, tp) keys (0: every logit kept), with kSampleCandidates = cap."""
    v, m = len(logits), F(logits.max())
    temp, top_p, k = F(params.temperature), F(params.top_p), params.top_k
    inv_t = F(1) / temp
    keys = order_keys(logits)
    by_k, by_p = 0 < k < v, top_p < 1
    tk, resident = 0, None
    if by_k:
        klo = int(local_maxima(keys)[k - 1]) if k <= THREADS else 0
        key, cands, _ = select_key(keys, logits, m, inv_t, False, k, top_p, klo, cap)
        tk, resident = (int(cands[k - 1]), cands) if cands is not None else (key, None)
    tp = tk
    if by_p:
        if resident is not None:
            ck = resident[resident >= tk]
            fw = mass_weights(key_values(ck), m, inv_t)
            target = mass_target(top_p, int(fw.sum(dtype=np.uint64)))
            tp = int(ck[first_reaching(fw, 0, target)])
        else:
            klo, target = tk, 0
            if not by_k:
                lmax = local_maxima(keys)
                target = mass_target(top_p, int(mass_weights(logits, m, inv_t).sum()))
                j = first_reaching(mass_weights(key_values(lmax), m, inv_t), 0, target)
                floor = order_keys(np.array([m - F(FLOOR_NATS) * temp]))[0]
                klo = int(lmax[j] if j >= 0 else floor)
            key, cands, target = select_key(keys, logits, m, inv_t, True, target, top_p, klo, cap)
            if cands is not None:
                fw = mass_weights(key_values(cands), m, inv_t)
                key = int(cands[first_reaching(fw, 0, target)])
            tp = key
    return tk, tp


def kept_set(logits: np.ndarray, params: SamplingParams, cap: int = CANDIDATES):
    """kept_set + kept_weight: (kept bool [V]: logit >= tp, the weights float32 [V], 0 outside
    the kept set)."""
    m, inv_t = F(logits.max()), F(1) / F(params.temperature)
    if params.top_p < 1 or 0 < params.top_k < len(logits):
        tp = key_values(np.uint32(max(thresholds(logits, params, cap))))[()]
    else:
        tp = F(-3.0e38)  # temperature only: no threshold work
    kept = logits >= tp
    return kept, np.where(kept, np.exp2((logits - m) * inv_t * LOG2E), F(0)).astype(F)


def kept_parts(w: np.ndarray, exclude: int) -> np.ndarray:
    """part float32 [THREADS]: thread t's sequential sum over ids [t * per, (t + 1) * per),
    `exclude` left out."""
    per = -(-len(w) // THREADS)
    padded = np.zeros(per * THREADS, F)
    padded[: len(w)] = w
    if exclude >= 0:
        padded[exclude] = 0
    return np.add.accumulate(padded.reshape(THREADS, per), axis=1, dtype=F)[:, -1]


def draw_parts(kept, w: np.ndarray, exclude: int, part: np.ndarray, u01: float) -> int:
    """draw_parts (one thread): the owner thread by a sequential float32 running sum over the
    parts (cumsum is sequential: run + part[i] is its element i), then the walk over its ids."""
    per = -(-len(w) // THREADS)
    run_to = np.cumsum(part, dtype=F)
    u = F(u01) * run_to[-1]  # parts_total: the same sequential sum
    hit = np.flatnonzero((run_to > u) & (part > 0))
    owner = int(hit[0]) if hit.size else THREADS - 1
    run = (run_to[owner] - part[owner] if owner else F(0)) if hit.size else run_to[-1]
    last = -1
    for i in range(owner * per, min(len(w), owner * per + per)):
        if not kept[i] or i == exclude:
            continue
        last = i
        run = F(run + w[i])
        if run > u:
            break
    return last


def sample_row(kept, w: np.ndarray, draft: int, seed: int, t: int, argmax: int) -> int:
    """sample_rows' thread-0 tail for one row: -1 (draft accepted) or the row's token. t: the
    token index STEP + r."""
    part = kept_parts(w, draft)
    rest = np.cumsum(part, dtype=F)[-1]
    if draft >= 0:
        wd = w[draft]
        if uniform01(seed, ACCEPT_COUNTER + t) < F(wd / F(rest + wd)):
            return -1
    pick = draw_parts(kept, w, draft, part, uniform01(seed, t))
    return pick if pick >= 0 else argmax


def accept_sampled(picks: list[int], tokens: list[int], d: int) -> tuple[list[int], int]:
    """accept_sampled before emit_step: (the step's tokens before the cuts, agree)."""
    agree = next(r for r in range(d + 1) if picks[r] >= 0)
    return [*tokens[1 : 1 + agree], picks[agree]], agree


def run_step(rows, drafts, seed, step):
    """One sampled step as the device runs it: rows = [(kept, w, argmax)] of rows 0 .. d."""
    d = len(drafts)
    picks = [sample_row(kept, w, drafts[r] if r < d else -1, seed, step + r, a)
             for r, (kept, w, a) in enumerate(rows)]  # fmt: skip
    return accept_sampled(picks, [-5, *drafts], d)


# -- the tests ---------------------------------------------------------------------------------
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=1000, top_p=0.9),
]


def random_logits(rng, v: int) -> np.ndarray:
    return (rng.standard_normal(v) * rng.uniform(0.5, 4.0)).astype(F)


def mass_before(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 [V]: per token, the probability mass before it in _kept's order (softmax of
    logits / temperature sorted, cut to top_k and renormalized; inf past the top_k): where the
    top-p cut falls, computed without float32 rounding."""
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    order = np.argsort(-p, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    q = p[order] / p[order].sum()
    before = np.full(len(logits), np.inf)
    before[order] = np.cumsum(q) - q
    return before


@pytest.mark.parametrize("v", [17, 111, 4097, 151936])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}k{p.top_k}p{p.top_p}")
def test_kept_set_is_probabilities(v, params):
    """The device's p (exact selections, ties kept) is sampling.probabilities' p. Random
    logits have no ties; a top-p cut can still differ at tokens whose mass before them (exact,
    mass_before) is within float32 noise of top_p, and only there, however many sit that close.
    The noise: the device scales logits by float32 1/T and log2(e), each rounded, so every
    weight's exponent x carries a relative error up to ~3 * 2^-24 of the same sign, which moves
    the mass before the cut by up to ~2 ln2 |x| 1.8e-7: ~1e-5 at x = -40, the lowest that
    counts (5.0e-6 was the most in 600 draws at V = 152k; 3e-5 leaves room)."""
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed)
    for _ in range(3):
        logits = random_logits(rng, v)
        _, w = kept_set(logits, params)
        got = w.astype(np.float64) / w.sum(dtype=np.float64)
        want = probabilities(torch.from_numpy(logits), params).double().numpy()
        differ = np.flatnonzero((got > 0) != (want > 0))
        if differ.size:
            off = np.abs(mass_before(logits, params)[differ] - params.top_p)
            assert off.max() < 3e-5, f"seed {seed}: tokens {differ} at {off} from the cut"
            continue
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7, err_msg=f"seed {seed}")


def exact_rule(logits: np.ndarray, params: SamplingParams) -> tuple[int, int]:
    """sampler.cuh's rule by brute force over all logits sorted: (tk, tp) keys. tk: the k-th
    largest key; tp: the first sorted key >= tk where the fixed-point prefix mass reaches
    ceil(top_p * mass(l >= tk))."""
    keys = np.sort(order_keys(logits))[::-1]
    m, inv_t = F(logits.max()), F(1) / F(params.temperature)
    tk = int(keys[params.top_k - 1]) if 0 < params.top_k < len(logits) else 0
    if params.top_p >= 1:
        return tk, tk
    inside = keys[keys >= tk]
    fw = mass_weights(key_values(inside), m, inv_t)
    target = mass_target(F(params.top_p), int(fw.sum(dtype=np.uint64)))
    return tk, int(inside[first_reaching(fw, 0, target)])


def adversarial_logits(rng, v: int) -> dict[str, np.ndarray]:
    """Ties at and around the k-th value, few distinct values, one value everywhere, a peaked
    row, a flat row, huge and tiny spreads."""
    base = random_logits(rng, v)
    few = rng.choice(np.array([-3.0, 0.5, 2.25, 7.0], F), v)
    ties = base.copy()
    ties[rng.choice(v, min(v, 200), replace=False)] = F(np.sort(base)[-min(v, 40)])
    peaked = base.copy()
    peaked[rng.integers(v)] = F(base.max() + 25)
    return {
        "random": base,
        "ties_at_k": ties,
        "few_values": few.astype(F),
        "all_equal": np.full(v, F(1.5)),
        "peaked": peaked,
        "flat": (rng.standard_normal(v) * 0.05).astype(F),
        "wide": (rng.standard_normal(v) * 40).astype(F),
        "negative": (rng.standard_normal(v) * 0.5 - 30).astype(F),
    }


EXACT_PARAMS = [
    *PARAMS,
    SamplingParams(temperature=0.1, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.8, top_k=1500, top_p=0.9),  # top-k above kSampleThreads
    SamplingParams(temperature=1.0, top_k=2, top_p=0.999),
    SamplingParams(temperature=0.3, top_p=0.5),
]


@pytest.mark.parametrize("v", [17, 1000, 4097, 151936])
@pytest.mark.parametrize(
    "params", EXACT_PARAMS, ids=lambda p: f"t{p.temperature}k{p.top_k}p{p.top_p}"
)
def test_thresholds_are_the_exact_rule(v, params):
    """Every route of the selection (the default candidate cap; caps of 1 and 37, which force
    the histogram levels down to single keys) gives exactly the brute-force rule's keys, on
    random and adversarial rows (exact: counts and fixed-point masses are integers)."""
    rng = np.random.default_rng()
    for name, logits in adversarial_logits(rng, v).items():
        want = exact_rule(logits, params)
        for cap in (CANDIDATES, 37, 1):
            assert thresholds(logits, params, cap) == want, (name, cap)


def test_kept_set_keeps_ties_and_degenerate_settings():
    """Ties at the k-th value are all kept; top_k above the distinct values keeps them all;
    top_k = 1 keeps the maximal logits; top_p = 1 with top_k off keeps every logit."""
    rng = np.random.default_rng()
    logits = rng.choice(np.array([0.0, 1.0, 2.0, 3.0], F), 5000).astype(F)
    kept, _ = kept_set(logits, SamplingParams(temperature=1.0, top_k=3))
    assert kept.sum() == (logits == 3).sum() and kept.sum() > 3
    kept, _ = kept_set(logits, SamplingParams(temperature=1.0, top_k=4999))
    assert kept.all()  # the 4999th largest is 0.0, the least value: every logit ties or passes
    kept, _ = kept_set(logits, SamplingParams(temperature=0.5, top_k=1))
    assert np.array_equal(kept, logits == 3)
    kept, w = kept_set(logits, SamplingParams(temperature=2.0))
    assert kept.all() and np.all(w > 0)


def test_accept_decisions_follow_the_rule():
    """u < p(draft) with the device's p decides as speculative.accept's u < p(draft) for every
    uniform not within float32 noise of p: drafts of every rank, inside and outside the kept
    set, uniforms around p on both sides."""
    rng = np.random.default_rng()
    checked = 0
    for params in PARAMS:
        for v in (17, 4097):
            logits = random_logits(rng, v)
            _, w = kept_set(logits, params)
            want = probabilities(torch.from_numpy(logits), params).double().numpy()
            order = np.argsort(-want, kind="stable")
            for draft in {int(order[0]), int(order[1]), int(order[v // 2]), int(order[-1])}:
                rest = kept_parts(w, draft).sum(dtype=F)
                p_dev = F(w[draft] / F(rest + w[draft]))
                p = want[draft]
                us = [*rng.random(20), p * (1 - 1e-3), p * (1 + 1e-3), 0.0, 1 - 2**-24]
                for u in us:
                    if abs(u - p) < 1e-6:
                        continue
                    assert (F(u) < p_dev) == (u < p), (params, draft, u, p, p_dev)
                    checked += 1
    assert checked > 400


@pytest.mark.parametrize("params", PARAMS[:4], ids=lambda p: f"t{p.temperature}k{p.top_k}")
def test_draws_follow_p_and_the_residual(params):
    """Inverse-CDF draws on a grid of N uniforms hit each token N * q times, +-1 (an interval
    of length L holds N L +- 1 grid points): q = p for the plain draw, p without the draft
    renormalised for the residual; the draft itself never."""
    rng = np.random.default_rng()
    n = 4000
    grid = (np.arange(n) + 0.5) / n
    for v in (17, 111, 1500):
        logits = random_logits(rng, v)
        kept, w = kept_set(logits, params)
        p = w.astype(np.float64) / w.sum(dtype=np.float64)
        draft = int(np.argmax(p))  # the largest residual change
        # A lone kept token has p = 1: always accepted, it has no residual.
        for exclude in (-1, draft) if kept.sum() > 1 else (-1,):
            q = p.copy()
            if exclude >= 0:
                q[exclude] = 0
            q /= q.sum()
            part = kept_parts(w, exclude)
            picks = np.array([draw_parts(kept, w, exclude, part, u) for u in grid])
            counts = np.bincount(picks, minlength=v)
            assert np.all(np.abs(counts - n * q) <= 1.01 + 1e-3 * n * q), (v, exclude)
            if exclude >= 0:
                assert counts[exclude] == 0


@pytest.mark.parametrize("params", [PARAMS[0], PARAMS[1], PARAMS[3]], ids=["t1", "k50p95", "p8"])
@pytest.mark.parametrize("draft_rank", [0, 3])
def test_steps_keep_each_tokens_distribution(params, draft_rank):
    """Whole steps with two drafts over vocab 8, one seed each (fresh seeds every run): the
    first token follows p0 whatever the draft; given the first draft accepted the second
    follows p1; given both, the bonus token follows p2. A draw that reused the acceptance
    test's uniform (or its counter), or redrew from p after a rejection, fails it."""
    rng = np.random.default_rng()
    p: list[np.ndarray] = []
    while not p or min(np.count_nonzero(pi) for pi in p) < 2:  # a row of one kept token
        logits = (rng.standard_normal((3, 8)) * 1.5).astype(F)  # tests no distribution: redraw
        rows, p = [], []
        for row in logits:
            kept, w = kept_set(row, params)
            rows.append((kept, w, int(np.argmax(row))))
            p.append(w.astype(np.float64) / w.sum(dtype=np.float64))
    drafts = [int(np.argsort(-p[0], kind="stable")[draft_rank]), int(np.argmax(p[1]))]
    emitted: list[list[int]] = [[], [], []]
    base = int(rng.integers(0, 2**62))
    step = int(rng.integers(1, 1000))
    for s in range(4000):
        out, _ = run_step(rows, drafts, base + 7919 * s, step)
        for i, token in enumerate(out):
            emitted[i].append(token)
    for i in range(3):
        if i == 0 or len(emitted[i]) >= 300:
            assert_distribution(emitted[i], p[i])


def test_counters_are_never_consulted_twice():
    """A generation's consulted uniforms (the prefill's draw at counter 0, then each step's
    acceptance tests of rows 0 .. min(agree, d - 1) and its draw at row agree) have distinct
    counters: each decision sees a fresh uniform."""
    rng = np.random.default_rng()
    for _ in range(200):
        seen = {0}  # the prefill's sample_finish: step 0
        step = 1
        while step < 500:
            d = int(rng.integers(0, 9))
            agree = int(rng.integers(0, d + 1))
            tests = [ACCEPT_COUNTER + step + r for r in range(min(agree + 1, d))]
            used = [*tests, step + agree]
            assert not seen.intersection(used) and len(set(used)) == len(used)
            seen.update(used)
            step += agree + 1


def test_uniform01_is_in_range_and_seeded():
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**63))
    us = np.array([uniform01(seed, c) for c in range(20000)])
    assert us.min() >= 0 and us.max() < 1 and abs(us.mean() - 0.5) < 0.01
    assert uniform01(seed, 5) == uniform01(seed, 5) != uniform01(seed + 1, 5)
    assert uniform01(seed, 5) != uniform01(seed, ACCEPT_COUNTER + 5)


def test_threshold_code_has_one_home():
    """The kept-set rule lives in sampler.cuh alone; the plain sampler and speculative
    sampling both include it."""
    sources = {p.name: p.read_text() for p in KERNEL_DIR.glob("*.cu*")}
    for name, text in sources.items():
        defines = "KeptSet kept_set(" in text or "float uniform01(" in text
        assert defines == (name == "sampler.cuh"), name
    assert '#include "sampler.cuh"' in sources["decode_misc.cu"]
    assert '#include "sampler.cuh"' in sources["speculate.cu"]


# -- the launchers -------------------------------------------------------------------------------
def fake_kernels(k: int, calls: list, cap: int = 16, grace: int = 1) -> SpeculateKernels:
    """SpeculateKernels without a Gpu: launches are recorded."""
    sk = object.__new__(SpeculateKernels)
    sk.spec = SpeculativeConfig(k=k, backoff_cap=cap, backoff_grace=grace)
    sk.config = preset("tiny")
    sk.capacity = 64
    sk.launch = lambda key, grid, *args, **kw: calls.append((key, grid, args, kw))
    return sk


def test_sample_rows_launch():
    calls: list = []
    sk = fake_kernels(5, calls)
    sk.sample_rows(0x1000, 0x2000, 0x30, 0x40, 0x50, 0x60, 0x70, stream="s")
    key, grid, args, kw = calls[0]
    assert key == "sample_rows" and grid == (6, 1, 1)  # a CTA a row, 1 + K
    assert args[:7] == (0x1000, 0x2000, 0x30, 0x40, 0x50, 0x60, 0x70)
    assert args[7] == preset("tiny").vocab_size and args[7].dtype == np.int32
    assert kw["stream"] == "s"
    for bad in ((0, 0x2000, 0x70), (0x1000, 0, 0x70), (0x1000, 0x2000, 0), (0x1002, 0x2000, 0x70)):
        logits, logits0, picks = bad
        with pytest.raises(NanoqwenError, match="null or unaligned"):
            sk.sample_rows(logits, logits0, 0x30, 0x40, 0x50, 0x60, picks)


def test_accept_sampled_launch():
    calls: list = []
    fake_kernels(3, calls).accept_sampled(0x30, 0x40, 0x50, 0x70, 0x60, 0x80, 0x90, 0xA0,
                                          0xB0, 0)  # fmt: skip
    key, grid, args, _ = calls[0]
    assert key == "accept_sampled" and grid == (1, 1, 1)
    assert args[:9] == (0x30, 0x40, 0x50, 0x70, 0x60, 0x80, 0x90, 0xA0, 0xB0)
    assert args[9] == 0 and args[10] == 3 and args[10].dtype == np.int32  # no cond; K
    assert [int(a) for a in args[11:]] == [16, 1] and args[12].dtype == np.int32  # cap, grace


def test_draft_and_accept_launch():
    """draft_ngram gets the stats (it counts dropped drafts), the accept kernels the cap."""
    calls: list = []
    sk = fake_kernels(3, calls, cap=5, grace=2)
    sk.draft(0x1000, 0x20, 0x30, 0x40, 0x50, 0x60, 0)
    key, grid, args, _ = calls[0]
    assert key == "draft_ngram" and grid == (1, 1, 1)
    assert args[:6] == (0x1000, 0x20, 0x30, 0x40, 0x50, 0x60)
    # K, n_min, n_max, capacity, the pages of attention_rows' long form (none asked), the case
    assert [int(a) for a in args[6:]] == [3, 3, 5, 64, registry.MATTN_NEVER_LONG, 0]
    sk.draft(0x1000, 0x20, 0x30, 0x40, 0x50, 0x60, 0, long_pages=193)
    assert int(calls[1][2][10]) == 193 and calls[1][2][10].dtype == np.int32
    sk.accept(0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0)
    key, _, args, _ = calls[2]
    assert key == "accept_greedy" and [int(a) for a in args[8:]] == [0, 3, 5, 2]  # cond K cap grace


def test_sampled_specs_are_registered():
    specs = {s.key: s for s in registry.speculate_specs()}
    assert specs["sample_rows"].threads == THREADS  # sampler.cuh runs in kSampleThreads
    assert specs["accept_sampled"].threads == 32  # a lane a row
    assert registry.DEFAULT_GEOMETRY.verify_rows <= 32
