"""Sampling parameters (validated once) and the host-side sampler used by the reference backend.

Semantics shared by every backend: temperature 0 is greedy (argmax, lowest id on ties);
otherwise logits / temperature, then top-k (0 = off), then top-p (nucleus, 1.0 = off) over the
tokens sorted by probability, then one draw from a generator seeded by `seed` (None = random).

Degenerate values have one rule, applied here when the parameters are made, so no backend ever
sees them: a temperature below MIN_TEMPERATURE is greedy (as vLLM does), and so is a top_p
below MIN_TOP_P (it keeps only the most probable token); both are stored as temperature 0,
top_p 1. The samplers divide by the temperature (the device in float32): from 1e-5 on,
1 / temperature and the scaled logit gaps stay finite, where a temperature of 1e-40 would turn
them into inf and the probabilities into NaN; and a top_p below float32's smallest value would
compare as 0 and keep no token at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import NanoqwenError

if TYPE_CHECKING:
    import torch


MIN_TEMPERATURE = 1e-5  # below: greedy (vLLM's _SAMPLING_EPS)
# Below: greedy. The top token has probability >= 1 / vocab (> 1e-6 for any vocabulary under a
# million tokens), so such a top_p keeps only it anyway.
MIN_TOP_P = 1e-6


class SamplingError(NanoqwenError, ValueError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature in [0, 100], top_k >= 0 (0 = off), top_p in [0, 1] (0 = the top token only),
    seed in [0, 2**63) or None, max_tokens >= 1, stop strings. Degenerate temperature / top_p
    are made greedy (module docstring): read `temperature` and `top_p` back, not the inputs."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 <= self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.temperature < MIN_TEMPERATURE or self.top_p < MIN_TOP_P:
            object.__setattr__(self, "temperature", 0.0)
            object.__setattr__(self, "top_p", 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# The host sampler. torch is imported inside the functions: it is an optional dependency (the
# `reference` extra), and this module is imported by every backend through SamplingParams.


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU torch.Generator seeded by `seed`; None draws a fresh random seed."""
    import torch

    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _kept(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, ids) of the tokens a non-greedy draw can return, most probable first: the
    softmax of logits / temperature sorted (stable, so equal probabilities keep id order), cut
    to the top_k, renormalized, cut to the smallest prefix whose cumulative probability reaches
    top_p (the top token is always kept). After the top-p cut `probs` sums to <= 1: a draw
    renormalizes."""
    import torch

    probs = torch.softmax(logits.float() / params.temperature, dim=0)
    probs, ids = torch.sort(probs, descending=True, stable=True)
    if params.top_k:
        probs, ids = probs[: params.top_k], ids[: params.top_k]
    probs = probs / probs.sum()
    if params.top_p < 1.0:
        # Keep token i while the mass strictly before it is < top_p: the smallest prefix with
        # cumulative probability >= top_p. Token 0 has 0 before it, so it is always kept.
        before = torch.cumsum(probs, dim=0) - probs
        keep = int((before < params.top_p).sum())
        probs, ids = probs[:keep], ids[:keep]
    return probs, ids


def _check_logits(logits: torch.Tensor, caller: str) -> None:
    if logits.ndim != 1 or logits.numel() == 0:
        raise SamplingError(f"{caller}: expected logits of shape [V], got {tuple(logits.shape)}")


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """One token id from `logits` (float32 [V], CPU) under `params` (module docstring).

    Greedy is argmax, lowest id on ties. Otherwise one token is drawn with `generator` from
    the tokens `_kept` leaves (temperature, top-k, top-p): the distribution `probabilities`
    returns.
    """
    import torch

    _check_logits(logits, "sample")
    if params.greedy:
        return int(torch.argmax(logits))  # first maximal index: lowest id on ties
    probs, ids = _kept(logits, params)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(ids[choice])


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, float32 [V] summing to 1: for greedy a point mass
    on the argmax (lowest id on ties), otherwise the `_kept` tokens' probabilities
    renormalized, 0 elsewhere. Speculative acceptance (nanoqwen.speculative) compares draft
    tokens against it."""
    import torch

    _check_logits(logits, "probabilities")
    out = torch.zeros(logits.shape[0], dtype=torch.float32)
    if params.greedy:
        out[int(torch.argmax(logits))] = 1.0
        return out
    probs, ids = _kept(logits, params)
    out[ids] = probs / probs.sum()
    return out
