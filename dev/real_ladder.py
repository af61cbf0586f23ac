"""The ladder's real-weight tiers and the massive-channel check, on an sm_90 GPU.

    PYTHONPATH=. python3 dev/real_ladder.py REAL.nanoqwen [--out /tmp/real_ladder]

Parts, each on its own (one that fails is logged and the others still run):
  real layer   harness.validate_real.real_layer_tier: layer 0 on a code window, decode path
  real graph   harness.validate_real.real_graph_tier: teacher-forced code windows (decode and
               prefill paths) and greedy generations, gates of ladder.*.real
  planted      a synthetic model with REAL's config (so REAL's compiled kernels) and residual
               channels of 1e4..6e4 on sink tokens (harness.planted), packed here: the engine's
               logits (prefill and decode paths) finite and within the synthetic graph gates of
               the float32 reference, and its residual row after the last layer (decode path,
               a sink token) finite and as large as the reference's
  time         the real model's decode step (nanoqwen bench's run_bench, 512-token prompt,
               median inter-token latency)
Prints a RESULT table last.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from nanoqwen.harness import load_protocol, planted
from nanoqwen.harness import validate_real as vr
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.harness.validate import _reference

PLANTED_PROMPTS = 8
PLANTED_TOKENS = 40


def real_tiers(engine, f, ladder, log) -> list:
    checks = vr.real_layer_tier(engine, f, ladder["layer"]["real"])
    checks += vr.real_graph_tier(engine, f, ladder["graph"]["real"])
    for c in checks:
        log(f"{c.tier:6} {'PASS' if c.ok else 'FAIL'}  {c.name}  {c.detail}")
    return checks


def planted_check(real_cfg, gates: dict, out_dir: str, log) -> dict:
    """Pack the planted model with the real model's config; compare the engine with the float32
    reference on prompts that hold sink tokens."""
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile

    path = os.path.join(out_dir, "planted.nanoqwen")
    planted.pack_planted(real_cfg, path)  # the real config: its kernels, no compile
    with NanoqwenFile(path) as f:
        cfg = f.config
        ref = _reference(f, "cuda" if torch.cuda.is_available() else "cpu")
        prompts = planted.sink_prompts(cfg, np.random.default_rng(), PLANTED_PROMPTS,
                                       PLANTED_TOKENS)  # fmt: skip
        engine = CudaBackend(f, max_context=4096)
        res = {"finite": True, "agree": 0, "total": 0, "dlogit": 0.0}
        try:
            for ids in prompts:
                want = ref.logits(ids)
                for got in (engine.logits(ids), engine.decode_logits(ids)):
                    res["finite"] &= bool(np.isfinite(got).all())
                    res["agree"] += int((got.argmax(-1) == want.argmax(-1)).sum())
                    res["total"] += len(ids)
                    dl = np.abs(got - want).max(-1) / want.std(-1)
                    res["dlogit"] = max(res["dlogit"], float(dl.max()))
            # The engine's own residual row of a sink token after every layer (decode path).
            row = engine.decode_hidden(planted.SINK_TOKENS[0], 0, layers=cfg.num_layers)
            res["sink_row_max"] = float(np.abs(row).max())
            res["finite"] &= bool(np.isfinite(row).all())
        finally:
            engine.close()
    rate = res["agree"] / res["total"]
    res["ok"] = (res["finite"] and rate >= gates["top1_agreement"]
                 and res["dlogit"] <= gates["logit_max_over_std"]
                 and res["sink_row_max"] >= 1.0e4)  # fmt: skip
    log(
        f"planted: finite {res['finite']}, top1 {rate:.4f} ({res['agree']}/{res['total']}), "
        f"max|dlogit|/std {res['dlogit']:.4f}, sink row max |x| {res['sink_row_max']:.0f}"
    )
    return res


def time_step(engine, log) -> dict:
    from nanoqwen.harness.bench import run_bench

    r = run_bench(engine, prompt_len=512, gen_len=64, warmup=2, runs=3)
    res = {"itl_ms": r["itl_ms"], "bytes": r["bytes_per_token"]}
    log(f"time: ITL {r['itl_ms']:.3f} ms, {r['bytes_per_token'] / 1e6:.1f} MB a token")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a real .nanoqwen file (pack of a GGUF or HF checkpoint)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "real_ladder"),
                    help="folder for the log and the planted model")  # fmt: skip
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.harness.real_text import is_real

    fh = open(os.path.join(args.out, "real_ladder.log"), "w")  # noqa: SIM115 (whole run)

    def log(msg: str) -> None:
        print(msg, flush=True)
        fh.write(msg + "\n")
        fh.flush()

    ladder, results = load_protocol()["ladder"], {}
    with NanoqwenFile(args.file) as f:
        if not is_real(f):
            log(f"note: {args.file} is marked synthetic; its real-text tiers still run")
        engine = CudaBackend(f, max_context=4096)
        try:
            run_part("real tiers", results, log, lambda: real_tiers(engine, f, ladder, log))
            run_part("time", results, log, lambda: time_step(engine, log))
        finally:
            engine.close()
        cfg = f.config
    run_part("planted", results, log,
             lambda: planted_check(cfg, ladder["graph"], args.out, log))  # fmt: skip
    log("\nRESULT")
    tiers = results["real tiers"]
    for c in tiers or []:
        log(f"  {'PASS' if c.ok else 'FAIL'}  {c.tier:5} {c.name}: {c.detail}")
    if tiers is None:
        log("  FAIL  real tiers: raised (see the log above)")
    p = results["planted"]
    if p is None:
        log("  FAIL  planted: raised (see the log above)")
    else:
        log(f"  {'PASS' if p['ok'] else 'FAIL'}  planted {cfg.num_layers}-layer model: finite "
            f"{p['finite']}, top1 {p['agree']}/{p['total']}, max|dlogit|/std {p['dlogit']:.4f}, "
            f"sink residual max {p['sink_row_max']:.0f}")  # fmt: skip
    t = results["time"]
    if t is not None:
        log(f"  INFO  decode ITL {t['itl_ms']:.3f} ms at 512 ({t['bytes']} B a token)")
    ok = tiers is not None and all(c.ok for c in tiers) and p is not None and p["ok"]
    log(f"  {'ALL PASS' if ok else 'SOME FAILED'}")
    fh.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
