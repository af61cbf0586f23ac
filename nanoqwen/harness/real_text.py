"""Real text for checks on real weights: windows of Python standard-library source, and the
metrics that compare a model's logits with the float32 reference's on them.

Why real text: random token ids put a real model far outside its training distribution, where
its top-2 margins are tiny and fp16 noise flips a percent of the argmaxes (the 1.5B's graph tier
on random ids: top-1 0.99 against the float32 reference, with greedy generations on real
requests identical). On code the model is confident, so a flip means a bug or a true near-tie.

The windows are deterministic on one interpreter: `tokens` tokens from the middle of each of
VALIDATION_FILES (the middle: a file's opening is licence and docstring). The stdlib of another
Python version gives other windows of the same kind.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import NanoqwenError

# Disjoint from nanoqwen.calibrate.CALIBRATION_FILES (GPTQ's calibration text) and from
# dev/quant_ppl.py's EVAL_FILES; each is over 20 kB in Python 3.10-3.13.
VALIDATION_FILES = (
    "os.py",
    "socket.py",
    "gzip.py",
    "pprint.py",
    "fractions.py",
    "ipaddress.py",
    "locale.py",
    "mailbox.py",
    "optparse.py",
    "pickle.py",
    "smtplib.py",
    "traceback.py",
    "weakref.py",
    "http/client.py",
    "urllib/parse.py",
    "unittest/case.py",
)


def is_real(file) -> bool:
    """Whether a .nanoqwen file holds real weights: pack records "source_format" in the
    metadata ("hf" or "gguf" for a checkpoint, "synthetic" for pack --synthetic)."""
    return file.metadata.get("source_format", "synthetic") != "synthetic"


def stdlib_token_ids(tokenizer, files: tuple[str, ...], tokens: int) -> Iterator[list[int]]:
    """The token ids of each of `files` (paths relative to the running interpreter's stdlib) that
    exists and holds at least `tokens` tokens, in order."""
    root = stdlib_root()
    for rel in files:
        path = root / rel
        if path.is_file():
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
            if len(ids) >= tokens:
                yield ids


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_windows(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` windows of `tokens` token ids: the middle of each of the first `count` of
    VALIDATION_FILES (found in the running interpreter's stdlib) that is long enough."""
    windows = []
    for ids in stdlib_token_ids(tokenizer, VALIDATION_FILES, tokens):
        mid = (len(ids) - tokens) // 2
        windows.append(ids[mid : mid + tokens])
        if len(windows) == count:
            return windows
    raise NanoqwenError(
        f"found {len(windows)} of {count} {tokens}-token windows among the Python "
        f"standard-library files under {stdlib_root()}"
    )


def margins(ref: np.ndarray) -> np.ndarray:
    """[T]: the reference's (top-1 - top-2 logit) / std of its row; ref float [T, V]."""
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) / ref.std(axis=-1)


def compare(got: np.ndarray, ref: np.ndarray) -> dict[str, np.ndarray]:
    """Per position of logits got, ref [T, V]: `agree` top-1 equal, `margin` the reference's
    top-2 margin / std, `dlogit` max over the vocabulary of |got - ref| / std of ref's row."""
    ref64 = ref.astype(np.float64)
    std = ref64.std(axis=-1)
    return {
        "agree": got.argmax(-1) == ref.argmax(-1),
        "margin": margins(ref64),
        "dlogit": np.abs(got.astype(np.float64) - ref64).max(-1) / std,
    }


def summary(rows: list[dict[str, np.ndarray]], near_tie: float) -> dict[str, float]:
    """Totals over the positions of every compare(): top-1 agreement over all positions and
    over those whose reference margin exceeds `near_tie`, the positions left out, and the
    median, 99th percentile and max of the per-position max |dlogit| / std."""
    agree = np.concatenate([r["agree"] for r in rows])
    margin = np.concatenate([r["margin"] for r in rows])
    dl = np.concatenate([r["dlogit"] for r in rows])
    clear = margin > near_tie
    return {
        "positions": int(agree.size),
        "top1": float(agree.mean()),
        "top1_clear": float(agree[clear].mean()) if clear.any() else 1.0,
        "flips_clear": int((~agree & clear).sum()),
        "near_ties": int((~clear).sum()),
        "dlogit_p50": float(np.percentile(dl, 50)),
        "dlogit_p99": float(np.percentile(dl, 99)),
        "dlogit_max": float(dl.max()),
        "worst_flip_margin": float(margin[~agree].max()) if (~agree).any() else 0.0,
    }
