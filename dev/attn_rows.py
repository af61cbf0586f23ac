"""The multi-row step's kernels (VerifyKernels: attention and lm_head + argmax over M rows of
one sequence, for speculative decoding): validate against torch float32, then time (sm_90 GPU).

    PYTHONPATH=. python3 dev/attn_rows.py [--parts lm_head,attention,timing] [--out DIR]
        [--variant NAME=v,NAME=v ...]

Validation (fresh random inputs every run, the seed printed; outputs poisoned with NaN first):
- lm_head_rows on the 7B shape (V 152064, H 3584) at M = 1, 2, 3, 5, 8, 9, 16 (M = 3 over the
  first V - 37 rows: a partial last block): logits against xn @ W^T in float32, xn the
  reference's fp16 RMSNorm; every key's id must be torch's argmax, or a stated near-tie (its
  reference logit within LOGIT_TOL of the max); rows past M must stay NaN.
- attention_rows, both forms (clusters of mattn_cluster and of mattn_long_cluster), on the 7B
  (28/4, D 128), 1.5B (12/2), 32B (40/8) and 0.5B (14/2, D 64) head shapes at M = 1, 2, 3, 5,
  8, 16 and start = 0, 5, 511, 4000, 8191 - M, over a paged cache of random K/V with a shuffled
  page table: against softmax(q k^T / sqrt(D), causal inside the block) v in float32; rows
  past M must stay NaN.

Timing (the 7B shapes, CUDA graphs, medians of 5 graph launches; harness.bench.time_graph):
attention at context 512, 8192, 32768 (keys 0 .. ctx - 1; M = 1 is today's attn_decode, M > 1
both forms, `*` the one the verify step takes there), 28 launches a graph over 28 layers' own
caches; lm_head at M = 1 (today's lm_head_argmax), 2, 4, 8, 16. Printed: microseconds a
launch, the ratio to M = 1, and the bytes' rate.

--variant: lm_head_rows also built on a Geometry with those values, checked and timed beside the
shipped one. Each part runs on its own: a failure prints its traceback and the next part runs.
RESULT last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from nanoqwen.config import PAGE_TOKENS, preset
from nanoqwen.cuda.decode import DecodeKernels, VerifyKernels
from nanoqwen.cuda.device import Gpu
from nanoqwen.cuda.registry import DEFAULT_GEOMETRY, kv_token_bytes
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.gpu_script import gpu_session, run_part
from nanoqwen.harness.prefill_checks import wait_or_die

ATTN_MS = (1, 2, 3, 5, 8, 16)
ATTN_STARTS = (0, 5, 511, 4000)  # and 8191 - M: the last page of an 8k cache
ATTN_MODELS = ("7b", "1.5b", "32b", "0.5b")
ATTN_CTX = 8192  # positions the validation cache holds
# P is rounded to fp16 before P V and the output to fp16 (2^-11 relative each); the outputs are
# averages of N(0, 1) values, at most ~3 in magnitude.
ATTN_ABS_TOL = 4e-3
LM_MS = (1, 2, 3, 5, 8, 9, 16)
# fp32 sums of 3584 products in another order, and x's fp16 RMSNorm rounded from an rsqrtf that
# may differ from torch's by an ulp: logits of order 1 agree to ~1e-5.
LOGIT_TOL = 2e-3
TIME_CTX = (512, 8192, 32768)
TIME_MS = (1, 2, 4, 8, 16)


# -- attention ----------------------------------------------------------------------------------
class PagedKV:
    """A layer's K and V caches in the device layout (kv_cache.cuh: K in the default format's
    parts, each random N(0, 1) / (1 + 3 part), so a part left out shows), with a shuffled page
    table, and the logical [positions, n_kv, D] float32 views for the reference."""

    def __init__(self, cfg, positions: int, layers: int = 1, gen=None):
        pages = -(-positions // PAGE_TOKENS) + 3  # spare pages: the table does not cover all
        parts = DEFAULT_GEOMETRY.k_parts

        def cache(n):
            shape = (pages, cfg.num_kv_heads, n, PAGE_TOKENS, cfg.head_dim)
            x = torch.randn(shape, generator=gen, device="cuda")
            return (x / (1 + 3 * torch.arange(n, device="cuda"))[:, None, None]).half()

        self.k = [cache(parts) for _ in range(layers)]
        self.v = [cache(1) for _ in range(layers)]
        self.table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
        self.cfg = cfg

    def logical(self, cache: torch.Tensor, n: int) -> torch.Tensor:
        """[n, n_kv, D] float32 of positions 0 .. n - 1 (the chunk swizzle undone, the parts
        summed)."""
        d = self.cfg.head_dim
        pos = torch.arange(n, device="cuda")
        t = (pos % PAGE_TOKENS)[:, None]
        col = torch.arange(d, device="cuda")[None, :]
        stored = ((col // 8) ^ (t % 8)) * 8 + col % 8  # [n, D]
        tiles = cache[self.table[pos // PAGE_TOKENS].long()]  # [n, n_kv, parts, 16, D]
        rows = tiles[torch.arange(n, device="cuda"), :, :, pos % PAGE_TOKENS]  # [n, n_kv, parts, D]
        idx = stored[:, None, None, :].expand_as(rows)
        return torch.gather(rows, 3, idx).float().sum(2)


def attention_reference(q, k, v, start):
    """q [M, H, D], k, v [start + M, Hkv, D] float32 -> [M, H, D]: row t over keys 0..start+t."""
    m, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, H, D]
    s = torch.einsum("mhd,lhd->hml", q, kk) / d**0.5
    keys = torch.arange(k.shape[0], device=q.device)
    mask = keys[None, :] > start + torch.arange(m, device=q.device)[:, None]  # [M, L]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(s, -1), vv)


def check_attention(gpu, gen, log) -> bool:
    ok = True
    for name in ATTN_MODELS:
        cfg = preset(name)
        vk = VerifyKernels(gpu, cfg)
        for key in ("attention_rows", "attention_rows_long"):
            r = vk.resources[vk.specs[key].expression]
            log(f"{name}: {vk.specs[key].expression} {r.registers} regs, {r.spill_bytes} B "
                f"spilled")  # fmt: skip
        log(f"{name}: splits {vk.attn_splits} a kv head, the long form from {vk.long_pages} "
            f"pages")  # fmt: skip
        kv = PagedKV(cfg, ATTN_CTX, gen=gen)
        k_all, v_all = kv.logical(kv.k[0], ATTN_CTX), kv.logical(kv.v[0], ATTN_CTX)
        scratch = vk.attention_scratch()
        vr = vk.geometry.verify_rows
        out = torch.empty(vr, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.float16)
        start_d = torch.zeros(1, dtype=torch.int32, device="cuda")
        worst = 0.0
        cases = [(m, start, long) for m in ATTN_MS for start in (*ATTN_STARTS, ATTN_CTX - 1 - m)
                 for long in (False, True)]  # fmt: skip
        for m, start, long in cases:
            q = (2 * torch.randn(m, cfg.num_heads, cfg.head_dim, generator=gen,
                                 device="cuda")).half()  # fmt: skip
            out.fill_(float("nan"))
            start_d.fill_(start)
            vk.attention_rows(q.data_ptr(), kv.k[0].data_ptr(), kv.v[0].data_ptr(),
                              kv.table.data_ptr(), start_d.data_ptr(), m, scratch,
                              out.data_ptr(), long=long)  # fmt: skip
            form = "long" if long else "short"
            wait_or_die(gpu, f"attn_rows {name} {form} M={m} start={start}")
            ref = attention_reference(q.float(), k_all[: start + m], v_all[: start + m],
                                      start)  # fmt: skip
            got = out[:m].float()
            err = (got - ref).abs().max().item() if got.isfinite().all() else float("inf")
            guard = bool(out[m:].isnan().all())
            worst = max(worst, err)
            if err > ATTN_ABS_TOL or not guard:
                ok = False
                log(f"  * {name} {form} M={m} start={start}: max|err| {err:.2e} "
                    f"(tol {ATTN_ABS_TOL}), rows past M untouched: {guard}")  # fmt: skip
        log(f"  {name}: {len(cases)} cases (both forms), worst max|err| {worst:.2e} "
            f"(tol {ATTN_ABS_TOL})")  # fmt: skip
        scratch.free()
        del kv
    return ok


# -- lm_head ------------------------------------------------------------------------------------
def decode_key(key: int) -> tuple[int, float]:
    """(id, logit) of a packed argmax key (decode_misc.cu / common.cuh argmax_key)."""
    bits = key >> 32
    bits = bits & 0x7FFFFFFF if bits & 0x80000000 else ~bits & 0xFFFFFFFF
    return 0xFFFFFFFF - (key & 0xFFFFFFFF), float(np.array([bits], np.uint32).view(np.float32)[0])


def rmsnorm_ref(x, w, eps):
    """fp16(x * rsqrt(mean(x^2) + eps) * w), fp32 math, one rounding (the kernel's)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * w.float()).half()


class LmHead:
    """Random 7B-shaped lm_head weights, final norm and x rows on the GPU."""

    def __init__(self, cfg, rows: int, gen):
        v, h = cfg.vocab_size, cfg.hidden_size
        self.w = (0.02 * torch.randn(v, h, generator=gen, device="cuda")).half()
        self.norm = (1 + 0.1 * torch.randn(h, generator=gen, device="cuda")).half()
        self.x = torch.randn(rows, h, generator=gen, device="cuda").half()
        self.logits = torch.empty(rows, v, device="cuda")
        self.keys = torch.zeros(rows, dtype=torch.int64, device="cuda")


def check_lm_head(gpu, vk, cfg, lm: LmHead, log) -> bool:
    ok = True
    v_full = cfg.vocab_size
    xn = rmsnorm_ref(lm.x, lm.norm, cfg.rms_norm_eps)
    ref_all = xn.float() @ lm.w.float().t()  # [rows, V], float32 (TF32 off)
    for m in LM_MS:
        v = v_full - 37 if m == 3 else v_full
        lm.logits.fill_(float("nan"))
        lm.keys.zero_()
        vk.lm_head_rows(lm.x.data_ptr(), lm.norm.data_ptr(), lm.w.data_ptr(),
                        lm.logits.data_ptr(), lm.keys.data_ptr(), m, rows=v)  # fmt: skip
        wait_or_die(gpu, f"lm_head_rows M={m}")
        got = lm.logits.view(-1)[: m * v].view(m, v)
        ref = ref_all[:m, :v]
        err = (got - ref).abs().max().item() if got.isfinite().all() else float("inf")
        guard = bool(lm.logits.view(-1)[m * v :].isnan().all())
        ties, wrong = 0, 0
        for r, key in enumerate(lm.keys[:m].tolist()):
            kid, kval = decode_key(key & 0xFFFFFFFFFFFFFFFF)
            best = int(ref[r].argmax())
            if kid != best:
                near = ref[r, kid].item() >= ref[r, best].item() - LOGIT_TOL
                ties += near
                wrong += not near
            if kval != got[r, kid].item():
                wrong += 1  # the key's value is not the logit written for its id
        bad = err > LOGIT_TOL or not guard or wrong
        ok &= not bad
        log(f"  {'*' if bad else ' '} lm_head_rows M={m:2d} V={v}: max|err| {err:.2e} "
            f"(tol {LOGIT_TOL}), argmax: {wrong} wrong, {ties} near-ties, rows past M "
            f"untouched: {guard}")  # fmt: skip
    return ok


# -- timing -------------------------------------------------------------------------------------
def time_attention(gpu, gen, log) -> list[tuple]:
    cfg = preset("7b")
    dk, vk = DecodeKernels(gpu, cfg), VerifyKernels(gpu, cfg)
    layers = cfg.num_layers
    kv = PagedKV(cfg, max(TIME_CTX), layers, gen)
    rows = []
    q = torch.randn(16, cfg.num_heads, cfg.head_dim, generator=gen, device="cuda").half()
    out = torch.empty_like(q)
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    sd, sv = dk.attention_scratch(), vk.attention_scratch()
    ptr = (q.data_ptr(), kv.table.data_ptr(), pos.data_ptr(), out.data_ptr())
    for ctx in TIME_CTX:
        base = None
        for m, form in [(1, "")] + [(m, f) for m in TIME_MS[1:] for f in ("short", "long")]:
            pos.fill_(ctx - m)  # M = 1: attn_decode's pos; else attn_rows' start

            def body(s, m=m, long=form == "long"):
                for i in range(layers):
                    k, v = kv.k[i].data_ptr(), kv.v[i].data_ptr()
                    if m == 1:
                        dk.attention(ptr[0], k, v, ptr[1], ptr[2], sd.part_ml.ptr,
                                     sd.part_acc.ptr, sd.counters.ptr, ptr[3],
                                     stream=s)  # fmt: skip
                    else:
                        vk.attention_rows(ptr[0], k, v, ptr[1], ptr[2], m, sv, ptr[3],
                                          long=long, stream=s)  # fmt: skip

            us = 1e6 * time_graph(gpu, body, 4) / layers
            base = base or us
            tb_s = ctx * kv_token_bytes(cfg) / us / 1e6
            step = "*" if form and (form == "long") == vk.long_form(ctx - m, m) else " "
            rows.append(("attention", ctx, m, form, us, us / base, tb_s))
            log(f"attention ctx {ctx:6d} M {m:2d} {form:5s}{step}: {us:8.2f} us  "
                f"x{us / base:5.2f}  {tb_s:5.2f} TB/s")  # fmt: skip
    sd.free()
    sv.free()
    return rows


def time_lm_head(gpu, dk, vk, cfg, lm: LmHead, log, name: str = "") -> list[tuple]:
    rows, base = [], None
    nbytes = cfg.vocab_size * cfg.hidden_size * 2
    for m in TIME_MS:

        def body(s, m=m):
            if m == 1:
                dk.lm_head(lm.x.data_ptr(), lm.norm.data_ptr(), lm.w.data_ptr(),
                           lm.logits.data_ptr(), lm.keys.data_ptr(), stream=s)  # fmt: skip
            else:
                vk.lm_head_rows(lm.x.data_ptr(), lm.norm.data_ptr(), lm.w.data_ptr(),
                                lm.logits.data_ptr(), lm.keys.data_ptr(), m, stream=s)  # fmt: skip

        us = 1e6 * time_graph(gpu, body, 5)
        base = base or us
        rows.append(("lm_head", cfg.hidden_size, m, name, us, us / base, nbytes / us / 1e6))
        log(f"lm_head{name and ' ' + name} M {m:2d}: {us:8.2f} us  x{us / base:5.2f}  "
            f"{nbytes / us / 1e6:5.2f} TB/s")  # fmt: skip
    return rows


# -- the run ------------------------------------------------------------------------------------
def run(parts: set[str], gpu: Gpu, log, variants: dict | None = None) -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} seed {seed} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    results: dict = {}
    cfg7 = preset("7b")
    kernels: dict = {}

    def lm_setup():
        kernels["vk"] = VerifyKernels(gpu, cfg7)
        kernels["variants"] = {t: VerifyKernels(gpu, cfg7, g) for t, g in (variants or {}).items()}
        for name, vk in [("", kernels["vk"]), *kernels["variants"].items()]:
            r = vk.resources[vk.specs["lm_head_rows"].expression]
            log(f"7b: lm_head_rows{name and ' ' + name} {r.registers} regs, "
                f"{r.spill_bytes} B spilled")  # fmt: skip
        kernels["lm"] = LmHead(cfg7, kernels["vk"].geometry.verify_rows, gen)
        return True

    run_part("setup", results, log, lm_setup)
    if "lm_head" in parts and "lm" in kernels:
        run_part("lm_head", results, log,
             lambda: check_lm_head(gpu, kernels["vk"], cfg7, kernels["lm"], log))  # fmt: skip
        for name, vk in kernels["variants"].items():
            log(f"lm_head_rows {name}:")
            run_part(f"lm_head {name}", results, log,
                     lambda vk=vk: check_lm_head(gpu, vk, cfg7, kernels["lm"], log))  # fmt: skip
    if "attention" in parts:
        run_part("attention", results, log, lambda: check_attention(gpu, gen, log))
    table = []
    if "timing" in parts:
        if "lm" in kernels:

            def lm_time():
                dk = DecodeKernels(gpu, cfg7)
                rows = time_lm_head(gpu, dk, kernels["vk"], cfg7, kernels["lm"], log)
                for name, vk in kernels["variants"].items():
                    rows += time_lm_head(gpu, dk, vk, cfg7, kernels["lm"], log, name)
                return rows

            run_part("lm_head timing", results, log, lm_time)
            table += results["lm_head timing"] or []
        kernels.pop("lm", None)  # its 3.3 GB before the attention caches
        torch.cuda.empty_cache()
        run_part("attention timing", results, log, lambda: time_attention(gpu, gen, log))
        table += results["attention timing"] or []
    if table:
        log(f"\n{'kernel':10s} {'ctx/H':>6s} {'M':>3s} {'form':5s} {'us':>9s} {'x M=1':>6s} "
            f"{'TB/s':>6s}   (7B shapes; M = 1: attn_decode / lm_head_argmax; attention: "
            "both forms of attn_rows)")  # fmt: skip
        for kind, ctx, m, form, us, ratio, tb in table:
            log(f"{kind:10s} {ctx:6d} {m:3d} {form:5s} {us:9.2f} {ratio:6.2f} {tb:6.2f}")
    names = ["lm_head", *(f"lm_head {t}" for t in variants or {}), "attention"]
    verdict = {k: results.get(k) for k in names if k.split()[0] in parts}
    words = [f"{k} {'PASS' if v else 'FAIL'}" for k, v in verdict.items()]
    log("RESULT " + (", ".join(words) or "timing only"))
    return 0 if all(verdict.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="lm_head,attention,timing",
                    help="comma list: lm_head, attention, timing")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log directory")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=v,NAME=v (repeatable): lm_head_rows also built on the "
                         "geometry with these values, checked and timed")  # fmt: skip
    args = ap.parse_args()
    try:
        variants = {t: DEFAULT_GEOMETRY.override_text(t) for t in args.variant}
    except ValueError as exc:
        ap.error(f"--variant: {exc}")
    parts = set(args.parts.split(","))
    with gpu_session(args.out, "attn_rows.log") as (gpu, log):
        return run(parts, gpu, log, variants)


if __name__ == "__main__":
    sys.exit(main())
