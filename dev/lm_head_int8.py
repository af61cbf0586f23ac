"""The int8 lm_head (lm_head_argmax_q8, `pack --lm-head int8`): validate against torch, then
time it beside the fp16 kernel (sm_90 GPU).

    PYTHONPATH=. python3 dev/lm_head_int8.py [--files FP16.nanoqwen INT8.nanoqwen]
                                             [--parts check,time,step] [--out DIR]

check (fresh random inputs, the seed printed; logits poisoned with NaN before each launch):
the 7B (V 152064, H 3584) and 0.5B (V 151936, H 896: a lane's last x vector is partial) heads,
rows scaled 0.05..3 so the row scales differ, x with a few large outliers. At V = 1, 3, 17,
111, 4097 and the full vocabulary: logits[:V] against xn @ (q * scale)^T in float32 (xn the
kernel's fp16 RMSNorm, the dequantized head what the reference model reads), logits[V:] still
NaN, the key's id torch's argmax or a stated near-tie (within LOGIT_TOL of the max) and its
value the logit written for that id. The fp16 kernel is checked the same way at the full V,
and the int8 head's argmax against the fp16 head's over 64 x rows is printed (information).

time (the 7B head, CUDA graphs of 5 launches, medians of 5; harness.bench.time_graph):
lm_head_argmax (fp16, 1.09 GB) and lm_head_argmax_q8 (int8, 0.55 GB), each in microseconds
and TB/s, beside a device-to-device copy of the fp16 head (read + write) in the same run.

step (only with --files): each file's whole decode step at context 513 and its lm_head launch
(harness.bench.kernel_breakdown, as `bench --kernels` reports it). Make the pair with
    nanoqwen pack --synthetic 7b -o /tmp/7b.nanoqwen
    nanoqwen pack /tmp/7b.nanoqwen -o /tmp/7b-int8.nanoqwen --lm-head int8

Each part runs on its own: a failure prints its traceback and the next part runs. The table
and RESULT come last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from nanoqwen.config import preset
from nanoqwen.cuda.decode import DecodeKernels
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.gpu_script import gpu_session, run_part
from nanoqwen.harness.prefill_checks import wait_or_die
from nanoqwen.quant import Q8_MAX

CHECK_PRESETS = ("7b", "0.5b")
CHECK_VS = (1, 3, 17, 111, 4097)  # and the full vocabulary
# fp32 sums of up to 3584 products in another order, one fp32 multiply by the scale, and x's
# fp16 RMSNorm from an rsqrtf that may differ from torch's by an ulp: logits of order 1 agree
# to ~1e-5; 2e-3 leaves room and still catches a wrong byte (a step is ~1e-2 of a logit).
LOGIT_TOL = 2e-3
STEP_CONTEXT = 513


def decode_key(key: int) -> tuple[int, float]:
    """(id, logit) of a packed argmax key (common.cuh argmax_key)."""
    import numpy as np

    bits = key >> 32
    bits = bits & 0x7FFFFFFF if bits & 0x80000000 else ~bits & 0xFFFFFFFF
    return 0xFFFFFFFF - (key & 0xFFFFFFFF), float(np.array([bits], np.uint32).view(np.float32)[0])


def rmsnorm_ref(x, w, eps):
    """fp16(x * rsqrt(mean(x^2) + eps) * w), fp32 math, one rounding (the kernel's)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).half()


class Head:
    """A random head of `cfg`'s shape on the GPU: fp16 w, its int8 rows q and fp32 scales (the
    rule of quant.quantize_rows_int8), the norm weight, x, logits and the key."""

    def __init__(self, cfg, gen):
        v, h = cfg.vocab_size, cfg.hidden_size
        rows = 0.05 + 2.95 * torch.rand(v, 1, generator=gen, device="cuda")
        self.w = (0.02 * rows * torch.randn(v, h, generator=gen, device="cuda")).half()
        wf = self.w.float()
        self.scale = (wf.abs().amax(1) / Q8_MAX).contiguous()
        safe = torch.where(self.scale > 0, self.scale, torch.ones_like(self.scale))
        self.q = torch.round(wf / safe[:, None]).clamp(-Q8_MAX, Q8_MAX).to(torch.int8)
        self.deq = self.q.float() * self.scale[:, None]  # what the reference model reads
        self.norm = (1 + 0.1 * torch.randn(h, generator=gen, device="cuda")).half()
        self.x = torch.randn(h, generator=gen, device="cuda").half()
        self.x[torch.randint(0, h, (4,), generator=gen, device="cuda")] = 20.0  # outliers
        self.logits = torch.empty(v, device="cuda")
        self.key = torch.zeros(1, dtype=torch.int64, device="cuda")

    def launch(self, dk, int8: bool, rows=None, stream=None):
        p = (self.x.data_ptr(), self.norm.data_ptr())
        out = (self.logits.data_ptr(), self.key.data_ptr())
        if int8:
            dk.lm_head_q8(*p, self.q.data_ptr(), self.scale.data_ptr(), *out, stream=stream,
                          rows=rows)  # fmt: skip
        else:
            dk.lm_head(*p, self.w.data_ptr(), *out, stream=stream, rows=rows)


def check_one(gpu, dk, head: Head, int8: bool, v: int, ref_all, log) -> bool:
    head.logits.fill_(float("nan"))
    head.key.zero_()
    head.launch(dk, int8, rows=v)
    what = f"{'int8' if int8 else 'fp16'} V={v}"
    wait_or_die(gpu, f"lm_head {what}")
    got, ref = head.logits[:v], ref_all[:v]
    err = (got - ref).abs().max().item() if got.isfinite().all() else float("inf")
    guard = bool(head.logits[v:].isnan().all())
    kid, kval = decode_key(head.key.item() & 0xFFFFFFFFFFFFFFFF)
    best = int(ref.argmax())
    near = kid != best and 0 <= kid < v and ref[kid].item() >= ref[best].item() - LOGIT_TOL
    key_ok = (kid == best or near) and 0 <= kid < v and kval == got[kid].item()
    bad = err > LOGIT_TOL or not guard or not key_ok
    log(
        f"  {'*' if bad else ' '} {what:12s}: max|err| {err:.2e} (tol {LOGIT_TOL}), argmax "
        f"{kid} vs {best}{' (near-tie)' if near else ''}, key value matches: "
        f"{kval == got[kid].item() if 0 <= kid < v else False}, rows past V untouched: {guard}"
    )
    return not bad


def check(gpu, gen, log) -> bool:
    ok = True
    for name in CHECK_PRESETS:
        cfg = preset(name)
        dk = DecodeKernels(gpu, cfg)
        head = Head(cfg, gen)
        xn = rmsnorm_ref(head.x, head.norm, cfg.rms_norm_eps).float()
        ref8 = head.deq @ xn
        for v in (*CHECK_VS, cfg.vocab_size):
            ok &= check_one(gpu, dk, head, True, v, ref8, log)
        ok &= check_one(gpu, dk, head, False, cfg.vocab_size, head.w.float() @ xn, log)
        xs = torch.randn(64, cfg.hidden_size, generator=gen, device="cuda").half()
        xs = rmsnorm_ref(xs, head.norm, cfg.rms_norm_eps).float()
        agree = ((xs @ head.deq.t()).argmax(1) == (xs @ head.w.float().t()).argmax(1)).float()
        log(
            f"  {name}: int8 head's argmax = fp16 head's on {100 * agree.mean().item():.0f}% of "
            "64 random x (random weights; real-model figures: dev/lm_head_quality.py)"
        )
        del head
        torch.cuda.empty_cache()
    return ok


def time_heads(gpu, gen, log) -> list[tuple]:
    cfg = preset("7b")
    dk, head = DecodeKernels(gpu, cfg), Head(cfg, gen)
    v, h = cfg.vocab_size, cfg.hidden_size
    rows = []
    for label, int8, nbytes in (("fp16", False, v * h * 2), ("int8", True, v * (h + 4))):
        us = 1e6 * time_graph(gpu, lambda s, i=int8: head.launch(dk, i, stream=s), 5)
        rows.append((f"lm_head {label}", us, nbytes / us / 1e6))
        log(f"lm_head {label}: {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s")
    dst = torch.empty_like(head.w)
    times = []
    for _ in range(6):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(head.w)
        e1.record()
        e1.synchronize()
        times.append(1e3 * e0.elapsed_time(e1))
    us = sorted(times[1:])[2]
    rows.append(("copy fp16 head", us, 2 * v * h * 2 / us / 1e6))
    log(f"d2d copy of the fp16 head: {us:8.2f} us  {2 * v * h * 2 / us / 1e6:5.2f} TB/s (r+w)")
    return rows


def time_steps(files, log) -> list[tuple]:
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.harness.bench import kernel_breakdown

    rows = []
    for path in files:
        with NanoqwenFile(path) as f:
            e = CudaBackend(f, max_context=STEP_CONTEXT + 64)
            try:
                res = kernel_breakdown(e, STEP_CONTEXT - 1, 20)
            finally:
                e.close()
        per = {r["label"]: r["us"] / r["count"] for r in res["rows"]}
        step = res["whole_step"]["us"]
        rows.append((f"step {f.lm_head} {os.path.basename(path)}", step, per.get("lm_head", 0)))
        log(f"{path} ({f.lm_head} head): whole step {step:8.1f} us, lm_head "
            f"{per.get('lm_head', 0):7.1f} us")  # fmt: skip
    return rows


def run(args, gpu, log) -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} seed {seed} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    parts, results = set(args.parts.split(",")), {}
    if "check" in parts:
        run_part("check", results, log, lambda: check(gpu, gen, log))
    torch.cuda.empty_cache()
    if "time" in parts:
        run_part("time", results, log, lambda: time_heads(gpu, gen, log))
    torch.cuda.empty_cache()
    if "step" in parts and args.files:
        run_part("step", results, log, lambda: time_steps(args.files, log))
    log(f"\n{'what':44s} {'us':>9s} {'TB/s | lm_head us':>18s}   ({gpu.name})")
    for name in ("time", "step"):
        for what, us, extra in results.get(name) or []:
            log(f"{what:44s} {us:9.2f} {extra:18.2f}")
    words = [f"{k} {'PASS' if results[k] else 'FAIL'}" for k in ("check",) if k in results]
    words += [f"{k} {'ran' if results[k] else 'FAILED'}" for k in ("time", "step") if k in results]
    log("RESULT " + ", ".join(words))
    return 0 if all(results.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--files",
        nargs=2,
        metavar=("FP16", "INT8"),
        default=None,
        help="two packed files (fp16 and int8 heads) for the whole-step part",
    )
    ap.add_argument("--parts", default="check,time,step", help="comma list: check, time, step")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log directory")
    args = ap.parse_args()  # fmt: skip
    with gpu_session(args.out, "lm_head_int8.log") as (gpu, log):
        return run(args, gpu, log)


if __name__ == "__main__":
    sys.exit(main())
