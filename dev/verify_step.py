"""The multi-row verify step composed from its kernels on a .nanoqwen file: checked against the
decode step, then timed by M (sm_90 GPU). Issue #26's step-cost table.

    PYTHONPATH=. python3 dev/verify_step.py FILE [--context 512] [--ms 1,2,4,8,16] [--json PATH]

The verify step feeds M tokens at the consecutive positions start .. start + M - 1 of one
sequence (speculative decoding: the token of the step and M - 1 drafts) through one pass over
the weights: embed the M tokens; per layer gemv_rows q/k/v (RMSNorm, bias, RoPE, K/V into the
pages at each row's position), attention_rows (causal inside the block), gemv_rows o (+
residual), gate/up (RMSNorm, SwiGLU), down (+ residual); then lm_head_rows (final RMSNorm,
logits, each row's argmax key).

Check: the engine's own prefill writes the K/V of `context` random tokens; then at each M, the
verify step over M random tokens at positions context .. context + M - 1 against M decode steps
of the same tokens (forward.decode_step, one row at a time): each row's top-1 must be the
decode step's unless the decode step's top-2 margin is under TIE (a near-tie, counted), and
max |dlogit| / std(logits) is printed. The two paths round differently (the decode GEMV's
offset form, attention's split merges), so the logits differ in the fp16 noise, not more.

Time: the verify step at each M as a CUDA graph of 20 copies (harness.bench.time_graph, median
of 5 launches), beside the decode step's forward (embed, layers, lm_head; no sampler) timed the
same way: microseconds, the ratio to the decode step, and milliseconds per token if every row
were accepted. RESULT last.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from nanoqwen.cuda.decode import DecodeKernels, VerifyKernels
from nanoqwen.engine import CudaBackend
from nanoqwen.engine.decode_loop import DecodeState
from nanoqwen.engine.weights import check_speculation_head
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.gpu_script import run_part

TIE = 0.05  # logit stds: a top-2 margin under this is a near-tie (fp16 noise can flip it)
MAX_DLOGIT = 0.05  # max |dlogit| / std between the two paths (the ladder's graph-tier bound)


class VerifyStep:
    """The composed verify step over an engine's weights, KV cache and RoPE table, with its own
    buffers for up to 16 rows: tokens int32 [16], pos int32 [16], start int32, x fp16 [16, H],
    q and attn fp16 [16, q], mlp fp16 [16, I], logits fp32 [16, V], keys u64 [16]."""

    ROWS = 16

    def __init__(self, engine: CudaBackend) -> None:
        self.e, c, gpu = engine, engine.config, engine.gpu
        check_speculation_head(engine.weights.lm_head_format)  # lm_head_rows reads fp16 rows
        self.rows = DecodeKernels(gpu, c, engine.kernels.geometry, rows=True)
        self.verify = VerifyKernels(gpu, c, engine.kernels.geometry)
        self.attn_scratch = self.verify.attention_scratch()
        n = self.ROWS
        sizes = {"tokens": n * 4, "pos": n * 4, "start": 4, "x": n * c.hidden_size * 2,
                 "q": n * c.q_size * 2, "attn": n * c.q_size * 2,
                 "mlp": n * c.intermediate_size * 2, "logits": n * c.vocab_size * 4,
                 "keys": n * 8}  # fmt: skip
        self.buf = {k: gpu.alloc(b, f"verify {k}").ptr for k, b in sizes.items()}

    def set_rows(self, tokens: np.ndarray, start: int) -> None:
        """The step's input: tokens at positions start .. start + len(tokens) - 1 (synchronous)."""
        m, gpu = len(tokens), self.e.gpu
        gpu.upload(self.buf["tokens"], tokens.astype(np.int32))
        gpu.upload(self.buf["pos"], np.arange(start, start + m, dtype=np.int32))
        gpu.upload(self.buf["start"], np.array([start], np.int32))
        gpu.memset(self.buf["keys"], 0, self.ROWS * 8)
        gpu.sync("verify rows")

    def step(self, m: int, stream=None) -> None:
        """The verify step over the first m rows (module docstring)."""
        e, b, k, v = self.e, self.buf, self.rows, self.verify
        f, w, kv = e.forward, e.weights, e.kv
        e.kernels.embed(b["tokens"], w.embed, b["x"], m, stream=stream)
        for i, L in enumerate(w.layers):
            k.gemv_rows("qkv", m, b["x"], L.input_norm, L.qkv_w, L.qkv_s, b["q"], bias=L.qkv_b,
                        pos=b["pos"], rope=f.rope, pages=kv.page_table, page_stride=0,
                        kc=kv.k[i], vc=kv.v[i], stream=stream)  # fmt: skip
            v.attention_rows(b["q"], kv.k[i], kv.v[i], kv.page_table, b["start"], m,
                             self.attn_scratch, b["attn"], stream=stream)  # fmt: skip
            k.gemv_rows("o", m, b["attn"], 0, L.o_w, L.o_s, b["x"], stream=stream)
            k.gemv_rows("gate_up", m, b["x"], L.post_norm, L.gate_up_w, L.gate_up_s, b["mlp"],
                        stream=stream)  # fmt: skip
            k.gemv_rows("down", m, b["mlp"], 0, L.down_w, L.down_s, b["x"], stream=stream)
        v.lm_head_rows(b["x"], w.final_norm, w.lm_head, b["logits"], b["keys"], m, stream=stream)

    def logits(self, m: int) -> np.ndarray:
        out = np.empty((m, self.e.config.vocab_size), np.float32)
        return self.e.gpu.download(self.buf["logits"], out)


