"""The batched decode step's host side on the CPU (nanoqwen/engine/batch.py): buckets, the
row-state staging words and what each step copies, padding rows, the memory plan with the KV
pool's kv_tokens and the batch buffers. The step itself runs on a GPU: dev/batch_check.py."""

import numpy as np
import pytest

from nanoqwen.batching import Sequence
from nanoqwen.config import preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.batch import batch_attention_scratch_buffers, spare_clusters
from nanoqwen.cuda.device import alloc_size
from nanoqwen.cuda.registry import STATE_WORDS, StateWord
from nanoqwen.engine import memory
from nanoqwen.engine.batch import (
    BATCH_BUCKETS,
    Launched,
    Row,
    RowLayout,
    RowStager,
    batch_buckets,
    batch_buffers,
    batch_plan,
    chained_rows,
    copy_runs,
    decode_rows,
    last_token,
    pages_per_row,
    pick_bucket,
)
from nanoqwen.engine.decode_loop import DecodeState
from nanoqwen.engine.kv_cache import kv_cache_buffers
from nanoqwen.errors import NanoqwenError
from nanoqwen.kv_pages import BlockManager, PageTable
from nanoqwen.sampling import SamplingParams


def test_buckets():
    assert batch_buckets(16) == BATCH_BUCKETS == (1, 2, 4, 8, 16)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(1) == (1,)
    assert [pick_bucket(b, BATCH_BUCKETS) for b in (1, 2, 3, 5, 8, 9, 16)] == [
        1, 2, 4, 8, 8, 16, 16]  # fmt: skip
    assert pick_bucket(11, batch_buckets(12)) == 12
    for bad in (0, 17):
        with pytest.raises(ValueError):
            batch_buckets(bad)
    with pytest.raises(ValueError, match="largest bucket is 8"):
        pick_bucket(9, (1, 2, 4, 8))


def test_layout():
    L = RowLayout(16, pages_per_row(1000))
    assert L.pages_per_row == 63  # ceil(1000 / 16)
    assert (L.tokens, L.pos, L.params) == (0, 16, 32)
    assert L.first == 32 + 16 * STATE_WORDS and L.head_words == L.first
    assert L.tables == L.first + STATE_WORDS
    assert L.words == L.tables + 16 * 63


def _stager(rows=4, ppr=8, pad=999):
    layout = RowLayout(rows, ppr)
    words = np.full(layout.words, -7, np.int32)  # poisoned: what stage leaves alone shows
    return RowStager(words, layout, pad), words, layout


def _seq(bm, prompt, tokens=(), params=None):
    s = Sequence(list(prompt), params or SamplingParams(), tokens=list(tokens))
    s.table = bm.admit(s.prompt)
    s.kv_len = len(s.prompt) + len(s.tokens) - 1
    bm.reserve(s.table, s.kv_len + 1)
    return s


def test_stage_rows_and_copies():
    bm = BlockManager(64, prefix_caching=False)
    st, words, L = _stager()
    a = _seq(bm, range(20), tokens=[5, 6])  # kv_len 21: feeds 6 at 21, 2 pages
    b = _seq(bm, [3], params=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=11))
    copies = st.stage(decode_rows([a, b]), 4)
    assert copies[0] == (0, L.head_words)
    assert list(st.tokens) == [6, 3, 0, 0] and list(st.pos) == [21, 0, 0, 0]
    assert last_token(a) == 6 and last_token(b) == 3
    # sampler words: the plain loop's state words, draw number = len(tokens)
    want = DecodeState(step=0, top_k=40, temperature=0.7, top_p=0.9, seed=11).to_words()
    assert (st.params[1] == want).all() and b.sampler == 11
    assert st.params[0, StateWord.STEP] == 2 and st.params[0, StateWord.TEMP] == 0
    # tables: rows 0 and 1 whole, padding rows 2, 3 page 0 = the padding page
    assert (st.tables[0, :2] == a.table.pages).all() and st.tables[1, 0] == b.table.pages[0]
    assert st.tables[2, 0] == st.tables[3, 0] == 999
    assert (st.tables[2, 1:] == -7).all()  # only page 0 of a padding row is written
    t = L.tables
    assert copies[1:] == [(t, 2), (t + 8, 1), (t + 16, 1), (t + 24, 1)]
    assert (st.params[2:] == 0).all()  # padding rows: greedy

    # The next step: same rows, nothing new but the head.
    a.tokens.append(7)
    a.kv_len += 1
    assert st.stage(decode_rows([a, b]), 4) == [(0, L.head_words)]
    assert st.params[0, StateWord.STEP] == 3 and st.tokens[0] == 7
    # a crosses into a third page: only that page id goes up
    for _ in range(10):
        a.tokens.append(1)
        a.kv_len += 1
    bm.reserve(a.table, a.kv_len + 1)
    assert st.stage(decode_rows([a, b]), 4)[1:] == [(t + 2, 1)]
    assert st.tables[0, 2] == a.table.pages[2]


