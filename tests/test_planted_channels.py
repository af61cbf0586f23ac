"""Massive residual channels (harness.planted: 1e4..6e4 on sink tokens, as real Qwen2-family
checkpoints carry) through the reference with the engine's fp16 storage emulated
(reference.Fp16Storage): the values really reach the residual, nothing overflows, and the
logits match the float32 reference within the synthetic ladder's gates."""

import numpy as np
import pytest
import torch

from nanoqwen.config import preset
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness import load_protocol, planted
from nanoqwen.kv_pages import PageTable
from nanoqwen.reference import Fp16Storage, ReferenceBackend


@pytest.fixture(scope="module")
def planted_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("planted") / "tiny-planted.nanoqwen"
    planted.pack_planted(preset("tiny"), path)
    with NanoqwenFile(path) as f:
        yield f


@torch.inference_mode()
def residual_peaks(ref: ReferenceBackend, ids: list[int]) -> list[float]:
    """max |x| of the residual stream after each layer."""
    m, table = ref.model, PageTable()
    ref.cache.pages.reserve(table, len(ids))
    try:
        tab = torch.tensor(table.pages)
        cos, sin = m.cos[: len(ids)], m.sin[: len(ids)]
        x, peaks = m.embed_tokens[torch.tensor(ids)], []
        for i, w in enumerate(m.layers):
            x = m.block(x, w, i, 0, tab, ref.cache, cos, sin)
            peaks.append(float(x.abs().max()))
        return peaks
    finally:
        ref.cache.pages.release(table)


def test_planted_channels_match_the_reference_in_fp16_storage(planted_file):
    gates = load_protocol()["ladder"]["graph"]
    ref = ReferenceBackend(planted_file, max_context=64, prefix_caching=False)
    prompts = planted.sink_prompts(preset("tiny"), np.random.default_rng(), 6, 40)
    agree = total = 0
    worst = 0.0
    for ids in prompts:
        peaks = residual_peaks(ref, ids)
        assert all(1.0e4 <= p <= 6.5e4 for p in peaks), peaks  # the plant reached the residual
        want = ref.logits(ids)
        with ref.model.storing(Fp16Storage()):
            got = ref.logits(ids)
        assert np.isfinite(got).all() and np.isfinite(want).all()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float((np.abs(got - want).max(-1) / want.std(-1)).max()))
    assert agree / total >= gates["top1_agreement"], (agree, total)
    assert worst <= gates["logit_max_over_std"], worst


def test_planted_file_is_marked_synthetic(planted_file):
    from nanoqwen.harness.real_text import is_real

    assert not is_real(planted_file)
    assert "planted" in planted_file.metadata
