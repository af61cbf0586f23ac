"""The multi-row verify step composed from its kernels on a .nanoqwen file: checked against the
decode step, then timed by M (sm_90 GPU). Issue #26's step-cost table.

    PYTHONPATH=. python3 dev/verify_step.py FILE [--context 512] [--ms 1,2,4,8,16] [--json PATH]
        [--down split,rows] [--kernels] [--ablate[-pairs]] [--no-pdl] [--seed N]
        [--skip-draws M,M]
        [--reference] [--attention auto,short,long] [--variant NAME=v,NAME=v ...]

The verify step (nanoqwen/engine/verify.py, the engine's speculative loop runs it) feeds M
tokens at the consecutive positions start .. start + M - 1 of one sequence (the token of the
step and M - 1 drafts) through one pass over the weights: gemv_rows, attention_rows and
lm_head_rows.

Check: the engine's own prefill writes the K/V of `context` random tokens; then at each M, the
verify step over M random tokens at positions context .. context + M - 1 against M decode steps
of the same tokens (forward.decode_step, one row at a time): each row's top-1 must be the
decode step's unless the decode step's top-2 margin is under TIE (a near-tie, counted), and
max |dlogit| / std(logits) is printed. The two paths round differently (the decode GEMV's
offset form, attention's split merges), so the logits differ in the fp16 noise, not more.
Every down_proj path and attention form (--attention: auto is the engine's choice at the
context, short and long force one of attention_rows' two forms) is checked on the same tokens
(drawn once per M after the context, past --skip-draws rows: an A/B of the paths, and --seed
with --skip-draws replays a check).
--reference: also the float32 reference's logits for the same tokens (nanoqwen.reference on
the GPU, teacher-forced over the context and the rows), each row's max |dlogit| / std from it
for the verify step and for the decode step, and a row that parts from the decode step still
passes when it is as close to float32 as the decode step is (EXACT_SLACK): on real weights a
random token with massive activations can put the decode step itself 0.39 std from float32.

Time: the verify step at each M as a CUDA graph of 20 copies (harness.bench.time_graph, median
of 5 launches), beside the decode step's forward (embed, layers, lm_head; no sampler) timed the
same way: microseconds, the ratio to the decode step, and milliseconds per token if every row
were accepted. --kernels: each label's launches of the step timed alone (summed over the
layers; harness.bench.launch_times, as `nanoqwen bench --kernels` times the decode step) at
each M, side by side with the decode step's forward by operation (harness.bench.compare_steps):
where the verify step's cost over the decode step goes. --ablate: each label's cost inside the
step, the step's recorded launches replayed as one graph (10 copies) with and without that
label's launches (what runs under another kernel costs nothing here, unlike in --kernels' sums);
--ablate-pairs also every two labels' together, and the time the two share (their costs alone
summed less their cost together: what removing either alone does not give back).
RESULT last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

from nanoqwen.cuda.registry import DEFAULT_GEOMETRY, MATTN_NEVER_LONG
from nanoqwen.engine import CudaBackend
from nanoqwen.engine.decode_loop import DecodeState
from nanoqwen.engine.verify import DOWN_PATHS
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness import import_torch_first
from nanoqwen.harness.bench import aggregate_kernels, compare_steps, launch_times, time_graph
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.harness.real_text import compare
from nanoqwen.harness.verify_bench import VerifyStep, prefill_context, time_rows

TIE = 0.05  # logit stds: a top-2 margin under this is a near-tie (fp16 noise can flip it)
MAX_DLOGIT = 0.05  # max |dlogit| / std between the two paths (the ladder's graph-tier bound)
# --reference: a row that parts from the decode step passes if it is no further from float32
# than this times the decode step's distance (each path rounds in fp16 its own way; on the real
# 1.5B the two paths' medians from float32 are 0.015 and 0.014)
EXACT_SLACK = 1.25


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


def check(e: CudaBackend, vs: VerifyStep, draws: list[np.ndarray], context: int, exact) -> bool:
    """Each draw's verify step against its decode steps. A row passes when it agrees with the
    decode step (max |dlogit| / std <= MAX_DLOGIT, top-1 the same or a near-tie) or, with
    `exact` (the float32 reference's logits of each draw's rows), when it is as exact as the
    decode step: no further from float32 than EXACT_SLACK x the decode step's distance, with
    float32's top-1 (or a near-tie of float32's)."""
    ok = True
    for j, tokens in enumerate(draws):
        m = len(tokens)
        ref = decode_rows(e, tokens, context)
        vs.set_rows(tokens, context)
        with e.gpu.guard("verify step"):
            vs.step(m)
            e.gpu.sync("verify step")
        got = vs.logits(m)
        c = compare(got, ref)  # per row: top-1 equal, ref's top-2 margin, max |dlogit| / std
        row_dl, same, tie = c["dlogit"], c["agree"], c["margin"] < TIE
        agree = (row_dl <= MAX_DLOGIT) & (same | tie)
        good_rows = agree.copy()
        if exact is not None:
            x = exact[j]
            cv = compare(got, x)
            v, d = cv["dlogit"], compare(ref, x)["dlogit"]
            top1 = cv["agree"] | (cv["margin"] < TIE)
            good_rows |= (v <= EXACT_SLACK * d) & top1
        finite = bool(np.isfinite(got).all())
        good = finite and bool(good_rows.all())
        ok &= good
        print(f"check M={m:2d}: top-1 {int(same.sum())}/{m} (near-ties {int(tie.sum())}), "
              f"max|dlogit|/std {float(row_dl.max()):.4f}{'' if finite else ', NON-FINITE'}  "
              f"{'ok' if good else 'FAIL'}")  # fmt: skip
        for r in np.flatnonzero(~agree):  # which rows, if any
            line = (f"  row {r} (token {tokens[r]}, position {context + r}): max|dlogit|/std "
                    f"{row_dl[r]:.4f}, top-1 {'same' if same[r] else 'differs'}")  # fmt: skip
            if exact is not None:
                line += (f"; from float32 {v[r]:.4f} against the decode step's {d[r]:.4f}: "
                         f"{'as exact' if good_rows[r] else 'FAIL'}")  # fmt: skip
            print(line)
        if exact is not None:
            print(f"  from float32: verify max {v.max():.4f}, median {np.median(v):.4f}; "
                  f"decode step max {d.max():.4f}, median {np.median(d):.4f}")  # fmt: skip
    return ok


def exact_logits(f: NanoqwenFile, context_ids: np.ndarray, draws, max_context: int) -> list:
    """The float32 reference's logits of each draw's rows after the context (on the GPU)."""
    from nanoqwen.reference import ReferenceBackend

    ref = ReferenceBackend(f, max_context=max_context, device="cuda", prefix_caching=False)
    try:
        n = len(context_ids)
        return [ref.logits(np.concatenate([context_ids, t]).tolist())[n:] for t in draws]
    finally:
        ref.close()


def timing(e: CudaBackend, vs: VerifyStep, ms, context: int) -> list[dict]:
    """The step timed by M beside the decode step (harness.verify_bench.time_rows, as `nanoqwen
    bench --workload verify`): rows {m, us, ratio to the decode step}, the decode step as m 0."""
    base, by_rows = time_rows(e, vs, ms, context)
    print(f"decode step (M = 1, today's kernels): {base:8.1f} us")
    return [{"m": 0, "us": base, "ratio": 1.0}] + [
        {"m": m, "us": us, "ratio": us / base} for m, us in by_rows.items()
    ]


def record(launchers, gpu, body) -> list:
    """Every launch (cuda.launcher.Launch) that body() makes through `launchers`, in order."""
    trace: list = []
    for lr in launchers:
        lr.on_launch = trace.append
    try:
        with gpu.guard("record a step"):
            body()
            gpu.sync("record a step")
    finally:
        for lr in launchers:
            lr.on_launch = None
    return trace


def breakdown(e: CudaBackend, trace: list, whole, pos: int) -> dict:
    """aggregate_kernels' dict of one recorded step: each label's launches timed alone
    (harness.bench.launch_times, graphs of 20) against whole(stream), the step, timed alike.
    Every launcher here shares the Gpu and the PDL flag, so one replays them all."""
    seconds = launch_times(e.gpu, trace, e.kernels.replay, reps=20)
    step_s = time_graph(e.gpu, whole, reps=20)
    return aggregate_kernels([(ln.label, t, ln.nbytes + ln.per_token * (pos + 1))
                              for ln, t in zip(trace, seconds, strict=True)], step_s)  # fmt: skip


def kernels(e: CudaBackend, vs: VerifyStep, ms, context: int) -> dict:
    """The decode step's forward (no sampler) and the verify step at each M, kernel by kernel:
    aggregate_kernels' dicts by column name ("decode", "M=1", ...), printed side by side."""
    e.set_decode_state(DecodeState(token=1, pos=context))
    trace = record([e.kernels], e.gpu, e.forward.decode_step)
    cols = {"decode": breakdown(e, trace, lambda s: e.forward.decode_step(s), context)}
    rng = np.random.default_rng(0)
    launchers = [vs.v.kernels, vs.v.verify]
    for m in ms:
        vs.set_rows(rng.integers(0, e.config.vocab_size, m), context)
        trace = record(launchers, e.gpu, lambda m=m: vs.step(m))
        cols[f"M={m}"] = breakdown(e, trace, lambda s, m=m: vs.step(m, s), context + m - 1)
    print(f"per kernel, summed over the layers (us a step; x the decode step's; context {context})")
    print(compare_steps(cols))
    return cols


