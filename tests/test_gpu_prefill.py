"""Prefill kernels on an sm_90 GPU against PyTorch references (nanoqwen.harness.prefill_checks
holds the references and states the tolerances): every 7B GEMM shape at awkward M for every
GEMM tile, NaN-poisoned outputs with guard rows past M, the tile the engine picks, causal GQA
attention at awkward T, and bad shapes raising before any launch."""

import itertools

import pytest

from nanoqwen.cuda.device import sm90_available

torch = pytest.importorskip("torch")
if not (sm90_available() and torch.cuda.is_available()):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from nanoqwen.config import ModelConfig, preset  # noqa: E402
from nanoqwen.cuda.device import Gpu  # noqa: E402
from nanoqwen.cuda.prefill import PrefillKernels  # noqa: E402
from nanoqwen.harness import prefill_checks as pc  # noqa: E402

pytestmark = pytest.mark.gpu

CFG = preset("7b")
SHAPES = ["qkv", "o", "gate_up", "down"]


@pytest.fixture(scope="module")
def env(kernel_cache):
    torch.cuda.init()
    kernels = PrefillKernels(Gpu(torch.cuda.current_device()), CFG)
    gen = torch.Generator(device="cuda")
    gen.seed()  # fresh inputs every run
    return kernels, gen


def _bias(shape):
    return (
        torch.randn(shape["n"], device="cuda", dtype=torch.float16) if shape.get("bias") else None
    )


@pytest.mark.parametrize("shape_name", SHAPES)
def test_gemm_7b_shapes(env, shape_name):
    kernels, gen = env
    shape = pc.gemm_shapes(CFG)[shape_name]
    words, scales, deq = pc.random_int4_weight(shape["n"], shape["k"], gen)
    pc.check_packing_against_quant(words, scales, deq)
    bias = _bias(shape)
    specs = [s for s in kernels.gemms if s.tile.swiglu == shape.get("swiglu", False)]
    assert specs, f"no GEMM tile for {shape_name}"
    for m in pc.GEMM_M:
        a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
        for spec, padded in itertools.product(specs, (True, False)):
            ok, err, scale = pc.run_gemm_case(kernels, a, words, scales, deq, shape, m, spec, bias,
                                              padded)  # fmt: skip
            assert ok, (f"{shape_name} M={m} {spec.key} padded={padded}: max err {err:.3g} "
                        f"vs max|ref| {scale:.3g}")  # fmt: skip


@pytest.mark.parametrize("shape_name", SHAPES)
def test_gemm_7b_picked_tile(env, shape_name):
    """What the engine runs (spec=None: pick_gemm's tile for M and swiglu)."""
    kernels, gen = env
    shape = pc.gemm_shapes(CFG)[shape_name]
    swiglu = shape.get("swiglu", False)
    for m in (5, 512, 700):
        picked = kernels.pick_gemm(m, swiglu)
        assert picked in kernels.gemms and picked.tile.swiglu == swiglu, picked
    words, scales, deq = pc.random_int4_weight(shape["n"], shape["k"], gen)
    bias = _bias(shape)
    for m in (5, 512, 700):
        a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
        ok, err, scale = pc.run_gemm_case(kernels, a, words, scales, deq, shape, m, None, bias)
        assert ok, f"{shape_name} M={m} picked: max err {err:.3g} vs max|ref| {scale:.3g}"


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        ModelConfig("gqa2-d128", 1000, 512, 512, 1, 4, 2, 128),
        preset("tiny"),
        preset("32b"),
        preset("3b"),
    ],
    ids=["7b-7to1", "d128-2to1", "tiny-d64-2to1", "32b-5to1", "3b-8to1"],
)
def test_attention(env, cfg):
    kernels, gen = env
    if cfg is not CFG:
        kernels = PrefillKernels(kernels.gpu, cfg)
    ok, worst = pc.check_attention([(cfg, kernels)], gen)
    assert ok, f"worst max abs err {worst:.3g} > {pc.ATTN_ABS_TOL}"


def test_bad_shapes_raise(env):
    kernels, _ = env
    with pytest.raises(ValueError, match="K=100"):
        kernels.gemm(0, 0, 0, None, 0, 4, 128, 100)
    with pytest.raises(ValueError, match="N=96"):
        kernels.gemm(0, 0, 0, None, 0, 4, 96, 128)
    with pytest.raises(ValueError, match="M=0"):
        kernels.gemm(0, 0, 0, None, 0, 0, 128, 128)
    with pytest.raises(ValueError, match="swiglu takes no bias"):
        kernels.gemm(0, 0, 0, 0, 0, 4, 256, 128, swiglu=True)
    plain = next(s for s in kernels.gemms if not s.tile.swiglu)
    with pytest.raises(ValueError, match="does not match swiglu=True"):
        kernels.gemm(0, 0, 0, None, 0, 4, 256, 128, swiglu=True, spec=plain)
    with pytest.raises(ValueError, match="T=0"):
        kernels.attention(0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="start=-1"):
        kernels.attention(0, 0, 0, 0, 0, -1, 4)
