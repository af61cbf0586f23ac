"""The batched decode step (issue #28, engine/batch.py) on a .nanoqwen file: checked against
the single-stream engine, then timed by batch size (sm_90 GPU, one command).

    PYTHONPATH=. python3 dev/batch_check.py FILE --out DIR [--parts timing,sampler,correct,...]
        [--steps 64] [--long 8192]

Parts (each runs on its own: a failing part is logged and the others still run):

correct  12 sequences of mixed prompt lengths (1, 15, 16, 17, 100, 511, 513, 2000, --long, and
         three that share a prefix with earlier ones), admitted through the block manager
         (prefix cache hits included) and prefill_chunk in chunks of 512 (one of at most
         max_batch ids, as 1, 15, 16 and 513's last, runs as rows of the batch step), one
         chunk between decode steps, then decode steps (decode_launch, read at once) over
         --steps steps while sequences join and leave (the scheduler's calls, emulated here
         on nanoqwen.batching.Sequence). Checks:
         - greedy rows: each sequence's tokens against CudaBackend.generate alone on the same
           file; at a split the batch logits' top-2 margin must be under SPLIT_MARGIN logit
           stds (a near-tie: the M-row kernels round differently from the decode kernels)
         - logits: at two steps, every row's logits against the single-stream decode step of
           the same context (forward.decode_step over the sequence's own pages, run before
           the batch step, which then rewrites the same K/V slot): max |dlogit| / std under
           MAX_DLOGIT, top-1 equal unless a near-tie; every row finite (buffers poisoned)
         - sampled rows (seeded): the same sequences run again in another batch composition,
           and generate() alone: where their tokens part is reported, not gated. Each draws
           the same random numbers in every composition (the draw counter is the sequence's),
           but the buckets' kernels round differently (down_proj's path depends on the rows),
           so the fp16 noise can move a draw at a CDF boundary: on the synthetic 7B every
           token reproduces; the real 1.5B at temperature 1.0 has parted at token 5
         - no page held at the end (block_manager.pages_held == 0)
timing   (runs first) B = 1, 2, 4, 8, 16 sequences at context 512, and 16 with one of them
         at --long: the batch step's graph (CUDA events, median of 5 launches of 20 steps)
         and the whole decode call (decode_launch and its tokens: host staging, launch, sync;
         wall clock, median of 20), against the plain decode step (forward + sampler) at the
         same context in the same run: us, ratio, aggregate tokens/s. Then prefill_chunk of
         CHUNK_TIMES ids after a cached context (a call, sampling: the batch step's rows up to
         max_batch ids, forward.prefill past it).

sampler  sample_batch against sample_finish on the same logits: 16 rows of mixed parameters
         (greedy, temperature, top-k, top-p; seeds and draw counters of their own) in one
         launch, each row the plain sampler's token for its state words, bit for bit.
handoff  nanoqwen.batching.Scheduler on the engine: a lone greedy request decodes solo (the
         one-graph loop) for 24 tokens, a second one arrives and it moves into the batch
         (resumed from its pages in the prefix cache), and back to solo once alone; both
         requests' tokens against generate() alone (at a split, the top-2 margin of
         generate()'s own teacher-forced logits must be under SPLIT_MARGIN stds), no page
         held at the end.
chain    nanoqwen.batching.Scheduler (solo off) over 12 requests at once, 8 greedy and 4 seeded
         sampled, of mixed prompt lengths and max_tokens, stepped to the end: its decode steps
         run one step behind (a step chained behind the one in flight, fed that step's tokens
         on the device; the count is logged and must be most of the steps). Greedy tokens
         against generate() alone (at a split, generate()'s top-2 margin under SPLIT_MARGIN
         stds); seeded sampled ones: how many tokens agree with generate() alone before they
         part (reported). Then two steps of 8 seeded sequences at temperature 1.5, chained,
         and the same two steps again over the same rows, the second launched after the
         first is read: the tokens must be equal (the chained step's fed token and draw
         number, exactly). No page held at the end.
speculative  a backend built with speculative=SpeculativeConfig() (after the first one is
         closed) runs three repetitive prompts through decode_launch: one token a sequence a
         step, the tokens compared with the plain backend's run of the same (reported).

Output: the log and DIR/batch_check.json (top level: {"parts": ..., "correct": ...,
"timing": ..., "result": "PASS" | "FAIL"}); the last line is RESULT PASS or RESULT FAIL.
Works on the synthetic pack (python3 -m nanoqwen.cli pack --synthetic 7b --no-progress -o
/tmp/s7b.nanoqwen) and on a real one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from nanoqwen.batching import Sequence
from nanoqwen.engine import CudaBackend
from nanoqwen.engine.batch import decode_rows
from nanoqwen.engine.decode_loop import DecodeState
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness import real_text
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.gpu_script import run_part
from nanoqwen.sampling import SamplingParams

TIE = 0.05  # logit stds: a top-2 margin under this is a near-tie (dev/verify_step.py's)
MAX_DLOGIT = 0.05  # max |dlogit| / std against the decode step (dev/verify_step.py's)
# A greedy split against generate() alone is noise when the batch row's top-2 margin is under
# this: flipping two logits takes a difference of the margin between the paths, each logit off
# by up to MAX_DLOGIT stds.
SPLIT_MARGIN = 2 * MAX_DLOGIT
CHUNK = 512
CHUNK_TIMES = (1, 8, 16, 17, 64)  # prefill_chunk lengths timed (timing part)
CONTEXT = 512  # the timing's context
BATCHES = (1, 2, 4, 8, 16)


@dataclass(eq=False)
class Seq(Sequence):
    """nanoqwen.batching.Sequence with the check's own bookkeeping."""

    name: str = ""
    target: int = 0  # tokens to generate
    join: int = 0  # decode step at which it is admitted


