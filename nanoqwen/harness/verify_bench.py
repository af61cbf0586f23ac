"""`nanoqwen bench --workload verify`: the verify step (engine/verify.py, the pass over the
weights that speculative decoding feeds the step's token and its drafts) timed by its rows M,
beside the decode step, at one context.

The engine's own prefill writes the K/V of `context` random ids; the verify step then takes M
random tokens at positions context .. context + M - 1 and the decode step one token at position
context. Each is timed as a CUDA graph of `reps` copies (bench.time_graph: median of 5
launches), the decode step as its forward (embed, layers, lm_head + argmax; no sampler) and the
verify step as a whole (its lm_head_rows takes every row's argmax): microseconds, the ratio to
the verify step at M = 1 and to the decode step, and milliseconds a token if all M rows were
accepted. The decode step is what a step without drafts runs, so its column is the one that
says what a verify step costs over plain decoding. dev/verify_step.py checks the same step's
rows against the decode step and takes its cost apart by kernel.
"""

from __future__ import annotations

import datetime

import numpy as np

from ..engine.decode_loop import DecodeState
from .bench import commit_id, time_graph

DEFAULT_ROWS = (1, 2, 4, 8, 16)


class VerifyStep:
    """The engine's verify step (engine.verify.Verify) for up to ROWS rows on an engine built
    without speculation, with its own start word (the engine's loop passes the decode state's
    POS); `geometry` builds its kernels on another Geometry (dev/verify_step.py's variants)."""

    ROWS = 16

    def __init__(self, engine, geometry=None) -> None:
        from ..cuda.decode import DecodeKernels
        from ..engine.verify import Verify

        self.e, gpu = engine, engine.gpu
        geometry = geometry or engine.kernels.geometry
        kernels = DecodeKernels(gpu, engine.config, geometry, rows=True)
        self.v = Verify(gpu, engine.config, kernels, engine.weights, engine.kv,
                        engine.forward.rope, self.ROWS)  # fmt: skip
        self.start = gpu.alloc(4, "verify start").ptr
        self.attention = "auto"  # attention_rows' form: auto (the engine's), short or long
        self.long = False

    def set_rows(self, tokens: np.ndarray, start: int) -> None:
        """The step's input: tokens at positions start .. start + len(tokens) - 1, and the
        attention form the step takes there (synchronous)."""
        m, gpu, b = len(tokens), self.e.gpu, self.v.buf
        auto = self.v.verify.long_form(start, m)
        self.long = {"auto": auto, "short": False, "long": True}[self.attention]
        gpu.upload(b["tokens"], tokens.astype(np.int32))
        gpu.upload(b["pos"], np.arange(start, start + m, dtype=np.int32))
        gpu.upload(self.start, np.array([start], np.int32))
        gpu.memset(b["keys"], 0, self.ROWS * 8)
        gpu.sync("verify rows")

    def step(self, m: int, stream=None) -> None:
        """The verify step over the first m rows (engine/verify.py)."""
        self.v.step(m, self.start, self.long, stream)

    def logits(self, m: int) -> np.ndarray:
        out = np.empty((m, self.e.config.vocab_size), np.float32)
        return self.e.gpu.download(self.v.buf["logits"], out)


def prefill_context(engine, ids: np.ndarray) -> None:
    """K/V of ids at positions 0 .. len(ids) - 1 through the engine's prefill (the whole pool
    mapped: set_decode_state)."""
    engine.set_decode_state(DecodeState(token=int(ids[-1]), pos=len(ids) - 1))
    with engine.gpu.guard("prefill the context"):
        engine.loop.stage_ids(ids, engine.forward.scratch(len(ids))["ids"])
        engine.forward.prefill(len(ids))
        engine.gpu.sync("prefill the context")


def rows_table(decode_us: float, by_rows: dict[int, float]) -> list[dict]:
    """The table's rows from the decode step's and the verify step's microseconds by M: each
    M's ratio to M = 1 (None without an M = 1 row) and to the decode step, and ms a token if
    all M rows were accepted."""
    one = by_rows.get(1)
    return [
        {
            "m": m,
            "us": us,
            "x_m1": us / one if one else None,
            "x_decode": us / decode_us,
            "ms_per_token_all_accepted": us / 1e3 / m,
        }
        for m, us in sorted(by_rows.items())
    ]


def time_rows(engine, vs: VerifyStep, rows, context: int, reps: int = 20, seed: int = 0):
    """(decode step us, {M: verify step us}) at position `context` (its K/V written before)."""
    engine.set_decode_state(DecodeState(token=1, pos=context))
    decode_us = time_graph(engine.gpu, lambda s: engine.forward.decode_step(s), reps=reps) * 1e6
    rng = np.random.default_rng(seed)
    by_rows = {}
    for m in rows:
        vs.set_rows(rng.integers(0, engine.config.vocab_size, m), context)
        by_rows[m] = time_graph(engine.gpu, lambda s, m=m: vs.step(m, s), reps=reps) * 1e6
    return decode_us, by_rows


def run_verify_bench(engine, rows, context: int, reps: int = 20, seed: int = 0) -> dict:
    """The workload's result: the context's K/V prefilled from random ids, then time_rows."""
    cfg = engine.config
    if not rows or min(rows) < 1 or max(rows) > VerifyStep.ROWS:
        raise ValueError(f"verify rows must lie in 1..{VerifyStep.ROWS}, got {list(rows)}")
    rng = np.random.default_rng(seed)
    prefill_context(engine, rng.integers(0, cfg.vocab_size, context).astype(np.int32))
    vs = VerifyStep(engine)
    decode_us, by_rows = time_rows(engine, vs, rows, context, reps, seed)
    return {
        "workload": "verify",
        "gpu": engine.gpu.name,
        "commit": commit_id(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": cfg.name,
        "context": context,
        "reps": reps,
        "down_proj": vs.v.down,
        "decode_step_us": decode_us,
        "rows": rows_table(decode_us, by_rows),
    }


def print_verify_result(res: dict) -> None:
    print(f"verify step, {res['model']}, context {res['context']}, down_proj {res['down_proj']} "
          f"({res['gpu']}; us a step, graphs of {res['reps']})")  # fmt: skip
    print(f"  decode step {res['decode_step_us']:8.1f} us")
    print("     M       us   x M=1   x decode   ms/token if all M accepted")
    for r in res["rows"]:
        m1 = "" if r["x_m1"] is None else f"{r['x_m1']:6.3f}"
        print(f"  {r['m']:4d} {r['us']:8.1f}  {m1:>6}   {r['x_decode']:8.3f}   "
              f"{r['ms_per_token_all_accepted']:.3f}")  # fmt: skip
