"""CPU (no GPU): speculate.cu (draft_ngram, accept_greedy) compiles for every preset without
spills, its launchers refuse bad arguments, and a numpy emulation of the kernels' index and
reduction logic (the 16-byte chunks over the history, L(i) and the packed key's block max;
the ballots, cuts and state words of acceptance; the backoff words) matches speculative.draft /
accept / cut / Backoff on random and repetitive histories: what dev/speculate_check.py cannot
show without a GPU."""

import numpy as np
import pytest
import torch

from nanoqwen.config import PRESETS, preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.speculate import check_capacity
from nanoqwen.errors import NanoqwenError
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import (
    MAX_DRAFT_TOKENS,
    Backoff,
    SpeculativeConfig,
    accept,
    cut,
    draft,
    step_limit,
)

THREADS = registry.DEFAULT_GEOMETRY.draft_threads
VEC = 4  # kHistVec
POISON = -7  # history words past len: a kernel that reads them as tokens picks them up


@pytest.fixture(autouse=True)
def _cache(kernel_cache):
    return kernel_cache


@pytest.mark.parametrize("name", list(PRESETS))
def test_speculate_specs_compile_without_spills(name):
    pytest.importorskip("cuda.bindings.nvrtc")
    specs = registry.speculate_specs()
    res = {}
    for mod in registry.compile_specs(specs, preset(name)).values():
        res.update(mod.resources())
    for s in specs:
        r = res[s.expression]
        assert r.spill_bytes == 0 and r.registers <= 65536 // s.threads, (s.key, r)


def test_launcher_refusals():
    for bad in (0, 6, 1 << 27):
        with pytest.raises(NanoqwenError, match="multiple of 4"):
            check_capacity(bad)
    assert check_capacity(32768) == 32768
    assert MAX_DRAFT_TOKENS + 1 == registry.MAX_ROWS  # every draft count fits the verify step


# -- the kernels' logic, emulated -------------------------------------------------------------
def emulate_draft(h, state, k, n_min, n_max, capacity, skip=0):
    """draft_ngram in numpy, line by line, with SPEC_SKIP = `skip`: returns (tokens [1 + k],
    positions [1 + k], d, SPEC_SKIP after, dropped: 1 when the backoff dropped the drafts)."""
    pos, step, max_new = state
    length = pos + 1
    limit = min(k, min(max_new - step - 1, capacity - length - 1))
    last = int(h[length - 1])

    def at(i):  # a scalar read of the history: only h[0 .. len - 1] holds tokens
        assert 0 <= i < length, (i, length)
        return h[i]

    best = np.zeros(THREADS, np.uint64)  # each thread's packed key
    if limit > 0:
        chunks = (length - 1 + VEC - 1) // VEC
        for c in range(chunks):
            w = h[c * VEC : c * VEC + VEC]  # one 16-byte load (inside the capacity)
            for kk in range(VEC):
                i = c * VEC + kk
                if i > length - 2 or w[kk] != last:
                    continue
                n = 1
                while n < n_max and n <= i and at(i - n) == at(length - 1 - n):
                    n += 1
                if n < n_min:
                    continue
                e = i + 1
                key = min(limit, length - e) * length + (e - n)
                assert key < 1 << 32
                best[c % THREADS] = max(int(best[c % THREADS]), (n << 32) | key)
    top = int(best.max())  # the warp shuffles and the shared-memory max
    key, n = top & 0xFFFFFFFF, top >> 32
    d = key // length if n else 0
    dropped = int(d > 0 and skip > 0)
    skip, d = skip - dropped, 0 if dropped else d
    src = key % length + n if n else 0
    tokens = [int(h[src + r - 1]) if 1 <= r <= d else last for r in range(k + 1)]
    return tokens, [pos + r for r in range(k + 1)], d, skip, dropped


def emulate_accept(targets, tokens, d, state, eos, capacity, fails=0, cap=0, grace=0):
    """accept_greedy in numpy, with SPEC_FAILS = `fails`, backoff_cap `cap` and backoff_grace
    `grace`: (emitted tokens, new (token, pos, step, done), accepted, new (SPEC_SKIP,
    SPEC_FAILS) or None when d = 0 leaves them)."""
    _, pos, step, max_new = state
    lanes = np.arange(32)
    tgt = np.array([targets[r] if r < len(targets) else 0 for r in lanes])
    drafts = np.array([tokens[1 + r] if r < d else -1 for r in lanes])
    miss = (lanes < d) & (drafts != tgt)
    agree = int(np.argmax(miss)) if miss.any() else d
    stops = np.isin(tgt, eos) & (lanes <= agree)
    first = int(np.argmax(stops)) + 1 if stops.any() else agree + 1
    e = max(1, min(first, max_new - step))
    assert pos + e < capacity  # h[pos + 1 + t] stays inside
    done = step + e >= max_new or bool(stops.any())
    backoff = None
    if d > 0:
        fails = 0 if agree > 0 else min(fails + 1, registry.BACKOFF_MAX_FAILS)
        over = fails - grace
        skip = min(cap, 1 << min(over - 1, registry.BACKOFF_MAX_SHIFT)) if over > 0 else 0
        backoff = (skip, fails)
    return tgt[:e].tolist(), (int(tgt[e - 1]), pos + e, step + e, done), agree, backoff