class Driver:
    """The scheduler's calls on one backend: admit (block manager + slot), prefill chunks,
    decode steps, leave; commits K/V as the host side does."""

    def __init__(self, e: CudaBackend, first_margins: dict | None = None) -> None:
        self.e, self.bm = e, e.block_manager
        self.free_slots = list(range(e.max_batch))[::-1]
        self.running: list[Seq] = []
        self.first_margins = first_margins  # name -> the first token's top-2 margin

    def admit(self, s: Seq) -> None:
        s.table = self.bm.admit(s.prompt)
        s.kv_len, s.slot = s.table.cached_tokens, self.free_slots.pop()

    def prefill_step(self, s: Seq) -> bool:
        """One chunk; True once the prompt is done (the first token sampled)."""
        end = min(len(s.prompt), s.kv_len + CHUNK)
        last = end == len(s.prompt)
        self.bm.reserve(s.table, end + 1 if last else end)
        start = s.kv_len
        tok = self.e.prefill_chunk(s, end, sample=last)
        self.bm.commit(s.table, s.prompt[start:end])
        if last:
            s.tokens.append(tok)
            if self.first_margins is not None:  # the head's logits of the prompt's last row
                row = np.empty(self.e.config.vocab_size, np.float32)
                self.first_margins[s.name] = top2_margin(self.e.gpu.download(
                    self.e.chunk_logits, row))  # fmt: skip
        return last

    def decode(self, seqs: list[Seq]) -> list[int]:
        for s in seqs:
            self.bm.reserve(s.table, s.kv_len + 1)
        fed = [s.ids[s.kv_len] for s in seqs]
        out = self.e.decode_launch(seqs).tokens()
        for s, f, t in zip(seqs, fed, out, strict=True):
            self.bm.commit(s.table, [f])
            s.tokens.append(t)
        return out

    def leave(self, s: Seq) -> None:
        self.e.release_slot(s)
        self.bm.release(s.table)
        self.free_slots.append(s.slot)
        s.slot = -1


def make_sequences(vocab: int, long: int, rng) -> list[Seq]:
    def ids(n):
        return rng.integers(0, vocab, n).tolist()

    base = {n: ids(n) for n in (1, 15, 16, 17, 100, 511, 513, 2000, long)}
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    seqs = [Seq(p, greedy, name=f"len{n}") for n, p in base.items()]
    # Prefix sharers: full cached pages at admission (the block manager's prefix cache).
    seqs.append(Seq(base[2000][:1024] + ids(300), greedy, name="share2000"))
    sampled = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234, max_tokens=1 << 20),
        SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=1 << 20),
    ]
    seqs.append(Seq(base[511] + ids(40), sampled[0], name="share511_sampled"))
    seqs.append(Seq(ids(300), sampled[1], name="sampled300"))
    # Targets and join steps: some leave early, some join late.
    targets = [40, 64, 30, 64, 50, 64, 20, 64, 48, 64, 64, 40]
    joins = [0, 0, 0, 0, 0, 0, 10, 10, 12, 20, 24, 6]
    for s, t, j in zip(seqs, targets, joins, strict=True):
        s.target, s.join = t, j
    return seqs


