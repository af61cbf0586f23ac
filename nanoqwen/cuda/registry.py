"""The kernel registry: every kernel the engine launches, and every number that the host and the
kernels must agree on.

Two tables live here and nowhere else:

- `Geometry`: launch geometry (threads, CTAs per SM, shared memory), the kernels' tunables
  (ring depths, stage sizes, split counts) and the enums of the Python <-> CUDA contract
  (`StateWord`, the decode state's int32 words; `Epilogue`, the GEMV's epilogue ids). `header()`
  renders all of it, with the model's dims, as the constexpr header that nanoqwen.cuda.jit
  prepends to every source: a kernel reads `kGvStageTarget`, the launcher reads
  `geometry.gv_stage_target`, and neither repeats the other. `Geometry.override()` makes a
  variant (dev/kernel_tune.py sweeps them): a new header, so a new compile-cache entry.
- `kernel_table()`: one `KernelSpec` per kernel (source file, name, template arguments, block
  size, dynamic shared memory, the tunables that shape it), for the decode step and the
  prefill. The launchers (decode.py, prefill.py), `nanoqwen kernels` and the tests compile and
  look kernels up only through it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum
from fractions import Fraction

from ..config import GROUP_SIZE, PAGE_TOKENS, ModelConfig


class StateWord(IntEnum):
    """The decode state: int32 words in device memory, read by the decode kernels and advanced
    by sample_finish (engine/decode_loop.py's DecodeState packs and unpacks them)."""

    TOKEN = 0  # the token the next step consumes
    POS = 1  # its position (KV slot)
    STEP = 2  # tokens generated so far
    MAX_NEW = 3  # stop after this many tokens
    DONE = 4  # 1 once eos / max / cancel is reached
    TOP_K = 5  # 0 = off
    TEMP = 6  # float bits; 0 = greedy
    TOP_P = 7  # float bits; 1 = off
    SEED_LO = 8
    SEED_HI = 9
    SPEC_SKIP = 10  # speculation's backoff: found drafts still to drop (speculative.Backoff)
    SPEC_FAILS = 11  # fully rejected verify steps since the last accepted draft (saturating)
    NUM_EOS = 12
    EOS0 = 13  # NUM_EOS stop ids follow, at most MAX_EOS


class StepCase(IntEnum):
    """The speculative loop body's cases (engine/speculate.py's switch node): draft_ngram sets
    the step's case from its drafts and the verify step's pages (VerifyKernels.long_pages)."""

    CASE_DECODE = 0  # no drafts: the decode step
    CASE_VERIFY = 1  # the verify step, attention_rows' short form
    CASE_VERIFY_LONG = 2  # the verify step, attention_rows' long form


MAX_EOS = 8
STATE_WORDS = StateWord.EOS0 + MAX_EOS
# Speculation's backoff (speculative.Backoff): SPEC_FAILS saturates at BACKOFF_MAX_FAILS, a skip
# is at most 2^BACKOFF_MAX_SHIFT (the cap's bound), both far inside the int32 state words.
BACKOFF_MAX_FAILS = 64
BACKOFF_MAX_SHIFT = 20


class Epilogue(IntEnum):
    """What gemv_int4 does with its dot products (its EPI template argument)."""

    ROPE = 0  # q/k/v: + bias, RoPE on q and k, K/V into the paged cache
    RESIDUAL = 1  # o_proj, down_proj: out += dot (the residual stream, in place)
    SWIGLU = 2  # stacked gate/up: out = silu(gate) * up


_EPILOGUE_C = {Epilogue.ROPE: "kRope", Epilogue.RESIDUAL: "kResidual", Epilogue.SWIGLU: "kSwiGLU"}


def c_name(field: str) -> str:
    """The header's name of a Geometry field or state word: gv_stage_target -> kGvStageTarget,
    max_new -> kMaxNew."""
    return "k" + "".join(part.capitalize() for part in field.split("_"))


# The multi-token step (speculative decoding's verify, batching): token rows 1..MAX_ROWS; the
# M-row GEMV (gemv_rows.cu) is compiled in buckets of n8 tiles. Up to 16 rows an INT4 GEMV over
# the rows stays memory-bound (one read of the weights serves every row).
ROW_BUCKETS = (8, 16)
MAX_ROWS = ROW_BUCKETS[-1]


@dataclass(frozen=True)
class Geometry:
    """Launch geometry and tunables of every kernel. Each field reaches the kernels as
    `constexpr int k<CamelCase>` (c_name); the ones marked host only are the launchers' alone
    and are emitted too, so that the header lists the whole geometry. Why each value is what it
    is: the comment at its use in the .cu file, and docs/PERFORMANCE.md."""

    # gemv_int4.cu: consumer warps (one producer warp more), CTAs per SM (their registers: 96
    # a thread), the smallest K of the wide form (gemv_form: past the 7B's down, K = 18944 with
    # three stages a CTA, before a CTA's share holds only two, K ~ 22k), weight bytes a stage
    # aims at (gate/up: twice), ring depth, stages in flight before x has landed, the largest K
    # that takes the offset form, x items kept in registers, stage_pairs' balance rule (0: the
    # size rule alone; kept as a switch so that dev/kernel_tune.py can time both).
    gv_consumers: int = 8
    gv_ctas_per_sm: int = 2
    gv_wide_min_k: int = 20480
    gv_stage_target: int = 8192
    gv_max_stages: int = 8
    gv_early_stages: int = 1
    gv_fold_max_k: int = 8192
    gv_x_reg_items: int = 2
    gv_balance: int = 1
    gv_smem: int = 110 * 1024  # host only: dynamic shared memory a GEMV CTA gets (its ring)
    # gemv_rows.cu (the M-row GEMV): consumer warps (one producer warp more; one CTA an SM),
    # ring depth at most (K slices: 16 KB stages, 8 of them ~128 KB in flight an SM), the
    # dynamic shared memory a CTA asks for, the fewest SMs its K slices plan for
    # (rows_split: a CTA's pairs, and so its sums, grow as SMs go), and the fewest pairs a CTA
    # takes (rows_grid: a whole stage's; below it a CTA's 8-row TMA boxes read its
    # neighbour's rows, and every CTA's read of x from L2 outweighs its weights more); the
    # groups of x a consumer lane keeps in registers at MT = 8 (16 registers each: a warp takes
    # the same groups of every stage at S = 1; two spill under the 96 registers a thread); the
    # consumer teams where a CTA runs mr_team_min_stages stages or more at MT = 8 (rows_teams).
    mr_consumers: int = 16
    mr_teams: int = 2  # host only: the kernel's T is a template argument
    mr_team_min_stages: int = 8  # host only
    mr_x_regs: int = 1
    mr_max_stages: int = 8
    mr_smem: int = 224 * 1024  # host only
    mr_min_sms: int = 112  # host only
    mr_min_pairs: int = 8  # host only
    # gemv_rows_split (down_proj split over K, gemv_rows.cu): consumer warps (one producer
    # more), the (group, token tile) products a consumer warp keeps in flight (warp_stage),
    # 16-row sub-stages a stage (one a team of kMrSplitConsumers / kMrSplitSub warps: weight
    # bytes a consumer barrier), the fewest ring stages its K slices must leave
    # (rows_split_slices), gemv_rows_split_sum's block. Half gemv_rows' warps, each with 4
    # groups in flight: a team's warps then take ~4 of a sub-stage's 15 groups, and its stage
    # reduction adds 4 warps' sums, not 8 (docs/PERFORMANCE.md, the verify step).
    mr_split_consumers: int = 8
    mr_split_ilp: int = 4
    mr_split_sub: int = 2
    mr_split_min_stages: int = 3  # host only
    mr_sum_threads: int = 128
    # decode_misc.cu: block of the token-parallel kernels, lm_head's warps a CTA and rows in
    # flight a warp (fp16 rows; int8 rows, half the bytes, so twice as many keep the same
    # bytes in flight), the sampler's block and the most candidates its thresholds sort in
    # shared memory (sampler.cuh: 8 bytes each, beside 24 KB of histogram bins).
    misc_threads: int = 256
    lm_warps: int = 8
    lm_max_slots: int = 4
    lm_q8_max_slots: int = 8
    lm_ring: int = 200 * 1024  # host only: the shared memory lm_head's slots may take
    sample_threads: int = 1024
    sample_candidates: int = 2048
    # kernels/kv_cache.cuh: fp16 tiles a page of K, 2 for the (hi, lo) pair that holds k to
    # ~22 bits, 1 for plain fp16 K (K_CACHE names the two).
    k_parts: int = 2
    # decode_attention.cu: consumer warps (one producer more), the most splits along the
    # sequence, pages in flight a CTA (96 KB at D = 128: 8 stages of K (hi, lo) and V, 12 of
    # plain fp16 K and V), CTAs a cluster merges, the fewest pages a cluster rank owns, the
    # merge's independent loads a thread, and the grid's target size.
    attn_consumers: int = 4
    attn_splits: int = 64
    attn_stages: int = 8
    attn_cluster: int = 8
    attn_min_pages: int = 16
    attn_merge_loads: int = 16
    attn_ctas: int = 128  # host only
    # The multi-row step (speculative decoding: the current token and its drafts; its most rows
    # are MAX_ROWS, kVerifyRows in the header): decode_attention_rows.cu's consumer warps (one
    # producer more; a power of two), most splits along the sequence, ring pages (8 of K (hi,
    # lo) and V leave room for the cluster inbox; 16 of plain fp16 K and V), CTAs a cluster
    # merges in the short form and in the long one (the kernel's template argument: the step
    # takes the long form where the short one's clusters would not fit the GPU at once,
    # mattn_long_pages), fewest pages a cluster rank owns and the final merge's independent
    # loads a thread; lm_head_rows.cu's consumer warps (one producer more), vocab rows a block
    # (TMA box rows), columns a k-tile (TMA box columns: 128 bytes), ring stages at most, and
    # the shared memory it asks for.
    mattn_consumers: int = 8
    mattn_splits: int = 64
    mattn_stages: int = 8
    mattn_cluster: int = 8
    mattn_long_cluster: int = 2
    mattn_min_pages: int = 8
    mattn_merge_loads: int = 8
    lmr_consumers: int = 4
    lmr_block_rows: int = 128
    lmr_k_tile: int = 64
    lmr_max_stages: int = 12
    lmr_smem: int = 220 * 1024  # host only
    # speculate.cu: draft_ngram's block (one CTA scans the whole history) and its 16-byte
    # history loads in flight a thread.
    draft_threads: int = 1024
    draft_loads: int = 4
    # One shared-memory carveout (percent) for every kernel of the decode step, so that no SM
    # drains to reconfigure between overlapping (PDL) kernels.
    smem_carveout: int = 100  # host only
    # prefill_gemm_wgmma.cu (K per k-tile, weight rows a CTA, threads) and
    # prefill_attention.cu (query rows a CTA = keys a K/V tile, threads; the split merge's
    # threads, a warp a (row, head)).
    prefill_k_tile: int = 64
    prefill_rows: int = 128
    prefill_threads: int = 384
    prefill_attn_tile: int = 64
    prefill_attn_threads: int = 128
    prefill_merge_threads: int = 256

    @property
    def gv_threads(self) -> int:
        return (self.gv_consumers + 1) * 32

    @property
    def norm_rows(self) -> int:
        """rmsnorm_rows takes a row a warp."""
        return self.misc_threads // 32

    @property
    def attn_threads(self) -> int:
        return (self.attn_consumers + 1) * 32

    @property
    def mattn_threads(self) -> int:
        return (self.mattn_consumers + 1) * 32

    @property
    def lmr_threads(self) -> int:
        return (self.lmr_consumers + 1) * 32

    @property
    def verify_rows(self) -> int:
        """The multi-row step's most rows: MAX_ROWS (the M-row GEMV's largest bucket)."""
        return MAX_ROWS

    def constants(self) -> dict[str, int]:
        """Every value the header declares, by its C name (fields, then derived sizes)."""
        out = {c_name(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}
        for derived in ("gv_threads", "norm_rows", "attn_threads", "mattn_threads", "lmr_threads",
                        "verify_rows"):  # fmt: skip
            out[c_name(derived)] = getattr(self, derived)
        return out

    def override(self, values: dict[str, int]) -> Geometry:
        """A copy with fields replaced, named by their C names ({"kGvEarlyStages": 2})."""
        by_c = {c_name(f.name): f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - set(by_c))
        if unknown:
            raise ValueError(f"unknown geometry names {unknown}; known: {', '.join(by_c)}")
        return dataclasses.replace(self, **{by_c[k]: int(v) for k, v in values.items()})

    def override_text(self, text: str) -> Geometry:
        """override() from "kMrMaxStages=4,kMrConsumers=8" (the dev scripts' --variant)."""
        values = {}
        for item in text.split(","):
            name, eq, v = item.partition("=")
            if not eq or not v.strip().lstrip("-").isdigit():
                raise ValueError(f"{item!r}: expected NAME=integer")
            values[name.strip()] = int(v)
        return self.override(values)


DEFAULT_GEOMETRY = Geometry()

# The K cache's formats (kernels/kv_cache.cuh), by name: the Geometry fields each sets.
# "fp16x2" (the default) keeps k as an fp16 (hi, lo) pair, to ~22 bits: K's rounding was the
# engine's largest left (docs/DESIGN.md, Activation precision), for 1.5x the KV bytes. "fp16"
# is the plain cache: 2/3 of the KV bytes and attention's stream, for long contexts and many
# sequences, at the old precision; its rings take 12 and 16 stages for the same bytes.
K_CACHE = {
    "fp16x2": {"kKParts": 2, "kAttnStages": 8, "kMattnStages": 8},
    "fp16": {"kKParts": 1, "kAttnStages": 12, "kMattnStages": 16},
}
DEFAULT_K_CACHE = "fp16x2"  # DEFAULT_GEOMETRY's


def k_cache_geometry(name: str, g: Geometry = DEFAULT_GEOMETRY) -> Geometry:
    """`g` with the K cache format `name` (K_CACHE)."""
    if name not in K_CACHE:
        raise ValueError(f"unknown K cache format {name!r}; known: {', '.join(K_CACHE)}")
    return g.override(K_CACHE[name])


def k_cache_name(g: Geometry) -> str:
    """The K_CACHE format of g's K cache (its k_parts)."""
    return next(name for name, v in K_CACHE.items() if v["kKParts"] == g.k_parts)


def header(config: ModelConfig | None, geometry: Geometry = DEFAULT_GEOMETRY) -> str:
    """The generated header: the model's dims, the geometry and the contract's enums."""
    lines = [
        "// Generated by nanoqwen.cuda.registry.header(): do not edit.",
        "#pragma once",
        f"constexpr int kPageTokens = {PAGE_TOKENS};",
        f"constexpr int kGroupSize = {GROUP_SIZE};",
    ]
    lines += [f"constexpr int {k} = {v};" for k, v in geometry.constants().items()]
    lines.append("enum StateWord : int {")
    lines += [f"  {c_name(w.name.lower())} = {int(w)}," for w in StateWord]
    lines.append("};")
    lines.append("enum StepCase : int {")
    lines += [f"  {c_name(c.name.lower())} = {int(c)}," for c in StepCase]
    lines.append("};")
    lines.append(f"constexpr int kMaxEos = {MAX_EOS};")
    lines.append(f"constexpr int kNormParts = {NORM_PARTS};")
    lines.append(f"constexpr int kBackoffMaxFails = {BACKOFF_MAX_FAILS};")
    lines.append(f"constexpr int kBackoffMaxShift = {BACKOFF_MAX_SHIFT};")
    lines.append("enum Epilogue : int {")
    lines += [f"  {_EPILOGUE_C[e]} = {int(e)}," for e in Epilogue]
    lines.append("};")
    if config is not None:
        c = config
        lines += [
            f"// model: {c.name}",
            f"constexpr int kHidden = {c.hidden_size};",
            f"constexpr int kInter = {c.intermediate_size};",
            f"constexpr int kVocab = {c.vocab_size};",
            f"constexpr int kLayers = {c.num_layers};",
            f"constexpr int kHeads = {c.num_heads};",
            f"constexpr int kKVHeads = {c.num_kv_heads};",
            f"constexpr int kHeadDim = {c.head_dim};",
            f"constexpr int kQSize = {c.q_size};",
            f"constexpr int kKVSize = {c.kv_size};",
            f"constexpr int kQKVSize = {c.q_size + 2 * c.kv_size};",
            f"constexpr int kGroupRatio = {c.group_ratio};",
            f"constexpr float kRopeTheta = {c.rope_theta!r}f;",
            f"constexpr float kRmsEps = {c.rms_norm_eps!r}f;",
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class GemmTile:
    """One tile of the stream-K prefill GEMM: 128 weight rows x `tokens` tokens, a
    `stages`-deep ring. `tflops` is its rate on the 7B shapes counting the padded tokens (chip
    TFLOP/s of ceil(M / tokens) x tokens; GEMM_TILES says at which M and whether measured or
    estimated), the tile picker's only notion of speed."""

    tokens: int
    stages: int
    swiglu: bool
    tflops: float


# Ties go to the first tile (prefill.PrefillKernels.pick_gemm). The rates are measured on the
# H200 (docs/PERFORMANCE.md, Prompt lengths and the GEMM tiles), each kind on its layer's largest
# GEMM: SwiGLU on the 7B's gate/up, the others on its down_proj (o and q/k/v, ~40% of a layer's
# plain GEMM time, rank the tiles alike within 5%); 64 to 256 tokens at M = 512 (the 192-token
# tile at M = 576: its rate against the 256-token tile's in the same run, x 0.98 plain, x 0.91
# SwiGLU). The 192-token tile is there for the lengths just past a multiple of 256: a 530-token
# prompt pads to 576 rows instead of 768. The 16-token tile (M = 1..16: prompts of a few new
# tokens; dev/down_ab.py's gemm baseline) keeps 16 stages (64 KB of weights) in flight an
# SM for its pass over the weights. The picker's model has no memory-bound term, so its rates are
# set from what it must reproduce, the 7B's shapes at M = 16 on the H200 against the 64-token
# tile (dev/prefill_check.py --timing-m 8,16): down 25.6 against 29.6 us gives 395 x 16/64 x
# 29.6/25.6 = 114; gate/up 47.2 against 65.3 gives 373 x 16/64 x 65.3/47.2 = 129 (q/k/v and o
# are 23-26% faster with it too). Any rate in (r64 / 4, r64 / 2) picks it at M <= 16 only: at
# M = 17..64 two or more 16-token tiles cost more than one 64-token tile.
GEMM_TILES = (
    GemmTile(16, 16, False, 114.0),
    GemmTile(16, 16, True, 129.0),
    GemmTile(64, 8, False, 395.0),
    GemmTile(64, 8, True, 373.0),
    GemmTile(128, 6, False, 582.0),
    GemmTile(128, 6, True, 545.0),
    GemmTile(192, 5, False, 671.0),
    GemmTile(192, 5, True, 605.0),
    GemmTile(256, 4, False, 685.0),
    GemmTile(256, 4, True, 662.0),
)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel instantiation: `source` in nanoqwen/kernels/, function `name` with template
    arguments `targs`, launched with `threads` threads and `smem` bytes of dynamic shared
    memory. `tunables` names the Geometry values (C names) its code depends on."""

    key: str
    source: str
    name: str
    threads: int
    smem: int = 0
    targs: tuple = ()
    tunables: tuple[str, ...] = ()
    tile: GemmTile | None = None  # prefill GEMM specs only

    @property
    def expression(self) -> str:
        """The NVRTC name expression: `embed_gather`, `gemv_int4<3584, true, 0>`."""
        if not self.targs:
            return self.name
        args = ", ".join(("true" if a else "false") if isinstance(a, bool) else str(a)
                         for a in self.targs)  # fmt: skip
        return f"{self.name}<{args}>"


GEMV = "gemv_int4.cu"
GEMV_ROWS = "gemv_rows.cu"
ATTENTION_ROWS = "decode_attention_rows.cu"
LM_HEAD_ROWS = "lm_head_rows.cu"
MISC = "decode_misc.cu"
SPECULATE = "speculate.cu"
ATTENTION = "decode_attention.cu"
PREFILL_GEMM = "prefill_gemm_wgmma.cu"
PREFILL_ATTENTION = "prefill_attention.cu"
_GV_TUNABLES = ("kGvConsumers", "kGvCtasPerSm", "kGvWideMinK", "kGvStageTarget",
                "kGvMaxStages", "kGvEarlyStages", "kGvFoldMaxK", "kGvXRegItems",
                "kGvBalance", "kKParts")  # fmt: skip
_MR_TUNABLES = ("kMrConsumers", "kMrXRegs", "kMrMaxStages", "kGvEarlyStages", "kKParts",
                "kVerifyRows")  # fmt: skip
_MR_SPLIT_TUNABLES = ("kMrSplitConsumers", "kMrSplitIlp", "kMrMaxStages", "kGvEarlyStages",
                      "kKParts", "kMrSplitSub")  # fmt: skip
_ATTN_TUNABLES = ("kAttnConsumers", "kAttnSplits", "kAttnStages", "kAttnCluster",
                  "kAttnMinPages", "kAttnMergeLoads", "kKParts")  # fmt: skip
_MATTN_TUNABLES = ("kVerifyRows", "kMattnConsumers", "kMattnSplits", "kMattnStages",
                   "kMattnCluster", "kMattnLongCluster", "kMattnMinPages", "kMattnMergeLoads",
                   "kKParts")  # fmt: skip
_LMR_TUNABLES = ("kVerifyRows", "kLmrConsumers", "kLmrBlockRows", "kLmrKTile",
                 "kLmrMaxStages")  # fmt: skip


def gemm_smem_bytes(tile: GemmTile, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """prefill_gemm_wgmma.cu's smem_bytes<BT, STAGES, SWIGLU>(): 1024 bytes of alignment slack
    + max(the ring, the epilogue's fp32 staging) + 2 x STAGES + 1 mbarriers."""
    ring = tile.stages * (
        tile.tokens * g.prefill_k_tile * 2 + g.prefill_rows * g.prefill_k_tile // 2
    )
    cols = g.prefill_rows // 2 if tile.swiglu else g.prefill_rows
    staging = tile.tokens * (cols + 4) * 4
    return 1024 + max(ring, staging) + (2 * tile.stages + 1) * 8


def prefill_attention_smem_bytes(head_dim: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """prefill_attention.cu's Layout<D>::kSmemBytes: 1024 bytes of alignment slack + a Q tile,
    two K tiles (k_parts parts each) and two V tiles of prefill_attn_tile rows x head_dim
    halves."""
    return 1024 + (3 + 2 * g.k_parts) * g.prefill_attn_tile * head_dim * 2


@dataclass(frozen=True)
class GemvForm:
    """The launch shape of gemv_int4<K> (its GvForm<K>): `ctas_per_sm` CTAs an SM, each of
    `consumers` consumer warps and a producer, with `smem` bytes of dynamic shared memory.
    From K = gv_wide_min_k on one CTA takes the SM's share of all gv_ctas_per_sm (the wide
    form: a CTA's share cannot hold x beside two whole-row stages)."""

    consumers: int
    ctas_per_sm: int
    smem: int

    @property
    def threads(self) -> int:
        return (self.consumers + 1) * 32


def gemv_form(k: int, g: Geometry = DEFAULT_GEOMETRY) -> GemvForm:
    if k >= g.gv_wide_min_k:
        return GemvForm(g.gv_ctas_per_sm * g.gv_consumers, 1, g.gv_ctas_per_sm * g.gv_smem)
    return GemvForm(g.gv_consumers, g.gv_ctas_per_sm, g.gv_smem)


def gemv_stage_pairs(k: int, epi: Epilogue, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """Pairs a stage of gemv_int4<K, *, EPI>: gemv_int4.cu's stage_pairs (why: its comment),
    in Python. The size rule (about gv_stage_target bytes, gate/up twice), raised by the
    balance rule (gv_balance; not in the wide form) to the fewest pairs that keep every
    consumer warp busy."""
    form, octets = gemv_form(k, g), (k // GROUP_SIZE + 7) // 8
    target = g.gv_stage_target * (2 if epi == Epilogue.SWIGLU else 1)
    p = 1
    while p < form.consumers and 2 * p * k <= target:
        p *= 2
    best, best_rate = 1, Fraction(0)
    q = 1
    while g.gv_balance and k < g.gv_wide_min_k and q <= form.consumers:
        wp = form.consumers // q
        kx = -(-octets // wp)
        rate = Fraction(q * wp, octets) if kx > g.gv_x_reg_items else Fraction(q, kx)
        if rate > best_rate:
            best, best_rate = q, rate
        q *= 2
    return max(p, best)


def gemv_stages(k: int, epi: Epilogue, npairs: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """The stages of gemv_int4<K, *, EPI>'s ring in a CTA that owns `npairs` pairs: what its
    dynamic shared memory leaves beside x, the offset terms and the per-pair sums, at most
    gv_max_stages (the kernel traps below two). gemv_int4.cu's stage_pairs, kStageBytes and
    `stages`, in Python."""
    form, groups = gemv_form(k, g), k // GROUP_SIZE
    p = gemv_stage_pairs(k, epi, g)
    scale_bytes = (p * groups * 2 + 28 + 15) // 16 * 16
    stage_bytes = (2 * (p * k // 2) + 2 * scale_bytes + 127) // 128 * 128
    xc_bytes = (groups + 1) // 2 * 2 * 4
    red_bytes = npairs * (form.consumers // p) * 8 * 2 * 4
    return min(g.gv_max_stages, (form.smem - k * 2 - xc_bytes - red_bytes) // stage_bytes)


def lm_head_smem_bytes(
    config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY, int8: bool = False
) -> int:
    """lm_head's whole-row slots: as many a warp as fit in lm_ring, at most lm_max_slots
    (fp16 rows) or lm_q8_max_slots (int8 rows: lm_head_argmax_q8)."""
    row = config.hidden_size * (1 if int8 else 2)
    most = g.lm_q8_max_slots if int8 else g.lm_max_slots
    return g.lm_warps * min(most, g.lm_ring // (g.lm_warps * row)) * row


def kv_token_bytes(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """Bytes of K (k_parts fp16 values a dim) and V (one) a token occupies in one layer's
    cache: what attention reads a position."""
    return config.kv_size * 2 * (g.k_parts + 1)


def attn_smem_bytes(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """decode_attention.cu's kAttnRingBytes: attn_stages pages of K (k_parts tiles) and V."""
    return g.attn_stages * (g.k_parts + 1) * PAGE_TOKENS * config.head_dim * 2


def mattn_smem_bytes(config: ModelConfig, cluster: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """decode_attention_rows.cu's MaCluster<cluster>::kSmemBytes: the ring (mattn_stages pages
    of K and V), then the cluster inbox: a column slice of every rank's rows (fp32) and their
    (m, l)."""
    rows = g.verify_rows * config.group_ratio
    ring = g.mattn_stages * (g.k_parts + 1) * PAGE_TOKENS * config.head_dim * 2
    return ring + cluster * rows * (config.head_dim // cluster) * 4 + cluster * rows * 8


# mattn_long_pages when the short form always fits: no verify step reaches it (MAX_HISTORY
# tokens take MAX_HISTORY / 16 pages).
MATTN_NEVER_LONG = 1 << 30


def mattn_long_pages(config: ModelConfig, splits: int, fits: int,
                     g: Geometry = DEFAULT_GEOMETRY) -> int:  # fmt: skip
    """The fewest pages (ceil((start + M) / 16)) at which the verify step takes attention_rows'
    long form (clusters of mattn_long_cluster): where the short form's working clusters,
    num_kv_heads x ncl (ncl = min(splits / C, ceil(P / (C mattn_min_pages))), C =
    mattn_cluster; one tile group there), pass `fits`, the short form's clusters the GPU holds
    at once (Gpu.max_active_clusters); splits: the CTAs a kv head (VerifyKernels.attn_splits).
    MATTN_NEVER_LONG where they always fit. The tile groups of shorter contexts take at most
    half the grid's clusters (decode_attention_rows.cu), 8 of 16 on every preset."""
    per_head = fits // config.num_kv_heads
    if per_head >= splits // g.mattn_cluster:
        return MATTN_NEVER_LONG
    return per_head * g.mattn_cluster * g.mattn_min_pages + 1


def lmr_stages(config: ModelConfig, m: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """lm_head_rows.cu's ring stages at M rows: what lmr_smem leaves beside the 1024-byte
    alignment and the padded x rows (8 or 16), in 1024-byte units, at most lmr_max_stages."""
    x_rows = 8 if m <= 8 else 16
    x_bytes = -(-x_rows * (config.hidden_size * 2 + 16) // 1024) * 1024
    stage = g.lmr_block_rows * g.lmr_k_tile * 2
    return min(g.lmr_max_stages, (g.lmr_smem - 1024 - x_bytes) // stage)


def gemv_shapes(config: ModelConfig) -> dict[str, tuple[int, int, bool, Epilogue]]:
    """The decode step's four GEMVs: kind -> (K, N output features, RMSNorm fused, epilogue)."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    return {
        "qkv": (h, c.q_size + 2 * c.kv_size, True, Epilogue.ROPE),  # + bias + RoPE + K/V write
        "o": (c.q_size, h, False, Epilogue.RESIDUAL),
        "gate_up": (h, i, True, Epilogue.SWIGLU),  # stacked gate/up: silu(gate) * up
        "down": (i, h, False, Epilogue.RESIDUAL),
    }


def gemv_pairs(n: int, epi: Epilogue) -> int:
    """Pairs of output rows a GEMV takes (gemv_int4.cu: rows two at a time; SwiGLU: gate row
    p with up row p)."""
    return n if epi == Epilogue.SWIGLU else -(-n // 2)


def row_bucket(m: int) -> int:
    """The compiled bucket (MT) that takes m token rows: the smallest of ROW_BUCKETS >= m."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv_rows takes 1..{MAX_ROWS} token rows, got M={m}")
    return next(b for b in ROW_BUCKETS if b >= m)


# gemv_rows.cu's constants: pairs a stage (16 weight rows, one mma's A), a K slice's most
# groups (kMrSliceGroups: a TMA box row of 256 words), the ring's alignment (kMrAlign), the
# alignment of gemv_rows' x at S = 1 (kMrXAlign: the 128-byte swizzle's).
ROWS_STAGE_PAIRS = 8
ROWS_SLICE_GROUPS = 16
ROWS_ALIGN = 128
ROWS_X_ALIGN = 1024
# gemv_rows.cu's RMSNorm hand-off (NormLink): rows of producer sums of squares a normalizing
# kernel reads at most (kNormParts: a producer's CTAs; one CTA an SM for gemv_rows' residual
# GEMVs, ~100-160 for the split's sum kernel), and the bytes of ss plus the two scale slots.
NORM_PARTS = 256
NORM_LINK_BYTES = (NORM_PARTS + 2) * MAX_ROWS * 4


def rows_split(k: int, n: int, epi: Epilogue, mt: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """S, the K slices each CTA takes in turn (gemv_rows.cu's template argument): 1 when x of
    MT tokens over all K leaves two stages of the ring beside it, the stage reduction and the
    sums on a GPU of mr_min_sms SMs; else the fewest slices of at most ROWS_SLICE_GROUPS groups
    whose double-buffered x leaves two."""
    groups = k // GROUP_SIZE
    npairs = _rows_npairs(n, epi, g.mr_min_sms, g)
    if rows_stages(k, mt, 1, npairs, g) >= 2:
        return 1
    s = max(2, -(-groups // ROWS_SLICE_GROUPS))
    while rows_stages(k, mt, s, npairs, g) < 2:
        s += 1
        if s > groups:
            raise ValueError(f"gemv_rows: K={k}, N={n} at MT={mt} fits no split")
    return s


def rows_stage_bytes(k: int, s: int) -> int:
    """gemv_rows.cu's MrShape<K, MT, S>::kStage: runs a and b (8 rows each, whole at S = 1,
    else the slice's ceil(G / S) groups; run b rows_run_pad bytes past run a's end) and their
    scales (the 16-byte units around the run at S = 1, each row's 4-byte units around its slice
    at S > 1)."""
    groups = k // GROUP_SIZE
    gs = -(-groups // s)
    row = k // 2 if s == 1 else gs * GROUP_SIZE // 2
    if s == 1:
        scales = (ROWS_STAGE_PAIRS * groups * 2 + 28 + 15) // 16 * 16
    else:
        scales = ROWS_STAGE_PAIRS * (((gs + 2) * 2 + 15) // 16 * 16)
    return (2 * ROWS_STAGE_PAIRS * row + rows_run_pad(k, s) + 2 * scales + 127) // 128 * 128


def rows_run_pad(k: int, s: int) -> int:
    """MrShape::kPad: bytes between a stage's run a and run b (64 at S = 1 when a row is a
    whole multiple of 128 bytes, so that the two runs' rows differ in bank by 64 bytes)."""
    return 64 if s == 1 and (k // 2) % 128 == 0 else 0


def rows_stages(k: int, mt: int, s: int, npairs: int, g: Geometry = DEFAULT_GEOMETRY,
                teams: int = 1) -> int:  # fmt: skip
    """The ring stages of gemv_rows<K, MT, *, *, S, T> in a CTA that owns `npairs` pairs: what
    mr_smem leaves beside x (two slices' buffers at S > 1), the stage reduction and, at S > 1,
    the sums, at most mr_max_stages, in whole rounds of its T `teams` (the kernel traps below
    two a team). gemv_rows.cu's `stages`, in Python."""
    x = (1 if s == 1 else 2) * mt * -(-(k // GROUP_SIZE) // s) * GROUP_SIZE * 2
    red = 2 * g.mr_consumers * 16 * mt * 4
    sums = 0 if s == 1 else npairs * 2 * mt * 4
    free = g.mr_smem - ROWS_ALIGN - (ROWS_X_ALIGN if s == 1 else 0) - x - red - sums
    return min(g.mr_max_stages, free // rows_stage_bytes(k, s)) // teams * teams


def rows_teams(k: int, n: int, epi: Epilogue, mt: int, s: int,
               g: Geometry = DEFAULT_GEOMETRY) -> int:  # fmt: skip
    """T, gemv_rows' consumer teams (gemv_rows.cu's template argument): mr_teams at S = 1 and
    MT = 8 where the ring holds two stages a team and a CTA runs mr_team_min_stages stages or
    more (on a GPU of mr_min_sms SMs: gate/up), else one. A CTA of few stages runs them in
    turn faster with all its warps on each (the 7B's q/k/v: 3 a CTA)."""
    t = g.mr_teams
    if s != 1 or mt != 8 or t == 1 or rows_stages(k, mt, s, 0, g) < 2 * t:
        return 1
    stages = -(-_rows_npairs(n, epi, g.mr_min_sms, g) // ROWS_STAGE_PAIRS)
    return t if stages >= g.mr_team_min_stages else 1


def _rows_npairs(n: int, epi: Epilogue, num_sms: int, g: Geometry) -> int:
    """The most pairs a CTA of gemv_rows owns (rows_grid's grid)."""
    return -(-gemv_pairs(n, epi) // rows_grid(n, epi, num_sms, g))


def rows_grid(n: int, epi: Epilogue, num_sms: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """gemv_rows' persistent grid: one CTA an SM (no clusters: each CTA owns its pairs over
    all K), fewer where the pairs would leave a CTA fewer than mr_min_pairs."""
    return max(1, min(num_sms, gemv_pairs(n, epi) // g.mr_min_pairs))


def rows_specs(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """The M-row GEMV of the decode step's four shapes at each token bucket, and the
    multi-row steps' embedding (the head of gemv_rows.cu's RMSNorm hand-off)."""
    gemvs = tuple(
        KernelSpec(f"gemv_rows_{kind}_m{mt}", GEMV_ROWS, "gemv_rows", (g.mr_consumers + 1) * 32,
                   g.mr_smem, targs=(k, mt, norm, int(epi), s, rows_teams(k, n, epi, mt, s, g)),
                   tunables=_MR_TUNABLES)
        for kind, (k, n, norm, epi) in gemv_shapes(config).items()
        for mt in ROW_BUCKETS
        for s in (rows_split(k, n, epi, mt, g),)
    )  # fmt: skip
    return gemvs + (KernelSpec("embed_rows", GEMV_ROWS, "embed_rows", g.misc_threads,
                               tunables=("kMiscThreads", "kVerifyRows")),)  # fmt: skip


def rows_split_stage_rows(g: Geometry = DEFAULT_GEOMETRY) -> int:
    """Weight rows a stage of gemv_rows_split (SplitShape::kRows): mr_split_sub x 16."""
    return 16 * g.mr_split_sub


def rows_split_stages(k: int, mt: int, s: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """The ring stages of gemv_rows_split<K, MT, S>: what mr_smem leaves beside x of one slice
    (MT x ceil(G / S) groups), the stage reduction and the alignment, in stages of mr_split_sub
    gemv_rows S > 1 stages, at most mr_max_stages (the kernel traps below two)."""
    gs = -(-(k // GROUP_SIZE) // s)
    x = mt * gs * GROUP_SIZE * 2
    red = 2 * g.mr_split_consumers * 16 * mt * 4
    free = g.mr_smem - ROWS_ALIGN - x - red
    return min(g.mr_max_stages, free // (g.mr_split_sub * rows_stage_bytes(k, s)))


def rows_split_slices(k: int, mt: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """S, gemv_rows_split's K slices (its grid's second dimension): the fewest slices of at
    most ROWS_SLICE_GROUPS groups (a TMA box row), at least two, whose x leaves
    mr_split_min_stages ring stages. Fewer slices: less x from L2 (ranges x M x K x 2 bytes)
    and fewer partial sums; the box bounds it below (the 7B's down: 10 slices of 14-15
    groups; at MT = 32 the 32B's would take more, shorter slices)."""
    groups = k // GROUP_SIZE
    s = max(2, -(-groups // ROWS_SLICE_GROUPS))
    while rows_split_stages(k, mt, s, g) < g.mr_split_min_stages:
        s += 1
        if s > groups:
            raise ValueError(f"gemv_rows_split: K={k} at MT={mt} fits no split")
    return s


def rows_split_grid(k: int, n: int, mt: int, num_sms: int,
                    g: Geometry = DEFAULT_GEOMETRY) -> tuple[int, int]:  # fmt: skip
    """gemv_rows_split's grid (R row ranges, S K slices): one wave of one CTA an SM (R x S <=
    num_sms), at most one range a stage of rows."""
    s = rows_split_slices(k, mt, g)
    blocks = -(-n // rows_split_stage_rows(g))
    return max(1, min(num_sms // s, blocks)), s


def rows_split_padded(n: int, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """Npad: the workspace's rows, n rounded up to whole stages of gemv_rows_split."""
    rows = rows_split_stage_rows(g)
    return -(-n // rows) * rows


def rows_split_workspace(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> int:
    """Bytes of gemv_rows_split's partial sums, fp32 [S][Npad][MT], for the largest bucket
    (one buffer serves every bucket and every layer: each launch writes what its sum reads)."""
    k, n, _, _ = gemv_shapes(config)["down"]
    return max(rows_split_slices(k, mt, g) * rows_split_padded(n, g) * mt * 4
               for mt in ROW_BUCKETS)  # fmt: skip


def rows_split_specs(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """down_proj split over K at each token bucket: gemv_rows_split (the slices' sums into
    the workspace) and gemv_rows_split_sum (their sum into the residual)."""
    k, _, _, _ = gemv_shapes(config)["down"]
    specs: tuple[KernelSpec, ...] = ()
    for mt in ROW_BUCKETS:
        s = rows_split_slices(k, mt, g)
        specs += (
            KernelSpec(f"gemv_rows_split_down_m{mt}", GEMV_ROWS, "gemv_rows_split",
                       (g.mr_split_consumers + 1) * 32, g.mr_smem, targs=(k, mt, s),
                       tunables=_MR_SPLIT_TUNABLES),
            KernelSpec(f"gemv_rows_split_sum_m{mt}", GEMV_ROWS, "gemv_rows_split_sum",
                       g.mr_sum_threads, targs=(mt, s),
                       tunables=("kMrSplitSub", "kMrSumThreads", "kVerifyRows")),
        )  # fmt: skip
    return specs


def decode_specs(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """The decode step's kernels (and the token-parallel ones the prefill shares)."""
    gemv = tuple(
        KernelSpec(
            f"gemv_{kind}",
            GEMV,
            "gemv_int4",
            gemv_form(k, g).threads,
            gemv_form(k, g).smem,
            targs=(k, norm, int(epi)),
            tunables=_GV_TUNABLES,
        )
        for kind, (k, _, norm, epi) in gemv_shapes(config).items()
    )
    misc, misc_tunables = g.misc_threads, ("kMiscThreads",)
    attn_smem = attn_smem_bytes(config, g)
    return gemv + (
        KernelSpec("embed", MISC, "embed_gather", misc, tunables=misc_tunables),
        KernelSpec("rmsnorm", MISC, "rmsnorm_rows", misc, tunables=("kMiscThreads", "kNormRows")),
        KernelSpec("rope_kv", MISC, "rope_kv_write", misc, tunables=("kMiscThreads", "kKParts")),
        KernelSpec("lm_head", MISC, "lm_head_argmax", g.lm_warps * 32,
                   lm_head_smem_bytes(config, g), tunables=("kLmWarps", "kLmMaxSlots")),
        KernelSpec("lm_head_q8", MISC, "lm_head_argmax_q8", g.lm_warps * 32,
                   lm_head_smem_bytes(config, g, int8=True),
                   tunables=("kLmWarps", "kLmQ8MaxSlots")),
        KernelSpec("sample", MISC, "sample_finish", g.sample_threads,
                   tunables=("kSampleThreads", "kSampleCandidates")),
        KernelSpec("attention", ATTENTION, "attn_decode", g.attn_threads, attn_smem,
                   targs=(False,), tunables=_ATTN_TUNABLES),
    )  # fmt: skip


def batch_specs(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """The batched decode step's own kernels (engine/batch.py; its GEMVs are rows_specs', its
    lm_head verify_specs'): attention over B sequences of one token each (attn_decode<true>)
    and the per-row sampler (decode_misc.cu's sample_batch)."""
    attn_smem = attn_smem_bytes(config, g)
    return (
        KernelSpec("attention_batch", ATTENTION, "attn_decode", g.attn_threads, attn_smem,
                   targs=(True,), tunables=_ATTN_TUNABLES),
        KernelSpec("sample_batch", MISC, "sample_batch", g.sample_threads,
                   tunables=("kSampleThreads", "kSampleCandidates")),
    )  # fmt: skip


def verify_specs(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """The multi-row step's own kernels (speculative decoding verifies M = 1..verify_rows rows
    of one sequence): attention with the causal mask inside the block (its short and long
    forms: clusters of mattn_cluster and of mattn_long_cluster CTAs), and lm_head + argmax."""
    return (
        KernelSpec("attention_rows", ATTENTION_ROWS, "attn_rows", g.mattn_threads,
                   mattn_smem_bytes(config, g.mattn_cluster, g), targs=(g.mattn_cluster,),
                   tunables=_MATTN_TUNABLES),
        KernelSpec("attention_rows_long", ATTENTION_ROWS, "attn_rows", g.mattn_threads,
                   mattn_smem_bytes(config, g.mattn_long_cluster, g),
                   targs=(g.mattn_long_cluster,), tunables=_MATTN_TUNABLES),
        KernelSpec("lm_head_rows", LM_HEAD_ROWS, "lm_head_rows", g.lmr_threads, g.lmr_smem,
                   tunables=_LMR_TUNABLES),
    )  # fmt: skip


# Histories below 2^27 tokens: draft_ngram's 32-bit key min(limit, len - e) * len + j stays
# below 2^32 at K <= verify_rows - 1 <= 15.
MAX_HISTORY = 1 << 27


def speculate_specs(g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """The speculative step's drafting and acceptance kernels (speculate.cu): greedy
    generations accept with accept_greedy, sampled ones with sample_rows + accept_sampled."""
    return (
        KernelSpec("draft_ngram", SPECULATE, "draft_ngram", g.draft_threads,
                   tunables=("kDraftThreads", "kDraftLoads", "kVerifyRows")),
        KernelSpec("accept_greedy", SPECULATE, "accept_greedy", 32, tunables=("kVerifyRows",)),
        KernelSpec("sample_rows", SPECULATE, "sample_rows", g.sample_threads,
                   tunables=("kSampleThreads", "kSampleCandidates")),
        KernelSpec("accept_sampled", SPECULATE, "accept_sampled", 32, tunables=("kVerifyRows",)),
    )  # fmt: skip


def prefill_specs(
    config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY, tiles: tuple = GEMM_TILES
) -> tuple[KernelSpec, ...]:
    """The prefill's tensor-core kernels: one GEMM spec per tile, then attention and the merge
    of its key splits."""
    gemms = tuple(
        KernelSpec(f"gemm_{t.tokens}x{t.stages}{'_swiglu' if t.swiglu else ''}", PREFILL_GEMM,
                   "prefill_gemm_wgmma", g.prefill_threads, gemm_smem_bytes(t, g),
                   targs=(t.tokens, t.stages, t.swiglu),
                   tunables=("kPrefillKTile", "kPrefillRows", "kPrefillThreads"), tile=t)
        for t in tiles
    )  # fmt: skip
    attention = KernelSpec(
        "prefill_attention", PREFILL_ATTENTION, "prefill_attention", g.prefill_attn_threads,
        prefill_attention_smem_bytes(config.head_dim, g),
        targs=(config.head_dim, config.num_heads, config.num_kv_heads),
        tunables=("kPrefillAttnTile", "kPrefillAttnThreads", "kPrefillMergeThreads", "kKParts"),
    )  # fmt: skip
    merge = KernelSpec(
        "prefill_attention_merge", PREFILL_ATTENTION, "prefill_attention_merge",
        g.prefill_merge_threads, 0, targs=(config.head_dim, config.num_heads),
        tunables=("kPrefillAttnTile", "kPrefillMergeThreads"),
    )  # fmt: skip
    return (*gemms, attention, merge)


def kernel_table(config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> tuple[KernelSpec, ...]:
    """Every kernel of the engine for `config`: the decode step's, the multi-row step's (M-row
    GEMVs, down_proj split over K, attention, lm_head), the batched step's, speculation's
    drafting and acceptance, then the prefill's."""
    return (
        decode_specs(config, g)
        + rows_specs(config, g)
        + rows_split_specs(config, g)
        + verify_specs(config, g)
        + batch_specs(config, g)
        + speculate_specs(g)
        + prefill_specs(config, g)
    )


def sources(specs) -> dict[str, list[str]]:
    """{source file: the name expressions to compile from it}, in table order."""
    out: dict[str, list[str]] = {}
    for s in specs:
        names = out.setdefault(s.source, [])
        if s.expression not in names:
            names.append(s.expression)
    return out


def compile_specs(specs, config: ModelConfig, g: Geometry = DEFAULT_GEOMETRY) -> dict:
    """{source file: jit.Compiled} for `specs`: one NVRTC module per source (no GPU needed)."""
    from . import jit

    text = header(config, g)
    return {src: jit.compile_module(src, names, text) for src, names in sources(specs).items()}
