"""The INT4 quantizers (nanoqwen.quantizers) and the GPTQ calibration pass (nanoqwen.calibrate):
GPTQ's activation-weighted error never above round-to-nearest's, RTN's scales and format kept,
codes in [-8, 7], deterministic; `pack --quantizer gptq` end to end on a small HF checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_convert import CFG, grid_weights, write_hf

from nanoqwen import calibrate
from nanoqwen.calibrate import WINDOW, _float_target, calibration_windows, quantize_model
from nanoqwen.config import PROJECTIONS
from nanoqwen.convert.hf import read_hf
from nanoqwen.errors import ConvertError
from nanoqwen.quant import (
    QMAX,
    QMIN,
    QuantError,
    dequantize,
    quantize,
    quantize_onto,
    signed_scales,
    unpack_value_shuffle,
)
from nanoqwen.quantizers import (
    _inverse_cholesky,
    check_device,
    gptq_quantize,
    projection_quantizer,
    weighted_error,
)


def correlated_inputs(rng, tokens: int, k: int) -> np.ndarray:
    """Activations with correlated features and a few outlier channels, like an LLM's."""
    x = rng.standard_normal((tokens, k)) @ rng.standard_normal((k, k)) * 0.2
    x += rng.standard_normal((tokens, k))
    x[:, rng.choice(k, 4, replace=False)] *= 8
    return x


