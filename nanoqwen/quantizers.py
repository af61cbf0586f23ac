"""INT4 quantizers, all writing the one format of nanoqwen.quant (symmetric INT4, g128, fp16
scales, ValueShuffle). They differ only in which codes q (and scales) they pick.

    rtn   round to nearest against scale = fp16(max|w| / 7) (quant.quantize). Needs nothing but
          the weight; the fast default.
    gptq  GPTQ error feedback (Frantar et al. 2022) with the activations' Hessian H = X^T X of
          each projection's input, collected on calibration text by a sequential forward pass
          (nanoqwen.calibrate) that targets the float model's outputs, onto sign-aware scales
          (quant.signed_scales). Opt-in: it needs forward passes of the float and the quantized
          model (0.5B: ~25 min on one core; `device` takes it to a GPU).

Why error feedback and not a scale search: our sources are mostly Q4_K_M GGUFs, whose weights
already sit on Q4_K's grid (per-32 sub-block scales and minimums). Re-quantizing onto a g128
symmetric grid cannot land on that grid, so every group carries an irreducible rounding error of
about a quarter of a step; clipping the scale (a per-group MSE or activation-weighted search)
only trades that rounding error for clipping error (measured on the real 1.5B: a per-group MSE
search worse than RTN, an activation-weighted one barely better; inside GPTQ on the real 0.5B,
a diag(H)-weighted clip of each group's scale +10.5% against +8.4% unclipped, damp 0.1). GPTQ
instead pushes each column's rounding error onto the columns not yet quantized, weighted by
H^-1, so the errors cancel in the product W X that the model actually uses.

Choices of `gptq_quantize` (figures in docs/EXPERIMENTS.md, section Quantization):
- static group scales: every group's scale comes from the original weight before any update,
  so the format is unchanged and act-order may visit columns in any order. The rule is
  `signed`: the finest step that clips nothing, using -8 when the group's extreme is negative
  (the format allows it; RTN's max|w| / 7 never uses it);
- act-order: columns in decreasing diag(H) (the most active inputs first, while the most
  unquantized columns remain to absorb their error);
- damping: `damp` * mean(diag H) added to the diagonal, so H is positive definite even for inputs
  the calibration text never excites (dead inputs get H_ii = 1 and their weight is kept as RTN).
  It also bounds overfitting: a few thousand calibration tokens leave H of rank about their
  count of distinct tokens at the first layer, and GPTQ then hides the error in directions the
  calibration never excited but other text does (layer 0 of the 0.5B, 2048 tokens: weighted
  error 8% of RTN's on the calibration text, 49% on held-out text at damp 0.01, 34% at 0.1).
  Hence also calibrate.DEFAULT_CALIBRATION_TOKENS well above the widest K, and 0.3 measured
  best with them end to end.
"""

from __future__ import annotations

import numpy as np

from .config import GROUP_SIZE
from .quant import QMAX, QMIN, QuantError, rtn_scales, signed_scales

QUANTIZERS = ("rtn", "gptq")
DEFAULT_QUANTIZER = "rtn"
NEEDS_CALIBRATION = ("gptq",)
GPTQ_BLOCK = 128  # columns per lazy-batch update (the paper's B); any multiple of 1 is exact
GPTQ_DAMP = 0.3  # of mean(diag H), on H's diagonal: the best of 0.03..1 measured (EXPERIMENTS)
TRI_INV_LEAF = 256  # triangular inverses this small go to one triangular solve
SCALE_RULES = ("rtn", "signed")  # gptq_quantize's static group scales


def weighted_error(w: np.ndarray, wq: np.ndarray, hessian: np.ndarray) -> float:
    """tr((W - W') H (W - W')^T): the summed squared output error ||(W - W') X||^2 when
    H = X^T X. w, wq: float [N, K]; hessian: float [K, K]."""
    d = np.asarray(w, np.float64) - np.asarray(wq, np.float64)
    return float(np.einsum("nk,kj,nj->", d, np.asarray(hessian, np.float64), d))


def _triangular_inverse(lower):
    """Inverse of a lower-triangular matrix by 2x2 block recursion: all but the small diagonal
    blocks are matmuls, 2.7x faster on one core than one triangular solve against I (K=8960)."""
    import torch

    k = lower.shape[0]
    if k <= TRI_INV_LEAF:
        eye = torch.eye(k, dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower, eye, upper=False)
    m = k // 2
    a_inv, d_inv = _triangular_inverse(lower[:m, :m]), _triangular_inverse(lower[m:, m:])
    out = torch.zeros_like(lower)
    out[:m, :m], out[m:, m:] = a_inv, d_inv
    out[m:, :m] = -(d_inv @ (lower[m:, :m] @ a_inv))
    return out


