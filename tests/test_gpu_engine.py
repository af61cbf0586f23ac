"""GPU (sm_90): the decode kernels' unit tier (the 7B's shapes, the 3B's GQA 8 and the 32B's
GQA 5 and wide down GEMV) and the engine on a tiny synthetic model (layer + graph tiers, pages
freed, PDL off and geometry variants giving the same tokens, the memory plan being the load's
allocations; speculative greedy decoding against the plain loop). Skipped cleanly without an
sm_90 device."""

import pytest

from nanoqwen.cuda.device import sm90_available

if not sm90_available():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from nanoqwen.config import preset  # noqa: E402
from nanoqwen.harness import load_protocol  # noqa: E402
from nanoqwen.harness import validate as v  # noqa: E402

pytestmark = pytest.mark.gpu
LADDER = load_protocol()["ladder"]


@pytest.mark.parametrize("name", ["tiny", "7b", "3b", "32b"])
def test_unit_tier(name):
    checks = v.unit_tier(preset(name), LADDER["unit"]["tolerances"])
    bad = [c for c in checks if not c.ok]
    assert not bad, bad


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile

    f = NanoqwenFile(tiny_model)
    e = CudaBackend(f, max_context=1024)
    yield e, f
    e.close()
    f.close()


def test_layer_and_graph(tiny):
    e, f = tiny
    checks = v.layer_tier(e, f, LADDER["layer"]["tolerance"])
    checks += v.graph_tier(e, f, LADDER["graph"], prompts=10)
    bad = [c for c in checks if not c.ok]
    assert not bad, bad
    assert e.kv_pages_in_use == 0


@pytest.mark.parametrize("T", [1, 17, 300])
def test_first_token_logits_match_the_full_prefill(tiny, T):
    """generate()'s prefill takes the last layer for the last token alone (decode attention
    and GEMVs): its logits must match row T - 1 of the whole prefill (logits()) within the
    graph tier's bound (both sit within ~0.012 std of the reference)."""
    import numpy as np

    from nanoqwen.sampling import SamplingParams

    e, _ = tiny
    ids = [(7 * i + 3) % e.config.vocab_size for i in range(T)]
    full = e.logits(ids)[-1]
    tokens = list(e.generate(ids, SamplingParams(max_tokens=1), frozenset()))
    got = e.gpu.download(e.forward.logits, np.empty_like(full))
    assert np.isfinite(got).all()
    assert np.abs(got - full).max() <= LADDER["graph"]["logit_max_over_std"] * full.std()
    assert tokens == [int(np.argmax(got))]


def test_cancel_frees_pages(tiny):
    from nanoqwen.sampling import SamplingParams

    e, _ = tiny
    it = e.generate([1, 2, 3], SamplingParams(max_tokens=200), frozenset())
    next(it)
    assert e.kv_pages_in_use > 0
    it.close()
    assert e.kv_pages_in_use == 0


def test_close_ends_a_suspended_generation(tiny_model):
    """close() with generations suspended mid-stream (the graph running) and after their first
    token: each is ended first (cancelled, synced, pages released), so nothing of theirs runs
    later against the host ring's freed pinned memory."""
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    with NanoqwenFile(tiny_model) as f:
        e = CudaBackend(f, max_context=1024)
        try:
            streaming = e.generate([1, 2, 3], SamplingParams(max_tokens=500), frozenset())
            next(streaming), next(streaming)  # the graph runs
            e.close()
            assert streaming.gi_frame is None  # finished: its finally ran before the free
            assert e.kv_pages_in_use == 0
            with pytest.raises(StopIteration):
                next(streaming)
        finally:
            e.close()  # a second close frees nothing twice
        e = CudaBackend(f, max_context=1024)
        first_only = e.generate([4, 5, 6], SamplingParams(max_tokens=500), frozenset())
        next(first_only)
        e.close()
        assert first_only.gi_frame is None and e.kv_pages_in_use == 0


