"""down_proj's multi-row paths on a model's own activations, each against float64 (sm_90 GPU).

    PYTHONPATH=. python3 dev/down_ab.py FILE [--context 512] [--rows 16] [--seed N]
        [--skip-draws M,M] [--text] [--tokens ID,ID] [--paths gemm,split,rows,gemv]

dev/verify_step.py compares whole steps' logits; this script finds which layer, row and
feature a down_proj path gets wrong. It runs the verify step (engine.verify.Verify) over
`rows` tokens after `context` tokens of prefilled K/V, layer by layer; after each layer's
gate/up it downloads the SwiGLU output and the fp32 residual, runs down_proj by each of
--paths on a copy of the residual (the step's paths, engine.verify.DOWN_PATHS; gemm: the
prefill's tensor-core GEMM, the baseline; gemv: the decode step's one-row kernel, row by row,
the verify check's reference), and computes the same update in float64 on the host from the
file's dequantized weights. Per layer and path: the worst row's max |err| over that row's own
max |update| (err: the path's new residual minus the float64 one; per row, because a token
with massive activations has updates hundreds of times another row's) and where it is. The
step goes on with its own path's result (engine.verify.down_path), run last, so every path
sees the same inputs and the RMSNorm hand-off continues from the step's.

Tokens: random ids drawn as dev/verify_step.py draws them (the context, then each check's rows):
--seed and --skip-draws (the row counts of the checks before the one to replay; e.g. 1,9,16,1,9
for the split's 16-row check of `--ms 1,9,16 --down split,rows`) give a failing check's exact
inputs. Or with --text real code (a standard-library window) for both the context and the rows;
--tokens puts these ids in the first rows.
RESULT FAIL if a path's error at some layer exceeds RATIO x the GEMM's there and FLOOR.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from nanoqwen.engine import CudaBackend
from nanoqwen.engine.verify import DOWN_PATHS, down_proj
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness.real_text import code_windows
from nanoqwen.harness.verify_bench import VerifyStep, prefill_context
from nanoqwen.quant import dequantize_packed
from nanoqwen.tokenizer import Tokenizer

RATIO = 4.0  # a path this many times the GEMM's error at a layer is wrong, not rounding
FLOOR = 2e-3  # max |err| / max |update| below which any path is fine


def down_ref(f: NanoqwenFile, layer: int, mlp: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 [m, H]: x + mlp @ dequant(W_down)^T."""
    w = dequantize_packed(f.tensor(f"layers.{layer}.down_proj.qweight"),
                          f.tensor(f"layers.{layer}.down_proj.scales"))  # fmt: skip
    return x.astype(np.float64) + mlp.astype(np.float64) @ w.astype(np.float64).T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model")
    ap.add_argument("--context", type=int, default=512, help="tokens before the rows")
    ap.add_argument("--rows", type=int, default=16, help="the verify step's rows (1..16)")
    ap.add_argument("--seed", type=int, default=None, help="random ids' seed (default: fresh)")
    ap.add_argument(
        "--skip-draws", default="", help="row counts drawn before the rows (comma list)"
    )
    ap.add_argument("--text", action="store_true", help="real code instead of random ids")
    ap.add_argument("--tokens", default="", help="ids of the first rows (comma list)")
    ap.add_argument("--paths", default="gemm,split,rows,gemv", help="down_proj paths compared")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if set(paths) - {*DOWN_PATHS, "gemm", "gemv"}:
        ap.error(f"--paths {args.paths!r}: each one of {', '.join(DOWN_PATHS)}, gemm, gemv")
    f = NanoqwenFile(args.file)
    e = CudaBackend(f, max_context=args.context + 64)
    c, m, gpu = e.config, args.rows, e.gpu
    if args.text:
        ids = np.array(code_windows(Tokenizer.from_spec(f.tokenizer), 1, args.context + m)[0])
        print(f"real code: {args.context} + {m} tokens")
    else:
        seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
        print(f"seed {seed}")
        rng = np.random.default_rng(seed)
        context = rng.integers(0, c.vocab_size, args.context)
        for n in (int(n) for n in args.skip_draws.split(",") if n):
            rng.integers(0, c.vocab_size, n)
        ids = np.concatenate([context, rng.integers(0, c.vocab_size, m)])
    ids = ids.astype(np.int32)
    given = [int(t) for t in args.tokens.split(",") if t]
    ids[args.context : args.context + len(given)] = given
    prefill_context(e, ids[: args.context])
    vs = VerifyStep(e)
    vs.set_rows(ids[args.context :], args.context)
    v, b, h, inter = vs.v, vs.v.buf, c.hidden_size, c.intermediate_size
    spare = gpu.alloc(m * h * 4, "down_ab residual copy").ptr
    spare_x = gpu.alloc(m * h * 2, "down_ab residual's fp16 copy").ptr
    k, kv, w, link = v.kernels, v.kv, v.weights, v.link
    worst = {p: 0.0 for p in paths}
    bad = []
    print(f"{'layer':>5} " + " ".join(f"{p:>22}" for p in paths) + "   max|update|")
    with gpu.guard("down_ab"):
        k.embed_rows(b["tokens"], w.embed, w.layers[0].input_norm, b["x"], b["res"], m, link)
        for i, L in enumerate(w.layers):
            k.gemv_rows("qkv", m, b["x"], L.qkv_w, L.qkv_s, b["q"], link=link, bias=L.qkv_b,
                        pos=b["pos"], rope=v.rope, pages=kv.page_table, page_stride=0,
                        kc=kv.k[i], vc=kv.v[i])  # fmt: skip
            v.verify.attention_rows(b["q"], kv.k[i], kv.v[i], kv.page_table, vs.start, m,
                                    v.attn_scratch, b["attn"], long=vs.long)  # fmt: skip
            k.gemv_rows("o", m, b["attn"], L.o_w, L.o_s, b["x"], link=link, res=b["res"],
                        next_w=L.post_norm)  # fmt: skip
            k.gemv_rows("gate_up", m, b["x"], L.gate_up_w, L.gate_up_s, b["mlp"], link=link)
            next_w = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else 0
            mlp = gpu.download(b["mlp"], np.empty((m, inter), np.float16))
            x = gpu.download(b["res"], np.empty((m, h), np.float32))
            ref = down_ref(f, i, mlp, x)
            update = np.abs(ref - x).max(axis=1)  # [m]: each row's largest update
            scale = float(update.max())
            cells = []
            for p in paths:
                gpu.copy_d2d(spare, b["res"], m * h * 4)
                if p == "gemv":
                    for r in range(m):
                        e.kernels.gemv("down", b["mlp"] + r * inter * 2, 0, L.down_w, L.down_s,
                                       spare_x + r * h * 2, h, spare + r * h * 4)  # fmt: skip
                elif p == "gemm":
                    e.prefill_kernels.gemm(b["mlp"], L.down_w, L.down_s, None, spare_x, m, h,
                                           inter, residual=spare)  # fmt: skip
                else:
                    down_proj(v, m, p, b["mlp"], L, spare_x, spare, v.part, next_w, None)
                got = gpu.download(spare, np.empty((m, h), np.float32)).astype(np.float64)
                err = np.abs(got - ref)
                rows = err.max(axis=1) / np.maximum(update, 1e-30)
                r = int(rows.argmax())
                n = int(err[r].argmax())
                rel = float(rows[r])
                worst[p] = max(worst[p], rel)
                cells.append((p, rel, r, n, got[r, n]))
            gemm = next((cell[1] for cell in cells if cell[0] == "gemm"), None)
            for p, rel, r, n, val in cells:
                if rel > FLOOR and (gemm is None or rel > RATIO * gemm):
                    bad.append(f"layer {i} {p}: {rel:.2e} at row {r} (token "
                               f"{ids[args.context + r]}), feature {n}: residual {x[r, n]} -> "
                               f"{val} against float64 {ref[r, n]:.4f} (the row's max |update| "
                               f"{update[r]:.4g})")  # fmt: skip
            big = np.unravel_index(int(np.abs(x).argmax()), x.shape)
            print(f"{i:5d} " + " ".join(f"{cell[1]:9.2e} r{cell[2]:2d} n{cell[3]:5d}"
                                        for cell in cells) + f"   {scale:.3g}  max|x| "
                  f"{abs(float(x[big])):.4g} (row {big[0]}), max|mlp| "
                  f"{float(np.abs(mlp).max()):.4g}")  # fmt: skip
            down_proj(v, m, v.down, b["mlp"], L, b["x"], b["res"], v.part, next_w, None)
        gpu.sync("down_ab")
    print("worst: " + ", ".join(f"{p} {worst[p]:.2e}" for p in paths))
    for line in bad:
        print("  " + line)
    print(f"RESULT {'FAIL' if bad else 'PASS'}")
    e.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
