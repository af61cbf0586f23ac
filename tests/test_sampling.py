"""The host sampler: greedy, temperature, top-k, top-p, seeds, and the drawn distribution."""

import numpy as np
import pytest
import torch

from nanoqwen.sampling import (
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingError,
    SamplingParams,
    make_generator,
    probabilities,
    sample,
)


def _random_logits(v: int, rng: np.random.Generator | None = None) -> torch.Tensor:
    rng = rng or np.random.default_rng()
    return torch.from_numpy(rng.standard_normal(v).astype(np.float32) * 3)


def _expected(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution written independently of sample(): float64 [V]."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    kept = order[:top_k] if top_k else order
    mass = 0.0
    for i in kept:
        keep[i] = True
        mass += p[i] / p[kept].sum()
        if mass >= top_p:
            break
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("v", [1, 2, 17, 151_936])
def test_greedy_is_argmax_lowest_id_on_ties(v):
    logits = _random_logits(v)
    top = int(torch.argmax(logits))
    assert sample(logits, SamplingParams(), None) == top
    if v > 1:
        tie = np.random.default_rng().integers(0, v)
        logits[tie] = logits[top]
        expected = min(tie, top)
        assert sample(logits, SamplingParams(temperature=0.0), None) == expected
        # top_k = 1 is greedy at any temperature, and consumes no randomness.
        assert sample(logits, SamplingParams(temperature=3.0, top_k=1), None) == expected


def test_top_k_never_draws_outside_the_top_k():
    logits = torch.rand(1000)  # uniform [0, 1): the top 3 have comparable probabilities
    top3 = set(torch.topk(logits, 3).indices.tolist())
    params = SamplingParams(temperature=1.0, top_k=3)
    gen = make_generator(int(np.random.default_rng().integers(2**62)))
    drawn = {sample(logits, params, gen) for _ in range(2000)}
    assert drawn == top3


def test_small_top_p_keeps_only_the_top_token():
    logits = _random_logits(500)
    params = SamplingParams(temperature=5.0, top_p=1e-6)
    gen = make_generator(None)
    assert {sample(logits, params, gen) for _ in range(200)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize(("top_p", "kept"), [(0.45, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2})])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, kept):
    # Probabilities 0.5, 0.3, 0.2, ~0, ~0 placed on the ids ids[0], ..., ids[4].
    ids = np.random.default_rng().permutation(5)
    probs = np.empty(5)
    probs[ids] = [0.5, 0.3, 0.2, 1e-30, 1e-30]
    logits = torch.from_numpy(np.log(probs).astype(np.float32))
    params = SamplingParams(temperature=1.0, top_p=top_p)
    gen = make_generator(7)
    drawn = {sample(logits, params, gen) for _ in range(600)}
    assert drawn == {int(ids[i]) for i in kept}


def test_seed_reproducibility():
    logits = _random_logits(4096) / 3
    params = SamplingParams(temperature=1.0, top_p=0.95)
    seed = int(np.random.default_rng().integers(2**62))

    def draws(s):
        gen = make_generator(s)
        return [sample(logits, params, gen) for _ in range(50)]

    assert draws(seed) == draws(seed)
    assert draws(seed) != draws(seed + 1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8)]
)
def test_empirical_distribution_matches(temperature, top_k, top_p):
    """Pearson chi-square of 10,000 draws against the expected distribution.

    Fixed seeds make this deterministic; the bound (chi2 < 40 over at most 7 cells, p ~ 1e-6 for
    a correct sampler) still fails a sampler that skips the temperature, the renormalization
    or the top-p cut, each of which moves the statistic into the hundreds or more.
    """
    rng = np.random.default_rng(1234)
    logits = rng.standard_normal(8).astype(np.float32)
    expected = _expected(logits, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    gen = make_generator(99)
    n = 10_000
    counts = np.bincount(
        [sample(torch.from_numpy(logits), params, gen) for _ in range(n)], minlength=8
    )
    assert counts[expected == 0].sum() == 0
    cells = expected > 0
    chi2 = ((counts[cells] - n * expected[cells]) ** 2 / (n * expected[cells])).sum()
    assert chi2 < 40, (chi2, counts, expected)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.8)]
)
def test_probabilities_are_the_distribution_sampled(temperature, top_k, top_p):
    """probabilities() is the rule sample() draws by (the empirical test above checks sample()
    against the same independent _expected): equal within float32 rounding."""
    logits = _random_logits(17)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = _expected(logits.numpy(), temperature, top_k, top_p)
    np.testing.assert_allclose(probabilities(logits, params).numpy(), expected, atol=1e-6)


def test_greedy_probabilities_are_a_point_mass_on_the_lowest_argmax():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0])
    np.testing.assert_array_equal(probabilities(logits, SamplingParams()).numpy(), [0, 1, 0, 0])
    with pytest.raises(SamplingError, match="shape"):
        probabilities(torch.zeros(2, 3), SamplingParams())


def test_bad_logits_shape():
    with pytest.raises(SamplingError, match="shape"):
        sample(torch.zeros(2, 3), SamplingParams(), None)
    with pytest.raises(SamplingError, match="shape"):
        sample(torch.zeros(0), SamplingParams(temperature=1.0), None)


@pytest.mark.parametrize(
    ("temperature", "top_p", "greedy"),
    [
        (5e-324, 1.0, True),
        (1e-45, 1.0, True),
        (1e-40, 0.9, True),
        (1e-38, 1.0, True),
        (1e-6, 1.0, True),
        (MIN_TEMPERATURE, 1.0, False),
        (1.0, 0.0, True),
        (1.0, 1e-46, True),
        (1.0, 1e-45, True),
        (1.0, 1e-7, True),
        (1.0, MIN_TOP_P, False),
        (0.0, 0.5, True),
    ],
)
def test_degenerate_params_are_stored_greedy(temperature, top_p, greedy):
    params = SamplingParams(temperature=temperature, top_p=top_p)
    assert params.greedy == greedy
    if greedy:  # one form, so no backend ever sees the degenerate values
        assert (params.temperature, params.top_p) == (0.0, 1.0)
    else:
        assert (params.temperature, params.top_p) == (temperature, top_p)


@pytest.mark.parametrize("bad", [{"temperature": -1e-45}, {"top_p": -0.0001}, {"top_p": 1.01}])
def test_out_of_range_params_are_refused(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=MIN_TEMPERATURE),
        SamplingParams(temperature=1.0, top_p=MIN_TOP_P),
        SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P, top_k=7),
    ],
)
def test_sampler_at_the_edges_draws_the_top_token(params):
    # Logit gaps of up to 400: / 1e-5 stays finite in float32, and the top token takes all mass.
    logits = _random_logits(151_936) * 40
    gen = make_generator(3)
    assert {sample(logits, params, gen) for _ in range(20)} == {int(torch.argmax(logits))}