def test_generate_on_another_thread(tiny_model):
    """The server builds the engine on its main thread and generates on a worker thread: the
    first generation there allocates prefill scratch and captures the decode graph."""
    import threading

    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    with NanoqwenFile(tiny_model) as f:
        e = CudaBackend(f, max_context=1024)
        out: list = []
        errors: list = []

        def work() -> None:
            try:
                out.extend(e.generate(list(range(1, 300)), SamplingParams(max_tokens=8), set()))
            except Exception as exc:  # surfaced below with its message
                errors.append(exc)

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        try:
            assert not errors, errors
            assert len(out) == 8 and e.kv_pages_in_use == 0
        finally:
            e.close()


@pytest.mark.parametrize(
    "pdl, overrides",
    [
        (False, {}),
        (True, {"kGvEarlyStages": 0, "kAttnStages": 12, "kGvStageTarget": 16384}),
        (True, {"kGvWideMinK": 128}),  # every GEMV in the wide form (one CTA an SM)
    ],
    ids=["pdl-off", "geometry-variant", "wide-gemv"],
)
def test_variants_generate_the_same_tokens(tiny, tiny_model, pdl, overrides):
    """Launches without PDL (validate's unit tier, dev/ttft_profile.py) and a geometry variant
    (dev/kernel_tune.py) compute what the shipped engine does: the same greedy tokens and
    logits within the graph tier's bound."""
    import numpy as np

    from nanoqwen.cuda.registry import DEFAULT_GEOMETRY
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    e, _ = tiny
    ids = [(11 * i + 5) % e.config.vocab_size for i in range(40)]
    params = SamplingParams(max_tokens=16)
    want = list(e.generate(ids, params, frozenset()))
    want_logits = e.decode_logits(ids[:8])
    with NanoqwenFile(tiny_model) as f:
        other = CudaBackend(f, max_context=1024, geometry=DEFAULT_GEOMETRY.override(overrides),
                            pdl=pdl)  # fmt: skip
        try:
            assert list(other.generate(ids, params, frozenset())) == want
            got = other.decode_logits(ids[:8])
        finally:
            other.close()
    bound = LADDER["graph"]["logit_max_over_std"] * want_logits.std()
    assert np.abs(got - want_logits).max() <= bound