def test_rows_change_hands():
    bm = BlockManager(64, prefix_caching=False)
    st, words, L = _stager()
    a, b, c = (_seq(bm, range(n)) for n in (40, 17, 3))
    st.stage(decode_rows([a, b, c]), 4)
    # b leaves: c moves up to row 1 (new owner: whole table and params), row 2 pads
    st.forget(b)
    copies = st.stage(decode_rows([a, c]), 2)
    t = L.tables
    assert copies[1:] == [(t + 8, 1)] and st.tables[1, 0] == c.table.pages[0]
    # a padding row that a sequence held goes back to the padding page; a later owner of
    # that row uploads its whole table
    copies = st.stage(decode_rows([a]), 4)
    assert (t + 8, 1) in copies and st.tables[1, 0] == 999
    d = _seq(bm, range(33))
    copies = st.stage(decode_rows([a, d]), 2)
    assert copies[1:] == [(t + 8, 3)] and (st.tables[1, :3] == d.table.pages).all()


def test_rebuilt_table_uploads_again():
    """A table rebuilt under the same sequence (preempted and readmitted without
    release_slot) is caught by its last uploaded page id and uploaded whole."""
    bm = BlockManager(64, prefix_caching=False)
    st, _, L = _stager()
    a = _seq(bm, range(40))
    st.stage(decode_rows([a]), 1)
    bm.release(a.table)
    bm.reserve(PageTable(), 48)  # the old pages go to someone else
    a.table = PageTable()
    bm.reserve(a.table, a.kv_len + 1)
    copies = st.stage(decode_rows([a]), 1)
    assert copies[1:] == [(L.tables, 3)] and (st.tables[0, :3] == a.table.pages).all()


def test_unseeded_sequences_keep_their_seed():
    bm = BlockManager(64, prefix_caching=False)
    st, _, _ = _stager()
    s = _seq(bm, [1, 2], params=SamplingParams(temperature=1.0))
    st.stage(decode_rows([s]), 1)
    seed = s.sampler
    assert isinstance(seed, int)
    st.forget(s)
    st.stage(decode_rows([s]), 1)  # a new owner of the row writes its words again: same seed
    assert s.sampler == seed
    lo, hi = st.params[0, StateWord.SEED_LO], st.params[0, StateWord.SEED_HI]
    assert int(np.uint32(lo)) | int(np.uint32(hi)) << 32 == seed & ((1 << 64) - 1)


def test_prefill_rows_of_one_sequence():
    """A short prefill chunk: one row per id at consecutive positions, every row the
    sequence's (its sampler words and whole table each); the sequence's decode step after it
    takes row 0, whose table is already up."""
    bm = BlockManager(64, prefix_caching=False)
    st, _, L = _stager()
    s = Sequence(list(range(40, 60)), SamplingParams(temperature=0.5, seed=3))
    s.table = bm.admit(s.prompt)
    bm.reserve(s.table, 21)  # 20 ids and the first token's position: 2 pages
    s.kv_len = 16
    rows = [Row(s, 16 + j, s.prompt[16 + j], 0) for j in range(4)]
    copies = st.stage(rows, 4)
    assert list(st.tokens) == [56, 57, 58, 59] and list(st.pos) == [16, 17, 18, 19]
    assert (st.params[:, StateWord.STEP] == 0).all() and (st.params[:, StateWord.TEMP] != 0).all()
    assert all((st.tables[r, :2] == s.table.pages).all() for r in range(4))
    t = L.tables
    assert copies[1:] == [(t, 2), (t + 8, 2), (t + 16, 2), (t + 24, 2)]
    s.kv_len, s.tokens = 20, [7]
    copies = st.stage(decode_rows([s]), 1)
    assert copies == [(0, L.head_words)] and st.tokens[0] == 7 and st.pos[0] == 20
    assert st.params[0, StateWord.STEP] == 1


def test_table_longer_than_a_row_is_refused():
    bm = BlockManager(64, prefix_caching=False)
    st, _, _ = _stager(ppr=2)
    a = _seq(bm, range(40))  # 3 pages
    with pytest.raises(NanoqwenError, match="a batch row's table takes 2"):
        st.stage(decode_rows([a]), 1)