def run_schedule(e: CudaBackend, seqs: list[Seq], log, on_step=None, first_margins=None) -> int:
    """Admit at each sequence's join step, prefill one chunk a step for each joining sequence,
    decode the running ones; leave at target. on_step(step, running) runs before a decode
    step. Returns the decode steps taken."""
    d = Driver(e, first_margins)
    waiting = sorted(seqs, key=lambda s: s.join)
    prefilling: list[Seq] = []
    step = 0
    while waiting or prefilling or d.running:
        while waiting and waiting[0].join <= step:
            s = waiting.pop(0)
            d.admit(s)
            prefilling.append(s)
        for s in list(prefilling):
            if d.prefill_step(s):
                prefilling.remove(s)
                if len(s.tokens) >= s.target:
                    d.leave(s)
                else:
                    d.running.append(s)
        if d.running:
            if on_step is not None:
                on_step(step, d.running)
            d.decode(d.running)
            for s in [s for s in d.running if len(s.tokens) >= s.target]:
                d.running.remove(s)
                d.leave(s)
        step += 1
        if step > 10_000:
            raise RuntimeError("the schedule does not end")
    log(f"  schedule: {step} steps, pages held after it: {e.block_manager.pages_held}")
    return step


def top2_margin(row: np.ndarray) -> float:
    """(top-1 - top-2) / std of one logits row (real_text.margins)."""
    return float(real_text.margins(row[None])[0])


def single_step_logits(e: CudaBackend, s: Seq) -> np.ndarray:
    """The single-stream decode step's logits for s's next step (its last token at kv_len over
    its own pages): forward.decode_step with the sequence's table in kv.page_table. It writes
    the K/V slot at kv_len, which the batch step then rewrites."""
    out = np.empty(e.config.vocab_size, np.float32)
    with e.gpu.guard("single decode step"):
        e.loop.stage_pages(s.table.pages, e.kv.page_table)
        e.loop.set_state(DecodeState(token=s.ids[s.kv_len], pos=s.kv_len))
        e.forward.decode_step()
        e.gpu.download(e.forward.logits, out)
        e.gpu.memset(e.forward.key, 0, 8)
        e.gpu.sync("single decode step")
    return out


def poison(e: CudaBackend) -> None:
    """NaN bit patterns over the batch step's outputs and activations."""
    from nanoqwen.engine.batch import batch_buffers

    sizes = batch_buffers(e.config, e.max_batch, e.max_context)
    for k in ("x", "q", "attn", "mlp", "logits"):
        e.gpu.memset(e.batch.buf[k], 0xFF, sizes[k])
    e.gpu.memset(e.batch.buf["out"], 0xFF, sizes["out"])
    e.gpu.sync("poison")


