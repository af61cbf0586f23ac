"""The batched decode step: B sequences, one token each, each at its own position with its own
page table and sampling parameters, through ONE pass over the weights (continuous batching:
the scheduler in nanoqwen/batching.py calls CudaBackend.decode_launch, which lands here, and
CudaBackend.prefill_chunk for a chunk of at most max_batch ids: rows below).

Per step, for the B rows (row r: in a decode step the r-th sequence by slot; buffers for
max_batch rows):

    embed        res[r] = embed[tokens[r]], x[r] its first RMSNorm's input (embed_rows; the
                 pass is verify.rows_forward, the verify step's, with this step's attention)
    per layer    gemv_rows qkv (RMSNorm, bias, RoPE at pos[r], K/V into row r's pages: page
                 tables [max_batch, pages_per_row], row r's at r * pages_per_row), attention
                 over each row's own context (attn_decode<true>: a sequence's splits follow its
                 own length), gemv_rows o (+ residual), gate/up (RMSNorm, SwiGLU), down
                 (+ residual; K split across the CTAs where gemv_rows would take K in
                 many slices: verify.down_path's rule)
    lm_head_rows final RMSNorm, logits [B, V], each row's argmax key
    sample_batch each row's token by the plain sampler's rule with its own temperature /
                 top-k / top-p / seed, the draw counter = the sequence's draw number
                 (len(seq.tokens)), so a seeded row draws the random numbers the plain loop
                 draws at that token, whatever else is in the batch (its logits carry the
                 bucket's fp16 rounding, which can move a draw at a CDF boundary); greedy rows
                 take the argmax key

A row is (sequence, position, token, draw): a decode step gives each sequence one, its last id
at kv_len (draw len(seq.tokens)), or, chained behind the step in flight, the token that step
samples for it, copied on the device (chained_rows, BatchStep.launch); prefill_chunk gives a
chunk of at most max_batch ids of one sequence one row each, at consecutive positions. The
rows of one step see each other's K/V as their positions allow:
gemv_rows' q/k/v launch writes every row's K/V before attention reads any (row t of a chunk
attends to the chunk's rows before it), so a short chunk is prefilled through the step's
graph, one pass over the weights, where forward.prefill would launch its ~9 kernels a layer
one by one from the host (docs/PERFORMANCE.md, Many sequences).

The step is captured as one CUDA graph per bucket of rows (BATCH_BUCKETS up to max_batch) at
its first use. B rows run in the smallest bucket m >= B; rows B .. m - 1 are padding: token 0
at position 0, greedy, their page table's page 0 the pool's padding page (KVCache.pad_page,
in no sequence's table), their outputs ignored. Per step the host writes the rows' state into
pinned staging words (RowStager: the layout below), queues stream-ordered copies of what
changed (the head of tokens, positions and parameters, and the new tail of each row's page
table; no allocation), launches the bucket's graph and queues the copy of its B tokens into
pinned host words and a fence after it; the tokens are read when the fence has passed, so the
host can stage and launch the next step first (BatchStep.launch: the two-step bound).

Staging words (int32, RowLayout; the device buffer "rows" has the same layout):

    [tokens R][pos R][params R x STATE_WORDS][first STATE_WORDS][tables R x pages_per_row]

R = max_batch; params row r holds StateWord words (TEMP, TOP_K, TOP_P, SEED_LO, SEED_HI, STEP
read by sample_batch); `first` is prefill_chunk's row (a sequence's first token, sampled from
the prefill's last row by the same kernel). The head (tokens, pos, params) goes up whole each
step (R x 21 words); a row's table only from the first page not yet uploaded for the sequence
that holds the row, so a steady batch copies a page id per row every 16 steps.

max_batch is at most 16 (registry.MAX_ROWS: gemv_rows' largest bucket, to which an INT4 GEMV
over the rows stays memory-bound). Issue #28's N = 32 would need two gemv_rows launches of 16
rows per weight (two reads of the weights) or the prefill GEMM's 64-token tile for every
projection; neither is here.

The batch path runs without speculative drafts: a backend built with speculative=... still
decodes one token a step per sequence here (its single-stream generate() keeps speculation).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..config import PAGE_TOKENS, ModelConfig
from ..cuda import registry
from ..cuda.batch import BatchKernels, batch_attention_scratch_buffers
from ..cuda.decode import DecodeKernels, NormLink, VerifyKernels
from ..cuda.registry import MAX_ROWS, STATE_WORDS, Geometry, StateWord
from ..errors import NanoqwenError
from .decode_loop import DecodeState
from .kv_cache import KVCache
from .verify import down_path, rows_forward
from .weights import Weights

BATCH_BUCKETS = (1, 2, 4, 8, 16)
assert BATCH_BUCKETS[-1] == MAX_ROWS


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The row counts a graph is captured for: BATCH_BUCKETS below max_batch, then max_batch."""
    if not 1 <= max_batch <= MAX_ROWS:
        raise ValueError(f"max_batch must be 1..{MAX_ROWS}, got {max_batch}")
    return (*(b for b in BATCH_BUCKETS if b < max_batch), max_batch)