def test_memory_plan_with_pool_and_batch():
    cfg, g = preset("7b"), registry.DEFAULT_GEOMETRY
    base = memory.plan_memory(cfg, 8192)
    assert "batch" not in base.parts
    plan = memory.plan_memory(cfg, 8192, kv_tokens=65536, max_batch=16)
    assert plan.parts["kv_cache"] == sum(
        alloc_size(n) for n in kv_cache_buffers(cfg, 65536, g.k_parts)
    )
    assert plan.parts["kv_cache"] > 7 * base.parts["kv_cache"]
    for k in ("weights", "prefill_scratch", "decode_buffers"):
        assert plan.parts[k] == base.parts[k]  # the context, not the pool, sizes these
    want = sum(alloc_size(n) for n in batch_plan(cfg, 16, 8192, g))
    assert plan.parts["batch"] == want
    sizes = batch_buffers(cfg, 16, 8192)
    assert sizes["logits"] == 16 * cfg.vocab_size * 4
    assert sizes["rows"] == RowLayout(16, 512).words * 4
    scratch = batch_attention_scratch_buffers(cfg, g, 16)
    assert scratch["part_acc"] == 16 * cfg.num_heads * g.attn_splits * cfg.head_dim * 4
    assert scratch["counters"] == 16 * cfg.num_kv_heads * 4
    # a smaller pool than the context is allowed (sequences share it)
    small = memory.plan_memory(cfg, 32768, kv_tokens=4096, max_batch=16)
    assert small.parts["kv_cache"] < memory.plan_memory(cfg, 32768).parts["kv_cache"]


def test_pool_refused_with_its_size():
    cfg = preset("32b")
    with pytest.raises(memory.DeviceError, match="with a KV pool of 600000 tokens needs"):
        memory.check_memory(cfg, 8192, memory.H200_FREE, 141 * 10**9, kv_tokens=600000,
                            max_batch=16)  # fmt: skip


