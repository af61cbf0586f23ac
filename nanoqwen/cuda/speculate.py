"""Launchers of speculate.cu: the drafting and acceptance ends of a speculative decode step, on
the device (no host round trip a step; nanoqwen.speculative states the rules).

`SpeculateKernels(gpu, config, spec, capacity)` builds registry.speculate_specs for one
SpeculativeConfig (K, n_min, n_max and the backoff's cap and grace are launch arguments,
fixed when a graph captures them) and
one history capacity. Every pointer is a device address (int); every method takes `stream` (a
cuda.core Stream or a GraphBuilder being built; default: the Gpu's stream). A step ends on
`accept` (greedy: the rows' argmax) or on `sample_rows` + `accept_sampled` (speculative
sampling against each row's sampling distribution); engine/speculate.py picks by the
generation's parameters.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import NanoqwenError
from ..speculative import SpeculativeConfig
from . import registry
from .device import Gpu
from .launcher import Launcher

_I32 = np.int32
HISTORY_ALIGN = 16  # bytes: draft_ngram reads the history as 16-byte vectors


def _cond_arg(cond):
    """A graph condition as a kernel argument: the GraphCondition itself, or a null handle."""
    return cond if cond is not None and not isinstance(cond, int) else np.uint64(cond or 0)


def check_capacity(capacity: int) -> int:
    """The history's words: a multiple of 4 (draft_ngram's 16-byte loads stay inside), below
    registry.MAX_HISTORY (its 32-bit key)."""
    if capacity < 4 or capacity % 4 or capacity >= registry.MAX_HISTORY:
        raise NanoqwenError(
            f"speculation history capacity must be a multiple of 4 in [4, "
            f"{registry.MAX_HISTORY}), got {capacity}"
        )
    return capacity


class SpeculateKernels(Launcher):
    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        spec: SpeculativeConfig,
        capacity: int,
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        *,
        pdl: bool = True,
    ) -> None:
        super().__init__(gpu, config, registry.speculate_specs(geometry), geometry, pdl=pdl)
        self.spec, self.capacity = spec, check_capacity(capacity)
        for kernel in self.kernels.values():  # the decode step's one carveout (DecodeKernels)
            gpu.set_smem_carveout(kernel, self.geometry.smem_carveout)

    def _tail(self) -> tuple:
        """The accept kernels' last arguments: K, backoff_cap, backoff_grace."""
        s = self.spec
        return _I32(s.k), _I32(s.backoff_cap), _I32(s.backoff_grace)

    def draft(self, h: int, state: int, tokens: int, positions: int, ndraft: int,
              stats: int = 0, branch=0, long_pages: int = registry.MATTN_NEVER_LONG,
              stream=None) -> None:  # fmt: skip
        """The step's input rows from an n-gram lookup in the history (speculative.draft with
        speculative.step_limit's cap, from the state words), through the backoff
        (speculative.Backoff.gate).

        h          int32 [capacity] the history, h[0 .. POS] valid (len = state[POS] + 1),
                   16-byte aligned
        state      int32 [registry.STATE_WORDS]: reads POS, STEP, MAX_NEW; SPEC_SKIP
                   decremented when the backoff drops the found drafts
        tokens     int32 [1 + K] out: h[len - 1], the d drafts, h[len - 1] in the other rows
        positions  int32 [1 + K] out: state[POS] + r for row r
        ndraft     int32 [1]     out: d (0 when dropped)
        stats      int32 [4] (or 0): stats[3] (skipped) += 1 when the backoff drops drafts
        branch     a GraphCondition (or 0) set to the step's registry.StepCase: the engine's
                   loop body (a switch) runs the decode step (no drafts) or the verify step,
                   with attention_rows' long form from long_pages pages of its 1 + K rows on
                   (VerifyKernels.long_pages)
        """
        if h % HISTORY_ALIGN:
            raise NanoqwenError(f"draft_ngram: history address {h:#x} is not 16-byte aligned")
        s = self.spec
        self.launch("draft_ngram", (1, 1, 1), h, state, tokens, positions, ndraft, stats,
                    _I32(s.k), _I32(s.n_min), _I32(s.n_max), _I32(self.capacity),
                    _I32(long_pages), _cond_arg(branch), stream=stream,
                    nbytes=4 * self.capacity)  # fmt: skip

    def accept(self, keys: int, tokens: int, ndraft: int, state: int, h: int, host_ring: int,
               cancel: int, stats: int, cond, stream=None) -> None:  # fmt: skip
        """Keep the agreeing drafts and the model's next token (speculative.accept, greedy),
        cut at an eos id and at max_new; append them to h and the host ring; advance the state
        and the backoff words (speculative.Backoff.update: spec.backoff_cap, backoff_grace).

        keys       uint64 [1 + K] lm_head_rows' argmax key per row (re-zeroed)
        tokens     int32 [1 + K] draft's rows; ndraft int32 [1] d
        state      int32 [registry.STATE_WORDS]: TOKEN, POS, STEP, DONE advanced,
                   SPEC_SKIP and SPEC_FAILS updated
        h          int32 [capacity] the history: h[POS + 1 + t] = emitted token t
        host_ring  int32* mapped host memory (or 0): host_ring[step + t] = token t, then
                   host_ring[-1] = the count (decode_loop.HostRing)
        cancel     int32* mapped host flag (or 0): nonzero stops after this step
        stats      int32 [4] (or 0): += steps 1, drafted d, accepted (before the cuts);
                   [3] (skipped) is draft's
        cond       the generation while loop's GraphCondition (or 0): set to "not done"
        """
        self.launch("accept_greedy", (1, 1, 1), keys, tokens, ndraft, state, h, host_ring,
                    cancel, stats, _cond_arg(cond), *self._tail(), stream=stream)  # fmt: skip

    def sample_rows(self, logits: int, logits0: int, keys: int, tokens: int, ndraft: int,
                    state: int, picks: int, stream=None) -> None:  # fmt: skip
        """Each row's acceptance test and draw (speculative.accept, sampled; speculate.cu's
        sample_rows has the rule and the random counters). Grid 1 + K, rows past d idle.

        logits     fp32 [1 + K, V] the verify step's logits
        logits0    fp32 [V]      the decode step's logits: row 0 of a step without drafts
        keys       uint64 [1 + K] each row's argmax key (read, not re-zeroed)
        tokens     int32 [1 + K] draft's rows; ndraft int32 [1] d
        state      int32 [registry.STATE_WORDS]: reads STEP and the sampling words
        picks      int32 [1 + K] out, rows 0 .. d: -1 (draft accepted) or the row's token
        """
        for name, ptr in (("logits", logits), ("logits0", logits0), ("picks", picks)):
            if not ptr or ptr % 4:
                raise NanoqwenError(f"sample_rows: {name} address {ptr:#x} is null or unaligned")
        v = self.config.vocab_size  # nbytes: at least one row's logits are read
        self.launch("sample_rows", (1 + self.spec.k, 1, 1), logits, logits0, keys, tokens,
                    ndraft, state, picks, _I32(v), stream=stream, nbytes=4 * v)  # fmt: skip

    def accept_sampled(self, keys: int, tokens: int, ndraft: int, picks: int, state: int,
                       h: int, host_ring: int, cancel: int, stats: int, cond,
                       stream=None) -> None:  # fmt: skip
        """The step's tokens from sample_rows' picks: the accepted drafts and the first
        row's pick; then what `accept` does with them (h, host ring, state, stats, cond;
        the same arguments), keys re-zeroed. picks: int32 [1 + K] sample_rows' output."""
        self.launch("accept_sampled", (1, 1, 1), keys, tokens, ndraft, picks, state, h,
                    host_ring, cancel, stats, _cond_arg(cond), *self._tail(),
                    stream=stream)  # fmt: skip