def pick_bucket(b: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds b rows."""
    for m in buckets:
        if m >= b:
            return m
    raise ValueError(f"{b} rows: the largest bucket is {buckets[-1]}")


@dataclass(frozen=True)
class RowLayout:
    """Word offsets of the staging area (the module docstring's layout) for `rows` rows of
    `pages_per_row` page ids each."""

    rows: int
    pages_per_row: int

    @property
    def tokens(self) -> int:
        return 0

    @property
    def pos(self) -> int:
        return self.rows

    @property
    def params(self) -> int:
        return 2 * self.rows

    @property
    def first(self) -> int:
        return self.params + self.rows * STATE_WORDS

    @property
    def head_words(self) -> int:
        """tokens, pos, params: the words every step uploads."""
        return self.first

    @property
    def tables(self) -> int:
        return self.first + STATE_WORDS

    @property
    def words(self) -> int:
        return self.tables + self.rows * self.pages_per_row


def pages_per_row(max_context: int) -> int:
    """A row's page table: every page a sequence of max_context positions holds."""
    return -(-max_context // PAGE_TOKENS)


def batch_buffers(config: ModelConfig, rows: int, max_context: int) -> dict[str, int]:
    """Bytes of BatchStep's own buffers for `rows` rows: the staging words' device copy (int32
    RowLayout.words), res fp32 [rows, H] (the residual stream), x fp16 [rows, H] (the next
    RMSNorm's input: verify_buffers' x), q and attn fp16 [rows, q], mlp fp16 [rows, I], logits
    fp32 [rows, V], keys u64 [rows + 1] (the last: spare), out int32 [rows + 1] (the last:
    prefill_chunk's token)."""
    c = config
    return {
        "rows": RowLayout(rows, pages_per_row(max_context)).words * 4,
        "res": rows * c.hidden_size * 4,
        "x": rows * c.hidden_size * 2,
        "q": rows * c.q_size * 2,
        "attn": rows * c.q_size * 2,
        "mlp": rows * c.intermediate_size * 2,
        "logits": rows * c.vocab_size * 4,
        "keys": (rows + 1) * 8,
        "out": (rows + 1) * 4,
    }


def batch_plan(config: ModelConfig, rows: int, max_context: int, geometry: Geometry) -> list[int]:
    """Every device buffer BatchStep allocates, in bytes (engine.memory); the pinned staging
    words are host memory."""
    scratch = batch_attention_scratch_buffers(config, geometry, rows)
    split = registry.rows_split_workspace(config, geometry)  # down_proj's split: BatchStep.part
    return [*batch_buffers(config, rows, max_context).values(), *scratch.values(), split,
            registry.NORM_LINK_BYTES]  # fmt: skip


def sequence_seed(seq) -> int:
    """The sequence's sampling seed, kept in seq.sampler (the contract's backend-owned slot):
    params.seed, or a fresh one drawn at its first use; 64 bits."""
    if seq.sampler is None:
        seed = seq.params.seed
        seq.sampler = seed if seed is not None else int(np.random.SeedSequence().entropy)
    return int(seq.sampler) & ((1 << 64) - 1)


def sampling_words(seq, out: np.ndarray) -> None:
    """A sequence's sampler words (StateWord layout: sample_batch reads TEMP, TOP_K, TOP_P,
    SEED_LO, SEED_HI, STEP) into `out` int32 [STATE_WORDS]; STEP = its draw number
    len(seq.tokens)."""
    p = seq.params
    DecodeState(step=len(seq.tokens), top_k=p.top_k, temperature=p.temperature, top_p=p.top_p,
                seed=sequence_seed(seq)).to_words(out)  # fmt: skip


def last_token(seq) -> int:
    """ids[seq.kv_len] with ids = prompt + tokens: the token a decode step feeds."""
    n = len(seq.prompt)
    return int(seq.prompt[seq.kv_len] if seq.kv_len < n else seq.tokens[seq.kv_len - n])


class Row(NamedTuple):
    """One row of a step: `token` fed at `pos` into `seq`'s pages, its next token sampled by
    seq's params as draw number `draw`."""

    seq: Any
    pos: int
    token: int
    draw: int


def decode_rows(seqs) -> list[Row]:
    """A decode step's rows: each sequence's last id at kv_len, draw len(seq.tokens)."""
    return [Row(s, s.kv_len, last_token(s), len(s.tokens)) for s in seqs]


def chained_rows(seqs) -> list[Row]:
    """The rows of a step launched before the previous step's tokens are read: each sequence
    feeds, at kv_len, the token that step samples for it (copied on the device: `token` here
    is a placeholder), as draw len(seq.tokens) + 1."""
    return [Row(s, s.kv_len, 0, len(s.tokens) + 1) for s in seqs]


def copy_runs(fed_from: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first source row, rows) for each run of consecutive rows r whose sources
    fed_from[r] are consecutive too: one device copy each."""
    runs: list[tuple[int, int, int]] = []
    for r, src in enumerate(fed_from):
        if runs and runs[-1][1] + runs[-1][2] == src:
            dst, first, n = runs[-1]
            runs[-1] = (dst, first, n + 1)
        else:
            runs.append((r, src, 1))
    return runs


_PAD = object()  # a row's owner while it is a padding row


class RowStager:
    """The rows' state in the staging words (int32 [layout.words]) and what each step must copy
    to the device: per row the sequence that holds it and how many of its page ids the device
    has (a new owner, a padding row, or a table that no longer matches uploads again)."""

    def __init__(self, words: np.ndarray, layout: RowLayout, pad_page: int) -> None:
        self.words, self.layout, self.pad_page = words, layout, pad_page
        L = layout
        self.tokens = words[L.tokens : L.tokens + L.rows]
        self.pos = words[L.pos : L.pos + L.rows]
        self.params = words[L.params : L.first].reshape(L.rows, STATE_WORDS)
        self.first = words[L.first : L.tables]
        self.tables = words[L.tables : L.words].reshape(L.rows, L.pages_per_row)
        self._owner: list[object] = [None] * L.rows
        self._uploaded = [0] * L.rows

    def stage(self, rows: list[Row], m: int) -> list[tuple[int, int]]:
        """Write rows 0 .. len(rows) - 1 and padding rows up to m; returns the copies (first
        word, words) to queue, the head first."""
        L, copies = self.layout, [(0, self.layout.head_words)]
        for r, (seq, pos, token, draw) in enumerate(rows):
            self.tokens[r], self.pos[r] = token, pos
            if self._owner[r] is not seq:
                sampling_words(seq, self.params[r])
                self._owner[r], self._uploaded[r] = seq, 0
            self.params[r, StateWord.STEP] = draw
            pages, done = seq.table.pages, self._uploaded[r]
            n = len(pages)
            if n > L.pages_per_row:
                raise NanoqwenError(
                    f"a sequence holds {n} pages; a batch row's table takes {L.pages_per_row}"
                )
            if done and (done > n or self.tables[r, done - 1] != pages[done - 1]):
                done = 0  # the table was rebuilt under the same sequence: upload it whole
            if n > done:
                self.tables[r, done:n] = pages[done:n]
                copies.append((L.tables + r * L.pages_per_row + done, n - done))
                self._uploaded[r] = n
        for r in range(len(rows), m):
            self.tokens[r] = self.pos[r] = 0
            self.params[r] = 0  # temperature 0: greedy
            if self._owner[r] is not _PAD:
                self.tables[r, 0] = self.pad_page
                copies.append((L.tables + r * L.pages_per_row, 1))
                self._owner[r], self._uploaded[r] = _PAD, 0
        return copies

    def forget(self, seq) -> None:
        """Drop every row held by `seq` (its pages may go to others)."""
        for r, owner in enumerate(self._owner):
            if owner is seq:
                self._owner[r], self._uploaded[r] = None, 0


class Launched(NamedTuple):
    """A batch step launched by BatchStep.launch: the sequence of each row."""

    step: Any  # the BatchStep
    serial: int
    seqs: list

    def tokens(self) -> list[int]:
        return self.step.read(self)

    def rows_of(self, seqs) -> list[int]:
        """The row each of `seqs` held in this step: some of its sequences, in its row order
        (a step chained behind it), else NanoqwenError."""
        row = {id(s): r for r, s in enumerate(self.seqs)}
        rows = [row.get(id(s), -1) for s in seqs]
        if -1 in rows or rows != sorted(rows):
            raise NanoqwenError("the step before must hold every sequence chained, in its order")
        return rows


class BatchPending(NamedTuple):
    """CudaBackend.decode_launch's step (backend.Pending): its sequences in the order given and
    the launched step, whose rows run by slot: row r holds seqs[order[r]]."""

    seqs: list
    order: list[int]
    step: Launched

    def tokens(self) -> list[int]:
        out = [0] * len(self.seqs)
        for i, token in zip(self.order, self.step.tokens(), strict=True):
            out[i] = token
        return out


class BatchStep:
    """The batched step over an engine's weights, KV cache and RoPE table, with its buffers for
    max_batch rows (batch_buffers; `buf` maps each name to its device address). `kernels`
    must be built with rows=True (gemv_rows); the head must be fp16 (lm_head_rows)."""

    def __init__(
        self,
        gpu,
        config: ModelConfig,
        kernels: DecodeKernels,
        weights: Weights,
        kv: KVCache,
        rope: int,
        max_batch: int,
        max_context: int,
    ) -> None:
        self.gpu, self.config, self.kernels = gpu, config, kernels
        self.weights, self.kv, self.rope = weights, kv, rope
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.verify = VerifyKernels(gpu, config, kernels.geometry, pdl=kernels.pdl)
        self.batch = BatchKernels(gpu, config, kernels.geometry, pdl=kernels.pdl)
        self.down = {m: down_path(config, m, kernels.geometry) for m in self.buckets}
        self.layout = RowLayout(max_batch, pages_per_row(max_context))
        sizes = batch_buffers(config, max_batch, max_context)
        self.buf = {k: gpu.alloc(n, f"batch {k}").ptr for k, n in sizes.items()}
        gpu.memset(self.buf["keys"], 0, sizes["keys"])  # lm_head_rows takes an atomic max
        split = registry.rows_split_workspace(config, kernels.geometry)
        self.part = gpu.alloc(split, "batch down_proj split").ptr  # every bucket's graph
        self.link = NormLink(gpu)  # the RMSNorm hand-off's buffers, every bucket's graph
        self.attn_scratch = self.batch.scratch(max_batch)
        host, _ = gpu.alloc_mapped(self.layout.words * 4)  # pinned: async copies' source
        self._host = host
        words = np.ctypeslib.as_array((ctypes.c_int32 * self.layout.words).from_address(host))
        words[:] = 0
        self.stager = RowStager(words, self.layout, kv.pad_page)
        self._first = np.empty(1, np.int32)  # the host's copy of buf["out"][max_batch]
        # Two launched steps may be unread at once (launch: why): each step's tokens land in
        # its own half of these pinned words, `done[serial % 2]` recorded after the copy.
        out, _ = gpu.alloc_mapped(2 * max_batch * 4)
        self._out = np.ctypeslib.as_array((ctypes.c_int32 * (2 * max_batch)).from_address(out))
        self._out_host = out
        self._done = [gpu.fence(), gpu.fence()]
        self._staged = gpu.fence()  # recorded after each launch's staging copies
        self._serial = 0  # steps launched
        self._graphs: dict[int, object] = {}

    def word(self, at: int) -> int:
        """Device address of staging word `at` in the device copy."""
        return self.buf["rows"] + 4 * at

    # -- the step ------------------------------------------------------------------------------
    def forward(self, m: int, stream=None) -> None:
        """Enqueue the step over the first m rows of the device copy (tokens, pos, params,
        tables): logits into buf["logits"], the tokens into buf["out"]."""
        b, kv, L = self.buf, self.kv, self.layout
        tokens, pos, tables = self.word(L.tokens), self.word(L.pos), self.word(L.tables)
        stride = L.pages_per_row

        def attend(i: int, stream) -> None:
            self.batch.attention(b["q"], kv.k[i], kv.v[i], tables, stride, pos, m,
                                 self.attn_scratch, b["attn"], stream=stream)  # fmt: skip

        rows_forward(self, m, tokens, pos, tables, stride, self.down[m], attend, stream)
        self.batch.sample(b["logits"], b["keys"], self.word(L.params), b["out"], m,
                          stream=stream)  # fmt: skip

    def graph(self, m: int):
        """The bucket's graph of forward(m), captured and uploaded at its first use."""
        graph = self._graphs.get(m)
        if graph is None:
            with self.gpu.guard(f"capture the batch step at {m} rows"):
                gb = self.gpu.graph_builder()
                self.forward(m, gb)
                graph = gb.end_building().complete()
                graph.upload(self.gpu.stream)
            self._graphs[m] = graph
        return graph

    def stage(self, rows: list[Row]) -> int:
        """Write the rows' state and queue its copies (no sync); returns the bucket."""
        m = pick_bucket(len(rows), self.buckets)
        for at, n in self.stager.stage(rows, m):
            self.gpu.upload_async(self.word(at), self._host + 4 * at, 4 * n)
        return m

    def launch(self, rows: list[Row], after: Launched | None = None) -> Launched:
        """Queue one step of `rows` (each feeds its token at its position into its sequence's
        pages; no sync): its handle, whose tokens() waits for the token each row samples.

        With `after` (the step launched just before, not yet read), `rows` are chained_rows
        of some of its rows' sequences in its row order: row r feeds the token that step
        sampled in row after.rows[r], copied from buf["out"] on the device between the two
        graphs. The host then stages step k + 1 while step k runs: the staging words are
        rewritten only once the `staged` fence shows the last launch's copies have left them,
        and each step's tokens go to its own half of the pinned `out` words, so at most two
        steps are unread at once (the third launch reuses the first's half)."""
        runs = []
        if after is not None:
            if after.serial != self._serial:
                raise NanoqwenError("a chained batch step must follow the step it reads")
            runs = copy_runs(after.rows_of([r.seq for r in rows]))
        with self.gpu.guard("batch step"):
            self._staged.sync()
            m = self.stage(rows)
            self.gpu.fence(self._staged)
            for dst, src, n in runs:
                self.gpu.copy_d2d(self.word(self.layout.tokens + dst),
                                  self.buf["out"] + 4 * src, 4 * n)  # fmt: skip
            self.graph(m).launch(self.gpu.stream)
            self._serial += 1
            half = self._serial % 2 * self.max_batch
            self.gpu.download_async(self._out_host + 4 * half, self.buf["out"], 4 * len(rows))
            self.gpu.fence(self._done[self._serial % 2])
        return Launched(self, self._serial, [r.seq for r in rows])

    def read(self, step: Launched) -> list[int]:
        """A launched step's tokens, by row (waits for it)."""
        if step.serial < self._serial - 1:
            raise NanoqwenError("a batch step read after two later launches: its tokens are gone")
        with self.gpu.guard("batch step"):
            self._done[step.serial % 2].sync()
        half = step.serial % 2 * self.max_batch
        return self._out[half : half + len(step.seqs)].tolist()

    def step(self, rows: list[Row]) -> list[int]:
        """One step of `rows`, waited for: the token each row samples."""
        return self.launch(rows).tokens()

    def sample_first(self, seq, logits: int, key: int) -> None:
        """Queue the draw of a sequence's next token from one row's logits fp32 [V] and argmax
        key (re-zeroed) into buf["out"][max_batch] (read_first after a sync)."""
        L = self.layout
        sampling_words(seq, self.stager.first)
        self.gpu.upload_async(self.word(L.first), self._host + 4 * L.first, 4 * STATE_WORDS)
        self.batch.sample(logits, key, self.word(L.first), self.buf["out"] + 4 * L.rows, 1)

    def read_first(self) -> int:
        """The token sample_first drew (synchronous)."""
        return int(self.gpu.download(self.buf["out"] + 4 * self.layout.rows, self._first)[0])

    def forget(self, seq) -> None:
        self.stager.forget(seq)
