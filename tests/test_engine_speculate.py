"""The host side of the cuda backend's speculative loop (nanoqwen/engine/speculate.py), on the
CPU: positions and page reservation, the memory plan, the graph body's cases and its
greedy / sampled ends (with fakes), and an emulation of the device loop's K/V writes that
checks the reservation bound and the prefix-cache commit rule."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nanoqwen.config import preset
from nanoqwen.cuda.registry import StateWord, StepCase
from nanoqwen.engine import speculate as sp
from nanoqwen.engine.memory import plan_memory
from nanoqwen.speculative import Backoff, SpeculativeConfig, cut, draft, step_limit

SPEC = SpeculativeConfig(k=4)


def test_positions_and_reservation():
    assert sp.kv_positions(1000, None) == 1000
    assert sp.kv_positions(1000, SPEC) == 1004
    assert sp.reserved_tokens(17, 111, None) == 128
    assert sp.reserved_tokens(17, 111, SPEC) == 132
    for n in (1, 3, 4, 17, 4097):
        cap = sp.history_capacity(n)
        assert cap % 4 == 0 and n <= cap < n + 4 and cap >= 4


def test_stats_words():
    s = sp.stats_from_words(np.array([5, 12, 9, 3], np.int32))
    assert (s.steps, s.drafted, s.accepted, s.skipped) == (5, 12, 9, 3)


@pytest.mark.parametrize("model", ["0.5b", "7b"])
def test_memory_plan_counts_speculation(model):
    cfg = preset(model)
    plain = plan_memory(cfg, 4096)
    spec = plan_memory(cfg, 4096, speculative=SpeculativeConfig(k=15))
    assert "speculation" not in plain.parts
    assert spec.parts["speculation"] > 16 * cfg.vocab_size * 4  # the 16 rows' logits at least
    assert spec.parts["kv_cache"] > plain.parts["kv_cache"]  # 15 positions more: one more page
    assert spec.parts["decode_buffers"] > plain.parts["decode_buffers"]  # the RoPE rows
    assert spec.needed > plain.needed


def test_step_limit_never_binds_on_capacity():
    """capacity >= max_context >= P + max_new: the max_new term is always the smaller."""
    rng = np.random.default_rng()
    for _ in range(2000):
        max_context = int(rng.integers(2, 5000))
        prompt = int(rng.integers(1, max_context))
        max_new = int(rng.integers(1, max_context - prompt + 1))
        cap = sp.history_capacity(max_context)
        for step in (0, max_new // 2, max_new - 1):
            length = prompt + step  # step tokens generated: a history of P + step
            assert step_limit(max_new, step, length, cap) == max_new - step - 1


# -- the graph body with fakes -------------------------------------------------------------------
class FakeBuilder:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def create_condition(self, default_value=None):
        self.log.append((self.name, "create_condition", default_value))
        return f"cond@{self.name}"

    def switch(self, cond, count):
        self.log.append((self.name, "switch", cond, count))
        return tuple(FakeBuilder(self.log, f"case{c}") for c in range(count))

    def begin_building(self):
        self.log.append((self.name, "begin"))
        return self

    def end_building(self):
        self.log.append((self.name, "end"))


class Recorder:
    def __init__(self, log: list, what: str) -> None:
        self.log, self.what = log, what

    def __getattr__(self, name):
        def call(*args, stream=None, **kw):
            self.log.append((stream.name, f"{self.what}.{name}", args, kw))

        return call


def fake_spec_loop(log: list) -> sp.SpecLoop:
    """A SpecLoop over fake kernels and buffers (no Gpu)."""
    s = object.__new__(sp.SpecLoop)
    s.spec, s.h, s.ndraft, s.stats, s.picks = SPEC, 0x1000, 0x2000, 0x3000, 0x6000
    s.kernels = Recorder(log, "spec")
    s.verify = Recorder(log, "verify")
    s.verify.buf = {"tokens": 0x10, "pos": 0x20, "keys": 0x30, "logits": 0x40}
    s.verify.verify = type("VerifyKernels", (), {"long_pages": 193})()

    class Loop:
        state = 0x4000
        host = type("H", (), {"ring_ptr": 0x5008, "cancel_ptr": 0x5000})()

        def word(self, w):
            return self.state + 4 * int(w)

    forward = Recorder(log, "forward")
    forward.logits = 0x50
    s.e = type("E", (), {"loop": Loop(), "forward": forward})()
    return s


BRANCHES = [
    ("loop", "create_condition"),
    ("loop", "spec.draft"),
    ("loop", "switch"),
    ("case0", "begin"),
    ("case0", "forward.decode_step"),
    ("case0", "end"),
    ("case1", "begin"),
    ("case1", "verify.step"),
    ("case1", "end"),
    ("case2", "begin"),
    ("case2", "verify.step"),
    ("case2", "end"),
]


def body_log(greedy: bool) -> tuple[list, list, dict]:
    """The fake loop body's log, its calls [(builder, what)], and {what: (args, kwargs)}."""
    log: list = []
    fake_spec_loop(log).body(FakeBuilder(log, "loop"), "while-cond", greedy)
    return log, [(b, what) for b, what, *_ in log], {what: rest for _, what, *rest in log}


