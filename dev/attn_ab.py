"""Prefill attention A/B: this tree's kernel against earlier revisions, in one process (sm_90).

Validates this tree's prefill_attention.cu, checks it against the same file at an earlier git
revision bit for bit, then times both (and the contiguous-K/V kernel it replaced) interleaved.

    PYTHONPATH=. python3 dev/attn_ab.py [--old-rev 19a1c93] [--contig-rev 6c796b1]
        [--timed-t 512,2048,8192,32704] [--reps 7] [--out DIR]

The old kernels are compiled from `git show REV:nanoqwen/kernels/prefill_attention.cu` (or
--old-source / --contig-source FILE) through nanoqwen.cuda.jit with this tree's generated
header and kernels/*.cuh (a warning says when those differ from REV's). "old" (--old-rev) has
this tree's signature and launches through the same PrefillKernels.attention host code;
"contig" (--contig-rev, "" to skip) is the kernel that read contiguous K/V copies
(q, k, v, out, T; whole prompts only), the time the paged kernel is measured against.

Parts (a failure in one is logged with its traceback and the others still run):
1. validate: nanoqwen.harness.prefill_checks.check_attention for this tree's kernel at every
   (start, T) of ATTN_CASES (whole prompts of awkward length, new tokens after a cached prefix,
   key splits) on the 7B (28:4 heads, D 128), 32B (40:8), a 2:1 D 128 and the tiny (D 64)
   shapes, fresh random inputs, NaN-poisoned outputs; the old kernel on the 7B as well.
2. same bits: old and new on the same inputs at SAME_BITS_CASES, 7B and 32B shapes: the outputs
   must be bit-identical (the default old revision differs from this tree in how the K/V loads
   are issued, not in the math).
3. time: old, new and contig at each T of --timed-t (7B shapes; 32B shapes at 512), start 0
   (a cold prompt), interleaved old/new/contig for --reps rounds (the order rotating), each a
   timing of `batch` launches queued behind a spin kernel (dev/prefill_check.py time_ms);
   medians. TFLOP/s counts the causal half: 4 HQ D T (T + 1) / 2.

Printed last: each part's status, then the table (shape, T, us of each kernel, new/old,
TFLOP/s). A JSON summary goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from prefill_check import time_ms

from nanoqwen.config import ModelConfig, preset
from nanoqwen.cuda import jit, registry
from nanoqwen.cuda.device import Gpu
from nanoqwen.cuda.prefill import PrefillKernels
from nanoqwen.harness.gpu_script import gpu_session, run_part
from nanoqwen.harness.prefill_checks import check_attention, paged_kv, wait_or_die

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "nanoqwen/kernels/prefill_attention.cu"
TILES = registry.GEMM_TILES[:1]  # attention only: one GEMM tile (the launcher's workspace)
SAME_BITS_CASES = ((0, 1), (0, 100), (0, 1000), (37, 64), (100, 200), (4000, 1), (8190, 64))
TIMED_32B_T = 512
TARGET_MS = 1.0  # launches queued per timing: enough for about this long, at most 20


def source_at(rev: str, log) -> str:
    """prefill_attention.cu at git revision `rev`, warning when the headers it is compiled
    with (this tree's kernels/*.cuh) differ from that revision's."""
    # safe.directory: a copied checkout may belong to another user than the one running this
    git = ["git", "-c", "safe.directory=*", "-C", str(ROOT)]
    show = subprocess.run([*git, "show", f"{rev}:{KERNEL}"], capture_output=True, text=True)
    if show.returncode != 0:
        raise RuntimeError(f"git show {rev}:{KERNEL} failed: {show.stderr.strip()}")
    headers = [str(p.relative_to(ROOT)) for p in sorted(jit.KERNEL_DIR.glob("*.cuh"))]
    diff = subprocess.run([*git, "diff", "--quiet", rev, "--", *headers])
    if diff.returncode != 0:
        log(f"WARNING: kernels/*.cuh differ from {rev}: its kernel is built with this tree's")
    return show.stdout


def compile_attention(text: str, cfg: ModelConfig, names: list[str]):
    return jit.compile_module(registry.PREFILL_ATTENTION, names, registry.header(cfg), source=text)


def with_old_attention(gpu, cfg: ModelConfig, text: str, log) -> PrefillKernels:
    """A PrefillKernels whose attention and merge kernels are compiled from `text` (the same
    signatures as this tree's), launched by this tree's host code."""
    pk = PrefillKernels(gpu, cfg, tiles=TILES)
    specs = [pk.specs[k] for k in ("prefill_attention", "prefill_attention_merge")]
    mod = compile_attention(text, cfg, [s.expression for s in specs])
    with gpu.guard("loading the old attention"):
        for spec in specs:
            kernel = mod.kernel(spec.expression)
            gpu.set_max_dynamic_smem(kernel, spec.smem)
            pk.kernels[spec.key] = kernel
    pk.old_module = mod  # the loaded image lives as long as its kernels
    r = mod.resources()[specs[0].expression]
    log(f"  old {cfg.name}: {r.registers} regs, {r.spill_bytes} B spilled, "
        f"{pk.ctas_per_sm('prefill_attention')} CTA/SM")  # fmt: skip
    return pk


class Contig:
    """The contiguous-K/V kernel: prefill_attention<D, HQ, HKV>(q, k, v, out, T), grid (HQ,
    ceil(T / 64)), q/out fp16 [T, HQ, D], k/v fp16 [T, HKV, D] row-major."""

    def __init__(self, gpu, cfg: ModelConfig, text: str, log) -> None:
        (spec,) = (
            s for s in registry.prefill_specs(cfg, tiles=TILES) if s.key == "prefill_attention"
        )
        self.gpu, self.cfg, self.spec = gpu, cfg, spec
        self.mod = compile_attention(text, cfg, [spec.expression])
        with gpu.guard("loading the contiguous attention"):
            self.kernel = self.mod.kernel(spec.expression)
            gpu.set_max_dynamic_smem(self.kernel, spec.smem)
        r = self.mod.resources()[spec.expression]
        log(f"  contig {cfg.name}: {r.registers} regs, {r.spill_bytes} B spilled")

    def __call__(self, q, k, v, out, T: int) -> None:
        grid = (self.cfg.num_heads, -(-T // registry.DEFAULT_GEOMETRY.prefill_attn_tile), 1)
        ptrs = [int(x.data_ptr()) for x in (q, k, v, out)]
        self.gpu.launch(self.kernel, grid, self.spec.threads, *ptrs, np.int32(T),
                        smem=self.spec.smem, pdl=True)  # fmt: skip


def inputs(cfg: ModelConfig, start: int, T: int, gen):
    """Random q [T, HQ, D], K's parts (this tree's cache format) and v [start + T, HKV, D]
    fp16, and their paged caches."""
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(T, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    k_parts = [torch.randn(start + T, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
               for _ in range(registry.DEFAULT_GEOMETRY.k_parts)]  # fmt: skip
    v = torch.randn(start + T, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
    return q, sum(x.float() for x in k_parts).half(), v, paged_kv(k_parts, v, gen)


def same_bits(pairs, gen, log) -> bool:
    """Old and new outputs on the same inputs, bit for bit, at every SAME_BITS_CASES case."""
    ok_all = True
    for cfg, old, new in pairs:
        for start, t in SAME_BITS_CASES:
            q, _, _, (kc, vc, table) = inputs(cfg, start, t, gen)
            outs = []
            for pk in (old, new):
                out = torch.full_like(q, float("nan"))
                torch.cuda.synchronize()
                pk.attention(q, kc, vc, table, out, start, t)
                wait_or_die(pk.gpu, f"attention {cfg.name} start={start} T={t}")
                outs.append(out)
            ok = bool(torch.isfinite(outs[1]).all()) and torch.equal(outs[0], outs[1])
            ok_all &= ok
            if not ok:
                diff = (outs[0].float() - outs[1].float()).abs().max().item()
                log(f"SAME-BITS FAIL {cfg.name} start={start} T={t} splits="
                    f"{new.splits(start, t)}: max |old - new| {diff:.3g}")  # fmt: skip
    log(f"same bits (old vs new, {len(pairs)} shapes x {len(SAME_BITS_CASES)} cases): "
        f"{'pass' if ok_all else 'FAIL'}")  # fmt: skip
    return ok_all


def time_case(gpu, kernels: dict, cfg: ModelConfig, T: int, reps: int, gen) -> dict:
    """Median us a launch of each kernel at a cold prompt of T tokens, interleaved."""
    q, k, v, (kc, vc, table) = inputs(cfg, 0, T, gen)
    out = torch.empty_like(q)
    calls = {}
    for name, kern in kernels.items():
        if isinstance(kern, Contig):
            calls[name] = lambda kern=kern: kern(q, k, v, out, T)
        else:
            calls[name] = lambda kern=kern: kern.attention(q, kc, vc, table, out, 0, T)
    est_ms = 1.1 * (T / 8192) ** 2 + 0.01
    batch = max(1, min(20, round(TARGET_MS / est_ms)))
    for fn in calls.values():
        time_ms(gpu, fn, reps=1, batch=batch, warmup=3)
    runs = {name: [] for name in calls}
    names = list(calls)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            runs[name].append(time_ms(gpu, calls[name], reps=1, batch=batch, warmup=0))
    flop = 4 * cfg.num_heads * cfg.head_dim * T * (T + 1) / 2
    return {n: (statistics.median(r) * 1e3, flop / statistics.median(r) / 1e9)
            for n, r in runs.items()}  # fmt: skip


def build(gpu, args, log) -> dict:
    """This tree's kernels ("new"), and "old" / "contig" where their sources can be had, for
    the 7B and the 32B shapes: {kind: {model name: launcher}}."""
    models = (preset("7b"), preset("32b"))
    built: dict[str, dict] = {"new": {}, "old": {}, "contig": {}}
    for cfg in models:
        pk = built["new"][cfg.name] = PrefillKernels(gpu, cfg, tiles=TILES)
        spec = pk.specs["prefill_attention"]
        r = pk.resources[spec.expression]
        log(f"  new {cfg.name}: {r.registers} regs, {r.spill_bytes} B spilled, smem {spec.smem} B, "
            f"{pk.ctas_per_sm('prefill_attention')} CTA/SM")  # fmt: skip
    for kind, rev, path in (("old", args.old_rev, args.old_source),
                            ("contig", args.contig_rev, args.contig_source)):  # fmt: skip
        if not (rev or path):
            continue
        try:
            text = Path(path).read_text() if path else source_at(rev, log)
            for cfg in models:
                make = with_old_attention if kind == "old" else Contig
                built[kind][cfg.name] = make(gpu, cfg, text, log)
        except Exception:  # noqa: BLE001 - the other kernels are still worth validating and timing
            log(f"{kind} ({path or rev}) not built:\n{traceback.format_exc()}")
    return built


def validate(built, gen, log) -> bool:
    gqa2 = ModelConfig("gqa2-d128", 1000, 512, 512, 1, 4, 2, 128)
    configs = [(preset(n), pk) for n, pk in built["new"].items()]
    gpu = built["new"]["7b"].gpu
    configs += [(c, PrefillKernels(gpu, c, tiles=TILES)) for c in (gqa2, preset("tiny"))]
    log("this tree's attention against PyTorch:")
    ok, _ = check_attention(configs, gen, log)
    if "7b" in built["old"]:
        log("the old attention against PyTorch (7B):")
        ok_old, _ = check_attention([(preset("7b"), built["old"]["7b"])], gen, log)
        ok &= ok_old
    return ok


def time_all(gpu, built, args, gen, rows: list, log) -> None:
    cases = [("7b", t) for t in args.timed_t] + [("32b", TIMED_32B_T)]
    for model, t in cases:
        kernels = {k: built[k][model] for k in ("old", "new", "contig") if model in built[k]}
        result = time_case(gpu, kernels, preset(model), t, args.reps, gen)
        rows.append((model, t, result))
        log(f"  {model} T={t}: " + ", ".join(f"{k} {us:.1f} us" for k, (us, _) in result.items()))


def table(rows, log) -> None:
    kinds = [k for k in ("old", "new", "contig") if any(k in r for _, _, r in rows)]
    head = f"{'shape':5s} {'T':>6s} " + " ".join(f"{k + ' us':>10s}" for k in kinds)
    head += f" {'new/old':>8s} {'new/contig':>10s}  TFLOP/s " + " / ".join(kinds)
    log(head)
    for model, t, r in rows:
        us = " ".join(f"{r[k][0]:10.1f}" if k in r else f"{'-':>10s}" for k in kinds)
        ratio = [f"{r['new'][0] / r[k][0]:.3f}" if k in r and "new" in r else "-"
                 for k in ("old", "contig")]  # fmt: skip
        tf = " / ".join(f"{r[k][1]:.0f}" if k in r else "-" for k in kinds)
        log(f"{model:5s} {t:6d} {us} {ratio[0]:>8s} {ratio[1]:>10s}  {tf}")


def run(args, gpu: Gpu, log) -> int:
    log(f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    gen = torch.Generator(device="cuda")
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; logged to replay
    gen.manual_seed(seed)
    log(f"seed {seed}")
    results, rows = {}, []
    built = run_part("build", results, log, lambda: build(gpu, args, log))
    if built is not None:
        run_part("validate", results, log, lambda: validate(built, gen, log))
        if built["old"]:
            pairs = [(preset(n), built["old"][n], built["new"][n]) for n in built["old"]]
            run_part("same-bits", results, log, lambda: same_bits(pairs, gen, log))
        run_part("time", results, log, lambda: time_all(gpu, built, args, gen, rows, log))
    # a part that raised is an ERROR, one that returned False a FAIL
    status = {k: "ERROR" if v is None else "FAIL" if v is False else "PASS"
              for k, v in results.items()}  # fmt: skip
    summary = {"status": status, "seed": seed, "rows": rows}
    (Path(args.out) / "attn_ab.json").write_text(json.dumps(summary, indent=1))
    log("\nRESULT " + " ".join(f"{k} {v}" for k, v in status.items()))
    table(rows, log)
    return 0 if status and all(v == "PASS" for v in status.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-rev", default="19a1c93", help="git revision of the old kernel")
    ap.add_argument("--old-source", default="", help="the old kernel's file (instead of git)")
    ap.add_argument("--contig-rev", default="6c796b1",
                    help="revision of the contiguous-K/V kernel ('' to skip)")  # fmt: skip
    ap.add_argument("--contig-source", default="", help="its file (instead of git)")
    ap.add_argument("--timed-t", default="512,2048,8192,32704", help="T values timed (7B)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds; medians")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log/JSON directory")
    args = ap.parse_args()
    args.timed_t = tuple(int(t) for t in args.timed_t.split(","))
    with gpu_session(args.out, "attn_ab.log") as (gpu, log):
        return run(args, gpu, log)


if __name__ == "__main__":
    sys.exit(main())