def prefill_context(e: CudaBackend, ids: np.ndarray) -> None:
    """K/V of ids at positions 0 .. len(ids) - 1 through the engine's prefill (the whole pool
    mapped: set_decode_state)."""
    e.set_decode_state(DecodeState(token=int(ids[-1]), pos=len(ids) - 1))
    with e.gpu.guard("prefill the context"):
        e.loop.stage_ids(ids, e.forward.scratch(len(ids))["ids"])
        e.forward.prefill(len(ids))
        e.gpu.sync("prefill the context")


def decode_rows(e: CudaBackend, tokens: np.ndarray, start: int) -> np.ndarray:
    """float32 [M, V]: the decode step's logits for tokens at start .. start + M - 1."""
    out = np.empty((len(tokens), e.config.vocab_size), np.float32)
    with e.gpu.guard("decode rows"):
        for r, tok in enumerate(tokens):
            e.loop.set_state(DecodeState(token=int(tok), pos=start + r))
            e.forward.decode_step()
            e.gpu.download(e.forward.logits, out[r])
        e.gpu.sync("decode rows")
    return out


def check(e: CudaBackend, vs: VerifyStep, ms, context: int, rng) -> bool:
    ok = True
    for m in ms:
        tokens = rng.integers(0, e.config.vocab_size, m)
        ref = decode_rows(e, tokens, context)
        vs.set_rows(tokens, context)
        with e.gpu.guard("verify step"):
            vs.step(m)
            e.gpu.sync("verify step")
        got = vs.logits(m)
        std = ref.std(axis=1, keepdims=True)
        dl = float(np.max(np.abs(got - ref) / std))
        top2 = np.sort(ref, axis=1)[:, -2:]
        tie = (top2[:, 1] - top2[:, 0]) / std[:, 0] < TIE
        same = got.argmax(1) == ref.argmax(1)
        bad = int(np.sum(~same & ~tie))
        finite = bool(np.isfinite(got).all())
        good = finite and bad == 0 and dl <= MAX_DLOGIT
        ok &= good
        print(f"check M={m:2d}: top-1 {int(same.sum())}/{m} (near-ties {int(tie.sum())}), "
              f"max|dlogit|/std {dl:.4f}{'' if finite else ', NON-FINITE'}  "
              f"{'ok' if good else 'FAIL'}")  # fmt: skip
    return ok


def timing(e: CudaBackend, vs: VerifyStep, ms, context: int) -> list[dict]:
    e.set_decode_state(DecodeState(token=1, pos=context))
    base = time_graph(e.gpu, lambda s: e.forward.decode_step(s), reps=20) * 1e6
    rows = [{"m": 0, "us": base, "ratio": 1.0}]
    print(f"decode step (M = 1, today's kernels): {base:8.1f} us")
    rng = np.random.default_rng(0)
    for m in ms:
        vs.set_rows(rng.integers(0, e.config.vocab_size, m), context)
        us = time_graph(e.gpu, lambda s, m=m: vs.step(m, s), reps=20) * 1e6
        rows.append({"m": m, "us": us, "ratio": us / base})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model")
    ap.add_argument("--context", type=int, default=512, help="tokens before the verified rows")
    ap.add_argument("--ms", default="1,2,4,8,16", help="row counts checked and timed")
    ap.add_argument("--seed", type=int, default=None, help="inputs' seed (default: fresh)")
    ap.add_argument("--json", default="", help="write the timing table here")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    e = CudaBackend(NanoqwenFile(args.file), max_context=args.context + 64)
    vs = VerifyStep(e)
    prefill_context(e, rng.integers(0, e.config.vocab_size, args.context).astype(np.int32))
    results: dict = {}
    run_part("check", results, print, lambda: check(e, vs, ms, args.context, rng))
    run_part("time", results, print, lambda: timing(e, vs, ms, args.context))
    ok = results["check"] is True
    if results["time"]:
        print(f"\nverify step, {e.config.name}, context {args.context} (us a step, graph of 20)")
        print("     M       us   x step   ms/token if all M accepted")
        for r in results["time"]:
            label = "step" if r["m"] == 0 else f"{r['m']:4d}"
            per_tok = r["us"] / 1e3 / max(r["m"], 1)
            print(f"  {label:>4} {r['us']:8.1f}   {r['ratio']:6.3f}   {per_tok:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": e.config.name, "context": args.context,
                           "rows": results["time"]}, f, indent=1)  # fmt: skip
    print(f"RESULT check {'PASS' if ok else 'FAIL'} time {'PASS' if results['time'] else 'FAIL'}")
    e.close()
    return 0 if ok and results["time"] else 1


if __name__ == "__main__":
    sys.exit(main())