def histories(rng):
    """(kind, history) pairs: random over small and large vocabularies, runs, loops of period
    1..9 with noise, a repeated block, lengths 1 .. ~3000."""
    for length in (1, 2, 3, 4, 5, 7, 17, 111, 1000, 3001):
        yield "random8", rng.integers(0, 8, length)
        yield "random5k", rng.integers(0, 5000, length)
    for length in (2, 9, 64, 500):
        yield "run", np.full(length, 3)
    for period in range(1, 10):
        loop = np.tile(rng.integers(0, 50, period), 400 // period + 1)[: 300 + period]
        noise = rng.random(len(loop)) < 0.05
        yield f"loop{period}", np.where(noise, rng.integers(0, 50, len(loop)), loop)
    block = rng.integers(0, 100, 60)
    yield "block", np.concatenate([block, rng.integers(0, 100, 40), block[:45]])


def padded(hist, capacity):
    h = np.full(capacity, POISON, np.int64)
    h[: len(hist)] = hist
    return h


def test_draft_emulation_matches_speculative_draft():
    rng = np.random.default_rng()
    cases = drafted = dropped_cases = 0
    for kind, hist in histories(rng):
        length = len(hist)
        for k, n_min, n_max in ((1, 1, 1), (4, 1, 3), (15, 2, 4), (7, 3, 3), (5, 1, 12)):
            capacity = -(-(length + int(rng.integers(1, 20))) // 4) * 4
            step = int(rng.integers(0, 8))
            max_new = step + int(rng.integers(1, 20))  # limits 0 .. and past K
            pos = length - 1
            skip = int(rng.choice([0, 0, 1, 5]))
            tokens, positions, d, skip_after, dropped = emulate_draft(
                padded(hist, capacity), (pos, step, max_new), k, n_min, n_max, capacity, skip
            )
            cap = step_limit(max_new, step, length, capacity)
            cfg = SpeculativeConfig(k=k, n_min=n_min, n_max=n_max)
            backoff = Backoff(skip=skip)
            want = backoff.gate(draft(hist, cfg, cap))
            assert (d, skip_after) == (len(want), backoff.skip), (kind, length, skip)
            assert tokens[1 : 1 + d] == want, (kind, length, k, n_min, n_max, cap)
            assert tokens[0] == hist[-1] and set(tokens[1 + d :]) <= {int(hist[-1])}
            assert positions == list(range(pos, pos + k + 1))
            cases += 1
            drafted += d > 0
            dropped_cases += dropped
    found = drafted + dropped_cases  # the lookup matched: verified, or dropped by the backoff
    counts = (cases, drafted, dropped_cases)
    assert cases == 170 and found > 60 and min(drafted, dropped_cases) > 15, counts


def test_draft_limit_rule():
    """The cap binds at max_new (one token left: no drafts) and at the capacity."""
    hist = np.tile([1, 2, 3, 4], 10)
    cfg = SpeculativeConfig(k=8, n_min=1, n_max=3)
    for max_new, step, capacity, d in ((100, 0, 400, 8), (5, 2, 400, 2), (5, 4, 400, 0),
                                       (100, 0, 44, 3), (100, 0, 41, 0)):  # fmt: skip
        cap_h = -(-capacity // 4) * 4
        _, _, got, _, _ = emulate_draft(padded(hist, cap_h), (39, step, max_new), 8, 1, 3,
                                        capacity)  # fmt: skip
        assert got == d == len(draft(hist, cfg, step_limit(max_new, step, 40, capacity)))


def expected_step(targets, drafts, eos, left):
    """speculative.accept on one-hot logits (row r's argmax targets[r]), then speculative.cut:
    (kept, (emitted, stopped))."""
    logits = torch.full((len(drafts) + 1, 64), -1.0)
    logits[torch.arange(len(drafts) + 1), torch.tensor(targets[: len(drafts) + 1])] = 1.0
    kept = accept(logits, drafts, SamplingParams(temperature=0.0))
    return kept, cut(kept, left, frozenset(eos))


def test_accept_emulation_matches_speculative_accept():
    rng = np.random.default_rng()
    for _ in range(3000):
        k = int(rng.integers(1, 16))
        d = int(rng.integers(0, k + 1))
        drafts = rng.integers(0, 64, d).tolist()
        agree = int(rng.integers(0, d + 1))
        targets = drafts[:agree] + rng.integers(0, 64, k + 1 - agree).tolist()
        tokens = [int(rng.integers(0, 64))] + drafts + [7] * (k - d)
        eos = rng.choice(64, int(rng.integers(0, 4)), replace=False).tolist()
        step = int(rng.integers(0, 10))
        left = int(rng.integers(1, 20))
        pos = int(rng.integers(0, 100))
        capacity = pos + k + 2
        fails = int(rng.choice([0, 1, 2, 5, 30, 64]))
        cfg = SpeculativeConfig(backoff_cap=int(rng.choice([0, 1, 16, 1 << 20])),
                                backoff_grace=int(rng.integers(0, 3)))  # fmt: skip
        got, (token, new_pos, new_step, done), acc, words = emulate_accept(
            targets, tokens, d, (0, pos, step, step + left), eos, capacity, fails,
            cfg.backoff_cap, cfg.backoff_grace
        )  # fmt: skip
        kept, (want, stopped) = expected_step(targets, drafts, eos, left)
        backoff = Backoff(skip=0, fails=fails)  # a step that verified drafts ran at skip 0
        backoff.update(d, len(kept) - 1, cfg)
        assert words == (None if d == 0 else (backoff.skip, backoff.fails))
        assert got == want and token == want[-1]
        assert (new_pos, new_step) == (pos + len(want), step + len(want))
        assert done == (stopped or len(want) == left)
        assert acc == len(kept) - 1  # SpecStats.accepted: before the cuts
