"""The reference on real Qwen2.5-Coder weights (opt-in: slow, needs a packed .nanoqwen file).

The file is NANOQWEN_REAL_MODEL, or the 0.5B that `nanoqwen pack` writes from the GGUF in
docs/DATA.md; without it every test here is skipped. A chat prompt asks for a long answer, the
reference writes it greedily (>= 256 tokens in all), and then the whole text is teacher-forced
through both the reference and transformers' Qwen2 holding the same dequantized weights. Top-1
must agree at every position; the logit gap and the timings are printed (`pytest -s`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.reference import ReferenceBackend
from nanoqwen.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

DEFAULT_MODEL = Path.home() / ".cache/nanoqwen/qwen2.5-coder-0.5b-instruct.nanoqwen"
MODEL = Path(os.environ.get("NANOQWEN_REAL_MODEL", DEFAULT_MODEL))
PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n<|im_start|>user\nWrite a Python class for a binary search tree with insert, "
    "delete, search and in-order traversal. Give every method a docstring.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MODEL.is_file(), reason=f"no real model at {MODEL}"),
]


@pytest.fixture(scope="module")
def real():
    with NanoqwenFile(MODEL) as file:
        start = time.perf_counter()
        ref = ReferenceBackend(file, max_context=1024)
        print(f"\n{MODEL.name}: reference loaded in {time.perf_counter() - start:.1f} s")
        yield file, ref
        ref.close()


@pytest.fixture(scope="module")
def greedy_text(real):
    """(prompt ids, greedy reply ids) from the reference, and the decode speed printed."""
    file, ref = real
    tok = tokenizers.Tokenizer.from_str(file.tokenizer.tokenizer_json)
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    assert prompt.count(file.tokenizer.special_tokens["im_start"]) == 3
    stop = frozenset(file.tokenizer.eos_token_ids)
    stream = ref.generate(prompt, SamplingParams(max_tokens=220), stop)
    start = time.perf_counter()
    reply = [next(stream)]
    first = time.perf_counter()
    reply += list(stream)
    end = time.perf_counter()
    rate = (len(reply) - 1) / (end - first)
    print(
        f"prompt {len(prompt)} tokens: first token after {first - start:.2f} s; "
        f"{len(reply) - 1} decode steps at {rate:.2f} tokens/s "
        f"({torch.get_num_threads()} threads)\n--- reply ---\n{tok.decode(reply)}\n---"
    )
    assert ref.kv_pages_in_use == 0
    return prompt, reply


def test_greedy_reply_is_real_code(real, greedy_text):
    file, _ = real
    prompt, reply = greedy_text
    text = tokenizers.Tokenizer.from_str(file.tokenizer.tokenizer_json).decode(reply)
    assert len(prompt) + len(reply) >= 256
    assert "class" in text and "def insert" in text


def test_top1_agrees_with_transformers(real, greedy_text):
    from test_reference import hf_model, max_rel_err

    file, ref = real
    prompt, reply = greedy_text
    ids = prompt + reply
    start = time.perf_counter()
    ours = ref.logits(ids)
    mid = time.perf_counter()
    with torch.no_grad():
        theirs = hf_model(file)(torch.tensor([ids])).logits[0].numpy()
    end = time.perf_counter()
    agree = (ours.argmax(axis=1) == theirs.argmax(axis=1)).mean()
    print(
        f"{len(ids)} tokens teacher-forced: reference {mid - start:.1f} s, transformers "
        f"(with weight load) {end - mid:.1f} s; top-1 agreement {agree:.2%}; max |logit diff| "
        f"{np.abs(ours - theirs).max():.3g}; max rel err {max_rel_err(ours, theirs):.3g}"
    )
    assert agree == 1.0
    assert max_rel_err(ours, theirs) <= 1e-4
    # The reference's own paged decode chose the teacher-forced argmax at every step.
    assert ours[len(prompt) - 1 : -1].argmax(axis=1).tolist() == reply
