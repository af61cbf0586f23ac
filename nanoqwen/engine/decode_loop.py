"""The generation loop: the decode state on the device, the host ring, and the one graph that
runs a whole generation.

A generation is ONE graph launch: a conditional while node whose body is the decode step and
the sampler. The decode state (DecodeState: token, position, step, stop rules; int32 words
in device memory, registry.StateWord) is advanced by sample_finish, which also writes each
token to a ring in mapped host memory and sets the loop's condition. The host only reads the
ring to stream tokens; the next step never waits on it.

Mapped pinned host memory (HostRing), int32 words:

    [0]            cancel: the host sets it; the sampler ends the loop after its token
    [1]            count: tokens written so far (the kernel's host_ring[-1])
    [2 : 2 + C]    ring: token i at [2 + i]          (C = max_context)
    [2 + C : ...]  staging: the decode state words, then the prompt ids (C words), then the
                   page table (KV positions / 16 words, rounded up); copied to the device
                   asynchronously, so a generation's inputs reach the GPU without a host sync

The sampler writes the token before the count, with a system fence between them, so a count
the host reads names tokens already there.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..config import PAGE_TOKENS
from ..cuda.decode import DecodeKernels
from ..cuda.device import Gpu
from ..cuda.registry import MAX_EOS, STATE_WORDS, StateWord
from ..sampling import SamplingParams

POLL_S = 20e-6  # host ring poll interval while a generation graph runs


def _f32_bits(v: float) -> int:
    return int(np.float32(v).view(np.int32))


def _u32_as_i32(v: int) -> int:
    return int(np.uint32(v).view(np.int32))


@dataclass
class DecodeState:
    """The decode state words, by name. `eos`: the stop ids the device checks (at most
    MAX_EOS; the host stops on the others). spec_skip, spec_fails: speculation's backoff
    (speculative.Backoff), 0 at a generation's start."""

    token: int = 0
    pos: int = 0
    step: int = 0
    max_new: int = 0
    done: bool = False
    top_k: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos: tuple[int, ...] = ()
    spec_skip: int = 0
    spec_fails: int = 0

    @classmethod
    def for_prompt(cls, prompt_len: int, params: SamplingParams, stop_ids) -> DecodeState:
        """The state the first sample (after the prompt's prefill) starts from: position
        prompt_len - 1, params' sampling rules, a fresh seed when params has none."""
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy)
        return cls(
            pos=prompt_len - 1,
            max_new=params.max_tokens,
            top_k=params.top_k,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed & ((1 << 64) - 1),
            eos=tuple(sorted(stop_ids)[:MAX_EOS]),
        )

    def to_words(self, out: np.ndarray | None = None) -> np.ndarray:
        """int32 [STATE_WORDS] (written into `out` when given)."""
        if len(self.eos) > MAX_EOS:
            raise ValueError(f"at most {MAX_EOS} stop ids on the device, got {len(self.eos)}")
        w = np.zeros(STATE_WORDS, np.int32) if out is None else out
        w[:] = 0
        w[StateWord.TOKEN], w[StateWord.POS], w[StateWord.STEP] = self.token, self.pos, self.step
        w[StateWord.MAX_NEW], w[StateWord.DONE] = self.max_new, int(self.done)
        w[StateWord.TOP_K] = self.top_k
        w[StateWord.TEMP] = _f32_bits(self.temperature)
        w[StateWord.TOP_P] = _f32_bits(self.top_p)
        w[StateWord.SEED_LO] = _u32_as_i32(self.seed & 0xFFFFFFFF)
        w[StateWord.SEED_HI] = _u32_as_i32((self.seed >> 32) & 0xFFFFFFFF)
        w[StateWord.SPEC_SKIP], w[StateWord.SPEC_FAILS] = self.spec_skip, self.spec_fails
        w[StateWord.NUM_EOS] = len(self.eos)
        w[StateWord.EOS0 : StateWord.EOS0 + len(self.eos)] = self.eos
        return w

    @classmethod
    def from_words(cls, w: np.ndarray) -> DecodeState:
        n = int(w[StateWord.NUM_EOS])
        bits = np.asarray(w, np.int32)
        return cls(
            token=int(w[StateWord.TOKEN]),
            pos=int(w[StateWord.POS]),
            step=int(w[StateWord.STEP]),
            max_new=int(w[StateWord.MAX_NEW]),
            done=bool(w[StateWord.DONE]),
            top_k=int(w[StateWord.TOP_K]),
            temperature=float(bits[StateWord.TEMP : StateWord.TEMP + 1].view(np.float32)[0]),
            top_p=float(bits[StateWord.TOP_P : StateWord.TOP_P + 1].view(np.float32)[0]),
            seed=int(np.uint32(w[StateWord.SEED_LO])) | int(np.uint32(w[StateWord.SEED_HI])) << 32,
            eos=tuple(int(t) for t in w[StateWord.EOS0 : StateWord.EOS0 + n]),
            spec_skip=int(w[StateWord.SPEC_SKIP]),
            spec_fails=int(w[StateWord.SPEC_FAILS]),
        )


