"""Prefill kernels on an sm_90 GPU against PyTorch references (tools/prefill_check.py holds the
references and states the tolerances): every 7B GEMM shape at awkward M for every GEMM variant
(wgmma and mma.sync), NaN-poisoned outputs with guard rows past M, the variant the engine
picks, causal GQA attention at awkward T, and bad shapes raising before any launch."""

import importlib.util
from pathlib import Path

import pytest

from nanoqwen.cuda.device import sm90_available

torch = pytest.importorskip("torch")
if not (sm90_available() and torch.cuda.is_available()):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from nanoqwen.config import ModelConfig, preset  # noqa: E402
from nanoqwen.cuda.device import Gpu  # noqa: E402
from nanoqwen.prefill import PrefillKernels  # noqa: E402

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "prefill_check", Path(__file__).parents[1] / "tools" / "prefill_check.py"
)
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

CFG = preset("7b")


@pytest.fixture(scope="module")
def env():
    from cuda.core import Stream

    torch.cuda.init()
    kernels = PrefillKernels(CFG, Gpu(torch.cuda.current_device()))
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda")
    gen.seed()  # fresh inputs every run
    return kernels, stream, gen


@pytest.mark.parametrize("shape_name", ["qkv", "o", "gate_up", "down"])
def test_gemm_7b_shapes(env, shape_name):
    kernels, stream, gen = env
    shape = pc.gemm_shapes(CFG)[shape_name]
    words, scales, deq = pc.random_int4_weight(shape["n"], shape["k"], gen)
    pc.check_packing_against_quant(words, scales, deq)
    bias = (
        torch.randn(shape["n"], device="cuda", dtype=torch.float16) if shape.get("bias") else None
    )
    for m in pc.GEMM_M:
        a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
        for v in (x for x in kernels.variants if x.swiglu == shape.get("swiglu", False)):
            ok, err, scale = pc.run_gemm_case(
                kernels, stream, a, words, scales, deq, shape, m, v, bias
            )
            assert ok, f"{shape_name} M={m} {v.name}: max err {err:.3g} vs max|ref| {scale:.3g}"


@pytest.mark.parametrize("shape_name", ["qkv", "o", "gate_up", "down"])
def test_gemm_7b_picked_variant(env, shape_name):
    """What the engine runs (variant=None: pick_gemm), wgmma unless NANOQWEN_PREFILL_WGMMA=0."""
    kernels, stream, gen = env
    shape = pc.gemm_shapes(CFG)[shape_name]
    swiglu = shape.get("swiglu", False)
    picked = kernels.pick_gemm(512, shape["n"], swiglu, shape["k"])
    assert picked.kind == ("wgmma" if kernels.use_wgmma else "mma"), picked
    words, scales, deq = pc.random_int4_weight(shape["n"], shape["k"], gen)
    bias = (
        torch.randn(shape["n"], device="cuda", dtype=torch.float16) if shape.get("bias") else None
    )
    for m in (5, 512, 700):
        a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
        ok, err, scale = pc.run_gemm_case(
            kernels, stream, a, words, scales, deq, shape, m, None, bias
        )
        assert ok, f"{shape_name} M={m} picked: max err {err:.3g} vs max|ref| {scale:.3g}"


@pytest.mark.parametrize(
    "cfg",
    [CFG, ModelConfig("gqa2-d128", 1000, 512, 512, 1, 4, 2, 128), preset("tiny")],
    ids=["7b-7to1", "d128-2to1", "tiny-d64-2to1"],
)
def test_attention(env, cfg):
    _, stream, gen = env
    kernels = env[0] if cfg is CFG else PrefillKernels(cfg, env[0].gpu)
    ok, worst = pc.check_attention([(cfg, kernels)], stream, gen, None)
    assert ok, f"worst max abs err {worst:.3g} > {pc.ATTN_ABS_TOL}"


def test_bad_shapes_raise(env):
    kernels, stream, _ = env
    with pytest.raises(ValueError, match="K=100"):
        kernels.gemm(0, 0, 0, None, 0, 4, 128, 100, stream=stream)
    with pytest.raises(ValueError, match="N=96"):
        kernels.gemm(0, 0, 0, None, 0, 4, 96, 128, stream=stream)
    with pytest.raises(ValueError, match="M=0"):
        kernels.gemm(0, 0, 0, None, 0, 0, 128, 128, stream=stream)
    with pytest.raises(ValueError, match="T=0"):
        kernels.attention(0, 0, 0, 0, 0, stream=stream)
