"""The stand-in engine of dev/server_overhead.py (nanoqwen.harness.paced): the real front end
over a backend whose steps only take time."""

from __future__ import annotations

import time

import pytest

from nanoqwen.harness.paced import TEXT, WAITS, PacedLLM, StepCosts
from nanoqwen.sampling import SamplingParams


@pytest.mark.parametrize("wait", WAITS)
def test_batch_streams_the_text_one_step_apart_and_frees_its_pages(tiny_model, wait) -> None:
    step_s = 0.002
    with PacedLLM(tiny_model, step_s, wait, max_batch=4) as llm:
        batch = llm.batch(3)
        lengths = (5, 9, 17)
        seqs = [batch.add(llm.prepare("x" * n), SamplingParams(max_tokens=n)) for n in lengths]
        text = {seq: "" for seq in seqs}
        start = time.perf_counter()
        while batch.has_work:
            for seq, delta in batch.step():
                text[seq] += delta.text
        elapsed = time.perf_counter() - start
        for seq, n in zip(seqs, lengths, strict=True):
            assert seq.finish_reason == "length" and text[seq] == (TEXT * 2)[: len(text[seq])]
            assert len(llm.tokenizer.encode(text[seq])) == n
        gaps, waits = llm.backend.take_times()
        # One wait a step; the stand-in device runs them one after the other, and a step
        # chained behind the one in flight starts the moment that one ends (gap 0).
        assert len(waits) == len(gaps) + 1 and elapsed >= len(waits) * step_s
        assert 0.0 in gaps
        assert llm.kv_pages_in_use == 0 and llm.backend.take_times() == ([], [])


def test_a_lone_stream_runs_solo_through_generate(tiny_model) -> None:
    with PacedLLM(tiny_model, 0.001) as llm:
        deltas = list(llm.stream(llm.prepare("hello"), SamplingParams(max_tokens=12)))
        assert "".join(d.text for d in deltas) == TEXT[: len("".join(d.text for d in deltas))]
        assert len(deltas) == 12 and deltas[-1].finish_reason == "length"
        assert len(llm.backend.waits) == 12  # the prefill, then one wait per token after the first
        assert llm.kv_pages_in_use == 0


def test_step_costs_wait_by_tokens_and_rows(tiny_model) -> None:
    """A prefill waits its tokens' cost (at least a pass over the weights), a chunk of at most
    max_batch ids and a decode step their rows' (the last entry past the table's end)."""
    from types import SimpleNamespace

    costs = StepCosts(prefill_token_s=0.0004, prefill_min_s=0.003, decode_s=(0.001, 0.004))
    assert costs.prefill(2) == 0.003 and costs.prefill(20) == pytest.approx(0.008)
    assert (costs.decode(1), costs.decode(2), costs.decode(9)) == (0.001, 0.004, 0.004)
    assert StepCosts.flat(0.002).prefill(500) == StepCosts.flat(0.002).decode(7) == 0.002
    with PacedLLM(tiny_model, costs) as llm:
        backend = llm.backend
        seqs = [SimpleNamespace(kv_len=0, tokens=[]) for _ in range(3)]
        backend.prefill_chunk(seqs[0], 20, sample=True)
        backend.prefill_chunk(seqs[1], 2, sample=False)
        backend.decode_launch(seqs).tokens()
        backend.decode_launch(seqs[:1]).tokens()
        _, waits = backend.take_times()
        # Each wait at least its cost: a sleep overshoots (on a busy box by ms), never undershoots.
        for waited, cost in zip(waits, (0.008, 0.004, 0.004, 0.001), strict=True):
            assert cost <= waited < cost + 0.5
        assert [s.kv_len for s in seqs] == [22, 3, 1]


def test_a_chained_step_runs_behind_the_one_in_flight(tiny_model) -> None:
    """decode_launch queues: a step launched before the last one is read starts when that one
    ends."""
    from types import SimpleNamespace

    with PacedLLM(tiny_model, StepCosts.flat(0.02)) as llm:
        backend = llm.backend
        seqs = [SimpleNamespace(kv_len=4, tokens=[1]) for _ in range(2)]
        start = time.perf_counter()
        first = backend.decode_launch(seqs)
        second = backend.decode_launch(seqs, after=first)
        assert first.tokens() == [backend._token(1)] * 2  # draw 1 each
        assert second.tokens() == [backend._token(2)] * 2  # the draw after first's
        assert 0.04 <= time.perf_counter() - start < 0.5
        assert second.ends == pytest.approx(first.ends + 0.02)  # no idle time between them
        gaps, waits = backend.take_times()
        assert gaps == [0.0] and len(waits) == 2
        assert [s.kv_len for s in seqs] == [6, 6]