class HostRing:
    """The mapped pinned host memory of one engine (layout: the module docstring)."""

    def __init__(self, gpu: Gpu, max_context: int, kv_positions: int = 0) -> None:
        n = max_context + 2
        pages = -(-max(kv_positions, max_context) // PAGE_TOKENS)
        total = n + STATE_WORDS + max_context + pages
        host, dev = gpu.alloc_mapped(total * 4)  # freed with the Gpu
        words = np.ctypeslib.as_array((ctypes.c_int32 * total).from_address(host))
        self.view, self.staging = words[:n], words[n:]
        self.staging_ptr = host + 4 * n  # host address of staging[0]
        self.cancel_ptr, self.ring_ptr = dev, dev + 8  # device addresses: word 0, word 2

    def reset(self) -> None:
        self.view[:] = 0

    def cancel(self) -> None:
        self.view[0] = 1

    @property
    def count(self) -> int:
        return int(self.view[1])

    def token(self, i: int) -> int:
        return int(self.view[2 + i])

    def tokens(self, n: int) -> list[int]:
        """Tokens 0 .. n - 1 of the ring."""
        return self.view[2 : 2 + n].tolist()


def loop_buffers(max_context: int) -> dict[str, int]:
    """Bytes of DecodeLoop's device buffers: the state int32 [STATE_WORDS], the token ring
    int32 [max_context] (the host ring is mapped host memory)."""
    return {"state": STATE_WORDS * 4, "ring": max_context * 4}


class DecodeLoop:
    """The decode state and token ring on the device, the host ring, the sampler launch and
    the generation graph. Every entry point of the engine ends on a stream sync, so no
    asynchronous copy out of the staging area is pending when the next one writes it."""

    def __init__(
        self, gpu: Gpu, kernels: DecodeKernels, max_context: int, kv_positions: int = 0
    ) -> None:
        """kv_positions: the KV pool's positions when more than max_context (the page table
        staging words cover them)."""
        self.gpu, self.kernels = gpu, kernels
        sizes = loop_buffers(max_context)
        self.state = gpu.alloc(sizes["state"], "decode state").ptr
        self.ring = gpu.alloc(sizes["ring"], "token ring").ptr
        self.host = HostRing(gpu, max_context, kv_positions)
        self._pages_at = STATE_WORDS + max_context  # the page table's staging words
        self._graph = None

    def word(self, w: StateWord) -> int:
        """Device address of one state word (the kernels read the token and position there)."""
        return self.state + 4 * int(w)

    def set_state(self, state: DecodeState) -> None:
        """Upload `state` (synchronous)."""
        self.gpu.upload(self.state, state.to_words())

    def begin(self, state: DecodeState) -> None:
        """A generation's state through the staging area (queued, no sync); ring cleared."""
        state.to_words(self.host.staging[:STATE_WORDS])
        self.gpu.upload_async(self.state, self.host.staging_ptr, 4 * STATE_WORDS)
        self.host.reset()

    def stage_ids(self, ids: np.ndarray, dst: int) -> None:
        """Queue a copy of the prompt ids to device address `dst` through the staging area."""
        self.host.staging[STATE_WORDS : STATE_WORDS + len(ids)] = ids
        self.gpu.upload_async(dst, self.host.staging_ptr + 4 * STATE_WORDS, 4 * len(ids))

    def stage_pages(self, pages: list[int], dst: int) -> None:
        """Queue a copy of a page table (page ids, as int32) to device address `dst` through
        the staging area."""
        at = self._pages_at
        self.host.staging[at : at + len(pages)] = pages
        self.gpu.upload_async(dst, self.host.staging_ptr + 4 * at, 4 * len(pages))

    def sample(self, logits: int, key: int, stream=None, cond=0, ring: int = 0) -> None:
        """The sampler over `logits` (and lm_head's argmax `key`), advancing the state; the
        token goes to the device ring `ring` (default: the loop's) at [step]."""
        h = self.host
        self.kernels.sample(logits, key, self.state, ring or self.ring, h.ring_ptr, h.cancel_ptr,
                            cond,
                            stream=stream)  # fmt: skip

    def capture(self, body):
        """A generation graph, uploaded: a while loop whose body is body(builder, cond) (the
        step, ending on the kernel that clears the condition when done)."""
        with self.gpu.guard("build the generation graph"):
            gb = self.gpu.graph_builder()
            cond = gb.create_condition(default_value=1)
            loop = gb.while_loop(cond).begin_building()
            body(loop, cond)
            loop.end_building()
            graph = gb.end_building().complete()
            graph.upload(self.gpu.stream)
        return graph

    def build(self, body) -> None:
        """Capture the plain generation graph once (capture: the decode step and the sampler,
        which clears the condition when done)."""
        if self._graph is None:
            self._graph = self.capture(body)

    def launch(self) -> None:
        """Run the plain generation graph from the current state (queued)."""
        self._graph.launch(self.gpu.stream)

    def stream_tokens(self, max_tokens: int, stop_ids) -> Iterator[int]:
        """Tokens 1.. of a running generation graph as the sampler writes them; returns at a
        stop id, at max_tokens, or when the graph has stopped."""
        seen, host = 1, self.host
        while True:
            count = host.count
            while seen < count:
                token = host.token(seen)
                seen += 1
                yield token
                if token in stop_ids or seen >= max_tokens:
                    return
            if self.gpu.stream_idle("decode graph") and host.count == seen:
                return  # the graph stopped (eos within the device's list, or cancelled)
            time.sleep(POLL_S)
