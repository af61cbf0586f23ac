"""Prefill kernels on an sm_90 GPU against PyTorch references (nanoqwen.harness.prefill_checks
holds the references and states the tolerances): every 7B GEMM shape at awkward M for every
GEMM tile, NaN-poisoned outputs with guard rows past M, the tile the engine picks, causal GQA
attention at awkward T, the q/k/v GEMM's RoPE + K/V epilogue, and bad shapes raising before any
launch."""

import pytest

from nanoqwen.cuda.device import sm90_available

torch = pytest.importorskip("torch")
if not (sm90_available() and torch.cuda.is_available()):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from nanoqwen.config import PAGE_TOKENS, ModelConfig, preset  # noqa: E402
from nanoqwen.cuda.device import Gpu  # noqa: E402
from nanoqwen.cuda.prefill import PrefillKernels  # noqa: E402
from nanoqwen.engine.kv_cache import kv_cache_from_device  # noqa: E402
from nanoqwen.harness import prefill_checks as pc  # noqa: E402
from nanoqwen.rope import rope_table  # noqa: E402

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
    specs = [
        s for s in kernels.gemms if s.tile.swiglu == shape.get("swiglu", False) and not s.tile.rope
    ]
    assert specs, f"no GEMM tile for {shape_name}"
    for m in pc.GEMM_M:
        a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16)
        for spec in specs:
            ok, err, scale = pc.run_gemm_case(kernels, a, words, scales, deq, shape, m, spec, bias)
            assert ok, f"{shape_name} M={m} {spec.key}: max err {err:.3g} vs max|ref| {scale:.3g}"


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


@pytest.mark.parametrize("start,t", [(0, 1), (13, 77), (0, 512), (37, 513)])
def test_gemm_rope_epilogue(env, start, t):
    """Every RoPE tile: q rotated into q, k rotated and v into NaN-poisoned pages behind a
    scattered page table, against fp16(h @ W^T + b) rotated in fp32 (rope_kv_write's rounding);
    positions outside start .. start + t - 1 and the spare pages stay NaN."""
    kernels, gen = env
    c, hd = CFG, CFG.head_dim
    n, k = c.q_size + 2 * c.kv_size, c.hidden_size
    words, scales, deq = pc.random_int4_weight(n, k, gen)
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
    h = torch.randn(t, k, device="cuda", dtype=torch.float16, generator=gen)
    cs = torch.from_numpy(rope_table(c, start + t)).cuda()
    pages = -(-(start + t) // PAGE_TOKENS) + 3
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    ref = (h.float() @ deq.float().t() + bias.float()).half().float()
    q_ref = pc.rope_reference(ref[:, : c.q_size].view(t, -1, hd), cs[start:])
    k_ref = pc.rope_reference(ref[:, c.q_size : c.q_size + c.kv_size].view(t, -1, hd), cs[start:])
    v_ref = ref[:, c.q_size + c.kv_size :].view(t, -1, hd)
    for spec in (s for s in kernels.gemms if s.tile.rope):
        nan = float("nan")
        q = torch.full((t, c.num_heads, hd), nan, device="cuda", dtype=torch.float16)
        kc, vc = (torch.full((pages, c.num_kv_heads, PAGE_TOKENS, hd), nan, device="cuda",
                             dtype=torch.float16) for _ in range(2))  # fmt: skip
        torch.cuda.synchronize()
        kernels.gemm(h, words, scales, bias, q, t, n, k, spec=spec,
                     rope_kv=(cs, table, kc, vc, q, start))  # fmt: skip
        pc.wait_or_die(kernels.gpu, f"{spec.key} start={start} T={t}")
        perm = table.cpu().numpy()
        for got, want in ((kc, k_ref), (vc, v_ref)):
            rows = torch.from_numpy(kv_cache_from_device(got.cpu().numpy())[perm].copy())
            rows = rows.view(-1, c.num_kv_heads, hd)
            assert torch.isnan(rows[:start]).all() and torch.isnan(rows[start + t :]).all()
            err = (rows[start : start + t].cuda().float() - want).abs().max().item()
            assert err <= pc.ROPE_REL_TOL * want.abs().max().item(), f"{spec.key}: {err}"
        err = (q.float() - q_ref).abs().max().item()
        assert err <= pc.ROPE_REL_TOL * q_ref.abs().max().item(), f"{spec.key} q: {err}"


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
    plain = next(s for s in kernels.gemms if not s.tile.swiglu and not s.tile.rope)
    with pytest.raises(ValueError, match="does not match swiglu=True"):
        kernels.gemm(0, 0, 0, None, 0, 4, 256, 128, swiglu=True, spec=plain)
    rope = next(s for s in kernels.gemms if s.tile.rope)
    with pytest.raises(ValueError, match="rope_kv is the q/k/v"):
        kernels.gemm(0, 0, 0, None, 0, 4, 256, 128, rope_kv=(0, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="does not match swiglu=False rope=False"):
        kernels.gemm(0, 0, 0, None, 0, 4, 256, 128, spec=rope)
    with pytest.raises(ValueError, match="T=0"):
        kernels.attention(0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="start=-1"):
        kernels.attention(0, 0, 0, 0, 0, -1, 4)
