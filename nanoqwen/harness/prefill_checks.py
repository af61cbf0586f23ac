"""The prefill kernels' correctness checks against PyTorch (on an sm_90 GPU):
tests/test_gpu_prefill.py and dev/prefill_check.py run them.

GEMM: every 7B projection shape (qkv, o + residual in place, gate_up + SwiGLU, down) at
awkward M (GEMM_M), fresh random INT4 weights each run, the output poisoned with NaN before
the launch and followed by GUARD_ROWS poisoned rows that must stay NaN (no store past row M);
a launch that does not finish within a minute ends the process with a HANG line naming the
kernel (a pipeline deadlock never returns, and every later call would wait behind it). The
reference dequantizes exactly as the kernel does (q * scale rounded once to fp16; the packing
is checked against nanoqwen.quant on a slice) and multiplies in fp32, so what is left is fp32
summation order (~1e-6 relative) and the final fp16 rounding (2^-11 relative): the tolerance
is max|out - ref| <= GEMM_REL_TOL * max|ref| (GEMM_FP32_REL_TOL for the q/k/v projection's fp32
output, which no fp16 rounding may touch).

Attention: T new tokens after `start` cached ones, (start, T) in ATTN_CASES, K/V in paged
caches behind a scattered page table (K's parts as the kernels' cache format has them, each
random: random_k_parts), against an fp32 causal softmax over all start + T
positions; P is rounded to fp16 before P V, so the tolerance is max abs error <= ATTN_ABS_TOL
on outputs of magnitude ~1.

The inputs are torch tensors on torch's current stream; the kernels run on the Gpu's stream.
Every check synchronizes the device before its launch and waits for the Gpu's stream after
it, so the two streams never race.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from ..config import GROUP_SIZE, PAGE_TOKENS, ModelConfig
from ..engine.forward import scratch_rows
from ..engine.kv_cache import kv_tiles_to_device
from ..quant import LANE_SHIFTS, dequantize_packed

# One row, odd counts, whole tiles (16 tokens: the verify step's most rows), one either side.
GEMM_M = (1, 3, 8, 16, 17, 64, 65, 128, 511, 512, 513)
# (start, T): whole prompts of one token, odd lengths, part tiles (64 rows); then new tokens
# after a cached prefix that ends on a page, mid-tile, on a tile; then prefixes long enough for
# key splits (PrefillKernels.splits > 1 on every model: the partials and their merge).
ATTN_CASES = tuple((0, t) for t in (1, 15, 16, 17, 100, 512, 1000)) + (
    (16, 1), (37, 1), (37, 64), (64, 100), (100, 200), (1000, 65), (2000, 100), (4000, 1),
    (8190, 64),
)  # fmt: skip
GEMM_REL_TOL = 2e-3  # fp16 output rounding (2^-11) with room for fp32 summation order
# An fp32 out (q/k/v): summation order alone; an fp16 rounding (up to 2^-12 of max|ref|) fails.
GEMM_FP32_REL_TOL = 2e-5
GUARD_ROWS = 256  # poisoned rows past M after every GEMM output (must stay untouched)
ATTN_ABS_TOL = 4e-3  # P is rounded to fp16 before P V; outputs are of magnitude ~1
HANG_S = 60.0  # a launch still running after this long is a deadlock
SCALE = 0.01  # weight scales: outputs of order 1 for K = 3584 and random N(0,1) activations

Log = Callable[[str], None]


def wait_or_die(gpu, what: str, timeout_s: float = HANG_S) -> None:
    """Wait for the Gpu's stream with a deadline: a kernel that never finishes (a pipeline
    deadlock) ends the process with its name instead of waiting forever."""
    t0 = time.monotonic()
    while not gpu.stream_idle(what):
        if time.monotonic() - t0 > timeout_s:
            print(f"HANG: {what} still running after {timeout_s:.0f} s; exiting", flush=True)
            os._exit(3)
        time.sleep(0.0005)


# -- references ---------------------------------------------------------------------------------
def random_int4_weight(n: int, k: int, gen: torch.Generator):
    """Fresh random INT4 weight on the GPU: (qweight int32-bits [N, K/8], scales fp16
    [N, K/128], dequantized fp16 [N, K] = fp16(q * scale), the value the kernel computes)."""
    q = torch.randint(-8, 8, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand((n, k // GROUP_SIZE), device="cuda", generator=gen) + 0.5) * SCALE
    scales = scales.half()
    nib = (q & 0xF).to(torch.int64).view(n, k // 8, 8)
    shifts = torch.tensor(LANE_SHIFTS.tolist(), device="cuda", dtype=torch.int64)
    words = (nib << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    groups = q.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * scales.float()[:, :, None]
    return words, scales, groups.half().view(n, k)


def check_packing_against_quant(words, scales, deq) -> None:
    """The GPU packer above must agree with nanoqwen.quant (the file format's definition)."""
    w = words[:4].cpu().numpy().view(np.uint32)
    ref = dequantize_packed(w, scales[:4].cpu().numpy())
    got = deq[:4].float().cpu().numpy()
    if not np.array_equal(ref.astype(np.float16).astype(np.float32), got):
        raise AssertionError("GPU INT4 packing disagrees with nanoqwen.quant.dequantize_packed")


def gemm_reference(a, deq, bias=None, residual=None, swiglu=False):
    """fp32 a @ deq^T (+ bias) (+ residual); swiglu: silu(first half) * second half."""
    ref = a.float() @ deq.float().t()
    if bias is not None:
        ref += bias.float()
    if residual is not None:
        ref += residual.float()
    if swiglu:
        i = ref.shape[1] // 2
        ref = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    return ref


def attention_reference(q, k, v):
    """fp32 causal GQA softmax attention of the last T positions: q [T, Hq, D] at positions
    L - T .. L - 1, k/v [L, Hkv, D] -> [T, Hq, D]."""
    t, hq, d = q.shape
    n = k.shape[0]
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)
    mask = torch.ones(t, n, device=q.device, dtype=torch.bool).triu(n - t + 1)
    s.masked_fill_(mask, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vf)


