"""The real-weight layer and graph tiers (harness.validate_real) on the CPU: an "engine" that is
the reference with the engine's fp16 storage emulated passes them, one with a layer-0 branch
broken fails them. A synthetic tiny file stands in for real weights (the tiers take any file)."""

import dataclasses
import types

import numpy as np
import pytest

from nanoqwen.convert import pack_synthetic
from nanoqwen.fileformat import NanoqwenFile
from nanoqwen.harness import load_protocol, real_text
from nanoqwen.harness import validate_real as vr
from nanoqwen.reference import Fp16Storage, ReferenceBackend

TOL_LAYER = {**load_protocol()["ladder"]["layer"]["real"], "tokens": 24}
TOL_GRAPH = {**load_protocol()["ladder"]["graph"]["real"], "windows": 2, "tokens": 48,
             "generations": 2, "prompt_tokens": 16, "generate_tokens": 6}  # fmt: skip


class FakeEngine:
    """The reference with fp16 storage, behind the engine's validation methods."""

    kv = types.SimpleNamespace(k_parts=2)  # the K cache's (hi, lo) pair: Fp16Storage's default

    def __init__(self, file, broken: bool = False):
        self.ref = ReferenceBackend(file, max_context=256, prefix_caching=False)
        self.ref.model.fp16_storage = Fp16Storage()
        if broken:  # layer 0's MLP writes nothing, as a kernel that skips it would
            m = self.ref.model
            m.layers[0] = dataclasses.replace(m.layers[0], down_proj=m.layers[0].down_proj * 0)
        self.tokens: list[int] = []

    logits = decode_logits = property(lambda self: self.ref.logits)
    generate = property(lambda self: self.ref.generate)
    kv_pages_in_use = property(lambda self: self.ref.kv_pages_in_use)

    def decode_hidden(self, token: int, pos: int, layers: int) -> np.ndarray:
        assert layers == 1
        self.tokens[pos:] = [token]
        rows = vr._layer0(self.ref, self.tokens, "cpu", Fp16Storage())
        return rows[pos].astype(np.float32)  # the engine's fp32 residual row


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("real") / "tiny.nanoqwen"
    pack_synthetic("tiny", path, progress=False)
    with NanoqwenFile(path) as f:
        yield f


def test_emulated_engine_passes(tiny):
    engine = FakeEngine(tiny)
    checks = vr.real_layer_tier(engine, tiny, TOL_LAYER) + vr.real_graph_tier(
        engine, tiny, TOL_GRAPH
    )
    assert [c.tier for c in checks] == ["layer", "graph", "graph", "graph"]
    assert all(c.ok for c in checks), checks
    for c in checks[1:3]:  # the emulation beside each path: here the engine is the emulation
        engine_all = c.detail.split("all ")[1].split(",")[0]
        assert f"fp16 storage emulated: all {engine_all}," in c.detail, c.detail


def test_broken_branch_fails(tiny):
    engine = FakeEngine(tiny, broken=True)
    layer = vr.real_layer_tier(engine, tiny, TOL_LAYER)
    graph = vr.real_graph_tier(engine, tiny, TOL_GRAPH)
    assert not layer[0].ok, layer
    assert not graph[0].ok and not graph[1].ok, graph


def test_code_windows_are_deterministic_middles(tiny):
    from nanoqwen.tokenizer import Tokenizer

    tok = Tokenizer.from_spec(tiny.tokenizer)
    a = real_text.code_windows(tok, 3, 100)
    assert a == real_text.code_windows(tok, 3, 100)
    assert len(a) == 3 and all(len(w) == 100 for w in a)
    assert real_text.is_real(tiny) is False


def test_summary_leaves_out_near_ties():
    ref = np.array([[0.0, 5.0, 4.99, 0.0], [0.0, 9.0, 0.0, 0.0]])
    got = np.array([[0.0, 4.99, 5.0, 0.0], [0.0, 9.0, 0.0, 0.0]])
    s = real_text.summary([real_text.compare(got, ref)], near_tie=0.1)
    assert s["top1"] == 0.5 and s["top1_clear"] == 1.0 and s["near_ties"] == 1
    assert s["worst_flip_margin"] < 0.1
