"""Prefix caching in the reference backend, against the same model with prefix caching off.

Every warm generation is compared with a cold one of the same prompt: the same greedy tokens,
and the logits of every step (recorded where generate() samples them) within 1e-5 of
max|cold|. Not bitwise: the warm prefill runs only the uncached suffix, and float32 GEMMs of
M = suffix rows and M = whole-prompt rows may round differently (the bound and reason of
tests/test_reference.py's paged-vs-one-shot check; measured 0 to 3.3e-7 on its configs).
A reused page holding another prefix's K/V, a wrong offset or a never-written slot moves
logits by 1e-2 or more, and a poisoned cached page turns them NaN (checked below: the cache
is really read).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nanoqwen.reference as reference
from nanoqwen.config import PAGE_TOKENS
from nanoqwen.errors import ContextError
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.reference import ReferenceBackend
from nanoqwen.sampling import SamplingParams

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_file(tiny_model):
    with NanoqwenFile(tiny_model) as f:
        yield f


@pytest.fixture
def pair(model_file):
    """pair(max_context) -> (warm, cold): fresh backends with prefix caching on and off."""

    def make(max_context: int = 256):
        warm = ReferenceBackend(model_file, max_context=max_context)
        return warm, ReferenceBackend(model_file, max_context=max_context, prefix_caching=False)

    return make


@pytest.fixture
def recorded(monkeypatch):
    """Every logits row generate() samples from, in order (cleared by `run`)."""
    rows: list[torch.Tensor] = []
    accept = reference.accept

    def spy(logits, drafts, params, generator):
        kept = accept(logits, drafts, params, generator)
        rows.extend(logits[: len(kept)].clone())  # row i gave the step's i-th token
        return kept

    monkeypatch.setattr(reference, "accept", spy)
    return rows


def run(backend, prompt, recorded, max_tokens=8, close_after=None, params=None):
    """(tokens, logits [steps, V]) of one generation, closed after `close_after` tokens."""
    recorded.clear()
    params = params or SamplingParams(max_tokens=max_tokens)
    stream = backend.generate(prompt, params, frozenset())
    tokens = []
    for token in stream:
        tokens.append(token)
        if len(tokens) == close_after:
            stream.close()
    assert backend.kv_pages_in_use == 0
    return tokens, torch.stack(recorded).numpy()


def assert_same(warm, cold, prompt, recorded, cached: int, **kw) -> list[int]:
    """warm reuses exactly `cached` prompt tokens and generates what cold does."""
    tokens, logits = run(warm, prompt, recorded, **kw)
    assert warm.cached_tokens == cached
    cold_tokens, cold_logits = run(cold, prompt, recorded, **kw)
    assert cold.cached_tokens == 0
    err = float(np.abs(logits - cold_logits).max() / np.abs(cold_logits).max())
    assert err <= TOL, err
    assert tokens == cold_tokens
    return tokens


def ids(rng, n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


def test_reuse_matches_a_cold_prefill(pair, recorded):
    warm, cold = pair()
    rng = np.random.default_rng()
    shared = ids(rng, 40)
    # Sampled (not greedy) the first time: sampling parameters never enter the K/V.
    hot = SamplingParams(temperature=1.3, top_p=0.9, seed=int(rng.integers(1 << 30)), max_tokens=8)
    run(warm, shared + ids(rng, 7), recorded, params=hot)
    assert warm.cached_tokens == 0
    b = shared + ids(rng, 11)
    reply = assert_same(warm, cold, b, recorded, cached=32, max_tokens=12)
    # The next chat turn resends prompt and reply: every full page written is reused (the
    # reply's last token never had its K/V computed).
    turn = b + reply + ids(rng, 5)
    assert_same(warm, cold, turn, recorded, cached=(len(b) + 12 - 1) // 16 * 16)
    s = warm.kv_stats
    assert s.held == 0 and s.hit_tokens == 32 + (len(b) + 11) // 16 * 16
    assert s.lookup_tokens == 47 + len(b) + len(turn)
    # A poisoned cached page poisons the next hit: the warm prefill really reads the cache.
    probe = warm.cache.pages.admit(shared + [0])
    page = probe.pages[0]
    warm.cache.pages.release(probe)
    with torch.inference_mode():
        warm.cache.k[0][page] = float("nan")
    _, logits = run(warm, shared + ids(rng, 3), recorded, max_tokens=1)
    assert warm.cached_tokens == 32 and np.isnan(logits).all()


def test_cancelled_and_failed_steps_cache_only_written_pages(pair, recorded):
    warm, cold = pair()
    rng = np.random.default_rng()
    prompt = ids(rng, 30)  # positions 0..29; the replies' tokens go to 30, 31, ...
    g = run(warm, prompt, recorded, max_tokens=50, close_after=2)[0]
    # Closed when token 2 (position 31) was yielded: its K/V were never written, so page 1
    # (positions 16..31) is incomplete and not cached.
    assert warm.kv_stats.cached == 1
    assert_same(warm, cold, prompt + g + ids(rng, 1), recorded, cached=16)
    g = run(warm, prompt, recorded, max_tokens=50, close_after=3)[0]  # position 31 written
    assert_same(warm, cold, prompt + g + ids(rng, 1), recorded, cached=32)

    # A forward that fails part way: layer 0 has written position 31's K/V, layer 1 has not.
    fresh = ids(rng, 31)
    mlp, calls = warm.model.mlp, []

    def failing_mlp(x, w):
        calls.append(1)
        if len(calls) == warm.config.num_layers + 1:  # layer 0 of the first decode step
            raise RuntimeError("injected failure")
        return mlp(x, w)

    warm.model.mlp = failing_mlp  # shadows the class's staticmethod on this instance
    stream = warm.generate(fresh, SamplingParams(max_tokens=5), frozenset())
    first = next(stream)
    with pytest.raises(RuntimeError, match="injected"):
        next(stream)
    del warm.model.mlp
    assert warm.kv_pages_in_use == 0
    assert_same(warm, cold, fresh + [first] + ids(rng, 1), recorded, cached=16)


def test_pool_running_short_evicts(pair, recorded):
    warm, cold = pair(max_context=64)  # 4 pages
    rng = np.random.default_rng()
    a = ids(rng, 40)
    run(warm, a, recorded, max_tokens=8)  # 47 positions written: 2 full pages cached
    assert warm.kv_stats.cached == 2
    # 63 positions need all 4 pages: the 2 free ones, then the 2 cached ones.
    assert_same(warm, cold, ids(rng, 50), recorded, cached=0, max_tokens=14)
    s = warm.kv_stats
    assert s.evictions == 2 and s.held == 0 and s.cached + s.free == 4
    assert_same(warm, cold, a + ids(rng, 3), recorded, cached=0, max_tokens=4)


def test_context_errors_stay_clear(pair, recorded):
    warm, _ = pair(max_context=64)
    rng = np.random.default_rng()
    a = ids(rng, 40)
    run(warm, a, recorded, max_tokens=8)
    before = warm.kv_stats
    with pytest.raises(ContextError, match="prompt of 65 tokens .* exceeds the context of 64"):
        warm.generate(ids(rng, 65), SamplingParams(max_tokens=1), frozenset())
    with pytest.raises(ContextError, match="60 tokens \\+ max_tokens 5 = 65"):
        warm.generate(ids(rng, 60), SamplingParams(max_tokens=5), frozenset())
    assert warm.kv_stats == before
    # Two generations open at once (past the batch-1 contract) run the pool itself short.
    first = warm.generate(a + ids(rng, 8), SamplingParams(max_tokens=10), frozenset())
    next(first)  # holds 3 pages (2 of them cached ones)
    second = warm.generate(ids(rng, 30), SamplingParams(max_tokens=10), frozenset())
    with pytest.raises(ContextError, match="KV cache full: 30 positions need 2 more"):
        next(second)
    assert warm.kv_pages_in_use == 3
    first.close()
    assert warm.kv_pages_in_use == 0


def test_logits_neither_read_nor_fill_the_cache(pair, recorded):
    warm, cold = pair()
    rng = np.random.default_rng()
    prompt = ids(rng, 50)
    before = warm.kv_stats
    expected = cold.logits(prompt)
    assert np.array_equal(warm.logits(prompt), expected)
    assert warm.kv_stats == before
    assert_same(warm, cold, prompt + ids(rng, 2), recorded, cached=0)
    # ... and a cached prefix does not change what logits() computes.
    assert np.array_equal(warm.logits(prompt), expected)


def test_prefix_caching_off(pair, recorded):
    _, cold = pair()
    prompt = ids(np.random.default_rng(), 40)
    for _ in range(2):
        run(cold, prompt, recorded)
        assert cold.cached_tokens == 0
    s = cold.kv_stats
    assert (s.cached, s.free, s.lookup_tokens, s.hit_tokens) == (0, s.pages, 0, 0)


def test_greedy_reply_with_reuse_is_the_teacher_forced_argmax(pair, recorded):
    """A warm generation across several pages agrees with one cold teacher-forced pass."""
    warm, _ = pair()
    rng = np.random.default_rng()
    shared = ids(rng, 3 * PAGE_TOKENS + 5)
    run(warm, shared, recorded, max_tokens=2)
    prompt = shared + ids(rng, 9)
    reply, _ = run(warm, prompt, recorded, max_tokens=30)
    assert warm.cached_tokens == 48
    logits = warm.logits(prompt + reply)
    assert reply == logits[len(prompt) - 1 : -1].argmax(axis=1).tolist()
