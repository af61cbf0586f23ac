"""Prefill kernels on the CPU: they compile with NVRTC for sm_90a (7b, 1.5b and tiny) through
nanoqwen.cuda.jit, use tensor cores and spill nothing; and the GEMM's register dequantization
and K permutation, emulated in numpy lane by lane, reproduce A @ dequant(W)^T."""

import numpy as np
import pytest

from nanoqwen.config import preset
from nanoqwen.prefill import (
    ATTENTION_SOURCE,
    GEMM_SOURCE,
    GEMM_VARIANTS,
    attention_smem_bytes,
    prefill_kernels,
)
from nanoqwen.quant import dequantize_packed, pack_value_shuffle, quantize_pack

pytest.importorskip("cuda.bindings.nvrtc")
jit = pytest.importorskip("nanoqwen.cuda.jit")

SMEM_LIMIT = 227 * 1024  # Hopper: largest dynamic shared memory one CTA may opt into


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOQWEN_NO_COMPILE", raising=False)


def _ptx(source_name: str, names: list[str], cfg) -> str:
    """The PTX of a module, through jit's NANOQWEN_DUMP_PTX switch."""
    import os

    os.environ["NANOQWEN_DUMP_PTX"] = names[0]
    try:
        jit.compile_module(source_name, names, cfg)
    finally:
        del os.environ["NANOQWEN_DUMP_PTX"]
    (path,) = jit.cache_dir().glob(f"{source_name.split('.')[0]}-*.ptx")
    return path.read_text(errors="replace")


@pytest.mark.parametrize("name", ["7b", "1.5b", "tiny"])
def test_prefill_kernels_compile_without_spills(name):
    cfg = preset(name)
    for source, names in prefill_kernels(cfg).items():
        res = jit.compile_module(source, names, cfg).resources()
        assert set(res) == set(names), f"{source}: ptxas reported {sorted(res)}"
        for kernel, r in res.items():
            assert r.spill_bytes == 0 and r.stack_bytes == 0, f"{kernel} uses local memory: {r}"
            assert r.registers <= 255, f"{kernel}: {r.registers} registers"
    assert all(v.smem_bytes <= SMEM_LIMIT for v in GEMM_VARIANTS)
    assert attention_smem_bytes(cfg.head_dim) <= SMEM_LIMIT


def test_kernels_use_tensor_cores():
    cfg = preset("tiny")
    table = prefill_kernels(cfg)
    gemm = _ptx(GEMM_SOURCE, table[GEMM_SOURCE], cfg)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in gemm
    assert "cp.async.cg.shared.global" in gemm
    attn = _ptx(ATTENTION_SOURCE, table[ATTENTION_SOURCE], cfg)
    assert "mma.sync.aligned.m16n8k16" in attn and "ldmatrix" in attn


# -- numpy emulation of prefill_gemm.cu's fragment assembly ----------------------------------
def _halves(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)


def _word(lo, hi) -> int:
    h = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint32)
    return int(h[0] | (h[1] << 16))


def _op(a, b, c=None, kind="mul"):
    x, y = _halves(a).astype(np.float32), _halves(b).astype(np.float32)
    r = {"mul": x * y, "sub": x - y, "fma": x * y + (0 if c is None else _halves(c))}[kind]
    return _word(*r.astype(np.float16))  # one fp16 rounding, as the f16x2 instructions


def _dequant_word(w: int, scale2: int) -> list[int]:
    """prefill_gemm.cu dequant_word: magic-number int4 -> fp16 pairs, times the scale."""
    p0, p1 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    w >>= 8
    p2, p3 = (w & 0x000F000F) ^ 0x64086408, (w & 0x00F000F0) ^ 0x64806480
    lo = [_op(p, 0x64086408, kind="sub") for p in (p0, p2)]
    hi = [_op(p, 0x2C002C00, 0xD480D480, kind="fma") for p in (p1, p3)]
    return [_op(x, scale2) for x in (lo[0], hi[0], lo[1], hi[1])]


def test_gemm_fragment_emulation_matches_matmul():
    rng = np.random.default_rng()
    m, n, k = 16, 8, 128  # one m16n8 mma tile over one 128-wide k-tile
    a = rng.standard_normal((m, k)).astype(np.float16)
    qweight, scales = quantize_pack(rng.standard_normal((n, k)).astype(np.float32))
    w16 = dequantize_packed(qweight, scales).astype(np.float16)  # the kernel rounds here too
    a_bits = a.view(np.uint16).astype(np.uint32)
    c = np.zeros((m, n), np.float32)
    for w in range(4):  # word w of each lane's 16-byte chunk
        for q in range(2):  # mma k-step within the word
            la, lb = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                cols = [32 * t + 8 * w + 2 * e for e in range(4)]
                lo = [int(a_bits[g, x] | (a_bits[g, x + 1] << 16)) for x in cols]
                hi = [int(a_bits[g + 8, x] | (a_bits[g + 8, x + 1] << 16)) for x in cols]
                regs = [lo[2 * q], hi[2 * q], lo[2 * q + 1], hi[2 * q + 1]]
                s = int(scales[g, 0].view(np.uint16))
                b = _dequant_word(int(qweight[g, 4 * t + w]), s | (s << 16))
                # PTX m16n8k16 fragment layouts: where each register's two halves live.
                la[g, 2 * t : 2 * t + 2] = _halves(regs[0])
                la[g + 8, 2 * t : 2 * t + 2] = _halves(regs[1])
                la[g, 2 * t + 8 : 2 * t + 10] = _halves(regs[2])
                la[g + 8, 2 * t + 8 : 2 * t + 10] = _halves(regs[3])
                lb[2 * t : 2 * t + 2, g] = _halves(b[2 * q])
                lb[2 * t + 8 : 2 * t + 10, g] = _halves(b[2 * q + 1])
            c += la @ lb
    ref = a.astype(np.float32) @ w16.astype(np.float32).T
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("value", range(-8, 8))
def test_dequant_magic_numbers_exact(value):
    q = np.full((1, 8), value, dtype=np.int8)
    q[0, 1::2] = -1 - value  # odd lanes: a different value in the high half-word
    word = int(pack_value_shuffle(q)[0, 0])
    one = 0x3C003C00  # fp16 1.0 in both halves: no scaling
    pairs = [_halves(p) for p in _dequant_word(word, one)]
    assert all(p[0] == value and p[1] == -1 - value for p in pairs)