def check_correct(e: CudaBackend, args, log) -> dict:
    rng = np.random.default_rng(2026)
    V = e.config.vocab_size
    seqs = make_sequences(V, args.long, rng)
    # The plain engine alone, every sequence (sampled ones with their seeds).
    t0 = time.time()
    alone = {}
    for s in seqs:
        p = s.params
        alone[s.name] = list(e.generate(s.prompt, SamplingParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
            max_tokens=s.target), frozenset()))  # fmt: skip
    log(f"  generate() alone: {len(seqs)} sequences in {time.time() - t0:.1f} s; "
        f"pages held {e.block_manager.pages_held}")  # fmt: skip
    e.block_manager.clear_cache()  # the batch run prefills its prompts (chunked) itself

    margins: dict[str, list[float]] = {s.name: [] for s in seqs}
    first_margins: dict[str, float] = {}
    logits_checks: list[dict] = []
    check_steps = {args.steps // 4, (3 * args.steps) // 4}

    def on_step(step, running):
        if step in check_steps:
            refs = {s.name: single_step_logits(e, s) for s in running}
            poison(e)
            pending.append((step, list(running), refs))

    pending: list = []
    d_steps: list[int] = []

    # Record each row's margin after every decode step (the batch logits of that step; its
    # rows run by slot order).
    orig_decode = e.decode_launch

    def recording_decode(seqs, after=None):
        launched = orig_decode(seqs, after)
        launched.tokens()  # the step has run: its logits are in the batch buffer
        rows = sorted(seqs, key=lambda s: s.slot)
        logits = np.empty((len(rows), V), np.float32)
        e.gpu.download(e.batch.buf["logits"], logits)
        for r, s in enumerate(rows):
            margins[s.name].append(top2_margin(logits[r]))
        while pending:
            step, running, refs = pending.pop()
            for r, s in enumerate(rows):
                if s.name not in refs:
                    continue
                ref, got = refs[s.name], logits[r]
                c = real_text.compare(got[None], ref[None])
                dl, tie, same = (
                    float(c["dlogit"][0]),
                    bool(c["margin"][0] < TIE),
                    bool(c["agree"][0]),
                )
                finite = bool(np.isfinite(got).all())
                ok = finite and dl <= MAX_DLOGIT and (same or tie)
                logits_checks.append({"step": step, "seq": s.name, "ctx": s.kv_len,
                                      "dlogit_std": dl, "top1_same": same, "near_tie": tie,
                                      "finite": finite, "ok": ok})  # fmt: skip
        d_steps.append(len(rows))
        return launched

    e.decode_launch = recording_decode
    try:
        steps = run_schedule(e, seqs, log, on_step, first_margins)
    finally:
        del e.decode_launch  # the class's method again
    held = e.block_manager.pages_held
    log(f"  decode steps {steps}, rows a step: min {min(d_steps)} max {max(d_steps)}")

    per_seq, ok = [], held == 0
    for s in seqs:
        ref, got = alone[s.name], s.tokens
        split = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
        row = {"seq": s.name, "prompt": len(s.prompt), "tokens": len(got),
               "greedy": s.params.greedy, "split": split}  # fmt: skip
        if split is not None and split > 0:
            # token `split` came from decode row split - 1 (token 0 from the prefill)
            row["margin_at_split"] = margins[s.name][split - 1]
        elif split == 0:  # the first token: prefill_chunk's last row
            row["margin_at_split"] = first_margins.get(s.name)
        if s.params.greedy:
            good = split is None or (
                row.get("margin_at_split") is not None and row["margin_at_split"] < SPLIT_MARGIN
            )
            row["ok"] = good
            ok &= good
        per_seq.append(row)
        log(f"  {s.name:18s} prompt {len(s.prompt):5d} tokens {len(got):3d} "
            f"{'greedy' if s.params.greedy else 'sampled'} split {split} "
            f"margin {row.get('margin_at_split')} {row.get('ok', '')}")  # fmt: skip
    for c in logits_checks:
        ok &= c["ok"]
    worst = max((c["dlogit_std"] for c in logits_checks), default=None)
    log(f"  logits vs decode step: {len(logits_checks)} rows, worst max|dlogit|/std {worst}, "
        f"failing {sum(not c['ok'] for c in logits_checks)}")  # fmt: skip

    # Sampled rows again, in another composition (with other companions, joining at once).
    sampled = [s for s in seqs if not s.params.greedy]
    again = [Seq(s.prompt, s.params, name=s.name, target=s.target, join=0) for s in sampled]
    companions = [Seq(rng.integers(0, V, n).tolist(), SamplingParams(max_tokens=1 << 20),
                      name=f"comp{n}", target=64, join=j)
                  for n, j in ((64, 0), (700, 3), (33, 5))]  # fmt: skip
    run_schedule(e, again + companions, log)
    repro = []
    for a, b in zip(sampled, again, strict=True):
        same = a.tokens == b.tokens
        first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False))
                      if x != y), None)  # fmt: skip
        agree_alone = float(np.mean([x == y for x, y in zip(a.tokens, alone[a.name],
                                                            strict=False)]))  # fmt: skip
        repro.append({"seq": a.name, "same": same, "first_diff": first,
                      "agree_with_alone": agree_alone})  # fmt: skip
        log(f"  sampled {a.name}: reproduces across compositions {same} (first diff {first}); "
            f"agrees with generate() alone on {agree_alone:.2%} of tokens")  # fmt: skip
    held_end = e.block_manager.pages_held
    ok &= held_end == 0
    log(f"  pages held at the end: {held_end}")
    return {"ok": ok, "sequences": per_seq, "logits": logits_checks, "sampled": repro,
            "pages_held": held_end, "decode_steps": steps}  # fmt: skip


