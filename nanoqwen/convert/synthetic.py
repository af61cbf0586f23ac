"""Random weights with exactly a preset's shapes, seeded and deterministic.

Projections are generated directly as INT4 codes and fp16 scales (statistically a quantized
random weight), not as float weights run through the quantizer: the quantizer costs minutes on
a 7B on two cores, random codes cost seconds. Codes take -7..7 once and 0 twice out of 16
(mean 0, std sqrt(17.5)); each group's fp16 scale is `gain / sqrt(K) / sqrt(17.5)` times
U(0.75, 1.25), so a projection maps an input of rms 1 to an output of rms about `gain`.

Random weights are only useful for correctness work if fp16 activations (the engine) and the
float32 reference cannot part for numerical reasons, and if every token comparison is
meaningful. Three choices get there (tests/test_convert_synthetic.py holds the float32 forward
that measured them, with fp16 rounding at every kernel boundary as an option):
  * Not chaotic. o_proj / down_proj have gain BRANCH_GAIN / sqrt(2 * layers): every block is
    a small step, the summed branches have rms ~BRANCH_RMS whatever the depth, and a
    perturbation is not amplified block after block (a gain of 1 lets the residual grow as
    sqrt(layers), each block rewriting it). q_proj / k_proj have gain QK_GAIN = 1
    (attention scores of std ~1); near-argmax softmax (gain 2, std ~4) turns score noise into
    a different winning key. With depth-scaled branches the QK gain matters less (tiny widths,
    12 layers, fp16 max|dlogit|/std: 0.007 at gain 1, 0.010 at 2, 0.017 at 3); 1 keeps margin.
  * A clear top-1: a next-token pointer. The input token's embedding stays in the residual
    stream with the share rho = POINTER / sqrt(H) of its rms (that sets embed_std), and the
    head row aligned with it scores ~POINTER logit stds above the mean. Everything else in
    the logits, nearly all of their variance, is what attention and MLP wrote: iid-like values
    whose max over 152k tokens is only ~5 std and whose top-2 gap is tiny (~0.2 std median,
    ~0.002 at p1: that is why iid rows cannot give clear margins). So top-1 is the pointed-to
    token at a margin of several std, and dropping one attention or MLP branch still moves the
    logits by over 1 std (a broken kernel shows far beyond any fp16 tolerance).
      - untied (7b and up): lm_head[perm[t]] = embed_tokens[t], perm a random permutation, so
        greedy text walks perm's long cycles.
      - tied (3b and down): a symmetric score E diag(g) E^T cannot point along a cycle, so
        tokens come in partner pairs t, t ^ 1 (`embed_rows`): greedy text alternates t, t ^ 1.
  * final_norm (~LOGIT_STD / (embed_std sqrt(H))) sets the logit std to about LOGIT_STD.
Measured (teacher-forced random ids, seed 0, 256 positions; tests/test_convert_synthetic.py's
forward): fp16 = every activation rounded to fp16 at the engine's kernel boundaries, against
float32:

    model                fp16: top-1  max|dl|/std  p99    margin/std: p1  p5    median
    1.5b, 28 layers            100%   0.012        0.011  4.7    5.9   8.8
    7b widths, 8 layers        100%   0.0076       0.0075 4.7    6.0   8.5
    7b, 28 layers              100%   0.011        0.011  4.1    5.8   7.9

fp16 max|dl|/std grows ~+0.0017 per doubling of depth (1.5b widths: 0.0068 at 4 layers,
0.0118 at 28). Distinct top-1 tokens: 255 of 256 (1.5b), 128 of 128 (7b), each the input's
pointer. Dropping the middle layer's attention (MLP) moves the logits by up to 1.48 (1.06) std
at 1.5b, 28 layers, and 1.60 (1.01) std at 7b: far beyond any fp16 tolerance.
Packing the 7B takes 54 s at 1.4 GB peak RSS on two cores.

Each tensor has its own generator seeded by (seed, crc32(name)), so the order of generation
does not matter and the same seed gives identical bytes.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np

from ..config import GROUP_SIZE, ModelConfig

QK_GAIN = 1.0  # rms gain of q_proj / k_proj: sets how sharp attention is
BRANCH_GAIN = 1.0  # o_proj / down_proj gain is BRANCH_GAIN / sqrt(2 * num_layers)
POINTER = 13.0  # the next-token pointer logit, in logit stds (see the module docstring)
BRANCH_RMS = 0.65  # rms of the summed branch outputs (measured: 0.6 tiny, 0.65 1.5b)
LOGIT_STD = 2.0  # target std of a logit for a typical row
NORM_JITTER = 0.1  # RMSNorm weights: 1 + N(0, 0.1^2)
BIAS_STD = 0.1
_CODES = np.array([-7, -6, -5, -4, -3, -2, -1, 0, 0, 1, 2, 3, 4, 5, 6, 7], dtype=np.int32)
CODE_STD = float(np.sqrt(np.mean(_CODES.astype(np.float64) ** 2)))  # sqrt(17.5)
_LOW3 = np.uint64(0x7777_7777_7777_7777)  # the three low bits of every nibble
_CHUNK_ROWS = 8192  # rows of an fp16 matrix generated at once (bounds float32 scratch)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_qweight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """uint32 [N, K/8] ValueShuffle words whose 8 nibbles are iid codes from `_CODES`.

    Random 64-bit words give 16 uniform two's-complement nibbles in [-8, 7]; each -8 (0b1000)
    becomes 0, which yields exactly the `_CODES` law (0 twice as likely, -7..7 once). Nibbles
    are iid, so their position inside a word (the layout) does not change the law. In place:
    u = w & 0x7..7; u += 0x7..7 sets bit 3 of a nibble iff its low bits are nonzero; w &= u | 0x7..7
    clears bit 3 only of nibbles 0b1000.
    """
    words = rng.bit_generator.random_raw(n * k // 16)  # uint64, 16 nibbles each
    low = words & _LOW3
    low += _LOW3
    low |= _LOW3
    words &= low
    return words.view(np.uint32).reshape(n, k // 8)


def random_scales(rng: np.random.Generator, n: int, k: int, gain: float) -> np.ndarray:
    """float16 [N, K/128]: per-group scales giving the projection an rms gain of `gain`."""
    base = gain / np.sqrt(k) / CODE_STD
    return (base * rng.uniform(0.75, 1.25, size=(n, k // GROUP_SIZE))).astype(np.float16)


def embed_std(config: ModelConfig) -> float:
    """Entry std of embed_tokens: the share rho = POINTER / sqrt(H) of the final residual's
    rms, next to branches of rms BRANCH_RMS. rho is capped at 0.9, so at tiny widths (H = 128)
    the pointer is ~10 logit stds instead of POINTER."""
    rho = min(POINTER / np.sqrt(config.hidden_size), 0.9)
    return float(BRANCH_RMS * rho / np.sqrt(1.0 - rho * rho))


def _embed_blocks(config: ModelConfig, seed: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 block) of embed_tokens, _CHUNK_ROWS rows at a time (see
    `embed_rows`): the float32 scratch stays ~50 MB whatever the vocabulary."""
    rng = _rng(seed, "embed_tokens")
    v, h = config.vocab_size, config.hidden_size
    std = np.float32(embed_std(config))
    for start in range(0, v, _CHUNK_ROWS):  # _CHUNK_ROWS is even: pairs never straddle
        block = rng.standard_normal((min(v, start + _CHUNK_ROWS) - start, h), dtype=np.float32)
        block *= std
        if config.tie_word_embeddings:
            even, odd = block[0::2], block[1::2]
            odd[:, : h // 2] = even[: len(odd), : h // 2]
            odd[:, h // 2 :] = -even[: len(odd), h // 2 :]
        yield start, block


def embed_rows(config: ModelConfig, seed: int) -> np.ndarray:
    """float16 [V, H] embed_tokens: iid N(0, embed_std^2) rows; tied, in partner pairs.

    Tied (the logits read embed_tokens): row 2m+1 is row 2m with its second half negated, and
    final_norm is negative on that half, so token t scores its partner t ^ 1 at
    +|row|^2 and itself at |first half|^2 - |second half|^2 ~ 0."""
    out = np.empty((config.vocab_size, config.hidden_size), dtype=np.float16)
    for start, block in _embed_blocks(config, seed):
        out[start : start + len(block)] = block
    return out


def head_rows(config: ModelConfig, seed: int) -> np.ndarray:
    """float16 [V, H] lm_head (untied): lm_head[perm[t]] = embed_tokens[t], so token t scores
    perm[t] at +|row|^2; perm is a random permutation, whose long cycles keep greedy text
    from repeating soon."""
    perm = next_token_permutation(config, seed)
    out = np.empty((config.vocab_size, config.hidden_size), dtype=np.float16)
    for start, block in _embed_blocks(config, seed):
        out[perm[start : start + len(block)]] = block
    return out


def next_token_permutation(config: ModelConfig, seed: int) -> np.ndarray:
    """int64 [V]: the token each input token points to (its top-1 without context)."""
    if config.tie_word_embeddings:
        return np.arange(config.vocab_size) ^ 1  # preset vocabularies are even
    return _rng(seed, "lm_head").permutation(config.vocab_size)


def final_norm_scale(config: ModelConfig) -> float:
    """The final_norm weight that gives a typical logit the std LOGIT_STD."""
    return LOGIT_STD / (embed_std(config) * np.sqrt(config.hidden_size))


def projection_gain(config: ModelConfig, proj: str) -> float:
    """rms gain of one INT4 projection (module docstring: soft attention, small branches)."""
    if proj in ("q_proj", "k_proj"):
        return QK_GAIN
    if proj in ("o_proj", "down_proj"):
        return BRANCH_GAIN / np.sqrt(2 * config.num_layers)
    return 1.0


def synthetic_tensor(config: ModelConfig, name: str, seed: int) -> np.ndarray:
    """The stored tensor `name` of `config.tensor_shapes()`, with its dtype and shape."""
    _, shape = config.tensor_shapes()[name]
    return _generate(config, name, shape, seed)


def _generate(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = _rng(seed, name)
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed_tokens":
        return embed_rows(config, seed)
    if name == "lm_head":
        return head_rows(config, seed)
    if leaf == "qweight":
        return random_qweight(rng, shape[0], shape[1] * 8)
    if leaf == "scales":
        gain = projection_gain(config, name.rsplit(".", 2)[-2])
        return random_scales(rng, shape[0], shape[1] * GROUP_SIZE, gain)
    if leaf == "bias":
        return (BIAS_STD * rng.standard_normal(shape)).astype(np.float16)
    weight = 1.0 + NORM_JITTER * rng.standard_normal(shape)
    if name == "final_norm":
        weight *= final_norm_scale(config)
        if config.tie_word_embeddings:
            weight[shape[0] // 2 :] *= -1.0
    return weight.astype(np.float16)


def synthetic_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Every stored tensor of `config`, in file order, generated one at a time."""
    for name, (_, shape) in config.tensor_shapes().items():
        yield name, _generate(config, name, shape, seed)