def test_prefix_reuse_matches_a_cold_prefill(tiny_model):
    """A prompt sharing a prefix with earlier requests (their prompts and their replies, as a
    chat's next turn resends them) prefills only its uncached tokens, attending over the
    cached pages: its first token's logits match a cold engine's within the graph tier's bound
    (the GEMMs run over fewer rows, so they round differently), the greedy tokens are the
    same, and nothing stays held."""
    import numpy as np

    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    one, greedy = SamplingParams(max_tokens=1), SamplingParams(max_tokens=24)
    with NanoqwenFile(tiny_model) as f:
        warm = CudaBackend(f, max_context=2048)
        cold = CudaBackend(f, max_context=2048, prefix_caching=False)
        try:
            V = warm.config.vocab_size
            base = [(13 * i + 7) % V for i in range(300)]
            reply = list(warm.generate(base + [5, 6, 7], greedy, frozenset()))
            turn = base + [5, 6, 7] + reply + [(3 * i + 1) % V for i in range(40)]
            for prompt, cached in ((base + [9] * 37, 288), (turn, (303 + 23) // 16 * 16)):
                got_tokens = list(warm.generate(prompt, greedy, frozenset()))
                assert warm.cached_tokens == cached
                list(warm.generate(prompt, one, frozenset()))
                got = warm.gpu.download(warm.forward.logits, np.empty(V, np.float32))
                want_tokens = list(cold.generate(prompt, greedy, frozenset()))
                assert cold.cached_tokens == 0
                list(cold.generate(prompt, one, frozenset()))
                want = cold.gpu.download(cold.forward.logits, np.empty(V, np.float32))
                assert np.isfinite(got).all()
                assert (
                    np.abs(got - want).max() <= LADDER["graph"]["logit_max_over_std"] * want.std()
                )
                assert got_tokens == want_tokens
            stats = warm.kv_stats
            assert warm.kv_pages_in_use == 0 and stats.cached > 0 and stats.hit_tokens > 0
        finally:
            warm.close()
            cold.close()


def test_batch_of_one_prompt_takes_its_pages_from_the_cache(tiny_model):
    """A prompt's n choices (the server's n > 1) enter the batch together: the first prefills
    the prompt, the others wait for its pages and take them from the prefix cache; greedy,
    all four give the tokens the prompt gets alone, and nothing stays held."""
    from nanoqwen.batching import Scheduler
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    params = SamplingParams(max_tokens=20)
    with NanoqwenFile(tiny_model) as f:
        e = CudaBackend(f, max_context=1024, max_batch=4)
        try:
            prompt = [(11 * i + 5) % e.config.vocab_size for i in range(200)]
            alone = list(e.generate(prompt, params, frozenset()))
            e.block_manager.clear_cache()
            sched = Scheduler(e, prefill_chunk=64)
            seqs = [sched.add(prompt, params, frozenset()) for _ in range(4)]
            while sched.has_work:
                sched.step()
            assert [s.tokens for s in seqs] == [alone] * 4
            assert [s.cached_tokens for s in seqs] == [0, 192, 192, 192]
            assert e.kv_pages_in_use == 0
        finally:
            e.close()


REAL_REQUESTS = [
    {"chat": "Write a Python function is_prime(n) with a docstring."},
    {"chat": "Reverse a singly linked list in Python; explain the loop in one line."},
    {"chat": "Add type hints to: def merge(a, b): return sorted(a + b)"},
    {"chat": "Write a SQL query that returns the ten most recent orders per customer."},
    {"chat": "Fix the bug: for i in range(len(xs)): if xs[i] = 0: print(i)"},
    {"chat": "Write a bash one-liner that counts lines in every .py file under src/."},
    {"fim": ("def add(a, b):\n    ", "\n\nprint(add(2, 3))\n")},
    {"fim": ("import json\n\ndef load(path):\n    with open(path) as f:\n        ", "\n")},
    {
        "fim": (
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, x):\n        ",
            "\n\n    def pop(self):\n        return self.items.pop()\n",
        )
    },  # noqa: E501
]


@pytest.mark.slow
def test_real_weights_greedy_matches_the_reference(real_model):
    """Real Qwen2.5-Coder weights (the real_model fixture): the engine's greedy reply to
    coding and fill-in-the-middle requests is the float32 reference's, token for token, except
    where they part at a near-tie of the reference's own top-2 (the graph tier's rule)."""
    import torch

    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.reference import ReferenceBackend
    from nanoqwen.sampling import SamplingParams
    from nanoqwen.tokenizer import Tokenizer

    near_tie = LADDER["graph"]["near_tie_over_std"]
    params = SamplingParams(max_tokens=96)
    with NanoqwenFile(real_model) as f:
        tok = Tokenizer.from_file(f)
        stop = frozenset(tok.eos_token_ids)
        engine = CudaBackend(f, max_context=2048)
        ref = ReferenceBackend(
            f, max_context=2048, device="cuda" if torch.cuda.is_available() else "cpu"
        )
        try:
            same, splits = 0, []
            for req in REAL_REQUESTS:
                if "chat" in req:
                    ids = tok.encode_chat([{"role": "user", "content": req["chat"]}])
                else:
                    ids = tok.fim_prompt(*req["fim"])
                a = list(engine.generate(ids, params, stop))
                b = list(ref.generate(ids, params, stop))
                if a == b:
                    same += 1
                    continue
                i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
                row = ref.logits(ids + b[:i])[-1]
                splits.append(abs(float(row[b[i]] - row[a[i]])) / float(row.std()))
            print(f"\n{real_model.name}: {same}/{len(REAL_REQUESTS)} identical, splits {splits}")
            assert all(m <= near_tie for m in splits), splits
            assert engine.kv_pages_in_use == 0
        finally:
            engine.close()
            ref.close()


def test_memory_plan_is_the_load(tiny_model):
    """engine.memory's plan is what the load allocates, to the byte: every part but the
    margin and the prefill scratch at load, the scratch too once a max_context prompt's
    exists (tests/test_memory_plan.py checks the parts a fake Gpu can build)."""
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile

    with NanoqwenFile(tiny_model) as f:
        e = CudaBackend(f, max_context=1000)
        try:
            plan = e.plan.parts
            at_load = e.plan.needed - plan["margin"] - plan["prefill_scratch"]
            assert e.gpu.live_bytes() == at_load, plan
            e.forward.scratch(e.max_context)
            assert e.gpu.live_bytes() == at_load + plan["prefill_scratch"]
            assert e.memory()["planned"] == plan
        finally:
            e.close()


@pytest.fixture(scope="module", params=["auto", "long"])
def spec_tiny(request, tiny_model):
    """The speculative engine; "long": every verify step takes attention_rows' long form (the
    tiny model's contexts never reach it on their own), set before the graph is captured."""
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.speculative import SpeculativeConfig

    f = NanoqwenFile(tiny_model)
    e = CudaBackend(f, max_context=1024, prefix_caching=False,
                    speculative=SpeculativeConfig(k=4))  # fmt: skip
    if request.param == "long":
        e.spec.verify.verify.long_pages = 1
    yield e
    e.close()
    f.close()


def _greedy(e, ids, max_tokens, speculate=True):
    from nanoqwen.sampling import SamplingParams

    saved, e.speculative = e.speculative, e.speculative if speculate else None
    try:
        return list(e.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), {}))
    finally:
        e.speculative = saved


