"""speculate.cu on the GPU: draft_ngram and accept_greedy validated against nanoqwen.speculative
(the oracle), then draft_ngram timed (sm_90 GPU).

    PYTHONPATH=. python3 dev/speculate_check.py [--parts draft,accept,loop,timing] [--out DIR]

Validation (fresh random inputs every run, the seed printed; outputs poisoned first):
- draft: histories of lengths 1 .. 40000 (random over 4, 64 and 150k ids; runs; loops of period
  1..40 with 2% noise; a prompt block repeated later with edits), K 1..15, (n_min, n_max) from
  (1, 1) to (2, 8), step / max_new / capacity so the cap binds at 0, below K and above it, the
  backoff's SPEC_SKIP 0, 1 or 5; the history past len poisoned (-7). tokens[1 .. d] must be
  speculative.draft(h, cfg, step_limit(...)) through speculative.Backoff.gate, tokens[0] and
  the padding rows h[len - 1], positions POS + r, d exact; SPEC_SKIP and the skipped stats word
  as the gate leaves them.
- accept: after each draft, row keys in argmax_key format whose ids agree with a random prefix
  of the drafts; stop ids on some emitted token; max_new cutting some steps; a cancel flag on a
  few; SPEC_FAILS 0, 1, 2, 5 or 64 against backoff caps 0, 1, 4, 16 and graces 0..2. Against
  speculative.accept
  (one-hot logits) + speculative.cut + Backoff.update: the history's appended words (and the
  word after them untouched), the host ring (decode_loop.HostRing, mapped memory: slots and
  count), every state word (TOKEN/POS/STEP/DONE, SPEC_SKIP/SPEC_FAILS), the keys re-zeroed, the
  stats words.
- loop: the two kernels in a conditional while loop (a CUDA graph, as the engine will run
  them) with no verify step between them: the keys stay zero, so every row's argmax is id
  0xFFFFFFFF (-1 as int32), a model that always says -1. The history holds runs of -1 of 1..6
  tokens, each followed by other ids: while the reply's own run of -1 is short, the lookup
  drafts what followed a run in the history (rejected: the backoff drops and doubles), once it
  is long, more -1 (accepted: the backoff resets). The ring, every state word (the backoff's
  included), history and stats (skipped included) after the graph against the same steps on
  the host (eos, max_new 2, a stop on step one; backoff cap 0, cap 2 grace 0, cap 16 grace 1).

Timing (CUDA graphs of 20 launches, median of 5 graph launches; harness.bench.time_graph):
draft_ngram at history lengths 1 (the launch floor), 512, 8192, 32768 on a random history (few
candidates) and a run (every position a candidate, each compared n_max deep), K 4 / n 1..3;
accept_greedy alone. Microseconds a launch, and the history's bytes over the time.

Each part runs on its own: a failure prints its traceback and the next part runs. RESULT and
the table come last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from nanoqwen.config import preset
from nanoqwen.cuda.device import Gpu
from nanoqwen.cuda.registry import STATE_WORDS
from nanoqwen.cuda.speculate import SpeculateKernels
from nanoqwen.engine.decode_loop import DecodeState, HostRing
from nanoqwen.harness.bench import time_graph
from nanoqwen.harness.gpu_script import gpu_session, run_part
from nanoqwen.harness.prefill_checks import wait_or_die
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import Backoff, SpeculativeConfig, accept, cut, draft, step_limit

CAPACITY = 40960  # history words (a multiple of 4); the longest history is 40000
POISON = -7  # history past len, tokens / positions / ring before a launch
# (K, n_min, n_max, backoff_cap, backoff_grace)
CONFIGS = ((1, 1, 1, 0, 1), (4, 1, 3, 1, 0), (15, 1, 3, 16, 1), (7, 2, 4, 4, 2), (3, 1, 8, 16, 0),
           (15, 2, 8, 1, 1), (2, 3, 3, 4, 0))  # fmt: skip
LENGTHS = (1, 2, 3, 4, 5, 6, 17, 111, 512, 4097, 8192, 32768, 40000)
TIME_LENGTHS = (1, 512, 8192, 32768)
CFG = preset("tiny")  # speculate.cu reads no model dims
DEVICE = "cuda"  # of the torch buffers


class Bufs:
    """Device buffers of one check: history, state, rows, keys, stats; the mapped host ring."""

    def __init__(self, gpu: Gpu):
        dev = dict(device=DEVICE, dtype=torch.int32)
        self.h = torch.full((CAPACITY,), POISON, **dev)
        self.state = torch.zeros(STATE_WORDS, **dev)
        self.tokens = torch.zeros(16, **dev)
        self.positions = torch.zeros(16, **dev)
        self.nd = torch.zeros(1, **dev)
        self.keys = torch.zeros(16, device=DEVICE, dtype=torch.int64)
        self.stats = torch.zeros(4, **dev)  # steps, drafted, accepted, skipped
        self.ring = HostRing(gpu, CAPACITY)

    def ptr(self, name: str) -> int:
        return getattr(self, name).data_ptr()


def history(rng, length: int) -> np.ndarray:
    kind = rng.integers(0, 6)
    if kind == 0:
        return rng.integers(0, [4, 64, 150000][rng.integers(0, 3)], length)
    if kind == 1:
        return np.full(length, int(rng.integers(0, 9)))
    if kind in (2, 3):
        period = int(rng.integers(1, 41))
        loop = np.resize(rng.integers(0, 500, period), length)
        noise = rng.random(length) < 0.02
        return np.where(noise, rng.integers(0, 500, length), loop)
    block = rng.integers(0, 2000, max(1, length // 3))  # a prompt block repeated with edits
    h = np.resize(np.concatenate([block, rng.integers(0, 2000, length // 5 + 1), block]), length)
    edits = rng.random(length) < 0.01
    return np.where(edits, rng.integers(0, 2000, length), h)


def set_state(b: Bufs, st: DecodeState) -> None:
    b.state.copy_(torch.from_numpy(st.to_words()))


def run_draft(b: Bufs, sk, hist, st: DecodeState) -> tuple[list, list, int]:
    b.h.fill_(POISON)
    b.h[: len(hist)] = torch.from_numpy(hist.astype(np.int32))
    set_state(b, st)
    for t in (b.tokens, b.positions, b.nd):
        t.fill_(POISON)
    b.stats.zero_()
    sk.draft(b.ptr("h"), b.ptr("state"), b.ptr("tokens"), b.ptr("positions"), b.ptr("nd"),
             b.ptr("stats"))  # fmt: skip
    wait_or_die(sk.gpu, "draft_ngram")
    k = sk.spec.k
    return b.tokens[: k + 1].tolist(), b.positions[: k + 1].tolist(), int(b.nd.item())


def check_draft_case(b, sk, hist, st, log) -> tuple[bool, list, DecodeState]:
    """One draft against the oracle; returns (ok, drafts, the state after it)."""
    tokens, positions, d = run_draft(b, sk, hist, st)
    length, k = len(hist), sk.spec.k
    backoff = Backoff(skip=st.spec_skip, fails=st.spec_fails)
    found = draft(hist, sk.spec, step_limit(st.max_new, st.step, length, sk.capacity))
    want = backoff.gate(found)
    after = replace(st, spec_skip=backoff.skip)
    last = int(hist[-1])
    ok = (
        d == len(want)
        and tokens[1 : 1 + d] == want
        and tokens[0] == last
        and all(t == last for t in tokens[1 + d :])
        and positions == list(range(length - 1, length + k))
        and b.state.cpu().numpy().tolist() == after.to_words().tolist()
        and b.stats.tolist() == [0, 0, 0, int(len(want) < len(found))]
    )
    if not ok:
        got = DecodeState.from_words(b.state.cpu().numpy())
        log(f"  * draft len {length} cfg {sk.spec} step {st.step}/{st.max_new} skip "
            f"{st.spec_skip}: got d={d} {tokens} {positions[:3]}..., skip {got.spec_skip}, "
            f"stats {b.stats.tolist()}; want {want}, skip {backoff.skip}")  # fmt: skip
    return ok, want, after


def random_state(rng, length: int, k: int) -> tuple[DecodeState, int]:
    """A state whose cap binds at max_new (0, < K) or not, skipping on half the cases (the
    backoff's SPEC_SKIP 1 or 5; SPEC_FAILS from none to saturated), and a capacity that binds
    on a quarter of the cases (the kernel's argument; the buffer stays CAPACITY long)."""
    step = int(rng.integers(0, 50))
    left = int(rng.choice([1, 2, k, k + 1, k + 2, 1000]))
    tight = rng.random() < 0.25
    capacity = -(-(length + 1 + int(rng.integers(0, 12))) // 4) * 4 if tight else CAPACITY
    skip = int(rng.choice([0, 0, 1, 5]))
    fails = int(rng.choice([0, 1, 2, 5, 64])) if skip == 0 else 4
    st = DecodeState(pos=length - 1, step=step, max_new=step + left, spec_skip=skip,
                     spec_fails=fails)  # fmt: skip
    return st, capacity


def one_hot_keys(rng, targets: list[int]) -> np.ndarray:
    """u64 argmax keys (common.cuh argmax_key) of rows whose argmax ids are `targets`."""
    out = []
    for t in targets:
        bits = int(np.float32(rng.normal() * 5).view(np.uint32))
        bits = (~bits & 0xFFFFFFFF) if bits & 0x80000000 else bits | 0x80000000
        out.append((bits << 32) | (0xFFFFFFFF - t))
    return np.array(out, np.uint64).view(np.int64)


def expected(targets, drafts, eos, left):
    """speculative.accept on one-hot logits, then cut: (kept, emitted, stopped)."""
    v = max(max(targets), max(drafts, default=0)) + 1
    logits = torch.full((len(drafts) + 1, v), -1.0)
    logits[torch.arange(len(drafts) + 1), torch.tensor(targets[: len(drafts) + 1])] = 1.0
    kept = accept(logits, drafts, SamplingParams(temperature=0.0))
    emitted, stopped = cut(kept, left, frozenset(eos))
    return kept, emitted, stopped


def accept_inputs(rng, drafts, k, hist):
    """Row targets agreeing with a random prefix of the drafts, and stop ids."""
    agree = int(rng.integers(0, len(drafts) + 1))
    targets = drafts[:agree] + rng.integers(0, 3000, k + 1 - agree).tolist()
    if agree < len(drafts) and targets[agree] == drafts[agree]:
        targets[agree] += 1
    eos = rng.integers(3000, 4000, int(rng.integers(0, 3))).tolist()
    if rng.random() < 0.3:  # a stop id among the tokens the step would emit
        eos.append(targets[int(rng.integers(0, agree + 1))])
    return targets, sorted(set(eos))[:8]


def run_accept(b: Bufs, sk, st: DecodeState, keys: np.ndarray, cancel: bool) -> None:
    k = sk.spec.k
    b.keys.fill_(-5)  # rows past 1 + K keep it
    b.keys[: k + 1] = torch.from_numpy(keys)
    b.stats.zero_()
    set_state(b, st)
    ring = b.ring
    ring.reset()
    ring.view[2:] = POISON
    ring.view[1] = st.step  # the count earlier steps left
    ring.view[0] = int(cancel)
    sk.accept(b.ptr("keys"), b.ptr("tokens"), b.ptr("nd"), b.ptr("state"), b.ptr("h"),
              ring.ring_ptr, ring.cancel_ptr, b.ptr("stats"), 0)  # fmt: skip
    wait_or_die(sk.gpu, "accept_greedy")


def check_accept_case(b, sk, hist, st, drafts, rng, log) -> bool:
    """st: the state draft_ngram left (its SPEC_SKIP used)."""
    k, length = sk.spec.k, len(hist)
    targets, eos = accept_inputs(rng, drafts, k, hist)
    st = replace(st, eos=tuple(eos))
    cancel = rng.random() < 0.1
    run_accept(b, sk, st, one_hot_keys(rng, targets), cancel)
    kept, emitted, stopped = expected(targets, drafts, eos, st.max_new - st.step)
    backoff = Backoff(skip=st.spec_skip, fails=st.spec_fails)
    backoff.update(len(drafts), len(kept) - 1, sk.spec)
    e = len(emitted)
    got_h = b.h[length : length + e + 1].tolist()
    at = 2 + st.step  # slot `step` of the ring; the word before it: a token, or the count
    ring = ([int(b.ring.view[at - 1])] if st.step else [POISON]) + b.ring.view[
        at : at + e + 1
    ].tolist()
    want_st = DecodeState(
        token=emitted[-1],
        pos=st.pos + e,
        step=st.step + e,
        max_new=st.max_new,
        done=stopped or st.step + e >= st.max_new or cancel,
        eos=st.eos,
        spec_skip=backoff.skip,
        spec_fails=backoff.fails,
    )
    checks = {
        "history": got_h == emitted + [POISON],
        "ring": ring == [POISON] + emitted + [POISON],
        "count": b.ring.count == st.step + e,
        "state": b.state.cpu().numpy().tolist() == want_st.to_words().tolist(),
        "keys": b.keys[: k + 1].eq(0).all().item() and b.keys[k + 1 :].eq(-5).all().item(),
        "stats": b.stats.tolist() == [1, len(drafts), len(kept) - 1, 0],
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        log(
            f"  * accept len {length} cfg {sk.spec} drafts {drafts} targets {targets} eos {eos} "
            f"step {st.step}/{st.max_new} cancel {cancel}: wrong {bad}; want {emitted}, "
            f"got h {got_h}, ring {ring}, state {DecodeState.from_words(b.state.cpu().numpy())}"
        )
    return not bad


def capped(log, most: int = 12):
    """`log` that prints at most `most` failure lines (those starting "  *"), then says so."""
    seen = [0]

    def out(msg: str) -> None:
        if msg.startswith("  *"):
            seen[0] += 1
            if seen[0] > most:
                if seen[0] == most + 1:
                    log(f"  * (further failures not printed; at most {most})")
                return
        log(msg)

    return out


def check_draft_accept(gpu, rng, log, parts) -> dict:
    """Both kernels on every (config, length) and random lengths; returns {part: ok}."""
    b, log = Bufs(gpu), capped(log)
    stats = {"draft": [0, 0, 0, 0], "accept": [0, 0]}  # cases, failures, drafted, dropped; ..
    for k, n_min, n_max, cap, grace in CONFIGS:
        spec = SpeculativeConfig(k=k, n_min=n_min, n_max=n_max, backoff_cap=cap,
                                 backoff_grace=grace)  # fmt: skip
        sk = SpeculateKernels(gpu, CFG, spec, CAPACITY)
        lengths = [*LENGTHS, *rng.integers(1, 40001, 12).tolist()]
        for length in lengths * 3:
            hist = history(rng, int(length))
            st, sk.capacity = random_state(rng, len(hist), k)
            ok, drafts, after = check_draft_case(b, sk, hist, st, log)
            s = stats["draft"]
            s[0], s[1], s[2] = s[0] + 1, s[1] + (not ok), s[2] + (len(drafts) > 0)
            s[3] += after.spec_skip < st.spec_skip
            if "accept" in parts and ok:
                ok = check_accept_case(b, sk, hist, st=after, drafts=drafts, rng=rng, log=log)
                stats["accept"][0] += 1
                stats["accept"][1] += not ok
    d, a = stats["draft"], stats["accept"]
    log(f"  draft: {d[0]} cases ({d[2]} with drafts, {d[3]} dropped by the backoff), {d[1]} "
        f"wrong; accept: {a[0]} cases, {a[1]} wrong")  # fmt: skip
    out = {"draft": d[1] == 0 and d[2] + d[3] > d[0] // 4 and d[3] > d[0] // 20}
    if "accept" in parts:
        out["accept"] = a[1] == 0 and a[0] > 0
    return out


# -- the loop -----------------------------------------------------------------------------------
def simulate_loop(hist: list[int], st: DecodeState, spec, capacity: int):
    """The loop on the host with every row's argmax -1: (history, ring from st.step, steps,
    [steps, drafted, accepted, skipped], the Backoff at the end)."""
    h, step, ring, counts = list(hist), st.step, [], [0, 0, 0, 0]
    backoff = Backoff()
    while True:
        found = draft(h, spec, step_limit(st.max_new, step, len(h), capacity))
        drafts = backoff.gate(found)
        agree = next((i for i, t in enumerate(drafts) if t != -1), len(drafts))
        backoff.update(len(drafts), agree, spec)
        emitted, stopped = cut([-1] * (agree + 1), st.max_new - step, frozenset(st.eos))
        counts = [counts[0] + 1, counts[1] + len(drafts), counts[2] + agree,
                  counts[3] + (len(drafts) < len(found))]  # fmt: skip
        h, ring, step = h + emitted, ring + emitted, step + len(emitted)
        if stopped or step >= st.max_new:
            return h, ring, step, counts, backoff


def with_runs(rng, length: int) -> list[int]:
    """Ids below 50 with a run of 1..6 ids -1 starting at ~10% of the positions."""
    out: list[int] = []
    while len(out) < length:
        out += [-1] * int(rng.integers(1, 7)) if rng.random() < 0.1 else [int(rng.integers(0, 50))]
    return out[:length]


def check_loop(gpu, rng, log) -> bool:
    """draft + (keys left zero) + accept in a graph's while loop, against simulate_loop."""
    b, ok, skipped = Bufs(gpu), True, 0
    cases = (((), 60), ((), 2), ((-1,), 60), ((5000,), 300), ((), 400))
    backoffs = ((0, 1), (2, 0), (16, 1))  # (cap, grace)
    for (cap, grace), (eos, max_new) in [(b, case) for b in backoffs for case in cases]:
        spec = SpeculativeConfig(k=4, n_min=1, n_max=3, backoff_cap=cap, backoff_grace=grace)
        sk = SpeculateKernels(gpu, CFG, spec, CAPACITY)
        hist = with_runs(rng, int(rng.integers(50, 400)))
        st = DecodeState(pos=len(hist) - 1, step=1, max_new=max_new, eos=eos)
        b.h.fill_(POISON)
        b.h[: len(hist)] = torch.tensor(hist, dtype=torch.int32)
        set_state(b, st)
        b.keys.zero_()
        b.stats.zero_()
        b.ring.reset()
        b.ring.view[1], b.ring.view[2] = 1, hist[-1]  # the prefill's token, step 0
        run_graph(gpu, sk, b)
        h, ring, step, counts, backoff = simulate_loop(hist, st, spec, CAPACITY)
        want = replace(st, token=h[-1], pos=len(h) - 1, step=step, done=True,
                       spec_skip=backoff.skip, spec_fails=backoff.fails)  # fmt: skip
        checks = {
            "history": b.h[: len(h) + 1].tolist() == h + [POISON],
            "ring": b.ring.tokens(step)[1:] == ring and b.ring.count == step,
            "state": b.state.cpu().numpy().tolist() == want.to_words().tolist(),
            "stats": b.stats.tolist() == counts,
        }
        bad = [name for name, good in checks.items() if not good]
        ok &= not bad
        skipped += counts[3]
        log(
            f"  {'*' if bad else ' '} loop cap {cap} grace {grace} eos {eos} max_new {max_new}: "
            f"{counts[0]} "
            f"steps, {counts[1]} drafted, {counts[2]} accepted, {counts[3]} skipped, "
            f"{step - 1} tokens, fails {backoff.fails}; wrong: {bad or 'none'}"
        )
    return ok and skipped > 0


def run_graph(gpu, sk, b: Bufs) -> None:
    ptr = b.ptr
    with gpu.guard("speculate_check: the loop graph"):
        gb = gpu.graph_builder()
        cond = gb.create_condition(default_value=1)
        loop = gb.while_loop(cond).begin_building()
        sk.draft(ptr("h"), ptr("state"), ptr("tokens"), ptr("positions"), ptr("nd"),
                 ptr("stats"), stream=loop)  # fmt: skip
        sk.accept(ptr("keys"), ptr("tokens"), ptr("nd"), ptr("state"), ptr("h"),
                  b.ring.ring_ptr, b.ring.cancel_ptr, ptr("stats"), cond, stream=loop)  # fmt: skip
        loop.end_building()
        graph = gb.end_building().complete()
        graph.upload(gpu.stream)
        graph.launch(gpu.stream)
    wait_or_die(gpu, "the speculation loop graph")
    graph.close()


# -- timing -------------------------------------------------------------------------------------
def time_kernels(gpu, rng, log) -> list[tuple]:
    b, rows = Bufs(gpu), []
    sk = SpeculateKernels(gpu, CFG, SpeculativeConfig(k=4, n_min=1, n_max=3), CAPACITY)
    ptr = b.ptr
    for kind in ("random", "run"):
        for length in TIME_LENGTHS:
            hist = rng.integers(0, 150000, length) if kind == "random" else np.full(length, 3)
            b.h[:length] = torch.from_numpy(hist.astype(np.int32))
            set_state(b, DecodeState(pos=length - 1, step=0, max_new=1000))

            def body(s):
                sk.draft(ptr("h"), ptr("state"), ptr("tokens"), ptr("positions"), ptr("nd"),
                         stream=s)  # fmt: skip

            us = 1e6 * time_graph(gpu, body, 20)
            rows.append(("draft_ngram", kind, length, us, 4 * length / us / 1e3))
            log(f"draft_ngram {kind:6s} len {length:6d}: {us:7.2f} us")
    st = DecodeState(pos=511, step=0, max_new=1 << 20)

    def body(s):
        sk.accept(ptr("keys"), ptr("tokens"), ptr("nd"), ptr("state"), ptr("h"), 0, 0, 0, 0,
                  stream=s)  # fmt: skip

    us = 1e6 * time_graph(gpu, body, 20, reset=lambda: set_state(b, st))
    rows.append(("accept_greedy", "-", 0, us, 0.0))
    log(f"accept_greedy: {us:7.2f} us")
    return rows


# -- the run ------------------------------------------------------------------------------------
def run(parts: set[str], gpu: Gpu, log) -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    log(f"device {gpu.name} SMs {gpu.num_sms} torch {torch.__version__} seed {seed} "
        f"date {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    rng = np.random.default_rng(seed)
    results: dict = {}
    verdict: dict = {}
    if parts & {"draft", "accept"}:
        run_part("draft+accept", results, log, lambda: check_draft_accept(gpu, rng, log, parts))
        for name in ("draft", "accept"):
            if name in parts:
                verdict[name] = bool((results["draft+accept"] or {}).get(name))
    if "loop" in parts:
        run_part("loop", results, log, lambda: check_loop(gpu, rng, log))
        verdict["loop"] = bool(results["loop"])
    table = []
    if "timing" in parts:
        run_part("timing", results, log, lambda: time_kernels(gpu, rng, log))
        table = results["timing"] or []
    words = [f"{k} {'PASS' if v else 'FAIL'}" for k, v in verdict.items()]
    log("RESULT " + (", ".join(words) or "timing only"))
    if table:
        log(f"\n{'kernel':14s} {'history':>8s} {'len':>6s} {'us':>8s} {'GB/s':>7s}"
            "   (a launch in a graph of 20; K 4, n 1..3)")  # fmt: skip
        for kernel, kind, length, us, gbs in table:
            log(f"{kernel:14s} {kind:>8s} {length:6d} {us:8.2f} {gbs:7.1f}")
    return 0 if all(verdict.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="draft,accept,loop,timing",
                    help="comma list: draft, accept (needs draft), loop, timing")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="log directory")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "accept" in parts:
        parts.add("draft")
    with gpu_session(args.out, "speculate_check.log") as (gpu, log):
        return run(parts, gpu, log)


if __name__ == "__main__":
    sys.exit(main())