@pytest.mark.parametrize("name", ["0.5b", "7b", "32b"])
def test_spare_clusters_are_the_single_streams(name):
    """The batched attention's spare clusters a kv head = the decode step's clusters."""
    cfg, g = preset(name), registry.DEFAULT_GEOMETRY
    per_head = min(g.attn_splits, g.attn_ctas // cfg.num_kv_heads)
    assert spare_clusters(cfg, g) * g.attn_cluster == max(
        g.attn_cluster, per_head // g.attn_cluster * g.attn_cluster
    )


def test_memory_command_with_pool_and_batch(capsys):
    from nanoqwen.cli import main

    assert main(["memory", "--model", "7b", "--context", "8192", "--kv-tokens", "131072"]) == 0
    out = capsys.readouterr().out
    assert "batch " in out and "10.50 GiB" in out  # 131072 + 16 positions of 84 KB
    assert main(["memory", "--model", "7b", "--max-batch", "0"]) == 0
    assert "batch " not in capsys.readouterr().out


class _FakeGpu:
    def ensure_ok(self):
        pass


class _RowsByToken:
    """BatchStep's surface for decode_launch and prefill_chunk: each row's token = its fed
    token + 1000 (a chained row's fed token: its sequence's in the step it follows); `rows`
    records each step's (slot, position, draw) rows."""

    def __init__(self):
        self.rows, self.out, self.serial = [], {}, 0
        self.buf = {"logits": 1 << 20}

    def launch(self, rows, after=None):
        self.rows.append([(r.seq.slot, r.pos, r.draw) for r in rows])
        fed = [r.token for r in rows]
        if after is not None:
            assert after.serial == self.serial  # the step launched just before
            fed = [self.out[after.serial][i] for i in after.rows_of([r.seq for r in rows])]
        self.serial += 1
        self.out[self.serial] = [t + 1000 for t in fed]
        return Launched(self, self.serial, [r.seq for r in rows])

    def read(self, step):
        return self.out[step.serial]

    def step(self, rows):
        return self.launch(rows).tokens()

    def forget(self, seq):
        self.rows.append(("forget", seq.slot))


def _backend(max_batch=4, max_context=256):
    from nanoqwen.engine.backend import CudaBackend

    e = object.__new__(CudaBackend)  # the batch primitives' host logic, no device
    e.gpu, e.batch, e.max_batch, e.max_context = _FakeGpu(), _RowsByToken(), max_batch, max_context
    e.config = preset("tiny")
    return e


def test_decode_launch_rows_by_slot_tokens_in_order():
    e, bm = _backend(), BlockManager(64, prefix_caching=False)
    seqs = [_seq(bm, [10 + i] * (3 + i), tokens=[20 + i]) for i in range(3)]
    for s, slot in zip(seqs, (2, 0, 3), strict=True):
        s.slot = slot
    before = [s.kv_len for s in seqs]
    step = e.decode_launch(seqs)
    assert [s.kv_len for s in seqs] == [b + 1 for b in before]  # at the launch
    assert e.batch.rows == [[(0, before[1], 1), (2, before[0], 1), (3, before[2], 1)]]  # slots
    assert step.tokens() == [1020, 1021, 1022]  # tokens in the order given
    e.release_slot(seqs[0])
    assert e.batch.rows[-1] == ("forget", 2)


def test_a_chained_step_feeds_the_tokens_of_the_step_before():
    """decode_launch(after=): some of that step's sequences, each fed the token it samples
    for them (a device copy from its rows), at the next position, as the next draw."""
    e, bm = _backend(), BlockManager(64, prefix_caching=False)
    seqs = [_seq(bm, [10 + i] * 4, tokens=[20 + i]) for i in range(3)]
    for s, slot in zip(seqs, (2, 0, 3), strict=True):
        s.slot = slot
    first = e.decode_launch(seqs)
    with pytest.raises(NanoqwenError, match="kv_len 5 must be len"):
        e.decode_launch(seqs)  # their tokens are in flight: only a chained step may follow
    second = e.decode_launch([seqs[2], seqs[0]], after=first)  # seqs[1] left it
    assert e.batch.rows[-1] == [(2, 5, 2), (3, 5, 2)]  # by slot, position kv_len, draw 2
    assert [s.kv_len for s in seqs] == [6, 5, 6]
    assert first.tokens() == [1020, 1021, 1022] and second.tokens() == [2022, 2020]
    with pytest.raises(NanoqwenError, match="must hold every sequence chained"):
        e.decode_launch([seqs[1]], after=second)


def test_chained_rows_and_their_copies():
    bm = BlockManager(64, prefix_caching=False)
    s = _seq(bm, [5] * 9, tokens=[6, 7])
    assert chained_rows([s]) == [Row(s, s.kv_len, 0, 3)]
    assert copy_runs([0, 1, 2]) == [(0, 0, 3)]
    assert copy_runs([0, 2, 3, 5]) == [(0, 0, 1), (1, 2, 2), (3, 5, 1)]
    assert copy_runs([]) == []


def test_decode_launch_refuses_bad_calls():
    e, bm = _backend(max_batch=2), BlockManager(64, prefix_caching=False)
    a, b, c = (_seq(bm, [1, 2, 3]) for _ in range(3))
    a.slot, b.slot, c.slot = 0, 0, 1
    with pytest.raises(NanoqwenError, match="share a slot"):
        e.decode_launch([a, b])
    with pytest.raises(NanoqwenError, match=r"1\.\.2 sequences"):
        e.decode_launch([a, b, c])
    b.slot, b.kv_len = 1, 1
    with pytest.raises(NanoqwenError, match="kv_len 1 must be len"):
        e.decode_launch([a, b])
    b.kv_len = 2
    bm.release(b.table)  # no page for position 2
    with pytest.raises(NanoqwenError, match="must be reserved"):
        e.decode_launch([a, b])
    e.batch = None
    with pytest.raises(NanoqwenError, match="no batch path"):
        e.decode_launch([a])
    assert e.batch is None


def test_short_prefill_chunk_is_rows_of_the_batch_step():
    """A chunk of at most max_batch ids: one batch step, a row per id at its position; the
    token is the last row's, and chunk_logits that row's logits."""
    e, bm = _backend(max_batch=4), BlockManager(64, prefix_caching=False)
    s = _seq(bm, list(range(100, 120)))  # 20 ids
    s.slot, s.kv_len = 1, 16
    bm.reserve(s.table, 21)
    assert e.prefill_chunk(s, 20, sample=True) == 119 + 1000
    assert e.batch.rows == [[(1, 16, 0), (1, 17, 0), (1, 18, 0), (1, 19, 0)]] and s.kv_len == 20
    assert e.chunk_logits == (1 << 20) + 3 * e.config.vocab_size * 4
    s.kv_len = 17
    assert e.prefill_chunk(s, 20, sample=False) is None and s.kv_len == 20


def test_prefill_chunk_refuses_bad_ranges():
    from nanoqwen.errors import ContextError

    e, bm = _backend(max_context=48), BlockManager(64, prefix_caching=False)
    s = _seq(bm, list(range(32)))  # 32 positions reserved: 2 pages
    s.kv_len = 0
    with pytest.raises(NanoqwenError, match="kv_len 0 < end 33 <= 32"):
        e.prefill_chunk(s, 33, sample=False)
    with pytest.raises(NanoqwenError, match="covers 32 positions; 33 must be reserved"):
        e.prefill_chunk(s, 32, sample=True)  # the sampled token's position too
    long = _seq(bm, list(range(50)))
    long.kv_len = 0
    with pytest.raises(ContextError, match="longer than max_context 48"):
        e.prefill_chunk(long, 50, sample=False)
    assert s.kv_len == 0 and long.kv_len == 0