def check_timing(e: CudaBackend, args, log) -> dict:
    V, gpu = e.config.vocab_size, e.gpu
    rng = np.random.default_rng(7)
    # The plain decode step (forward + sampler) at the same context, the whole pool mapped.
    e.set_decode_state(DecodeState(token=1, pos=CONTEXT))
    state = DecodeState(token=1, pos=CONTEXT, max_new=1 << 20)

    def reset():
        e.loop.set_state(state)

    plain = time_graph(gpu, lambda s: e.decode_step(s), reps=20, reset=reset) * 1e6
    e.set_decode_state(DecodeState(token=1, pos=args.long))
    plain_long = time_graph(gpu, lambda s: e.forward.decode_step(s), reps=20) * 1e6
    log(f"  plain decode step at {CONTEXT}: {plain:.1f} us; forward at {args.long}: "
        f"{plain_long:.1f} us")  # fmt: skip
    rows = []
    cases = [(b, [CONTEXT] * b) for b in BATCHES if b <= e.max_batch]
    cases.append(("16 mixed", [args.long] + [CONTEXT] * (min(16, e.max_batch) - 1)))
    for label, lengths in cases:
        d = Driver(e)
        seqs = [Seq(rng.integers(0, V, n).tolist(), SamplingParams(max_tokens=1 << 20),
                    name=f"t{i}", target=1 << 20) for i, n in enumerate(lengths)]  # fmt: skip
        for s in seqs:
            d.admit(s)
            while not d.prefill_step(s):
                pass
        for s in seqs:
            e.block_manager.reserve(s.table, s.kv_len + 64)
        for _ in range(3):
            d.decode(seqs)  # warm-up; the bucket's graph is captured here
        m = e.batch.stage(decode_rows(seqs))
        gpu.sync("stage")
        # 20 steps in one graph, as the plain step is timed; the same rows each time (the
        # same K/V slots rewritten)
        graph_us = time_graph(gpu, lambda s, m=m: e.batch.forward(m, s), reps=20) * 1e6
        wall = []
        for _ in range(20):
            t0 = time.perf_counter()
            d.decode(seqs)
            wall.append((time.perf_counter() - t0) * 1e6)
        call_us = statistics.median(wall)
        b, base = len(seqs), plain
        row = {"batch": label, "rows": b, "bucket": m, "step_us": graph_us,
               "ratio_to_plain": graph_us / base, "tokens_per_s": b * 1e6 / graph_us,
               "call_us": call_us, "call_tokens_per_s": b * 1e6 / call_us}  # fmt: skip
        rows.append(row)
        log(f"  B={label!s:9s} step {graph_us:8.1f} us  x{graph_us / base:5.2f} of plain  "
            f"{row['tokens_per_s']:8.0f} tok/s  | decode call {call_us:8.1f} us "
            f"{row['call_tokens_per_s']:8.0f} tok/s")  # fmt: skip
        for s in seqs:
            d.leave(s)
    # prefill_chunk after CONTEXT - 16 positions: up to max_batch ids as the batch step's rows,
    # more through forward.prefill (the call, wall clock, median of 20; the same K/V rewritten)
    chunks = {}
    for n in CHUNK_TIMES:
        s = Seq(rng.integers(0, V, CONTEXT - 16 + n).tolist(), SamplingParams(max_tokens=8),
                name=f"c{n}", target=8)  # fmt: skip
        d = Driver(e)
        d.admit(s)
        e.block_manager.reserve(s.table, len(s.prompt) + 1)
        e.prefill_chunk(s, CONTEXT - 16, sample=False)
        wall = []
        for _ in range(23):
            s.kv_len = CONTEXT - 16
            t0 = time.perf_counter()
            e.prefill_chunk(s, len(s.prompt), sample=True)
            wall.append((time.perf_counter() - t0) * 1e6)
        chunks[n] = statistics.median(wall[3:])
        d.leave(s)
    log("  prefill_chunk of n ids after " + str(CONTEXT - 16) + ": "
        + ", ".join(f"n={n} {us:.1f} us" for n, us in chunks.items()))  # fmt: skip
    return {"plain_us": plain, "plain_long_forward_us": plain_long, "rows": rows,
            "prefill_chunk_us": chunks,
            "ok": e.block_manager.pages_held == 0}  # fmt: skip