def _inverse_cholesky(h):
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U; row i of U holds the weights that
    spread column i's error over the later columns), from one Cholesky of H.

    With J the order reversal and J H J = L L^T: H^-1 = J L^-T L^-1 J = U^T U, U = J L^-1 J
    (upper triangular, positive diagonal). One factorization and one triangular inverse instead
    of the usual cholesky -> cholesky_inverse -> cholesky: 13 s against 27 s at K = 8960."""
    import torch

    lower = torch.linalg.cholesky(h.flip(0, 1))
    return _triangular_inverse(lower).flip(0, 1)


def gptq_quantize(
    w: np.ndarray,
    hessian,
    name: str = "weight",
    act_order: bool = True,
    damp: float = GPTQ_DAMP,
    scales: str = "signed",
    device="cpu",
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ-quantize one projection onto static group scales.

    w: float [N, K], K % 128 == 0; hessian: float [K, K] (numpy or torch, any device),
    symmetric positive semi-definite (X^T X of the projection's input, any positive scale).
    scales (SCALE_RULES): rtn = quant.quantize's max|w| / 7; signed = quant.signed_scales.
    Returns (q: int8 [N, K] in
    [-8, 7], scales: float16 [N, K/128]) as quant.quantize does. Runs in float32 on torch
    `device`; deterministic on a given device (no randomness, no atomics).
    """
    import torch  # here, not at the top: `nanoqwen pack --help` must not pay torch's import

    if scales not in SCALE_RULES:
        raise QuantError(f"{name}: scale rule {scales!r} is not one of {SCALE_RULES}")
    # Either rule validates shape, finiteness and the fp16 range.
    base = rtn_scales(w, name) if scales == "rtn" else signed_scales(w, name)
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise QuantError(f"{name}: Hessian shape {tuple(hessian.shape)}, expected {(k, k)}")
    W = torch.tensor(np.asarray(w, dtype=np.float32), device=device)
    H = torch.as_tensor(hessian, dtype=torch.float32, device=device).clone()
    dead = torch.diag(H) <= 0
    H[dead, dead] = 1.0
    s = torch.from_numpy(base.astype(np.float32)).to(device)
    s = s.repeat_interleave(GROUP_SIZE, dim=1)  # [N, K]
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else None
    if perm is not None:
        W, H, s = W[:, perm], H[perm][:, perm], s[:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype, device=device)
    U = _inverse_cholesky(H)
    inv_s = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    Q = torch.zeros_like(W)
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, k)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = W1[:, i]
            q = torch.clamp(torch.round(col * inv_s[:, i1 + i]), QMIN, QMAX)
            Q[:, i1 + i] = q
            err = (col - q * s[:, i1 + i]) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Q.cpu().numpy().astype(np.int8), base


def check_device(device: str) -> None:
    """A ConvertError unless torch can run a calibration on `device` ("cpu", "cuda",
    "cuda:1"): checked before the pack starts, not at the first projection."""
    import torch

    from .errors import ConvertError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConvertError(f"--device {device!r}: not a torch device ({e})") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ConvertError(f"--device {device}: torch has no such device here (cpu, cuda)")
    if (dev.index or 0) >= torch.cuda.device_count():
        raise ConvertError(f"--device {device}: {torch.cuda.device_count()} CUDA device(s) here")


def projection_quantizer(
    name: str, config, tokenizer_spec, get, where: str, device: str = "cpu"
):  # fmt: skip
    """The `quantize(logical, array, label) -> (qweight, scales)` of convert_stream for
    quantizer `name`. get(logical) -> float32 source tensor (gptq reads the model through it).

    gptq runs its calibration pass (nanoqwen.calibrate) at the first projection, on the torch
    `device` (a GPU: the 1.5B in about a minute and a half instead of most of an hour on the
    CPU; float32 sums in another order, so not bit-identical codes), holding only the packed
    results; it needs the source's tokenizer for the calibration text."""
    from .convert.names import rtn
    from .errors import ConvertError
    from .quant import pack_value_shuffle

    if name not in QUANTIZERS:
        raise ConvertError(f"unknown quantizer {name!r}; choose one of {', '.join(QUANTIZERS)}")
    if name == "rtn":
        return rtn
    if tokenizer_spec is None:
        raise ConvertError(f"{where}: --quantizer {name} needs the source's tokenizer")
    check_device(device)
    table: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def quantize_gptq(logical: str, array: np.ndarray, label: str):
        from . import calibrate
        from .tokenizer import Tokenizer

        if not table:
            windows = calibrate.calibration_windows(Tokenizer.from_spec(tokenizer_spec))
            table.update(calibrate.quantize_model(config, get, windows, device=device))
        q, scales = table.pop(logical)
        return pack_value_shuffle(q), scales

    return quantize_gptq