def test_body_drafts_then_switches_then_accepts():
    """draft_ngram sets the case (registry.StepCase: its values index the switch's bodies):
    the decode step, the verify step with attention_rows' short form, with its long form."""
    log, calls, by = body_log(greedy=True)
    assert calls == [*BRANCHES, ("loop", "spec.accept")]
    assert log[0][2] == StepCase.CASE_DECODE == 0  # the case defaults to the decode step
    assert log[2][2:] == ("cond@loop", len(StepCase)) == ("cond@loop", 3)
    draft_args, draft_kw = by["spec.draft"]
    assert draft_args[-1] == "cond@loop"  # draft_ngram sets the case
    assert draft_kw == {"long_pages": 193}  # VerifyKernels' threshold
    assert draft_args[:6] == (0x1000, 0x4000, 0x10, 0x20, 0x2000, 0x3000)  # stats: skipped
    steps = [(b, rest) for b, what, *rest in log if what == "verify.step"]
    pos = 0x4000 + 4 * int(StateWord.POS)
    assert steps == [(f"case{int(StepCase.CASE_VERIFY)}", [(1 + SPEC.k, pos), {"long": False}]),
                     (f"case{int(StepCase.CASE_VERIFY_LONG)}",
                      [(1 + SPEC.k, pos), {"long": True}])]  # fmt: skip
    assert by["forward.decode_step"][1] == {"key": 0x30}  # row 0's key, accept reads it
    accept_args = by["spec.accept"][0]
    assert accept_args[0] == 0x30 and accept_args[-1] == "while-cond"
    assert accept_args[5:7] == (0x5008, 0x5000)  # the host ring and the cancel flag


def test_sampled_body_ends_on_sample_rows_and_accept_sampled():
    _, calls, by = body_log(greedy=False)
    assert calls == [*BRANCHES, ("loop", "spec.sample_rows"), ("loop", "spec.accept_sampled")]
    # The verify step's logits, the decode step's (row 0 without drafts), the keys, tokens, d,
    # the state; the picks.
    assert by["spec.sample_rows"][0] == (0x40, 0x50, 0x30, 0x10, 0x2000, 0x4000, 0x6000)
    assert by["spec.accept_sampled"][0] == (0x30, 0x10, 0x2000, 0x6000, 0x4000, 0x1000, 0x5008,
                                            0x5000, 0x3000, "while-cond")  # fmt: skip


# -- an emulation of the device loop's K/V writes --------------------------------------------------
def next_token(prefix: tuple[int, ...]) -> int:
    """A deterministic toy model with repetition (drafts hit often, but not always)."""
    if len(prefix) >= 7 and hash(prefix[-3:]) % 5:
        return prefix[-7]
    return (sum(prefix[-3:]) * 31 + len(prefix)) % 50


def emulate(prompt: list[int], max_new: int, max_context: int, eos: int | None,
            backoff_cap: int = 2):  # fmt: skip
    """The speculative loop as the graph runs it: (emitted tokens, kv {position: (token,
    prefix)}, history, skipped steps). Rows past d write K/V too (the verify step runs 1 + K
    rows); the backoff (cap `backoff_cap`) drops drafts after rejections."""
    h, kv = list(prompt), {}
    for p in range(len(h)):  # the prefill
        kv[p] = (h[p], tuple(h[:p]))
    out = [next_token(tuple(h))]
    h.append(out[0])
    cap = sp.history_capacity(max_context)
    backoff, skipped = Backoff(), 0
    while len(out) < max_new and (eos is None or out[-1] != eos):
        pos = len(h) - 1
        found = draft(h, SPEC, step_limit(max_new, len(out), len(h), cap))
        drafts = backoff.gate(found)
        skipped += len(drafts) < len(found)
        d = len(drafts)
        rows = [h[-1], *drafts] + ([h[-1]] * (SPEC.k - d) if d else [])
        for r, tok in enumerate(rows):
            kv[pos + r] = (tok, tuple(h[:pos]) + tuple(rows[:r]))
        targets = [next_token(tuple(h) + tuple(drafts[:r])) for r in range(d + 1)]
        agree = 0
        while agree < d and drafts[agree] == targets[agree]:
            agree += 1
        backoff.update(d, agree, replace(SPEC, backoff_cap=backoff_cap))
        kept, _ = cut(targets[: agree + 1], max_new - len(out), {eos} if eos is not None else ())
        out += kept
        h += kept
    return out, kv, h, skipped