@pytest.mark.parametrize("kind", ["repeat", "random", "short"])
def test_speculative_greedy_is_the_plain_loop(spec_tiny, kind):
    """Token-identical to the plain loop on the same engine, or a near-tie where they part
    (the verify step rounds differently from the decode step: dev/verify_step.py)."""
    import numpy as np

    e, rng = spec_tiny, np.random.default_rng()
    ids = {"repeat": [11, 12, 13, 14, 15] * 30, "random": rng.integers(0, 1000, 77).tolist(),
           "short": [3]}[kind]  # fmt: skip
    max_tokens = int(rng.integers(2, 200))
    plain, spec = _greedy(e, ids, max_tokens, False), _greedy(e, ids, max_tokens)
    st = e.spec_stats
    assert e.kv_pages_in_use == 0
    assert st.steps >= 1 and st.accepted <= st.drafted
    assert len(spec) == max_tokens  # no stop ids: max_tokens exactly
    if spec != plain:
        i = next(j for j, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b)
        row = e.logits(ids + plain[:i])[-1]
        top2 = np.sort(row)[-2:]
        assert (top2[1] - top2[0]) / row.std() < 0.05, (i, plain[i], spec[i])


def test_speculative_sampled_and_cancel(spec_tiny):
    """A sampled request speculates too (speculate.cu's accept_sampled); a greedy one cancelled
    mid-loop frees its pages, and the next request runs."""
    from nanoqwen.sampling import SamplingParams

    e, ids = spec_tiny, [21, 22, 23, 24] * 20
    out = list(e.generate(ids, SamplingParams(temperature=0.9, max_tokens=40, seed=3), {}))
    st = e.spec_stats
    assert len(out) == 40 and st.steps >= 1 and st.accepted <= st.drafted
    it = e.generate(ids, SamplingParams(temperature=0.0, max_tokens=300), {})
    head = [next(it) for _ in range(7)]
    it.close()  # the graph stops after its current step
    assert e.kv_pages_in_use == 0 and len(head) == 7
    assert len(_greedy(e, ids, 50)) == 50 and e.kv_pages_in_use == 0  # and the next one runs


def test_speculative_memory_plan_is_the_load(tiny_model):
    """The speculation part of the plan (history, verify rows, attention_rows scratch) and
    the K extra KV and RoPE positions are what the load allocates, to the byte."""
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.speculative import SpeculativeConfig

    with NanoqwenFile(tiny_model) as f:
        e = CudaBackend(f, max_context=1000, speculative=SpeculativeConfig(k=7))
        try:
            plan = e.plan.parts
            assert e.gpu.live_bytes() == e.plan.needed - plan["margin"] - plan["prefill_scratch"]
        finally:
            e.close()