def paged_kv(k_parts: list, v, gen: torch.Generator):
    """K's parts (the kernels sum them: [k] for a plain fp16 cache, [hi, lo] for the pair) and
    v, each [L, Hkv, D] fp16 -> (K cache, V cache, page table) on the GPU in the engine's
    layout (engine.kv_cache), the pages scattered by a random permutation with spare pages."""
    n, hkv, d = v.shape
    pages = -(-n // PAGE_TOKENS) + 3
    table = torch.randperm(pages, generator=gen, device=gen.device).to(torch.int32).cpu()

    def physical(x):
        rows = torch.zeros(pages * PAGE_TOKENS, hkv, d, dtype=torch.float16)
        rows[:n] = x.cpu()
        out = np.empty((pages, PAGE_TOKENS, hkv, d), np.float16)
        out[table.numpy()] = rows.view(pages, PAGE_TOKENS, hkv, d).numpy()
        return out

    def cache(parts):
        return torch.from_numpy(kv_tiles_to_device([physical(x) for x in parts])).cuda()

    return cache(k_parts), cache([v]), table.cuda()


def random_k_parts(pk, shape, gen: torch.Generator) -> list:
    """K's parts for pk's cache format (its geometry's k_parts), random fp16 [shape]: a lo part
    a quarter of hi's scale, far above a real remainder, so that a kernel leaving it out
    fails the check."""
    return [torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen) / (1 + 3 * i)
            for i in range(pk.geometry.k_parts)]  # fmt: skip


