"""The layer and graph tiers on real weights (harness.real_text.is_real): real code, not random
ids, and gates for real-weight noise (config/nanoqwen.yaml, ladder.layer.real and
ladder.graph.real, each with its reason).

layer  layer 0 through the decode path on the first code window, against the float32 reference
       (max |err| / rms and rms err / rms), gated at a multiple of the error of the reference
       itself with the engine's fp16 storage emulated (reference.Fp16Storage) on the same
       tokens: a real layer 0's output has channels tens of times its rms, and fp16 rounds each
       element to 2^-11 of its own size, so a fixed tolerance in units of the rms would be a
       guess per model, the emulation is a measurement
graph  teacher-forced logits of the decode and prefill paths on code windows: top-1 agreement
       at the positions whose reference top-2 margin is clear of the near-tie bound, and the
       99th percentile of the per-position max |dlogit| / std, each beside the same figures
       of the reference with the engine's fp16 storage emulated (what storage rounding alone
       costs on these tokens: not gated); then greedy generations from window openings,
       identical except at a near-tie (the margin at the first split shown)
"""

from __future__ import annotations

import time

import numpy as np

from . import real_text
from .validate import Check, _reference


def _windows(file, count: int, tokens: int) -> list[list[int]]:
    from ..tokenizer import Tokenizer

    return real_text.code_windows(Tokenizer.from_spec(file.tokenizer), count, tokens)


def _layer0(ref, ids: list[int], dev: str, storage) -> np.ndarray:
    """The reference's residual stream after layer 0, float64 [T, H], with `storage`."""
    import torch

    from ..kv_pages import PageTable

    table = PageTable()
    ref.cache.pages.reserve(table, len(ids))
    try:
        with ref.model.storing(storage) as m, torch.inference_mode():
            t = torch.tensor(ids, device=dev)
            tab = torch.tensor(table.pages, device=dev)
            cos, sin = m.cos[: len(ids)], m.sin[: len(ids)]
            x = m.block(m.embed_tokens[t], m.layers[0], 0, 0, tab, ref.cache, cos, sin)
            return x.double().cpu().numpy()
    finally:
        ref.cache.pages.release(table)


def _storage(engine):
    """The reference.Fp16Storage that emulates `engine`'s: its K cache's format included."""
    from ..reference import Fp16Storage

    return Fp16Storage(k_pair=engine.kv.k_parts == 2)


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max |got - want|, rms of got - want), each over rms(want)."""
    err, rms = np.abs(got.astype(np.float64) - want), float(np.sqrt(np.mean(want**2)))
    return float(err.max()) / rms, float(np.sqrt(np.mean(err**2))) / rms


def real_layer_tier(engine, file, tol: dict) -> list[Check]:
    """Layer 0 of the engine (decode path, token by token) on a code window, against the
    float32 reference; the gate is a multiple of what the reference itself errs by when it
    stores fp16 where the engine does (reference.Fp16Storage), measured on the same tokens."""
    import torch

    ids = _windows(file, 1, tol["tokens"])[0]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = _reference(file, dev)
    want = _layer0(ref, ids, dev, None)
    emu_max, emu_rms = _errors(_layer0(ref, ids, dev, _storage(engine)), want)
    got = np.stack([engine.decode_hidden(int(tok), i, layers=1) for i, tok in enumerate(ids)])
    err_max, err_rms = _errors(got, want)
    k = tol["over_fp16_emulation"]
    ok = err_max <= k * emu_max and err_rms <= k * emu_rms
    peak = float(np.abs(want).max() / np.sqrt(np.mean(want**2)))
    detail = (f"max|err|/rms {err_max:.2e} (fp16 emulation {emu_max:.2e}), rms err/rms "
              f"{err_rms:.2e} ({emu_rms:.2e}), max|ref|/rms {peak:.0f}")  # fmt: skip
    return [Check("layer", f"layer 0, {len(ids)} code tokens (decode path)", ok, detail)]


def real_graph_tier(engine, file, tol: dict) -> list[Check]:
    """Teacher-forced logits on code windows (decode and prefill paths) and greedy
    generations from their openings, vs the float32 reference."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = _reference(file, dev)
    windows = _windows(file, tol["windows"], tol["tokens"])
    want = [ref.logits(ids).astype(np.float32) for ids in windows]
    with ref.model.storing(_storage(engine)):
        emulated = [
            real_text.compare(ref.logits(ids), w) for ids, w in zip(windows, want, strict=True)
        ]
    emu = real_text.summary(emulated, tol["near_tie_over_std"])
    checks = []
    for path in ("decode", "prefill"):
        t0 = time.perf_counter()
        try:
            rows = []
            for ids, w in zip(windows, want, strict=True):
                got = engine.decode_logits(ids) if path == "decode" else engine.logits(ids)
                rows.append(real_text.compare(got, w))
        except Exception as exc:  # report the failing path, keep the other
            checks.append(Check("graph", f"{path} logits", False, f"{type(exc).__name__}: {exc}"))
            continue
        s = real_text.summary(rows, tol["near_tie_over_std"])
        ok = s["top1_clear"] >= tol["top1_agreement"] and s["dlogit_p99"] <= tol["logit_p99"]
        detail = (f"top1 {s['top1_clear']:.4f} at margin > {tol['near_tie_over_std']} "
                  f"({s['flips_clear']} flips; all {s['top1']:.4f}, {s['near_ties']} near-ties, "
                  f"worst flip margin {s['worst_flip_margin']:.3f}), |dlogit|/std p50 "
                  f"{s['dlogit_p50']:.3f} p99 {s['dlogit_p99']:.3f} max {s['dlogit_max']:.3f}; "
                  f"fp16 storage emulated: all {emu['top1']:.4f}, p50 {emu['dlogit_p50']:.3f} "
                  f"p99 {emu['dlogit_p99']:.3f}; {time.perf_counter() - t0:.0f}s")  # fmt: skip
        name = f"{path} logits, {len(windows)}x{tol['tokens']} code tokens"
        checks.append(Check("graph", name, ok, detail))
    checks.append(_greedy(engine, ref, windows, tol))
    return checks


def _greedy(engine, ref, windows: list[list[int]], tol: dict) -> Check:
    """Greedy generations from each window's opening: identical, or split at a step whose
    reference top-2 margin (between the two picks, over the row's std) is a near-tie."""
    from ..sampling import SamplingParams

    n, same, splits = tol["generations"], 0, []
    params = SamplingParams(max_tokens=tol["generate_tokens"])
    try:
        for ids in windows[:n]:
            prompt = ids[: tol["prompt_tokens"]]
            a = list(engine.generate(prompt, params, frozenset()))
            b = list(ref.generate(prompt, params, frozenset()))
            if a == b:
                same += 1
                continue
            i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
            row = ref.logits(prompt + b[:i])[-1]
            splits.append((i, abs(float(row[b[i]] - row[a[i]])) / float(row.std())))
    except Exception as exc:
        return Check("graph", "greedy generate (code)", False, f"{type(exc).__name__}: {exc}")
    bound = tol["near_tie_over_std"]
    ok = all(m <= bound for _, m in splits) and engine.kv_pages_in_use == 0
    detail = f"{same}/{n} identical"
    if splits:
        detail += ", split at " + ", ".join(f"step {i} margin {m:.3f}" for i, m in splits)
    detail += f", pages after {engine.kv_pages_in_use}"
    return Check("graph", f"greedy generate x{n} from code", ok, detail)
