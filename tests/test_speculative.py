"""Speculative decoding: the drafting rule, the acceptance rule (greedy and sampled, the latter
checked statistically), the backoff, and the reference backend's speculative generation against
its plain one on the tiny synthetic model (token for token, the prefix cache, the KV pages, the
backoff's dropped drafts).

The tiny model's greedy replies fall into a short loop within a few tokens, so n-gram drafts are
proposed and accepted on every prompt; a prompt that repeats a block also gets drafts from the
prompt that the model rejects, so both paths of the rule run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from chisquare import assert_distribution

import nanoqwen.reference as reference
from nanoqwen.config import PAGE_TOKENS
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.reference import ReferenceBackend
from nanoqwen.sampling import SamplingParams, make_generator, probabilities, sample
from nanoqwen.speculative import (
    MAX_BACKOFF,
    MAX_BACKOFF_GRACE,
    MAX_DRAFT_TOKENS,
    Backoff,
    SpeculativeConfig,
    SpeculativeError,
    accept,
    draft,
    step_limit,
)

SPEC = SpeculativeConfig(k=4, n_min=1, n_max=3)
TOL = 1e-5  # of max|logits|: tests/test_prefix_cache.py's bound and reason (M-row GEMM rounding)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- drafting --------------------------------------------------------------------------------


def config(k=4, n_min=1, n_max=3) -> SpeculativeConfig:
    return SpeculativeConfig(k=k, n_min=n_min, n_max=n_max)


@pytest.mark.parametrize(
    ("history", "cfg", "limit", "expected"),
    [
        # The 3-gram [1, 2, 3] occurs at the start: the 3 tokens after it.
        ([1, 2, 3, 9, 8, 1, 2, 3], config(k=3), None, [9, 8, 1]),
        # [5] occurs twice with full drafts: the most recent wins.
        ([5, 7, 1, 5, 8, 2, 5], config(k=2, n_max=1), None, [8, 2]),
        # The longer n-gram wins over a more recent shorter match ([3] at index 5)...
        ([1, 2, 3, 4, 9, 3, 5, 6, 1, 2, 3], config(k=2), None, [4, 9]),
        # ...and with n_max = 1 only the 1-gram is tried.
        ([1, 2, 3, 4, 9, 3, 5, 6, 1, 2, 3], config(k=2, n_max=1), None, [5, 6]),
        # n_min = 2: the 1-gram [1] matching is not enough.
        ([4, 1, 9, 1], config(n_min=2, n_max=3), None, []),
        ([4, 1, 9, 1], config(n_min=1, n_max=3), None, [9, 1]),
        # K caps the draft, and so does the caller's limit (0: no draft).
        ([1, 2, 3, 4, 5, 6, 7, 1], config(k=4), None, [2, 3, 4, 5]),
        ([1, 2, 3, 4, 5, 6, 7, 1], config(k=4), 2, [2, 3]),
        ([1, 2, 3, 4, 5, 6, 7, 1], config(k=4), 0, []),
        # The most recent match drafts only 2 tokens before the end of the history; the
        # earlier one drafts the full 3 and wins; with k = 2 both are full and recency wins.
        ([1, 5, 6, 1, 9, 1], config(k=3, n_max=1), None, [5, 6, 1]),
        ([1, 5, 6, 1, 9, 1], config(k=2, n_max=1), None, [9, 1]),
        # A run: every match overlaps the suffix; the earliest drafts the most, up to h[-1].
        ([7, 7, 7, 7], config(k=4, n_max=2), None, [7, 7]),
        # A loop of period 2 drafts K tokens from an earlier lap.
        ([3, 8, 3, 8, 3, 8, 3, 8], config(k=4, n_max=3), None, [3, 8, 3, 8]),
        # No match, and histories too short for any n-gram.
        ([1, 2, 3, 4, 5], config(), None, []),
        ([6], config(), None, []),
        ([6, 6], config(n_min=2, n_max=2), None, []),
        ([6, 6], config(), None, [6]),
    ],
)
def test_draft(history, cfg, limit, expected):
    assert draft(history, cfg, limit) == expected
    assert draft(np.array(history), cfg, limit) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "eagle"}, "method must be one of ngram"),
        ({"k": 0}, "k .* must be in"),
        ({"k": MAX_DRAFT_TOKENS + 1}, "k .* must be in"),
        ({"n_min": 0}, "n_min must be >= 1"),
        ({"n_min": 3, "n_max": 2}, r"n_max \(2\) must be >= n_min \(3\)"),
        ({"backoff_cap": -1}, "backoff_cap must be in"),
        ({"backoff_cap": MAX_BACKOFF + 1}, "backoff_cap must be in"),
        ({"backoff_grace": -1}, "backoff_grace must be in"),
        ({"backoff_grace": MAX_BACKOFF_GRACE + 1}, "backoff_grace must be in"),
    ],
)
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(SpeculativeError, match=match):
        SpeculativeConfig(**kwargs)


# -- the backoff -------------------------------------------------------------------------------
# A hand-made sequence of steps: (drafts the lookup found, accepted of those that ran) ->
# (drafts verified, skip, fails after the step). Cap 4, grace 1: failures in a row set skips
# 0, 1, 2, 4, 4.
BACKOFF_STEPS = [
    (3, 0, 3, 0, 1),  # a first failure is forgiven
    (2, 0, 2, 1, 2),  # the second sets skip 1
    (0, 0, 0, 1, 2),  # no match: skip unused
    (5, 0, 0, 0, 2),  # dropped (skipped): skip used up
    (2, 0, 2, 2, 3),  # fail again: skip doubles
    (4, 0, 0, 1, 3),  # dropped
    (4, 0, 0, 0, 3),  # dropped
    (1, 0, 1, 4, 4),  # fail: 4
    *[(2, 0, 0, n, 4) for n in (3, 2, 1, 0)],
    (6, 0, 6, 4, 5),  # fail at the cap: stays 4
    *[(1, 0, 0, n, 5) for n in (3, 2, 1, 0)],
    (6, 1, 6, 0, 0),  # one of six accepted: a partial rejection clears the backoff
    (6, 0, 6, 0, 1),  # and the next failure is forgiven again
    (2, 2, 2, 0, 0),  # all accepted
    (3, 0, 3, 0, 1),
]


def test_backoff_on_a_hand_made_sequence():
    b, dropped = Backoff(), 0
    cfg = SpeculativeConfig(backoff_cap=4, backoff_grace=1)
    for i, (found, accepted, verified, skip, fails) in enumerate(BACKOFF_STEPS):
        drafts = b.gate(list(range(found)))
        dropped += len(drafts) < found
        b.update(len(drafts), accepted, cfg)
        assert (len(drafts), b.skip, b.fails) == (verified, skip, fails), i
    assert dropped == 11


@pytest.mark.parametrize(
    ("cap", "grace", "skips"),
    [
        (4, 0, [1, 2, 4, 4, 4]),
        (16, 1, [0, 1, 2, 4, 8, 16, 16]),
        (5, 2, [0, 0, 1, 2, 4, 5, 5]),
        (0, 1, [0, 0, 0, 0]),  # cap 0: no backoff
        (MAX_BACKOFF, 0, [1 << min(n, 20) for n in range(70)]),  # fails saturate at 64
    ],
)
def test_backoff_skips_after_failures_in_a_row(cap, grace, skips):
    b, cfg = Backoff(), SpeculativeConfig(backoff_cap=cap, backoff_grace=grace)
    for n, want in enumerate(skips):
        b.update(3, 0, cfg)
        assert (b.skip, b.fails) == (want, min(n + 1, 64)), n
        b.skip = 0  # as if the skipped matches went by
    b.update(0, 0, cfg)  # a step without drafts changes nothing
    assert b.skip == 0 and b.fails == min(len(skips), 64)


# -- acceptance: greedy ------------------------------------------------------------------------


def one_hot_rows(targets: list[int], v: int = 6) -> torch.Tensor:
    """Logits [len(targets), v] whose row i has its argmax at targets[i] (and a tie at a
    higher id, which the lowest-id rule must ignore)."""
    logits = torch.zeros(len(targets), v)
    for i, t in enumerate(targets):
        logits[i, t] = logits[i, v - 1] = 2.0
    return logits


@pytest.mark.parametrize(
    ("targets", "drafts", "expected"),
    [
        ([3], [], [3]),
        ([1, 2, 4], [1, 2], [1, 2, 4]),  # all agree: the drafts and row 2's token
        ([1, 2, 4], [1, 0], [1, 2]),  # row 1 disagrees: its argmax replaces the draft
        ([1, 2, 4], [0, 2], [1]),
        ([5, 5], [5], [5, 5]),
    ],
)
def test_greedy_acceptance(targets, drafts, expected):
    assert accept(one_hot_rows(targets), drafts, SamplingParams()) == expected


def test_acceptance_checks_the_rows():
    with pytest.raises(SpeculativeError, match=r"expected logits \[3, V\] for 2 drafts"):
        accept(torch.zeros(2, 6), [1, 2], SamplingParams())


# -- acceptance: sampled (statistical) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.8, 6, 0.9)],
)
@pytest.mark.parametrize("draft_rank", [0, 7])  # the most probable token; the least
def test_sampled_acceptance_keeps_the_target_distribution(temperature, top_k, top_p, draft_rank):
    """Two drafts over vocab 8. The first emitted token must follow p0 (row 0's processed
    distribution) whatever the draft; given the first draft accepted, the second must follow
    p1; given both accepted, the third (the bonus token) must follow p2. The least probable
    token is outside the top-k / top-p cut in some cases (p = 0: always rejected)."""
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32) * 1.5)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = [probabilities(row, params) for row in logits]
    rank = [torch.argsort(q, descending=True, stable=True) for q in p]
    drafts = [int(rank[0][draft_rank]), int(rank[1][0])]
    generator = make_generator(11)
    emitted: list[list[int]] = [[], [], []]  # [i]: the i-th token where drafts[:i] were kept
    for _ in range(5000):
        out = accept(logits, drafts, params, generator)
        for i, token in enumerate(out):
            emitted[i].append(token)
    assert_distribution(emitted[0], p[0])
    # Conditional checks where enough draws reach them (too few make chi-square unreliable).
    for i in (1, 2):
        if len(emitted[i]) >= 300:
            assert_distribution(emitted[i], p[i])
    if draft_rank == 0:
        assert len(emitted[2]) >= 300  # the bonus path was checked


def test_sampled_acceptance_without_drafts_is_sample():
    """No draft: the same draws as sample() from the same generator state."""
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=0.9, top_k=20)
    a, b = make_generator(3), make_generator(3)
    drawn = [accept(logits, [], params, a)[0] for _ in range(20)]
    assert drawn == [sample(logits[0], params, b) for _ in range(20)]


# -- the reference backend ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_file(tiny_model):
    with NanoqwenFile(tiny_model) as f:
        yield f


@pytest.fixture(scope="module")
def cold(model_file):
    """The plain backend, prefix caching off: every generation from scratch."""
    return ReferenceBackend(model_file, max_context=256, prefix_caching=False)


@pytest.fixture
def spec(model_file):
    """A fresh speculative backend with prefix caching on."""
    return ReferenceBackend(model_file, max_context=256, speculative=SPEC)


@pytest.fixture
def steps(monkeypatch):
    """Every step's drafts, emitted tokens and their logits rows, [(drafts, tokens,
    rows [n, V])], in order."""
    record: list[tuple[list[int], list[int], torch.Tensor]] = []
    rule = reference.accept

    def spy(logits, drafts, params, generator):
        kept = rule(logits, drafts, params, generator)
        record.append((list(drafts), kept, logits[: len(kept)].clone()))  # row i: token i
        return kept

    monkeypatch.setattr(reference, "accept", spy)
    return record


def generate(backend, prompt, max_tokens=24, stop=frozenset(), **params) -> list[int]:
    out = list(backend.generate(prompt, SamplingParams(max_tokens=max_tokens, **params), stop))
    assert backend.kv_pages_in_use == 0
    return out


def repeating(seed: int) -> list[int]:
    """A block of 11 random ids three times and its first 5 once more: drafts from the prompt."""
    block = np.random.default_rng(seed).integers(0, 5000, 11).tolist()
    return block * 3 + block[:5]


def decoys(seed: int) -> list[int]:
    """b and its partner b ^ 1 (the tiny model's next token) each followed by a random id, then
    b: the reply b ^ 1, b, .. matches them, and their drafts are rejected steps in a row."""
    b, *r = np.random.default_rng(seed).integers(0, 5000, 5).tolist()
    return [b, r[0], b ^ 1, r[1], b, r[2], b ^ 1, r[3], b]


def random_prompt(seed: int, n: int = 29) -> list[int]:
    return np.random.default_rng(seed).integers(0, 150_000, n).tolist()


@pytest.mark.parametrize("prompt", [repeating(1), repeating(2), random_prompt(3), random_prompt(4)])
def test_greedy_speculative_equals_plain_greedy(prompt, cold, spec, steps):
    plain = generate(cold, prompt)
    steps.clear()
    assert generate(spec, prompt) == plain
    stats = spec.spec_stats
    assert stats.accepted > 0, stats
    assert stats.steps == len(steps) - 1  # every forward after the prefill
    assert stats.drafted == sum(len(d) for d, _, _ in steps)
    assert stats.accepted == sum(len(kept) - 1 for _, kept, _ in steps)
    assert len(steps) < len(plain)  # fewer forwards than tokens


def replay(prompt: list[int], steps, spec: SpeculativeConfig, max_tokens: int, capacity: int):
    """The drafts the rule gives each decode step of a recorded generation (speculative.draft
    through a Backoff fed the recorded acceptances), and how many it dropped."""
    history, backoff, want, dropped = prompt + steps[0][1], Backoff(), [], 0
    for drafts, kept, _ in steps[1:]:
        made = len(history) - len(prompt)
        found = draft(history, spec, step_limit(max_tokens, made, len(history), capacity))
        want.append(backoff.gate(found))
        dropped += len(want[-1]) < len(found)
        backoff.update(len(drafts), len(kept) - 1, spec)
        history += kept
    return want, dropped


@pytest.mark.parametrize(("cap", "grace"), [(0, 1), (1, 0), (16, 1)])
def test_backoff_drops_drafts_and_keeps_greedy_tokens(model_file, cold, steps, cap, grace):
    """The reference backend drafts by the rule (replayed), drops drafts after rejections
    (not with cap 0) and gives the plain greedy tokens."""
    spec_cfg = SpeculativeConfig(k=4, n_min=1, n_max=3, backoff_cap=cap, backoff_grace=grace)
    backend = ReferenceBackend(model_file, max_context=256, speculative=spec_cfg)
    skipped = 0
    for prompt in (repeating(1), repeating(2), decoys(3), decoys(4)):
        plain = generate(cold, prompt, max_tokens=40)
        steps.clear()
        assert generate(backend, prompt, max_tokens=40) == plain
        want, dropped = replay(prompt, steps, spec_cfg, 40, 256)
        assert [d for d, _, _ in steps[1:]] == want
        assert backend.spec_stats.skipped == dropped
        skipped += dropped
    assert (skipped > 0) == (cap > 0), skipped


def test_repeating_prompt_drafts_get_rejected_too(spec):
    """The prompt's repetition proposes drafts the model does not follow: both outcomes run."""
    generate(spec, repeating(1))
    stats = spec.spec_stats
    assert 0 < stats.accepted < stats.drafted, stats


def test_max_tokens_and_stop_ids_cut_mid_step(cold, spec, steps):
    """Every max_tokens and every stop id of a reply is honoured exactly, also where it falls
    inside a step that accepted several drafts (such steps exist: checked)."""
    prompt = repeating(2)
    full = generate(cold, prompt, max_tokens=20)
    steps.clear()
    assert generate(spec, prompt, max_tokens=20) == full
    assert any(len(kept) > 2 for _, kept, _ in steps)  # a cut at 1..19 lands inside such a step
    for m in range(1, 20):
        assert generate(spec, prompt, max_tokens=m) == full[:m]
    for stop in set(full):
        upto = full[: full.index(stop) + 1]
        assert generate(spec, prompt, max_tokens=20, stop=frozenset({stop})) == upto


def test_prefix_cache_after_speculation(cold, spec, steps):
    """Speculative replies (with rejected drafts written to the pages) leave a prefix cache
    whose reuse gives the cold run's tokens and logits: the re-request of prompt + reply +
    more is served from the cache as far as the committed full pages reach."""
    prompt = repeating(1)
    reply = generate(spec, prompt, max_tokens=30)
    assert spec.spec_stats.accepted < spec.spec_stats.drafted  # some drafts were rejected
    again = prompt + reply + random_prompt(5, n=7)
    steps.clear()
    warm = generate(spec, again, max_tokens=16)
    committed = len(prompt) + len(reply) - 1  # the reply's last token is never fed
    assert spec.cached_tokens == min(committed, len(again) - 1) // PAGE_TOKENS * PAGE_TOKENS
    assert spec.cached_tokens >= 4 * PAGE_TOKENS
    # The rows warm's tokens came from ([16, V]; the last step may have accepted past 16).
    rows = torch.cat([r for _, _, r in steps])[:16].numpy()
    assert warm == generate(cold, again, max_tokens=16)
    forced = cold.logits(again + warm)[len(again) - 1 : -1]  # teacher-forced, one cold pass
    assert rows.shape == forced.shape
    assert np.abs(rows - forced).max() <= TOL * np.abs(forced).max()


def test_closing_mid_generation_frees_pages(spec):
    stream = spec.generate(repeating(2), SamplingParams(max_tokens=40), frozenset())
    for n, _ in enumerate(stream, start=1):
        if n == 6:
            break
    stream.close()
    assert spec.kv_pages_in_use == 0


def test_sampled_speculation_stays_in_the_support(cold, spec, steps):
    """Seeded sampled speculation is reproducible, and every emitted token lies in the top-k
    support of the teacher-forced logits at its position (a wrong row, offset or K/V would
    leave it). top_k = 3 at a low temperature keeps drafts acceptable now and then."""
    prompt = repeating(2)
    params = {"temperature": 0.3, "top_k": 3, "seed": 5}
    out = generate(spec, prompt, max_tokens=24, **params)
    assert generate(spec, prompt, max_tokens=24, **params) == out
    assert spec.spec_stats.drafted > 0
    forced = torch.from_numpy(cold.logits(prompt + out)[len(prompt) - 1 : -1])
    top3 = torch.topk(forced, 3, dim=1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(out))


EDIT_PROMPT = (
    "<|im_start|>user\nRename the parameter `xs` to `values` and return the whole function:\n"
    "```python\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return total / len(xs)\n```<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_on_real_weights(real_model):
    """A real model asked to repeat code with an edit: prompt lookup drafts most of the reply,
    and the tokens are still plain greedy's."""
    from tokenizers import Tokenizer

    with NanoqwenFile(real_model) as file:
        ref = ReferenceBackend(file, max_context=512, prefix_caching=False)
        prompt = Tokenizer.from_str(file.tokenizer.tokenizer_json).encode(EDIT_PROMPT).ids
        stop = frozenset(file.tokenizer.eos_token_ids)
        plain = generate(ref, prompt, max_tokens=40, stop=stop)
        ref.speculative = SPEC
        assert generate(ref, prompt, max_tokens=40, stop=stop) == plain
        stats = ref.spec_stats
        print(f"\n{real_model.name}: {len(plain)} tokens in {stats.steps + 1} forwards, {stats}")
        assert stats.accepted > len(plain) // 4, stats
        ref.close()