# -- checks -------------------------------------------------------------------------------------
def gemm_shapes(cfg: ModelConfig) -> dict[str, dict]:
    """The prefill's four GEMMs of `cfg`: N, K and what the epilogue adds."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": dict(n=cfg.q_size + 2 * cfg.kv_size, k=h, bias=True, fp32_out=True),
        "o": dict(n=h, k=cfg.q_size, residual=True),
        "gate_up": dict(n=2 * i, k=h, swiglu=True),
        "down": dict(n=h, k=i, residual=True),
    }


def run_gemm_case(pk, a, words, scales, deq, shape, m, spec=None, bias=None, padded=True):
    """One GEMM of `pk` (a PrefillKernels) with tile `spec` (None: pick_gemm's) on the M = m
    rows of `a` against the reference: (ok, max|err|, max|ref|); err is inf when a guard row
    was written or, with a residual (fp32, the result), when out is not its exact fp16 copy.
    padded: A sits in a buffer of the engine's prefill rows
    (forward.scratch_rows, passed as a_rows) whose rows past M are NaN, which must not reach
    any output; else A is exactly M rows (the TMA fills the rest of a box)."""
    n = shape["n"]
    swiglu = shape.get("swiglu", False)
    out_cols = n // 2 if swiglu else n
    # `out` is the first m rows of a NaN-poisoned buffer with GUARD_ROWS more: a kernel that
    # stores past row M shows up as a finite guard row.
    out_dtype = torch.float32 if shape.get("fp32_out") else torch.float16
    buf = torch.full((m + GUARD_ROWS, out_cols), float("nan"), device="cuda", dtype=out_dtype)
    out = buf[:m]
    res_buf = res_arg = None
    if shape.get("residual"):  # the fp32 residual, in place (off the fp16 grid), guarded too
        res_buf = torch.full((m + GUARD_ROWS, n), float("nan"), device="cuda")
        res_arg = res_buf[:m]
        res_arg.copy_(torch.randn(m, n, device="cuda"))
    ref = gemm_reference(a, deq, bias, res_arg, swiglu)
    a_rows = scratch_rows(m) if padded else 0
    if padded:
        a_buf = torch.full((a_rows, a.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
        a_buf[:m] = a
        a = a_buf
    torch.cuda.synchronize()
    what = f"gemm {spec.key if spec else 'picked'} N={n} K={shape['k']} M={m} a_rows={a_rows}"
    pk.gemm(a, words, scales, bias, out, m, n, shape["k"], res_arg, swiglu=swiglu, spec=spec,
            a_rows=a_rows, out_fp32=shape.get("fp32_out", False))  # fmt: skip
    wait_or_die(pk.gpu, what)
    got = out.float()
    guard_ok = bool(torch.isnan(buf[m:]).all().item())
    if res_buf is not None:  # the result is the fp32 residual; out must be its fp16 copy
        got = res_arg
        guard_ok &= bool(torch.isnan(res_buf[m:]).all().item())
        guard_ok &= bool(torch.equal(res_arg.half(), out))
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    if not guard_ok:
        err = float("inf")  # reported as a failure: a guard row written, or a wrong copy
    tol = GEMM_FP32_REL_TOL if shape.get("fp32_out") else GEMM_REL_TOL
    ok = guard_ok and bool(torch.isfinite(got).all().item()) and err <= tol * scale
    return ok, err, scale


def check_gemm(pk, cfg: ModelConfig, gen: torch.Generator, log: Log = print, quick=False):
    """Every GEMM shape of `cfg` at every M of GEMM_M (quick: four of them) with every GEMM
    tile of `pk`; logs failures and a table of max|err| / max|ref|. Returns (all ok, the worst
    ratio)."""
    rows, ok_all = [], True
    ms = (GEMM_M[:3] + GEMM_M[-1:]) if quick else GEMM_M
    for name, shape in gemm_shapes(cfg).items():
        words, scales, deq = random_int4_weight(shape["n"], shape["k"], gen)
        check_packing_against_quant(words, scales, deq)
        bias = None
        if shape.get("bias"):
            bias = torch.randn(shape["n"], device="cuda", dtype=torch.float16, generator=gen)
        specs = [s for s in pk.gemms if s.tile.swiglu == shape.get("swiglu", False)]
        for m in ms:
            a = torch.randn(m, shape["k"], device="cuda", dtype=torch.float16, generator=gen)
            for spec, padded in itertools.product(specs, (True, False)):
                ok, err, scale = run_gemm_case(pk, a, words, scales, deq, shape, m, spec, bias,
                                               padded)  # fmt: skip
                ok_all &= ok
                key = spec.key + ("" if padded else " A to M")
                rows.append((name, m, key, err, scale, ok))
                if not ok:
                    log(f"GEMM FAIL {name} M={m} {key}: err {err:.3g} (max|ref| {scale:.3g})")
        del words, scales, deq
    # max|err| / max|ref| per (shape, tile) and M: which kernel, which shapes, which M.
    log(f"\nmax|err|/max|ref| (tol {GEMM_REL_TOL}); * = FAIL")
    log(f"{'shape':8s} {'tile':24s} " + " ".join(f"{'M=' + str(m):>9s}" for m in ms))
    for name in gemm_shapes(cfg):
        for key in dict.fromkeys(r[2] for r in rows if r[0] == name):
            cells = []
            for m in ms:
                r = next(r for r in rows if r[0] == name and r[2] == key and r[1] == m)
                cells.append(f"{r[3] / max(r[4], 1e-30):8.1e}{' ' if r[5] else '*'}")
            log(f"{name:8s} {key:24s} " + " ".join(cells))
    worst = max(r[3] / max(r[4], 1e-30) for r in rows)
    log(f"gemm correctness: {sum(r[5] for r in rows)}/{len(rows)} pass; worst max|err|/max|ref| "
        f"= {worst:.2e} (tol {GEMM_REL_TOL})")  # fmt: skip
    return ok_all, worst


def check_attention(configs, gen: torch.Generator, log: Log = print):
    """The prefill attention of each (config, PrefillKernels) in `configs` at every (start, T)
    of ATTN_CASES, random q, k, v. Returns (all ok, the worst max abs error)."""
    ok_all, worst = True, 0.0
    for cfg, pk in configs:
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for start, t in ATTN_CASES:
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.float16, generator=gen)
            k_parts = random_k_parts(pk, (start + t, hkv, d), gen)
            v = torch.randn(start + t, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
            kc, vc, table = paged_kv(k_parts, v, gen)
            k = sum(x.float() for x in k_parts)
            out = torch.full_like(q, float("nan"))
            torch.cuda.synchronize()
            pk.attention(q, kc, vc, table, out, start, t)
            wait_or_die(pk.gpu, f"prefill attention {cfg.name} start={start} T={t} "
                        f"splits={pk.splits(start, t)}")  # fmt: skip
            err = (out.float() - attention_reference(q, k, v)).abs().max().item()
            ok = bool(torch.isfinite(out).all().item()) and err <= ATTN_ABS_TOL
            worst = max(worst, err)
            ok_all &= ok
            if not ok:
                log(f"ATTN FAIL {cfg.name} {hq}:{hkv} D={d} start={start} T={t} splits="
                    f"{pk.splits(start, t)}: max err {err:.3g}")  # fmt: skip
    log(f"attention correctness: {'pass' if ok_all else 'FAIL'}; worst max abs err {worst:.2e} "
        f"(tol {ATTN_ABS_TOL})")  # fmt: skip
    return ok_all, worst