def argmax_keys(rows: np.ndarray) -> np.ndarray:
    """u64 [R]: common.cuh's argmax_key of each row's largest logit (lowest id on ties)."""
    ids = rows.argmax(axis=1)
    bits = rows[np.arange(len(rows)), ids].view(np.uint32).astype(np.uint64)
    keys = np.where(bits & 0x80000000, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    return (keys << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - ids.astype(np.uint64))


def check_sampler(e: CudaBackend, log) -> dict:
    """sample_batch against sample_finish (the plain loop's sampler) on the same logits: 16
    rows of mixed parameters (greedy, temperature alone, top-k, top-p, both; seeds and draw
    counters of their own) drawn in one launch must give, row by row, the token the plain
    sampler gives with that row's state words; 8 rounds of fresh logits."""
    from nanoqwen.cuda.registry import STATE_WORDS

    V, gpu, R = e.config.vocab_size, e.gpu, 16
    rng = np.random.default_rng(5)
    kinds = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 1.0), (0.9, 0, 0.9), (1.2, 100, 0.8),
             (0.5, 1, 1.0), (1.0, 2000, 0.95), (2.0, 0, 0.5)]  # fmt: skip
    logits_d = gpu.alloc(R * V * 4, "check logits")
    keys_d = gpu.alloc(R * 8, "check keys")
    params_d = gpu.alloc(R * STATE_WORDS * 4, "check params")
    tokens_d = gpu.alloc(R * 4, "check tokens")
    state_d = gpu.alloc(STATE_WORDS * 4, "check state")
    ring_d = gpu.alloc(1024 * 4, "check ring")
    mismatches, draws = 0, 0
    try:
        for _ in range(8):
            scale = rng.uniform(0.5, 4.0, (R, 1))
            rows = (rng.standard_normal((R, V)) * scale).astype(np.float32)
            params = np.zeros((R, STATE_WORDS), np.int32)
            states = []
            for r in range(R):
                temp, top_k, top_p = kinds[r % len(kinds)]
                st = DecodeState(step=int(rng.integers(0, 1000)), temperature=temp, top_k=top_k,
                                 top_p=top_p, seed=int(rng.integers(0, 1 << 62)),
                                 max_new=1 << 20)  # fmt: skip
                st.to_words(params[r])
                states.append(st)
            keys = argmax_keys(rows)
            gpu.upload(logits_d.ptr, rows)
            gpu.upload(keys_d.ptr, keys)
            gpu.upload(params_d.ptr, params)
            with gpu.guard("sample_batch"):
                e.batch.batch.sample(logits_d.ptr, keys_d.ptr, params_d.ptr, tokens_d.ptr, R)
            got = gpu.download(tokens_d.ptr, np.empty(R, np.int32))
            for r, st in enumerate(states):
                gpu.upload(state_d.ptr, st.to_words())
                gpu.upload(keys_d.ptr, keys[r : r + 1])
                with gpu.guard("sample_finish"):
                    e.kernels.sample(logits_d.ptr + r * V * 4, keys_d.ptr, state_d.ptr,
                                     ring_d.ptr, 0, 0, 0)  # fmt: skip
                want = gpu.download(state_d.ptr, np.empty(STATE_WORDS, np.int32))
                draws += 1
                mismatches += int(want[0] != got[r])  # StateWord.TOKEN
    finally:
        for b in (logits_d, keys_d, params_d, tokens_d, state_d, ring_d):
            b.free()
    log(f"  sample_batch against sample_finish: {draws - mismatches}/{draws} rows equal")
    return {"ok": mismatches == 0, "rows": draws, "mismatches": mismatches}


def small_run(e: CudaBackend) -> dict:
    """Three repetitive prompts (n-gram drafts would find matches), greedy, prefilled and run
    16 decode steps together: each step must return one token a sequence and advance
    each kv_len by one. Returns the tokens and whether every step did."""
    pattern = list(range(100, 140))
    prompts = [pattern * 6, pattern[:20] * 9 + [7], [5, 6, 7, 8] * 30]
    d = Driver(e)
    seqs = [Seq(p, SamplingParams(max_tokens=1 << 20), name=f"rep{i}", target=1 << 20)
            for i, p in enumerate(prompts)]  # fmt: skip
    for s in seqs:
        d.admit(s)
        while not d.prefill_step(s):
            pass
    one_a_step = True
    for _ in range(16):
        before = [s.kv_len for s in seqs]
        out = d.decode(seqs)
        one_a_step &= len(out) == len(seqs) and all(
            s.kv_len == b + 1 for s, b in zip(seqs, before, strict=True)
        )
    for s in seqs:
        d.leave(s)
    return {"tokens": [s.tokens for s in seqs], "one_token_a_step": one_a_step}