@pytest.mark.parametrize("prompt_len,max_new,eos", [(1, 1, None), (3, 17, None), (17, 111, 7),
                                                    (40, 60, None), (5, 200, 3)])  # fmt: skip
def test_emulated_loop_reservation_and_commit(prompt_len, max_new, eos):
    rng = np.random.default_rng()
    prompt = rng.integers(0, 50, prompt_len).tolist()
    max_context = prompt_len + max_new + int(rng.integers(0, 3))
    out, kv, h, _ = emulate(prompt, max_new, max_context, eos)
    plain = []  # greedy one token a step
    while len(plain) < max_new and (not plain or plain[-1] != eos):
        plain.append(next_token(tuple(prompt + plain)))
    assert out == plain
    reserved = sp.reserved_tokens(prompt_len, max_new, SPEC)
    assert max(kv) < reserved  # every row's K/V lands in the reserved pages
    assert max(kv) < sp.kv_positions(max_context, SPEC)  # and inside the pool
    # The commit: the prompt and every generated token but the last; their K/V are right.
    committed = prompt + out[:-1]
    for p, tok in enumerate(committed):
        assert kv[p] == (tok, tuple(committed[:p])), p


def test_emulated_loop_backoff_skips_and_keeps_the_tokens():
    """The backoff drops drafts on the toy model (it rejects often) and changes no token."""
    rng = np.random.default_rng()
    skipped = 0
    for _ in range(10):
        prompt = rng.integers(0, 50, 40).tolist()
        off, _, _, none = emulate(prompt, 200, 242, None, backoff_cap=0)
        on, _, _, n = emulate(prompt, 200, 242, None, backoff_cap=4)
        assert on == off and none == 0
        skipped += n
    assert skipped > 0


def test_cuda_backend_takes_the_reference_backends_argument():
    import inspect

    from nanoqwen.engine import CudaBackend
    from nanoqwen.reference import ReferenceBackend

    for cls in (CudaBackend, ReferenceBackend):
        assert inspect.signature(cls.__init__).parameters["speculative"].default is None


class FakeGpu:
    """Host memory in place of the device: alloc_mapped gives a ctypes buffer's address."""

    def __init__(self) -> None:
        self.keep, self.copies = [], []

    def alloc_mapped(self, nbytes: int):
        import ctypes

        buf = (ctypes.c_int32 * (nbytes // 4))()
        self.keep.append(buf)
        return ctypes.addressof(buf), 0

    def alloc(self, nbytes: int, what: str):
        return type("Buf", (), {"ptr": 0x10000 * (len(self.keep) + 1)})()

    def upload_async(self, dst: int, src: int, nbytes: int) -> None:
        self.copies.append((dst, nbytes))


@pytest.mark.parametrize("max_context,k", [(17, 15), (4096, 4), (4095, 1), (32768, 15)])
def test_page_table_staging_covers_the_speculative_reservation(max_context, k):
    from nanoqwen.config import PAGE_TOKENS
    from nanoqwen.engine.decode_loop import DecodeLoop

    spec = SpeculativeConfig(k=k)
    positions = sp.kv_positions(max_context, spec)
    loop = DecodeLoop(FakeGpu(), None, max_context, positions)
    prompt, max_new = max_context // 2, max_context - max_context // 2  # the longest that fits
    pages = -(-sp.reserved_tokens(prompt, max_new, spec) // PAGE_TOKENS)
    assert pages <= -(-positions // PAGE_TOKENS)  # the pool has them
    loop.stage_pages(list(range(pages)), 0x100)  # and the staging area takes the table
    assert loop.gpu.copies[-1] == (0x100, 4 * pages)
    assert loop.host.staging[loop._pages_at + pages - 1] == pages - 1