@pytest.mark.parametrize("n, k, act_order", [(16, 128, True), (33, 384, True), (8, 256, False)])
def test_gptq_beats_rtn_and_keeps_the_format(n, k, act_order):
    rng = np.random.default_rng(n * k)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    x = correlated_inputs(rng, 4 * k, k)
    h = x.T @ x
    q_rtn, s_rtn = quantize(w)
    q, s = gptq_quantize(w, h, act_order=act_order)
    assert q.dtype == np.int8 and q.shape == (n, k)
    assert s.dtype == np.float16 and s.shape == (n, k // 128)
    assert QMIN <= q.min() and q.max() <= QMAX
    np.testing.assert_array_equal(s, signed_scales(w))  # static: the original weight's
    rtn_err = weighted_error(w, dequantize(q_rtn, s_rtn), h)
    assert weighted_error(w, dequantize(q, s), h) <= 0.8 * rtn_err
    q2, s2 = gptq_quantize(w, h, act_order=act_order)
    np.testing.assert_array_equal(q2, q)  # deterministic
    np.testing.assert_array_equal(s2, s)


@pytest.mark.parametrize("rule", ["rtn", "signed"])
def test_gptq_scale_rules(rule):
    rng = np.random.default_rng(11)
    w = rng.standard_normal((12, 256)).astype(np.float32)
    x = correlated_inputs(rng, 1024, 256)
    h = x.T @ x
    q, s = gptq_quantize(w, h, scales=rule)
    want = quantize(w)[1] if rule == "rtn" else signed_scales(w)
    np.testing.assert_array_equal(s, want)
    assert QMIN <= q.min() and q.max() <= QMAX
    rtn_err = weighted_error(w, dequantize(*quantize(w)), h)
    assert weighted_error(w, dequantize(q, s), h) <= 0.8 * rtn_err
    with pytest.raises(QuantError, match="scale rule"):
        gptq_quantize(w, h, scales="mse")


def test_gptq_identity_hessian_is_rtn():
    # With uncorrelated unit inputs no column's error can be compensated: GPTQ rounds as RTN.
    w = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    q, s = gptq_quantize(w, np.eye(256), damp=0.0, scales="rtn")
    np.testing.assert_array_equal(q, quantize(w)[0])
    q, s = gptq_quantize(w, np.eye(256), damp=0.0)
    np.testing.assert_array_equal(q, quantize_onto(w, signed_scales(w)))


def test_gptq_dead_inputs_and_zero_groups():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    w[1, :128] = 0.0  # an all-zero group: scale 0, codes 0
    x = correlated_inputs(rng, 512, 256)
    x[:, 10:20] = 0.0  # inputs the calibration text never excites
    q, s = gptq_quantize(w, x.T @ x)
    assert s[1, 0] == 0 and not q[1, :128].any()
    assert np.isfinite(dequantize(q, s)).all()


def test_gptq_rejects_bad_input():
    with pytest.raises(QuantError, match="Hessian shape"):
        gptq_quantize(np.zeros((2, 128), np.float32), np.eye(64))
    with pytest.raises(QuantError, match="multiple of the group size"):
        gptq_quantize(np.zeros((2, 100), np.float32), np.eye(100))


def test_inverse_cholesky():
    rng = np.random.default_rng(7)
    a = torch.from_numpy(rng.standard_normal((700, 700)))
    h = a @ a.T + torch.eye(700, dtype=a.dtype)
    want = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    torch.testing.assert_close(_inverse_cholesky(h), want)


def test_quantize_model_shapes_and_determinism():
    weights = grid_weights(CFG, seed=2)
    windows = np.random.default_rng(8).integers(0, CFG.vocab_size, (2, 64))
    first = quantize_model(CFG, weights.__getitem__, windows, progress=False)
    again = quantize_model(CFG, weights.__getitem__, windows, progress=False)
    names = {f"layers.{i}.{p}" for i in range(CFG.num_layers) for p in PROJECTIONS}
    assert set(first) == names
    for name, (q, s) in first.items():
        n, k = CFG.projection_shape(name.rsplit(".", 1)[1])
        assert q.shape == (n, k) and q.dtype == np.int8 and s.shape == (n, k // 128)
        assert QMIN <= q.min() and q.max() <= QMAX
        np.testing.assert_array_equal(again[name][0], q)


def test_quantize_model_device():
    """device='cpu' (string or torch.device, numpy or torch Hessian) gives the same codes; on a
    GPU, where float32 sums run in another order, nearly all codes agree with the CPU's."""
    weights = grid_weights(CFG, seed=4)
    windows = np.random.default_rng(9).integers(0, CFG.vocab_size, (2, 64))
    cpu = quantize_model(CFG, weights.__getitem__, windows, progress=False)
    same = quantize_model(CFG, weights.__getitem__, windows, False, torch.device("cpu"))
    for name, (q, s) in cpu.items():
        np.testing.assert_array_equal(same[name][0], q)
        np.testing.assert_array_equal(same[name][1], s)
    rng = np.random.default_rng(12)
    w, x = rng.standard_normal((8, 256)).astype(np.float32), correlated_inputs(rng, 512, 256)
    h = (x.T @ x).astype(np.float32)
    q_np = gptq_quantize(w, h)[0]
    np.testing.assert_array_equal(gptq_quantize(w, torch.from_numpy(h), device="cpu")[0], q_np)
    if torch.cuda.is_available():
        gpu = quantize_model(CFG, weights.__getitem__, windows, False, "cuda")
        agree = np.mean([(gpu[n][0] == q).mean() for n, (q, _) in cpu.items()])
        assert agree > 0.98


def test_projection_quantizer_choices():
    with pytest.raises(ConvertError, match="unknown quantizer 'awq'"):
        projection_quantizer("awq", CFG, None, None, "x")
    with pytest.raises(ConvertError, match="needs the source's tokenizer"):
        projection_quantizer("gptq", CFG, None, None, "x")


def test_check_device():
    """`pack --device`: cpu passes; what torch cannot run here fails before the pack starts."""
    check_device("cpu")
    with pytest.raises(ConvertError, match="not a torch device"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConvertError, match="no such device here"):
            check_device("cuda")
    else:
        with pytest.raises(ConvertError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(ConvertError, match="no such device here"):
        check_device("meta")
    with pytest.raises(ConvertError, match="not a torch device"):
        projection_quantizer("gptq", CFG, {"kind": "any"}, None, "x", device="gpu0")


def test_pack_device_needs_a_calibrated_quantizer(tmp_path, capsys):
    """`--device` with rtn or --synthetic is refused (it would be silently ignored)."""
    from nanoqwen.cli import main

    out = str(tmp_path / "t.nanoqwen")
    assert main(["pack", str(tmp_path), "-o", out, "--device", "cuda"]) != 0
    assert "--device applies to a calibrated quantizer" in capsys.readouterr().err
    assert main(["pack", "--synthetic", "tiny", "-o", out, "--device", "cuda"]) != 0
    assert "rtn only (no --device)" in capsys.readouterr().err


def test_read_hf_gptq(tmp_path):
    """`pack --quantizer gptq` through the HF reader: same stored names and dtypes as rtn,
    finite scales (signed ones of the float target's weight) and codes differing from rtn's
    somewhere; calibration windows of real stdlib text."""
    weights = grid_weights(CFG, seed=3)
    directory = write_hf(tmp_path / "hf", CFG, weights, tokenizer=True)
    rtn = dict(read_hf(directory)[2])
    gptq = dict(read_hf(directory, quantizer="gptq")[2])
    assert sorted(rtn) == sorted(gptq)
    differ = 0
    for name, array in rtn.items():
        assert gptq[name].dtype == array.dtype and gptq[name].shape == array.shape
        if name.endswith(".scales"):
            assert np.isfinite(gptq[name]).all() and (gptq[name] != array).any()
        elif name.endswith(".qweight"):
            differ += int((unpack_value_shuffle(gptq[name]) != unpack_value_shuffle(array)).any())
    assert differ > 0
    assert WINDOW % 16 == 0


def test_float_target_is_the_least_squares_fit():
    """_float_target without damping: x V^T is the least-squares fit of xf w^T (numpy lstsq);
    with x = xf it is w; with damping the correction shrinks towards w."""
    rng = np.random.default_rng()
    n, k, t = 5, 48, 300
    w = rng.standard_normal((n, k))
    x = correlated_inputs(rng, t, k)
    xf = x + 0.1 * rng.standard_normal((t, k))
    w, x, xf = (torch.from_numpy(a) for a in (w, x, xf))
    h = x.T @ x
    got = _float_target(w, x, xf, h, 0.0).numpy()
    want = np.linalg.lstsq(x.numpy(), (xf @ w.T).numpy(), rcond=None)[0].T
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(_float_target(w, x, x, h, 0.3).numpy(), w.numpy())
    w = w.numpy()
    damped = _float_target(torch.from_numpy(w), x, xf, h, 0.3).numpy()
    assert 0 < np.abs(damped - w).sum() < np.abs(got - w).sum()


def test_quantize_model_float_target():
    """float_target (the default) against float_target=False: layer 0's q/k/v see the same
    input in both models and are unchanged; every later projection moves; deterministic."""
    weights = grid_weights(CFG, seed=2)
    windows = np.random.default_rng(8).integers(0, CFG.vocab_size, (2, 64))
    plain = quantize_model(CFG, weights.__getitem__, windows, False, float_target=False)
    first = quantize_model(CFG, weights.__getitem__, windows, progress=False)
    again = quantize_model(CFG, weights.__getitem__, windows, progress=False)
    for name, (q, s) in first.items():
        np.testing.assert_array_equal(again[name][0], q)
        np.testing.assert_array_equal(again[name][1], s)
        same = name.startswith("layers.0.") and name[9:] in ("q_proj", "k_proj", "v_proj")
        assert same == (np.array_equal(plain[name][0], q) and np.array_equal(plain[name][1], s))


def test_calibration_windows_take_every_file_before_a_second_window(monkeypatch):
    """Window j of every file long enough, then window j + 1: three files of 2.5, 1 and 2
    windows give their openings, then the first and the third file's second windows; asking
    for more than the text holds is a ConvertError naming the count."""
    lengths = {"a": 5 * WINDOW // 2, "b": WINDOW, "c": 2 * WINDOW}
    texts = {f: [ord(f) * 10000 + i for i in range(n)] for f, n in lengths.items()}
    monkeypatch.setattr(calibrate, "CALIBRATION_FILES", tuple(texts))
    monkeypatch.setattr(calibrate, "stdlib_token_ids", lambda _tok, files, _n: iter(
        texts[f] for f in files))  # fmt: skip
    w = calibration_windows(None, 5 * WINDOW)
    assert w.shape == (5, WINDOW) and w.dtype == np.int64
    starts = [(chr(int(row[0]) // 10000), int(row[0]) % 10000) for row in w]
    assert starts == [("a", 0), ("b", 0), ("c", 0), ("a", WINDOW), ("c", WINDOW)]
    assert all((np.diff(row) == 1).all() for row in w)  # consecutive tokens of one file
    with pytest.raises(ConvertError, match="found 5 of 6"):
        calibration_windows(None, 6 * WINDOW)