def check_handoff(e: CudaBackend, log) -> dict:
    """The handoff part (module docstring)."""
    from nanoqwen.batching import Scheduler

    rng = np.random.default_rng()
    V = e.config.vocab_size
    reqs = [(rng.integers(0, V, 300).tolist(), SamplingParams(max_tokens=96)),
            (rng.integers(0, V, 120).tolist(), SamplingParams(max_tokens=40))]  # fmt: skip
    sched = Scheduler(e)
    a = sched.add(*reqs[0])
    modes = []
    for _ in range(24):
        sched.step()
        modes.append("solo" if sched.solo is a else "batch")
    b = sched.add(*reqs[1])
    while sched.has_work:
        sched.step()
        if a.finish_reason is None:  # a's mode while it runs
            modes.append("solo" if sched.solo is a else "batch")
    went = "".join("s" if m == "solo" else "b" for m in modes)
    moved = went.startswith("s" * 24 + "b") and went.rstrip("s") != went  # solo, batch, solo
    ok = moved and e.kv_pages_in_use == 0
    for seq, (prompt, params) in zip((a, b), reqs, strict=True):
        alone = list(e.generate(prompt, params, frozenset()))
        split = next((i for i, (x, y) in enumerate(zip(seq.tokens, alone, strict=False))
                      if x != y), None)  # fmt: skip
        margin = None
        if split is not None:
            logits = e.logits([*prompt, *alone[:split]])[-1]
            margin = top2_margin(logits)
            ok &= margin < SPLIT_MARGIN
        ok &= len(seq.tokens) == len(alone)
        log(f"  handoff: {len(prompt)}-token prompt, {len(seq.tokens)} tokens, split {split} "
            f"margin {margin}")  # fmt: skip
    log(f"  handoff: steps solo/batch {went.count('s')}/{went.count('b')}, solo -> batch -> "
        f"solo {moved}, pages held {e.kv_pages_in_use}")  # fmt: skip
    return {"ok": ok, "modes": went, "pages_held": e.kv_pages_in_use}


def check_chain(e: CudaBackend, log) -> dict:
    """The chain part (module docstring)."""
    from nanoqwen.batching import Scheduler

    rng = np.random.default_rng()
    V = e.config.vocab_size
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=0)
    reqs = [(rng.integers(0, V, int(n)).tolist(),
             SamplingParams(max_tokens=int(m)) if i < 8 else replace(sampled, seed=i,
                                                                     max_tokens=int(m)))
            for i, (n, m) in enumerate(zip(rng.integers(1, 700, 12), rng.integers(8, 80, 12),
                                           strict=True))]  # fmt: skip
    sched = Scheduler(e, solo=False)
    launches = []
    orig_launch = e.decode_launch

    def counting_launch(seqs, after=None):
        launches.append(after is not None)
        return orig_launch(seqs, after)

    e.decode_launch = counting_launch
    try:
        seqs = [sched.add(*r) for r in reqs]
        while sched.has_work:
            sched.step()
    finally:
        del e.decode_launch  # the class's method again
    chained = sum(launches)
    ok = chained >= len(launches) // 2
    agree = []
    for seq, (prompt, params) in zip(seqs, reqs, strict=True):
        alone = list(e.generate(prompt, params, frozenset()))
        split = next((j for j, (x, y) in enumerate(zip(seq.tokens, alone, strict=False))
                      if x != y), None)  # fmt: skip
        same = len(seq.tokens) if split is None else split
        if params.greedy:
            margin = None
            if split is not None:
                margin = top2_margin(e.logits([*prompt, *alone[:split]])[-1])
                ok &= margin < SPLIT_MARGIN
            ok &= len(seq.tokens) == len(alone)
            log(f"  chain: greedy {len(prompt)}-token prompt, {len(seq.tokens)} tokens, split "
                f"{split} margin {margin}")  # fmt: skip
        else:
            agree.append(same / len(alone))
            log(f"  chain: sampled {len(prompt)}-token prompt, {same} of {len(alone)} tokens as "
                f"generate() alone")  # fmt: skip
    exact = chained_equals_unchained(e, rng)
    ok &= exact and e.kv_pages_in_use == 0
    log(f"  chain: {chained} of {len(launches)} decode steps chained; two chained steps of 8 "
        f"sampled rows draw what they draw launched one at a time: {exact}; pages held "
        f"{e.kv_pages_in_use}")  # fmt: skip
    return {"ok": ok, "chained": chained, "launches": len(launches), "sampled_agree": agree,
            "chained_equals_unchained": exact}  # fmt: skip