def ablate(e: CudaBackend, vs: VerifyStep, ms, context: int, pairs: bool = False) -> dict:
    """The decode step's forward and the verify step at each M, each label's cost inside the
    step (the docstring's --ablate), us: {step name: {"whole": us, label: us, ...}}; pairs:
    also each two labels' cost together, and what the pair shares (their costs alone summed
    less their cost together) under "pairs": {"a + b": [together, shared]}."""
    e.set_decode_state(DecodeState(token=1, pos=context))
    traces = {"decode": record([e.kernels], e.gpu, e.forward.decode_step)}
    rng = np.random.default_rng(0)
    launchers = [vs.v.kernels, vs.v.verify]
    for m in ms:
        vs.set_rows(rng.integers(0, e.config.vocab_size, m), context)
        traces[f"M={m}"] = record(launchers, e.gpu, lambda m=m: vs.step(m))

    def replayed(launches) -> float:
        def body(s) -> None:
            for ln in launches:
                e.kernels.replay(ln, stream=s)

        return time_graph(e.gpu, body, reps=10) * 1e6

    out: dict = {}
    for name, trace in traces.items():
        whole = replayed(trace)
        out[name] = {"whole": whole}
        for label in dict.fromkeys(ln.label for ln in trace):
            out[name][label] = whole - replayed([ln for ln in trace if ln.label != label])
        print(f"{name}: whole step {whole:.1f} us; each label's cost inside it (us a step)")
        for label, us in list(out[name].items())[1:]:
            print(f"  {label:28s} {us:8.1f}")
        if pairs:
            labels, out[name]["pairs"] = list(out[name])[1:], {}
            print(f"{name}: two labels' cost together and the time they share (us a step)")
            for a, b in itertools.combinations(labels, 2):
                both = whole - replayed([ln for ln in trace if ln.label not in (a, b)])
                shared = out[name][a] + out[name][b] - both
                out[name]["pairs"][f"{a} + {b}"] = [both, shared]
                print(f"  {a + ' + ' + b:52s} {both:8.1f} {shared:8.1f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model")
    ap.add_argument("--context", type=int, default=512, help="tokens before the verified rows")
    ap.add_argument("--ms", default="1,2,4,8,16", help="row counts checked and timed")
    ap.add_argument("--seed", type=int, default=None, help="inputs' seed (default: fresh)")
    ap.add_argument("--skip-draws", default="",
                    help="row counts drawn (and dropped) after the context, before the checks' "
                         "tokens (comma list)")  # fmt: skip
    ap.add_argument("--json", default="", help="write the timing table here")
    ap.add_argument("--down", default="split,rows",
                    help="down_proj paths to check and time in turn: split (gemv_rows_split + "
                         "its sum: K split across the CTAs), rows (gemv_rows); the engine "
                         "picks by engine.verify.down_path")  # fmt: skip
    ap.add_argument("--attention", default="auto",
                    help="attention_rows' forms to check and time in turn (comma list): auto "
                         "(the engine's choice at the context: VerifyKernels.long_form), short "
                         "(clusters of mattn_cluster), long (of mattn_long_cluster)")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=v,NAME=v (repeatable): also check and time the verify step with "
                         "its kernels built on the engine's geometry with these values (C "
                         "names, e.g. kMrMaxStages=4), beside the shipped one")  # fmt: skip
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch every kernel (the verify step's, the decode step's, the "
                         "prefill's) without programmatic dependent launch: a check that "
                         "passes only without it points at a missing wait")  # fmt: skip
    ap.add_argument("--reference", action="store_true",
                    help="also each check's distance from the float32 reference, for the "
                         "verify step and the decode step")  # fmt: skip
    ap.add_argument("--kernels", action="store_true",
                    help="also time each kernel of the steps alone, summed over the "
                         "layers, beside the decode step's (where the verify step's cost "
                         "goes)")  # fmt: skip
    ap.add_argument("--ablate-pairs", action="store_true",
                    help="--ablate, and also every two labels' cost together and the time they "
                         "share (what removing either alone does not give back)")  # fmt: skip
    ap.add_argument("--ablate", action="store_true",
                    help="also each label's cost inside the step: the step replayed with and "
                         "without that label's launches")  # fmt: skip
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    unknown = set(args.down.split(",")) - set(DOWN_PATHS)
    if unknown:
        ap.error(f"--down {args.down!r}: {sorted(unknown)} not among {', '.join(DOWN_PATHS)}")
    forms = args.attention.split(",")
    if set(forms) - {"auto", "short", "long"}:
        ap.error(f"--attention {args.attention!r}: a comma list of auto, short, long")
    variants = {}
    for text in args.variant:
        try:
            variants[text] = DEFAULT_GEOMETRY.override_text(text)
        except ValueError as exc:
            ap.error(f"--variant {text!r}: {exc}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    if args.reference:
        import_torch_first()  # the reference runs after the engine's kernels build
    f = NanoqwenFile(args.file)
    e = CudaBackend(f, max_context=args.context + 64)
    steps = {"": VerifyStep(e)}
    for text, geometry in variants.items():
        steps[f" {text}"] = VerifyStep(e, geometry)
    for name, vs in steps.items():
        pages = vs.v.verify.long_pages
        print(f"attention_rows{name}: the long form from {pages} pages"
              f"{' (never)' if pages == MATTN_NEVER_LONG else ''}")  # fmt: skip
    if args.no_pdl:
        launchers = [e.kernels, e.prefill_kernels]
        launchers += [x for vs in steps.values() for x in (vs.v.kernels, vs.v.verify)]
        for launcher in launchers:
            launcher.pdl = False
    vocab = e.config.vocab_size
    context_ids = rng.integers(0, vocab, args.context).astype(np.int32)
    prefill_context(e, context_ids)
    for n in (int(n) for n in args.skip_draws.split(",") if n):
        rng.integers(0, vocab, n)
    draws = [rng.integers(0, vocab, m) for m in ms]  # every path's check takes these tokens
    exact = exact_logits(f, context_ids, draws, args.context + 64) if args.reference else None
    ok, tables, breakdowns, ablations = True, {}, {}, {}
    for down, form, (name, vs) in itertools.product(args.down.split(","), forms, steps.items()):
        vs.v.down, vs.attention = down, form
        # the table's name: the path, the attention form unless auto, and the variant if any
        down = down + ("" if form == "auto" else f" attention {form}") + name
        results: dict = {}
        print(f"== down_proj: {down}")
        run_part("check", results, print, lambda vs=vs: check(e, vs, draws, args.context, exact))
        run_part("time", results, print, lambda vs=vs: timing(e, vs, ms, args.context))
        ok &= results["check"] is True and bool(results["time"])
        tables[down] = results["time"] or []
        if args.kernels:
            run_part("kernels", results, print, lambda vs=vs: kernels(e, vs, ms, args.context))
            ok &= bool(results["kernels"])
            breakdowns[down] = results["kernels"] or {}
        if args.ablate or args.ablate_pairs:
            run_part("ablate", results, print,
                     lambda vs=vs: ablate(e, vs, ms, args.context, args.ablate_pairs))  # fmt: skip
            ok &= bool(results["ablate"])
            ablations[down] = results["ablate"] or {}
    for down, table in tables.items():
        print(f"\nverify step, {e.config.name}, context {args.context}, down_proj {down} "
              "(us a step, graph of 20)")  # fmt: skip
        print("     M       us   x step   ms/token if all M accepted")
        for r in table:
            label = "step" if r["m"] == 0 else f"{r['m']:4d}"
            per_tok = r["us"] / 1e3 / max(r["m"], 1)
            print(f"  {label:>4} {r['us']:8.1f}   {r['ratio']:6.3f}   {per_tok:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": e.config.name, "context": args.context, "down": tables,
                       "kernels": breakdowns, "ablation": ablations}, f, indent=1)  # fmt: skip
    print(f"RESULT {'PASS' if ok else 'FAIL'}")
    e.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
