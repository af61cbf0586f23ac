"""GPU (sm_90): the decode kernels' unit tier and the engine on a tiny synthetic model
(layer + graph tiers, pages freed). Skipped cleanly without an sm_90 device."""

import pytest

from nanoqwen.cuda.device import sm90_available

if not sm90_available():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from nanoqwen import validate as v  # noqa: E402
from nanoqwen.config import preset  # noqa: E402

pytestmark = pytest.mark.gpu
LADDER = v.load_ladder()["ladder"]


@pytest.mark.parametrize("name", ["tiny", "7b"])
def test_unit_tier(name):
    checks = v.unit_tier(preset(name), LADDER["unit"]["tolerances"])
    bad = [c for c in checks if not c.ok]
    assert not bad, bad


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from nanoqwen.convert import pack_synthetic
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile

    path = tmp_path_factory.mktemp("m") / "tiny.nanoqwen"
    pack_synthetic("tiny", path, progress=False)
    f = NanoqwenFile(path)
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
    got = e.gpu.download(e.logits_buf, np.empty_like(full))
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


def test_generate_on_another_thread(tmp_path):
    """The server builds the engine on its main thread and generates on a worker thread: the
    first generation there allocates prefill scratch and captures the decode graph."""
    import threading

    from nanoqwen.convert import pack_synthetic
    from nanoqwen.engine import CudaBackend
    from nanoqwen.fileformat import NanoqwenFile
    from nanoqwen.sampling import SamplingParams

    pack_synthetic("tiny", tmp_path / "t.nanoqwen", progress=False)
    with NanoqwenFile(tmp_path / "t.nanoqwen") as f:
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