def chained_equals_unchained(e: CudaBackend, rng) -> bool:
    """Two decode steps of 8 seeded sequences at temperature 1.5 (draws far from certain),
    the second chained behind the first, then the same two steps again over the same rows,
    the second launched after the first's tokens are read: equal tokens."""
    d, V = Driver(e), e.config.vocab_size
    hot = [Seq(rng.integers(0, V, 64 + 37 * i).tolist(),
               SamplingParams(temperature=1.5, seed=7 + i, max_tokens=1 << 20), name=f"hot{i}")
           for i in range(8)]  # fmt: skip
    for s in hot:
        d.admit(s)
        while not d.prefill_step(s):
            pass
        e.block_manager.reserve(s.table, s.kv_len + 2)
    first = e.decode_launch(hot)
    second = e.decode_launch(hot, after=first)
    chained = [first.tokens(), second.tokens()]
    for s in hot:
        s.kv_len -= 2
    again = [e.decode_launch(hot).tokens()]
    for s, t in zip(hot, again[0], strict=True):
        s.tokens.append(t)
    again.append(e.decode_launch(hot).tokens())
    for s in hot:
        d.leave(s)
    return chained == again


def check_speculative(f, max_context: int, kv_tokens: int, plain: dict, log) -> dict:
    """A backend built with speculative=... answers decode_launch one token a step, the same
    tokens as the plain backend's (the batch path has no drafts)."""
    from nanoqwen.speculative import SpeculativeConfig

    e = CudaBackend(f, max_context, kv_tokens=kv_tokens, speculative=SpeculativeConfig())
    try:
        got = small_run(e)
    finally:
        e.close()
    same = got["tokens"] == plain["tokens"]
    log(f"  speculative engine: one token a step {got['one_token_a_step']}, tokens equal to "
        f"the plain engine's {same}")  # fmt: skip
    return {"ok": got["one_token_a_step"] and plain["one_token_a_step"], "same_tokens": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help=".nanoqwen model file")
    ap.add_argument("--out", required=True, help="directory for the log and batch_check.json")
    parts = "timing,sampler,correct,handoff,chain,speculative"
    ap.add_argument("--parts", default=parts, help=f"comma list: {parts}")
    ap.add_argument("--steps", type=int, default=64, help="decode steps of the longest rows")
    ap.add_argument("--long", type=int, default=8192, help="the long sequence's prompt")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="the KV pool's positions")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    fh = open(os.path.join(args.out, "batch_check.log"), "w")  # noqa: SIM115

    def log(msg: str) -> None:
        print(msg, flush=True)
        fh.write(msg + "\n")
        fh.flush()

    results: dict = {"parts": parts, "file": args.file}
    with NanoqwenFile(args.file) as f:
        max_context = args.long + 1024
        e = run_part("load", results, log, lambda: CudaBackend(
            f, max_context, kv_tokens=args.kv_tokens))  # fmt: skip
        if e is not None:
            log(
                f"loaded {f.config.name}: max_context {max_context}, kv pool "
                f"{e.kv.num_pages} pages, max_batch {e.max_batch}; plan {e.plan.describe()}"
            )
            results["load"] = {"max_batch": e.max_batch, "plan": e.plan.parts}
            # timing first: it maps the whole pool (set_decode_state) for the plain step, which
            # needs no page held, and a failed correctness part might leave some
            if "timing" in parts:
                run_part("timing", results, log, lambda: check_timing(e, args, log))
            if "sampler" in parts:
                run_part("sampler", results, log, lambda: check_sampler(e, log))
            if "correct" in parts:
                run_part("correct", results, log, lambda: check_correct(e, args, log))
            if "handoff" in parts:
                run_part("handoff", results, log, lambda: check_handoff(e, log))
            if "chain" in parts:
                run_part("chain", results, log, lambda: check_chain(e, log))
            plain = None
            if "speculative" in parts:
                plain = run_part("plain_small", results, log, lambda: small_run(e))
            e.close()
            if plain is not None:
                run_part("speculative", results, log, lambda: check_speculative(
                    f, max_context, args.kv_tokens, plain, log))  # fmt: skip
    ok = results.get("load") is not None and all(
        (results.get(p) or {}).get("ok", False) for p in parts
    )
    results["result"] = "PASS" if ok else "FAIL"
    with open(os.path.join(args.out, "batch_check.json"), "w") as out:
        json.dump(results, out, indent=1, default=str)
    failed = [p for p in ["load", *parts] if results.get(p) is None]
    log(f"parts that raised: {failed or 'none'}")
    log(f"RESULT {results['result']}")
    fh.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
